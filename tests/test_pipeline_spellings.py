"""MindSpore's ways of asking for a pipeline, each checked to pipeline: ``PipelineCell(net,
micro_size)``, stage marks on NNX modules (``cell.pipeline_stage = i``), and the split the plan
chose named in the top-level ``plan.explain()``.  Each pipelined step is checked against the
unpipelined one (float32 precision, NaN in the bubbles) and, for the marks, for its
collective-permutes over ``pp`` in the compiled HLO."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from tests.test_pipeline import _toy

NAN = float("nan")


def _pipelined(cell, args, stages=2, mesh_shape=(4, 2), config=None, **parallelize_kw):
    """``(value, grad, plan, collectives)`` of ``value_and_grad(cell)`` pipelined."""
    mesh = jaxpar.make_mesh(mesh_shape, ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=stages,
                                      pipeline_config=config or {}):
        step = jaxpar.parallelize(jax.value_and_grad(cell), batch_argnums=1, **parallelize_kw)
        value, grad = step(*args)
        return value, grad, step.plan(*args), jaxpar.inspect.collectives(
            step.lower(*args).compile())


# -- PipelineCell(net, micro_size) ----------------------------------------------------------------
@functools.cache
def _by_micro_batches(n):
    """The toy pipelined with ``parallelize(micro_batches=n)``: the reference (compiled once)."""
    loss, w, x = _toy()
    return _pipelined(jaxpar.PipelineCell(loss, bubble_fill=NAN), (w, x), micro_batches=n)


@pytest.mark.parametrize("micro_size, micro_batches, want", [
    (4, None, 4),  # MindSpore's spelling alone
    (None, 4, 4),  # jaxpar's parallelize(micro_batches=...)
    (4, 2, 4),     # both: the cell's own count wins (PipelineCell's docstring)
    (2, None, 2),
], ids=["micro_size", "micro_batches", "micro_size-wins", "micro_size-2"])
def test_micro_size_pipelines_like_micro_batches(micro_size, micro_batches, want):
    loss, w, x = _toy()
    kw = {} if micro_batches is None else {"micro_batches": micro_batches}
    value, grad, plan, _ = _pipelined(jaxpar.PipelineCell(loss, micro_size, bubble_fill=NAN),
                                      (w, x), **kw)
    ref_value, ref_grad, ref_plan, _ = _by_micro_batches(want)
    assert plan.pipeline.config.micro_batches == want == ref_plan.pipeline.config.micro_batches
    assert plan.pipeline.micro_rows == 16 // want
    assert plan.pipeline.unit_timeline.bubble_fraction == pytest.approx(1 / (want + 1))
    np.testing.assert_array_equal(value, ref_value)  # the same program
    np.testing.assert_array_equal(grad, ref_grad)
    one_value, one_grad = jax.value_and_grad(loss)(w, x)
    np.testing.assert_allclose(value, one_value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad, one_grad, rtol=1e-5, atol=1e-6)


# -- stage marks on NNX modules --------------------------------------------------------------------
def _marked_nnx_net(stage_of_block):
    """Four tanh(Linear) blocks, block ``i`` marked ``pipeline_stage(stage_of_block(i))`` in
    place (MindSpore: ``net.blocks[i].pipeline_stage = ...``); ``(loss, params, x)``."""
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return jnp.tanh(self.lin(x))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([Block(rngs) for _ in range(4)])

        def __call__(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    net = Net(nnx.Rngs(0))
    for i, block in enumerate(net.blocks):
        assert jaxpar.pipeline_stage(stage_of_block(i))(block) is block  # marked in place
    graphdef, params = nnx.split(net, nnx.Param)

    def loss(p, x):
        return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

    return loss, params, jax.random.normal(jax.random.key(1), (16, 8))


@pytest.mark.parametrize("stage_of_block, config, repeats", [
    (lambda i: i // 2, {"pipeline_scheduler": "gpipe"}, 1),
    (lambda i: i // 2, {"pipeline_scheduler": "1f1b"}, 1),
    # interleaved: the marks number the chunks, chunk c on stage c % 2
    (lambda i: i, {"pipeline_scheduler": "gpipe", "pipeline_interleave": True}, 2),
], ids=["gpipe", "1f1b", "gpipe-v2"])
def test_stage_marks_on_nnx_modules_pipeline(stage_of_block, config, repeats):
    """Each marked region (the blocks sharing a mark) is one layer of the pipeline."""
    loss, params, x = _marked_nnx_net(stage_of_block)
    value, grad, plan, colls = _pipelined(jaxpar.PipelineCell(loss, bubble_fill=NAN),
                                          (params, x), config=config, micro_batches=4)
    assert plan.pipeline.split.how == "markers"
    assert plan.pipeline.layers == len({stage_of_block(i) for i in range(4)}) == 2 * repeats
    assert plan.pipeline.schedule.repeats == repeats
    ref_value, ref_grad = jax.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6, atol=1e-6)
    diffs = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))),
                                         grad, ref_grad))
    assert len(diffs) == 8 and max(diffs) < 1e-5, diffs
    permutes = colls.of("collective-permute")
    assert permutes.count() >= plan.pipeline.schedule.num_ticks - 1, colls.table()
    assert {r.axes for r in permutes} == {("pp",)}


# -- the split in plan.explain() -------------------------------------------------------------------
@pytest.mark.parametrize("stages, mesh_shape, forced, counts", [
    (2, (4, 2), None, (2, 2)),
    (4, (2, 4), None, (1, 1, 1, 1)),
    (2, (4, 2), (3, 1), (3, 1)),  # a split the search would not choose: explain names it
], ids=["S2", "S4", "S2-forced-3-1"])
def test_explain_names_the_split_the_plan_chose(stages, mesh_shape, forced, counts,
                                               monkeypatch):
    if forced is not None:
        from jaxpar._src.pipeline import program as pipeline_program

        choose = pipeline_program.choose_split
        monkeypatch.setattr(pipeline_program, "choose_split", lambda n, **kw: dataclasses.replace(
            choose(n, **kw), counts=forced))
    loss, w, x = _toy()
    _, _, plan, _ = _pipelined(jaxpar.PipelineCell(loss), (w, x), stages=stages,
                               mesh_shape=mesh_shape, micro_batches=4)
    assert plan.pipeline.split.counts == counts
    text = plan.explain()  # the top-level plan's, not only plan.pipeline's
    assert f"split: counts {list(counts)} balance the cost model's time" in text, text
