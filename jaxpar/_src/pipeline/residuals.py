"""A chunk's backward residuals: which leaves of its pullback the tick loop stores per
micro-batch, found by tracing the chunk's forward once.

The pullback of ``jax.vjp`` is a pytree whose leaves are the residuals.  A leaf that is one of
the chunk's weights or batch inputs is taken live in the backward; one that depends on the
activation or the batch is stored in a slot (with the layout it was constrained to where it was
made); one that depends on neither (a weight-only product) is recomputed.  ``loop.py`` runs the
probe once per loop and reads the answer from :class:`Residuals`.

Before the loop exists, the split's memory check (``early.py``) needs a layer's stored
residuals per candidate split: :func:`layer_stored` asks JAX the same question of one layer
(the leaves of ``jax.vjp`` of the layer's nodes, sorted as the probe sorts a chunk's), once
per build.  Every operator result of the layer, the count it replaced, was 1.9x what the
probe stores on the bench's GPT (26.1 KiB against 13.9): JAX keeps neither a linear
operator's result (adds, reshapes, transposes, sums, selects) nor a product's (it keeps the
operands), and keeps factors its JVP rules make (``rsqrt``'s, ``1 - tanh(x)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar._src.pipeline import arrays as ar
from jaxpar._src.spec import Spec


@dataclasses.dataclass
class Residuals:
    """Which leaves of a chunk's pullback to keep, found by tracing it once."""

    treedef: Any = None
    x_avals: list[Any] = dataclasses.field(default_factory=list)
    kinds: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    stored: list[Any] = dataclasses.field(default_factory=list)  # avals of stored leaves
    specs: list[Spec | None] = dataclasses.field(default_factory=list)
    # the leaves a stored chunk would keep, recomputing too: what its backward remakes
    # (memory.py counts them)
    full: list[Any] = dataclasses.field(default_factory=list)
    full_specs: list[Spec | None] = dataclasses.field(default_factory=list)


def probe(tick: Any, carried0: Any) -> None:
    """Traces one chunk's forward to learn its pullback's leaves: which are the weights or
    the batch (taken live in the backward), which depend on the activation or the batch
    (stored), and which on neither (recomputed).  Recomputing (the chunk's input stored
    alone) it traces the chunk all the same: the leaves it would store are what the backward
    remakes within a tick (``res.full``, counted by ``memory.py``)."""
    pieces, res, rest = tick.pieces, tick.res, tick.rest
    res.x_avals = list(carried0)
    a0 = tick.active[0]
    batch_m = [b[0] for b in tick.batch]
    w0, x_in, b_in = tick.inputs([w[0] for w in tick.weights],
                                  [jnp.zeros(a.shape, a.dtype) for a in carried0], batch_m)
    res.x_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in x_in]
    chunk = tick.chunk_fn(a0, batch_m)

    def leaves_of(w: list, x: list, r: list, b: list) -> list:
        def f(w: list, x: list, rr: list, bb: list) -> list:
            return chunk(w, x, ar.merge(rest, rr), bb)

        _, pull = jax.vjp(f, w, x, r, b)
        leaves, res.treedef = jax.tree.flatten(pull)
        ids: dict[int, tuple[str, int]] = {}
        for kind, group in (("w", w), ("r", r), ("b", b)):
            for j, v in enumerate(group):
                if v is not None:
                    ids.setdefault(id(v), (kind, j))
        res.kinds = [ids.get(id(leaf), ("?", -1)) for leaf in leaves]
        return leaves

    x0 = [jnp.zeros(a.shape, a.dtype) for a in res.x_avals]
    floats_r = ar.floats(rest)
    closed = jax.make_jaxpr(leaves_of)(w0, x0, floats_r, b_in)
    n_w, n_x = len(w0), len(x0)
    n_r = len(jax.tree.leaves(floats_r))
    invars = closed.jaxpr.invars
    tainted = set(invars[n_w:n_w + n_x]) | set(invars[n_w + n_x + n_r:])
    dirty = taint(closed.jaxpr, tainted)
    producers = {v: e for e in closed.jaxpr.eqns for v in e.outvars}
    kinds, stored, specs = [], [], []
    for (kind, j), out in zip(res.kinds, closed.jaxpr.outvars, strict=True):
        if kind != "?":
            kinds.append((kind, j))
        elif is_literal(out) or out not in dirty:
            kinds.append(("recompute", -1))
        else:
            kinds.append(("store", -1))
            stored.append(out.aval)
            producer = producers.get(out)
            specs.append(sharding_spec(producer, list(producer.outvars).index(out))
                         if producer is not None else None)
    res.kinds, res.stored, res.specs = kinds, stored, specs
    res.full, res.full_specs = stored, specs
    if tick.recompute:  # only the chunk's input is kept; the backward runs the forward again
        res.x_avals = list(carried0)
        res.stored = list(carried0)
        res.specs = [pieces.spec(v) for v in pieces.p.carried_in]


def taint(jaxpr: Any, tainted: set) -> set:
    """Variables of ``jaxpr`` that depend on ``tainted``: through a ``scan`` or a ``cond``
    output by output (a layer stack's weight-only residuals stay clean, and so do those of a
    padded split's slots, each run under a ``lax.cond`` on its flag), through other nested
    equations as a whole."""
    dirty = set(tainted)
    for eqn in jaxpr.eqns:
        ins = [not is_literal(v) and v in dirty for v in eqn.invars]
        if not any(ins):
            continue
        if eqn.primitive.name == "scan":
            dirty.update(v for v, d in zip(eqn.outvars, scan_taint(eqn, ins), strict=True)
                         if d)
        elif eqn.primitive.name == "cond":
            dirty.update(v for v, d in zip(eqn.outvars, cond_taint(eqn, ins), strict=True)
                         if d)
        else:
            dirty.update(eqn.outvars)
    return dirty


def scan_taint(eqn: Any, ins: list[bool]) -> list[bool]:
    """Which outputs of a scan depend on its tainted operands (carries to a fixed point)."""
    from jaxpar._src.compat import scan_counts

    body = eqn.params["jaxpr"].jaxpr
    nc, nk = scan_counts(eqn.params)
    flags = list(ins)
    while True:
        inner = taint(body, {v for v, d in zip(body.invars, flags, strict=True) if d})
        outs = [not is_literal(v) and v in inner for v in body.outvars]
        grown = [f or (nc <= i < nc + nk and outs[i - nc]) for i, f in enumerate(flags)]
        if grown == flags:
            return outs
        flags = grown


def cond_taint(eqn: Any, ins: list[bool]) -> list[bool]:
    """Which outputs of a cond depend on its tainted operands: all of them where the branch
    index does, else those that depend on them in some branch."""
    if ins[0]:
        return [True] * len(eqn.outvars)
    outs = [False] * len(eqn.outvars)
    for branch in eqn.params["branches"]:
        body = branch.jaxpr
        inner = taint(body, {v for v, d in zip(body.invars, ins[1:], strict=True) if d})
        outs = [o or (not is_literal(v) and v in inner)
                for o, v in zip(outs, body.outvars, strict=True)]
    return outs


def is_literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def sharding_spec(eqn: Any, index: int = 0) -> Spec | None:
    """The layout a residual was constrained to where it was made, if it was (a scan's
    stacked output: its body's layout under a leading unsplit dimension)."""
    if eqn is None:
        return None
    if eqn.primitive.name == "scan":
        from jaxpar._src.compat import scan_counts

        body = eqn.params["jaxpr"].jaxpr
        if index < scan_counts(eqn.params)[1]:
            return None  # a carry: not stacked
        out = body.outvars[index]
        producer = next((e for e in body.eqns if out in e.outvars), None)
        inner = sharding_spec(producer, list(producer.outvars).index(out)) if producer \
            else None
        return None if inner is None else Spec(((),) + inner.dims)
    if eqn.primitive.name != "sharding_constraint":
        return None
    spec = getattr(eqn.params["sharding"], "spec", None)
    if spec is None:
        return None
    return Spec.from_partition_spec(spec, len(eqn.outvars[0].aval.shape))


# (id of the graph, the layer's nodes) -> (the graph, each stored leaf: its aval and the value
# id whose layout it takes, or None)
_LAYER_LEAVES: dict[tuple[int, tuple[int, ...]], tuple[Any, list[tuple[Any, int | None]]]] = {}


def layer_stored(graph: Any, plan: Any, mesh: Any, layer: Any, *, stacked: Sequence[int],
                 shared: Sequence[int], carried: Sequence[int], rest: Sequence[int],
                 batch: Sequence[int]) -> list[tuple[Any, Spec | None]]:
    """One layer's stored residuals per micro-batch, before the loop exists: the leaves of
    ``jax.vjp`` of the layer's nodes (JAX's own rule for what a backward needs), sorted as
    :func:`probe` sorts a chunk's, with the layout each takes: ``(aval, spec)``.

    The layer's nodes run unconstrained (``evaluate_nodes(constrain=False)``: a third fewer
    equations to trace than the probe's constrained chunk) on abstract arguments: its stacked
    weights (``stacked``: positions in ``layer.weights``), its carried values (``layer.act_in``
    then ``shared``, shaped as ``carried``), the floating ``rest`` and ``batch``, all
    differentiated as the probe differentiates a chunk.  A leaf that is a weight, rest or
    batch input is read live; one that depends on neither a carried value nor the batch is
    recomputed; the rest are stored.  A stored leaf that is a value of the layer (an
    operator's result, found as the same variable among the values the layer returns as
    auxiliary outputs) takes that value's layout in ``plan``; one the JVP rules make (``1 -
    tanh(x)``, ``y**-2``) takes the layout of the same-shaped value of the layer it is
    computed from, else ``None`` (the caller's rows rule).  Cached per graph and layer."""
    key = (id(graph), tuple(layer.nodes))
    hit = _LAYER_LEAVES.get(key)
    if hit is None or hit[0] is not graph:
        hit = _LAYER_LEAVES[key] = (graph, _trace_layer(graph, plan, mesh, layer, stacked,
                                                        shared, carried, rest, batch))
        while len(_LAYER_LEAVES) > 64:
            _LAYER_LEAVES.pop(next(iter(_LAYER_LEAVES)))

    def spec(vid: int) -> Spec:
        v = graph.values[vid]
        return plan.decisions[v.producer].out_specs[v.index]

    return [(aval, None if vid is None else spec(vid)) for aval, vid in hit[1]]


def _trace_layer(graph: Any, plan: Any, mesh: Any, layer: Any, stacked: Sequence[int],
                 shared: Sequence[int], carried: Sequence[int], rest: Sequence[int],
                 batch: Sequence[int]) -> list[tuple[Any, int | None]]:
    """:func:`layer_stored`'s leaves: ``(aval, value id of its layout or None)``."""
    from jaxpar._src.graph import NodeKind
    from jaxpar._src.lower import evaluate_nodes
    from jaxpar._src.pipeline.layers import members

    def aval(vid: int) -> Any:
        return jax.ShapeDtypeStruct(graph.values[vid].shape, graph.values[vid].dtype)

    def inexact(vid: int) -> bool:
        return bool(jnp.issubdtype(graph.values[vid].dtype, jnp.inexact))

    w_ids = [layer.weights[j] for j in stacked]
    x_ids = list(layer.act_in) + list(shared)
    r_ids = [v for v in rest if inexact(v)]
    r_fixed = [v for v in rest if not inexact(v)]
    b_ids = [v for v in batch if inexact(v)]
    b_fixed = [v for v in batch if not inexact(v)]
    ops = [v for top in layer.nodes for nid in members(graph, top)
           if graph.nodes[nid].kind is NodeKind.OP for v in graph.nodes[nid].outputs]
    made: list[int] = []  # the operator results the layer's evaluation holds (not a body's)

    def leaves(w: list, x: list, r: list, b: list, fixed: list) -> tuple[list, list]:
        def f(w: list, x: list, r: list, b: list) -> tuple[list, list]:
            env = dict(zip(w_ids + x_ids + r_ids + b_ids + r_fixed + b_fixed,
                           w + x + r + b + fixed, strict=True))
            evaluate_nodes(graph, plan, mesh, layer.nodes, env, constrain=False)
            made[:] = [v for v in ops if v in env]
            return [env[v] for v in layer.act_out], [env[v] for v in made]

        _, pull, values = jax.vjp(f, w, x, r, b, has_aux=True)
        return jax.tree.leaves(pull), values

    args = ([aval(v) for v in w_ids], [aval(v) for v in carried], [aval(v) for v in r_ids],
            [aval(v) for v in b_ids], [aval(v) for v in r_fixed + b_fixed])
    closed = jax.make_jaxpr(leaves)(*args)
    jaxpr = closed.jaxpr
    n_w, n_x, n_r, n_b = (len(a) for a in args[:4])
    n_leaves = len(jaxpr.outvars) - len(made)
    invars = jaxpr.invars
    live = set(invars[:n_w]) | set(invars[n_w + n_x:])
    # stored: what depends on a carried value or the batch, as the probe sorts them
    dirty = taint(jaxpr, set(invars[n_w:n_w + n_x]) | set(invars[n_w + n_x + n_r:][:n_b]))
    of: dict[Any, int] = {}  # a jaxpr variable -> the layer value (or carried input) it is
    for v, vid in zip(jaxpr.outvars[n_leaves:], made, strict=True):
        if not is_literal(v):
            of.setdefault(v, vid)
    for v, vid in zip(invars[n_w:n_w + n_x], x_ids, strict=True):
        of.setdefault(v, vid)
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    out: list[tuple[Any, int | None]] = []
    for v in jaxpr.outvars[:n_leaves]:  # a leaf twice is stored twice, as the loop does
        if is_literal(v) or v in live or v not in dirty:
            continue
        out.append((jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype),
                    _layout_source(v, of, producers)))
    return out


def _layout_source(v: Any, of: dict[Any, int], producers: dict[Any, Any]) -> int | None:
    """The layer value whose layout ``v`` takes: itself, else the nearest same-shaped value
    it is computed from (walking back through the equations that make it)."""
    shape = tuple(v.aval.shape)
    todo, seen = [v], {v}
    while todo:
        u = todo.pop(0)
        if u in of and tuple(u.aval.shape) == shape:
            return of[u]
        eqn = producers.get(u)
        for w in eqn.invars if eqn is not None else ():
            if not is_literal(w) and w not in seen:
                seen.add(w)
                todo.append(w)
    return None
