"""The loss's tail per row group: its sum over the rows taken a group at a time, where exact.

Where the epilogue runs per row group (``ends.py``), its *tail* (the operators that read a
value mixing the rows of two groups: the loss's sum over the rows, its division by the count,
whatever reads them) ran on the whole micro-batch, so the sum's 4-byte scalar crossed the row
axes once per micro-batch: a collective's full latency inside the loop.  When the loss is
*affine in the sums over the rows*,

    loss = A(sum over rows of h) + b,   A linear,  b read from the weights alone,

each group can take its own part, ``A(sum over its rows of h)`` (the whole micro-batch's
constants: a mean still divides by the whole count), the loop accumulates those partials (and
feeds each its cotangent) per group, and one sum after the loop makes the loss; ``b`` (a
weight-decay term) runs once per micro-batch on the whole weights, as before, so it is counted
once, not once per group.

:func:`affine_tail` proves it over the tail's operators, classifying every value:

* ``FREE``: reads no rows (weights, constants, a weight-decay term);
* ``ROW``: a head value with the rows (per group: its own rows);
* ``LIN``: linear in the rows' sums (``reduce_sum`` of a ``ROW`` value over its rows; then
  ``neg``, reshapes, ``add``/``sub`` of two such, ``mul``/``div`` by a ``FREE`` value that reads
  no weight);
* ``AFF``: ``LIN`` plus a ``FREE`` term (``add``/``sub`` of one, and the linear operators above).

Anything else that reads a ``ROW``, ``LIN`` or ``AFF`` value (a ``log`` of a mean, a ``max`` over
the rows, a ratio of two sums, a scale read from a weight, a loop) keeps the tail on the whole
micro-batch, and ``explain()`` says which operator.  :func:`run_tail` evaluates the proven
tail's linear part (per group, ``FREE`` terms added dropped) or its offset (the sums zero).

:func:`run_tail` binds the tail's equations inside the loop's ``shard_map`` as they are, not
through the plan's lowering (``lower.py``), which turns a ``take_along_axis`` over a split
dimension into a masked sum (``masked_gather.py``: XLA's partitioner aborts the process on
that gather there).  No gather reaches it: the ``ROW``/``LIN``/``AFF`` operators it binds are
the sums over the rows and the linear operators above, and a gather reading the rows or a sum
over them is refused ("gather of the rows is not a sum over them"), which leaves the tail to
the plan.  A cross-entropy's label pick is per row, in the head (the plan's lowering), before
the tail's sum (``tests/test_pipeline_tail.py``; optax's loss over a vocabulary split on
``tp``: ``tests/test_pipeline_transpose.py``).  The ``FREE`` nodes run as a piece of the plan
(``Pieces.epilogue_part``); :func:`run_free` is for checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax.numpy as jnp

from jaxpar._src.compat import bind_equation
from jaxpar._src.graph import Const, NodeKind, OpGraph
from jaxpar._src.pipeline.layers import members

FREE, ROW, LIN, AFF = "free", "row", "lin", "aff"
NOT_A_SUM = "of the rows is not a sum over them"

# one operand, linear in it: a sum (or an affine value) stays one through them
LINEAR = frozenset("""neg copy copy_p reshape squeeze expand_dims broadcast_in_dim transpose
    reduce_sum sharding_constraint convert_element_type""".split())


@dataclasses.dataclass(frozen=True, eq=False)
class AffineTail:
    """The loss's tail, proven affine in the sums over the rows (:func:`affine_tail`).

    Attributes:
      kinds: the kind of every value the tail makes (``FREE``, ``LIN``, ``AFF``) and of the
        head values it reads (``ROW``).
      free: the tail's top-level nodes that read no rows, in order: run once, on the whole
        micro-batch's weights.
      rows: the others, in order: their linear part per group, their offset once.
      reads: the ``FREE`` values (made by ``free``, weights, batch-free values) ``rows`` read.
      out: the loss's value id.
      offset: whether the loss adds a term that reads no rows (``AFF``: weight decay).
    """

    kinds: Mapping[int, str]
    free: tuple[int, ...]
    rows: tuple[int, ...]
    reads: tuple[int, ...]
    out: int
    offset: bool


def affine_tail(graph: OpGraph, nodes: Sequence[int], bound: Mapping[int, int],
                rest: Collection[int], weights: Collection[int], out: Any,
                stops: Mapping[int, str] | None = None) -> AffineTail | str:
    """The tail ``nodes`` (top-level, in order) as an :class:`AffineTail`, or why not.

    ``bound``: the head's values the tail reads, with their row dimension; ``rest``: the value
    ids of the weights passed whole, ``weights`` those differentiated (a ``FREE`` value that
    reads one must not scale a sum: its gradient would be summed over the groups inside the
    loop); ``out``: the loss; ``stops``: why the head's proof left each tail node out (said
    where a node reads the rows and is no sum over them).

    >>> import jax.numpy as jnp
    >>> g, h, w, out = _example(lambda h, w: jnp.mean(h) + jnp.sum(w ** 2))
    >>> t = affine_tail(g, _ops(g), {h: 0}, {w}, {w}, out)
    >>> t.offset, [g.nodes[i].name for i in t.rows]  # the decay once, the mean per group
    (True, ['reduce_sum', 'div', 'add'])
    >>> g, h, w, out = _example(lambda h, w: jnp.log(jnp.mean(h)))
    >>> affine_tail(g, _ops(g), {h: 0}, {w}, {w}, out).split(" (")[0]
    'log of a sum over the rows is not affine'
    """
    kinds: dict[int, str] = {v: ROW for v in bound}
    weighty: set[int] = set(weights)
    made = {v for top in nodes for v in graph.nodes[top].outputs}
    free: list[int] = []
    rows: list[int] = []
    for top in nodes:
        node = graph.nodes[top]
        ins = _inputs(graph, top)
        for o in ins:
            if o not in kinds and o not in made and o not in rest and \
                    graph.nodes[graph.values[o].producer].kind is not NodeKind.CONST:
                return (f"{node.name} ({node.source}) reads rows the epilogue's head does not "
                        f"make (a batch input or a layer's output)")
        if all(kinds.get(o, FREE) == FREE for o in ins):
            free.append(top)
            for v in node.outputs:
                kinds[v] = FREE
                if any(o in weighty for o in ins):
                    weighty.add(v)
            continue
        if node.kind is not NodeKind.OP or node.structure is not None:
            return f"the loss's tail reads the rows in a {node.name} ({node.source})"
        kind = _kind(graph, top, [FREE if isinstance(o, Const) else kinds.get(o, FREE)
                                  for o in node.inputs], bound, weighty)
        if kind not in (LIN, AFF):
            if kind.endswith(NOT_A_SUM) and stops and top in stops:
                return f"{kind}: the head stops at {stops[top]}"
            return f"{kind} ({node.source})"
        rows.append(top)
        kinds |= {v: kind for v in node.outputs}
    if isinstance(out, Const) or kinds.get(out) not in (LIN, AFF):
        return "the loss is not a sum over the rows"
    reads = sorted({o for top in rows for o in graph.nodes[top].inputs
                    if not isinstance(o, Const) and kinds.get(o, FREE) == FREE})
    return AffineTail(kinds, tuple(free), tuple(rows), tuple(reads), out, kinds[out] == AFF)


def _inputs(graph: OpGraph, top: int) -> list[int]:
    """The value ids a top-level node (and what it nests) reads from outside itself."""
    inner = members(graph, top)
    made = {v for n in inner for v in graph.nodes[n].outputs}
    return [o for n in inner for o in graph.nodes[n].inputs
            if not isinstance(o, Const) and o not in made]


def _kind(graph: OpGraph, nid: int, kinds: list[str], bound: Mapping[int, int],
          weighty: set[int]) -> str:
    """An operator's result kind from its operands' (``LIN`` or ``AFF``), or why it is not
    affine in the sums over the rows."""
    node = graph.nodes[nid]
    name = node.name
    live = [k for k in kinds if k != FREE]
    if name == "reduce_sum" and kinds[0] == ROW:
        dim = bound[node.inputs[0]]  # type: ignore[index]
        axes = tuple(node.eqn.params["axes"])
        return LIN if dim in axes else "reduce_sum keeps the rows apart in the loss's tail"
    if ROW in live:
        return f"{name} {NOT_A_SUM}"
    if name in LINEAR:
        if name == "convert_element_type" and not _linear_convert(graph, node):
            return "convert_element_type rounds a sum over the rows"
        return live[0]
    if name in ("add", "sub"):
        if FREE in kinds:
            return AFF
        return AFF if AFF in live else LIN
    if name in ("mul", "div"):
        if len(live) == 2:
            return f"{name} of two sums over the rows is not affine"
        if name == "div" and kinds[0] == FREE:
            return "div by a sum over the rows is not affine"
        if name == "div" and not jnp.issubdtype(graph.values[node.outputs[0]].dtype,
                                                jnp.inexact):
            return "div rounds a sum over the rows (integer division: each group's part)"
        scale = node.inputs[kinds.index(FREE)]
        if not isinstance(scale, Const) and scale in weighty:
            return (f"{name} scales a sum over the rows by a value read from a weight (its "
                    f"gradient would sum over the groups in the loop)")
        return live[0]
    return f"{name} of a sum over the rows is not affine"


def _linear_convert(graph: OpGraph, node: Any) -> bool:
    """A conversion keeps a sum exact when it widens within floats or within integers (a
    narrowing one rounds each group's part instead of the whole sum; float to integer
    truncates)."""
    src = jnp.dtype(graph.values[node.inputs[0]].dtype)
    dst = jnp.dtype(graph.values[node.outputs[0]].dtype)
    for kind in (jnp.floating, jnp.signedinteger):
        if jnp.issubdtype(src, kind) and jnp.issubdtype(dst, kind):
            return dst.itemsize >= src.itemsize and (kind is not jnp.floating or
                                                    jnp.finfo(dst).nmant >= jnp.finfo(src).nmant)
    return False


def run_tail(graph: OpGraph, tail: AffineTail, env: Mapping[int, Any], *, linear: bool
             ) -> Any:
    """The loss from a proven tail: its linear part (``linear``: ``env`` holds one group's
    ``ROW`` values and the ``FREE`` values ``tail.reads``; a ``FREE`` term added is dropped, so
    the groups' parts sum to the linear part of the whole) or its offset (the sums over the
    rows zero; ``env`` holds ``tail.reads``).  Binds the whole micro-batch's equations, so a
    mean divides by the whole count.

    >>> import jax.numpy as jnp
    >>> g, h, w, out = _example(lambda h, w: jnp.mean(h) + w)
    >>> t = affine_tail(g, _ops(g), {h: 0}, {w}, {w}, out)
    >>> float(run_tail(g, t, {h: jnp.ones(2), w: 5.0}, linear=True))  # 2 of 8 rows: 2 / 8
    0.25
    >>> float(run_tail(g, t, {w: 5.0}, linear=False))
    5.0
    """
    env = dict(env)
    kinds = tail.kinds
    for nid in tail.rows:
        node = graph.nodes[nid]
        kind = [FREE if isinstance(o, Const) else kinds.get(o, FREE) for o in node.inputs]
        out = graph.values[node.outputs[0]]
        if node.name == "reduce_sum" and kind[0] == ROW and not linear:
            env[out.id] = jnp.zeros(out.shape, out.dtype)
            continue
        ins = [o.value if isinstance(o, Const) else env[o] for o in node.inputs]
        if linear and node.name in ("add", "sub") and FREE in kind:
            i = 1 - kind.index(FREE)  # the sum; the term added once is the offset's
            x = -ins[i] if node.name == "sub" and i == 1 else ins[i]
            env[out.id] = jnp.broadcast_to(jnp.asarray(x, out.dtype), out.shape)
            continue
        env[out.id] = bind_equation(node.eqn, ins, here=True)[0]
    return env[tail.out]


def run_free(graph: OpGraph, tail: AffineTail, env: Mapping[int, Any]) -> dict[int, Any]:
    """The ``FREE`` values ``tail.rows`` read (``tail.reads``), from ``env`` (the weights) and
    the tail's ``free`` nodes, unconstrained (the loop runs them as a piece of its plan,
    ``Pieces.epilogue_part``; this is for checks)."""
    env = dict(env)
    for nid in tail.free:
        node = graph.nodes[nid]
        if node.kind is NodeKind.CONST:
            env[node.outputs[0]] = jnp.asarray(node.constant)
            continue
        ins = [o.value if isinstance(o, Const) else env[o] for o in node.inputs]
        env.update(zip(node.outputs, bind_equation(node.eqn, ins, here=True), strict=True))
    return {v: env[v] for v in tail.reads}


def _example(fn: Any) -> tuple[OpGraph, int, int, Any]:
    """``fn(h, w)`` traced at ``h: [8]``, ``w: []`` (the docstrings' examples): its graph,
    ``h``'s and ``w``'s value ids and the loss operand."""
    from jaxpar._src.trace import trace

    g = trace(fn, [jnp.ones(8), jnp.ones(())]).graph
    h, w = (g.nodes[i].outputs[0] for i in g.inputs)
    return g, h, w, g.nodes[g.outputs[0]].inputs[0]


def _ops(graph: OpGraph) -> list[int]:
    return [n.id for n in graph.nodes if n.kind is NodeKind.OP]
