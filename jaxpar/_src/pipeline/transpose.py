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

import jax.numpy as jnp

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
    forward: list[PredictedCollective] = []
    backward: list[PredictedCollective] = []
    for top in nodes:
        in_tail = top in group_tail
        for nid in members(graph, top):
            node, d = graph.nodes[nid], plan.decisions[nid]
            for c in list(d.collectives) + [c for r in d.redistributions
                                             for c in r.collectives]:
                if not (in_tail and c.axes and set(c.axes) <= rows):
                    forward.append(c)
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
                        backward.append(PredictedCollective.of(summed, d.weight))
            for r in d.redistributions:
                o = ins[r.in_index]
                if r.in_index not in live or isinstance(o, Const):
                    continue
                v = graph.values[o]
                for moved in model.redistribution(r.dst, r.src, tuple(v.shape), v.dtype):
                    if moved.wire_bytes > 0:
                        backward.append(PredictedCollective.of(moved, d.weight))
    return EpilogueComm(tuple(forward), tuple(backward))


def _is_float(graph: OpGraph, vid: int) -> bool:
    return bool(jnp.issubdtype(graph.values[vid].dtype, jnp.inexact))
