"""The layer sequence of a traced loss: prologue, identical layers, epilogue.

One SPMD program runs every stage, so every stage must run the same code on its own weights
(stacked along a ``"pp"``-sharded axis): the pipelined part of a loss is a sequence of
*identical layers*.  This module finds it in the traced graph (the top-level operators, in
program order), in one of two ways:

* **markers**: the regions under ``jaxpar.pipeline_stage(c)``, one layer per marked chunk;
* **repeats**: the longest run of operators that repeats with one period (equal primitives,
  shapes and parameters), cut where the fewest bytes cross from one layer to the next (the
  residual stream of a transformer, not the middle of its attention).  This is Alpa's layer
  clustering made exact for the layers a pipeline can stack: Alpa groups equations by FLOPs and
  cross-layer bytes; here the layers must be identical anyway, so they are found as repeats.

Only operators that depend on a batch input take part: what depends on weights alone (a layer's
slice ``w[i]`` of a stacked parameter, a cast, a transpose, a causal mask) is *weight work*,
computed before the pipeline by the enclosing program, and its results count as weights.

A candidate is checked by its data flow: layer ``k`` may read its own values, the values layer
``k - 1`` passes on (the same ones in every layer: the *activation*), weights (the same shapes
position by position; a position where every layer reads the same value is a shared weight),
batch inputs, literals, and values the prologue made that every layer reads alike (*shared*).
Nothing of layer ``k`` may be read past layer ``k + 1``, except the last layer's activation by
the epilogue.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar._src.compat import name_stack
from jaxpar._src.errors import PlanError
from jaxpar._src.graph import (
    Const,
    Crossing,
    Node,
    NodeKind,
    OpGraph,
    ScanRegion,
    WhileRegion,
)
from jaxpar._src.pipeline.markers import stage_of
from jaxpar._src.trace import _INLINE


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer: its top-level nodes and its interface."""

    nodes: tuple[int, ...]  # top-level node ids in program order
    weights: tuple[int, ...]  # value ids of the weight inputs it reads, in first-use order
    act_in: tuple[int, ...]  # value ids the previous layer (or the prologue) passes it
    act_out: tuple[int, ...]  # value ids it passes on, position by position as ``act_in``


@dataclasses.dataclass(frozen=True)
class LayerSequence:
    """A loss split into prologue, identical layers and epilogue."""

    prologue: tuple[int, ...]  # top-level node ids before the first layer
    layers: tuple[Layer, ...]
    epilogue: tuple[int, ...]
    shared: tuple[int, ...]  # values made before the layers that layers or epilogue read
    marked: bool  # the layers are the user's pipeline_stage regions
    weight_nodes: tuple[int, ...] = ()  # top-level nodes that depend on no batch input

    @property
    def stacked(self) -> tuple[int, ...]:
        """Weight positions whose value differs from layer to layer (stacked by stage)."""
        first = self.layers[0].weights
        return tuple(j for j in range(len(first))
                     if any(layer.weights[j] != first[j] for layer in self.layers[1:]))

    @property
    def common(self) -> tuple[int, ...]:
        """Weight positions every layer reads the same value at (passed whole)."""
        stacked = set(self.stacked)
        return tuple(j for j in range(len(self.layers[0].weights)) if j not in stacked)

    @property
    def period(self) -> int:
        return len(self.layers[0].nodes)


def find_layers(graph: OpGraph, jaxpr: Any, batch_values: frozenset[int], *, where: str
                ) -> LayerSequence:
    """The layer sequence of ``graph``: from stage markers if there are any, else repeats.

    Raises:
      PlanError: marked regions that differ, or no repeated layers at all.
    """
    top = [n for n in graph.order if graph.nodes[n].kind not in ("input", "output")]
    dependent = batch_dependent(graph, top, batch_values)
    seq = [n for n in top if n in dependent]
    weight_nodes = tuple(n for n in top if n not in dependent)
    stages = _marked_stages(graph, jaxpr, seq)
    if any(s is not None for s in stages):
        found = _from_markers(graph, seq, stages, batch_values, where)
    else:
        found = _from_repeats(graph, seq, batch_values, where)
    return dataclasses.replace(found, weight_nodes=weight_nodes)


def batch_dependent(graph: OpGraph, top: Sequence[int], batch: frozenset[int]) -> set[int]:
    """The top-level nodes that read a batch input, directly or not (a loop's exits count
    as its control node)."""
    out: set[int] = set()
    for nid in top:
        node = graph.nodes[nid]
        if node.kind is NodeKind.EXIT:
            if control_of(node) in out:
                out.add(nid)
            continue
        if any(isinstance(o, int) and (o in batch or graph.values[o].producer in out)
               for o in node.inputs):
            out.add(nid)
    return out


# -- markers -----------------------------------------------------------------------------------
def _marked_stages(graph: OpGraph, jaxpr: Any, seq: Sequence[int]) -> list[int | None]:
    """Per top-level node, the stage marker on its equation (nested jit bodies inherit their
    call's name stack, which the inlined equations no longer carry)."""
    stacks: dict[int, str] = {}

    def walk(jx: Any, parent: str) -> None:
        for eqn in jx.eqns:
            full = f"{parent}/{name_stack(eqn)}" if parent else name_stack(eqn)
            stacks[id(eqn)] = full
            key = _INLINE.get(eqn.primitive.name)
            if key is not None and key in eqn.params:
                sub = eqn.params[key]
                walk(getattr(sub, "jaxpr", sub), full)

    walk(jaxpr.jaxpr, "")
    out: list[int | None] = []
    for nid in seq:
        node = graph.nodes[nid]
        if node.kind is NodeKind.EXIT:
            node = graph.nodes[control_of(node)]
        out.append(stage_of(stacks.get(id(node.eqn), "")) if node.eqn is not None else None)
    # literals bound by an inlined call carry no equation: they belong with the next operator
    for i in range(len(out) - 2, -1, -1):
        if out[i] is None and graph.nodes[seq[i]].kind is NodeKind.CONST:
            out[i] = out[i + 1]
    return out


def _from_markers(graph: OpGraph, seq: list[int], stages: list[int | None],
                  batch: frozenset[int], where: str) -> LayerSequence:
    first = next(i for i, s in enumerate(stages) if s is not None)
    last = max(i for i, s in enumerate(stages) if s is not None)
    regions: list[list[int]] = []
    ids: list[int] = []
    for i in range(first, last + 1):
        s = stages[i]
        if s is not None and (not ids or s != ids[-1]):
            if s in ids:
                raise PlanError(f"{where}: pipeline stage {s} is marked twice, with stage "
                                f"{ids[-1]} in between; a stage's operators must be "
                                f"contiguous in program order.")
            ids.append(s)
            regions.append([])
        regions[-1].append(seq[i])  # unmarked operators join the stage before them
    if ids != list(range(len(ids))):
        raise PlanError(f"{where}: the pipeline_stage markers must number the stages 0, 1, "
                        f"... in program order; found {ids}.")
    if len(regions) < 2:
        raise PlanError(f"{where}: only stage {ids[0]} is marked; mark every stage (or none, "
                        f"and let jaxpar split the layers).")
    layers = _check(graph, seq[:first], regions, seq[last + 1:], batch)
    if isinstance(layers, str):
        raise PlanError(f"{where}: the stages marked with jaxpar.pipeline_stage must run the "
                        f"same code on their own weights (one SPMD program runs them all, "
                        f"with the weights stacked by stage), but {layers}")
    return dataclasses.replace(layers, marked=True)


# -- repeats -----------------------------------------------------------------------------------
def _from_repeats(graph: OpGraph, seq: list[int], batch: frozenset[int], where: str
                  ) -> LayerSequence:
    sigs = _signatures(graph, seq)
    crossing = _crossing_bytes(graph, seq)
    best: LayerSequence | None = None
    best_key: tuple | None = None
    for p, start, stop in _periodic_runs(sigs):
        if best is not None and (stop - start) // p * p < len(best.layers) * best.period:
            break  # runs come longest first: nothing later covers more
        # cuts with more whole layers first, then fewer bytes crossing a layer boundary
        offsets = sorted(range(start, min(start + p, stop - 2 * p + 1)),
                         key=lambda o: (-((stop - o) // p), crossing[o + p], o))
        for o in offsets:
            k = (stop - o) // p
            regions = [seq[o + i * p: o + (i + 1) * p] for i in range(k)]
            layers = _check(graph, seq[:o], regions, seq[o + k * p:], batch)
            if isinstance(layers, str):
                continue
            key = (-k * p, crossing[o + p], p)
            if best_key is None or key < best_key:
                best, best_key = layers, key
            break
    if best is None:
        raise PlanError(
            f"{where}: found no repeated layers to pipeline in {len(seq)} operators. One SPMD "
            f"pipeline runs the same layer code on every stage with the layer weights stacked "
            f"by stage, so the pipelined part must be a sequence of identical layers (as in "
            f"MaxText and praxis). Build the model from identical blocks, or mark the stages "
            f"with jaxpar.pipeline_stage.")
    return best


def _periodic_runs(sigs: np.ndarray) -> list[tuple[int, int, int]]:
    """``(period, start, stop)`` of maximal runs ``sigs[start:stop]`` with that period and at
    least two periods, longest coverage first."""
    n = len(sigs)
    runs = []
    for p in range(1, n // 2 + 1):
        same = sigs[:-p] == sigs[p:]
        if not same.any():
            continue
        edges = np.diff(np.concatenate(([0], same.astype(np.int8), [0])))
        starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        for a, b in zip(starts, stops, strict=True):
            if b - a >= p:  # sigs[a : b + p] has period p, covering (b - a + p) // p periods
                runs.append((p, int(a), int(b) + p))
    runs.sort(key=lambda r: (-((r[2] - r[1]) // r[0] * r[0]), r[0]))
    return runs


def _crossing_bytes(graph: OpGraph, seq: Sequence[int]) -> np.ndarray:
    """``out[q]``: bytes of the values made before ``seq[q]`` and read at or after it (what a
    cut there hands from one side to the other); ``q`` runs to ``len(seq)``."""
    at = {nid: q for q, nid in enumerate(seq)}
    diff = np.zeros(len(seq) + 2)
    for q, nid in enumerate(seq):
        for vid in graph.nodes[nid].outputs:
            last = max((at.get(_top(graph, c), -1) for c, _ in graph.consumers[vid]),
                       default=-1)
            if last > q:
                diff[q + 1] += graph.values[vid].nbytes
                diff[last + 1] -= graph.values[vid].nbytes
    return np.cumsum(diff)[: len(seq) + 1]


def _signatures(graph: OpGraph, seq: Sequence[int]) -> np.ndarray:
    codes: dict[Any, int] = {}
    return np.array([codes.setdefault(_signature(graph, graph.nodes[n]), len(codes))
                     for n in seq], np.int64)


_SIGS: dict[tuple[int, int], Any] = {}


def _signature(graph: OpGraph, node: Node) -> Any:
    key = (id(graph), node.id)
    sig = _SIGS.get(key)
    if sig is None:
        if len(_SIGS) > 200_000:
            _SIGS.clear()
        sig = _SIGS[key] = _signature_of(graph, node)
    return sig


def _signature_of(graph: OpGraph, node: Node) -> Any:
    outs = tuple((graph.values[v].shape, str(graph.values[v].dtype)) for v in node.outputs)
    ins = tuple((graph.operand_shape(o), str(graph.operand_dtype(o))) for o in node.inputs)
    if node.kind is NodeKind.CONST:
        value = np.asarray(node.constant)
        return ("const", outs, value.tobytes())
    if node.kind is NodeKind.EXIT:
        return ("exit", node.name, _crossing(node).index, outs)
    return (node.kind, node.name, ins, outs, _params_key(node.eqn.params))


def _params_key(params: Any) -> Any:
    items = []
    for k in sorted(params):
        v = params[k]
        try:
            hash(v)
            items.append((k, v if not hasattr(v, "eqns") and not hasattr(v, "jaxpr")
                          else str(v)))
        except TypeError:
            items.append((k, str(v)))
    return tuple(items)


# -- the data-flow check -----------------------------------------------------------------------
def _check(graph: OpGraph, prologue: Sequence[int], regions: Sequence[Sequence[int]],
           epilogue: Sequence[int], batch: frozenset[int]) -> LayerSequence | str:
    """The layer sequence if ``regions`` are identical layers with one interface, else why
    not (text)."""
    if len({len(r) for r in regions}) != 1:
        return f"they have {[len(r) for r in regions]} operators."
    R = len(regions)
    owner: dict[int, int] = {}  # node id (nested ones too) -> region; -1 prologue, R epilogue
    offset: dict[int, int] = {}  # top-level node id -> its place in its region
    for nid in prologue:
        owner[nid] = -1
    for i, region in enumerate(regions):
        for j, nid in enumerate(region):
            offset[nid] = j
            for inner in members(graph, nid):
                owner[inner] = i
    for nid in epilogue:
        for inner in members(graph, nid):
            owner[inner] = R
    base = [_signature(graph, graph.nodes[n]) for n in regions[0]]
    for i in range(1, R):
        for j, nid in enumerate(regions[i]):
            if _signature(graph, graph.nodes[nid]) != base[j]:
                return (f"layer {i} differs from layer 0 at its operator {j}: "
                        f"{_describe(graph, nid)} vs {_describe(graph, regions[0][j])}.")
    weights = [_weights(graph, r, owner, batch) for r in regions]
    classes = []
    for i, region in enumerate(regions):
        got = _classes(graph, region, i, owner, offset, weights[i], batch)
        if isinstance(got, str):
            return got
        classes.append(got)
    positions: list[tuple[int, int]] = []  # where layer 1 reads layer 0, by first use
    for c in classes[1]:
        if c[0] == "prev" and c[1] not in positions:
            positions.append(c[1])
    for i in range(2, R):
        if classes[i] != classes[1]:
            return f"layer {i} reads its inputs differently from layer 1."
    act_in0: dict[tuple[int, int], int] = {}
    for c0, c1 in zip(classes[0], classes[1], strict=True):
        if c1[0] == "prev":
            if c0[0] not in ("shared", "batch"):  # the prologue's value, or a batch input
                return "layer 0 does not read the prologue where layer 1 reads layer 0."
            if act_in0.setdefault(c1[1], c0[1]) != c0[1]:
                return "layer 0 reads two prologue values where layer 1 reads one."
        elif c0 != c1:
            return "layer 0 reads its inputs differently from layer 1."
    shapes0 = [graph.values[v].shape for v in weights[0]]
    if any([graph.values[v].shape for v in w] != shapes0 for w in weights):
        return "the layers' weights differ in shape."

    def at(region: Sequence[int], pos: tuple[int, int]) -> int:
        return graph.nodes[region[pos[0]]].outputs[pos[1]]

    act_out = [[at(r, pos) for pos in positions] for r in regions]
    act_in = [[act_in0[pos] for pos in positions]] + act_out[:-1]
    for i, region in enumerate(regions):  # nothing escapes past the next layer
        passed = set(act_out[i])
        for nid in region:
            for vid in graph.nodes[nid].outputs:
                for consumer, _ in graph.consumers[vid]:
                    o = owner.get(consumer, owner.get(_top(graph, consumer)))
                    if o == i or (vid in passed and (o == i + 1 or (o == R and i == R - 1))):
                        continue
                    return (f"a value of layer {i} ({_describe(graph, nid)}) is read by "
                            f"{'the epilogue' if o == R else f'layer {o}'}.")
    shared = {c[1] for c in classes[1] if c[0] == "shared"}
    for nid in epilogue:
        for operand in graph.nodes[nid].inputs:
            if isinstance(operand, int) and owner.get(graph.values[operand].producer) == -1:
                shared.add(operand)
    layers = tuple(Layer(tuple(r), tuple(w), tuple(a), tuple(o))
                   for r, w, a, o in zip(regions, weights, act_in, act_out, strict=True))
    return LayerSequence(tuple(prologue), layers, tuple(epilogue), tuple(sorted(shared)), False)


def _classes(graph: OpGraph, region: Sequence[int], index: int, owner: dict[int, int],
             offset: dict[int, int], weights: Sequence[int], batch: frozenset[int]
             ) -> list[tuple] | str:
    """Where each operand of the region comes from, relative to the region, flat."""
    wpos = {v: k for k, v in enumerate(weights)}
    out: list[tuple] = []
    for nid in region:
        node = graph.nodes[nid]
        for o in node.inputs:
            if isinstance(o, Const):
                out.append(("lit", np.asarray(o.value).tobytes(), o.shape))
                continue
            v = graph.values[o]
            prod = graph.nodes[v.producer]
            if node.kind is NodeKind.EXIT:
                out.append(("body", v.index))  # the control node's signature covers its body
            elif owner.get(v.producer) == index and v.producer in offset:
                out.append(("int", offset[v.producer], v.index))
            elif o in batch:
                out.append(("batch", o))
            elif o in wpos:
                out.append(("w", wpos[o]))
            elif index > 0 and owner.get(v.producer) == index - 1:
                out.append(("prev", (offset[v.producer], v.index)))
            elif owner.get(v.producer, -1) == -1 or prod.kind is NodeKind.CONST:
                out.append(("shared", o))
            else:
                return (f"layer {index} reads a value of layer {owner.get(v.producer)} "
                        f"({_describe(graph, v.producer)}): a connection that skips layers.")
    return out


def _crossing(node: Node) -> Crossing:
    """Where an enter or exit node crosses its control node's boundary."""
    if node.crossing is None:
        raise PlanError(f"jaxpar: internal error: {node} crosses no control-flow boundary.")
    return node.crossing


def control_of(node: Node) -> int:
    """The control node (scan, while, cond) an exit node leaves."""
    return _crossing(node).control


def members(graph: OpGraph, nid: int) -> list[int]:
    """A top-level node and every node nested in its bodies."""
    out = [nid]
    region = graph.nodes[nid].structure
    if region is None:
        return out
    if isinstance(region, ScanRegion):
        groups: tuple[tuple[int, ...], ...] = (region.body,)
    elif isinstance(region, WhileRegion):
        groups = (region.carries, region.cond, region.body)
    else:
        groups = (region.operands, *region.branches)
    seen: set[int] = set()
    for group in groups:
        for inner in group:
            if inner not in seen:
                seen.add(inner)
                out.extend(members(graph, inner))
    return out


def _top(graph: OpGraph, nid: int) -> int:
    node = graph.nodes[nid]
    while node.region is not None:
        node = graph.nodes[node.region]
    return node.id


def _weights(graph: OpGraph, region: Sequence[int], owner: dict[int, int],
             batch: frozenset[int]) -> list[int]:
    """The weights a region reads, in first-use order: function inputs that are no batch,
    and results of weight work (nodes that are in no region: they read no batch input)."""
    seen: dict[int, None] = {}
    for nid in region:
        if graph.nodes[nid].kind is NodeKind.EXIT:
            continue
        for o in graph.nodes[nid].inputs:
            if not isinstance(o, int) or o in batch:
                continue
            prod = graph.nodes[graph.values[o].producer]
            if prod.kind is NodeKind.INPUT or (prod.id not in owner
                                               and prod.kind is not NodeKind.OUTPUT):
                seen.setdefault(o, None)
    return list(seen)


def _describe(graph: OpGraph, nid: int) -> str:
    node = graph.nodes[nid]
    shapes = [list(graph.values[v].shape) for v in node.outputs]
    return f"{node.kind} {node.name} -> {shapes} at {node.source}"
