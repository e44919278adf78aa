"""ZeRO levels 1-3: a split gradient made by reduce-scatter, not by all-reduce and a slice.

With the parallel optimizer on, the optimizer state (levels 1-2) and the parameters too (level
3, FSDP) are split on dimension 0 over the data-parallel axes, so the update reads each weight
gradient split the same way.  The plan makes that gradient where the backward pass sums over
the batch (a ``dot_general`` or ``reduce_sum`` whose contracted dimensions are split over the
data-parallel axes; a ``scatter-add`` of the batch's rows into an embedding table whose
updates are): whole (an all-reduce), then, after a few layout-keeping operators (a transpose,
Adam's ``(1 - b1) * g`` and ``g ** 2``), read split (a local slice).  XLA:GPU's
``reduce_scatter_creator`` pass turns that all-reduce and slice into a reduce-scatter; XLA:CPU
has none, and moves 3Ψ where ZeRO moves 2Ψ (4Ψ where FSDP moves 3Ψ).

:func:`find_scatters` finds such sums and the layout-keeping operators after them, and
rewrites the lowering's copy of the plan so that they carry the split layout from the sum on;
the sum itself is then lowered as a ``jax.shard_map`` manual over every mesh axis, in the
plan's operand layouts: the local contraction (scatter-add: into the table on one device of
the group, zeros on the others), then ``jax.lax.psum_scatter(..., tiled=True)`` over the axes
the readers add (and ``psum`` over any other contracted axis).  ``psum_scatter`` lowers to an
HLO ``reduce-scatter`` on every backend.  Manual over every axis, not only the data-parallel
ones: with the other axes automatic, XLA's partitioner gathers the result over them before the
reduce-scatter (seen on a (2, 4) mesh).

A weight read twice (a layer applied twice, an embedding tied to the output projection) gets
the sum of two such gradients (``add_any``).  Reduce-scattering each would move twice the
bytes of one; instead the terms, each reached through linear operators (a transpose, a scalar
factor), stay *partial sums*: each device keeps its own, stacked on a new leading dimension
split over the contracted axes (no collective, no copy: the stacked array is laid out as the
devices hold it), and the ``add_any`` adds them on each device and reduce-scatters once.

The plan does it when it is made (``scatter_plan.py``), at levels 1 to 3: its layouts are
those :func:`find_scatters` returns (partial sums in the layout of their local sums:
:func:`unstacked`), its predicted collectives and step time price the reduce-scatters, and it
keeps the nodes (``plan.scatters``), which the lowering (``lower.py``, ``annotate.py``) lowers
with :func:`scatter_fn`, the partial sums stacked again (:func:`restacked`).

>>> import jax.numpy as jnp, optax, jaxpar
>>> tx, p = optax.adam(0.1), {"w": jnp.ones((16, 16))}
>>> def step(p, s, x):  # w read twice: one reduce-scatter of the sum of its two gradients
...     g = jax.grad(lambda p: jnp.sum((jnp.tanh(x @ p["w"]) @ p["w"]) ** 2))(p)
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
import functools
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
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
    """How one node is lowered: scatter its result's dimension ``dim`` over ``axes``
    (``psum_scatter``), sum it over ``summed`` (``psum``).

    Gradient sums (a weight used twice: ``add_any`` of two contractions) are made locally
    first: the nodes of such a sum hold *partial sums*, one per device of the contracted axes
    (``axes + summed``), stacked on a new leading dimension split over those axes, so each
    device keeps its own; ``partials`` are the operands of this node that arrive so,
    ``partial`` says the result stays so (the node runs no collective; ``axes``, ``dim`` and
    ``summed`` then say what the node that ends the sum will do, ``dim`` in this node's
    result)."""

    axes: tuple[str, ...]
    dim: int
    summed: tuple[str, ...]
    partials: tuple[int, ...] = ()
    partial: bool = False


def _contracted(node: Node, in_specs: tuple[Spec, ...]) -> tuple[tuple[str, ...], Spec] | None:
    """The mesh axes the contraction of ``node`` is split over, and the layout its local
    result has; ``None`` when the operands' layouts do not line up."""
    p = node.eqn.params
    if node.name == "scatter-add":  # the embedding's gradient: updates summed into a table
        return _scattered(node, in_specs)
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


def _scattered(node: Node, in_specs: tuple[Spec, ...]
               ) -> tuple[tuple[str, ...], Spec] | None:
    """:func:`_contracted` of a ``scatter-add``: the axes its updates' scatter (batch)
    dimensions are split over, the indices' batch dimensions split alike, the table whole on
    the dimensions the indices pick and as the updates' windows on the others."""
    dn = node.eqn.params["dimension_numbers"]
    if len(in_specs) != 3 or dn.operand_batching_dims:
        return None
    table, indices, updates = in_specs
    batch = [k for k in range(len(updates.dims)) if k not in dn.update_window_dims]
    # JAX puts the index vector last in the indices
    if [indices.dims[k] for k in range(len(indices.dims) - 1)] != \
            [updates.dims[k] for k in batch] or indices.dims[-1]:
        return None
    windows = [k for k in range(len(table.dims)) if k not in dn.inserted_window_dims]
    if [table.dims[k] for k in windows] != [updates.dims[k] for k in dn.update_window_dims] \
            or any(table.dims[k] for k in dn.inserted_window_dims):
        return None
    return tuple(a for k in batch for a in updates.dims[k]), table


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
    if node.name not in _KEEP and not _identity(node):
        return None
    for k, o in enumerate(node.inputs):
        if k != index and (o.shape if isinstance(o, Const) else graph.values[o].shape) != ():
            return None
    if out != shape:
        return None
    return list(range(len(shape)))


def _identity(node: Node) -> bool:
    """A ``reshard`` XLA never sees: its destination on an empty or all-``Auto`` mesh, which
    JAX lowers to nothing (``mlir.lower_with_sharding_in_types``).  JAX's transpose of an
    ``add`` ends a gradient in one (``x * (1 + scale)``: Gemma's RMSNorm); a ``reshard`` that
    pins a layout (an ``Explicit`` or manual mesh) is not one."""
    if node.name != "reshard":
        return False
    mesh = getattr(node.eqn.params.get("dst_sharding"), "mesh", None)
    return mesh is not None and (mesh.empty or mesh.are_all_axes_auto)


# Linear operators a partial sum passes on its way to a sum of gradients (a sum of partial
# sums is the partial sum of the sum); their other operands are scalars.  Not a conversion:
# a bfloat16 partial sum converted and added in float32 rounds otherwise than one device (and
# XLA's all-reduce, which adds before it rounds).
_LINEAR = frozenset({"transpose", "neg", "copy", "copy_p", "mul"})
_SOURCES = ("dot_general", "reduce_sum", "scatter-add")


def find_scatters(graph: OpGraph, plan: ShardingPlan
                  ) -> tuple[ShardingPlan, dict[int, Scatter]]:
    """``plan`` with every gradient the readers take split made split where it is made, and
    the nodes to lower by reduce-scatter (see the module docstring)."""
    decisions = list(plan.decisions)
    # partial sums: value -> (its contracted axes, the layout of its local sums)
    partial: dict[int, tuple[tuple[str, ...], Spec]] = {}
    operands: dict[int, tuple[int, ...]] = {}  # node -> the operands that are partial sums
    for node in graph.nodes:
        if node.kind is not NodeKind.OP or not node.backward or len(node.outputs) != 1:
            continue
        d = decisions[node.id]
        if node.name in _SOURCES and not any(isinstance(o, Const) for o in node.inputs):
            got = _contracted(node, d.in_specs)
            if got is not None and got[0] and got[1] == d.out_specs[0] and \
                    not set(got[0]) & set(d.out_specs[0].axes):
                partial[node.outputs[0]] = got[0], got[1]
                operands[node.id] = ()
            continue
        found = _sum_step(graph, node, d, partial)
        if found is not None:
            partial[node.outputs[0]] = found[0], d.out_specs[0]
            operands[node.id] = found[1]
    scatters: dict[int, Scatter] = {}
    for vid, (contracted, _) in partial.items():
        uses = graph.consumers[vid]
        if len(uses) == 1 and uses[0].consumer in operands and \
                uses[0].in_index in operands[uses[0].consumer]:
            continue  # a term of a sum: made by the node that ends it
        node = graph.nodes[graph.values[vid].producer]
        # a chain of linear operators without a sum is followed from its start (the
        # contraction), through the layout-keeping operators, as a lone gradient is
        while operands[node.id] and node.name != "add_any":
            term = node.inputs[operands[node.id][0]]
            node = graph.nodes[graph.values[term].producer]  # type: ignore[index]
        followed = _follow(graph, decisions, node, contracted)
        if followed is None:
            continue
        scatter, chain = followed
        scatters[node.id] = dataclasses.replace(scatter, partials=operands[node.id])
        for nid, (ins, outs) in chain.items():
            decisions[nid] = dataclasses.replace(decisions[nid], in_specs=ins, out_specs=outs)
        _stack_terms(graph, decisions, node.id, scatter, operands, partial, scatters)
    if not scatters:
        return plan, {}
    return dataclasses.replace(plan, decisions=tuple(decisions)), scatters


def unscattered(spec: Spec, scatter: Scatter) -> Spec:
    """The layout of a contraction's result before ``scatter`` split dimension ``dim`` further
    over its axes (they end that dimension's axes)."""
    dims = spec.dims[scatter.dim]
    kept = dims[:len(dims) - len(scatter.axes)]
    assert kept + scatter.axes == dims, (spec, scatter)
    return Spec(spec.dims[:scatter.dim] + (kept,) + spec.dims[scatter.dim + 1:])


def unstacked(plan: ShardingPlan, scatters: dict[int, Scatter]) -> ShardingPlan:
    """``plan`` (as :func:`find_scatters` returns it) with each partial sum in the layout of
    its local sums, not stacked: the layouts of the graph's own values, which the plan keeps
    and prices (a partial sum moves nothing).  :func:`restacked` undoes it."""
    return _stacking(plan, scatters, lambda spec, _: Spec(spec.dims[1:]))


def restacked(plan: ShardingPlan) -> ShardingPlan:
    """``plan`` with its partial sums (``plan.scatters``) stacked again, as the lowering
    holds them (see :class:`Scatter`)."""
    def stack(spec: Spec, s: Scatter) -> Spec:
        stacked = s.axes + s.summed
        return Spec(((stacked,) if stacked else ((),)) + spec.dims)

    return _stacking(plan, dict(plan.scatters), stack)


def _stacking(plan: ShardingPlan, scatters: dict[int, Scatter],
              change: Callable[[Spec, Scatter], Spec]) -> ShardingPlan:
    if not any(s.partial or s.partials for s in scatters.values()):
        return plan
    decisions = list(plan.decisions)
    for nid, s in scatters.items():
        d = decisions[nid]
        ins = tuple(change(spec, s) if k in s.partials else spec
                    for k, spec in enumerate(d.in_specs))
        outs = (change(d.out_specs[0], s),) + d.out_specs[1:] if s.partial else d.out_specs
        decisions[nid] = dataclasses.replace(d, in_specs=ins, out_specs=outs)
    return dataclasses.replace(plan, decisions=tuple(decisions))


def _sum_step(graph: OpGraph, node: Node, d: Any,
              partial: dict[int, tuple[tuple[str, ...], Spec]]
              ) -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """Whether ``node`` adds partial sums (``add_any``) or passes one on linearly, each its
    only reader, in the layouts they have: their contracted axes and the operands' indices."""
    terms = tuple(k for k, o in enumerate(node.inputs) if not isinstance(o, Const) and
                  o in partial and len(graph.consumers[o]) == 1)
    if not terms:
        return None
    axes = {partial[node.inputs[k]][0] for k in terms}  # type: ignore[index]
    if len(axes) != 1 or any(d.in_specs[k] != partial[node.inputs[k]][1]  # type: ignore[index]
                             for k in terms):
        return None
    if node.name == "add_any":
        if len(terms) != len(node.inputs) or d.out_specs[0] != d.in_specs[0]:
            return None
    elif (node.name not in _LINEAR and not _identity(node)) or len(terms) != 1:
        return None
    else:
        perm = _keeps_layout(graph, node, terms[0])
        spec = d.in_specs[terms[0]]
        if perm is None or None in perm or d.out_specs[0] != Spec(tuple(
                spec.dims[p] for p in perm if p is not None)):
            return None
    return axes.pop(), terms


def _stack_terms(graph: OpGraph, decisions: list[Any], nid: int, scatter: Scatter,
                 operands: dict[int, tuple[int, ...]],
                 partial: dict[int, tuple[tuple[str, ...], Spec]],
                 scatters: dict[int, Scatter]) -> None:
    """Marks the nodes whose partial sums node ``nid`` adds up (through linear operators) to
    keep them so, stacked (see :class:`Scatter`), and their layouts in ``decisions``."""
    stacked = scatter.axes + scatter.summed

    def stack(spec: Spec) -> Spec:
        return Spec(((stacked,) if stacked else ((),)) + spec.dims)

    todo = [(nid, scatter.dim)]
    while todo:
        at, dim = todo.pop()
        node, d = graph.nodes[at], decisions[at]
        ins = list(d.in_specs)
        for k in operands[at]:
            term = graph.values[node.inputs[k]]  # type: ignore[index]
            ins[k] = stack(partial[term.id][1])
            perm = _keeps_layout(graph, node, k) if node.name != "add_any" else None
            tdim = dim if perm is None else perm[dim]
            assert tdim is not None
            td = decisions[term.producer]
            decisions[term.producer] = dataclasses.replace(
                td, out_specs=(stack(td.out_specs[0]),))
            scatters[term.producer] = Scatter(scatter.axes, tdim, scatter.summed,
                                              operands[term.producer], partial=True)
            todo.append((term.producer, tdim))
        decisions[at] = dataclasses.replace(d, in_specs=tuple(ins))


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
            if reader.kind is NodeKind.CONTROL:
                # a ``cond``'s or loop's own node lists its operands to order the graph and
                # has no layouts; its enter nodes (consumers too) are the readers
                continue
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
    reduce-scatter (see the module docstring), or as a step of a sum of partial sums."""
    stacked = scatter.axes + scatter.summed  # the axes a partial sum differs over

    def local(*operands: Any) -> Any:
        xs = [x[0] if k in scatter.partials else x for k, x in enumerate(operands)]
        if node.name == "scatter-add":  # the table, once over the devices that add
            first = functools.reduce(operator.and_, [
                jax.lax.axis_index(a) == 0 for a in stacked])
            xs[0] = jnp.where(first, xs[0], jnp.zeros_like(xs[0]))
        (x,) = bind_equation(node.eqn, xs, here=True)
        if scatter.partial:
            return x[None]
        names = scatter.axes if len(scatter.axes) > 1 else scatter.axes[0]
        x = jax.lax.psum_scatter(x, names, scatter_dimension=scatter.dim, tiled=True)
        return jax.lax.psum(x, scatter.summed) if scatter.summed else x

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(s.to_partition_spec() for s in in_specs),
                         out_specs=out_spec.to_partition_spec(), check_vma=False)
