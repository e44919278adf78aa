"""ShardingPlan: the explain table, JSON round trips, caching per signature."""

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from tests import models


@pytest.fixture(scope="module")
def step():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    return jaxpar.parallelize(jax.value_and_grad(models.mlp_loss), mesh=mesh,
                              parallel_mode="semi_auto_parallel",
                              in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1)))


def test_explain_lists_operator_source_strategy_and_communication(step):
    params, x = models.init_mlp(jax.random.key(0))
    text = step.plan(params, x).explain()
    header = text.splitlines()[1]
    for column in ("operator", "source", "layout", "comm/device (est.)", "origin"):
        assert column in header
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert len(dots) == 5  # forward 2; backward: dh, dw1, dw2 (x is not differentiated)
    assert all("models.py:" in line for line in dots)
    assert "all-reduce mp" in text and "in_strategy" in text
    assert text.splitlines()[-2].startswith("predicted collectives: all-reduce")
    assert text.splitlines()[-1].startswith("simulated step time (cpu):")
    assert len(step.plan(params, x).explain(verbose=True).splitlines()) > len(text.splitlines())


def test_plan_json_round_trips(step, tmp_path):
    params, x = models.init_mlp(jax.random.key(0))
    plan = step.plan(params, x)
    again = jaxpar.ShardingPlan.from_json(plan.to_json())
    assert again == plan
    plan.save(tmp_path / "plan.json")
    assert jaxpar.ShardingPlan.load(tmp_path / "plan.json") == plan
    with pytest.raises(jaxpar.PlanError, match="not a plan file"):
        jaxpar.ShardingPlan.from_json('{"format": "something else"}')


def test_plans_are_cached_per_input_signature(step):
    params, x = models.init_mlp(jax.random.key(0))
    assert step.plan(params, x) is step.plan(params, x)
    assert step.compiled_entry(params, x) is step.compiled_entry(params, x + 1)
    _, x_big = models.init_mlp(jax.random.key(0), batch=32)
    assert step.plan(params, x_big) is not step.plan(params, x)


def test_predicted_collectives_summarise_by_kind(step):
    params, x = models.init_mlp(jax.random.key(0))
    plan = step.plan(params, x)
    summary = plan.communication_summary()
    assert set(summary) == {"all-reduce"}
    # The forward all-reduce over mp, and the w1, w2 gradients and the loss over dp, which XLA
    # combines into one all-reduce: what the compiled program has.
    assert summary["all-reduce"]["count"] == 2
    assert len(plan.predicted_collectives(combined=False)) == 1 + 2 + 1
    compiled = jaxpar.inspect.collectives(step.lower(params, x))
    assert compiled.count("all-reduce") == 2 and compiled.count() == 2, compiled.table()
    assert summary["all-reduce"]["wire_bytes"] == pytest.approx(compiled.wire_bytes(), rel=1e-6)


def test_stand_alone_mode_plans_everything_replicated_on_one_device():
    params, x = models.init_mlp(jax.random.key(0))
    f = jaxpar.parallelize(models.mlp, parallel_mode="stand_alone")
    plan = f.plan(params, x)
    assert plan.mesh.num_devices == 1
    assert all(s.is_replicated for d in plan.decisions for s in d.out_specs)
    assert jnp.allclose(f(params, x), models.mlp(params, x))


def test_state_results_take_the_layout_of_their_arguments():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))

    def sgd_step(params, x):
        loss, grads = jax.value_and_grad(models.mlp_loss)(params, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params, x = models.init_mlp(jax.random.key(0))
    step = jaxpar.parallelize(sgd_step, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1)),
                              donate_argnums=0)
    plan = step.plan(params, x)
    ins, outs = plan.input_layouts(), plan.output_layouts()
    assert outs["out.0.w1"] == ins["params.w1"] and outs["out.0.w2"] == ins["params.w2"]
    new, _ = step(params, x)
    again, _ = step(new, x)  # same layout in and out: no resharding between steps
    assert again["w1"].sharding == new["w1"].sharding
