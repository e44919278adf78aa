"""A pipeline stage's weight gradients reduced over the data-parallel axes once per step
(``jaxpar/_src/pipeline/groups.py``), and kept per micro-batch where the layers mix rows.

The layers that keep rows apart are tested with every schedule in ``test_pipeline.py`` (toy)
and on the (dp, tp, pp) = (2, 2, 2) GPT trained with ``Model.train``."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.pipeline.groups import _fit
from jaxpar._src.spec import MeshShape, Spec
from tests.util import FAST_COMPILE_FLAGS

NAN = float("nan")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _step(loss, w, x, schedule="1f1b"):  # (dp, pp) = (4, 2)
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2,
                                      pipeline_config={"pipeline_scheduler": schedule}):
        cell = jaxpar.PipelineCell(loss, bubble_fill=NAN)  # no bubble may reach a result
        step = jaxpar.parallelize(jax.value_and_grad(cell), micro_batches=4, batch_argnums=1)
        value, grad = step(w, x)
        colls = jaxpar.inspect.collectives(step.lower(w, x).compile())
        return value, grad, colls, step.plan(w, x).pipeline


def _step_as_one_device(loss):
    """The pipelined step of ``loss`` on a [4, 8, 8] stack of weights and 16 rows, its loss
    and gradient checked against one device's; its collectives and pipeline plan."""
    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.5
    x = jax.random.normal(jax.random.key(1), (16, 8))
    value, grad, colls, pipe = _step(loss, w, x)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    return colls, pipe


def _weight_reductions(colls):
    """All-reduces over dp of the stage's [.., 8, 8] weight gradients (the loss and the
    batch-mean statistics are shaped otherwise)."""
    return [r for r in colls.of("all-reduce") if r.axes == ("dp",)
            and any(s.endswith("8,8]") for s in r.shapes)]


def test_a_chunk_that_mixes_rows_keeps_the_per_micro_batch_reduction():
    def loss(w, x):
        for i in range(4):
            x = jnp.tanh(x @ w[i])
            x = x - jnp.mean(x, axis=0)  # a batch-mean normalization: rows of every group meet
        return jnp.mean(x ** 2)

    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.5
    x = jax.random.normal(jax.random.key(1), (16, 8))
    value, grad, colls, pipe = _step(loss, w, x)
    # one device, the same micro-batches (rows m, m + 4, ...): the normalization is over a
    # micro-batch's rows, so that is the computation the pipeline must equal
    def reference(w, x):
        return jnp.mean(jnp.stack([loss(w, x[m::4]) for m in range(4)]))

    ref_value, ref_grad = jax.jit(jax.value_and_grad(reference))(w, x)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    red = pipe.gradient_reduction
    assert not red.once and "reduce_sum reduces over the rows" in red.why, red
    assert "per micro-batch" in pipe.explain()
    found = _weight_reductions(colls)
    # predicted: every tick of the loop's backward phases reduces the chunk's 2 layers
    assert sum(r.count for r in found) == red.runs and red.runs > 1, colls.table()
    assert sum(r.count * r.nbytes for r in found) == red.step_bytes


def test_a_mask_stretched_over_the_rows_is_read_per_group():
    def loss(w, x):
        keep = jnp.broadcast_to(jnp.arange(8) < 6, x.shape)  # made once, read by every layer
        for i in range(4):
            x = jnp.where(keep, jnp.tanh(x @ w[i]), 0.0)  # (0.0: a zero block per layer)
        return jnp.mean(x ** 2)

    colls, pipe = _step_as_one_device(loss)
    red = pipe.gradient_reduction
    assert red.once, red
    # the mask (unstacked) and the zeros (stacked per layer) are [rows, 8]: each group reads
    # its own rows of them where they lie, so nothing but the gradients' one all-reduce over dp
    # (with the loss's parts summed per group: tail.py; XLA combines the two)
    assert red.loss_bytes == 4
    assert [(r.count, r.nbytes) for r in _weight_reductions(colls)] == [
        (1, red.step_bytes + red.loss_bytes)], colls.table()
    assert not [r for r in colls if r.axes == ("dp",) and r.kind == "all-gather"], colls.table()


def _rope_split(h, c, s):  # flax Gemma's apply_rope: halves (jnp.split, jnp.concatenate)
    a, b = jnp.split(h, 2, axis=-1)
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _rope_stack(h, c, s):  # Meta's interleaved pairs: (re, im) = h[..., 0::2], h[..., 1::2]
    pairs = h.reshape(*h.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    return jnp.stack([re * c - im * s, re * s + im * c], axis=-1).reshape(h.shape)


@pytest.mark.parametrize("rope", [_rope_split, _rope_stack], ids=["split", "stack"])
def test_a_rotary_embedding_keeps_rows_apart(rope):
    """Rotary embeddings as the zoo's Gemma (``jnp.split``) and LLaMA (``jnp.stack``) write
    them: JAX 0.10's ``split``/``stack`` (and ``unstack``, their transpose) cut or join along
    the features, never the rows; the proof did not know them, and the stage gradients were
    all-reduced over dp once per micro-batch in the loop."""
    c, s = jnp.cos(jnp.arange(4.0)), jnp.sin(jnp.arange(4.0))

    def loss(w, x):
        for i in range(4):
            x = jnp.tanh(rope(x @ w[i], c, s))
        return jnp.mean(x ** 2)

    colls, pipe = _step_as_one_device(loss)
    red = pipe.gradient_reduction
    assert red.once, red.why
    assert [(r.count, r.nbytes) for r in _weight_reductions(colls)] == [
        (1, red.step_bytes + red.loss_bytes)], colls.table()


@pytest.mark.slow
def test_a_layer_weight_split_over_the_row_axes_keeps_the_per_micro_batch_reduction():
    # At 2 rows a micro-batch the search splits the MLP's kernels over (dp, tp), dp being the
    # axis the rows are on: a row group would hold a slice of the weight, not its own copy.
    # Grouped anyway, the step hung in XLA:CPU's collective-permute rendezvous (and with ZeRO
    # its reduce-scatter layout named dp twice); the per-micro-batch route runs and is exact.
    script = os.path.join(ROOT, "examples", "gpt_3d.py")
    result = subprocess.run([sys.executable, script, "--micro-batches", "8", "--layers", "2",
                             "--steps", "1"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "XLA_FLAGS": FAST_COMPILE_FLAGS})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(shape (512, 2048)) is split over the row axes dp" in result.stdout, result.stdout
    assert "largest difference" in result.stdout  # the script exits non-zero beyond 1e-4


def test_layouts_inside_a_group_drop_the_row_axes():
    mesh = MeshShape(("dp", "tp"), (2, 2))
    assert _fit(Spec((("dp", "tp"), ())), (2, 8), mesh, ("dp",)) == Spec((("tp",), ()))
    # an axis that no longer divides the smaller dimension is dropped too
    assert _fit(Spec((("dp", "tp"), ())), (1, 8), mesh, ("dp",)) == Spec(((), ()))


def _stack_adam(mesh, optimizer_config):
    """One Adam step of 8 layers ``tanh(x @ w_i)`` (16 x 16) pipelined over 2 stages, 4
    micro-batches, with the parallel optimizer (``optimizer_config``, threshold 0) and NaN
    bubbles, checked against the same step on one device: the new optimizer state, the
    compiled collectives and the plan's gradient reduction."""
    import optax

    def loss(w, x):
        for i in range(8):
            x = jnp.tanh(x @ w[i])
        return jnp.mean(x ** 2)

    tx = optax.adam(1e-2)

    def train(cell):
        def step(p, s, x):
            value, grads = jax.value_and_grad(cell)(p, x)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value
        return step

    keys = jax.random.split(jax.random.key(0), 9)
    w = [jax.random.normal(k, (16, 16)) * 0.3 for k in keys[:8]]
    x = jax.random.normal(keys[8], (32, 16))
    with jaxpar.auto_parallel_context(
            parallel_mode="semi_auto_parallel", mesh=mesh, pipeline_stages=2, micro_batches=4,
            enable_parallel_optimizer=True, parallel_optimizer_config={
                "parallel_optimizer_threshold": 0, **optimizer_config}):
        cell = jaxpar.PipelineCell(loss, batch_argnums=1, bubble_fill=NAN)
        sw = cell.stack(w, x)
        step = jaxpar.parallelize(train(cell), batch_argnums=2)
        new_sw, state, value = step(sw, tx.init(sw), x)
        colls = jaxpar.inspect.collectives(step.lower(sw, tx.init(sw), x).compile())
        red = step.plan(sw, tx.init(sw), x).pipeline.gradient_reduction
    ref_w, _, ref_value = jax.jit(train(loss))(w, tx.init(w), x)  # one device
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(new_sw.unstack(), ref_w, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    return state, colls, red


def test_zero2_reduce_scatters_the_stage_gradients_after_the_loop():
    # ZeRO level 2: the gradients summed over the row groups are reduce-scattered into the
    # layout of their Adam moments (split over dp), not all-reduced whole and then sliced
    state, colls, red = _stack_adam(jaxpar.make_mesh((4, 2), ("dp", "pp")),
                                    {"optimizer_level": "level2"})
    # the moments [S, v, k, 16, 16] = [2, 1, 4, 16, 16]: k split over dp
    assert state[0].mu.stacked[0].sharding.spec == P("pp", None, "dp")
    # one reduce-scatter over dp of the stage's 4 layers (4 x 1 KiB), as predicted; no
    # all-reduce of a weight gradient
    grads = [r for r in colls if r.axes == ("dp",) and any(s.endswith("16,16]")
                                                           for s in r.shapes)]
    assert red.collectives == ("reduce-scatter",) and red.once, red
    assert [(r.kind, r.count, r.nbytes) for r in grads if r.kind != "all-gather"] == [
        ("reduce-scatter", 1, red.scattered_bytes)], colls.table()
    assert red.scattered_bytes == red.run_bytes == 4 * 16 * 16 * 4
    assert "reduce-scatter" in red.explain()
    # the update runs on the slices; the new weights are gathered once (level 2 keeps them whole)
    assert [r.count for r in grads if r.kind == "all-gather"] == [1], colls.table()


# -- the prologue and epilogue per row group (ends.py) ---------------------------------------------
V, D = 24, 8  # vocabulary, width


def _lm(normalize_before_head=False, tail=None):
    """A toy language model: embedding + position (prologue), 4 layers sharing a gate, final
    scale, head and mean cross-entropy (``tail`` of it) plus weight decay (epilogue)."""
    def loss(p, tokens, labels):
        x = p["emb"][tokens] + p["pos"]  # [rows, seq, D]: a gather of each row's tokens
        gate = p["gate"][None, None]  # made once: every layer reads the same value
        for i in range(4):
            x = x + jnp.tanh(x @ p["w"][i]) * gate
        if normalize_before_head:  # a batch statistic read by the head: rows of every group
            x = x - jnp.mean(x, axis=0)
        logits = (x * p["scale"]) @ p["head"]
        logp = jax.nn.log_softmax(logits)
        decay = 1e-2 * jnp.sum(p["head"] ** 2)  # read by the tail: no rows, no reduction
        ce = -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))
        return (ce if tail is None else tail(ce)) + decay

    keys = jax.random.split(jax.random.key(0), 6)
    p = {"emb": jax.random.normal(keys[0], (V, D)), "pos": jax.random.normal(keys[1], (4, D)),
         "w": jax.random.normal(keys[2], (4, D, D)) * 0.3, "scale": jnp.ones(D) * 1.1,
         "head": jax.random.normal(keys[3], (D, V)) * 0.3, "gate": jnp.linspace(0.5, 1.5, D)}
    tokens = jax.random.randint(keys[4], (32, 4), 0, V)
    labels = jax.random.randint(keys[5], (32, 4), 0, V)
    return loss, p, tokens, labels


def _lm_step(loss, p, tokens, labels, schedule):  # (dp, pp) = (4, 2): 2 rows per group
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2,
                                      pipeline_config={"pipeline_scheduler": schedule}):
        cell = jaxpar.PipelineCell(loss, bubble_fill=NAN)
        step = jaxpar.parallelize(jax.value_and_grad(cell), micro_batches=4,
                                  batch_argnums=(1, 2))
        value, grad = step(p, tokens, labels)
        colls = jaxpar.inspect.collectives(step.lower(p, tokens, labels).compile())
        return value, grad, colls, step.plan(p, tokens, labels).pipeline, cell.last_program


def _micro_batch_mean(loss):
    """One device's loss where the loss mixes a micro-batch's rows: the mean of ``loss`` over
    the 4 micro-batches (rows ``m::4``), each computed alone."""
    def reference(p, tokens, labels):
        return jnp.mean(jnp.stack([loss(p, tokens[m::4], labels[m::4]) for m in range(4)]))

    return reference


def _close(value, grad, ref_value, ref_grad):
    assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grad))
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for k in ref_grad:
        np.testing.assert_allclose(grad[k], ref_grad[k], rtol=1e-5, atol=1e-5, err_msg=k)


def _in_loop(colls):
    """The collectives over dp inside the loop (its phases and their conditionals) and those
    after it, in the step's entry computation (a phase of one tick runs once a step too)."""
    over_dp = [r for r in colls if r.axes == ("dp",)]
    after = [r for r in over_dp if r.computation.startswith("main")]
    return [r for r in over_dp if r not in after], after


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_embedding_and_head_gradients_are_reduced_once_per_step(schedule):
    loss, p, tokens, labels = _lm()
    value, grad, colls, pipe, program = _lm_step(loss, p, tokens, labels, schedule)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(loss))(p, tokens, labels)  # one device
    _close(value, grad, ref_value, ref_grad)
    red = pipe.gradient_reduction
    assert program.ends.prologue and program.ends.epilogue, red.ends_why
    common = [program.layers.layers[0].weights[j] for j in program.layers.common]
    assert common and [program.rest[i] for i in program.ends.layers] == common  # the gate
    # no part reads them whole: the loop keeps only their [G, ...] accumulators
    assert program.ends.only == program.ends.grouped and len(program.ends.grouped) == 5
    assert red.once and "after the loop" in red.ends_why and "after the loop" in pipe.explain()
    assert "1 weight(s) it reads after mixing rows per micro-batch" in red.ends_why  # decay
    # emb [24, 8] + pos [4, 8] (prologue), gate [8] (layers), scale [8] + head [8, 24]
    # (epilogue): whole per device, summed per dp group in the loop
    assert red.ends_bytes == (V * D + 4 * D + D + D + D * V) * 4
    # the loss's tail (mean cross-entropy + decay) is affine in its sum over the rows: each
    # group takes its part, the decay is added once (tail.py)
    assert program.ends.affine is not None and program.ends.affine.offset
    assert "the loss's tail too" in red.ends_why and red.loss_bytes == 4
    inside, after = _in_loop(colls)
    # nothing crosses dp inside the loop: no gradient, not the loss's sum over the rows, no
    # all-gather of the rows for the head or the embedding's scatter-add
    assert not inside, colls.table()
    # after it, the stacked weights', the ends' gradients and the loss's parts: as predicted
    assert sum(r.nbytes for r in after if r.kind == "all-reduce") == red.after_loop_bytes, \
        colls.table()


def test_a_head_after_a_batch_statistic_keeps_the_epilogue_per_micro_batch():
    loss, p, tokens, labels = _lm(normalize_before_head=True)
    value, grad, colls, pipe, program = _lm_step(loss, p, tokens, labels, "1f1b")

    # the statistic is over a micro-batch's rows
    ref_value, ref_grad = jax.jit(jax.value_and_grad(_micro_batch_mean(loss)))(
        p, tokens, labels)
    _close(value, grad, ref_value, ref_grad)
    red = pipe.gradient_reduction
    # the head reads the normalized rows: its gradient contracts over every row of the
    # micro-batch, so it stays per micro-batch; the prologue still runs per group
    assert program.ends.prologue and not program.ends.epilogue
    assert "epilogue: per micro-batch: the loss reads its weights after mixing rows" in \
        red.ends_why, red.ends_why
    # and where the rows mix first: the batch statistic's sum over the rows
    assert "the rows mix first at reduce_sum reduces over the rows" in red.ends_why, \
        red.ends_why
    assert red.ends_bytes == (V * D + 4 * D + D) * 4  # the embedding's, position's, gate's
    inside, after = _in_loop(colls)
    head = [r for r in inside if any(sh in (f"f32[{D},{V}]", f"f32[{V},{D}]") for sh in r.shapes)]
    assert head and all(r.kind == "all-reduce" and r.count > 0 for r in head), colls.table()
    assert sum(r.count for r in head) > 1  # once per micro-batch (the 1-tick phase included)
    assert sum(r.nbytes for r in after if r.kind == "all-reduce") == red.after_loop_bytes, \
        colls.table()


@pytest.mark.parametrize("schedule", [  # GPipe at 1 row per group, NaN bubbles, also in
    pytest.param("gpipe", marks=pytest.mark.slow),  # test_pipeline.py's GPT (no collectives)
    "1f1b"])
def test_one_row_per_group_sums_the_loss_after_the_loop(schedule):
    # 16 rows, 4 micro-batches over dp = 4: 1 row per group.  Traced at 1 row,
    # take_along_axis takes the row dimension of 1 for a broadcast (its indices reshaped
    # without it, another gather): the proof follows the squeezed rows (rowflow._one_row), so
    # the loss's tail runs per group as at 2 rows (before: its scalar sum crossed dp inside
    # the loop each micro-batch)
    loss, p, tokens, labels = _lm()
    tokens, labels = tokens[:16], labels[:16]
    value, grad, colls, pipe, program = _lm_step(loss, p, tokens, labels, schedule)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(loss))(p, tokens, labels)  # one device
    _close(value, grad, ref_value, ref_grad)
    red = pipe.gradient_reduction
    assert "4 groups of 1 rows" in red.why, red.why
    assert program.ends.affine is not None and red.loss_bytes == 4, red.ends_why
    inside, after = _in_loop(colls)
    assert not inside, colls.table()
    assert sum(r.nbytes for r in after if r.kind == "all-reduce") == red.after_loop_bytes, \
        colls.table()


def _prove(fn, rows, groups, shapes):
    """``groups.py``'s proof over every operator of ``fn`` traced at ``rows`` and at
    ``rows / groups`` rows (its inputs ``[rows, *shape]``, rows on dimension 0): the state of
    every value, or why it may mix rows."""
    from jaxpar._src.graph import NodeKind
    from jaxpar._src.pipeline.rowflow import row_step
    from jaxpar._src.trace import trace

    def args(r):
        return [jnp.zeros((r, *s), d) for s, d in shapes]

    big, small = (trace(fn, args(r)).graph for r in (rows, rows // groups))
    assert [n.name for n in big.nodes] == [n.name for n in small.nodes]
    state = {big.nodes[i].outputs[0]: (0, 1) for i in big.inputs}
    ops = [n.id for n in big.nodes if n.kind is NodeKind.OP]
    made = {v for i in ops for v in big.nodes[i].outputs}
    for i in ops:
        why = row_step(big, small, i, state, made, {}, state, {}, rows, groups)
        if why:
            return why
    out = big.nodes[big.outputs[0]].inputs[0]
    return state, state[out]


def _label_logit(mode_at_1_row=None, rows=1):
    def fn(logits, labels):  # another gather mode when traced at ``rows`` rows
        mode = mode_at_1_row if logits.shape[0] == rows else None
        return jnp.take_along_axis(logits, labels[..., None], axis=-1, mode=mode)
    return fn


LOGITS = [((3, 5), jnp.float32), ((3,), jnp.int32)]


def test_the_proof_follows_the_row_dimension_squeezed_at_1_row():
    import optax

    def ce(logits, labels):
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

    for fn in (ce, _label_logit()):
        for groups in (2, 4):  # 2 rows per group: no squeeze; 1 row: the indices squeezed
            state, out = _prove(fn, 4, groups, LOGITS)
            assert out == (0, 1)  # the result carries the rows on dimension 0
            assert ((0, 0) in state.values()) == (groups == 4), state
    # a squeezed value read by anything but the gather take_along_axis makes of it, or by a
    # gather traced otherwise at 1 row (here: clipping, not filling), is refused
    why = _prove(_label_logit("clip"), 4, 4, LOGITS)
    assert "squeezed, traced there as another gather" in why, why

    def squeeze_then_scale(x):
        h = x.reshape(x.shape[1:] + (1,) if x.shape[0] == 1 else (*x.shape, 1))
        return h * 2

    why = _prove(squeeze_then_scale, 4, 4, [((3,), jnp.float32)])
    assert why.startswith("mul reads a value whose row dimension the trace at 1 row "
                          "squeezed"), why
    # at 2 rows per group too: the group's trace must run the operator the proof read
    why = _prove(_label_logit("clip", rows=2), 4, 2, LOGITS)
    assert why.startswith("gather's mode is "), why


@pytest.mark.slow  # ~25 CPU s compiling a step (the refusals: test_pipeline_tail.py)
def test_a_loss_not_affine_in_its_sum_over_the_rows_sums_it_per_micro_batch():
    loss, p, tokens, labels = _lm(tail=jnp.log)  # the log of the mean cross-entropy
    value, grad, colls, pipe, program = _lm_step(loss, p, tokens, labels, "1f1b")

    # the log is of each micro-batch's mean
    ref_value, ref_grad = jax.jit(jax.value_and_grad(_micro_batch_mean(loss)))(
        p, tokens, labels)
    _close(value, grad, ref_value, ref_grad)
    red = pipe.gradient_reduction
    # the head still runs per group (its gradients summed after the loop), the tail on the
    # whole micro-batch: its scalar sum crosses dp once per micro-batch, and explain() says why
    assert program.ends.epilogue and program.ends.affine is None and red.loss_bytes == 0
    assert "log of a sum over the rows is not affine" in red.ends_why, red.ends_why
    inside, after = _in_loop(colls)
    assert inside and all(r.kind == "all-reduce" and r.shapes == ("f32[]",) for r in inside), \
        colls.table()
    assert sum(r.count for r in inside) >= 4, colls.table()  # 4 micro-batches
    assert sum(r.nbytes for r in after if r.kind == "all-reduce") == red.after_loop_bytes, \
        colls.table()


def test_a_prologue_that_mixes_rows_keeps_its_gradients_per_micro_batch():
    def loss(p, tokens, labels):
        x = p["emb"][tokens]
        x = x - jnp.mean(x, axis=0)  # a batch statistic the layers read
        for i in range(4):
            x = x + jnp.tanh(x @ p["w"][i])
        logp = jax.nn.log_softmax(x @ p["head"])
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    _, p, tokens, labels = _lm()
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2):
        step = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(loss)),
                                  micro_batches=4, batch_argnums=(1, 2))
        pipe = step.plan(p, tokens, labels).pipeline
    red = pipe.gradient_reduction
    assert red.once  # the layers and the epilogue still run per group
    assert "prologue: per micro-batch: reduce_sum reduces over the rows" in red.ends_why, red
    assert "epilogue: runs per group, the loss's tail too" in pipe.explain()
    assert red.ends_bytes == D * V * 4  # the head's only


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_head_summed_per_group_compiles_and_equals_one_device(schedule):
    """The epilogue's per-group head gradient is made inside the tick's ``lax.cond`` whose
    other branch returns the accumulators' zeros: both must be laid out alike, or XLA refuses
    the program ("Inconsistent conditional sharding among instructions", found on a head wider
    than the layers)."""
    def loss(p, x):
        w, h = p
        for i in range(4):
            x = jnp.tanh(x @ w[i])
        return jnp.mean((x @ h) ** 2)

    p = (jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.5,
         jax.random.normal(jax.random.key(2), (8, 64)) * 0.3)
    x = jax.random.normal(jax.random.key(1), (16, 8))
    value, grad, colls, pipe = _step(loss, p, x, schedule)
    assert pipe.gradient_reduction.ends_bytes == 8 * 64 * 4  # the head, summed per group
    ref_value, ref_grad = jax.jit(jax.value_and_grad(loss))(p, x)  # rows never meet
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for g, r in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def _lm_train(loss, p, tokens, labels, *, schedule, level, reference=None):
    """One Adam step of the pipelined LM on (dp, pp) = (4, 2) with the parallel optimizer at
    ``level`` (every array split, threshold 0), beside the same step of ``reference`` (default:
    the loss) on one device."""
    import optax

    tx = optax.adam(1e-2)

    def train(cell):
        def step(p, s, tokens, labels):
            value, grads = jax.value_and_grad(cell)(p, tokens, labels)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, value
        return step

    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    zero = {} if level is None else {"enable_parallel_optimizer": True,
                                     "parallel_optimizer_config": {
                                         "optimizer_level": level,
                                         "parallel_optimizer_threshold": 0}}
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=4,
                                      pipeline_config={"pipeline_scheduler": schedule}, **zero):
        cell = jaxpar.PipelineCell(loss, batch_argnums=(1, 2), bubble_fill=NAN)
        step = jaxpar.parallelize(train(cell), batch_argnums=(2, 3))
        state = tx.init(p)
        new_p, _, value = step(p, state, tokens, labels)
        colls = jaxpar.inspect.collectives(step.lower(p, state, tokens, labels).compile())
        pipe = step.plan(p, state, tokens, labels).pipeline
    ref_p, _, ref_value = jax.jit(train(reference or loss))(p, tx.init(p), tokens, labels)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-6)
    for k in ref_p:
        np.testing.assert_allclose(new_p[k], ref_p[k], rtol=1e-5, atol=1e-5, err_msg=k)
    return colls, pipe, cell.last_program


# (schedule, optimizer level, rest weights reduce-scattered): emb [24, 8] and head [8, 24]
# (dimension 0 over dp, as their moments are over dp+pp), gate and scale ([1, 1, 8] in the
# loop: their first dimension longer than 1); pos [4, 8] is not (4 rows do not split over the
# 8 devices its moments would need); without the parallel optimizer (the tests above) every
# one is all-reduced
@pytest.mark.parametrize("schedule,level,scattered", [
    ("1f1b", "level1", {"emb": 0, "gate": 2, "head": 0, "scale": 2}),
    ("gpipe", "level2", {"emb": 0, "gate": 2, "head": 0, "scale": 2}),
])
def test_zero_reduce_scatters_the_ends_gradients_after_the_loop(schedule, level, scattered):
    loss, p, tokens, labels = _lm()
    colls, pipe, program = _lm_train(loss, p, tokens, labels, schedule=schedule, level=level)
    red = pipe.gradient_reduction
    names = {i: k for k, i in _rest_names(program, p).items()}
    assert {names[i]: dim for i, dim, _ in program.rest_scatters} == scattered
    assert all(axes == ("dp",) for _, _, axes in program.rest_scatters)
    inside, after = _in_loop(colls)
    assert not inside, colls.table()  # the loss's parts too are summed after the loop
    # after the loop: what is split as the optimizer state is reduce-scattered, the rest
    # all-reduced, each as many bytes per device as predicted
    rs = sum(r.nbytes * r.count for r in after if r.kind == "reduce-scatter")
    ar = sum(r.nbytes * r.count for r in after if r.kind == "all-reduce")
    assert (rs, ar) == (red.after_loop_scattered_bytes, red.after_loop_bytes), colls.table()
    # emb and head whole per device (24 x 8 floats each), gate and scale 8 floats
    assert red.ends_scattered_bytes == sum({"emb": V * D, "head": D * V, "gate": D,
                                            "scale": D}[k] for k in scattered) * 4
    assert ("reduce-scatter" in red.ends_why) == bool(scattered)


def test_a_weight_also_read_whole_adds_its_reduced_part_to_the_scattered_one():
    # the gate scales the embedding in a prologue that mixes rows (read whole, reduced per
    # micro-batch) and every layer reads it (summed per group, reduce-scattered after the
    # loop): the two parts add up in the scattered layout
    def loss(p, tokens, labels):
        gate = p["gate"][None, None]
        x = p["emb"][tokens] * gate
        x = x - jnp.mean(x, axis=0)  # a batch statistic in the prologue
        for i in range(4):
            x = x + jnp.tanh(x @ p["w"][i]) * gate
        logp = jax.nn.log_softmax(x @ p["head"])
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    _, p, tokens, labels = _lm()
    p = {k: p[k] for k in ("emb", "gate", "head", "w")}
    # the statistic is over a micro-batch's rows: one device runs each alone
    colls, pipe, program = _lm_train(loss, p, tokens, labels, schedule="1f1b", level="level1",
                                     reference=_micro_batch_mean(loss))
    names = {i: k for k, i in _rest_names(program, p).items()}
    gate = _rest_names(program, p)["gate"]
    assert gate in program.ends.grouped and gate not in program.ends.only
    assert {names[i] for i, _, _ in program.rest_scatters} == {"gate", "head"}
    red = pipe.gradient_reduction
    _, after = _in_loop(colls)
    assert sum(r.nbytes * r.count for r in after if r.kind == "reduce-scatter") == \
        red.after_loop_scattered_bytes == (2 * D * D + D + D * V) * 4, colls.table()
    # (a stage's 2 layers' [8, 8], the gate's [1, 1, 8] and the head's [8, 24], whole)


def _rest_names(program, p):
    """The rest index of each of ``p``'s arrays the loop reads (itself or broadcast)."""
    graph, keys = program.graph, sorted(p)  # a dict's leaves, in key order, come first
    out = {}
    for i, v in enumerate(program.rest):
        node = graph.nodes[graph.values[v].producer]
        if node.name == "broadcast_in_dim":
            node = graph.nodes[graph.values[node.inputs[0]].producer]
        if node.id in graph.inputs[:len(keys)]:
            out[keys[graph.inputs.index(node.id)]] = i
    return out


def test_a_shard_group_smaller_than_the_row_axes_keeps_the_all_reduce():
    # rows over dp+tp, optimizer_weight_shard_size=2: the moments split over tp only.  A
    # reduce-scatter over tp alone would leave the dp groups unsummed (the update was 2x the
    # learning rate off): the gradients are all-reduced over dp+tp and the update slices them
    state, colls, red = _stack_adam(jaxpar.make_mesh((2, 2, 2), ("dp", "tp", "pp")),
                                    {"optimizer_level": "level1",
                                     "optimizer_weight_shard_size": 2})
    assert red.axes == ("dp", "tp") and red.once and red.scattered_bytes == 0, red
    assert state[0].mu.stacked[0].sharding.spec == P("pp", None, "tp")
    after = [r for r in colls if r.computation.startswith("main") and "dp" in r.axes
             and any(s.endswith("16,16]") for s in r.shapes)]
    assert [(r.kind, r.axes, r.nbytes) for r in after] == [
        ("all-reduce", ("dp", "tp"), red.after_loop_bytes)], colls.table()
