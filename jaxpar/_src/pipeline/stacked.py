"""``StackedParams``: a pipeline's layer weights kept stacked by stage, split over ``"pp"``.

A pipeline runs layer ``i`` on one stage only, but in one SPMD program a per-layer parameter is
an array on every device: laid out by the step's plan it is replicated over ``"pp"``, so every
stage holds every layer and the step moves the stacked gradients back to every stage (one
all-gather over ``"pp"`` of all layer weights per step).  The fix is the layout praxis, MaxText
and axlearn use: keep each pipelined weight as one array ``[S, v, k, ...]`` (stage, repeat,
slot; padding slots zero) split over ``"pp"`` on its first dimension, so a stage holds its own
layers only, and the optimizer updates them where they live.

:meth:`jaxpar.PipelineCell.stack` builds one from the per-layer parameters (in the layout of the
cell's pipeline); it is a pytree (optax states and updates built from it are ``StackedParams``
too), and the cell takes it where it took the parameters: the loop reads the stacked arrays as
they are, and the gradients come back stacked.  :meth:`StackedParams.unstack` gives the
per-layer parameters back (checkpoints, evaluation).  Parameters that are not the same weight
of every layer (embeddings, the head, derived weights) stay as they are.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._src.spec import Spec


@dataclasses.dataclass(frozen=True)
class StackLayout:
    """How per-layer leaves map to stacked arrays (hashable: a pytree's auxiliary data)."""

    treedef: Any  # of the per-layer parameters
    avals: tuple[tuple[tuple[int, ...], str], ...]  # every per-layer leaf: shape, dtype
    grid: tuple[int, int, int]  # S, v, k
    groups: tuple[tuple[int, ...], ...]  # per stacked array: the leaf in each slot (-1: pad)
    others: tuple[int, ...]  # the leaves kept as they are
    specs: tuple[Any, ...] = ()  # per stacked array, the Spec it was put with (stack())

    def leaf_avals(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(s, np.dtype(d)) for s, d in self.avals]


@jax.tree_util.register_pytree_node_class
class StackedParams:
    """Parameters whose pipelined layer weights are stacked ``[S, v, k, ...]`` over ``"pp"``.

    Made by :meth:`jaxpar.PipelineCell.stack`; see the module docstring.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> def loss(w, x):
    ...     for i in range(4):
    ...         x = jnp.tanh(x @ w[i])
    ...     return jnp.mean(x ** 2)
    >>> w, x = [jnp.ones((8, 8)) * 0.1 for _ in range(4)], jnp.ones((16, 8))
    >>> mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    >>> with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
    ...                                   pipeline_stages=2, micro_batches=4):
    ...     cell = jaxpar.PipelineCell(loss, batch_argnums=1)
    ...     sw = cell.stack(w, x)
    ...     step = jaxpar.parallelize(jax.value_and_grad(cell), batch_argnums=1)
    ...     value, grad = step(sw, x)
    >>> sw.stacked[0].shape, sw.stacked[0].sharding.spec[0], type(grad).__name__
    ((2, 1, 2, 8, 8), 'pp', 'StackedParams')
    >>> ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    >>> bool(jnp.allclose(value, ref_value)), bool(jnp.allclose(grad.unstack()[3], ref_grad[3]))
    (True, True)
    """

    def __init__(self, stacked: Sequence[Any], others: Sequence[Any],
                 layout: StackLayout) -> None:
        self.stacked = tuple(stacked)
        self.others = tuple(others)
        self.layout = layout

    def tree_flatten(self) -> tuple[tuple, StackLayout]:
        return (self.stacked, self.others), self.layout

    @classmethod
    def tree_unflatten(cls, layout: StackLayout, children: tuple) -> StackedParams:
        return cls(children[0], children[1], layout)

    def leaves(self) -> list[Any]:
        """The per-layer leaves: a stacked leaf is its slot of its stacked array.

        Traced (the cell's step), the slices are ops of the caller's program (a slice no one
        reads costs nothing there); eager, one jitted program slices every leaf (compiled
        once per layout, shapes and shardings, not one small program per leaf)."""
        out: list[Any] = [None] * len(self.layout.avals)
        for i, x in zip(self.layout.others, self.others, strict=True):
            out[i] = x
        groups = self.layout.groups
        if any(isinstance(a, jax.core.Tracer) for a in self.stacked):
            parts = _slices(groups, self.stacked)
        else:
            parts = _unstack_program(groups)(tuple(self.stacked))
        for leaf, x in zip((x for g in groups for x in g if x >= 0), parts, strict=True):
            out[leaf] = x
        return out

    def unstack(self) -> Any:
        """The per-layer parameters, as the user's pytree."""
        return jax.tree.unflatten(self.layout.treedef, self.leaves())

    def abstract(self) -> Any:
        """The per-layer parameters' shapes and dtypes, as the user's pytree."""
        return jax.tree.unflatten(self.layout.treedef, self.layout.leaf_avals())

    def __repr__(self) -> str:
        shapes = [tuple(a.shape) for a in self.stacked]
        return f"StackedParams(stacked={shapes}, others={len(self.others)} leaves)"


def stack_layout(program: Any, params: Any, offset: int) -> StackLayout:
    """The layout of ``params`` (one argument, whose leaves start at flat leaf ``offset`` of
    the cell's arguments) for ``program``: every stacked weight whose value in every layer is
    one of these leaves as it is."""
    leaves, treedef = jax.tree.flatten(params)
    groups = stack_groups(program, len(leaves), offset)
    taken = {x for g in groups.values() for x in g if x >= 0}
    S, v, k = program.slot_layer.shape
    avals = tuple((tuple(np.shape(x)), str(jnp.result_type(x))) for x in leaves)
    others = tuple(i for i in range(len(leaves)) if i not in taken)
    return StackLayout(treedef, avals, (S, v, k), tuple(groups.values()), others)


def stack_groups(program: Any, n: int, offset: int) -> dict[int, tuple[int, ...]]:
    """For each stacked position ``j`` of ``program`` whose value in every layer is one of the
    ``n`` leaves from flat leaf ``offset`` on, as it is or reshaped (a layer norm's ``[d]``
    scale read as ``[1, 1, d]``): that leaf in each slot (-1: pad)."""
    graph = program.graph
    leaf_of = {graph.nodes[nid].outputs[0]: i - offset for i, nid in enumerate(graph.inputs)
               if offset <= i < offset + n}
    groups: dict[int, tuple[int, ...]] = {}
    taken: set[int] = set()
    for j in range(len(program.stacked)):
        per_layer = [leaf_of.get(through_reshapes(graph, v)) for v in program.stacked_values(j)]
        found = [x for x in per_layer if x is not None]
        if len(found) != len(per_layer) or len(set(found)) != len(found) or taken & set(found):
            continue  # derived in the step, or one leaf in two places: stacked in the step
        taken |= set(found)
        groups[j] = tuple(found[s] if s >= 0 else -1
                          for s in program.slot_layer.reshape(-1).tolist())
    return groups


_RESHAPES = frozenset({"reshape", "broadcast_in_dim", "squeeze", "expand_dims"})


def through_reshapes(graph: Any, vid: int) -> int:
    """The value ``vid`` is a reshape of (same elements, same dtype), else ``vid``: stacking
    the source and reshaping the stack is the same array, with no data moved."""
    while True:
        v = graph.values[vid]
        node = graph.nodes[v.producer]
        if node.name not in _RESHAPES:
            return vid
        arrays = [o for o in node.inputs if isinstance(o, int)]
        if len(arrays) != 1 or len(node.inputs) != 1:
            return vid
        src = graph.values[arrays[0]]
        if int(np.prod(src.shape)) != int(np.prod(v.shape)) or src.dtype != v.dtype:
            return vid
        vid = src.id


def stack(layout: StackLayout, params: Any, shardings: Sequence[Any] | None = None
          ) -> StackedParams:
    """``params`` stacked in ``layout``; each stacked array put with ``shardings[i]``.

    One jitted program stacks every group (compiled once per layout, shapes and shardings):
    eager, each group's zeros, stack, reshape and put were small programs of their own."""
    leaves = jax.tree.leaves(params)
    if shardings is not None:
        shardings = tuple(shardings)
        specs = tuple(Spec.from_partition_spec(sh.spec, 3 + len(layout.avals[
            next(x for x in g if x >= 0)][0])) for sh, g in zip(shardings, layout.groups,
                                                                 strict=True))
        layout = dataclasses.replace(layout, specs=specs)
    used = [leaves[x] for g in layout.groups for x in g if x >= 0]
    stacked = _stack_program(layout.groups, layout.grid, shardings)(tuple(used))
    return StackedParams(stacked, [leaves[i] for i in layout.others], layout)


def _slices(groups: tuple[tuple[int, ...], ...], stacked: Sequence[Any]) -> list[Any]:
    """Every used slot of every stacked array, in the order of ``groups``' used slots."""
    parts: list[Any] = []
    for group, a in zip(groups, stacked, strict=True):
        flat = jnp.reshape(a, (len(group),) + tuple(a.shape[3:]))
        parts.extend(flat[slot] for slot, leaf in enumerate(group) if leaf >= 0)
    return parts


@functools.lru_cache(maxsize=64)
def _unstack_program(groups: tuple[tuple[int, ...], ...]) -> Callable:
    """:func:`_slices` as one jitted program (jit caches it per shapes and shardings)."""
    return jax.jit(lambda stacked: tuple(_slices(groups, stacked)))


@functools.lru_cache(maxsize=64)
def _stack_program(groups: tuple[tuple[int, ...], ...], grid: tuple[int, int, int],
                   shardings: tuple[Any, ...] | None) -> Callable:
    """One jitted program stacking the used leaves (in the order of ``groups``' used slots)
    into one ``[S, v, k, ...]`` array per group, zeros in the padding slots, each put with
    its sharding when given."""
    def run(used: tuple[Any, ...]) -> tuple[Any, ...]:
        it = iter(used)
        out = []
        for group in groups:
            given = {slot: next(it) for slot, x in enumerate(group) if x >= 0}
            first = next(iter(given.values()))
            zero = jnp.zeros_like(first)
            a = jnp.stack([given.get(slot, zero) for slot in range(len(group))])
            out.append(a.reshape(grid + tuple(jnp.shape(first))))
        return tuple(out)

    return jax.jit(run) if shardings is None else jax.jit(run, out_shardings=shardings)


def unstacked(tree: Any) -> Any:
    """``tree`` with every :class:`jaxpar.StackedParams` in it back as the per-layer
    parameters (what the network, a checkpoint and the next ``train`` call take)."""
    def is_stacked(x: Any) -> bool:
        return isinstance(x, StackedParams)

    return jax.tree.map(lambda x: x.unstack() if is_stacked(x) else x, tree,
                        is_leaf=is_stacked)


def copies_of(params: Any, trees: Any) -> int:
    """How many subtrees of ``trees`` are shaped like ``params`` (the same tree structure and
    leaf shapes: an optimizer state's copies of the parameters, Adam's moments; not its step
    count).

    >>> import jax.numpy as jnp, optax
    >>> p = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
    >>> copies_of(p, optax.adam(1e-3).init(p)), copies_of(p, (p, optax.sgd(1e-3).init(p)))
    (2, 1)
    """
    treedef: Any = jax.tree.structure(params)
    shapes = [np.shape(x) for x in jax.tree.leaves(params)]

    def like(x: Any) -> bool:
        return bool(treedef == jax.tree.structure(x)) and \
            [np.shape(y) for y in jax.tree.leaves(x)] == shapes

    return sum(like(x) for x in jax.tree.leaves(trees, is_leaf=like))
