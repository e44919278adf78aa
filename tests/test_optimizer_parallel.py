"""The parallel optimizer (MindSpore's ``enable_parallel_optimizer``; ZeRO 1/2/3, FSDP).

Known answers: ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020, sections 5 and 7): per device, the optimizer state (level 1), the
gradients (level 2) and the parameters (level 3) fall to 1/N_d of their size; levels 1-2 move
data parallel's 2Ψ per step (reduce-scatter + all-gather), level 3 adds one all-gather (3Ψ).
MaxText and Levanter express FSDP the same way, as dimension-0 shardings over a data axis.

What is measured: the per-device bytes of each argument leaf from the compiled program's input
shardings (``shard_shape``), their sum beside ``memory_analysis().argument_size_in_bytes``, the
planned layouts of the gradients (level 2), and the collectives of the partitioned HLO.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests.util import assert_tree_close

D, H, B = 64, 256, 256
LEVELS = (0, 1, 2, 3)  # 0: plain data parallel


def _problem():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (D, H)) * 0.05, "b1": jnp.zeros((H,)),
              "w2": jax.random.normal(k[1], (H, D)) * 0.05}
    # eps 1e-3: Adam's first step is about lr * sign(g), which would turn the float32
    # rounding of a near-zero gradient (summed in another order) into a visible change
    tx = optax.adam(1e-2, eps=1e-3)
    x = jax.random.normal(k[2], (B, D))
    y = jax.random.normal(k[3], (B, D))

    def loss(p, x, y):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, tx.init(params), x, y)


def _zero(level: int, **config) -> dict:
    if level == 0:
        return {}
    return dict(enable_parallel_optimizer=True,
                parallel_optimizer_config={"optimizer_level": f"level{level}", **config})


def _leaf_bytes(compiled, args) -> list[tuple[int, int]]:
    """(full bytes, per-device bytes) of every argument leaf, from the input shardings."""
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    out = []
    for x, s in zip(jax.tree.leaves(args), shardings, strict=True):
        item = np.dtype(x.dtype).itemsize
        out.append((math.prod(x.shape) * item, math.prod(s.shard_shape(x.shape)) * item))
    return out


@pytest.fixture(scope="module")
def compiled_levels():
    """Each level's compiled step in data_parallel mode on 8 devices, and its results."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((8,), ("dp",))
    out = {}
    for level in LEVELS:
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            compiled = f.lower(*args).compile()
            out[level] = (compiled, f(*args))
    return args, out, jax.jit(step)(*args)


def test_state_bytes_per_device_fall_as_one_over_dp(compiled_levels):
    args, out, _ = compiled_levels
    params, opt_state = args[0], args[1]
    n_params, n_opt = len(jax.tree.leaves(params)), len(jax.tree.leaves(opt_state))
    moments = [k for k, x in enumerate(jax.tree.leaves(opt_state)) if x.ndim]  # not count
    for level, (compiled, _) in out.items():
        leaves = _leaf_bytes(compiled, args)
        p, o = leaves[:n_params], leaves[n_params:n_params + n_opt]
        mom_full = sum(o[k][0] for k in moments)
        mom_here = sum(o[k][1] for k in moments)
        # level >= 1: Adam's moments 1/8 per device; level 3: the parameters too.
        assert mom_here == (mom_full // 8 if level >= 1 else mom_full), level
        p_full, p_here = sum(a for a, _ in p), sum(b for _, b in p)
        assert p_here == (p_full // 8 if level == 3 else p_full), level
        # The program's own account of its argument bytes agrees (within 3%).
        analysed = compiled.memory_analysis().argument_size_in_bytes
        assert abs(analysed - sum(b for _, b in leaves)) <= 0.03 * analysed, level
    # memory_analysis alone: level 1 saves 7/8 of the moments, level 3 also 7/8 of the params
    arg = {level: c.memory_analysis().argument_size_in_bytes for level, (c, _) in out.items()}
    saved_moments = 7 / 8 * mom_full
    saved_params = 7 / 8 * p_full
    assert abs((arg[0] - arg[1]) - saved_moments) <= 0.03 * saved_moments
    assert arg[2] == arg[1]
    assert abs((arg[1] - arg[3]) - saved_params) <= 0.03 * saved_params


def test_numerics_equal_data_parallel_and_one_device(compiled_levels):
    _, out, single = compiled_levels
    for _, result in out.values():
        assert_tree_close(result, single, rtol=1e-5, atol=1e-6)
        assert_tree_close(result, out[0][1], rtol=1e-5, atol=1e-6)


def test_collectives_gather_the_split_parameters(compiled_levels):
    """Levels 1-2 all-gather the updated parameters once (Ψ bytes); level 3 gathers them for
    the forward pass (Ψ) and again for the backward pass (ZeRO-3's second all-gather: ``w2``,
    read by ``dh = dy @ w2ᵀ``; ``w1``'s backward read makes ``dx``, which nothing needs, and
    ``b1`` is added, not read whole); plain data parallel gathers nothing.  Data parallel
    all-reduces the gradients (Ψ); levels 1-3 reduce-scatter them (see
    ``test_levels_1_to_3_reduce_scatter_the_gradients``) and all-reduce only the loss."""
    args, out, _ = compiled_levels
    psi = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0]))
    for level, (compiled, _) in out.items():
        colls = jaxpar.inspect.collectives(compiled)
        gathered = colls.total_bytes("all-gather")
        again = args[0]["w2"].size * 4 if level == 3 else 0
        assert gathered == (0 if level == 0 else psi + again), (level, colls.table())
        # data parallel: one gradient all-reduce of Ψ (+ the loss); levels 1-3: the loss
        assert colls.total_bytes("all-reduce") == (psi + 4 if level == 0 else 4), (
            level, colls.table())
        assert colls.total_bytes("reduce-scatter") == (0 if level == 0 else psi), (
            level, colls.table())


def test_threshold_and_shard_size_follow_mindspore():
    """MindSpore's opt_param_mgr.cc: arrays under ``parallel_optimizer_threshold`` KB (default
    64) stay whole; ``optimizer_weight_shard_size`` takes whole mesh axes, innermost first."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    with jaxpar.auto_parallel_context(**_zero(3, optimizer_weight_shard_size=4)):
        f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
        layouts = f.plan(*args).input_layouts()
    # w1, w2: 64 KB each (not under 64 KB): split over the 4 innermost devices; b1: 1 KB.
    assert layouts["params.w1"] == P("mp") and layouts["params.w2"] == P("mp")
    assert layouts["params.b1"] == P()
    with jaxpar.auto_parallel_context(**_zero(1, optimizer_weight_shard_size=3)):
        with pytest.raises(jaxpar.ContextError, match="optimizer_weight_shard_size=3"):
            jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel").plan(*args)


def test_semi_auto_keeps_user_layouts_and_splits_over_the_batch_axes():
    step, args = _problem()
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    with jaxpar.auto_parallel_context(**_zero(3, parallel_optimizer_threshold=0)):
        f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="semi_auto_parallel",
                               in_strategy=({"w1": P(None, "mp"), "b1": P("mp"),
                                             "w2": P("mp")}, None, P("dp"), P("dp")))
        layouts = f.plan(*args).input_layouts()
        result = f(*args)
    # the user's tensor-parallel split kept, dimension 0 split further over the batch axis
    assert layouts["params.w1"] == P("dp", "mp")
    assert layouts["params.w2"] == P(("mp", "dp"))
    assert layouts["params.b1"] == P(("mp", "dp"))
    assert layouts["opt_state.0.mu.w1"] == P("dp")
    assert_tree_close(result, jax.jit(step)(*args), rtol=1e-5, atol=1e-6)


def test_model_level2_splits_the_gradients():
    """``Model`` at level 2 constrains the gradients where ``jax.grad`` makes them: their
    planned layouts hold 1/8 per device; the losses equal plain data parallel's."""
    step, (params, _, x, y) = _problem()

    def apply(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]

    def mse(out, y):
        return jnp.mean((out - y) ** 2)

    x, y = np.asarray(x), np.asarray(y)
    losses = {}
    for level in (0, 2):
        with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel",
                                          **_zero(level, parallel_optimizer_threshold=0)):
            model = jaxpar.Model((params, apply), mse, optax.adam(1e-2, eps=1e-3))
            model.train(2, [(x, y)])
            losses[level] = model.history
            if level == 2:
                state = (params, {}, model.optimizer.init(params), ())
                plan = model._train_step(state, (x, y)).plan(state, x, y)
    np.testing.assert_allclose(losses[2], losses[0], rtol=1e-5)
    # data_parallel: the step goes through parallelize (not per replica) with its state split
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel",
                                      **_zero(1, parallel_optimizer_threshold=0)):
        model = jaxpar.Model((params, apply), mse, optax.adam(1e-2, eps=1e-3))
        model.train(2, [(x, y)])
        assert isinstance(model._train_step(state, (x, y)), jaxpar.Parallelized)
    np.testing.assert_allclose(model.history, losses[0], rtol=1e-5)
    grads = [d for d in plan.decisions if d.name == "sharding_constraint"]
    mesh = plan.mesh
    assert sorted(d.out_shapes[0] for d in grads) == [(D, H), (H,), (H, D)]
    for d in grads:
        assert d.out_specs[0].shard_fraction(mesh) == 1 / 8, d


def test_context_validates_the_config():
    jaxpar.set_auto_parallel_context(enable_parallel_optimizer=True,
                                     parallel_optimizer_config={"optimizer_level": "level2"})
    assert jaxpar.get_auto_parallel_context("parallel_optimizer_config") == {
        "optimizer_level": "level2"}
    for bad in ({"optimizer_level": "level4"}, {"parallel_optimizer_threshold": -1},
                {"optimizer_weight_shard_size": 0}, {"gradient_accumulation_shard": 1},
                {"zero_stage": 2}):
        with pytest.raises(jaxpar.ContextError):
            jaxpar.set_auto_parallel_context(parallel_optimizer_config=bad)
    with pytest.raises(jaxpar.ContextError):
        jaxpar.set_auto_parallel_context(enable_parallel_optimizer="yes")


def test_auto_level_is_the_least_communication_that_fits():
    """``"optimizer_level": "auto"``: off (data parallel) while it fits the memory budget, then
    level 1, then level 3; each chosen plan's predicted peak is under its budget."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((8,), ("dp",))

    def plan(budget, **config):
        with jaxpar.auto_parallel_context(**config):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel",
                                   hardware=jaxpar.HardwareProfile(memory_per_device=budget))
            return f.plan(*args)

    peaks = {level: plan(1e12, **_zero(level, parallel_optimizer_threshold=0)).memory_bytes
             for level in (0, 1, 3)}
    assert peaks[0] > peaks[1] > peaks[3]
    auto = _zero(1, parallel_optimizer_threshold=0)
    auto["parallel_optimizer_config"]["optimizer_level"] = "auto"
    for budget, chosen in ((peaks[0], "off"), ((peaks[0] + peaks[1]) / 2, "level1"),
                           ((peaks[1] + peaks[3]) / 2, "level3")):
        p = plan(budget, **auto)
        assert f"parallel optimizer: {chosen} chosen" in p.notes[-1], p.notes
        assert p.memory_bytes <= budget


def test_auto_parallel_search_keeps_the_split_state():
    """In ``auto_parallel`` the levels are pins the search plans around: at level 3 every
    parameter and moment holds 1/8 per device, whatever the search does with the rest."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    with jaxpar.auto_parallel_context(**_zero(3, parallel_optimizer_threshold=0)):
        plan = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel").plan(*args)
    for name, spec in plan.input_layouts().items():
        if name.startswith(("params.", "opt_state.0.mu.", "opt_state.0.nu.")):
            assert spec == P(("dp", "mp")), (name, spec)


@pytest.fixture(scope="module")
def unsplit():
    """The step on one device and each mesh's plain data-parallel step (no parallel
    optimizer), computed by the first level's test and compared against by all three."""
    return {}


@pytest.mark.parametrize("level", [1, 2, 3])
def test_levels_1_to_3_reduce_scatter_the_gradients(level, monkeypatch, unsplit):
    """ZeRO-1/2's and FSDP's gradients: reduce-scattered where the backward pass contracts
    over the batch (``jaxpar/_src/scatter.py``), not all-reduced whole and sliced (XLA:CPU has
    no reduce-scatter creator pass): every gradient (weights and bias: Ψ) is reduce-scattered
    once, the only all-reduce over the batch axis is the loss's, and the numbers equal one
    device and data parallel.  On a (2, 4) mesh over both axes, and with the weights split
    over ``mp`` too (manual over every axis); the evaluator (``lower.py``) and the annotated
    jaxpr (``annotate.py``) agree."""
    step, args = _problem()
    if "single" not in unsplit:
        unsplit["single"] = jax.jit(step)(*args)
    single = unsplit["single"]
    psi = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    tp = {"w1": P(None, "mp"), "b1": P("mp"), "w2": P("mp")}  # the moments laid out alike
    moments = jax.tree.map(lambda x: P() if x.ndim == 0 else None, args[1])
    moments[0].mu.update(tp), moments[0].nu.update(tp)
    cases = [(jaxpar.make_mesh((8,), ("dp",)), dict(parallel_mode="data_parallel"), 1),
             (jaxpar.make_mesh((2, 4), ("dp", "mp")), dict(parallel_mode="data_parallel"), 1),
             (jaxpar.make_mesh((2, 4), ("dp", "mp")),
              dict(parallel_mode="semi_auto_parallel",
                   in_strategy=(tp, moments, P("dp"), P("dp"))), 4)]
    for case, (mesh, kw, mp) in enumerate(cases):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, **kw, mesh=mesh)
            compiled = f.lower(*args).compile()
            result = f(*args)
        if case not in unsplit:  # the same for every level
            with jaxpar.auto_parallel_context():
                unsplit[case] = jaxpar.parallelize(step, **kw, mesh=mesh)(*args)
        dp = unsplit[case]
        colls = jaxpar.inspect.collectives(compiled)
        assert colls.total_bytes("reduce-scatter") == psi // mp, (mesh, colls.table())
        # over the batch axis, only the f32 loss (over mp: the tensor-parallel activation's)
        over_dp = sum(c.nbytes for c in colls.of("all-reduce") if "dp" in c.axes)
        assert over_dp == 4, (mesh, colls.table())
        assert_tree_close(result, single, rtol=1e-5, atol=1e-6)
        assert_tree_close(result, dp, rtol=1e-5, atol=1e-6)
        if mp == 1:  # the same program when the graph is evaluated instead of written down
            with monkeypatch.context() as m, jaxpar.auto_parallel_context(
                    **_zero(level, parallel_optimizer_threshold=0)):
                m.setattr("jaxpar._src.lower.can_annotate", lambda graph: False)
                evaluated = jaxpar.parallelize(step, **kw, mesh=mesh).lower(*args).compile()
            assert jaxpar.inspect.collectives(evaluated).table() == colls.table()


def test_sums_of_gradients_and_the_embedding_reduce_scatter_once():
    """A weight read twice (its gradient: ``add_any`` of two contractions over the batch) is
    reduce-scattered once, its partial sums added on each device first (half the bytes of
    reduce-scattering each); an embedding's gradient (a ``scatter-add`` of the batch's rows into
    the table) is reduce-scattered too: Ψ in two reduce-scatters and no all-reduce, where data
    parallel all-reduces Ψ + w; the numbers equal one device and data parallel."""
    k = jax.random.split(jax.random.key(1), 4)
    params = {"w": jax.random.normal(k[0], (32, 32)) * 0.2,
              "emb": jax.random.normal(k[1], (64, 32)) * 0.2}
    tokens = jax.random.randint(k[2], (32, 8), 0, 64)
    y = jax.random.normal(k[3], (32, 8, 32))
    tx = optax.adam(1e-2, eps=1e-3)

    def step(p, s, tokens, y):
        def loss(p):
            return jnp.mean((jnp.tanh(p["emb"][tokens] @ p["w"]) @ p["w"] - y) ** 2)
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    args = (params, tx.init(params), tokens, y)
    psi = sum(x.size * 4 for x in jax.tree.leaves(params))
    mesh = jaxpar.make_mesh((8,), ("dp",))
    out = {}
    for level in (0, 1):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            out[level] = jaxpar.inspect.collectives(f.lower(*args).compile()), f(*args)
            plan = f.plan(*args)
    # the plan says what runs: the sum's terms move nothing, its end and the embedding's
    # gradient reduce-scatter
    assert sorted((c.kind, c.axes, c.nbytes, c.count) for c in plan.predicted_collectives()) \
        == sorted((r.kind, tuple(r.axes), r.nbytes, r.count) for r in out[1][0]), plan.explain()
    # data parallel all-reduces w's two gradients apiece: Ψ + w
    assert out[0][0].total_bytes("all-reduce") == psi + params["w"].size * 4, out[0][0].table()
    colls = out[1][0]
    assert colls.count("reduce-scatter") == 2, colls.table()
    assert colls.total_bytes("reduce-scatter") == psi, colls.table()
    assert colls.count("all-reduce") == 0, colls.table()
    assert_tree_close(out[1][1], jax.jit(step)(*args), rtol=1e-5, atol=1e-6)
    assert_tree_close(out[1][1], out[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("level", [1, 2])
def test_a_zero_centred_scale_reduce_scatters_its_gradient(level):
    """Gemma's RMSNorm reads its scale as ``x * (1 + scale)``: JAX's transpose of that ``add``
    ends the scale's gradient in a ``reshard`` to the traced (empty) mesh, an identity XLA
    never sees.  The reduce-scatter's walk stopped at it, so the zoo's Gemma all-reduced every
    norm scale's gradient whole at levels 1-2; it now passes it as the identity it is."""
    k = jax.random.split(jax.random.key(2), 3)
    params = {"w": jax.random.normal(k[0], (16, 64)) * 0.2, "s": jnp.zeros((64,))}
    x = jax.random.normal(k[1], (32, 16))
    tx = optax.adam(1e-2, eps=1e-3)

    def step(p, s, x):
        def loss(p):
            return jnp.mean((jnp.tanh(x @ p["w"]) * (1.0 + p["s"])) ** 2)
        u, s = tx.update(jax.grad(loss)(p), s, p)
        return optax.apply_updates(p, u), s

    args = (params, tx.init(params), x)
    psi = sum(v.size * 4 for v in jax.tree.leaves(params))
    with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
        f = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
                               parallel_mode="data_parallel")
        colls = jaxpar.inspect.collectives(f.lower(*args).compile())
        plan = f.plan(*args)
        result = f(*args)
    assert colls.count("reduce-scatter") == 2, colls.table()
    assert colls.total_bytes("reduce-scatter") == psi, colls.table()
    assert colls.count("all-reduce") == 0, colls.table()
    assert sorted((c.kind, c.axes, c.nbytes, c.count) for c in plan.predicted_collectives()) \
        == sorted((r.kind, tuple(r.axes), r.nbytes, r.count) for r in colls), plan.explain()
    assert_tree_close(result, jax.jit(step)(*args), rtol=1e-5, atol=1e-6)
