"""Naming arrays by path and finding, for each array a network wants, where a checkpoint has it.

Paths are dotted pytree key paths, as ``ShardingPlan.input_layouts()`` writes them
(``"params.blocks.0.attn.q.kernel.value"``).  A network's array is found in a checkpoint

* under the same path, or under a prefix the checkpoint adds (a network's parameters ``"w"``
  in a train checkpoint ``{"params": ..., "opt_state": ...}`` are ``"params.w"``);
* as one layer of an array stacked for a scan (``"blocks.3.w"`` of shape ``s`` is row 3 of
  ``"blocks.w"`` of shape ``(L, *s)``), or as the stack of layers saved one by one.

>>> saved = {"params.blocks.w": (4, 8, 8), "params.head": (8, 2), "opt_state.0.count": ()}
>>> wanted = {"blocks.1.w": (8, 8), "head": (8, 2)}
>>> found = match(wanted, saved, where="demo")
>>> found["blocks.1.w"], found["head"]
(Source(kind='slice', paths=('params.blocks.w',), index=1), Source(kind='direct', \
paths=('params.head',), index=0))
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jaxpar._src.errors import CheckpointError
from jaxpar._src.trace import dotted

Shape = tuple[int, ...]
MAX_LISTED = 12  # names listed in an error before "... and N more"


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a wanted array comes from: one saved array (``direct``), one row of a stacked
    array (``slice``, row ``index``), or several saved arrays stacked (``stack``)."""

    kind: str
    paths: tuple[str, ...]
    index: int = 0


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """Dotted paths, leaves and tree structure of ``tree`` (``None`` leaves are empty)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [dotted(p) for p, _ in flat], [x for _, x in flat], treedef


def components(path: str) -> list[str]:
    return path.split(".") if path else []


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def match(wanted: Mapping[str, Shape | None], saved: Mapping[str, Shape], *, where: str,
          subtree: str | None = None) -> dict[str, Source]:
    """For each wanted path (with its shape, ``None``: any) the saved array(s) it comes from.

    Raises:
      CheckpointError: some wanted arrays are not in the checkpoint or have other shapes (all
        are listed with both shapes), or the prefix to read them under is ambiguous.
    """
    prefix = subtree if subtree is not None else _prefix(wanted, saved, where)
    found: dict[str, Source] = {}
    missing, wrong = [], []
    for path, shape in wanted.items():
        full = join(prefix, path)
        if full in saved:
            if shape is not None and tuple(saved[full]) != tuple(shape):
                wrong.append((path, shape, saved[full], full))
            else:
                found[path] = Source("direct", (full,))
            continue
        source = _restructured(full, shape, saved)
        if source is None:
            missing.append((path, shape))
        else:
            found[path] = source
    if missing or wrong:
        raise CheckpointError(_mismatch_message(where, prefix, missing, wrong, saved, found))
    return found


def _restructured(full: str, shape: Shape | None, saved: Mapping[str, Shape]) -> Source | None:
    parts = components(full)
    # one layer of a stacked array: drop an integer component
    for k, c in enumerate(parts):
        if c.isdigit():
            stacked = join(*(parts[:k] + parts[k + 1:]))
            s = saved.get(stacked)
            if s and int(c) < s[0] and (shape is None or tuple(s[1:]) == tuple(shape)):
                return Source("slice", (stacked,), int(c))
    # a stack of layers saved one by one: insert an integer component
    if shape:
        for k in range(len(parts)):
            layers = tuple(join(*(parts[:k] + [str(i)] + parts[k:])) for i in range(shape[0]))
            if all(tuple(saved.get(p, (-1,))) == tuple(shape[1:]) for p in layers):
                if join(*(parts[:k] + [str(shape[0])] + parts[k:])) not in saved:
                    return Source("stack", layers)
    return None


def _prefix(wanted: Mapping[str, Shape | None], saved: Mapping[str, Shape], where: str) -> str:
    """The prefix under which the checkpoint holds the wanted tree: the one that explains the
    most wanted paths, then the shortest."""
    if all(p in saved for p in wanted):
        return ""
    suffixes: dict[str, set[str]] = collections.defaultdict(set)  # suffix -> prefixes
    for s in saved:
        parts = components(s)
        for k in range(1, len(parts)):
            suffixes[join(*parts[k:])].add(join(*parts[:k]))
    cover: collections.Counter[str] = collections.Counter()
    for path in wanted:
        prefixes = {""} if path in saved else set()
        for alt in _variants(path):
            prefixes |= suffixes.get(alt, set())
            if alt in saved:
                prefixes.add("")
        cover.update(prefixes)
    if not cover:
        return ""
    best = max(cover.values())
    tops = sorted((p for p, n in cover.items() if n == best), key=lambda p: len(components(p)))
    ties = [p for p in tops if len(components(p)) == len(components(tops[0]))]
    if len(ties) > 1:
        raise CheckpointError(
            f"{where}: the checkpoint holds the wanted arrays under several prefixes "
            f"({', '.join(repr(t) for t in ties)}); pass subtree= to say which to read.")
    return tops[0]


def _variants(path: str) -> list[str]:
    """``path`` and its restructured names: without one integer component (a stacked array
    holds it), with ``0`` inserted (a stack's first layer)."""
    parts = components(path)
    out = [path]
    out += [join(*(parts[:k] + parts[k + 1:])) for k, c in enumerate(parts) if c.isdigit()]
    out += [join(*(parts[:k] + ["0"] + parts[k:])) for k in range(len(parts))]
    return out


def _mismatch_message(where: str, prefix: str, missing: list, wrong: list,
                      saved: Mapping[str, Shape], found: Mapping[str, Source]) -> str:
    lines = [f"{where}: the checkpoint does not match the network"
             + (f" (reading the checkpoint's arrays under '{prefix}')" if prefix else "") + "."]
    if wrong:
        lines.append(f"{len(wrong)} arrays have other shapes (network vs checkpoint):")
        lines += [f"  {p}: {_shape(s)} vs {_shape(c)}" for p, s, c, _ in wrong[:MAX_LISTED]]
        lines += _more(wrong)
    if missing:
        lines.append(f"{len(missing)} arrays of the network are not in the checkpoint:")
        lines += [f"  {p}: {_shape(s)}" for p, s in missing[:MAX_LISTED]]
        lines += _more(missing)
    used = {p for s in found.values() for p in s.paths} | {f for *_, f in wrong}
    unused = [p for p in saved if p not in used and p.startswith(prefix)]
    if unused:
        lines.append(f"{len(unused)} arrays of the checkpoint were not asked for:")
        lines += [f"  {p}: {_shape(saved[p])}" for p in unused[:MAX_LISTED]]
        lines += _more(unused)
    lines.append("Load the checkpoint this network was trained with, or build the network with "
                 "the configuration the checkpoint was saved from.")
    return "\n".join(lines)


def _more(items: Sequence[Any]) -> list[str]:
    return [f"  ... and {len(items) - MAX_LISTED} more"] if len(items) > MAX_LISTED else []


def _shape(shape: Shape | None) -> str:
    return "any shape" if shape is None else str(list(shape))


def nest(flat: Mapping[str, Any]) -> dict:
    """Nested dicts from dotted paths (what orbax saves and reads back by the same paths).

    >>> nest({"a.b": 1, "a.c": 2, "d": 3})
    {'a': {'b': 1, 'c': 2}, 'd': 3}
    """
    root: dict = {}
    for path, value in flat.items():
        node = root
        parts = components(path)
        for c in parts[:-1]:
            node = node.setdefault(c, {})
        node[parts[-1]] = value
    return root
