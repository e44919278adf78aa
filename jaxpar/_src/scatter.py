"""ZeRO levels 1-2: a split gradient made by reduce-scatter, not by all-reduce and a slice.

At levels 1-2 the optimizer state is split on dimension 0 over the data-parallel axes, so the
update reads each weight gradient split the same way.  The plan makes that gradient where the
backward pass contracts over the batch (a ``dot_general`` or ``reduce_sum`` whose contracted
dimensions are split over the data-parallel axes): whole (an all-reduce), then, after a few
layout-keeping operators (a transpose, Adam's ``(1 - b1) * g`` and ``g ** 2``), read split (a
local slice).  XLA:GPU's ``reduce_scatter_creator`` pass turns that all-reduce and slice into a
reduce-scatter; XLA:CPU has none, and moves 3Ψ where ZeRO moves 2Ψ.

:func:`find_scatters` finds such contractions and the layout-keeping operators after them, and
rewrites the lowering's copy of the plan so that they carry the split layout from the
contraction on; the contraction itself is then lowered as a ``jax.shard_map`` manual over every
mesh axis, in the plan's operand layouts: the local contraction, then
``jax.lax.psum_scatter(..., tiled=True)`` over the axes the readers add (and ``psum`` over any
other contracted axis).  ``psum_scatter`` lowers to an HLO ``reduce-scatter`` on every backend.
Manual over every axis, not only the data-parallel ones: with the other axes automatic, XLA's
partitioner gathers the result over them before the reduce-scatter (seen on a (2, 4) mesh).

Only plans with the parallel optimizer at level 1 or 2 turn this on, and the plan does it
when it is made (``scatter_plan.py``): its layouts are those :func:`find_scatters` returns, its
predicted collectives and step time price the reduce-scatters, and it keeps the contractions
(``plan.scatters``), which the lowering (``lower.py``, ``annotate.py``) lowers with
:func:`scatter_fn`.

>>> import jax.numpy as jnp, optax, jaxpar
>>> tx, p = optax.adam(0.1), {"w": jnp.ones((16, 8))}
>>> def step(p, s, x):
...     g = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(p)
...     u, s = tx.update(g, s, p)
...     return optax.apply_updates(p, u), s
>>> with jaxpar.auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={
...         "optimizer_level": "level1", "parallel_optimizer_threshold": 0}):
...     f = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
...                            parallel_mode="data_parallel")
...     colls = jaxpar.inspect.collectives(f.lower(p, tx.init(p), jnp.ones((64, 16))))
>>> colls.count("reduce-scatter"), colls.count("all-reduce"), colls.count("all-gather")
(1, 0, 1)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar._src.compat import bind_equation
from jaxpar._src.graph import Const, Node, NodeKind, OpGraph
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.rules.elementwise import BINARY, UNARY
from jaxpar._src.spec import Spec

# Operators that keep their one array operand's layout (the others scalars): the gradient
# passes them on its way to the optimizer update.
_KEEP = (frozenset(UNARY) | frozenset(BINARY) | {"convert_element_type", "integer_pow",
                                                 "copy", "copy_p", "square"}) - {
    "reshard", "mesh_cast"}


@dataclasses.dataclass(frozen=True)
class Scatter:
    """How one contraction is lowered: scatter its result's dimension ``dim`` over ``axes``
    (``psum_scatter``), sum it over ``summed`` (``psum``)."""

    axes: tuple[str, ...]
    dim: int
    summed: tuple[str, ...]


def _contracted(node: Node, in_specs: tuple[Spec, ...]) -> tuple[tuple[str, ...], Spec] | None:
    """The mesh axes the contraction of ``node`` is split over, and the layout its local
    result has; ``None`` when the operands' layouts do not line up."""
    p = node.eqn.params
    if node.name == "reduce_sum":
        (spec,) = in_specs
        axes = tuple(a for k in p["axes"] for a in spec.dims[k])
        return axes, Spec(tuple(d for k, d in enumerate(spec.dims) if k not in p["axes"]))
    (lc, rc), (lb, rb) = p["dimension_numbers"]
    ls, rs = in_specs
    if [ls.dims[k] for k in lc] != [rs.dims[k] for k in rc] or \
            [ls.dims[k] for k in lb] != [rs.dims[k] for k in rb]:
        return None
    axes = tuple(a for k in lc for a in ls.dims[k])
    out = ([ls.dims[k] for k in lb] + [d for k, d in enumerate(ls.dims) if k not in (*lc, *lb)]
           + [d for k, d in enumerate(rs.dims) if k not in (*rc, *rb)])
    return axes, Spec(tuple(out))


def _keeps_layout(graph: OpGraph, node: Node, index: int) -> list[int | None] | None:
    """For a reader that only moves dimensions around (``None`` otherwise): its result's
    dimension ``i`` is operand ``index``'s dimension ``perm[i]`` (``None``: a new dimension of
    size 1).  A ``reshape`` or ``reduce_sum`` that only adds or drops dimensions of size 1 is
    one (the bias gradient: a ``reduce_sum`` over the batch, reshaped to ``(1, n)``, summed
    over that 1)."""
    if node.kind is not NodeKind.OP or len(node.outputs) != 1 or node.eqn.effects:
        return None
    if node.name == "transpose":
        return list(node.eqn.params["permutation"])
    operand = node.inputs[index]
    assert not isinstance(operand, Const)  # a value of the graph: the contraction's, or after
    shape = graph.values[operand].shape
    out = graph.values[node.outputs[0]].shape
    if node.name in ("reshape", "reduce_sum") and len(node.inputs) == 1:
        if node.name == "reduce_sum" and any(shape[a] != 1 for a in node.eqn.params["axes"]):
            return None
        kept = [k for k, n in enumerate(shape) if n != 1]
        if [shape[k] for k in kept] != [n for n in out if n != 1]:
            return None
        source = iter(kept)
        return [None if n == 1 else next(source) for n in out]
    if node.name not in _KEEP:
        return None
    for k, o in enumerate(node.inputs):
        if k != index and (o.shape if isinstance(o, Const) else graph.values[o].shape) != ():
            return None
    if out != shape:
        return None
    return list(range(len(shape)))


def find_scatters(graph: OpGraph, plan: ShardingPlan
                  ) -> tuple[ShardingPlan, dict[int, Scatter]]:
    """``plan`` with every gradient the readers take split made split where it is made, and
    the contractions to lower by reduce-scatter (see the module docstring)."""
    decisions = list(plan.decisions)
    scatters: dict[int, Scatter] = {}
    for node in graph.nodes:
        if node.kind is not NodeKind.OP or not node.backward or len(node.outputs) != 1 or \
                node.name not in ("dot_general", "reduce_sum") or \
                any(isinstance(o, Const) for o in node.inputs):
            continue
        d = decisions[node.id]
        got = _contracted(node, d.in_specs)
        if got is None or not got[0] or got[1] != d.out_specs[0] or \
                set(got[0]) & set(d.out_specs[0].axes):
            continue
        found = _follow(graph, decisions, node, got[0])
        if found is None:
            continue
        scatter, chain = found
        scatters[node.id] = scatter
        for nid, (ins, outs) in chain.items():
            decisions[nid] = dataclasses.replace(decisions[nid], in_specs=ins, out_specs=outs)
    if not scatters:
        return plan, {}
    return dataclasses.replace(plan, decisions=tuple(decisions)), scatters


def _follow(graph: OpGraph, decisions: list[Any], node: Node, contracted: tuple[str, ...]
            ) -> tuple[Scatter, dict[int, tuple[tuple[Spec, ...], tuple[Spec, ...]]]] | None:
    """Follows ``node``'s result through layout-keeping readers to the readers that take it
    split; the scatter and the new (in, out) layouts of ``node`` and the operators between,
    or ``None`` when some reader takes it otherwise."""
    # (value, its dimension per dimension of node's result); breadth first over the readers
    frontier: list[tuple[int, list[int | None]]] = [
        (node.outputs[0], list(range(len(graph.values[node.outputs[0]].shape))))]
    # reader -> (operand index, the operand's dims, the result's dims)
    between: dict[int, tuple[int, list[int | None], list[int | None]]] = {}
    added: tuple[str, ...] | None = None
    dim: int | None = None
    while frontier:
        vid, dims = frontier.pop()
        value = graph.values[vid]
        spec = decisions[value.producer].out_specs[value.index]
        for use in graph.consumers[vid]:
            reader = graph.nodes[use.consumer]
            rd = decisions[reader.id]
            read = rd.in_specs[use.in_index]
            perm = _keeps_layout(graph, reader, use.in_index)
            if perm is not None and read == spec and rd.out_specs[0] == Spec(tuple(
                    () if p is None else spec.dims[p] for p in perm)) and \
                    reader.id not in between:
                moved = [None if p is None else dims[p] for p in perm]
                between[reader.id] = (use.in_index, dims, moved)
                frontier.append((reader.outputs[0], moved))
                continue
            # a reader that takes it split: one dimension gains contracted axes at its end
            grown = [k for k, (a, b) in enumerate(zip(spec.dims, read.dims, strict=True))
                     if a != b]
            if len(grown) != 1 or read.dims[grown[0]][:len(spec.dims[grown[0]])] != \
                    spec.dims[grown[0]]:
                return None
            extra = read.dims[grown[0]][len(spec.dims[grown[0]]):]
            if dims[grown[0]] is None or not set(extra) <= set(contracted) or (
                    added is not None and (extra != added or dims[grown[0]] != dim)):
                return None
            added, dim = extra, dims[grown[0]]
    if added is None or dim is None:
        return None

    def split(spec: Spec, k: int) -> Spec:
        return Spec(spec.dims[:k] + (spec.dims[k] + added,) + spec.dims[k + 1:])

    d = decisions[node.id]
    Layouts = tuple[tuple[Spec, ...], tuple[Spec, ...]]
    chain: dict[int, Layouts] = {node.id: (d.in_specs, (split(d.out_specs[0], dim),))}
    for nid, (index, operand_dims, dims) in between.items():
        rd = decisions[nid]
        ins = list(rd.in_specs)
        ins[index] = split(ins[index], operand_dims.index(dim))
        chain[nid] = (tuple(ins), (split(rd.out_specs[0], dims.index(dim)),))
    summed = tuple(a for a in contracted if a not in added)
    return Scatter(added, dim, summed), chain


def scatter_fn(node: Node, in_specs: tuple[Spec, ...], out_spec: Spec, scatter: Scatter,
               mesh: Mesh) -> Callable[..., Any]:
    """``f(*operands) -> result``: ``node`` lowered as a manual contraction and a
    reduce-scatter (see the module docstring)."""
    def local(*operands: Any) -> Any:
        (x,) = bind_equation(node.eqn, operands, here=True)
        names = scatter.axes if len(scatter.axes) > 1 else scatter.axes[0]
        x = jax.lax.psum_scatter(x, names, scatter_dimension=scatter.dim, tiled=True)
        return jax.lax.psum(x, scatter.summed) if scatter.summed else x

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(s.to_partition_spec() for s in in_specs),
                         out_specs=out_spec.to_partition_spec(), check_vma=False)
