"""ZeRO levels 1-3: the plan says what the compiled program runs (issue 11).

At levels 1-3 the lowering makes each split weight gradient by reduce-scatter
(``jaxpar/_src/scatter.py``); the plan finds those contractions when it is made, so its
predicted collectives (``plan.predicted_collectives()``, ``explain()``, the step time) are the
reduce-scatters, and the lowering reads them from the plan (``plan.scatters``).  At level 3 the
backward pass gathers the parameters it reads again (``jaxpar/_src/regather.py``), and the
plan prices those second all-gathers too.  Known answer: ZeRO (Rajbhandari et al., SC 2020,
section 7) moves 2Ψ per step at levels 1-2, a reduce-scatter and an all-gather of Ψ each
sending ``(n - 1) / n`` of it, and 3Ψ at level 3 (Ψ gathered for the forward pass, again for
the backward pass, Ψ reduce-scattered), of which the second gather is only of the parameters
the backward pass reads (here ``w2``: ``dh = dy @ w2ᵀ``; ``w1``'s input gradient is not
needed, ``x`` being data).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src import api
from tests.test_optimizer_parallel import _problem, _zero


def _table(items) -> dict:
    """{(kind, axes, bytes per device): count}: a program's collectives as a multiset."""
    out: dict = collections.defaultdict(float)
    for kind, axes, nbytes, count in items:
        out[(kind, tuple(sorted(axes or ())), float(nbytes))] += count
    return dict(out)


def _compiled(f, args) -> dict:
    colls = jaxpar.inspect.collectives(f.lower(*args).compile())
    return _table((r.kind, r.axes, r.nbytes, r.count) for r in colls)


def _predicted(plan) -> dict:
    return _table((c.kind, c.axes, c.nbytes, c.count) for c in plan.predicted_collectives())


def _cases(args):
    tp = {"w1": P(None, "mp"), "b1": P("mp"), "w2": P("mp")}  # the moments laid out alike
    moments = jax.tree.map(lambda x: P() if x.ndim == 0 else None, args[1])
    moments[0].mu.update(tp), moments[0].nu.update(tp)
    return [(jaxpar.make_mesh((8,), ("dp",)), dict(parallel_mode="data_parallel"), 1),
            (jaxpar.make_mesh((2, 4), ("dp", "mp")),
             dict(parallel_mode="semi_auto_parallel",
                  in_strategy=(tp, moments, P("dp"), P("dp"))), 4)]


@pytest.mark.parametrize("level", [1, 2, 3])
def test_predicted_collectives_are_the_compiled_reduce_scatters(level):
    """Every collective of the compiled step, kind, axes, bytes and count, is predicted: at
    levels 1-3 the gradients' reduce-scatters (Ψ in all, per ``mp`` slice), the loss's 4-byte
    all-reduce, the parameters' all-gathers (at level 3 before the forward pass and ``w2``
    again for the backward pass); the wire bytes are ZeRO's 2Ψ·(n-1)/n on the batch axes
    (level 3: Ψ + |w2| gathered), and the plan records its level."""
    step, args = _problem()
    psi = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    for mesh, kw, mp in _cases(args):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, **kw, mesh=mesh)
            plan = f.plan(*args)
            compiled = _compiled(f, args)
        assert _predicted(plan) == compiled, (mesh, plan.explain())
        assert plan.optimizer_level == level and len(plan.scatters) == 3
        scattered = {k: n for k, n in compiled.items() if k[0] == "reduce-scatter"}
        assert sum(k[2] * n for k, n in scattered.items()) == psi // mp
        summary = plan.communication_summary()
        rs, ag = summary["reduce-scatter"], summary["all-gather"]
        n = 8 // mp  # the devices of the batch axes: mp splits the weights already
        assert rs["count"] == 3 and rs["wire_bytes"] == pytest.approx(psi // mp * (n - 1) / n)
        again = args[0]["w2"].size * 4 // mp if level == 3 else 0  # the backward's gather
        assert ag["count"] == 3 + (level == 3)
        assert ag["wire_bytes"] == pytest.approx((psi // mp + again) * (n - 1) / n)
        assert "reduce-scatter" in plan.explain() and f"optimizer=level{level}" in plan.explain()
        assert f"all-gather x{3 + (level == 3)} " in plan.explain()
        # XLA:CPU runs collectives one after another: the step time prices every one of them
        assert plan.step_time() == pytest.approx(
            plan.compute_s + sum(row["time"] for row in summary.values()))
        # the plan file keeps them (and the step time they price)
        loaded = jaxpar.ShardingPlan.from_json(plan.to_json())
        assert loaded.communication_summary() == summary
        assert loaded.step_time() == plan.step_time()
        # the contractions' own collectives say it too, in the layout the program makes
        for node, scatter in plan.scatters:
            d = plan.decisions[node]
            assert [c.kind for c in d.collectives] == ["reduce-scatter"], d
            assert set(scatter.axes) <= set(d.out_specs[0].axes), d


def test_a_second_gather_waits_for_the_backward_pass_where_xla_combines_all_gathers():
    """On a GPU profile (XLA:GPU combines independent all-gathers, up to 30 MiB) level 3's
    forward gathers of ``w1``, ``b1`` and ``w2`` combine into one, and the backward pass's
    second gather of ``w2``, tied by its optimization barrier to the cotangent
    (``regather.py``), stays apart: it cannot run before the forward pass (ZeRO-3's order)."""
    step, args = _problem()
    with jaxpar.auto_parallel_context(**_zero(3, parallel_optimizer_threshold=0)):
        plan = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
                                  parallel_mode="data_parallel",
                                  hardware=jaxpar.HardwareProfile("h100")).plan(*args)
    gathers = sorted((c.members, c.nbytes) for c in plan.predicted_collectives()
                     if c.kind == "all-gather")
    w2 = args[0]["w2"].size * 4
    assert gathers == [(1, w2), (3, sum(x.size * 4 for x in jax.tree.leaves(args[0])))]


def test_data_parallel_prices_the_all_reduce_and_level_1_half_of_it():
    """The same step with the optimizer off: the gradients all-reduced once (2Ψ·(n-1)/n on
    the wire); level 1 sends half of that in reduce-scatters (and Ψ·(n-1)/n in all-gathers)."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((8,), ("dp",))
    psi = sum(x.size * 4 for x in jax.tree.leaves(args[0]))
    plans = {}
    for level in (0, 1):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            plans[level] = f.plan(*args)
    off, one = (p.communication_summary() for p in (plans[0], plans[1]))
    assert "reduce-scatter" not in off and plans[0].scatters == ()
    assert off["all-reduce"]["wire_bytes"] == pytest.approx(2 * 7 / 8 * (psi + 4))
    assert one["reduce-scatter"]["wire_bytes"] == pytest.approx(7 / 8 * psi)
    assert one["all-gather"]["wire_bytes"] == pytest.approx(7 / 8 * psi)
    assert ("optimizer_level", "0", "1") in plans[0].diff(plans[1]).settings


def _auto_level_1(step, args, mesh):
    """A data-parallel step with ``"optimizer_level": "auto"`` and a budget only level 1 fits
    (half way between the off and level 1 peaks)."""
    def plan(budget, level):
        with jaxpar.auto_parallel_context(**_zero(level, parallel_optimizer_threshold=0)):
            return jaxpar.parallelize(
                step, mesh=mesh, parallel_mode="data_parallel",
                hardware=jaxpar.HardwareProfile(memory_per_device=budget)).plan(*args)

    budget = (plan(1e12, 0).memory_bytes + plan(1e12, 1).memory_bytes) / 2
    config = _zero(1, parallel_optimizer_threshold=0)
    config["parallel_optimizer_config"]["optimizer_level"] = "auto"
    return config, jaxpar.HardwareProfile(memory_per_device=budget)


def test_auto_choosing_level_1_reduce_scatters_and_a_reloaded_plan_too(tmp_path, monkeypatch):
    """``"optimizer_level": "auto"`` choosing level 1 lowers as an explicit ``"level1"`` does
    (the same collectives, reduce-scatters); the plan, saved in the plan cache and as a file,
    keeps its level and reduce-scatters, and the cached plan lowers to them unsearched."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((8,), ("dp",))
    config, hw = _auto_level_1(step, args, mesh)
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", str(tmp_path / "cache"))
    with jaxpar.auto_parallel_context(**config):
        f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel", hardware=hw)
        plan = f.plan(*args)
        compiled = _compiled(f, args)
    assert "parallel optimizer: level1 chosen" in plan.notes[-1], plan.notes
    assert plan.optimizer_level == 1 and plan.scatters
    with jaxpar.auto_parallel_context(**_zero(1, parallel_optimizer_threshold=0)):
        explicit = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
        assert _compiled(explicit, args) == compiled
    assert sum(n for k, n in compiled.items() if k[0] == "reduce-scatter") == 3
    assert _predicted(plan) == compiled

    again = jaxpar.ShardingPlan.from_json(plan.to_json())
    assert again == plan and again.optimizer_level == 1 and again.scatters == plan.scatters
    path = tmp_path / "plan.json"
    plan.save(path)
    assert jaxpar.ShardingPlan.load(path).scatters == plan.scatters

    def no_search(*a, **k):
        raise AssertionError("planned again: the plan cache missed")

    monkeypatch.setattr(api.Parallelized, "_plan", no_search)
    with jaxpar.auto_parallel_context(**config):
        g = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel", hardware=hw)
        cached = g.plan(*args)
        assert _compiled(g, args) == compiled
    assert cached.optimizer_level == 1 and cached.scatters == plan.scatters
    assert dataclasses.replace(cached, notes=plan.notes) == plan


@pytest.mark.parametrize("level", [1, 3])
def test_a_strategy_file_of_a_zero_plan_loads_and_lowers_alike(tmp_path, level):
    """``strategy_ckpt_load_file`` of a level-1 (and level-3) plan: its contractions' layouts
    are read back as their rules give them (before the reduce-scatter), and the plan made
    again lowers to the same collectives (level 3: its parameters, loaded split, gathered
    again for the backward pass), which it predicts."""
    step, args = _problem()
    mesh = jaxpar.make_mesh((8,), ("dp",))
    path = str(tmp_path / "strategy.json")
    zero = _zero(level, parallel_optimizer_threshold=0)
    with jaxpar.auto_parallel_context(**zero, strategy_ckpt_save_file=path):
        f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
        plan = f.plan(*args)
        compiled = _compiled(f, args)
    with jaxpar.auto_parallel_context(**zero, strategy_ckpt_load_file=path):
        g = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
        loaded = g.plan(*args)
        assert _compiled(g, args) == compiled
    assert loaded.scatters == plan.scatters
    assert _predicted(loaded) == compiled
    assert [d.out_specs for d in loaded.decisions] == [d.out_specs for d in plan.decisions]
