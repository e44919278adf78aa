"""Reading collectives out of a compiled (SPMD-partitioned) HLO module.

Handles what XLA prints today: the three replica-group formats (explicit ``{{0,1},{2,3}}``, iota
``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` and mesh axes ``mesh['a'=2,'b'=4] {'b'}`` with sub-axes
``'a':(1)2`` and ``device_ids=...``), asynchronous ``*-start``/``*-done`` pairs (counted once, at
the start), combined collectives with tuple results, and loops: a collective inside a ``while``
body runs ``known_trip_count`` times per call.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "collective-broadcast", "ragged-all-to-all")
_BYTES = {"pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2,
          "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8, "c64": 8, "c128": 16, "token": 0}
_OP_RE = re.compile(r"=\s*(?P<type>.*?)\s(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=")
_HEADER_RE = re.compile(r"^(?P<entry>ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\{\s*$")
_ARRAY_RE = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+\w*)?)\[([\d,]*)\]")
_CALLS_RE = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|"
                       r"false_computation)=%?([\w.\-]+)")
_BRANCHES_RE = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_RE = re.compile(r'known_trip_count"?\s*:\s*\{\s*"?n"?\s*:\s*"?(\d+)')
_NUM_PARTITIONS_RE = re.compile(r"num_partitions=(\d+)")


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective instruction of the compiled program.

    ``nbytes`` is the payload on one device (all-reduce and all-to-all: the buffer; all-gather:
    the gathered result; reduce-scatter: the input); ``count`` is how many times it runs per
    call of the program (loop trip counts).  ``axes`` names the mesh axes of its groups when a
    mesh was given.

    >>> import jax.numpy as jnp, jaxpar
    >>> f = jaxpar.parallelize(lambda x: x.sum(), mesh=jaxpar.make_mesh((8,), ("d",)),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=((8,),))
    >>> record = jaxpar.inspect.collectives(f.lower(jnp.ones(64)))[0]
    >>> record.kind, record.group_size, record.nbytes, record.wire_bytes
    ('all-reduce', 8, 4.0, 7.0)
    """

    kind: str
    name: str
    computation: str
    shapes: tuple[str, ...]
    nbytes: float
    group_size: int
    replica_groups: tuple[tuple[int, ...], ...]
    count: int = 1
    axes: tuple[str, ...] | None = None

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution (ring algorithms)."""
        n = self.group_size
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2.0 * (n - 1) / n * self.nbytes
        if self.kind in ("collective-permute", "collective-broadcast"):
            return float(self.nbytes)
        return (n - 1) / n * self.nbytes


class Collectives(tuple):
    """The collectives of a program: a tuple of :class:`CollectiveRecord` with summaries.

    >>> import jax.numpy as jnp, jaxpar
    >>> f = jaxpar.parallelize(lambda x: x.sum(), mesh=jaxpar.make_mesh((8,), ("d",)),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=((8,),))
    >>> colls = jaxpar.inspect.collectives(f.lower(jnp.ones(64)))
    >>> colls.count("all-reduce"), colls.total_bytes("all-reduce"), len(colls.of("all-gather"))
    (1, 4.0, 0)
    """

    def of(self, kind: str) -> Collectives:
        return Collectives(r for r in self if r.kind == kind)

    def count(self, kind: str | None = None) -> int:
        """How many collectives run per call (loop trip counts included)."""
        return sum(r.count for r in self if kind is None or r.kind == kind)

    def static_count(self, kind: str | None = None) -> int:
        """How many collective instructions the program text has."""
        return sum(1 for r in self if kind is None or r.kind == kind)

    def total_bytes(self, kind: str | None = None) -> float:
        """Payload bytes per device summed over executions."""
        return sum(r.nbytes * r.count for r in self if kind is None or r.kind == kind)

    def wire_bytes(self, kind: str | None = None) -> float:
        return sum(r.wire_bytes * r.count for r in self if kind is None or r.kind == kind)

    def by_kind(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for r in self:
            row = out.setdefault(r.kind, {"count": 0, "bytes": 0.0, "wire_bytes": 0.0})
            row["count"] += r.count
            row["bytes"] += r.nbytes * r.count
            row["wire_bytes"] += r.wire_bytes * r.count
        return out

    def table(self) -> str:
        """A readable listing, one line per collective instruction."""
        if not self:
            return "no collectives"
        lines = [f"{'kind':<20}{'count':>6}  {'group':>5}  {'axes':<10}{'bytes/device':>14}"
                 "  shapes"]
        for r in self:
            axes = "+".join(r.axes) if r.axes else "?" if r.axes is None else "-"
            lines.append(f"{r.kind:<20}{r.count:>6}  {r.group_size:>5}  {axes:<10}"
                         f"{_fmt(r.nbytes):>14}  {' '.join(r.shapes)}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Collectives({list(self)})"


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


# -- parsing ------------------------------------------------------------------------------------
def parse_collectives(text: str, mesh: Any = None) -> Collectives:
    """All collectives of the HLO module ``text``; see the module docstring."""
    computations, entry = _split_computations(text)
    m = _NUM_PARTITIONS_RE.search(text)
    num_devices = int(m.group(1)) if m else None
    mult = _multiplicities(computations, entry)
    labeler = _AxisLabeler(mesh) if mesh is not None else None
    out = []
    for comp, lines in computations.items():
        times = mult.get(comp, 0)
        if times == 0:
            continue
        for line in lines:
            rec = _parse_line(line, comp, times, num_devices)
            if rec is not None:
                if labeler is not None:
                    rec = dataclasses.replace(rec, axes=labeler.label(rec.replica_groups))
                out.append(rec)
    return Collectives(out)


def _split_computations(text: str) -> tuple[dict[str, list[str]], str | None]:
    comps: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in text.splitlines():
        # instructions are indented; only the rest can open a computation
        header = None if line[:1] in (" ", "\t") else _HEADER_RE.match(line)
        if header and "=" not in line.split("(")[0]:
            current = header.group("name")
            comps[current] = []
            if header.group("entry"):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        if current is not None:
            comps[current].append(line)
    return comps, entry


def _multiplicities(comps: dict[str, list[str]], entry: str | None) -> dict[str, int]:
    """How many times each computation runs per program call."""
    if entry is None:  # no ENTRY marker: count every computation once
        return {c: 1 for c in comps}
    mult: dict[str, int] = {}
    calls: dict[str, list[tuple[str, int]]] = {}  # computation -> (callee, trips) per call

    def callees(comp: str) -> list[tuple[str, int]]:
        # Read each computation's calls once: fusions are called from many places.
        if comp in calls:
            return calls[comp]
        out = calls[comp] = []
        for line in comps[comp]:
            trip = 1
            if " while(" in line:
                t = _TRIP_RE.search(line)
                trip = int(t.group(1)) if t else 1
            if not ("calls=" in line or "to_apply=" in line or "body=" in line
                    or "condition=" in line or "_computation" in line):
                continue
            for callee in _CALLS_RE.findall(line):
                is_body = f"body=%{callee}" in line or f"body={callee}" in line
                out.append((callee, trip if is_body else 1))
            b = _BRANCHES_RE.search(line)
            if b:
                out.extend((callee, 1) for callee in re.findall(r"%?([\w.\-]+)", b.group(1)))
        return out

    def visit(comp: str, times: int, depth: int = 0) -> None:
        if comp not in comps or depth > 64:
            return
        mult[comp] = mult.get(comp, 0) + times
        for callee, trips in callees(comp):
            visit(callee, times * trips, depth + 1)

    visit(entry, 1)
    return mult


def _parse_line(line: str, comp: str, times: int, num_devices: int | None
                ) -> CollectiveRecord | None:
    if not ("all-" in line or "collective-" in line or "reduce-scatter" in line):
        return None  # cheap test first: the full pattern is slow on long lines
    m = _OP_RE.search(line)
    if m is None:
        return None
    name_m = _NAME_RE.match(line)
    name = name_m.group("name") if name_m else "?"
    kind, type_str = m.group("op"), m.group("type").strip()
    if m.group("start"):
        parts = _split_tuple(type_str)
        if kind in ("all-gather", "collective-permute") and len(parts) >= 2:
            type_str = parts[1]
    arrays = [(dt, dims) for dt, dims in _ARRAY_RE.findall(type_str) if dt in _BYTES]
    shapes = tuple(f"{dt}[{dims}]" for dt, dims in arrays)
    nbytes = sum(_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                 for dt, dims in arrays)
    attrs = line[m.end():]
    groups = _replica_groups(attrs, num_devices)
    if kind == "collective-permute":
        # Its groups are the rings its pairs form (a pipeline's ppermute over "pp": one ring
        # per pp-row of devices), so the axis labeller names the axis the data moves along.
        pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
        nums = [int(x) for x in re.findall(r"\d+", pairs.group(1))] if pairs else []
        groups = _rings(list(zip(nums[::2], nums[1::2], strict=True)))
        group_size = len(groups[0]) if groups else 2
    else:
        group_size = len(groups[0]) if groups else (num_devices or 1)
    if kind == "reduce-scatter":
        nbytes *= group_size
    return CollectiveRecord(kind, name, comp, shapes, float(nbytes), group_size, groups, times)


def _rings(pairs: list[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """The connected groups of devices that ``(source, target)`` pairs link."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for a, b in pairs:
        parent[root(a)] = root(b)
    groups: dict[int, list[int]] = {}
    for x in list(parent):
        groups.setdefault(root(x), []).append(x)
    return tuple(sorted(tuple(sorted(g)) for g in groups.values()))


def _split_tuple(type_str: str) -> list[str]:
    s = type_str.strip()
    if not s.startswith("("):
        return [s]
    s = re.sub(r"/\*.*?\*/", "", s[1:-1])
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur).strip())
    return parts


def _replica_groups(attrs: str, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    m = re.search(r"replica_groups=", attrs)
    if m is None:
        return ((tuple(range(num_devices)),) if num_devices else ())
    rest = attrs[m.end():]
    if rest.startswith("{"):
        body = _balanced(rest, "{", "}")
        groups = tuple(tuple(int(x) for x in g.split(",") if x.strip())
                       for g in re.findall(r"\{([\d,\s]*)\}", body[1:-1]))
        if not groups:
            return ((tuple(range(num_devices)),) if num_devices else ())
        return groups
    if rest.startswith("["):
        it = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
        if it:
            return _iota_groups(it.group(1), it.group(2), it.group(3))
    if rest.startswith("mesh["):
        return _mesh_groups(rest)
    return ()


def _balanced(s: str, open_: str, close: str) -> str:
    depth = 0
    for i, ch in enumerate(s):
        if ch == open_:
            depth += 1
        elif ch == close:
            depth -= 1
            if depth == 0:
                return s[: i + 1]
    return s


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _iota(reshape: Sequence[int], perm: Sequence[int] | None) -> np.ndarray:
    arr = np.arange(math.prod(reshape)).reshape(reshape)
    if perm:
        arr = arr.transpose(perm)
    return arr.reshape(-1)


def _iota_groups(group_shape: str, reshape: str, perm: str | None) -> tuple[tuple[int, ...], ...]:
    shape = _ints(group_shape)
    flat = _iota(_ints(reshape), _ints(perm) if perm else None)
    return tuple(tuple(int(x) for x in row) for row in flat.reshape(shape[0], -1))


def _mesh_groups(rest: str) -> tuple[tuple[int, ...], ...]:
    """``mesh['a'=2,'b'=4][, device_ids=(...)] {'b'}`` (XLA's MeshAxesReplicaGroupList)."""
    head = re.match(r"mesh\[([^\]]*)\]", rest)
    if head is None:
        return ()
    axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", head.group(1))
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    after = rest[head.end():]
    n = math.prod(sizes)
    devices = np.arange(n)
    dm = re.match(r"\s*,\s*device_ids=\((.*?)\)\s*(?=\{)", after)
    if dm:
        spec = dm.group(1)
        it = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?$", spec.strip())
        if it:
            devices = _iota(_ints(it.group(1)), _ints(it.group(2)) if it.group(2) else None)
        else:
            devices = np.array(_ints(spec))
        after = after[dm.end():]
    sel = re.match(r"\s*\{([^}]*)\}", after)
    if sel is None:
        return ()
    refs = re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", sel.group(1))
    # Re-index: every mesh axis becomes its dims; sub-axes split the axis into (pre, size, rest).
    dims: list[int] = []
    grouped: list[int] = []
    by_axis: dict[int, list[tuple[int, int]]] = {}
    for axis, pre, size in refs:
        i = names.index(axis)
        by_axis.setdefault(i, []).append((int(pre), int(size)) if size else (1, sizes[i]))
    order_index: dict[tuple[int, int, int], int] = {}
    for i, full in enumerate(sizes):
        subs = sorted(by_axis.get(i, []))
        if not subs:
            dims.append(full)
            continue
        prefix = 1
        for pre, size in subs:
            if pre != prefix:
                dims.append(pre // prefix)
                prefix = pre
            order_index[(i, pre, size)] = len(dims)
            dims.append(size)
            prefix *= size
        if prefix != full:
            dims.append(full // prefix)
    for axis, pre, size in refs:
        i = names.index(axis)
        key = (i, int(pre), int(size)) if size else (i, 1, sizes[i])
        grouped.append(order_index[key])
    perm = [d for d in range(len(dims)) if d not in grouped] + grouped
    arr = devices.reshape(dims).transpose(perm).reshape(-1)
    group = math.prod(dims[g] for g in grouped) if grouped else 1
    return tuple(tuple(int(x) for x in row) for row in arr.reshape(-1, group))


class _AxisLabeler:
    """Names the mesh axes whose groups equal a collective's replica groups."""

    def __init__(self, mesh: Any) -> None:
        names = list(mesh.axis_names)
        shape = [int(s) for s in mesh.devices.shape]
        positions = np.arange(math.prod(shape)).reshape(shape)
        self.table: dict[frozenset, tuple[str, ...]] = {}
        for k in range(len(names) + 1):
            for combo in itertools.combinations(range(len(names)), k):
                rest = [d for d in range(len(names)) if d not in combo]
                arr = positions.transpose(rest + list(combo)).reshape(
                    -1, math.prod(shape[d] for d in combo) if combo else 1)
                key = frozenset(frozenset(int(x) for x in row) for row in arr)
                self.table.setdefault(key, tuple(names[d] for d in combo))

    def label(self, groups: Iterable[Iterable[int]]) -> tuple[str, ...] | None:
        key = frozenset(frozenset(g) for g in groups)
        return self.table.get(key)
