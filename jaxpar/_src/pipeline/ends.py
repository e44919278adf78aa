"""The prologue and epilogue per row group: their weight gradients reduced once per step.

Where the layers run per data-parallel row group (``groups.py``), the prologue (the embedding:
a gather of each row's tokens, the position embedding) and the epilogue (final norm, head,
loss) can too, so that the embedding's, the head's and the final norm's gradients are summed
over the groups once after the loop instead of all-reduced once per micro-batch inside it:

* the prologue's backward runs under ``jax.vmap`` over the groups (the loss traced at
  ``rows / G`` rows), the weights it reads broadcast to ``[G, ...]``; exact if no operator of
  it mixes rows of two groups (the same proof as the layers', operator by operator:
  :func:`rowflow.row_step`, which knows the embedding's ``gather``);
* the epilogue ends in the loss, which mixes every row (a mean over the rows and tokens).  It
  splits in two: the *head*, every operator before the first that mixes rows, runs per group
  (its weights broadcast to ``[G, ...]``); the *tail*, the operators that read a mixed value
  (the loss's sum over the rows and its division by the count), runs on the whole
  micro-batch, from the head's values put back together (``[G, rows / G, ...] -> [rows,
  ...]``: no data moves).  The tail is the loss traced at the full ``rows``, so a mean divides
  by the full count, not by ``rows / G``, and whatever the tail does with the rows (a batch
  statistic) sees them all: exact by construction.  Its cotangent flows into each group's
  head, whose weight gradient is that group's own.

Where ``tail.py`` proves the tail affine in the sums over the rows (a mean cross-entropy, plus
a weight-decay term), it runs per group too: each group takes its rows' part of the loss (the
whole micro-batch's constants), the loop accumulates the parts per group and sums them after
it, so no scalar crosses the row axes inside the loop; elsewhere (a ``log`` of a mean, a
``max`` over the rows) the tail runs on the whole micro-batch as above and ``explain()`` says
why.  The tail differentiates the weights it reads on the whole micro-batch, as before: a
weight-decay term added to the loss is exact and needs no reduction over the rows.  When only
the tail reads weights (a head after a batch normalization: their gradients contract over the
mixed rows) nothing is gained and the epilogue stays per micro-batch; ``plan.pipeline
.explain()`` says why, as it does for a prologue that mixes rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jaxpar._src.graph import Const, OpGraph
from jaxpar._src.pipeline.groups import strip
from jaxpar._src.pipeline.layers import members
from jaxpar._src.pipeline.rowflow import MIXED, SQUEEZED, RowDim, row_step
from jaxpar._src.pipeline.tail import AffineTail, affine_tail
from jaxpar._src.spec import MeshShape, Spec


@dataclasses.dataclass(frozen=True, eq=False)
class EndGroups:
    """How the prologue's backward and the epilogue run per row group.

    Attributes:
      prologue: the prologue's backward runs per group.
      epilogue: the epilogue's head runs per group, its tail on the whole micro-batch.
      head, tail: the epilogue's top-level nodes in each part, in order.
      bound: ``(value id, row dimension)`` of the head's values the tail reads.
      pro_cuts, epi_cuts: ``(rest index, dim)`` of the rest values stretched over the rows
        that each group reads its own slice of (a mask broadcast over the batch).
      grouped: rest indices whose gradients a group accumulates on its own (``[G, ...]``).
      layers: of ``grouped``, those the layers read (a weight every layer shares): the
        chunk's vmap takes them per group too.
      only: of ``grouped``, those no part reads whole (a prologue or epilogue not grouped,
        the loss's tail): the loop keeps no per-micro-batch accumulator for them.
      why_prologue, why_epilogue: one line each for ``explain()``.
      affine: the tail proven affine in the sums over the rows (``tail.py``): it runs per
        group too, the loss's parts summed after the loop; ``None``: on the whole micro-batch.

    >>> EndGroups(epilogue=True, grouped=(2,)).on  # the weight at rest index 2 per group
    True
    >>> EndGroups(why_epilogue="per micro-batch: the layers are not grouped").on
    False
    """

    prologue: bool = False
    epilogue: bool = False
    head: tuple[int, ...] = ()
    tail: tuple[int, ...] = ()
    bound: tuple[RowDim, ...] = ()
    pro_cuts: tuple[tuple[int, int], ...] = ()
    epi_cuts: tuple[tuple[int, int], ...] = ()
    grouped: tuple[int, ...] = ()
    layers: tuple[int, ...] = ()
    only: tuple[int, ...] = ()
    why_prologue: str = ""
    why_epilogue: str = ""
    affine: AffineTail | None = None

    @property
    def on(self) -> bool:
        return bool(self.grouped)


def end_groups(*, graph: OpGraph, small: OpGraph | None, rows: int, size: int,
               pro_nodes: Sequence[int], epi_nodes: Sequence[int], pro_seeds: Sequence[int],
               pro_outs: Sequence[int], epi_seeds: Sequence[int], rest: Sequence[int], out: Any,
               floats: Sequence[bool], layer_reads: Sequence[int] = ()) -> EndGroups:
    """Whether the prologue and epilogue run per row group; see the module docstring.

    ``small``: the loss traced at ``rows / size`` rows (``None``: the layers are not grouped,
    nor are the ends); ``pro_seeds`` / ``epi_seeds``: the values with rows on dimension 0 each
    part reads (the batch; the carried values and the batch), ``pro_outs`` the prologue's
    (the carried values); ``rest``: the weights passed
    whole, ``floats`` which have gradients; ``out``: the loss's operand; ``layer_reads``:
    the rest indices the (grouped) layers read whole, not a slice per group.
    """
    per = "per micro-batch"
    if small is None:
        why = f"{per}: the layers are not grouped"
        return EndGroups(why_prologue=why, why_epilogue=why)
    where = {v: i for i, v in enumerate(rest)}
    layers = {i for i in layer_reads if floats[i]}
    grouped: set[int] = set(layers)
    pro_cuts: tuple[tuple[int, int], ...] = ()

    pro = _follow(graph, small, pro_nodes, {v: (0, 1) for v in pro_seeds}, rows, size,
                  tail_ok=False)
    if not isinstance(pro, str) and any(pro[0].get(v) != (0, 1) for v in pro_outs):
        pro = "a value entering the layers does not carry the rows on dimension 0"
    if isinstance(pro, str):
        why_pro, pro_on = f"{per}: {pro}", False
    else:
        _, sliced, _ = pro
        pro_cuts = tuple((where[v], e) for v, (e, _) in sliced.items())
        read = _reads(graph, pro_nodes)
        grouped |= {where[v] for v in read if v in where and floats[where[v]]
                    and v not in sliced}
        why_pro, pro_on = (f"runs per group (its {len(pro_nodes)} operators keep rows "
                           f"apart)"), True

    epi = _epilogue(graph, small, epi_nodes, epi_seeds, rows, size, where, floats, out)
    # the weights some part reads whole: their gradients accumulate per micro-batch too
    whole = set() if pro_on else set(_reads(graph, pro_nodes))
    if isinstance(epi, str):
        whole |= set(_reads(graph, epi_nodes))
        return EndGroups(pro_on, False, pro_cuts=pro_cuts, grouped=tuple(sorted(grouped)),
                         layers=tuple(sorted(layers)), only=_only(grouped, whole, where),
                         why_prologue=why_pro, why_epilogue=f"{per}: {epi}")
    whole |= set(_reads(graph, epi.tail))
    epi_cuts = tuple((where[v], e) for v, (e, _) in epi.sliced.items())
    grouped |= {where[v] for v in _reads(graph, epi.head) if v in where and floats[where[v]]
                and v not in epi.sliced}
    note = (f"; {len(epi.late)} weight(s) it reads after mixing rows per micro-batch"
            if epi.late else "")
    proof = affine_tail(graph, epi.tail, dict(epi.bound), where,
                        {v for v, i in where.items() if floats[i]}, out, epi.stops)
    affine = None if isinstance(proof, str) else proof
    if affine is None:
        why_epi = (f"runs per group up to the loss's reduction over the rows (its last "
                   f"{len(epi.tail)} operators on the whole micro-batch, its sum crossing the "
                   f"row axes each micro-batch: {proof}){note}")
    else:
        once = ", a term without rows added once" if affine.offset else ""
        why_epi = (f"runs per group, the loss's tail too (affine in the sums over the rows: "
                   f"each group's part of the loss summed after the loop{once}){note}")
    return EndGroups(pro_on, True, epi.head, epi.tail, epi.bound, pro_cuts, epi_cuts,
                     tuple(sorted(grouped)), tuple(sorted(layers)),
                     _only(grouped, whole, where), why_pro, why_epi, affine)


def end_scatters(ends: EndGroups, axes: tuple[str, ...], optimizer: Any,
                 weights: Sequence[Any], specs: Sequence[Spec], mesh: MeshShape
                 ) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
    """With the parallel optimizer on (ZeRO levels 1-3), the grouped rest weights whose
    gradients the loop sums over the row groups by reduce-scatter: ``(rest index, dim,
    axes)``, dimension ``dim`` split further over the row axes ``axes``, as the stacked
    weights' are (:func:`groups.gradient_scatters`), so no device holds the whole gradient
    after the loop.

    The step's plan splits such a weight's moments on dimension 0 over the data-parallel axes
    (:func:`jaxpar._src.optimizer_parallel.optimizer_pins`: by default the batch's, every mesh
    axis in mesh order, the weight itself unpinned): a gradient split over ``axes`` is only
    worth it where that split refines it (its axes begin with ``axes``), so each device's
    slice of the moments lies in its slice of the gradient and the update reads it with no
    more communication.  ``dim`` is the first dimension longer than 1: a rest value made
    from the weight by adding leading dimensions of 1 (``p[None, None]``) is split as the
    weight's dimension 0.  Elsewhere (too small, indivisible, a weight already split on that
    dimension) the gradient is all-reduced as before.  ``weights``: the rest's avals,
    ``specs``: their layouts for one micro-batch.

    >>> import jax, jaxpar
    >>> e = EndGroups(epilogue=True, grouped=(0, 1))
    >>> opt = jaxpar.OptimizerParallel(level=1, threshold_kb=0)
    >>> w = [jax.ShapeDtypeStruct((24, 8), "float32"), jax.ShapeDtypeStruct((4, 8), "float32")]
    >>> end_scatters(e, ("dp",), opt, w, [Spec(((), ()))] * 2, MeshShape(("dp", "pp"), (4, 2)))
    ((0, 0, ('dp',)),)
    """
    if not ends.on or optimizer is None or optimizer.level < 1 or not axes:
        return ()
    out = []
    for i in ends.grouped:
        shape, spec = tuple(weights[i].shape), strip(specs[i], axes)
        dim = next((d for d, n in enumerate(shape) if n > 1), None)
        if dim is None or spec.dims[dim]:
            continue
        split = optimizer.split_axes(shape[dim:], weights[i].dtype,
                                     Spec.replicated(len(shape) - dim), mesh.names, mesh)
        if tuple(split[:len(axes)]) == tuple(axes):
            out.append((i, dim, tuple(axes)))
    return tuple(out)


def _only(grouped: set[int], whole: set[int], where: dict[int, int]) -> tuple[int, ...]:
    """The grouped rest indices no part reads whole (``whole``: value ids)."""
    return tuple(sorted(grouped - {where[v] for v in whole if v in where}))


@dataclasses.dataclass(frozen=True)
class _Split:
    """The epilogue split at the loss's reduction over the rows (:func:`_epilogue`).

    Attributes:
      head: the top-level nodes run per group, in order.
      tail: those run on the whole micro-batch (the loss's reduction and what follows it,
        with the row-free head values they read recomputed), in order.
      bound: ``(value id, row dimension)`` of the head's values the tail reads.
      sliced: the values from outside stretched over the rows that the head reads a group's
        slice of (value id -> row dimension).
      late: rest indices of the weights the tail reads after mixing rows (differentiated on
        the whole micro-batch).
      stops: why each tail node that mixes rows (or reads mixed ones) left the head.
    """

    head: tuple[int, ...]
    tail: tuple[int, ...]
    bound: tuple[RowDim, ...]
    sliced: dict[int, RowDim]
    late: tuple[int, ...]
    stops: dict[int, str] = dataclasses.field(default_factory=dict)


def _epilogue(graph: OpGraph, small: OpGraph, nodes: Sequence[int], seeds: Sequence[int],
              rows: int, size: int, where: dict[int, int], floats: Sequence[bool], out: Any
              ) -> str | _Split:
    """The epilogue's head, tail, boundary and sliced values, or why it is not grouped."""
    if isinstance(out, Const):
        return "the loss is a constant"
    found = _follow(graph, small, nodes, {v: (0, 1) for v in seeds}, rows, size, tail_ok=True)
    assert not isinstance(found, str)
    state, sliced, stops = found
    tail_set = set(stops)
    if state.get(out) != MIXED:
        return "the loss does not reduce over the rows"
    made = {v: top for top in nodes for nid in members(graph, top)
            for v in graph.nodes[nid].outputs}
    # the tail recomputes the row-free head values it reads (weights' work, constants); the
    # head keeps them too, for its own reads
    mixed = set(tail_set)
    while True:
        more = {made[v] for top in tail_set for v in _reads(graph, [top])
                if v in made and made[v] not in tail_set and state.get(v) is None}
        if not more:
            break
        tail_set |= more
    head = tuple(n for n in nodes if n not in mixed)
    late = [(v, top) for top in sorted(tail_set) for v in _reads(graph, [top])
            if v in where and floats[where[v]] and _reads_rows(graph, top, state)]
    if late and not any(v in where and floats[where[v]] for v in _reads(graph, head)):
        v, top = late[0]
        # the first node that left the head says why (the rest read it): where a node that
        # keeps rows apart is in the tail, that is what to look at
        first = min(stops)
        return (f"the loss reads its weights after mixing rows ({graph.values[v].shape} in "
                f"{graph.nodes[top].name}, {graph.nodes[top].source}; the rows mix first at "
                f"{stops[first]})")
    tail = tuple(n for n in nodes if n in tail_set)
    bound = sorted({v for top in tail for v in _reads(graph, [top])
                    if v in made and made[v] not in tail_set})
    bad = [v for v in bound if state.get(v) in (None, MIXED)]
    assert not bad, bad  # the closure above moved the row-free ones into the tail
    squeezed = [v for v in bound if state[v][1] == SQUEEZED]
    if squeezed:  # the head's value for the tail has no row dimension at 1 row per group
        return (f"the loss's tail reads a value the trace at {rows // size} row(s) shapes "
                f"without its rows ({graph.values[squeezed[0]].shape})")
    return _Split(head, tail, tuple((v, state[v][0]) for v in bound),
                  {v: s for v, s in sliced.items() if any(v in _reads(graph, [t]) for t in head)},
                  tuple(sorted({where[v] for v, _ in late})), stops)


def _reads_rows(graph: OpGraph, top: int, state: dict[int, RowDim]) -> bool:
    """Whether a node depends on rows (reads a value with rows or mixed rows)."""
    return any(state.get(v) is not None for v in _reads(graph, [top]))


def _reads(graph: OpGraph, tops: Sequence[int]) -> list[int]:
    """The values the nodes ``tops`` (and their members) read."""
    return [o for top in tops for nid in members(graph, top)
            for o in graph.nodes[nid].inputs if not isinstance(o, Const)]


def _follow(graph: OpGraph, small: OpGraph, nodes: Sequence[int], seeds: dict[int, RowDim],
            rows: int, groups: int, *, tail_ok: bool
            ) -> str | tuple[dict[int, RowDim], dict[int, RowDim], dict[int, str]]:
    """Every value's row dimension through ``nodes`` (``groups.py``'s proof, a top-level node
    at a time): ``(state, sliced, tail)``, or why a node mixes rows.  With ``tail_ok`` a node
    that mixes rows, or reads a value that does, joins ``tail`` (its values :data:`MIXED`;
    ``tail``: node -> why)."""
    state: dict[int, RowDim] = dict(seeds)
    sliced: dict[int, RowDim] = {}
    tail: dict[int, str] = {}
    made = {v for top in nodes for nid in members(graph, top)
            for v in graph.nodes[nid].outputs}
    for top in nodes:
        local: dict[int, RowDim] = {}
        cut: dict[int, RowDim] = {}
        why = None
        for nid in members(graph, top):
            why = row_step(graph, small, nid, state | local, made, sliced | cut, local, cut,
                            rows, groups)
            if why is not None:
                break
        if why is None:
            state |= local
            sliced |= cut
        elif tail_ok:
            tail[top] = why
            state |= {v: MIXED for nid in members(graph, top) for v in graph.nodes[nid].outputs}
        else:
            return why
    return state, sliced, tail
