"""The tick loop: one SPMD program that runs a whole pipeline schedule.

Inside ``jax.shard_map`` over ``"pp"`` only (the other mesh axes stay automatic, so the plan's
data and tensor parallelism inside a stage is XLA's to partition), every device is one stage
``s = axis_index("pp")`` and plays its column of the schedule's tick table.  Per tick:

1. store what arrived (an activation from stage ``s - 1``, a cotangent from stage ``s + 1``) in
   the slots the table names;
2. the forward task, if any: stage 0 runs the prologue on its micro-batch for chunk 0, every
   stage runs its chunk (its stacked layer weights), the last chunk also runs the epilogue with
   its backward (``jax.vjp``: loss and the cotangent to start this micro-batch's backward);
   the chunk's backward residuals go to a slot;
3. the backward task, if any: the chunk's pullback from its stored residuals (``jax.vjp``
   pullbacks are pytrees: their leaves are the residuals), weight gradients accumulate in the
   stage's own stacked slots; chunk 0 continues into the prologue's backward;
4. ``ppermute`` the activation to ``s + 1`` and the cotangent to ``s - 1`` (XLA's
   collective-permute), round the ring for interleaved chunks.

Idle tasks are skipped with ``lax.cond`` (a bubble costs no compute) and write only to a scratch
slot, so nothing a bubble holds reaches a result: tests fill bubbles with NaN to prove it.  One
``scan`` runs each phase of the table (GPipe: forwards, then backwards; 1F1B: warm-up, steady
state, cool-down) with only the code that phase needs.  Weight gradients stay on their stage;
the loss and the gradients of the unstacked weights are summed over ``"pp"`` at the end.

Where ``groups.py`` proves the layers keep the rows of a micro-batch apart, a chunk's forward
and backward run under ``jax.vmap`` over the data-parallel row groups with the weights broadcast
per group, and a stage accumulates per-group weight gradients ``[v, G, k, ...]``: summed over
the groups (one all-reduce over the row axes) after the loop, not once per micro-batch in it
(those reshapes and accumulators: ``grouped.py``).
Where ``ends.py`` proves it, the prologue's backward and the epilogue's head run per group too
(the loss's reduction over the rows on the whole micro-batch, or per group as well where
``tail.py`` proves the loss affine in it: the loss's parts accumulate ``[G]`` and are summed
after the loop), and the unstacked weights they and the layers read (embedding, head, final
norm, a weight every layer shares) accumulate ``[G, ...]`` gradients, summed after the loop as
well; elsewhere they are reduced per micro-batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar._src.pipeline import arrays as ar
from jaxpar._src.pipeline.config import AXIS
from jaxpar._src.pipeline.ends import EndGroups
from jaxpar._src.pipeline.grouped import GroupedArrays
from jaxpar._src.pipeline.groups import RowGroups, strip
from jaxpar._src.pipeline.memory import record
from jaxpar._src.pipeline.pieces import Pieces
from jaxpar._src.pipeline.residuals import Residuals, probe
from jaxpar._src.pipeline.slots import SlotTables
from jaxpar._src.pipeline.tail import run_tail
from jaxpar._src.spec import Spec

LOOP_NAME = "jaxpar_pipeline_loop"  # the shard_map body's name: how outer.py knows it
LOOP_SCOPE = "jaxpar_pipeline_"  # the name scope around a pipeline's loop, + its program id


def make_loop(program: Any, *, backward: bool, fill: float = 0.0) -> Callable:
    """``run(weights, rest, batch)`` for ``program``: the shard_map'd tick loop.

    ``weights``: stacked layer weights ``[S, v, k, ...]``; ``rest``: the other weights;
    ``batch``: micro-batched inputs ``[M, mb, ...]``.  Returns the loss, and with ``backward``
    also the stacked weight gradients, the other weights' gradients and the batch gradients
    (floating inputs only).  ``fill`` is what bubbles and empty slots hold.
    """
    sched = program.schedule if backward else program.forward_schedule
    tables = SlotTables.of(sched)
    pieces = Pieces(program)
    S, M = program.config.stages, program.config.micro_batches
    scale = 1.0 / M if program.config.reduction == "mean" else 1.0
    recompute = program.config.residuals == "recompute"
    fwd_perm = [(i, (i + 1) % S) for i in range(S)]
    bwd_perm = [(i, (i - 1) % S) for i in range(S)]
    w_local = [Spec(((), ()) + program.spec(program.rep_layer.weights[j]).dims)
               for j in program.stacked]
    carried_specs = [program.spec(v) for v in program.carried_in]
    groups = program.groups if backward and program.groups.on else None
    ends = program.ends if groups is not None and (program.ends.on or
                                                   program.ends.affine is not None) else None
    if groups is not None:  # the gradient accumulators: [v, G, k, ...], G on the row axes
        stretched = {i for kind, i, _, _ in groups.cuts if kind == "w"}  # per row: no G
        w_local = [sp if j in stretched else
                   Spec(((), groups.axes) + strip(sp, groups.axes).dims[1:])
                   for j, sp in enumerate(w_local)]

    def body(weights: list, rest: list, batch: list) -> Any:
        s = jax.lax.axis_index(AXIS)
        weights = [w[0] for w in weights]  # this stage's [v, k, ...]
        active = jnp.asarray(program.active)[s]  # [v, k]
        rows = {k: jnp.asarray(t) for k, t in tables.tables.items()}
        carried0 = jax.eval_shape(lambda: pieces.prologue(rest, [b[0] for b in batch]))

        def buf(shapes: Sequence[Any], slots: int, specs: Sequence[Spec | None]) -> list:
            return [ar.constrain(pieces, ar.filled(a, fill, (slots + 1,)), sp, lead=1)
                    for a, sp in zip(shapes, specs, strict=True)]

        res = Residuals()
        ctx = _Tick(pieces, program, weights, active, rest, batch, s, res, scale,
                    recompute, fill, fwd_perm, bwd_perm, w_local, carried_specs, groups,
                    ends)
        if backward:
            probe(ctx, carried0)
            record(program, res.stored, res.specs, res.full, res.full_specs)
        carry: dict[str, Any] = {
            "act": buf(carried0, tables.act_slots, carried_specs),
            "in_act": [ar.filled(a, fill) for a in carried0],
            "loss": jnp.zeros((), program.loss_dtype),
        }
        if backward:
            carry |= {
                "ct": buf(carried0, tables.ct_slots, carried_specs),
                "in_ct": [ar.filled(a, fill) for a in carried0],
                "res": buf(res.stored, tables.res_slots, res.specs),
                "g_w": [ctx.grad_zeros(j, w) for j, w in enumerate(weights)],
                "g_rest": ctx.rest_zeros(),
                "g_rest_g": ctx.rest_group_zeros(),
                "g_batch": [jnp.zeros_like(b) for b in batch],
                "loss_g": ctx.loss_group_zeros(),
            }
        for start, stop, has_f, has_b in tables.phases():
            xs = {k: v[start:stop] for k, v in rows.items()}

            def tick(c: dict, row: dict, has_f: bool = has_f, has_b: bool = has_b
                     ) -> tuple[dict, None]:
                return ctx.tick(c, {k: v[s] for k, v in row.items()}, has_f, has_b), None

            carry, _ = jax.lax.scan(tick, carry, xs)
        if not backward:
            return jax.lax.psum(carry["loss"], AXIS)
        # the loss's parts summed per row group (tail.py): their one sum over the row axes
        loss = jax.lax.psum(carry["loss"] + sum(jnp.sum(g) for g in carry["loss_g"]), AXIS)
        g_rest = [jax.lax.psum(g, AXIS) for g in ctx.rest_sums(carry["g_rest"],
                                                               carry["g_rest_g"])]
        g_batch = [jax.lax.psum(g, AXIS) for g in carry["g_batch"]]
        g_w = [g[None] for g in ctx.grad_sums(carry["g_w"])]
        return loss, g_w, g_rest, g_batch

    n_w = len(program.stacked)
    in_specs = ([P(AXIS)] * n_w, [P()] * len(program.rest), [P()] * len(program.batch))
    out_specs: Any = P()
    if backward:
        out_specs = (P(), [P(AXIS)] * n_w, [P()] * len(program.rest),
                     [P()] * len(program.batch))
    body.__name__ = body.__qualname__ = LOOP_NAME
    mapped = jax.shard_map(body, mesh=program.mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names={AXIS}, check_vma=False)

    def run(weights: list, rest: list, batch: list) -> Any:
        with jax.named_scope(f"{LOOP_SCOPE}{program.id}"):
            return mapped(weights, rest, batch)

    return run


@dataclasses.dataclass
class _Tick(GroupedArrays):
    """One tick of one stage; see the module docstring (the row groups' arrays:
    :class:`~jaxpar._src.pipeline.grouped.GroupedArrays`)."""

    pieces: Pieces
    program: Any
    weights: list
    active: Any
    rest: list
    batch: list
    stage: Any
    res: Residuals
    scale: float
    recompute: bool
    fill: float
    fwd_perm: list
    bwd_perm: list
    w_local: list
    carried_specs: list
    groups: RowGroups | None = None  # run the chunks per row group (groups.py)
    ends: EndGroups | None = None  # the prologue's backward, the epilogue per group (ends.py)

    def __post_init__(self) -> None:
        self.loss_dtype = self.program.loss_dtype  # float64 under x64, as unpipelined
        if self.groups is not None:
            p = self.program
            self.gpieces = Pieces(p, graph=self.groups.graph, plan=self.groups.plan)
            self.batch_specs = [p.spec(v) for v in p.batch]
            # values stretched over the rows (a causal mask broadcast over the batch): each
            # group reads its own rows of them, so their gradients need no sum over groups
            self.w_cuts = {i: dim + 1 for kind, i, dim, _ in self.groups.cuts if kind == "w"}
            self.r_cuts = [(i, dim) for kind, i, dim, _ in self.groups.cuts if kind == "r"]
        grouped = self.ends.grouped if self.ends is not None else ()
        # the accumulators of the rest's gradients a group sums on its own: [G, ...]
        self.rest_g_specs = [] if self.groups is None else [
            Spec((self.groups.axes,) + strip(self.program.spec(self.program.rest[i]),
                                              self.groups.axes).dims) for i in grouped]

    def tick(self, c: dict, row: dict, has_f: bool, has_b: bool) -> dict:
        c = dict(c)
        c["act"] = [ar.put(b, row["recv_act"], x) for b, x in zip(c["act"], c["in_act"],
                                                                 strict=True)]
        if has_b:
            c["ct"] = [ar.put(b, row["recv_ct"], x) for b, x in zip(c["ct"], c["in_ct"],
                                                                   strict=True)]
        if has_f:
            c = self.forward(c, row)
        if has_b:
            c = self.backward(c, row)
        return c

    # -- forward ------------------------------------------------------------------------------
    def forward(self, c: dict, row: dict) -> dict:
        pieces = self.pieces
        backward = "ct" in c
        batch_m = [ar.get(b, row["f_micro"]) for b in self.batch]
        w_c = [ar.get(w, row["f_local"]) for w in self.weights]
        act_c = ar.get(self.active, row["f_local"])

        def run() -> tuple:
            x = jax.lax.cond(
                row["f_first"] > 0,
                lambda: self._carried(pieces.prologue(self.rest, batch_m)),
                lambda: self._carried([ar.get(b, row["f_in"]) for b in c["act"]]))
            if backward:
                y, stored = self._chunk_forward(w_c, act_c, x, batch_m)
            else:
                y, stored = self._carried(pieces.chunk(w_c, act_c, x, self.rest,
                                                       batch_m)), []
            if backward:
                ends = jax.lax.cond(row["f_last"] > 0, lambda: self._epilogue_vjp(y, batch_m),
                                    lambda: self._no_epilogue(y))
            else:
                ends = jax.lax.cond(
                    row["f_last"] > 0,
                    lambda: pieces.epilogue(self.rest, y, batch_m).astype(self.loss_dtype),
                    lambda: jnp.zeros((), self.loss_dtype))
            return y, stored, ends

        def idle() -> tuple:
            shapes = jax.eval_shape(run)
            y = self._carried([ar.filled(a, self.fill) for a in shapes[0]])
            stored = [ar.filled(a, self.fill) for a in shapes[1]]
            ends = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes[2])
            if backward:
                ends = (ends[0], self._loss_groups(ends[1]),
                        self._carried([ar.filled(a, self.fill) for a in shapes[2][2]]),
                        *ends[3:])
            return y, stored, ends

        y, stored, ends = jax.lax.cond(row["f_on"] > 0, run, idle)
        c["in_act"] = [jax.lax.ppermute(v, AXIS, self.fwd_perm) for v in y]
        if not backward:
            c["loss"] = c["loss"] + ends * self.scale
            return c
        loss_m, loss_g, ct_y, g_rest, g_rest_g, ct_b = ends
        c["loss"] = c["loss"] + loss_m * self.scale
        c["loss_g"] = self._loss_groups([a + g * self.scale for a, g in zip(c["loss_g"], loss_g,
                                                                           strict=True)])
        c["res"] = [ar.put(b, row["f_res"], v) for b, v in zip(c["res"], stored, strict=True)]
        c["ct"] = [ar.put(b, row["f_ct"], v) for b, v in zip(c["ct"], ct_y, strict=True)]
        c["g_rest"] = self._add_rest(c["g_rest"], g_rest)
        c["g_rest_g"] = self._add_groups(c["g_rest_g"], g_rest_g)
        c["g_batch"] = [ar.add_at(g, row["f_micro"], d) for g, d in zip(c["g_batch"], ct_b,
                                                                      strict=True)]
        return c

    def _carried(self, xs: Sequence[Any]) -> list:
        return [ar.constrain(self.pieces, x, sp) for x, sp in zip(xs, self.carried_specs,
                                                                strict=True)]

    def chunk_fn(self, active: Any, batch_m: list) -> Callable:
        """The chunk as a function of what is differentiated: ``f(w, x, r, b)``; per row group
        (``jax.vmap`` over the groups) when grouped, its arguments from :meth:`inputs`."""
        if self.groups is not None:
            gp, axes, r_cuts = self.gpieces, self.groups.axes, self.r_cuts
            n_w = len(self.weights)
            batch_g = self._group(batch_m, self.batch_specs)

            def f_groups(w: list, x: list, r: list, b: list) -> list:
                r = ar.merge(self.rest, r)
                own = [self._regroup(r[i], dim) for i, dim in r_cuts]

                def one(w: list, x: list, b: list, whole: list, own: list) -> list:
                    rr = list(r)
                    for (i, _), v in zip(r_cuts, own, strict=True):
                        rr[i] = v
                    if len(w) > n_w:  # the group's own copies of unstacked weights
                        for i, v in zip(self._grouped(), w[n_w:], strict=True):
                            rr[i] = v
                    return gp.chunk(w[:n_w], active, x, rr, ar.merge(whole, b))

                return jax.vmap(one, spmd_axis_name=axes)(w, x, b, batch_g, own)

            return f_groups
        pieces = self.pieces

        def f(w: list, x: list, r: list, b: list) -> list:
            return pieces.chunk(w, active, x, r, ar.merge(batch_m, b))

        return f

    def inputs(self, w_c: list, x: list, batch_m: list) -> tuple[list, list, list]:
        """The chunk function's weights, carried values and floating batch inputs: per row
        group when grouped (the weights broadcast to ``[G, ...]``, so that each group's weight
        gradient comes back on its own; after the stacked ones, the unstacked weights summed
        per group, :meth:`_rest_groups`, when the layers read one)."""
        if self.groups is None:
            return list(w_c), list(x), ar.floats(batch_m)
        G = self.groups.size
        w_b = [self._regroup(w, self.w_cuts[j]) if j in self.w_cuts else
               ar.constrain(self.pieces, jnp.broadcast_to(w[None], (G,) + w.shape), sp)
               for j, (w, sp) in enumerate(zip(w_c, self._group_w_specs(), strict=True))]
        if self.ends is not None and self.ends.layers:
            w_b += self._rest_groups()
        return (w_b, self._group(x, self.carried_specs),
                ar.floats(self._group(batch_m, self.batch_specs)))

    def _chunk_forward(self, w_c: list, act_c: Any, x: list, batch_m: list) -> tuple:
        """The chunk's output and the residual leaves its backward needs."""
        if self.recompute:
            y = self.pieces.chunk(w_c, act_c, x, self.rest, batch_m)
            return self._carried(y), list(x)
        w_in, x_in, b_in = self.inputs(w_c, x, batch_m)
        y, pull = jax.vjp(self.chunk_fn(act_c, batch_m), w_in, x_in, ar.floats(self.rest), b_in)
        y = self._ungroup(y)
        leaves = jax.tree.leaves(pull)
        stored = [leaves[i] for i, (kind, _) in enumerate(self.res.kinds) if kind == "store"]
        stored = [ar.constrain(self.pieces, v, sp) for v, sp in zip(stored, self.res.specs,
                                                                   strict=True)]
        return self._carried(y), stored

    def _epilogue_vjp(self, y: list, batch_m: list) -> tuple:
        if self.ends is not None and self.ends.epilogue:
            return self._epilogue_vjp_groups(y, batch_m)
        pieces = self.pieces

        def f(r: list, x: list, b: list) -> Any:
            return pieces.epilogue(ar.merge(self.rest, r), x,
                                   ar.merge(batch_m, b)).astype(self.loss_dtype)

        loss, pull = jax.vjp(f, ar.floats(self.rest), list(y), ar.floats(batch_m))
        g_r, ct_y, ct_b = pull(jnp.asarray(self.scale, self.loss_dtype))
        return (loss, self.loss_group_zeros(), self._carried(ar.dense(ct_y, y)),
                ar.dense(g_r, self.rest), self.rest_group_zeros(), ar.dense(ct_b, batch_m))

    def _epilogue_vjp_groups(self, y: list, batch_m: list) -> tuple:
        """The epilogue's backward with its head per row group (``ends.py``): the weights the
        head reads broadcast to ``[G, ...]``, so each group's gradient comes back on its own;
        the tail (the loss's reduction over the rows) on the whole micro-batch, or, proven
        affine (``tail.py``), per group too: each group's part of the loss ``[G]`` and the
        term without rows (weight decay) once, each part's cotangent the loss's scale."""
        assert self.ends is not None and self.groups is not None
        e, gp, pieces, axes = self.ends, self.gpieces, self.pieces, self.groups.axes
        bound = [v for v, _ in e.bound]
        cuts = list(e.epi_cuts)
        t, graph = e.affine, self.program.graph

        def f(r: list, rg: list, x: list, b: list) -> Any:
            rr, whole = ar.merge(self.rest, r), ar.merge(batch_m, b)
            own = [self._regroup(rr[i], dim) for i, dim in cuts]
            free: dict = {}
            if t is not None:  # what the tail reads without rows, once on the whole weights
                free = dict(zip(t.reads, pieces.epilogue_part(rr, x, whole, t.free, t.reads),
                                strict=True))

            def one(rg: list, x: list, b: list, own: list) -> Any:
                parts = gp.epilogue_part(self._rest_of(rr, rg, cuts, own), x, b, e.head, bound)
                if t is None:
                    return parts
                env = free | dict(zip(bound, parts, strict=True))
                return run_tail(graph, t, env, linear=True).astype(self.loss_dtype)

            parts = jax.vmap(one, spmd_axis_name=axes)(
                rg, self._group(x, self.carried_specs), self._group(whole, self.batch_specs),
                own)
            if t is not None:
                once = (run_tail(graph, t, free, linear=False) if t.offset else
                        jnp.zeros((), self.loss_dtype))
                return once.astype(self.loss_dtype), self._loss_groups([parts])
            parts = [self._unregroup(v, dim) for v, (_, dim) in zip(parts, e.bound,
                                                                     strict=True)]
            out = pieces.epilogue_part(rr, x, whole, e.tail, [self.program.out_operand],
                                       bound=bound, values=parts)[0]
            return out.astype(self.loss_dtype), []

        rg = self._rest_groups()
        (loss, loss_g), pull = jax.vjp(f, ar.floats(self.rest), rg, list(y),
                                       ar.floats(batch_m))
        scale = jnp.asarray(self.scale, self.loss_dtype)
        g_r, g_rg, ct_y, ct_b = pull((scale, self._loss_groups(
            [jnp.full(g.shape, scale) for g in loss_g])))
        return (loss, loss_g, self._carried(ar.dense(ct_y, y)), ar.dense(g_r, self.rest),
                self._group_grads(ar.dense(g_rg, rg)), ar.dense(ct_b, batch_m))

    def _no_epilogue(self, y: list) -> tuple:
        ct_y = self._carried([ar.filled(v, self.fill) for v in y])
        return (jnp.zeros((), self.loss_dtype), self.loss_group_zeros(), ct_y,
                [jnp.zeros_like(r) for r in self.rest], self.rest_group_zeros(),
                [jnp.zeros(b.shape[1:], b.dtype) for b in self.batch])

    # -- backward -----------------------------------------------------------------------------
    def backward(self, c: dict, row: dict) -> dict:
        pieces = self.pieces
        batch_m = [ar.get(b, row["b_micro"]) for b in self.batch]
        w_c = [ar.get(w, row["b_local"]) for w in self.weights]
        act_c = ar.get(self.active, row["b_local"])

        def run() -> tuple:
            ct = self._carried([ar.get(b, row["b_ct"]) for b in c["ct"]])
            stored = [ar.get(b, row["b_res"]) for b in c["res"]]
            g_w, ct_x, g_r, g_rg0, ct_b = self._chunk_backward(w_c, act_c, stored, ct,
                                                                batch_m)

            def into_prologue() -> tuple:
                if self.ends is not None and self.ends.prologue:
                    return self._prologue_vjp_groups(ct_x, batch_m)

                def f(r: list, b: list) -> list:
                    return pieces.prologue(ar.merge(self.rest, r), ar.merge(batch_m, b))

                _, pull = jax.vjp(f, ar.floats(self.rest), ar.floats(batch_m))
                g_r2, b2 = pull(ar.floats_like(ct_x))
                return ar.dense(g_r2, self.rest), self.rest_group_zeros(), ar.dense(b2, batch_m)

            def no_prologue() -> tuple:
                return ([jnp.zeros_like(r) for r in self.rest], self.rest_group_zeros(),
                        [jnp.zeros(b.shape[1:], b.dtype) for b in self.batch])

            g_r2, g_rg, b2 = jax.lax.cond(row["b_first"] > 0, into_prologue, no_prologue)
            return (g_w, self._carried(ct_x), ar.add(g_r, g_r2), ar.add(g_rg0, g_rg),
                    ar.add(ct_b, b2))

        def idle() -> tuple:
            shapes = jax.eval_shape(run)
            zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
            ct_x = self._carried([ar.filled(a, self.fill) for a in shapes[1]])
            return (zeros[0], ct_x, *zeros[2:])

        g_w, ct_x, g_r, g_rg, ct_b = jax.lax.cond(row["b_on"] > 0, run, idle)
        c["in_ct"] = [jax.lax.ppermute(v, AXIS, self.bwd_perm) for v in ct_x]
        c["g_w"] = [ar.constrain(self.pieces, ar.add_at(g, row["b_local"], d), sp)
                    for g, d, sp in zip(c["g_w"], g_w, self.w_local, strict=True)]
        c["g_rest"] = self._add_rest(c["g_rest"], g_r)
        c["g_rest_g"] = self._add_groups(c["g_rest_g"], g_rg)
        c["g_batch"] = [ar.add_at(g, row["b_micro"], d) for g, d in zip(c["g_batch"], ct_b,
                                                                      strict=True)]
        return c

    def _prologue_vjp_groups(self, ct_x: list, batch_m: list) -> tuple:
        """The prologue's backward per row group (``ends.py``): the embedding's gradient (a
        scatter-add of each group's tokens) into the group's own ``[G, ...]`` accumulator."""
        assert self.ends is not None and self.groups is not None
        gp, cuts, axes = self.gpieces, list(self.ends.pro_cuts), self.groups.axes

        def f(r: list, rg: list, b: list) -> list:
            rr, whole = ar.merge(self.rest, r), ar.merge(batch_m, b)
            own = [self._regroup(rr[i], dim) for i, dim in cuts]

            def one(rg: list, b: list, own: list) -> list:
                return gp.prologue(self._rest_of(rr, rg, cuts, own), b)

            return self._ungroup(jax.vmap(one, spmd_axis_name=axes)(
                rg, self._group(whole, self.batch_specs), own))

        rg = self._rest_groups()
        _, pull = jax.vjp(f, ar.floats(self.rest), rg, ar.floats(batch_m))
        g_r, g_rg, b2 = pull(ar.floats_like(ct_x))
        return (ar.dense(g_r, self.rest), self._group_grads(ar.dense(g_rg, rg)),
                ar.dense(b2, batch_m))

    def _chunk_backward(self, w_c: list, act_c: Any, stored: list, ct: list, batch_m: list
                        ) -> tuple:
        f = self.chunk_fn(act_c, batch_m)
        if self.recompute:
            w_in, x_in, b_in = self.inputs(w_c, list(stored), batch_m)
            _, pull = jax.vjp(f, w_in, x_in, ar.floats(self.rest), b_in)
        else:
            w_in, _, b_in = self.inputs(w_c, [None] * len(ct), batch_m)
            pull = self._pullback(f, w_in, stored, b_in)
        grouped = self.groups is not None
        ct_in = self._group(ct, self.carried_specs) if grouped else list(ct)
        b_all = self._group(batch_m, self.batch_specs) if grouped else batch_m
        g_w, ct_x, g_r, ct_b = pull(ar.floats_like(ct_in))
        g_w = ar.dense(g_w, w_in)
        n_w = len(w_c)
        g_rg = self._group_grads(g_w[n_w:]) if len(g_w) > n_w else self.rest_group_zeros()
        g_w = g_w[:n_w]
        if grouped:
            g_w = [self._unregroup(g, self.w_cuts[j]) if j in self.w_cuts else g
                   for j, g in enumerate(g_w)]
        return (g_w, self._ungroup(ar.dense(ct_x, ct_in)), ar.dense(g_r, self.rest), g_rg,
                self._ungroup(ar.dense(ct_b, b_all)))

    def _pullback(self, f: Callable, w_c: list, stored: list, b_floats: list) -> Any:
        """The forward's pullback, its leaves from the slots, the weights, the batch, or
        recomputed (those that depend on no activation: XLA keeps only what they need)."""
        kinds = self.res.kinds
        again: list = []
        if any(k == "recompute" for k, _ in kinds):
            x0 = [jnp.zeros(a.shape, a.dtype) for a in self.res.x_avals]
            again = jax.tree.leaves(jax.vjp(f, w_c, x0, ar.floats(self.rest), b_floats)[1])
        sources = {"w": w_c, "r": ar.floats(self.rest), "b": b_floats}
        it = iter(stored)
        leaves = []
        for i, (kind, j) in enumerate(kinds):
            if kind == "store":
                leaves.append(next(it))
            elif kind == "recompute":
                leaves.append(again[i])
            else:
                leaves.append(sources[kind][j])
        return jax.tree.unflatten(self.res.treedef, leaves)
