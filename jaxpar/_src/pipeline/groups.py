"""Row groups: a stage's weight gradients reduced over the data-parallel axes once per step.

A micro-batch's rows are split over the data-parallel axes (``dp``, sometimes ``dp`` and ``tp``),
and a weight gradient contracts over the rows, so left to XLA every chunk's backward ends in an
all-reduce over those axes: one per micro-batch, inside the loop (XLA:CPU does not hoist it, and
JAX 0.10 keeps an array "unreduced" only on ``Explicit`` mesh axes).  Data parallelism reduces
once per step.  The loop does the same when it can prove it exact:

* the micro-batch's ``rows`` split into ``G`` groups, one per device of the row axes (group ``g``
  is the rows device ``g`` holds), and the chunk runs under ``jax.vmap`` over the groups
  (``spmd_axis_name``: the group dimension lies on the row axes) with the stage's weights
  broadcast to ``[G, ...]``: each group's weight gradient is its own, never summed with another
  group's, and the stage accumulates ``[G, ...]`` partial gradients; after the loop one sum over
  the group dimension (one all-reduce per gradient) makes the gradient;
* the chunk inside the ``vmap`` is the loss traced again at ``rows / G`` rows (shapes are static
  in a jaxpr), laid out as the stage's plan lays the micro-batch out, without the row axes
  (``vmap`` puts them on the group dimension).

Exact only if no row of one group meets a row of another in the chunk: :func:`row_groups` proves
it from the layer's operators, following the row dimension through each (elementwise, reshape,
transpose, broadcast, dot_general on a free or batch dimension, reductions over other
dimensions, ...).  Anything else (a batch-mean normalization, a reduction or contraction over the
rows, an operator it does not know, a loop over the rows, a layer weight the stage's plan splits
over the rows' axes) keeps the per-micro-batch reduction, and ``plan.pipeline.explain()``
says why.  Where the layers are grouped, the prologue's backward
and the epilogue (embedding, head, loss) run per group too when ``ends.py`` proves it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxpar._src.graph import OpGraph
from jaxpar._src.pipeline.layers import members
from jaxpar._src.pipeline.rowflow import RowDim, row_step
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.spec import MeshShape, Spec


@dataclasses.dataclass(frozen=True, eq=False)
class RowGroups:
    """How a pipeline's chunks run over the data-parallel groups of a micro-batch's rows.

    Attributes:
      axes: the mesh axes the rows are split over (the group dimension's layout); ``()`` when
        the micro-batch's rows are not split.
      size: ``G``, the number of groups (devices over ``axes``).
      graph: the loss traced at ``rows / G`` rows (``None``: not grouped).
      plan: the stage plan's layouts for ``graph``, without ``axes``.
      cuts: ``(kind, i, dim, n)``: the unstacked (``kind`` ``"r"``) or stacked (``"w"``)
        weight ``i`` is stretched over the rows along ``dim`` (a causal mask broadcast over
        the batch); each group reads its own ``n`` entries, those of its rows.
      why: one line for ``explain()``: grouped, or why not.
    """

    axes: tuple[str, ...]
    size: int
    graph: OpGraph | None
    plan: ShardingPlan | None
    cuts: tuple[tuple[str, int, int, int], ...]
    why: str

    @property
    def on(self) -> bool:
        return self.graph is not None


def row_groups(*, graph: OpGraph, plan: ShardingPlan, layer: Any, carried_in: Sequence[int],
               batch: Sequence[int], rest: Sequence[int], stacked: Sequence[int], rows: int,
               retrace: Callable[[int], OpGraph]) -> RowGroups:
    """Whether (and how) the chunks of a pipeline run per row group; see the module docstring.

    ``layer``: the representative layer (every layer runs its operators); ``carried_in`` and
    ``batch``: the value ids that carry the rows along dimension 0; ``rest``, ``stacked``: the
    unstacked weights the loop passes whole, the layer's stacked ones; ``retrace(r)``: the loss's
    graph traced with ``r`` rows per micro-batch.
    """
    mesh = plan.mesh

    def spec(vid: int) -> Spec:
        v = graph.values[vid]
        return plan.decisions[v.producer].out_specs[v.index]

    row_values = list(carried_in) + list(batch)
    firsts = {spec(v).dims[0] if spec(v).ndim else () for v in row_values}
    axes = next(iter(firsts)) if len(firsts) == 1 else None
    if axes is None:
        act = spec(row_values[0])
        seen = act.dims[0] if act.ndim else ()
        return RowGroups(seen, mesh.product(seen), None, None, (), "per micro-batch: the "
                         "stage's inputs split their rows over different axes")
    if not axes:
        return RowGroups((), 1, None, None, (), "the micro-batch's rows are not split: no "
                         "data-parallel gradient reduction")
    size = mesh.product(axes)
    per = "per micro-batch"
    if rows % size:
        return RowGroups(axes, size, None, None, (), f"{per}: {rows} rows do not split into "
                         f"{size} groups")
    bad = [v for v in row_values if not graph.values[v].shape or
           graph.values[v].shape[0] != rows]
    if bad:
        return RowGroups(axes, size, None, None, (), f"{per}: a value entering the layers "
                         f"(shape {graph.values[bad[0]].shape}) has no rows on dimension 0")
    try:
        small = retrace(rows // size)
    except Exception as e:  # noqa: BLE001 - any failure only keeps the old route
        return RowGroups(axes, size, None, None, (), f"{per}: the loss does not trace at "
                         f"{rows // size} rows ({type(e).__name__})")
    if len(small.nodes) != len(graph.nodes) or any(
            a.name != b.name or a.kind is not b.kind for a, b in zip(graph.nodes, small.nodes,
                                                                   strict=True)):
        return RowGroups(axes, size, None, None, (), f"{per}: the loss traced at "
                         f"{rows // size} rows is another program")
    why = _mixes_rows(graph, small, layer, {v: (0, 1) for v in row_values}, rows, size)
    if isinstance(why, str):
        return RowGroups(axes, size, None, None, (), f"{per}: {why}")
    if any(v not in rest and v not in stacked for v in why):
        return RowGroups(axes, size, None, None, (), f"{per}: the layers read a value "
                         f"stretched over the rows that is not a weight")
    # a weight split over the row axes: a group would hold a slice of it, not its own copy
    # (a value stretched over the rows, read per group from its own rows, is no weight here)
    split = [v for v in stacked if v not in why and set(axes) & {a for d in spec(v).dims
                                                                    for a in d}]
    if split:
        return RowGroups(axes, size, None, None, (), f"{per}: a layer weight (shape "
                         f"{graph.values[split[0]].shape}) is split over the row axes "
                         f"{'+'.join(axes)}, so no row group holds it whole")
    cuts = tuple(("w", stacked.index(v), e, n) if v in stacked else ("r", rest.index(v), e, n)
                 for v, (e, n) in why.items())
    return RowGroups(axes, size, small, _without(plan, small, axes), cuts,
                     f"summed per {'+'.join(axes)} group in the loop ({size} groups of "
                     f"{rows // size} rows; the layers never mix rows of two groups)")


def _without(plan: ShardingPlan, small: OpGraph, axes: tuple[str, ...]) -> ShardingPlan:
    """``plan``'s layouts for ``small`` without ``axes``, and without any axis that no longer
    divides its dimension."""
    mesh = plan.mesh
    decisions = []
    for d, node in zip(plan.decisions, small.nodes, strict=True):
        ins = tuple(_fit(s, small.operand_shape(o), mesh, axes)
                    for s, o in zip(d.in_specs, node.inputs, strict=False))
        outs = tuple(_fit(s, small.values[v].shape, mesh, axes)
                     for s, v in zip(d.out_specs, node.outputs, strict=False))
        decisions.append(dataclasses.replace(d, in_specs=ins + d.in_specs[len(ins):],
                                             out_specs=outs + d.out_specs[len(outs):]))
    return dataclasses.replace(plan, decisions=tuple(decisions))


def _fit(spec: Spec, shape: Sequence[int], mesh: MeshShape, drop: tuple[str, ...]) -> Spec:
    if spec.ndim == len(shape) + 1:  # the row dimension squeezed at 1 row (_squeezed)
        rows = next((e for e, d in enumerate(spec.dims) if set(d) & set(drop)), None)
        spec = Spec.replicated(len(shape)) if rows is None else \
            Spec(spec.dims[:rows] + spec.dims[rows + 1:])
    if spec.ndim != len(shape):
        return spec
    dims = []
    for size, dim_axes in zip(shape, spec.dims, strict=True):
        kept = [a for a in dim_axes if a not in drop]
        while kept and size % mesh.product(kept):
            kept.pop()
        dims.append(tuple(kept))
    return Spec(tuple(dims))


def strip(spec: Spec, drop: tuple[str, ...]) -> Spec:
    """``spec`` without the mesh axes ``drop``.

    >>> str(strip(Spec((("dp", "tp"), ())), ("dp",)))
    '[tp, -]'
    """
    return Spec(tuple(tuple(a for a in d if a not in drop) for d in spec.dims))



def gradient_scatters(groups: RowGroups, optimizer: Any, weights: Sequence[Any],
                      grid: tuple[int, ...], specs: Sequence[Spec], mesh: MeshShape
                      ) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """With the parallel optimizer on (ZeRO levels 1-3), the stacked weights whose gradients
    the loop sums over the row groups by reduce-scatter: ``(j, dim, axes)``, dimension ``dim``
    of ``[S, v, k, ...]`` split further over ``axes`` (row axes), where
    :func:`jaxpar._src.optimizer_parallel.optimizer_pins` splits the weight's moments, so the
    update reads its slice and no device holds the whole gradient (data parallel's
    :mod:`jaxpar._src.scatter`).  ``axes`` are all the row axes: a shard group of fewer
    (``optimizer_weight_shard_size``) keeps the all-reduce.  ``weights``: one layer's weights
    (avals), ``specs``: their stacked layouts, ``grid``: ``(S, v, k)``.

    >>> import jax, jaxpar
    >>> g = RowGroups(("dp",), 4, object(), None, (), "")  # grouped over dp
    >>> opt = jaxpar.OptimizerParallel(level=2, threshold_kb=0)
    >>> w = jax.ShapeDtypeStruct((16, 16), "float32")
    >>> gradient_scatters(g, opt, [w], (2, 1, 4), [Spec((("pp",), (), (), (), ()))],
    ...                   MeshShape(("dp", "pp"), (4, 2)))
    ((0, 2, ('dp',)),)
    """
    import jax
    import jax.numpy as jnp

    from jaxpar._src.optimizer_parallel import stacked_dim

    if not groups.on or optimizer is None or optimizer.level < 1:
        return ()
    stretched = {i for kind, i, _, _ in groups.cuts if kind == "w"}  # per row: no sum
    out = []
    for j, (w, spec) in enumerate(zip(weights, specs, strict=True)):
        if j in stretched or not jnp.issubdtype(w.dtype, jnp.inexact):
            continue
        stacked = jax.ShapeDtypeStruct(tuple(grid) + tuple(w.shape), w.dtype)
        dim, axes = stacked_dim(optimizer, stacked, strip(spec, groups.axes), groups.axes,
                                 mesh)
        # a shard group smaller than the row axes (optimizer_weight_shard_size) would leave
        # the other row groups unsummed: all-reduce, and the update takes its slice
        if axes and tuple(axes) == tuple(groups.axes):
            out.append((j, dim, axes))
    return tuple(out)

# -- the proof (its step, one operator: rowflow.py) ----------------------------------------------
def _mixes_rows(graph: OpGraph, small: OpGraph, layer: Any, seeds: dict[int, RowDim],
                rows: int, groups: int) -> str | dict[int, tuple[int, int]]:
    """Why the layer's operators may mix rows of two groups, or, if they never do, the values
    from outside the layer each group reads a slice of (:func:`_row_broadcast`).

    Follows every value's row dimension (``seeds``: the inputs') through the layer; a value
    that depends on no row is fine anywhere.  The graph traced at ``rows / groups`` rows must
    agree: a value with rows has that dimension ``groups`` times smaller there, any other value
    the same shape (so nothing is shaped by the row count without carrying rows: an ``iota``
    over the rows would number each group's rows from 0)."""
    state: dict[int, RowDim] = dict(seeds)
    sliced: dict[int, tuple[int, int]] = {}
    made = {v for top in layer.nodes for nid in members(graph, top)
            for v in graph.nodes[nid].outputs}
    for top in layer.nodes:
        for nid in members(graph, top):  # results into state, sliced outside values into sliced
            why = row_step(graph, small, nid, state, made, sliced, state, sliced, rows, groups)
            if why is not None:
                return why
    out = [state.get(v) for v in layer.act_out]
    if any(s != (0, 1) for s in out):
        return "the layer's output does not carry the rows on dimension 0"
    return sliced
