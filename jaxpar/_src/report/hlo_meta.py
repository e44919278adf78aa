"""The op metadata of a compiled HLO module: which plan node and source line made an instruction.

JAX writes every instruction's origin into its ``metadata``: ``op_name`` (the name stack, e.g.
``jit(step)/jaxpar#342/transpose(jvp())/dot_general``) and ``stack_frame_id``, an index into the
module's ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables (older
printers wrote ``source_file`` / ``source_line`` instead).  jaxpar lowers every plan node inside
the name scope ``jaxpar#<node id>`` (``lower.node_scope``), and the SPMD partitioner copies the
metadata of the instruction it partitions onto the collectives it inserts; XLA's combiners join
the names of what they merge (``(jaxpar#1/...:jaxpar#7/...)``).  So a collective names the plan
nodes that caused it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Iterable

_INSTR_ALL_RE = re.compile(r"^[ \t]*(?:ROOT[ \t]+)?%?([\w.\-]+)[ \t]*=[ \t]*(.*)$", re.M)
_TABLES_RE = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n((?:\d+ .*\n?)*)",
                        re.M)
_META_RE = re.compile(r"metadata=\{([^}]*)\}")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID_RE = re.compile(r"stack_frame_id=(\d+)")
_SRC_FILE_RE = re.compile(r'source_file="((?:[^"\\]|\\.)*)"')
_SRC_LINE_RE = re.compile(r"source_line=(\d+)")
_TAG_RE = re.compile(r"jaxpar#(\d+)")
_OPCODE_RE = re.compile(r"^(?:\(.*?\)|\S+)\s+([\w\-]+)\(")
_TABLE_HEADERS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_LOCATION_RE = re.compile(r"file_name_id=(\d+)\s+function_name_id=(\d+)\s+line=(\d+)")
_FRAME_RE = re.compile(r"file_location_id=(\d+)\s+parent_frame_id=(\d+)")


@dataclasses.dataclass(frozen=True)
class Frame:
    """One Python frame: file, line, qualified function name (``Block.__call__``)."""

    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line} ({self.function})"


@dataclasses.dataclass(frozen=True)
class OpMetadata:
    """Where one instruction came from."""

    op_name: str
    frames: tuple[Frame, ...]  # innermost first

    @property
    def tags(self) -> tuple[int, ...]:
        """The plan nodes named in ``op_name``, in order, without repeats."""
        return tuple(dict.fromkeys(int(t) for t in _TAG_RE.findall(self.op_name)))

    @property
    def primitive(self) -> str:
        """The last name-stack component: the JAX primitive (``dot_general``)."""
        return self.op_name.rstrip(")").rsplit("/", 1)[-1]


class HloIndex:
    """Instruction metadata and operands of one HLO module's text, looked up by name.

    >>> text = '''HloModule m
    ... ENTRY %main (p: f32[4]) -> f32[4] {
    ...   %p = f32[4]{0} parameter(0), metadata={op_name="x"}
    ...   ROOT %all-reduce = f32[4]{0} all-reduce(%p), metadata={op_name="jit(f)/jaxpar#7/add"}
    ... }'''
    >>> index = HloIndex(text)
    >>> index.metadata("all-reduce").tags, index.operands("all-reduce")
    ((7,), ('p',))
    """

    def __init__(self, text: str) -> None:
        # One pass of a multi-line pattern: much faster than a Python loop over the lines.
        self._lines: dict[str, str] = {}
        for m in _INSTR_ALL_RE.finditer(text):
            self._lines.setdefault(m.group(1), m.group(2))
        tables = {m.group(1): m.group(2).splitlines() for m in _TABLES_RE.finditer(text)}
        self._frames = _FrameTable({h: tables.get(h, []) for h in _TABLE_HEADERS})
        self._cache: dict[str, OpMetadata | None] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._lines

    def metadata(self, name: str) -> OpMetadata | None:
        """The metadata of instruction ``name``, or ``None`` when it has none."""
        if name in self._cache:
            return self._cache[name]
        rest = self._lines.get(name)
        found = None
        m = _META_RE.search(rest) if rest is not None else None
        if m is not None:
            body = m.group(1)
            op = _OP_NAME_RE.search(body)
            frames: tuple[Frame, ...] = ()
            fid = _FRAME_ID_RE.search(body)
            if fid is not None:
                frames = self._frames.chain(int(fid.group(1)))
            else:
                f, ln = _SRC_FILE_RE.search(body), _SRC_LINE_RE.search(body)
                if f is not None and ln is not None:
                    frames = (Frame(f.group(1), int(ln.group(1)), "?"),)
            found = OpMetadata(op.group(1) if op else "", frames)
        self._cache[name] = found
        return found

    def opcode(self, name: str) -> str:
        rest = self._lines.get(name, "")
        m = _OPCODE_RE.match(rest)
        return m.group(1) if m else ""

    def operands(self, name: str) -> tuple[str, ...]:
        """Names of the instruction's operands (``%a, %b`` inside its first parentheses)."""
        rest = self._lines.get(name)
        if rest is None:
            return ()
        m = _OPCODE_RE.match(rest)
        if m is None:
            return ()
        start = m.end()
        depth, end = 1, start
        while end < len(rest) and depth:
            depth += {"(": 1, ")": -1}.get(rest[end], 0)
            end += 1
        return tuple(re.findall(r"%([\w.\-]+)", rest[start:end - 1]))

    def tags(self, name: str, depth: int = 2) -> tuple[int, ...]:
        """Plan nodes behind instruction ``name``: its own ``jaxpar#`` tags; when a pass left it
        without any op name, its operands' (up to ``depth`` instructions back)."""
        meta = self.metadata(name)
        if meta is not None and meta.op_name:
            return meta.tags
        if depth <= 0:
            return ()
        found: list[int] = []
        for op in self.operands(name):
            found.extend(self.tags(op, depth - 1))
        return tuple(dict.fromkeys(found))


    def node_metadata(self) -> dict[int, OpMetadata]:
        """Per plan node, the metadata of the first instruction that names it alone."""
        out: dict[int, OpMetadata] = {}
        for name, rest in self._lines.items():
            if "jaxpar#" not in rest:
                continue
            meta = self.metadata(name)
            if meta is not None and len(meta.tags) == 1 and meta.tags[0] not in out:
                out[meta.tags[0]] = meta
        return out


@functools.lru_cache(maxsize=4096)
def short_path(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return rel if not rel.startswith("..") else path


class _FrameTable:
    """The module's stack-frame tables, resolved into chains of :class:`Frame`."""

    def __init__(self, tables: dict[str, list[str]]) -> None:
        self.files = _strings(tables["FileNames"])
        self.functions = _strings(tables["FunctionNames"])
        self.locations: dict[int, tuple[int, int, int]] = {}
        for row in tables["FileLocations"]:
            m = _LOCATION_RE.search(row)
            if m is not None:
                self.locations[_row_id(row)] = (int(m.group(1)), int(m.group(2)),
                                                int(m.group(3)))
        self.parents: dict[int, tuple[int, int]] = {}
        for row in tables["StackFrames"]:
            m = _FRAME_RE.search(row)
            if m is not None:
                self.parents[_row_id(row)] = (int(m.group(1)), int(m.group(2)))
        # XLA prints a frame's parent one past its index (0 = none), so the outermost frame
        # names itself; a printer that writes the index itself never does.
        self.offset = 1 if any(p == i for i, (_, p) in self.parents.items()) else 0
        self._chains: dict[int, tuple[Frame, ...]] = {}

    def chain(self, frame_id: int) -> tuple[Frame, ...]:
        """The frames from ``frame_id`` outwards (innermost first)."""
        if frame_id in self._chains:
            return self._chains[frame_id]
        out: list[Frame] = []
        seen: set[int] = set()
        fid = frame_id
        while fid in self.parents and fid not in seen:
            seen.add(fid)
            loc_id, parent = self.parents[fid]
            loc = self.locations.get(loc_id)
            if loc is not None:
                out.append(Frame(self.files.get(loc[0], "?"), loc[2],
                                 self.functions.get(loc[1], "?")))
            fid = parent - self.offset
        chain = self._chains[frame_id] = tuple(out)
        return chain


def _row_id(row: str) -> int:
    return int(row.split(None, 1)[0])


def _strings(rows: Iterable[str]) -> dict[int, str]:
    out = {}
    for row in rows:
        ident, _, value = row.partition(" ")
        out[int(ident)] = value.strip().strip('"')
    return out
