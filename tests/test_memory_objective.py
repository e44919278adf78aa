"""Memory as part of the search's objective: among plans of nearly equal time the least memory
wins (``search/auto.py``: ``NEAR``), and under a binding budget ``"optimizer_level": "auto"``
takes the cheapest ZeRO level that fits (``optimizer_parallel.choose_level``)."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpar
from jaxpar._src.search import auto
from tests import auto_models as am
from tests.util import assert_tree_close

TWO_LINKS = jaxpar.HardwareProfile(preset="a100", axis_bandwidth={"dp": 25e9, "mp": 300e9})


def _auto(step, mesh, mode="optimal", hw=TWO_LINKS):
    return jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel", search_mode=mode,
                              hardware=hw)


@pytest.mark.parametrize("fastest,expected", [
    (0, "search"),  # memory equal: the fastest
    (1, "lean"),  # within NEAR and smaller
])
def test_choose_prefers_memory_only_within_the_tolerance(fastest, expected):
    from jaxpar._src.search.memory import MemoryEstimate

    measured = []

    def option(name, step_s, peak):
        return auto._Option(name, {}, step_s,
                            lambda: measured.append(name) or MemoryEstimate(peak, 0.0, 0))

    options = [option("search", 1.0, 100.0),
               option("lean", 1.0 + auto.NEAR / 2, 100.0 if fastest == 0 else 90.0),
               option("baseline", 1.0 + 2 * auto.NEAR, 10.0)]  # too slow: never a tie
    chosen, why = auto._choose(options, budget=1e3, roomy=True)
    assert chosen.name == expected
    assert ("memory breaks the tie" in why) == (expected == "lean")
    assert sorted(measured) == ["lean", "search"]  # every plan fits: the slow one unmeasured
    chosen, _ = auto._choose(options, budget=50.0, roomy=False)  # only data parallel fits
    assert chosen.name == "baseline"
    assert auto._choose(options, budget=5.0, roomy=False)[0] is None


def _adam_mlp(d=64, h=256, batch=2048):
    """An MLP train step whose fastest plan on 8 devices is data parallel (weights whole)."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (d, h)) * 0.05,
              "w2": jax.random.normal(k[1], (h, d)) * 0.05}
    tx = optax.adam(1e-2, eps=1e-3)
    x, y = jax.random.normal(k[2], (batch, d)), jax.random.normal(k[3], (batch, d))

    def loss(p, x, y):
        return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"] - y) ** 2)

    def step(params, opt_state, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, tx.init(params), x, y)


def _level(level, **config):
    return dict(enable_parallel_optimizer=True, parallel_optimizer_config={
        "optimizer_level": level, "parallel_optimizer_threshold": 0, **config})


def test_auto_level_under_a_binding_budget_takes_the_cheapest_that_fits(monkeypatch):
    """auto_parallel with ``"optimizer_level": "auto"``: where the budget binds, the search
    squeezing the plan with the parallel optimizer off is weighed against the ZeRO levels, and
    the fastest that fits is taken (before, "off" always won: the search fits by itself)."""
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", None)
    step, args = _adam_mlp()
    mesh = jaxpar.make_mesh((8,), ("dp",))

    def run(budget, **config):
        with jaxpar.auto_parallel_context(**config):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                                   hardware=jaxpar.HardwareProfile(memory_per_device=budget))
            return f, f.plan(*args)

    plans = {lv: run(1e12, **(_level(lv) if lv else {}))[1] for lv in (None, "level1", "level3")}
    peaks = {lv: p.memory_bytes for lv, p in plans.items()}
    assert peaks[None] > peaks["level1"] > peaks["level3"], peaks
    # Between off's and level 1's peaks the search fits "off" by splitting the parameters
    # (gathered, the gradients all-reduced in one combined all-reduce): as fast as level 1 in
    # bytes, and level 1 pays a launch latency more per gradient (XLA:CPU combines no
    # reduce-scatters, and the loss's all-reduce then travels alone), so off is the fastest
    # that fits.  Between level 1's and level 3's, off and level 1 squeezed are slower.
    for budget, chosen in (((peaks[None] + peaks["level1"]) / 2, "off"),
                           ((peaks["level1"] + peaks["level3"]) / 2, "level3")):
        f, plan = run(budget, **_level("auto"))
        note = plan.notes[-1]
        assert note.startswith(f"parallel optimizer: {chosen} chosen"), plan.notes
        assert plan.memory_bytes <= budget
        with jaxpar.auto_parallel_context(**_level("auto")):
            compiled = jaxpar.inspect.memory(f.lower(*args).compile())
        assert compiled["total"] <= budget, (compiled, budget)
        # why: off was weighed, squeezed by the search (then no faster than the level), or
        # refused (no plan without the parallel optimizer fits: the note says so)
        if "off: no plan fits" not in note:
            assert "squeezed by the search" in note, note
            _, off = run(budget)
            assert plan.step_time() <= off.step_time() * (1 + 1e-9)
        else:
            with pytest.raises(jaxpar.PlanError, match="no plan fits the memory budget"):
                run(budget)
    with jaxpar.auto_parallel_context(**_level("auto")):
        assert_tree_close(f(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-5)


def test_auto_level_comes_before_recomputation(monkeypatch):
    """Both automatic: the ZeRO levels are tried before recomputing anything (a level costs
    little communication, recomputation costs compute); the compiled peak fits the budget."""
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", None)
    k = jax.random.split(jax.random.key(1), 3)
    params = {"w1": jax.random.normal(k[0], (64, 256)) * 0.05,
              "w2": jax.random.normal(k[1], (256, 64)) * 0.05}
    tx = optax.adam(1e-2, eps=1e-3)
    x = jax.random.normal(k[2], (2048, 64))
    hidden = jaxpar.recompute(lambda w, x: jax.nn.relu(x @ w), policy="auto")

    def step(params, opt_state, x):
        def loss(p):
            return jnp.mean((hidden(p["w1"], x) @ p["w2"] - x) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    args = (params, tx.init(params), x)
    mesh = jaxpar.make_mesh((8,), ("dp",))

    def run(budget, config):
        with jaxpar.auto_parallel_context(**config):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                                   hardware=jaxpar.HardwareProfile(memory_per_device=budget))
            return f.plan(*args), jaxpar.inspect.memory(f.lower(*args).compile())["total"]

    _, off = run(1e12, {})
    _, level1 = run(1e12, _level("level1"))
    assert level1 < off
    budget = (off + level1) / 2
    plan, compiled = run(budget, _level("auto"))
    assert any(n.startswith("parallel optimizer: level1 chosen with this recompute choice")
               for n in plan.notes), plan.notes
    assert any(n.startswith("recompute block 0") and n.endswith(": none")
               for n in plan.notes), plan.notes  # nothing recomputed: level 1 was enough
    assert compiled <= budget, (compiled, budget)


def test_memory_breaks_a_tie_on_time(monkeypatch):
    """A transformer block on a (2, 4) mesh priced by bytes alone (no latencies): the search's
    plan polished with memory priced in costs 0.01% more time and holds less; it is used, and
    XLA's compiled program needs no more than the search's own plan."""
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", None)  # both plans searched
    hw = jaxpar.HardwareProfile(preset="h100", intra_node_latency=0.0, inter_node_latency=0.0,
                                collective_latency=0.0)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step, args = am.transformer_block(batch=8)

    def run():
        f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                               search_mode="dynamic_programming", hardware=hw)
        return f, f.plan(*args), jaxpar.inspect.memory(f.lower(*args).compile())["total"]

    f, plan, compiled = run()
    assert any(n.startswith("memory breaks the tie") for n in plan.notes), plan.notes
    with monkeypatch.context() as m:  # the same search without the tie-break
        m.setattr(auto, "_lean", lambda problem, choice: choice)
        _, plain, plain_compiled = run()
    assert plan.step_time() <= plain.step_time() * (1 + auto.NEAR)
    assert plan.memory_bytes < plain.memory_bytes
    assert compiled <= plain_compiled, (compiled, plain_compiled)
    assert_tree_close(f(*args), jax.jit(step)(*args), rtol=1e-4, atol=1e-5)


def test_memory_estimates_remembered_per_plan_are_the_ones_measured_afresh():
    """The memory model remembers what it found of the last plans it measured on a graph
    (issue 14: the search's plan is measured again when the plan is made); plans measured in
    turn, and measured again, each get their own estimate, the one a cold measure gives."""
    from jaxpar._src.cost import CostModel
    from jaxpar._src.search import memory
    from jaxpar._src.search.common import SearchSpace
    from jaxpar._src.search.problem import build_problem
    from jaxpar._src.spec import MeshShape
    from jaxpar._src.trace import trace
    from tests import models

    params, x = models.init_block(jax.random.key(0))
    graph = trace(jax.grad(models.block_loss), (params, x)).graph
    mesh = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))
    problem = build_problem(SearchSpace(graph, CostModel(mesh, jaxpar.HardwareProfile())), [])
    plans = [problem.expand({r: k % len(problem.cands[r]) for r in problem.reps})
             for k in range(6)]  # more than it remembers
    assert len({tuple(p.items()) for p in plans}) == 6

    def cold(plan, packed):
        memory._STRUCTURES.pop(graph, None)
        return memory.lowered(graph, plan, mesh, packed=packed)

    expected = [(cold(p, True), cold(p, False)) for p in plans]
    assert len({e[0] for e in expected}) > 1  # the plans differ in memory
    for _ in range(2):
        for p, (packed, live) in zip(plans + plans[::-1], expected + expected[::-1], strict=True):
            assert memory.lowered(graph, dict(p), mesh, packed=True) == packed
            assert memory.lowered(graph, p, mesh, packed=False) == live


def test_buffer_assignment_over_arrays_equals_the_scan():
    """``memory._assign`` finds each buffer's allocation for all allocations at once (issue
    14: the scan was quadratic in the layers); it must place every buffer where the scan of
    the allocations one by one does, so estimates (and plans) stay the same."""
    import random

    from jaxpar._src.search import memory

    rng = random.Random(0)
    for trial in range(600):
        last = 2 * rng.randint(1, 60)
        buffers = []
        for _ in range(rng.randint(0, 80)):
            first = rng.randint(0, last)
            size = float(rng.choice([0, 1, 2, 4, 8, 16, rng.random() * 10]))
            if rng.random() < 0.3:  # an output: held from its first use on
                buffers.append((size, first, rng.choice([last, rng.randint(first, last)]),
                                True, last))
            else:
                stop = rng.randint(first, last)
                buffers.append((size, first, stop, False, rng.randint(first, stop)))
        assert memory._assign(buffers) == memory._assign_scan(buffers), trial


@pytest.mark.parametrize("search_s,other_s,other_peak,budget,tried", [
    (1.0, 1.5, 10.0, 1e3, True),  # the search's plan is the fastest: polished
    ((1 + auto.NEAR) ** 2, 1.0, 10.0, 1e3, True),  # within a tie twice over: polished
    ((1 + auto.NEAR) ** 2 * 1.001, 1.0, 10.0, 1e3, False),  # beyond it: not
    (1.6, 1.0, 10.0, 1e3, False),  # the 24-layer GPT: data parallel 60% faster
    (1.6, 1.0, 200.0, 150.0, True),  # the faster plan does not fit the budget: polished
    (1.6, None, None, 1e3, True),  # nothing else priced (no batch): polished
])
def test_lean_polish_only_where_it_can_break_a_tie(search_s, other_s, other_peak, budget,
                                                   tried):
    """The memory-lean polish is tried unless the search's plan is slower than another plan
    that fits by more than a tie twice over; the note says why it was not."""
    from jaxpar._src.search.memory import MemoryEstimate

    def option(name, step_s, peak):
        return auto._Option(name, {}, step_s, lambda: MemoryEstimate(peak, 0.0, 0))

    options = [option("search", search_s, 100.0)]
    if other_s is not None:
        options.append(option("baseline", other_s, other_peak))
    for roomy in (False, True):
        if roomy and other_peak is not None and other_peak > budget:
            continue  # (roomy: no plan exceeds the budget)
        why = auto._beyond_tie(options, budget, roomy)
        assert (why is None) == tried, why
        if not tried:
            assert why.startswith(f"the search's plan is {search_s / other_s - 1:.0%} slower "
                                  "than pure data parallel")


@pytest.mark.parametrize("model,args,skipped", [
    ("scan_cumprod", (), True),  # data parallel 11% faster than the search's own plan
    ("wide_mlp", (), False),  # the search's plan is used: 2% faster than data parallel
])
def test_lean_polish_skipped_only_beyond_a_tie_changes_no_plan(monkeypatch, model, args,
                                                                skipped):
    """Where the bound says the polish cannot be used it is not run, and the plan is the one
    the frame chooses with it run (every layout); where the search's plan wins it is run.
    (The search's own plan, as it ends without going on from data parallel: the test below.)"""
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", None)
    monkeypatch.setattr(auto, "_from_start", lambda target, choice, *a: choice)
    step, args = getattr(am, model)(*args)[:2]
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    polished = []
    lean = auto._lean
    monkeypatch.setattr(auto, "_lean", lambda *a: polished.append(1) or lean(*a))

    def plan():
        return jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel").plan(*args)

    first = plan()
    untried = [n for n in first.notes if "was not tried" in n]
    assert bool(untried) == skipped and bool(polished) != skipped, first.notes
    if not skipped:
        assert first.objective_s < first.baseline_s and "data parallel" not in str(first.notes)
        return
    assert "pure data parallel was cheaper" in " ".join(first.notes)
    monkeypatch.setattr(auto, "_beyond_tie", lambda *a: None)  # polished regardless
    again = plan()
    assert polished
    layouts = [(d.node, d.in_specs, d.out_specs, d.origin) for d in first.decisions]
    assert layouts == [(d.node, d.in_specs, d.out_specs, d.origin) for d in again.decisions]
    assert tuple(n for n in first.notes if n not in untried) == again.notes
    assert first.step_time() == again.step_time()


@pytest.mark.parametrize("mode", ["recursive_programming", "dynamic_programming"])
def test_search_is_never_dearer_than_data_parallel_under_its_own_cost(monkeypatch, mode):
    """A scan's step, on which the searches' own plans cost more than pure data parallel under
    the problem's cost (and more priced whole): the search goes on from data parallel,
    local search finds nothing cheaper, and the plan says so; it is the very plan (every
    layout and origin) the frame chose when it set the search's plan aside for data parallel."""
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", None)
    step, args = am.scan_cumprod()[:2]
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    solves = []
    solve = auto._solve
    monkeypatch.setattr(auto, "_solve", lambda *a, **k: solves.append(1) or solve(*a, **k))

    def plan():
        return jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                                  search_mode=mode).plan(*args)

    seeded = plan()
    went_on = [n for n in seeded.notes if "went on from data parallel" in n]
    assert went_on, seeded.notes
    cost = re.match(r"the search's own plan cost (\d+)% more than pure data parallel under",
                    went_on[0])
    assert cost and int(cost[1]) > 0, went_on
    assert seeded.objective_s == seeded.baseline_s
    assert len(solves) == 1
    monkeypatch.setattr(auto, "_from_start", lambda target, choice, *a: choice)
    before = plan()
    assert "pure data parallel was cheaper" in " ".join(before.notes)
    assert [(d.node, d.in_specs, d.out_specs, d.origin) for d in seeded.decisions] == \
        [(d.node, d.in_specs, d.out_specs, d.origin) for d in before.decisions]
    assert seeded.step_time() == before.step_time()
