"""jaxpar.recompute (MindSpore's Cell.recompute) and the automatic per-block policy choice.

Numbers are checked against single-device runs without recomputation; memory and FLOPs are read
from the compiled program (memory_analysis / cost_analysis), not from jaxpar's model.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar

LAYERS, BATCH, D, F = 3, 1024, 32, 128


def block(w, x):
    h = jax.nn.gelu(x @ w["w1"])
    return x + jnp.tanh(h @ w["w2"])


def make_step(layer):
    def loss(params, x):
        for w in params:
            x = layer(w, x)
        return jnp.mean(x ** 2)

    def step(params, x):
        g = jax.grad(loss)(params, x)
        return jax.tree.map(lambda p, d: p - 0.1 * d, params, g)

    return step


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
    params = [{"w1": jax.random.normal(k[2 * i], (D, F)) * 0.1,
               "w2": jax.random.normal(k[2 * i + 1], (F, D)) * 0.1} for i in range(LAYERS)]
    return params, jax.random.normal(k[-1], (BATCH, D))


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((8,), ("dp",))


@pytest.fixture(scope="module")
def compiled(data, mesh):
    """Per policy: the parallelized step's result and its compiled program."""
    params, x = data
    out = {}
    for policy in ("none", "full"):
        f = jaxpar.parallelize(make_step(jaxpar.recompute(block, policy=policy)), mesh=mesh,
                               parallel_mode="data_parallel", batch_argnums=(1,))
        out[policy] = (f(params, x), f.lower(params, x).compile(), f.plan(params, x))
    return out


@pytest.mark.parametrize("policy", ["none", "full"])
def test_numerics_equal_the_step_without_recomputation(data, compiled, policy):
    params, x = data
    want = jax.jit(make_step(block))(params, x)  # one device, nothing recomputed
    got = compiled[policy][0]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_recompute_lowers_compiled_temp_memory_and_raises_flops(compiled):
    none, full = compiled["none"][1], compiled["full"][1]
    temp = {p: jaxpar.inspect.memory(c)["temp"] for p, c in (("none", none), ("full", full))}
    assert temp["full"] < 0.8 * temp["none"], temp  # measured: 0.65
    assert jaxpar.inspect.flops(full) > 1.1 * jaxpar.inspect.flops(none)
    assert "recomputed in the backward pass" in compiled["full"][2].explain()
    assert "recomputed" not in compiled["none"][2].explain()


def test_dots_policy_keeps_products_with_weights(data):
    params, x = data
    loss = lambda layer: lambda p, x: make_step(layer)(p, x)[0]["w1"].sum()  # noqa: E731
    jaxpr = str(jax.make_jaxpr(loss(jaxpar.recompute(block, policy="dots")))(params, x))
    assert "dots_with_no_batch_dims_saveable" in jaxpr or "remat" in jaxpr
    saved = {}
    for p in ("none", "dots", "full"):
        layer = jaxpar.recompute(block, policy=p)
        saved[p] = jaxpar.inspect.saved_activations(
            lambda w, x, layer=layer: layer(w, x).sum(), params[0], x)
    assert saved["none"] > saved["dots"] > saved["full"], saved


def test_nnx_module_is_recomputed_in_place():
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(8, 32, rngs=rngs)
            self.down = nnx.Linear(32, 8, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.gelu(self.up(x)))

    plain = Block(nnx.Rngs(0))
    marked = jaxpar.recompute(Block(nnx.Rngs(0)))
    assert isinstance(marked, Block) and marked.recompute_policy == "full"
    x = jnp.ones((4, 8))

    def grads(model):
        graphdef, state = nnx.split(model)  # the mark survives split / merge

        def loss(state):
            return (nnx.merge(graphdef, state)(x) ** 2).sum()

        return jax.jit(jax.grad(loss))(state), jax.make_jaxpr(jax.grad(loss))(state)

    (g_plain, j_plain), (g_marked, j_marked) = grads(plain), grads(marked)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_marked), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "remat" in str(j_marked) and "remat" not in str(j_plain)
    assert jaxpar.recompute(marked) is marked  # configured again alike: nothing changes
    with pytest.raises(jaxpar.ContextError, match="configured"):
        jaxpar.recompute(marked, policy="dots")


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "some"}, "policy must be"),
    ({"mp_comm_recompute": False}, "mp_comm_recompute"),
    ({"parallel_optimizer_comm_recompute": True}, "parallel_optimizer_comm_recompute"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(jaxpar.ContextError, match=match):
        jaxpar.recompute(block, **kwargs)


def _budget(x: float):
    return jaxpar.auto_parallel_context(hardware=jaxpar.HardwareProfile(memory_per_device=x))


def test_auto_choice_fits_every_budget_and_is_monotone(data, mesh):
    params, x = data
    f = jaxpar.parallelize(make_step(jaxpar.recompute(block, policy="auto")), mesh=mesh,
                           parallel_mode="auto_parallel")
    with _budget(1e12):  # room for everything: nothing recomputed
        roomy = f.plan(params, x)
    assert "nothing recomputed" in roomy.explain()
    peak0 = jaxpar.inspect.memory(f.lower(params, x))["total"]
    # Budgets from the program without recomputation down to 70% of it (measured rungs:
    # 1.0, 0.84, 0.76, 0.68, 0.67, ... of it; nothing here depends on those numbers but the
    # count of distinct choices).
    peaks, chosen = [], []
    for fraction in (1.0, 0.9, 0.8, 0.7):
        budget = fraction * peak0
        with _budget(budget):
            plan = f.plan(params, x)
            peak = jaxpar.inspect.memory(f.lower(params, x))["total"]
        assert peak <= budget, (fraction, peak, budget)
        assert f"recompute (auto, {LAYERS} blocks" in plan.explain()
        assert plan.summary()["recompute"][0].startswith("recompute (auto")
        peaks.append(peak)
        chosen.append(tuple(n.rsplit(": ", 1)[1] for n in plan.notes
                            if n.startswith("recompute block")))
    assert all(a >= b for a, b in zip(peaks, peaks[1:], strict=False)), peaks  # monotone
    assert len(set(chosen)) >= 3, chosen  # the budgets bind: different choices
    assert chosen[0] == ("none",) * LAYERS and "none" not in chosen[-1], chosen
    with _budget(0.3 * peak0), pytest.raises(jaxpar.PlanError,
                                             match=r"memory_per_device.*Raise memory_per_device"):
        f.plan(params, x)


def test_auto_outside_a_choice_recomputes_nothing(data):
    params, x = data
    auto = jaxpar.recompute(block, policy="auto")
    loss = lambda w, x: auto(w, x).sum()  # noqa: E731
    assert "remat" not in str(jax.make_jaxpr(jax.grad(loss))(params[0], x))
    full = jaxpar.recompute(block)
    assert "remat" in str(jax.make_jaxpr(jax.grad(lambda w, x: full(w, x).sum()))(params[0], x))


def test_linen_module_class_is_rematerialized():
    nn = pytest.importorskip("flax.linen")

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(jax.nn.gelu(nn.Dense(32)(x)))

    x = jnp.ones((4, 8))
    variables = Mlp().init(jax.random.key(0), x)
    loss = lambda m: lambda v: (m.apply(v, x) ** 2).sum()  # noqa: E731
    marked = jaxpar.recompute(Mlp)()
    g_plain, g_marked = jax.grad(loss(Mlp()))(variables), jax.grad(loss(marked))(variables)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_marked), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert "remat" in str(jax.make_jaxpr(jax.grad(loss(marked)))(variables))
    with pytest.raises(jaxpar.ContextError, match="pass its class"):
        jaxpar.recompute(Mlp())


@pytest.mark.parametrize("order", ["stage-first", "recompute-first"])
def test_a_module_staged_and_recomputed_keeps_both_marks(order):
    from flax import nnx

    from jaxpar._src.pipeline.markers import stage_of

    m = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    if order == "stage-first":  # restaging used to drop to the unrecomputed base class
        jaxpar.pipeline_stage(1)(m)
        jaxpar.recompute(m)
    else:
        jaxpar.recompute(m)
        jaxpar.pipeline_stage(1)(m)
    jaxpar.pipeline_stage(0)(m)
    graphdef, params = nnx.split(m)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: nnx.merge(graphdef, p)(x).sum()))(
        params, jnp.ones((2, 4)))
    assert "remat" in str(jaxpr) or "checkpoint" in str(jaxpr)
    assert {stage_of(str(e.source_info.name_stack)) for e in jaxpr.eqns} - {None} == {0}


@pytest.mark.parametrize("peaks, smallest", [
    # the zoo's 2-layer Gemma (round 32's measures): the ladder's rungs, then the all-full
    # rung searched with memory priced in (Adam's moments split over dp), the smallest
    ((530_540, 503_852, 500_204, 499_820, 499_820, 311_340), "304 KiB"),
    ((530_540, 400_000, 420_000), "391 KiB"),  # a rung before the last is the smallest
])
def test_the_refusal_names_the_smallest_program_compiled(peaks, smallest):
    from jaxpar._src.recompute_choice import Rung, ladder, refusal

    rungs = [Rung(policies, None, None, None, peak, 0.0) for policies, peak in
             zip([*ladder(2), ladder(2)[-1]], peaks, strict=False)]
    error = refusal("f", ["a", "b"], 100e3, rungs)
    assert isinstance(error, jaxpar.PlanError)
    assert f"still needs {smallest}" in str(error), str(error)
    assert "Raise memory_per_device" in str(error)


# Predicted (plan.memory_bytes, jaxpar's model) against compiled (memory_analysis: arguments +
# outputs - aliased + temporaries) per policy, for the 3-layer MLP step above on (8,) in
# auto_parallel.  Tolerance 7%: the model places buffers in graph order, not in XLA's schedule,
# and packs them with XLA's heap algorithm in outline (program_memory.py); measured 1.042
# (none) and 1.061 (dots).  "full" is under by 26% (0.738: 456,704 B against 618,592 B):
# the model's packing run on XLA's own lifetimes (its live-range dump) gives XLA's
# temporaries within 3.5% for every policy, but with full recomputation XLA's schedule holds
# 475,136 B of temporaries live at once where the model's graph order holds 333,824 B:
# XLA:CPU's optimized HLO has lost the checkpoint's optimization barriers and merged the
# recomputed x @ w1 products with the forward's, which it keeps live into the backward.
# README "Recomputation" has the numbers; the row is a strict xfail, so a model that learns
# XLA's schedule fails here and the row must become a plain one.
@pytest.mark.parametrize("policy, tolerance", [
    ("none", 0.07),
    ("dots", 0.07),
    pytest.param("full", 0.07, marks=pytest.mark.xfail(
        strict=True, reason="XLA's schedule keeps more live than graph order: 0.74")),
])
def test_predicted_memory_is_near_the_compiled_per_policy(data, mesh, policy, tolerance):
    params, x = data
    f = jaxpar.parallelize(make_step(jaxpar.recompute(block, policy=policy)), mesh=mesh,
                           parallel_mode="auto_parallel")
    predicted = f.plan(params, x).memory_bytes
    compiled = jaxpar.inspect.memory(f.lower(params, x).compile())["total"]
    assert abs(predicted / compiled - 1.0) <= tolerance, (policy, predicted, compiled)
