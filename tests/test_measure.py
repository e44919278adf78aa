"""Measuring the cost model against what it did not produce: calibration, the HLO yardstick,
and models written by others (bench/zoo) through every mode."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src import calibrate as calibrate_mod
from jaxpar._src.hardware import calibration_path
from tests import models
from tests.util import assert_tree_close

MODES = ("recursive_programming", "dynamic_programming", "optimal")


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((2, 4), ("dp", "mp"))


# -- calibration --------------------------------------------------------------------------------
def test_calibrated_profile_is_measured_saved_and_loaded(mesh, tmp_path):
    result = calibrate_mod.measure(mesh, sizes=(4096, 65536), kinds=("all-reduce", "all-gather"),
                                   rounds=1, progress=False)
    hw = result.profile
    assert dict(hw.axis_bandwidth).keys() == {"dp", "mp"} == dict(hw.axis_latency).keys()
    assert all(b > 0 for _, b in hw.axis_bandwidth) and all(a >= 0 for _, a in hw.axis_latency)
    assert hw.flops_per_s > 1e6 and hw.memory_per_device > 2**20
    assert result.memory_bandwidth > 1e6
    # a traced operator's fixed cost: about 1 us on this emulated mesh, well under a ms anywhere
    assert 0 < result.operator_latency < 1e-3 and hw.operator_latency == result.operator_latency
    assert {(m.axis, m.kind, m.group) for m in result.measurements} == {
        (a, k, n) for a, n in (("dp", 2), ("mp", 4)) for k in ("all-reduce", "all-gather")} | {
        ("dp+mp", "all-reduce", 8)}  # the joint all-reduce, beside the per-axis fits
    assert all(m.seconds > 0 for m in result.measurements)
    path = tmp_path / "hw.json"
    result.save(path)
    assert jaxpar.HardwareProfile.load(path) == hw
    hw.save(tmp_path / "plain.json")
    assert jaxpar.HardwareProfile.load(tmp_path / "plain.json") == hw


def test_fit_recovers_alpha_and_beta_from_exact_times():
    alpha, beta = 3e-5, 2e9
    points = []
    for kind in ("all-reduce", "all-gather", "collective-permute"):
        for size in (1e3, 1e5, 1e7):
            steps, wire = calibrate_mod.model_terms(kind, size, 4)
            points.append(calibrate_mod.Measurement("x", kind, 4, size,
                                                    steps * alpha + wire / beta))
    fit = calibrate_mod._fit(points)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.rms_rel_error < 1e-9


def test_hardware_calibrated_loads_the_cache_or_calibrates(mesh, tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate_mod, "calibrate", functools.partial(
        calibrate_mod.calibrate, sizes=(4096,), kinds=("all-reduce",), rounds=1,
        progress=False))
    path = calibration_path(mesh)
    assert path.startswith(str(tmp_path)) and "dp2-mp4" in path
    params, x = models.init_mlp(jax.random.key(0))
    step = jaxpar.parallelize(models.mlp, mesh=mesh, parallel_mode="auto_parallel",
                              hardware="calibrated")
    plan = step.plan(params, x)  # no file yet: calibrates and saves
    measured = jaxpar.HardwareProfile.load(path)
    assert plan.flops_per_s == measured.flops_per_s
    mine = jaxpar.HardwareProfile(flops_per_s=123e9, axis_bandwidth={"dp": 1e9, "mp": 2e9})
    mine.save(path)
    jaxpar._src.hardware._CALIBRATED.clear()
    again = jaxpar.parallelize(models.mlp, mesh=mesh, parallel_mode="auto_parallel",
                               hardware="calibrated")
    assert again.plan(params, x).flops_per_s == 123e9  # the file, not a new measurement
    with pytest.raises(jaxpar.ContextError, match="calibrated"):
        jaxpar.parallelize(models.mlp, mesh=mesh, hardware="fastest").plan(params, x)


# -- the yardstick ------------------------------------------------------------------------------
def test_yardstick_prices_the_compiled_collectives(mesh):
    params, x = models.init_mlp(jax.random.key(1))
    step = jaxpar.parallelize(models.mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1)))
    compiled = step.lower(params, x).compile()
    hw = jaxpar.HardwareProfile(flops_per_s=1e12, axis_bandwidth={"dp": 1e9, "mp": 4e9},
                                axis_latency={"dp": 1e-5, "mp": 1e-6})
    y = jaxpar.inspect.yardstick(compiled, hw)
    (ar,) = jaxpar.inspect.collectives(compiled)  # one all-reduce over mp of f32[8,16]
    assert y.collective_count == 1 and ar.axes == ("mp",)
    expected = 6 * 1e-6 + 2 * 3 / 4 * 512 / 4e9  # 2 (n - 1) steps, ring wire bytes
    assert y.communication_s == pytest.approx(expected)
    assert y.compute_s == pytest.approx(jaxpar.inspect.flops(compiled) / 1e12)
    assert y.memory_bytes == jaxpar.inspect.memory(compiled)["total"] and y.fits_memory
    roof = jaxpar.inspect.yardstick(compiled, hw, memory_bandwidth=1e3)  # memory-bound
    assert roof.compute_s == pytest.approx(y.bytes_accessed / 1e3) and y.bytes_accessed > 0
    assert roof.communication_s == y.communication_s


# -- rules the zoo needs, and the zoo itself ----------------------------------------------------
def _rope_loss(w, x):
    from bench.zoo import meta_llama

    q = (x @ w).reshape(8, 16, 4, 8)
    cos, sin = meta_llama.precompute_freqs(8, 16, 10000.0)
    return jnp.mean(meta_llama.apply_rotary_emb(q, cos, sin) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_interleaved_rope_stack_and_unstack_have_rules(mesh, mode):
    # JaxparWarning is an error in this suite: a missing rule for stack/unstack would fail here.
    w = jax.random.normal(jax.random.key(0), (32, 32))
    x = jax.random.normal(jax.random.key(1), (8, 16, 32))
    fn = jax.value_and_grad(_rope_loss)
    step = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel", search_mode=mode)
    assert_tree_close(step(w, x), jax.jit(fn)(w, x))
    plan = step.plan(w, x)
    assert plan.ops("stack") and plan.ops("unstack")
    # the new dimension of the pairs stays whole
    assert all(s.dims[-1] == () for d in plan.ops("stack") for s in d.out_specs)


@pytest.fixture(scope="module")
def gemma():
    from bench import zoo

    case = zoo.gemma(batch=8, seq=8, layers=1)
    fn = case.grad_fn()
    return case, fn, jax.jit(fn)(case.params, case.state, *case.batch)


@pytest.mark.parametrize("plan", ("data_parallel", "megatron") + MODES)
def test_zoo_nnx_gemma_numerics_in_every_mode(mesh, gemma, plan):
    gemma, fn, (ref_loss, ref_grads) = gemma
    args = (gemma.params, gemma.state, *gemma.batch)
    batch = tuple(range(2, len(args)))
    if plan == "data_parallel":
        step = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="data_parallel",
                                  batch_argnums=batch)
    elif plan == "megatron":
        specs = gemma.megatron_specs("mp")
        assert sum(s != P() for s in specs.values()) == 6  # q, kv, out, gate, up, down
        step = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=(specs, None) + (P("dp"),) * len(batch))
    else:
        step = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel",
                                  search_mode=plan)
    loss, grads = step(*args)
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    worst = max(float(jnp.max(jnp.abs(grads[k] - ref_grads[k]))) for k in ref_grads)
    scale = max(float(jnp.max(jnp.abs(g))) for g in ref_grads.values())
    assert worst <= 1e-4 * scale, worst
    if plan == "megatron":  # heads split over mp: the gradient comes back split the same way
        kernel = "layers/0/attn/q_einsum/kernel"
        assert grads[kernel].sharding.spec == P("mp")
        assert np.asarray(grads[kernel]).shape == gemma.params[kernel].shape
