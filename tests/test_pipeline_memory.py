"""A pipelined plan's memory per device (``jaxpar/_src/pipeline/memory.py``): the loop's slots,
accumulators and one tick, counted in ``plan.memory_bytes`` and checked against the compiled
program's ``memory_analysis()``; the split's memory check under a budget.

The GPT rows, all schedules, are ``bench/pipeline_memory.py``'s table (README); here a toy of 8
identical ``tanh`` layers compiles in seconds."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpar
from jaxpar._src.pipeline.memory import estimate
from jaxpar._src.pipeline.residuals import taint
from jaxpar._src.pipeline.schedule import PipelineSchedule

TOLERANCE = 0.10  # |predicted / compiled - 1| (README: the GPT table's residual is within 5%)


def _toy(head: int):
    """8 layers ``tanh(x @ w_i)`` (32 x 32), then a head of ``head`` columns (0: none)."""
    def loss(p, x):
        w, h = p
        for i in range(8):
            x = jnp.tanh(x @ w[i])
        return jnp.mean((x @ h) ** 2) if head else jnp.mean(x ** 2)

    k = jax.random.split(jax.random.key(0), 3)
    w = list(jax.random.normal(k[0], (8, 32, 32)) * 0.3)
    h = jax.random.normal(k[1], (32, head)) * 0.1 if head else jnp.zeros(())
    return loss, (w, h), jax.random.normal(k[2], (64, 32))


def _step(S, M, config, *, dp, adam, zero=False, head=0, hardware=None):
    """The toy's train step pipelined (Adam: weights stacked, ``cell.stack``); its plan and
    the compiled program's memory per device."""
    loss, params, x = _toy(head)
    zero_options = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {
        "optimizer_level": "level1", "parallel_optimizer_threshold": 0}} if zero else {}
    extra = {"hardware": hardware} if hardware is not None else {}
    with jaxpar.auto_parallel_context(
            parallel_mode="semi_auto_parallel", mesh=jaxpar.make_mesh((dp, S), ("dp", "pp")),
            pipeline_stages=S, micro_batches=M, pipeline_config=config, **zero_options):
        cell = jaxpar.PipelineCell(loss, batch_argnums=1)
        if adam:
            opt = optax.adam(1e-3)

            def step(p, o, x):
                value, grads = jax.value_and_grad(cell)(p, x)
                updates, o = opt.update(grads, o, p)
                return optax.apply_updates(p, updates), o, value

            sp = cell.stack(params, x)
            args, f = (sp, opt.init(sp), x), jaxpar.parallelize(step, batch_argnums=2, **extra)
        else:
            args = (params, x)
            f = jaxpar.parallelize(jax.value_and_grad(cell), batch_argnums=1, **extra)
        plan = f.plan(*args)
        return plan, jaxpar.inspect.memory(f.lower(*args).compile())


def test_slots_follow_the_schedule():
    """GPipe keeps every micro-batch's residuals, 1F1B ``O(S)``; recomputing keeps only the
    chunk's input, and its backward remakes the chunk's residuals within the tick."""
    def loop(kind, residuals="store", repeats=1, slots=2):
        return estimate(PipelineSchedule.build(kind, 4, 16, repeats), slots=slots,
                        layer_bytes=1000.0, stored_bytes=100.0, full_bytes=150.0,
                        carried_bytes=10.0, recompute=residuals == "recompute")

    gpipe, one = loop("gpipe"), loop("1f1b")
    assert (gpipe.res_slots, one.res_slots) == (16, 7)  # in_flight(): M, 2 (S - 1) + 1
    assert gpipe.residual_slots == 17 * 2 * 100.0  # + the scratch slot, 2 layers per chunk
    assert one.residual_slots == 8 * 2 * 100.0
    assert one.tick == gpipe.tick == 2 * 1000.0  # the chunk's weight gradients > residuals
    rec = loop("1f1b", "recompute")
    assert rec.residual_slots == 8 * 10.0 and rec.tick == 2 * (1000.0 + 150.0)
    inter = loop("1f1b", repeats=2, slots=1)  # v = 2 chunks of 1 layer per stage
    assert inter.res_slots > one.res_slots and inter.residual_slots < one.residual_slots


@pytest.mark.parametrize("S, M, config, dp, adam, zero, head", [
    (2, 4, {"pipeline_scheduler": "gpipe"}, 4, True, False, 0),
    (2, 4, {"pipeline_scheduler": "1f1b", "pipeline_residuals": "recompute"}, 4, True, True,
     0),
    (4, 8, {"pipeline_scheduler": "1f1b", "pipeline_interleave": True}, 2, True, False, 0),
    (2, 4, {"pipeline_scheduler": "gpipe"}, 1, False, False, 4096),  # no row groups
], ids=["gpipe", "1f1b-recompute-zero1", "1f1b-v2-S4", "gpipe-dp1-head"])
def test_predicted_memory_is_the_compiled_programs(S, M, config, dp, adam, zero, head):
    plan, mem = _step(S, M, config, dp=dp, adam=adam, zero=zero, head=head)
    loop = plan.pipeline.memory
    assert loop is not None and loop.how == "traced"
    assert abs(plan.memory_bytes / mem["total"] - 1) <= TOLERANCE, (plan.memory_bytes, mem,
                                                                    loop)
    # the loop is what the step's plan did not see before: without it, off by more than that
    assert (plan.memory_bytes - loop.total) / mem["total"] < 1 - 2 * TOLERANCE
    assert "loop" in plan.pipeline.explain() and "residual slots" in plan.pipeline.explain()


def test_a_cond_taints_its_outputs_one_by_one():
    """A padded split's slot runs under ``lax.cond``: what a branch makes from the weights
    alone stays clean (recomputed in the backward, not stored per micro-batch); everything
    is tainted where the branch index is."""
    def slot(w, x, on):
        return jax.lax.cond(on, lambda w, x: (jnp.tanh(x @ w), w * 2.0),
                            lambda w, x: (x, jnp.zeros_like(w)), w, x)

    closed = jax.make_jaxpr(slot)(jnp.ones((4, 4)), jnp.ones((2, 4)), True)
    w, x, on = closed.jaxpr.invars
    y, w2 = closed.jaxpr.outvars
    dirty = taint(closed.jaxpr, {x})
    assert y in dirty and w2 not in dirty
    assert {y, w2} <= taint(closed.jaxpr, {on})


def test_the_split_respects_the_memory_budget():
    """A heavy head pulls layers to stage 0 (split (5, 3): 5 slots); a budget one byte below
    that split's estimate leaves at most 4 slots, within it; none fits 1 KB (said so).  Priced
    by FLOPs alone (``operator_latency=0``): the toy's layers are two operators each, about
    what an idle slot of a padded chunk costs, so with that priced no padding pays."""
    flops_only = jaxpar.HardwareProfile(operator_latency=0.0)
    free, _ = _step(2, 4, {"pipeline_scheduler": "gpipe"}, dp=1, adam=False, head=4096,
                    hardware=flops_only)
    split = free.pipeline.split
    assert split.slots == 5 and split.counts == (5, 3), split
    # padded (stage 1 runs 3 of its 5 slots, each under a lax.cond): a layer stores three
    # [16, 32] leaves of its micro-batch's rows, not a copy of its [32, 32] weight too
    # (10,240 B while residuals.taint tainted a cond's outputs as a whole)
    assert free.pipeline.memory.layer_stored == 3 * 16 * 32 * 4
    budget = split.memory_bytes - 1
    tight, _ = _step(2, 4, {"pipeline_scheduler": "gpipe"}, dp=1, adam=False, head=4096,
                     hardware=jaxpar.HardwareProfile(memory_per_device=budget,
                                                     operator_latency=0.0))
    chosen = tight.pipeline.split
    assert chosen.slots == 4 and chosen.fits and chosen.memory_bytes <= budget, chosen
    hopeless, _ = _step(2, 4, {"pipeline_scheduler": "gpipe"}, dp=1, adam=False, head=4096,
                        hardware=jaxpar.HardwareProfile(memory_per_device=1000))
    assert not hopeless.pipeline.split.fits
    assert "exceeds the budget" in hopeless.pipeline.explain()


def test_a_loss_not_differentiated_holds_no_residual_or_cotangent_slots():
    loss, params, x = _toy(0)
    with jaxpar.auto_parallel_context(
            parallel_mode="semi_auto_parallel", mesh=jaxpar.make_mesh((4, 2), ("dp", "pp")),
            pipeline_stages=2, micro_batches=4):
        plan = jaxpar.parallelize(jaxpar.PipelineCell(loss, batch_argnums=1),
                                  batch_argnums=1).plan(params, x)
    loop = plan.pipeline.memory
    assert (loop.res_slots, loop.ct_slots, loop.residual_slots, loop.cotangent_slots) == \
        (0, 0, 0.0, 0.0), loop
    assert loop.activation_slots > 0 and loop.tick == loop.slots * plan.pipeline.split.layer_bytes
