"""Per-device memory of a plan: arguments held throughout, intermediates while they are live.

Values live from the node that produces them to their last reader, in graph order (a loop body
counts once, at its place).  The estimate is the peak of the live bytes per device, which is
what XLA must hold at least; its own buffer reuse can only do better on temporaries.
"""

from __future__ import annotations

import dataclasses
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


def value_bytes(graph: OpGraph, strategies: Mapping[int, OpStrategy], mesh: MeshShape,
                vid: int) -> float:
    v = graph.values[vid]
    spec = strategies[v.producer].out_specs[v.index]
    return v.nbytes * spec.shard_fraction(mesh)


def peak_memory(graph: OpGraph, strategies: Mapping[int, OpStrategy], mesh: MeshShape
                ) -> MemoryEstimate:
    n = len(graph.nodes) + 1
    delta = np.zeros(n + 1)
    arguments = 0.0
    for vid, first, stop in live_ranges(graph):
        b = value_bytes(graph, strategies, mesh, vid)
        delta[first] += b
        delta[stop + 1] -= b
        if graph.nodes[graph.values[vid].producer].kind is NodeKind.INPUT:
            arguments += b
    live = np.cumsum(delta)[:n]
    at = int(np.argmax(live))
    return MemoryEstimate(float(live[at]), arguments, at)


def replicated_peak(graph: OpGraph) -> float:
    """Peak bytes per device if nothing were split: an upper bound for every plan."""
    n = len(graph.nodes) + 1
    delta = np.zeros(n + 1)
    for vid, first, stop in live_ranges(graph):
        b = graph.values[vid].nbytes
        delta[first] += b
        delta[stop + 1] -= b
    return float(np.max(np.cumsum(delta)[:n]))
