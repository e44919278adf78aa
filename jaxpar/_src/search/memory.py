"""Per-device memory of a plan: arguments held throughout, intermediates while they are live.

Values live from the node that produces them to their last reader, in graph order (a loop body
counts once, at its place).  The estimate is the peak of the live bytes per device, which is
what XLA must hold at least; its own buffer reuse can only do better on temporaries.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Mapping

import numpy as np

from jaxpar._src.graph import NodeKind, OpGraph
from jaxpar._src.rules import OpStrategy
from jaxpar._src.spec import MeshShape


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    peak: float  # bytes per device
    arguments: float  # bytes per device of the program's arguments
    at: int  # the graph position (node id) where the peak is reached


def live_ranges(graph: OpGraph) -> list[tuple[int, int, int]]:
    """``(value id, first position, last position)`` of every value."""
    end = len(graph.nodes)
    last = {v.id: v.producer for v in graph.values}
    for node in graph.nodes:
        for o in node.inputs:
            if isinstance(o, int):
                last[o] = max(last[o], node.id)
    out = []
    for v in graph.values:
        kind = graph.nodes[v.producer].kind
        held = kind in (NodeKind.INPUT, NodeKind.CONST)  # arguments live throughout
        first = 0 if held else v.producer
        stop = end if held else last[v.id]
        out.append((v.id, first, stop))
    return out


def peak_memory(graph: OpGraph, strategies: Mapping[int, OpStrategy], mesh: MeshShape
                ) -> MemoryEstimate:
    n = len(graph.nodes) + 1
    delta = np.zeros(n + 1)
    arguments = 0.0
    values = graph.values
    fractions: dict = {}  # per layout: a plan has few, its values many
    for vid, first, stop, nbytes, is_argument in _lifetimes(graph):
        v = values[vid]
        spec = strategies[v.producer].out_specs[v.index]
        fraction = fractions.get(spec)
        if fraction is None:
            fraction = fractions[spec] = spec.shard_fraction(mesh)
        b = nbytes * fraction
        delta[first] += b
        delta[stop + 1] -= b
        if is_argument:
            arguments += b
    live = np.cumsum(delta)[:n]
    at = int(np.argmax(live))
    return MemoryEstimate(float(live[at]), arguments, at)


def _lifetimes(graph: OpGraph) -> list[tuple[int, int, int, int, bool]]:
    """:func:`live_ranges` with each value's bytes and whether an input produces it, found
    once per graph: every plan compared is measured on the same graph (issue 14)."""
    found = _LIFETIMES.get(graph)
    if found is None:
        values, nodes = graph.values, graph.nodes
        found = _LIFETIMES[graph] = [
            (vid, first, stop, values[vid].nbytes,
             nodes[values[vid].producer].kind is NodeKind.INPUT)
            for vid, first, stop in live_ranges(graph)]
    return found


_LIFETIMES: weakref.WeakKeyDictionary[OpGraph, list] = weakref.WeakKeyDictionary()


def replicated_peak(graph: OpGraph) -> float:
    """Peak bytes per device if nothing were split: an upper bound for every plan."""
    n = len(graph.nodes) + 1
    delta = np.zeros(n + 1)
    for _, first, stop, b, _ in _lifetimes(graph):
        delta[first] += b
        delta[stop + 1] -= b
    return float(np.max(np.cumsum(delta)[:n]))
