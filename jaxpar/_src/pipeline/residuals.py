"""A chunk's backward residuals: which leaves of its pullback the tick loop stores per
micro-batch, found by tracing the chunk's forward once.

The pullback of ``jax.vjp`` is a pytree whose leaves are the residuals.  A leaf that is one of
the chunk's weights or batch inputs is taken live in the backward; one that depends on the
activation or the batch is stored in a slot (with the layout it was constrained to where it was
made); one that depends on neither (a weight-only product) is recomputed.  ``loop.py`` runs the
probe once per loop and reads the answer from :class:`Residuals`.
"""

from __future__ import annotations

import dataclasses
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
