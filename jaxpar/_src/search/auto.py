"""``auto_parallel``: run the chosen search on the coarse problem, keep memory within budget.

Every search respects the pins.  Two safeguards make the fast searches honest: the plan is never
worse than pure data parallel under the same cost model (when the batch is known, that plan is
priced too and kept if cheaper, and the report says so), and it must fit the device memory
(``HardwareProfile.memory_per_device``): a plan that does not is re-solved with memory priced in
(the exact search adds the violated memory constraint instead) until one fits, or jaxpar raises
with the budget and the smallest plan it found.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxpar._src.errors import PlanError
from jaxpar._src.rules import OpStrategy
from jaxpar._src.search.common import Assignment, Pin, SearchSpace
from jaxpar._src.search.elimination import solve_elimination
from jaxpar._src.search.memory import live_ranges, peak_memory, replicated_peak
from jaxpar._src.search.optimal import solve_optimal
from jaxpar._src.search.problem import Problem, build_problem, quotient
from jaxpar._src.search.propagation import propagate
from jaxpar._src.search.recursive import improve, refine, solve_recursive
from jaxpar._src.search.ties import prefer_names, split_inputs

SHARE_LAYERS_ABOVE = 400  # coarse nodes: beyond this, repeated layers share strategies


@dataclasses.dataclass(frozen=True)
class Detail:
    """Why one node got its strategy: its cost terms and the best alternative."""

    compute_s: float
    comm_s: float  # its own collectives
    redistribution_s: float  # layout changes to its neighbours' choices
    runner_up: OpStrategy | None
    runner_up_extra_s: float  # how much more the runner-up would cost, the rest fixed


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """What a search did."""

    search_mode: str
    objective_s: float  # simulated seconds per call under the cost model
    search_s: float  # wall seconds the search took
    nodes: int  # coarse nodes searched
    memory_bytes: float  # estimated peak bytes per device
    memory_budget: float
    optimal: bool | None = None  # proven optimal (the exact search)
    baseline_s: float | None = None  # pure data parallel under the same model
    used_baseline: bool = False
    notes: tuple[str, ...] = ()


def auto_search(space: SearchSpace, pins: Sequence[Pin], *, search_mode: str,
                ties: Sequence[tuple[int, int]] = (), baseline_pins: Sequence[Pin] | None = None,
                fully_use_devices: bool = True, time_limit: float = 300.0
                ) -> tuple[Assignment, SearchReport, dict[int, Detail]]:
    t0 = time.perf_counter()
    base = _baseline(space, baseline_pins, ties) if baseline_pins is not None else None
    if base is not None:  # how large XLA's combined gradient all-reduces are (combine.py)
        space.calibrate(base)
    graph, mesh = space.graph, space.model.mesh
    budget = float(space.model.hw.memory_per_device)
    roomy = replicated_peak(graph) <= budget  # then no plan can exceed the budget
    run = functools.partial(_solve, pins=pins, ties=ties, search_mode=search_mode,
                            fully_use_devices=fully_use_devices, time_limit=time_limit,
                            budget=budget, roomy=roomy)
    problem, choice, optimal, notes = run(space)
    strategies = problem.expand(choice)
    objective = space.price(strategies).step_s  # as XLA runs it: combined, overlapped
    if space.bucket_bytes > 0 and objective > problem.objective(choice) * (1 + 1e-6):
        # The search priced each gradient all-reduce as a share of one combined all-reduce,
        # but this plan's few pay a latency of their own: search again with every gradient
        # all-reduce alone, and keep the plan that is cheaper as XLA runs it.
        other = run(space.alone())
        alternative = other[0].expand(other[1])
        alternative_s = space.price(alternative).step_s
        if alternative_s < objective * (1 - 1e-9):
            problem, choice, optimal, notes = other
            strategies, objective = alternative, alternative_s
            notes = notes + ["searched again with gradient all-reduces priced alone: cheaper"]
    est = peak_memory(graph, strategies, mesh)
    details = _details(problem, choice)
    baseline_s = None
    used_baseline = False
    if base is not None:
        baseline_s = space.price(base).step_s
        if baseline_s < objective * (1 - 1e-9) and (
                roomy or peak_memory(graph, base, mesh).peak <= budget):
            # The searches price combining and overlap locally (combine.py); priced whole,
            # data parallel can still win, or use strategies fully_use_devices leaves out.
            strategies, objective, details = base, baseline_s, {}
            est = peak_memory(graph, strategies, mesh)
            used_baseline, optimal = True, False
            notes.append("pure data parallel was cheaper than the search's plan under "
                         "the cost model, and is used")
    if est.peak > budget:
        raise _over_budget(search_mode, budget, est.peak)
    if baseline_pins is not None:  # equal costs: the batch on dp-like axes, weights on mp-like
        batch = {p.node for p in baseline_pins
                 if p.origin == "data_parallel" and not p.strategy.out_specs[0].is_replicated}
        named = prefer_names(space, strategies, batch, {p.node for p in pins})
        if named != strategies:
            strategies, details = named, {}
            notes.append("interchangeable mesh axes exchanged to follow their names")
    strategies = split_inputs(space, strategies, {p.node for p in pins})
    origins = {n: problem.origins.get(n, search_mode) for n in strategies}
    if used_baseline:
        origins = {n: problem.origins.get(n, "data-parallel baseline") for n in strategies}
    else:
        for f, (rep, _) in problem.follow.items():
            if f not in problem.origins:
                origins[f] = f"{search_mode} (follows #{rep})"
    report = SearchReport(search_mode, objective, time.perf_counter() - t0, len(problem.reps),
                          est.peak, budget, optimal, baseline_s, used_baseline, tuple(notes))
    return Assignment(strategies, origins), report, details


def _solve(space: SearchSpace, *, pins: Sequence[Pin], ties: Sequence[tuple[int, int]],
           search_mode: str, fully_use_devices: bool, time_limit: float, budget: float,
           roomy: bool) -> tuple[Problem, dict[int, int], bool | None, list[str]]:
    """Builds the problem and solves it with ``search_mode`` within the memory budget."""
    problem = build_problem(space, pins, ties=ties, fully_use_devices=fully_use_devices)
    graph, mesh = space.graph, space.model.mesh
    notes: list[str] = []
    optimal = None
    owner: dict[int, int] | None = None
    target = problem
    if len(problem.reps) > SHARE_LAYERS_ABOVE and problem.groups:
        target, owner = quotient(problem)
        notes.append(f"repeated layers share strategies: {len(problem.reps)} nodes searched as "
                     f"{len(target.reps)}")

    def lift(choice: Mapping[int, int]) -> dict[int, int]:
        return dict(choice) if owner is None else {r: choice[owner[r]] for r in problem.reps}

    def memory_of(choice: Mapping[int, int]) -> float:
        if roomy:
            return 0.0
        return peak_memory(graph, problem.expand(lift(choice)), mesh).peak

    if search_mode == "optimal":
        result = solve_optimal(target, time_limit=time_limit)
        choice, optimal = result.choice, result.optimal
        if not result.optimal:
            notes.append(f"the integer program stopped at its time limit ({time_limit:g} s); "
                         f"relative gap {result.gap:.3g}")
        cuts = []
        smallest = float("inf")
        for _ in range(0 if roomy else 20):
            est = peak_memory(graph, problem.expand(lift(choice)), mesh)
            smallest = min(smallest, est.peak)
            if est.peak <= budget:
                break
            cuts.append(_fold(_memory_cut(problem, est.at, budget), owner))
            try:
                result = solve_optimal(target, time_limit=time_limit, extra_rows=cuts)
            except PlanError:  # the cuts admit no plan at all
                raise _over_budget(search_mode, budget, smallest) from None
            choice, optimal = result.choice, result.optimal
    else:
        solver = _SOLVERS[search_mode]
        choice = solver(target, 0.0)
        if memory_of(choice) > budget:
            choice = _fit_memory(target, choice, solver, budget, memory_of)
    return problem, lift(choice), optimal, notes


def _over_budget(search_mode: str, budget: float, smallest: float) -> PlanError:
    from jaxpar._src.plan import _bytes

    return PlanError(
        f"jaxpar ({search_mode}): no plan fits the memory budget of {_bytes(budget)} per device "
        f"(HardwareProfile.memory_per_device); the smallest plan found needs "
        f"{_bytes(smallest)}. Use more devices, a smaller batch, or raise memory_per_device.")


def _solve_recursive(problem: Problem, price: float) -> dict[int, int]:
    return solve_recursive(_priced(problem, price))


def _solve_elimination(problem: Problem, price: float) -> dict[int, int]:
    choice, stats = solve_elimination(problem, memory_price=price)
    if stats.star or not stats.core_exact:  # approximate steps: polish their decisions
        priced = _priced(problem, price)
        choice = refine(priced, improve(priced, choice))
    return choice


_SOLVERS: dict[str, Callable[[Problem, float], dict[int, int]]] = {
    "recursive_programming": _solve_recursive,
    "dynamic_programming": _solve_elimination,
}


def _priced(problem: Problem, price: float) -> Problem:
    if price == 0.0:
        return problem
    cost = {r: problem.cost[r] + price * problem.mem[r] for r in problem.reps}
    return dataclasses.replace(problem, cost=cost)


def _fit_memory(problem: Problem, choice: dict[int, int], solver: Callable, budget: float,
                memory_of: Callable) -> dict[int, int]:
    """Re-solves with memory priced in, cheapest price first, until the plan fits."""
    objective = max(problem.objective(choice), 1e-12)
    peak = max(memory_of(choice), 1.0)
    smallest = choice
    for scale in 10.0 ** np.arange(-3, 7):
        candidate = solver(problem, scale * objective / peak)
        if memory_of(candidate) <= budget:
            return candidate
        if memory_of(candidate) < memory_of(smallest):
            smallest = candidate
    return smallest


def _memory_cut(problem: Problem, position: int, budget: float
                ) -> tuple[dict[int, np.ndarray], float]:
    """The linear constraint: bytes live at ``position`` stay within ``budget``."""
    graph = problem.space.graph
    mesh = problem.space.model.mesh
    coeffs: dict[int, np.ndarray] = {}
    for vid, first, stop in live_ranges(graph):
        if not first <= position <= stop:
            continue
        v = graph.values[vid]
        producer = v.producer
        rep = problem.follow[producer][0] if producer in problem.follow else producer
        vec = np.zeros(len(problem.cands[rep]))
        for k in range(len(vec)):
            idx = int(problem.follow[producer][1][k]) if producer in problem.follow else k
            spec = problem.cands[producer][idx].out_specs[v.index]
            vec[k] = v.nbytes * spec.shard_fraction(mesh)
        coeffs[rep] = coeffs.get(rep, 0) + vec
    return coeffs, budget


def _fold(cut: tuple[dict[int, np.ndarray], float], owner: dict[int, int] | None
          ) -> tuple[dict[int, np.ndarray], float]:
    """A memory cut on the quotient problem: members' coefficients add up on their owner."""
    if owner is None:
        return cut
    coeffs: dict[int, np.ndarray] = {}
    for r, vec in cut[0].items():
        coeffs[owner[r]] = coeffs.get(owner[r], 0) + vec
    return coeffs, cut[1]


def _baseline(space: SearchSpace, pins: Sequence[Pin], ties: Sequence[tuple[int, int]]
              ) -> dict[int, OpStrategy] | None:
    """Pure data parallel: the batch split over every device, the rest propagated."""
    try:
        return dict(propagate(space, pins, ties=ties).strategies)
    except PlanError:
        return None


def _details(problem: Problem, choice: Mapping[int, int]) -> dict[int, Detail]:
    space = problem.space
    hw = space.model.hw
    adjacency = problem.neighbours()
    out = {}
    for r in problem.reps:
        total = problem.cost[r].copy()
        redist = np.zeros_like(total)
        for u in adjacency[r]:
            m = problem.edges[(r, u)] if r < u else problem.edges[(u, r)].T
            redist += m[:, choice[u]]
        total += redist
        k = choice[r]
        strategy = problem.cands[r][k]
        cost = space.op_cost(r, strategy)
        compute = cost.flops / hw.flops_per_s
        others = [i for i in np.argsort(total) if i != k and r not in problem.forced]
        runner = int(others[0]) if others else None
        out[r] = Detail(compute, cost.comm_time, float(redist[k]),
                        problem.cands[r][runner] if runner is not None else None,
                        float(total[runner] - total[k]) if runner is not None else 0.0)
    return out
