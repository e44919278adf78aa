"""The epilogue's collectives per micro-batch, its backward's included, from its layouts.

The stage split prices the epilogue (final norm, head, loss) forward and backward once per
micro-batch (``split.py``).  The plan is of the loss's forward alone (the loop differentiates
each piece with ``jax.vjp``), so its decisions hold the forward's collectives; the backward's
follow from the same layouts, operator by operator, as XLA's partitioner transposes them:

* an operand whose layout lacks a mesh axis the operator splits its work over (any axis of its
  operands', results' or partial sums' layouts) was read whole on each device of that axis:
  its cotangent is a partial sum there, an all-reduce of the operand's slice over those axes
  (the input of a column-split head ``[dp, -]·[-, tp]``: over ``tp``; its weight: over ``dp``);
* a layout change on an operand's edge runs backwards on its cotangent (a slice forward, an
  all-gather backward);
* a forward all-reduce (partial sums combined) transposes to nothing: each device's cotangent
  of its partial sum is the whole cotangent (the loss's scalar sum over the rows).

Only cotangents that flow count: of float values that depend on the carried activations or the
weights, through differentiable operators (not ``stop_gradient``, comparisons, integers).
Where the epilogue runs per row group (``ends.py``), a grouped weight's gradient is summed over
the row axes once after the loop, not per micro-batch, and a tail proven affine (``tail.py``)
takes its sum over the rows a group at a time: those collectives leave the loop.

XLA's all-reduce combiner (``combine.py``) then merges independent all-reduces of one reduction,
element type and set of axes into one instruction, which pays its latency once: the forward's
are combined as it does (:func:`combined`: in order, an all-reduce joins the open group of its
key unless it depends on a member), and the backward's too, their dependencies reversed (a
cotangent's all-reduce waits for those of the operators that read the value it belongs to).
The loss of a column-split head (``tests/test_pipeline_transpose.py``) has three forward
all-reduces over ``tp``, its max and two sums, which the compiled loop runs as two (the max;
the two independent sums in one); priced one by one they were four latencies with the
backward's, now three, as the loop has them.

>>> import jax.numpy as jnp, jaxpar
>>> from jax.sharding import PartitionSpec as P
>>> f = jaxpar.parallelize(lambda h, w: jnp.sum(h @ w), mesh=jaxpar.make_mesh((2, 2),
...     ("dp", "tp")), parallel_mode="semi_auto_parallel",
...     in_strategy=(P("dp", None), P(None, "tp")))  # a column-split head
>>> entry = f.compiled_entry(jnp.ones((4, 8)), jnp.ones((8, 6)))
>>> plan, g = entry.plan, entry.program.graph
>>> seeds = [g.nodes[i].outputs[0] for i in g.inputs]
>>> comm = epilogue_collectives(g, plan, [n.id for n in g.nodes if n.kind == "op"], seeds,
...                             jaxpar.HardwareProfile())
>>> [(c.kind, c.axes, c.nbytes) for c in comm.backward]  # h's cotangent over tp, w's over dp
[('all-reduce', ('tp',), 64.0), ('all-reduce', ('dp',), 96.0)]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from typing import Any

import jax.numpy as jnp

from jaxpar._src.combine import issued_groups
from jaxpar._src.cost import CostModel
from jaxpar._src.graph import Const, NodeKind, OpGraph, itemsize
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.pipeline.layers import members
from jaxpar._src.plan import PredictedCollective, ShardingPlan

# operators whose cotangent is zero or absent: nothing flows back through them
NO_COTANGENT = frozenset("""stop_gradient sign floor ceil round is_finite argmax argmin eq ne
    lt le gt ge and or not xor iota random_bits random_seed random_wrap random_unwrap
    shift_left shift_right_logical shift_right_arithmetic population_count""".split())


@dataclasses.dataclass(frozen=True)
class EpilogueComm:
    """The epilogue's collectives per micro-batch inside the loop, forward and backward.

    Attributes:
      forward: the plan's collectives of the epilogue's operators and edges (those over the
        row axes a grouped, affine tail takes a group at a time left out).
      backward: the transposes (module docstring).
    """

    forward: tuple[PredictedCollective, ...] = ()
    backward: tuple[PredictedCollective, ...] = ()

    @property
    def time(self) -> float:
        return sum(c.time for c in self.forward + self.backward)

    def bytes_by_axes(self) -> dict[tuple[str, ...], float]:
        """Payload bytes per device by the axes they cross, forward and backward together
        (what the compiled loop's collectives per trip hold: ``tests``)."""
        out: dict[tuple[str, ...], float] = {}
        for c in self.forward + self.backward:
            key = tuple(sorted(c.axes))
            out[key] = out.get(key, 0.0) + c.nbytes * c.count
        return out


def epilogue_collectives(graph: OpGraph, plan: ShardingPlan, nodes: Sequence[int],
                         seeds: Collection[int], hardware: HardwareProfile, *,
                         grouped: Collection[int] = (), row_axes: Sequence[str] = (),
                         group_tail: Collection[int] = ()) -> EpilogueComm:
    """The collectives of the epilogue's top-level ``nodes`` per micro-batch, forward and
    backward (module docstring).

    ``seeds``: the value ids differentiated (the carried activations, the weights);
    ``grouped``: the weights whose gradients are summed over ``row_axes`` after the loop (the
    epilogue per row group); ``group_tail``: the tail's top-level nodes run a group at a time
    (an affine tail): their forward collectives over ``row_axes`` alone leave the loop.
    """
    mesh = plan.mesh
    model = CostModel(mesh, hardware)
    rows = frozenset(row_axes)
    active = {v for v in seeds if _is_float(graph, v)}
    forward: list[_Raw] = []
    backward: list[_Raw] = []
    order = [nid for top in nodes for nid in members(graph, top)]
    inside = set(order)
    for top in nodes:
        in_tail = top in group_tail
        for nid in members(graph, top):
            node, d = graph.nodes[nid], plan.decisions[nid]
            own = [(c, _reduction(node.name), _dtype(graph, node.outputs)) for c in d.collectives]
            edges = [(c, "", _dtype(graph, [node.inputs[r.in_index]]))
                     for r in d.redistributions for c in r.collectives]
            for c, red, dtype in own + edges:
                if not (in_tail and c.axes and set(c.axes) <= rows):
                    forward.append(_Raw(c, nid, (c.kind, red, dtype, c.axes, c.count)))
            ins = list(node.inputs)
            live = [i for i, o in enumerate(ins) if not isinstance(o, Const) and o in active]
            if not live or node.name in NO_COTANGENT:
                continue
            made = [v for v in node.outputs if _is_float(graph, v)]
            active.update(made)
            if node.kind is not NodeKind.OP or not made or len(d.in_specs) != len(ins):
                continue
            work = {a for s in d.in_specs + d.out_specs for a in s.axes}
            work |= {a for c in d.collectives for a in c.axes}
            for i in live:
                o = ins[i]
                assert isinstance(o, int)
                v = graph.values[o]
                spec = d.in_specs[i]
                missing = work - set(spec.axes) - (rows if o in grouped else set())
                axes = tuple(a for a in mesh.names if a in missing and mesh.size(a) > 1)
                if axes and spec.ndim == len(v.shape):
                    nbytes = math.prod(v.shape) * itemsize(v.dtype) * spec.shard_fraction(mesh)
                    summed = model.collective("all-reduce", nbytes, axes, reduction="sum")
                    if summed.wire_bytes > 0:
                        c = PredictedCollective.of(summed, d.weight)
                        backward.append(_Raw(c, nid, (c.kind, "sum", str(v.dtype), c.axes,
                                                      c.count)))
            for r in d.redistributions:
                o = ins[r.in_index]
                if r.in_index not in live or isinstance(o, Const):
                    continue
                v = graph.values[o]
                for moved in model.redistribution(r.dst, r.src, tuple(v.shape), v.dtype):
                    if moved.wire_bytes > 0:
                        c = PredictedCollective.of(moved, d.weight)
                        backward.append(_Raw(c, nid, (c.kind, "", str(v.dtype), c.axes,
                                                      c.count)))
    return EpilogueComm(
        tuple(combined(forward, _depends(graph, order, inside, forward, reverse=False), model)),
        tuple(combined(backward, _depends(graph, order, inside, backward, reverse=True),
                       model)))


@dataclasses.dataclass(frozen=True)
class _Raw:
    """One of the epilogue's collectives before XLA's combiner: its operator and the key
    XLA combines by (kind, reduction, element type, axes, executions)."""

    collective: PredictedCollective
    node: int
    key: tuple


def combined(raw: Sequence[_Raw], deps: Sequence[int], model: CostModel
             ) -> list[PredictedCollective]:
    """``raw`` (in the order XLA meets them) as XLA's combiner issues them
    (:func:`jaxpar._src.combine.issued_groups`, the walk the whole plan's price uses; ``deps``:
    bitsets over ``raw``; ``HardwareProfile.combine_threshold`` 0: never combined); each group
    one collective, one latency for the members' bytes.

    >>> from jaxpar._src.spec import MeshShape
    >>> model = CostModel(MeshShape(("tp",), (2,)), HardwareProfile())
    >>> c = PredictedCollective.of(model.collective("all-reduce", 64.0, ("tp",)), 1.0)
    >>> key = ("all-reduce", "sum", "float32", ("tp",), 1.0)
    >>> [x.members for x in combined([_Raw(c, 0, key)] * 2, [0, 0], model)]  # independent
    [2]
    >>> [x.members for x in combined([_Raw(c, 0, key)] * 2, [0, 1], model)]  # the 2nd reads the 1st
    [1, 1]
    """
    hw = model.hw
    limits = [hw.combine_threshold(r.collective.kind) for r in raw]
    keys = [r.key if limit > 0 else None for r, limit in zip(raw, limits, strict=True)]
    out: list[PredictedCollective] = []
    for group in issued_groups(keys, [r.collective.nbytes for r in raw], limits, list(deps),
                               hw.combine_threshold_count):
        cs = [raw[k].collective for k in group]
        if len(cs) == 1:
            out.append(cs[0])
            continue
        c0 = cs[0]
        size = sum(c.nbytes for c in cs)
        time = model.collective_time(c0.kind, size, c0.axes)
        out.append(PredictedCollective(c0.kind, c0.axes, size, sum(c.wire_bytes for c in cs),
                                       time * c0.count, c0.count, len(cs)))
    return out


def _depends(graph: OpGraph, order: Sequence[int], inside: Collection[int],
             raw: Sequence[_Raw], *, reverse: bool) -> list[int]:
    """Per raw collective, the bitset of those it waits for through the epilogue's dataflow
    (``order``: its operators in order): forward, those of the operators it reads from;
    ``reverse`` (the backward's), those of the operators that read its operator's results."""
    own: dict[int, int] = {}
    for k, r in enumerate(raw):
        own[r.node] = own.get(r.node, 0) | 1 << k
    reach: dict[int, int] = {}  # what an operator's results wait for (reversed: feed)
    before: dict[int, int] = {}  # what its own collectives wait for
    for nid in (reversed(order) if reverse else order):
        node = graph.nodes[nid]
        acc = 0
        if reverse:
            for v in node.outputs:
                for reader, _ in graph.consumers[v]:
                    if reader in inside and reader != nid:
                        acc |= reach.get(reader, 0)
        else:
            for o in node.inputs:
                if isinstance(o, int) and graph.values[o].producer in inside:
                    acc |= reach.get(graph.values[o].producer, 0)
        reach[nid] = acc | own.get(nid, 0)
        before[nid] = acc
    return [before[r.node] for r in raw]


def _reduction(name: str) -> str:
    """The reduction of an operator's partial results (what its all-reduces combine by)."""
    return {"reduce_max": "max", "max": "max", "argmax": "max", "reduce_min": "min",
            "min": "min", "argmin": "min", "reduce_prod": "prod"}.get(name, "sum")


def _dtype(graph: OpGraph, vids: Sequence[Any]) -> str:
    """The element type of the first value of ``vids`` (a constant's: none)."""
    for v in vids:
        if isinstance(v, int):
            return str(graph.values[v].dtype)
    return ""


def _is_float(graph: OpGraph, vid: int) -> bool:
    return bool(jnp.issubdtype(graph.values[vid].dtype, jnp.inexact))
