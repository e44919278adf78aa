"""Pipeline parallel: schedules and their timelines, the stage split, the layers found, and the
pipelined step against the unpipelined one (losses and gradients to float32 precision, bubbles
filled with NaN), with its collective-permutes over ``pp`` in the compiled HLO."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar._src.pipeline import stacked
from jaxpar._src.pipeline.layers import find_layers
from jaxpar._src.pipeline.report import GradientReduction
from jaxpar._src.pipeline.schedule import PipelineSchedule, Task
from jaxpar._src.pipeline.slots import SlotTables
from jaxpar._src.pipeline.split import BACKWARD_FACTOR, choose_split
from jaxpar._src.trace import trace

NAN = float("nan")


# -- schedules and timelines (no JAX) -----------------------------------------------------------
@pytest.mark.parametrize("S,M", [(2, 1), (2, 4), (4, 4), (4, 16), (8, 3)])
def test_gpipe_bubble_is_the_textbook_fraction(S, M):
    tl = PipelineSchedule.build("gpipe", S, M).timeline()
    assert tl.bubble_fraction == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)


@pytest.mark.parametrize("S,M,v", [(2, 4, 2), (4, 16, 2), (4, 8, 4), (4, 5, 2)])
def test_interleaved_bubble_is_the_textbook_fraction(S, M, v):
    tl = PipelineSchedule.build("gpipe", S, M, v).timeline()
    assert tl.bubble_fraction == pytest.approx((S - 1) / (v * M + S - 1), abs=1e-12)


@pytest.mark.parametrize("S,M", [(2, 4), (4, 16), (4, 8)])
def test_1f1b_idles_like_gpipe_but_holds_o_of_s(S, M):
    gpipe = PipelineSchedule.build("gpipe", S, M)
    ofob = PipelineSchedule.build("1f1b", S, M)
    assert ofob.timeline().bubble_fraction == pytest.approx(gpipe.timeline().bubble_fraction)
    assert max(gpipe.in_flight()) == M
    # lock-step 1F1B: a cotangent needs a tick per hop back, so stage s holds 2 (S - 1 - s) + 1
    assert ofob.in_flight() == tuple(min(M, 2 * (S - 1 - s) + 1) for s in range(S))
    assert ofob.num_ticks < gpipe.num_ticks  # forwards and backwards share ticks


def test_interleaved_1f1b_holds_less_than_interleaved_gpipe():
    gpipe = PipelineSchedule.build("gpipe", 4, 16, 2)
    ofob = PipelineSchedule.build("1f1b", 4, 16, 2)
    assert ofob.timeline().bubble_fraction == pytest.approx(3 / (2 * 16 + 3))
    assert max(ofob.in_flight()) < max(gpipe.in_flight()) / 2


def test_every_schedule_respects_its_dependencies():
    for kind in ("gpipe", "1f1b", "forward"):
        for S, M, v in [(2, 2, 1), (3, 5, 1), (2, 4, 3), (4, 4, 2)]:
            s = PipelineSchedule.build(kind, S, M, v)
            s.validate()
            where = s.tasks()
            assert all(where[Task("F", m, c)][1] == c % S for m in range(M)
                       for c in range(S * v))


def test_timeline_prices_the_busiest_stage():
    s = PipelineSchedule.build("gpipe", 2, 2)
    tl = s.timeline(forward_cost=[1.0, 3.0], backward_cost=[2.0, 6.0])
    # F ticks: (1), (1|3), (3); B ticks: (6), (2|6), (2)
    assert tl.tick_seconds == (1.0, 3.0, 3.0, 6.0, 6.0, 2.0)
    assert tl.total_s == 21.0


def test_interleave_needs_enough_micro_batches():
    with pytest.raises(jaxpar.ContextError, match="at least as many micro-batches"):
        PipelineSchedule.build("gpipe", 4, 2, 2)


def test_slots_hold_what_is_in_flight():
    t = SlotTables.of(PipelineSchedule.build("gpipe", 4, 16))
    assert t.res_slots == 16 and t.act_slots == 1
    t = SlotTables.of(PipelineSchedule.build("1f1b", 4, 16))
    assert t.res_slots == 7 and t.ct_slots == 1
    assert [p[2:] for p in t.phases()] == [(True, False), (True, True), (False, True)]


# -- the split -------------------------------------------------------------------------------------
def test_split_balances_a_heavy_head():
    assert choose_split(8, stages=2, repeats=1, layer_s=1.0).counts == (4, 4)
    heavy = choose_split(8, stages=2, repeats=1, layer_s=1.0, epilogue_s=7.0)
    assert heavy.counts == (5, 3) and heavy.chunk_cost_s(1) < heavy.even_cost_s
    assert choose_split(8, stages=2, repeats=1, layer_s=1.0, epilogue_s=7.0,
                        max_slots=4).counts == (4, 4)  # the memory budget binds
    # an idle slot (a padded chunk walks every slot) as dear as a layer: padding never pays
    assert choose_split(8, stages=2, repeats=1, layer_s=1.0, epilogue_s=7.0,
                        idle_s=1.0).counts == (4, 4)
    cheap = choose_split(8, stages=2, repeats=1, layer_s=1.0, epilogue_s=7.0, idle_s=0.1)
    assert cheap.counts == (5, 3) and cheap.chunk_cost_s(1) == pytest.approx(3 * 3 + 0.6 + 7)


def test_split_interleaved_chunks_and_near_ties_prefer_fewer_slots():
    assert choose_split(8, stages=2, repeats=2, layer_s=1.0).counts == (2, 2, 2, 2)
    # 1% faster with three slots is not worth a third slot of memory
    assert choose_split(4, stages=2, repeats=1, layer_s=1.0, epilogue_s=0.03).counts == (2, 2)



def test_identical_blocks_and_a_light_head_split_evenly():
    """The 8-block GPT (d=16, vocabulary 64) on S=2: its head and loss cost less than a block
    on the clock (bench/pipeline_split.py: [4, 4] the fastest split), so the split is even.  It
    was [7, 1] while each operator cost only its FLOPs and the loss's scalar all-reduce over dp
    was tripled with the epilogue's backward: the epilogue priced at 143 layers."""
    _, _, loss_fn, params, batch = _gpt(8)
    x, y = batch[:, :-1], batch[:, 1:]
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=2,
                                      pipeline_config={"pipeline_scheduler": "gpipe"}):
        step = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(loss_fn)),
                                  batch_argnums=(1, 2))
        split = step.plan(params, x, y).pipeline.split
    assert split.counts == (4, 4), split
    one_layer = split.layer_s * (1.0 + BACKWARD_FACTOR)
    # a block's 68 operators cost more than their FLOPs; the epilogue's collective is priced
    # once (its backward broadcasts the loss's cotangent)
    assert split.layer_s > 68 * jaxpar.HardwareProfile().operator_latency
    assert split.prologue_s < split.epilogue_s < one_layer

# -- the layers found -----------------------------------------------------------------------------
def _gpt(layers=4):
    sys.path.insert(0, "examples")
    import gpt
    import optax
    from flax import nnx

    cfg = gpt.GPTConfig(layers=layers, annotate=False, d_model=16, heads=2, ff=32, seq=8,
                        vocab=64)
    graphdef, params = nnx.split(gpt.GPT(cfg, nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, inputs, targets):
        logits = nnx.merge(graphdef, p)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    batch = np.asarray(next(gpt.batches(gpt.corpus(), 8, cfg.seq)))
    return gpt, cfg, loss_fn, params, batch


def _layers(fn, args, nbatch):
    prog = trace(fn, args)
    g = prog.graph
    batch = frozenset(g.nodes[n].outputs[0] for n in g.inputs[len(g.inputs) - nbatch:])
    return g, find_layers(g, prog.jaxpr, batch, where="test")


def test_gpt_blocks_are_found_and_cut_at_the_residual_stream():
    _, cfg, loss_fn, params, batch = _gpt(4)
    g, ls = _layers(loss_fn, (params, batch[:, :-1], batch[:, 1:]), 2)
    assert len(ls.layers) == 4 and not ls.marked
    act = [g.values[v].shape for v in ls.layers[1].act_in]
    assert act == [(8, 8, 16)]  # only the residual stream crosses a block boundary
    assert any(g.nodes[n].name == "gather" for n in ls.prologue)  # the embedding
    head = [g.nodes[n] for n in ls.epilogue if g.nodes[n].name == "dot_general"]
    assert [g.values[h.outputs[0]].shape for h in head] == [(8, 8, 64)]  # the vocab head
    # the kernels are read as they are; biases and norm scales through weight work (their
    # broadcasts read no batch input and run before the pipeline)
    labels = [g.nodes[g.values[v].producer].label for v in ls.layers[2].weights
              if g.nodes[g.values[v].producer].kind == "input"]
    assert len(labels) == 6 and all(".blocks.2." in lab and "kernel" in lab for lab in labels)
    assert len(ls.stacked) == len(ls.layers[2].weights) >= 12


def test_stage_markers_make_the_layers():
    def loss(w, x):
        for i in range(4):
            with jaxpar.pipeline_stage(i // 2):
                x = jnp.tanh(x @ w[i])
        return jnp.mean(x ** 2)

    _, ls = _layers(loss, (jnp.ones((4, 8, 8)), jnp.ones((4, 8))), 1)
    assert ls.marked and len(ls.layers) == 2 and ls.period == 4


def test_marked_stages_that_differ_are_refused():
    def loss(w, x):
        with jaxpar.pipeline_stage(0):
            x = jnp.tanh(x @ w[0])
        with jaxpar.pipeline_stage(1):
            x = jnp.sin(x @ w[1])
        return jnp.mean(x ** 2)

    with pytest.raises(jaxpar.PlanError, match="same code on their own weights"):
        _layers(loss, (jnp.ones((2, 8, 8)), jnp.ones((4, 8))), 1)


def test_no_repeated_layers_is_a_clear_error():
    def loss(w1, w2, x):
        return jnp.mean(jnp.sin(jnp.tanh(x @ w1) @ w2))

    with pytest.raises(jaxpar.PlanError, match="identical layers"):
        _layers(loss, (jnp.ones((8, 16)), jnp.ones((16, 4)), jnp.ones((4, 8))), 1)


# -- the pipelined step ----------------------------------------------------------------------------
def _toy():
    def loss(w, x):
        for i in range(4):
            x = jnp.tanh(x @ w[i])
        return jnp.mean(x ** 2)

    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.5
    x = jax.random.normal(jax.random.key(1), (16, 8))
    return loss, w, x


@pytest.mark.parametrize("config", [
    {"pipeline_scheduler": "gpipe"},
    {"pipeline_scheduler": "1f1b"},
    {"pipeline_scheduler": "gpipe", "pipeline_interleave": True},
    {"pipeline_scheduler": "1f1b", "pipeline_interleave": True},
    {"pipeline_scheduler": "1f1b", "pipeline_residuals": "recompute"},
], ids=["gpipe", "1f1b", "gpipe-v2", "1f1b-v2", "1f1b-recompute"])
def test_pipelined_step_equals_unpipelined_with_nan_bubbles(config):
    loss, w, x = _toy()
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, pipeline_config=config):
        cell = jaxpar.PipelineCell(loss, bubble_fill=NAN)  # no bubble may reach a result
        step = jaxpar.parallelize(jax.value_and_grad(cell), micro_batches=4, batch_argnums=1)
        value, grad = step(w, x)
        colls = jaxpar.inspect.collectives(step.lower(w, x).compile())
        plan = step.plan(w, x)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    assert np.isfinite(value) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    permutes = colls.of("collective-permute")
    assert permutes.count() >= plan.pipeline.schedule.num_ticks - 1
    assert {r.axes for r in permutes} == {("pp",)}
    v = 2 if config.get("pipeline_interleave") else 1
    assert plan.pipeline.unit_timeline.bubble_fraction == pytest.approx(1 / (v * 4 + 1))
    # the layers keep rows apart: a stage's weight gradients are summed per dp group in the
    # loop and all-reduced over dp once, after it, as predicted (per micro-batch, 10 runs)
    red = plan.pipeline.gradient_reduction
    assert red.once and red.axes == ("dp",), red
    weight_grads = [r for r in colls.of("all-reduce") if r.axes == ("dp",)
                    and any(sh.endswith("8,8]") for sh in r.shapes)]
    # (the loss's parts summed per group in the loop too: XLA combines the two)
    assert [(r.count, r.nbytes) for r in weight_grads] == [
        (1, red.step_bytes + red.loss_bytes)], colls.table()



@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_padded_split_with_row_groups_equals_unpipelined(schedule, monkeypatch):
    """A padded split (3, 1): stage 1 runs one of its three slots, the idle ones under
    ``lax.cond``, per dp row group.  An idle slot reads its weights as the layer lays them out
    (``Pieces.pass_through``): XLA's verifier refused the program ("Inconsistent conditional
    sharding"), the idle branch's zero weight gradient laid out otherwise than the layer's."""
    from jaxpar._src.pipeline import program as pipeline_program

    choose = pipeline_program.choose_split
    monkeypatch.setattr(pipeline_program, "choose_split", lambda n, **kw: dataclasses.replace(
        choose(n, **kw), counts=(3, 1)))
    loss, w, x = _toy()
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2,
                                      pipeline_config={"pipeline_scheduler": schedule}):
        cell = jaxpar.PipelineCell(loss, bubble_fill=NAN)
        step = jaxpar.parallelize(jax.value_and_grad(cell), micro_batches=4, batch_argnums=1)
        value, grad = step(w, x)
        plan = step.plan(w, x)
    assert plan.pipeline.split.counts == (3, 1) and plan.pipeline.gradient_reduction.once
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_marked_stages_pipeline_and_an_undifferentiated_loss_runs_forwards_only():
    def loss(w, x):
        for i in range(4):
            with jaxpar.pipeline_stage(i // 2):
                x = jnp.tanh(x @ w[i])
        return jnp.mean(x ** 2)

    _, w, x = _toy()
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=2):
        step = jaxpar.parallelize(jaxpar.PipelineCell(loss, bubble_fill=NAN), batch_argnums=1)
        value = step(w, x)
        assert step.plan(w, x).pipeline.split.how == "markers"
    np.testing.assert_allclose(value, loss(w, x), rtol=1e-6)


def test_layers_holding_a_scan_pipeline_too():
    def loss(w, x):  # each layer is a loop (its nodes nest in the scan's region)
        for i in range(4):
            wi = w[i]

            def body(h, _, wi=wi):
                return jnp.tanh(h @ wi), None

            x, _ = jax.lax.scan(body, x, None, length=2)
        return jnp.mean(x ** 2)

    _, w, x = _toy()
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2):
        step = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(loss, bubble_fill=NAN)),
                                  micro_batches=4, batch_argnums=1)
        value, grad = step(w, x)
        assert step.plan(w, x).pipeline.layers == 4
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("where", ["where", "in_scan"])
def test_a_layer_broadcasting_a_batch_mask_pipelines(where):
    """A layer that broadcasts a batch input (an attention mask through ``jnp.where``, as flax's
    Gemma does): JAX's ``broadcast_in_dim`` records its result's sharding on the mesh it was
    traced under (the stage's); replayed inside ``shard_map`` (``"pp"`` manual) JAX refused
    it ("context mesh ... should match the aval mesh") until the evaluator moved the sharding
    onto the mesh in force (``compat.on_current_mesh``)."""
    def body(x, m):
        return jnp.where(jnp.expand_dims(m, -1), x, -1.0)

    def loss(w, x, mask):
        for i in range(4):
            x = jnp.tanh(x @ w[i])
            if where == "in_scan":
                x, _ = jax.lax.scan(lambda h, _: (body(h, mask), None), x, None, length=2)
            else:
                x = body(x, mask)
        return jnp.mean(x ** 2)

    w = jax.random.normal(jax.random.key(0), (4, 8, 8)) * 0.5
    x = jax.random.normal(jax.random.key(1), (16, 4, 8))
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (16, 4))
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2):
        step = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(loss, bubble_fill=NAN)),
                                  micro_batches=4, batch_argnums=(1, 2))
        value, grad = step(w, x, mask)
    ref_value, ref_grad = jax.value_and_grad(loss)(w, x, mask)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)


def test_gpt_gradients_equal_unpipelined_with_nan_bubbles():
    # (Model.train below runs 1F1B; the toy above every schedule)
    _, _, loss_fn, params, batch = _gpt(4)
    x, y = batch[:, :-1], batch[:, 1:]
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, pipeline_config={
                                          "pipeline_scheduler": "gpipe",
                                          "pipeline_interleave": True}):
        cell = jaxpar.PipelineCell(loss_fn, bubble_fill=NAN)
        step = jaxpar.parallelize(jax.value_and_grad(cell), micro_batches=2,
                                  batch_argnums=(1, 2))  # 4 rows per micro-batch: 1 per dp
        value, grad = step(params, x, y)
        assert step.plan(params, x, y).pipeline.schedule.repeats == 2
    # the one-device reference jitted: run op by op it compiled ~180 small programs (20 s)
    ref_value, ref_grad = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                         grad, ref_grad))
    assert len(diffs) == len(jax.tree.leaves(ref_grad)) and max(diffs) < 1e-5, max(diffs)


def test_gpt_train_step_on_dp_tp_pp_with_model_train(tmp_path):
    gpt, cfg, _, _, _ = _gpt(2)  # one block per stage: the smallest GPT that pipelines
    import optax
    from flax import nnx

    stream = gpt.batches(gpt.corpus(), 8, cfg.seq)
    data = [(b[:, :-1], b[:, 1:]) for b in (next(stream) for _ in range(2))]

    def loss(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    mesh = jaxpar.make_mesh((2, 2, 2), ("dp", "tp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=2,
                                      pipeline_config={"pipeline_scheduler": "1f1b"}):
        model = jaxpar.Model(gpt.GPT(cfg, nnx.Rngs(0)), loss, optax.adam(1e-2))
        model.train(1, data, callbacks=[jaxpar.ModelCheckpoint("run", str(tmp_path))])
        colls = jaxpar.inspect.collectives(model.lower(*data[0]).compile())
    reference = jaxpar.Model(gpt.GPT(cfg, nnx.Rngs(0)), loss, optax.adam(1e-2))
    reference.train(1, data)
    np.testing.assert_allclose(model.history, reference.history, rtol=1e-5)
    assert model.history[1] < model.history[0]
    # Model.train stacks the blocks' weights (and Adam's moments) by stage: no weight moves
    # over pp (per layer: an all-gather over pp of each stacked weight every step), and the
    # network, its optimizer state and the checkpoint are per layer again afterwards
    assert not [r for r in colls if r.axes and "pp" in r.axes
                and r.kind in ("all-gather", "all-to-all")], colls.table()
    want = jax.tree.map(np.shape, reference.params)
    assert jax.tree.map(np.shape, model.params) == want
    assert jax.tree.map(np.shape, model._opt_state) == jax.tree.map(np.shape,
                                                                      reference._opt_state)
    saved = jaxpar.load_checkpoint(tmp_path / "run")["params"]
    assert sorted(map(np.shape, jax.tree.leaves(saved))) == \
        sorted(map(np.shape, jax.tree.leaves(reference.params)))
    # the loop's permutes rotate micro-batches over pp; outside the loop XLA may also permute
    # devices to move a value between two layouts of the same mesh (one call each)
    rotations = [r for r in colls.of("collective-permute") if r.count > 1]
    assert rotations and {r.axes for r in rotations} == {("pp",)}
    # the search uses the tp axis too (at this size as more data parallelism: XLA reduces
    # the gradients over dp and tp together)
    assert any(r.axes and "tp" in r.axes for r in colls), colls.table()
    # the blocks', the embedding's and the head's weight gradients are reduced over the row
    # axes once, after the loop (ends.py), and the loss's parts with them (tail.py): at 1 row
    # per group the loss traced at 1 row takes a label's logit by another gather (the row
    # dimension of 1 squeezed from its indices), which the proof knows (rowflow._one_row)
    cell = next(v for k, v in model._steps.items() if isinstance(k, tuple) and k[0] == "pipeline")
    program = cell.last_program
    red = GradientReduction.of(program)
    assert red.once and "dp" in red.axes and program.ends.prologue and program.ends.epilogue
    assert red.ends_bytes > 0 and "after the loop" in red.ends_why, red
    assert sum(r.nbytes for r in colls.of("all-reduce") if r.count == 1 and r.axes == red.axes
               and r.nbytes > 4) == red.after_loop_bytes, colls.table()
    assert program.ends.affine is not None and red.loss_bytes == 4, red.ends_why
    # nothing crosses the row axes inside the loop (before: the loss's scalar sum, each
    # micro-batch)
    in_loop = [r for r in colls if r.count > 1 and r.axes and "pp" not in r.axes]
    assert not in_loop, colls.table()


# -- stacked layer weights -------------------------------------------------------------------------
def _over_pp(colls, weight_shape):
    """Collectives over pp that move layer weights (arrays ending in a weight's shape; the
    batch is shaped otherwise) other than the loop's rotations and its psum of the loss."""
    tail = ",".join(map(str, weight_shape)) + "]"
    return [r for r in colls if r.axes and "pp" in r.axes
            and r.kind not in ("collective-permute", "all-reduce")
            and any(sh.endswith(tail) for sh in r.shapes)]


def _adam_step(cell):
    import optax

    opt = optax.adam(1e-2)

    def step(p, o, x):
        value, grads = jax.value_and_grad(cell)(p, x)
        updates, o = opt.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    return opt, step


@pytest.mark.parametrize("S", [2, 4])
def test_stacked_weights_stay_on_their_stage(S):
    def loss(w, x):
        for i in range(8):
            x = jnp.tanh(x @ w[i])
        return jnp.mean(x ** 2)

    keys = jax.random.split(jax.random.key(0), 9)
    w = [jax.random.normal(k, (16, 16)) * 0.3 for k in keys[:8]]
    x = jax.random.normal(keys[8], (32, 16))  # not shaped like a weight
    layer_bytes = sum(a.nbytes for a in w)
    mesh = jaxpar.make_mesh((8 // S, S), ("dp", "pp"))
    # S = 4 with ZeRO level 1: the stacked moments split over dp too, the weights stay whole
    zero = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {
        "optimizer_level": "level1", "parallel_optimizer_threshold": 0}} if S == 4 else {}
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=S, micro_batches=4, **zero):
        cell = jaxpar.PipelineCell(loss, batch_argnums=1, bubble_fill=NAN)
        opt, step_fn = _adam_step(cell)
        sw = cell.stack(w, x)
        step = jaxpar.parallelize(step_fn, batch_argnums=2)
        new_sw, _, value = step(sw, opt.init(sw), x)
        compiled = step.lower(sw, opt.init(sw), x).compile()
        if S == 2:  # the same step on per-layer weights, laid out by the step's plan: the
            # weights or their gradients cross pp every step (what this test would catch)
            plain = jaxpar.inspect.collectives(step.lower(w, opt.init(w), x).compile())
            assert sum(r.nbytes * r.count for r in _over_pp(plain, (16, 16))) >= \
                layer_bytes / S
    assert isinstance(new_sw, jaxpar.StackedParams)
    # without a pipeline the cell takes the stacked weights too (it unstacks them)
    np.testing.assert_allclose(cell(new_sw, x), loss(new_sw.unstack(), x), rtol=1e-6)
    ref_opt, ref_fn = _adam_step(loss)
    ref_w, _, ref_value = jax.jit(ref_fn)(w, ref_opt.init(w), x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(new_sw.unstack(), ref_w, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    colls = jaxpar.inspect.collectives(compiled)
    assert _over_pp(colls, (16, 16)) == [], colls.table()
    # per device: the stage's layers (1/S of them), their two Adam moments (split over dp at
    # level 1), and the batch shard
    stage = sum(a.addressable_shards[0].data.nbytes for a in sw.stacked)
    assert stage == layer_bytes // S
    x_shard = np.prod(compiled.input_shardings[0][2].shard_shape(x.shape)) * x.dtype.itemsize
    count = 4  # Adam's step count, int32
    moments = 2 * stage // (8 // S if zero else 1)
    assert compiled.memory_analysis().argument_size_in_bytes == stage + moments + count + x_shard


@pytest.fixture
def compiles():
    """The number of XLA compiles so far (a list of one, counted while the test runs)."""
    count = [0]

    def compiled(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(compiled)
    yield count
    jax.monitoring.unregister_event_duration_listener(compiled)


def test_unstack_and_restack_are_one_program_each(compiles):
    """Eager, unstack slices every leaf in one jitted program and stack builds every stacked
    array in one (before: a program per leaf and slot, and per group's zeros, stack, reshape:
    64 of the (2, 2, 2) GPT Model.train test's 136 compiles), with the values, dtypes and
    shardings of the per-leaf slices and stacks."""
    def loss(p, x):
        for w, b in p["layers"]:
            x = jnp.tanh(x @ w + b)
        return jnp.mean((x @ p["head"]) ** 2)

    keys = jax.random.split(jax.random.key(0), 8)
    p = {"layers": [(jax.random.normal(keys[i], (8, 8)), jax.random.normal(keys[3 + i], (8,)))
                    for i in range(3)], "head": jax.random.normal(keys[6], (8, 4))}
    x = jax.random.normal(keys[7], (16, 8))
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=4):
        sw = jaxpar.PipelineCell(loss, batch_argnums=1).stack(p, x)
    layout = sw.layout
    assert len(layout.groups) == 2 and layout.others  # the head stays as it is
    assert any(-1 in g for g in layout.groups)  # 3 layers on 2 stages: a padding slot
    # the layer weights put split over pp on their first dimension, and one of them over dp too
    shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
        "pp", *([None] * (a.ndim - 2)), "dp" if a.ndim == 5 else None)) for a in sw.stacked]
    sw = jaxpar.StackedParams(
        [jax.device_put(a, s) for a, s in zip(sw.stacked, shardings, strict=True)],
        sw.others, layout)
    before = compiles[0]
    got = jax.tree.leaves(sw.unstack())
    assert compiles[0] - before == 1
    again = jax.tree.leaves(sw.unstack())
    assert compiles[0] - before == 1  # a second unstack compiles nothing
    leaves = jax.tree.leaves(p)
    want: list = [None] * len(leaves)
    for i, a in zip(layout.others, sw.others, strict=True):
        want[i] = a
    # the per-leaf slices, as before (taken after unstack: they compile the programs the
    # old unstack ran, one per leaf and slot)
    for group, a in zip(layout.groups, sw.stacked, strict=True):
        flat = jnp.reshape(a, (len(group),) + a.shape[3:])
        for slot, leaf in enumerate(group):
            if leaf >= 0:
                want[leaf] = flat[slot]
    for a, b, c, leaf in zip(got, want, again, leaves, strict=True):
        assert a.dtype == b.dtype == leaf.dtype and a.shape == leaf.shape
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, leaf)
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
        assert c.sharding.is_equivalent_to(a.sharding, a.ndim)
    assert got[layout.others[0]] is p["head"]  # a leaf kept as it is is not copied
    # restacking (Model.train's optimizer moments): one program, the given shardings, zeros
    # in the padding slots (the leaves on the mesh already: moving one device's arrays to the
    # mesh compiles small programs of its own, one per shape)
    p = jax.device_put(p, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    leaves = jax.tree.leaves(p)
    before = compiles[0]
    first = stacked.stack(layout, p, shardings)
    restack = stacked.stack(layout, p, shardings)
    assert compiles[0] - before == 1
    for a, b, s, group in zip(first.stacked, restack.stacked, shardings, layout.groups,
                              strict=True):
        per_slot = [np.asarray(leaves[x]) if x >= 0 else np.zeros(a.shape[3:], a.dtype)
                    for x in group]
        np.testing.assert_array_equal(a, np.stack(per_slot).reshape(a.shape))
        np.testing.assert_array_equal(b, a)
        assert a.dtype == leaves[max(group)].dtype and a.sharding == s == b.sharding
    assert first.layout.specs and first.others[0] is p["head"]


# -- errors ----------------------------------------------------------------------------------------
def test_bad_pipeline_options_are_context_errors():
    with pytest.raises(jaxpar.ContextError, match="pipeline_scheduler"):
        jaxpar.set_auto_parallel_context(pipeline_config={"pipeline_scheduler": "seqpipe"})
    with pytest.raises(jaxpar.ContextError, match="unknown pipeline_config key"):
        jaxpar.set_auto_parallel_context(pipeline_config={"interleave": True})
    with pytest.raises(jaxpar.ContextError, match="micro_batches"):
        jaxpar.set_auto_parallel_context(micro_batches=0)
    with jaxpar.auto_parallel_context(pipeline_stages=4,
                                      pipeline_config={"pipeline_interleave": True}):
        assert jaxpar.get_auto_parallel_context("pipeline_stages") == 4
        assert jaxpar.get_auto_parallel_context("pipeline_config") == {
            "pipeline_interleave": True}


def test_a_mesh_without_pp_and_an_uneven_batch_are_explained():
    loss, w, x = _toy()
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                      mesh=jaxpar.make_mesh((8,), ("dp",))):
        with pytest.raises(jaxpar.MeshError, match="'pp'"):
            jaxpar.parallelize(jaxpar.PipelineCell(loss), batch_argnums=1)(w, x)
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                      mesh=jaxpar.make_mesh((4, 2), ("dp", "pp"))):
        with pytest.raises(jaxpar.PlanError, match="micro_batches=3"):
            jaxpar.parallelize(jaxpar.PipelineCell(loss), micro_batches=3,
                               batch_argnums=1)(w, x)


@pytest.mark.parametrize("micro_batches, batch_argnums, error, match", [
    # 2 rows a micro-batch over the stage's dp=4: the stage's own plan said only that a batch
    # of [2, 8] does not split "over all 4 devices", naming data_parallel and not the pipeline
    (8, 1, jaxpar.PlanError, r"micro_batches=8 cuts the batch of 16 rows into micro-batches "
                             r"of 2, .* Use micro_batches=4 \(any of \[1, 2, 4\]"),
    # an argument that does not exist: "no batch input to split ... say which arguments
    # carry the batch (batch_argnums)", as though none had been named
    (4, 5, jaxpar.PlanError, r"batch_argnums=\(5,\) names argument 5, but the function is "
                             r"called with 2 arguments"),
], ids=["rows-over-dp", "batch-argnums-out-of-range"])
def test_bad_micro_batch_inputs_name_the_pipeline_and_the_fix(micro_batches, batch_argnums,
                                                              error, match):
    loss, w, x = _toy()
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                      mesh=jaxpar.make_mesh((4, 2), ("dp", "pp"))):
        cell = jaxpar.PipelineCell(loss, batch_argnums=batch_argnums)
        with pytest.raises(error, match=match):
            jaxpar.parallelize(jax.value_and_grad(cell), micro_batches=micro_batches)(w, x)
