"""auto_parallel: the fast searches against the exact one, pins, memory, strategy checkpoints,
explanations and predicted collectives (the known answers are in ``test_known_answers.py``).

Most cases are priced with the ``cpu`` profile, the machine the tests compile for, on which the
6-layer MLP with 256-wide weights and a 32-row batch is a Megatron plan.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests import auto_models as am
from tests.util import assert_tree_close

MODES = ("recursive_programming", "dynamic_programming", "optimal")
CPU = jaxpar.HardwareProfile()
BYTES_ONLY = jaxpar.HardwareProfile(preset="h100", intra_node_latency=0.0,
                                    inter_node_latency=0.0, collective_latency=0.0)


@pytest.fixture(scope="module")
def mesh4():
    return jaxpar.make_mesh((4,), ("x",))


def _auto(fn, mesh, mode, hw=CPU, **kw):
    return jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel", search_mode=mode,
                              hardware=hw, **kw)


def _kernels(plan):
    return [spec for name, spec in plan.input_layouts().items()
            if name.startswith("params.") and name.endswith("kernel.value")]


@pytest.mark.parametrize("mode", MODES)
def test_large_vocabulary_head_is_split_by_vocabulary(mode, mesh4):
    step, args = am.embedding_head()
    f = _auto(step, mesh4, mode)
    assert f.plan(*args).input_layouts()["params.head"] == P(None, "x")
    assert_tree_close(f(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-6)


def test_heavier_traffic_goes_to_the_faster_axis():
    """The same model on a (2, 4) mesh with one fast and one slow link: whichever axis is fast
    carries more of the traffic than it does when it is the slow one."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step, args = am.wide_mlp()
    moved = {}
    for fast, slow in (("dp", "mp"), ("mp", "dp")):
        hw = jaxpar.HardwareProfile(preset="a100", axis_bandwidth={fast: 300e9, slow: 25e9})
        f = _auto(step, mesh, "optimal", hw=hw)
        per_axis = {"dp": 0.0, "mp": 0.0}
        for c in jaxpar.inspect.collectives(f.lower(*args)):
            for axis in c.axes or ():
                per_axis[axis] += c.wire_bytes * c.count / len(c.axes)
        moved[fast] = per_axis
    assert moved["dp"]["dp"] > moved["mp"]["dp"], moved
    assert moved["mp"]["mp"] > moved["dp"]["mp"], moved


def _suite():
    mesh4 = jaxpar.make_mesh((4,), ("x",))
    mesh24 = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    two_links = jaxpar.HardwareProfile(preset="a100", axis_bandwidth={"dp": 25e9, "mp": 300e9})
    return {
        "mlp-megatron": (*am.flax_mlp_adam(32, 256), mesh4, CPU),
        "mlp-dp": (*am.flax_mlp_adam(256, 32), mesh4, CPU),
        "block": (*am.transformer_block(), mesh4, CPU),
        "convnet": (*am.convnet(), mesh4, jaxpar.HardwareProfile(preset="h100")),
        "embedding": (*am.embedding_head(), mesh4, CPU),
        "block-2d": (*am.transformer_block(batch=8, seq=32), mesh24, two_links),
        "mlp-2d": (*am.wide_mlp(), mesh24, two_links),
    }


@pytest.mark.slow
def test_fast_searches_land_near_the_exact_optimum():
    gaps = {}
    for name, (fn, args, mesh, hw) in _suite().items():
        plans = {mode: _auto(fn, mesh, mode, hw=hw).plan(*args) for mode in MODES}
        best = plans["optimal"].objective_s
        assert plans["optimal"].optimal
        for mode in MODES[:2]:
            plan = plans[mode]
            gaps[(name, mode)] = plan.objective_s / best - 1
            assert plan.objective_s <= plan.baseline_s * (1 + 1e-9)  # never worse than DP
            assert plan.objective_s >= best * (1 - 1e-6)  # the optimum is a lower bound
    within = [g <= 0.05 for g in gaps.values()]
    assert sum(within) >= 0.8 * len(within), gaps


@pytest.mark.parametrize("mode", MODES)
def test_user_pins_are_never_overridden(mode, mesh4):
    step, args = am.flax_mlp_adam(batch=32, hidden=256)
    # The batch pinned to x: the textbook plan (Megatron) is off the table; the pin holds.
    f = _auto(step, mesh4, mode, in_strategy=(None, None, P("x"), P("x")),
              out_strategy=(None, None, P()))
    plan = f.plan(*args)
    assert plan.input_layouts()["x"] == P("x") and plan.input_layouts()["y"] == P("x")
    assert plan.output_layouts()["out.2"] == P()
    origins = {d.label: d.origin for d in plan.decisions if d.kind == "input"}
    assert origins["x"] == "in_strategy"
    assert_tree_close(f(*args), jax.jit(step)(*args), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_memory_budget_is_respected_or_refused(mode, mesh4):
    step, args = am.flax_mlp_adam(batch=256, hidden=32)
    free = _auto(step, mesh4, mode).plan(*args)
    assert all(s == P() for n, s in free.input_layouts().items() if n.startswith("params."))
    budget = 0.75 * free.memory_bytes
    tight = jaxpar.HardwareProfile(preset="h100", intra_node_latency=0.0,
                                   inter_node_latency=0.0, memory_per_device=budget)
    plan = _auto(step, mesh4, mode, hw=tight).plan(*args)
    assert plan.memory_bytes <= budget
    assert any(s != P() for n, s in plan.input_layouts().items() if n.startswith("params."))
    hopeless = jaxpar.HardwareProfile(preset="h100", memory_per_device=1000)
    with pytest.raises(jaxpar.PlanError, match=r"budget of 1000 B per device.*smallest plan"):
        _auto(step, mesh4, mode, hw=hopeless).plan(*args)


def test_strategy_checkpoint_saves_and_reloads_without_searching(mesh4, tmp_path):
    step, args = am.flax_mlp_adam(batch=32, hidden=256)
    path = str(tmp_path / "strategy.json")
    with jaxpar.auto_parallel_context(strategy_ckpt_save_file=path):
        searched = _auto(step, mesh4, "recursive_programming")
        plan = searched.plan(*args)
        text = searched.lower(*args).as_text()
    with jaxpar.auto_parallel_context(strategy_ckpt_load_file=path):
        loaded = _auto(step, mesh4, "recursive_programming")
        again = loaded.plan(*args)
        assert loaded.lower(*args).as_text() == text
    assert again.search_mode == "loaded:recursive_programming"
    assert [d.in_specs for d in again.decisions] == [d.in_specs for d in plan.decisions]
    other, other_args = am.flax_mlp_adam(batch=64, hidden=256)
    with jaxpar.auto_parallel_context(strategy_ckpt_load_file=path):
        with pytest.raises(jaxpar.PlanError, match="does not match this program|nodes"):
            _auto(other, mesh4, "recursive_programming").plan(*other_args)


def test_explain_shows_runner_up_and_cost_terms_and_summary_totals(mesh4):
    step, args = am.flax_mlp_adam(batch=32, hidden=256)
    plan = _auto(step, mesh4, "optimal").plan(*args)
    text = plan.explain()
    assert "runner-up (extra cost)" in text and "compute / comm / layout change" in text
    dots = [d for d in plan.ops("dot_general")]
    assert all(d.terms is not None and d.runner_up is not None for d in dots)
    assert all(d.runner_up_extra_s >= -1e-12 for d in dots)  # the optimum beats its runner-up
    summary = plan.summary()
    for key in ("collectives", "memory_bytes_per_device", "step_time_s", "compute_s",
                "communication_s", "data_parallel_s", "proven_optimal"):
        assert key in summary
    big = [c for c in plan.predicted_collectives() if c.kind == "all-reduce" and c.nbytes > 64]
    assert len(big) == 5  # as compiled; besides them the model prices a scalar (the loss)
    assert summary["step_time_s"] == pytest.approx(plan.objective_s, rel=1e-6)
    assert jaxpar.ShardingPlan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize("case", ["mlp-megatron", "block", "convnet", "block-2d"])
def test_predicted_collective_bytes_match_the_compiled_program(case):
    fn, args, mesh, hw = _suite()[case]
    f = _auto(fn, mesh, "recursive_programming", hw=hw)
    predicted = f.plan(*args).summary()["collective_wire_bytes"]
    measured = jaxpar.inspect.collectives(f.lower(*args)).wire_bytes()
    assert measured == pytest.approx(predicted, rel=0.10), (predicted, measured)


def test_scan_layer_stack_is_searched_consistently():
    from tests import models

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step = am.sgd_step(models.scan_stack_loss)
    args = models.init_stack(jax.random.key(0), layers=4, batch=32, d=64)
    f = _auto(step, mesh, "recursive_programming",
              hw=jaxpar.HardwareProfile(preset="h100"))
    plan = f.plan(*args)
    for c in (d for d in plan.decisions if d.kind == "enter" and d.name == "carry"):
        assert c.in_specs[0] == c.in_specs[1] == c.out_specs[0]
    assert_tree_close(f(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-6)
    assert np.isfinite(plan.objective_s) and plan.objective_s <= plan.baseline_s
    assert jnp.isfinite(f(*args)[1])


@pytest.mark.parametrize("mode", MODES)
def test_meshes_need_not_be_powers_of_two(mode):
    mesh = jaxpar.make_mesh((2, 3), ("dp", "mp"))  # six of the eight devices
    step, args = am.transformer_block(batch=6, seq=12, d=96, heads=6, ff=192)
    f = _auto(step, mesh, mode, hw=BYTES_ONLY)
    plan = f.plan(*args)
    used = {a for spec in plan.input_layouts().values() for e in spec if e
            for a in ((e,) if isinstance(e, str) else e)}
    assert "mp" in used  # the 3-way axis carries splits
    assert_tree_close(f(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-6)
