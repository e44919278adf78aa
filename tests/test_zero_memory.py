"""The parallel optimizer's memory per device, read from ``compiled.memory_analysis()``.

Known answers: ZeRO (Rajbhandari et al., SC 2020, section 5): with ``N_d`` data-parallel devices
the optimizer state per device falls to ``1/N_d`` at level 1, the gradients too at level 2.
MindSpore's ``gradient_accumulation_shard`` (``parallel_optimizer_config``): with gradient
accumulation, the accumulated gradients are split over the data-parallel devices and each
micro-step's gradients reduce-scattered into them.

What is measured: a part of the program's arguments (the optimizer state; the gradient
accumulators of ``optax.MultiSteps``) as ``memory_analysis().argument_size_in_bytes`` less the
per-device bytes of every other argument (from the compiled input shardings), for data-parallel
groups of 2, 4 and 8 devices (meshes ``(dp,)`` of the first ``dp`` CPU devices); the
collectives of the compiled HLO; the numbers against plain data parallel.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests.test_optimizer_parallel import _problem, _zero
from tests.util import assert_tree_close

DPS = (2, 4, 8)


def _part_bytes(compiled, is_part: Callable[[str], bool]) -> tuple[int, int]:
    """(per device per ``memory_analysis()``, whole) bytes of the argument leaves whose path
    (``jax.tree_util.keystr``) ``is_part`` picks: the argument bytes less every other leaf's
    per-device bytes (``shard_shape`` of its compiled input sharding)."""
    infos = jax.tree_util.tree_flatten_with_path(compiled.args_info)[0]
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    others, whole = 0, 0
    for (path, info), s in zip(infos, shardings, strict=True):
        item = np.dtype(info.dtype).itemsize
        if is_part(jax.tree_util.keystr(path)):
            whole += math.prod(info.shape) * item
        else:
            others += math.prod(s.shard_shape(info.shape)) * item
    return compiled.memory_analysis().argument_size_in_bytes - others, whole


@pytest.mark.parametrize("dp", DPS)
def test_level1_optimizer_state_falls_as_one_over_dp(dp):
    """Level 1 on ``dp`` devices: Adam's state (its moments and step count) in
    ``memory_analysis()`` is ``1/dp`` of its size (within 3%; whole with the optimizer off),
    and the step's results equal plain data parallel's."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((dp,), ("dp",))
    state, result = {}, {}
    for level in (0, 1):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            compiled = f.lower(*args).compile()
            result[level] = f(*args)
        # args_info: ((params, opt_state, x, y), {}); the optimizer state is argument 1
        state[level], whole = _part_bytes(compiled, lambda p: p.startswith("[0][1]"))
    assert abs(state[0] - whole) <= 0.03 * whole, (dp, state, whole)
    assert abs(state[1] - whole / dp) <= 0.03 * whole / dp, (dp, state, whole)
    assert_tree_close(result[1], result[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dp", DPS)
def test_level3_parameters_fall_as_one_over_dp(dp):
    """Level 3 on ``dp`` devices: the parameters (argument 0) in ``memory_analysis()`` are
    ``1/dp`` of their size (within 3%; whole at level 1), gathered for use (all-gathers of at
    least Ψ per device), and the step's results equal plain data parallel's."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((dp,), ("dp",))
    held, result = {}, {}
    for level in (0, 1, 3):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            compiled = f.lower(*args).compile()
            result[level] = f(*args)
        held[level], whole = _part_bytes(compiled, lambda p: p.startswith("[0][0]"))
        if level == 3:
            gathered = jaxpar.inspect.collectives(compiled).total_bytes("all-gather")
            assert gathered >= whole, (dp, gathered, whole)
    assert abs(held[1] - whole) <= 0.03 * whole, (dp, held, whole)
    assert abs(held[3] - whole / dp) <= 0.03 * whole / dp, (dp, held, whole)
    assert_tree_close(result[3], result[0], rtol=1e-5, atol=1e-6)


def _model(level: int, dp: int, _hardware: jaxpar.HardwareProfile | None = None, **config):
    """``Model`` training an MLP with ``optax.MultiSteps`` (Adam every 2 micro-steps) on
    ``dp`` devices: its compiled train step and its losses over 4 micro-steps.  ``level`` 0
    with ``_hardware``: ``"optimizer_level": "auto"`` under its budget."""
    _, (params, _, x, y) = _problem()
    x, y = np.asarray(x), np.asarray(y)

    def apply(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"]

    def mse(out, y):
        return jnp.mean((out - y) ** 2)

    tx = optax.MultiSteps(optax.adam(1e-2, eps=1e-3), every_k_schedule=2)
    zero = _zero(level, parallel_optimizer_threshold=0, **config) if _hardware is None else \
        dict(enable_parallel_optimizer=True, hardware=_hardware, parallel_optimizer_config={
            "optimizer_level": "auto", "parallel_optimizer_threshold": 0, **config})
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel",
                                      mesh=jaxpar.make_mesh((dp,), ("dp",)), **zero):
        model = jaxpar.Model((params, apply), mse, tx)
        compiled = model.lower(x, y).compile()
        model.train(1, [(x, y)] * 4)
    return compiled, model.history, sum(v.size * 4 for v in jax.tree.leaves(params))


@pytest.mark.parametrize("dp", DPS)
def test_accumulated_gradients_split_at_level2_or_with_accumulation_shard(dp):
    """Gradients held across calls (``optax.MultiSteps``'s ``acc_grads``, MindSpore's
    accumulated gradients): level 1 keeps them whole and all-reduces each micro-step's
    gradients (Ψ); level 2, and level 1 with ``gradient_accumulation_shard``, hold ``1/dp``
    of them per device in ``memory_analysis()`` (within 3%) and reduce-scatter the gradients
    into them (Ψ, no all-reduce but the loss's); the losses equal plain data parallel's."""
    cases = {"off": (0, {}), "level1": (1, {}),
             "level1+shard": (1, {"gradient_accumulation_shard": True}), "level2": (2, {})}
    got = {name: _model(level, dp, **config) for name, (level, config) in cases.items()}
    for name, (compiled, history, psi) in got.items():
        acc, whole = _part_bytes(compiled, lambda p: ".acc_grads[" in p)
        assert whole == psi
        split = name in ("level1+shard", "level2")
        want = psi / dp if split else psi
        assert abs(acc - want) <= 0.03 * want, (dp, name, acc, want)
        colls = jaxpar.inspect.collectives(compiled)
        assert colls.total_bytes("reduce-scatter") == (psi if split else 0), colls.table()
        # the gradients (Ψ) and the f32 loss in one all-reduce (off: per replica, the
        # gradients alone); split: the loss alone
        reduced = {"off": psi, "level1": psi + 4}.get(name, 4)
        assert colls.total_bytes("all-reduce") == reduced, (name, colls.table())
        np.testing.assert_allclose(history, got["off"][1], rtol=1e-5)


def test_accumulation_shard_without_accumulators_changes_nothing():
    """A step of your own with no gradient accumulators: ``gradient_accumulation_shard`` adds
    nothing to level 1 (the same argument bytes and collectives); its gradients are
    temporaries of the step, which level 1 already reduce-scatters."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((8,), ("dp",))
    out = []
    for config in ({}, {"gradient_accumulation_shard": True}):
        with jaxpar.auto_parallel_context(**_zero(1, parallel_optimizer_threshold=0, **config)):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            compiled = f.lower(*args).compile()
        out.append((compiled.memory_analysis().argument_size_in_bytes,
                    jaxpar.inspect.collectives(compiled).table()))
    assert out[0] == out[1]


def test_own_accumulating_step_splits_its_accumulators():
    """A step of your own with ``optax.MultiSteps``: ``gradient_accumulation_shard`` at level 1
    splits its accumulators (1/8 per device) as level 2 does, and with the gradients
    constrained split (``jax.lax.with_sharding_constraint``, as level 2 asks of such a step)
    each micro-step reduce-scatters them (Ψ) instead of all-reducing them; the results equal
    one device's."""
    _, (params, _, x, y) = _problem()
    tx = optax.MultiSteps(optax.adam(1e-2, eps=1e-3), every_k_schedule=2)
    mesh = jaxpar.make_mesh((8,), ("dp",))
    psi = sum(v.size * 4 for v in jax.tree.leaves(params))

    def loss(p, x, y):
        return jnp.mean((jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    def step_of(split: bool):
        def step(params, opt_state, x, y):
            grads = jax.grad(loss)(params, x, y)
            if split:
                grads = jax.lax.with_sharding_constraint(
                    grads, jax.sharding.NamedSharding(mesh, P("dp")))
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state
        return step

    args = (params, tx.init(params), x, y)
    single = jax.jit(step_of(False))(*args)
    for split, level in ((False, 1), (True, 1), (True, 2)):
        config = {} if level == 2 else {"gradient_accumulation_shard": True}
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0,
                                                  **config)):
            f = jaxpar.parallelize(step_of(split), mesh=mesh, parallel_mode="data_parallel")
            compiled = f.lower(*args).compile()
            assert_tree_close(f(*args), single, rtol=1e-5, atol=1e-6)
        acc, _ = _part_bytes(compiled, lambda p: ".acc_grads[" in p)
        assert abs(acc - psi / 8) <= 0.03 * psi / 8, (split, level, acc)
        colls = jaxpar.inspect.collectives(compiled)
        assert colls.total_bytes("reduce-scatter") == (psi if split else 0), colls.table()
        assert colls.total_bytes("all-reduce") == (0 if split else psi), colls.table()


def test_auto_level_takes_level2_where_accumulators_make_it_fit():
    """``"optimizer_level": "auto"`` on ``Model`` with ``optax.MultiSteps`` (gradients held
    across calls), under a budget between level 2's compiled total and level 1's: level 2 is
    the least communication that fits (level 3 fits too, gathering the parameters besides),
    and it is chosen; its program is level 2's: the accumulators split, the gradients
    reduce-scattered into them (Ψ) with the loss the only all-reduce, the parameters gathered
    once (Ψ); the losses equal data parallel's.  Before, "auto" tried off, 1, 3 only and
    traced ``Model``'s step once, without level 2's gradient constraint: it compiled level 3's
    gathers with a full gradient all-reduce (Ψ)."""
    fixed = {level: _model(level, 8) for level in (1, 2)}
    total = {level: jaxpar.inspect.memory(c)["total"] for level, (c, _, _) in fixed.items()}
    assert total[2] < total[1]
    budget = (total[1] + total[2]) / 2
    compiled, history, psi = _model(
        0, 8, _hardware=jaxpar.HardwareProfile(memory_per_device=budget))
    assert jaxpar.inspect.memory(compiled)["total"] == total[2]
    colls = jaxpar.inspect.collectives(compiled)
    assert colls.total_bytes("reduce-scatter") == psi, colls.table()
    assert colls.total_bytes("all-reduce") == 4, colls.table()
    assert colls.total_bytes("all-gather") == psi, colls.table()
    np.testing.assert_allclose(history, fixed[1][1], rtol=1e-5)
