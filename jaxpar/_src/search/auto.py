"""The automatic searches' common frame: the coarse problem, memory, and the two safeguards.

A coarse search (``recursive_programming``, ``dynamic_programming``, ``optimal``: see
``modes.py``) is a :class:`Solver` of the coarse problem put in this frame by
:func:`coarse_search`.  The frame builds the problem (on large graphs, the quotient where
repeated layers share a strategy), hands the solver a :class:`Memory` to check its plans
against, and then makes the fast searches honest: the plan is never worse than pure data
parallel under the same cost model (when the batch is known, that plan is priced too and kept
if cheaper, and the report says so), and it must fit the device memory
(``HardwareProfile.memory_per_device``): :func:`priced` makes a solver re-solve with memory
priced in until a plan fits (the exact search adds the violated memory constraint instead), or
jaxpar raises with the budget and the smallest plan it found.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np

from jaxpar._src.errors import NoPlanFits, PlanError
from jaxpar._src.graph import NodeKind, OpGraph
from jaxpar._src.plan import _bytes
from jaxpar._src.regather import ORIGIN as REGATHERED
from jaxpar._src.regather import Regather
from jaxpar._src.rules import OpStrategy
from jaxpar._src.search.common import Assignment, Pin, SearchSpace
from jaxpar._src.search.memory import MemoryEstimate, live_ranges, peak_memory, replicated_peak
from jaxpar._src.search.polish import better, improve
from jaxpar._src.search.problem import Problem, build_problem, quotient
from jaxpar._src.search.propagation import propagate
from jaxpar._src.search.registry import (
    Detail,
    Search,
    SearchReport,
    SearchRequest,
    SearchResult,
)
from jaxpar._src.search.ties import prefer_names, split_inputs

SHARE_LAYERS_ABOVE = 400  # coarse nodes: beyond this, repeated layers share strategies
# The note of a plan the search had to fit into the memory budget (its fastest did not fit):
# "optimizer_level": "auto" then weighs the ZeRO levels against it (optimizer_parallel.py).
SQUEEZED = "memory budget binds: the search fitted the plan with memory priced in"
NEAR = 0.01  # plans within 1% of the fastest step time tie on time: the least memory wins


@dataclasses.dataclass(frozen=True)
class Solution:
    """A solver's answer: a candidate index per node of the problem it was given."""

    choice: dict[int, int]
    optimal: bool | None = None  # proven optimal (the exact search)
    notes: tuple[str, ...] = ()


class Solver(Protocol):
    """Solves the coarse problem ``target`` within ``memory``."""

    def __call__(self, target: Problem, memory: Memory) -> Solution: ...


@dataclasses.dataclass(frozen=True)
class Memory:
    """The memory budget of one search, and how a choice of the searched problem fares."""

    problem: Problem  # the full coarse problem
    owner: Mapping[int, int] | None  # searching its quotient: the group of every node
    budget: float  # bytes per device
    roomy: bool  # nothing replicated exceeds it: no plan can
    search_mode: str
    split: frozenset[int] = frozenset()  # ZeRO level 3's pinned inputs (gathered again)
    # what pipeline loops hold inside, (bytes, loop node): fixed by the pipeline's own plan
    loops: tuple[tuple[float, int], ...] = ()

    def lift(self, choice: Mapping[int, int]) -> dict[int, int]:
        """A choice of the searched problem as one of the full problem."""
        if self.owner is None:
            return dict(choice)
        return {r: choice[self.owner[r]] for r in self.problem.reps}

    def estimate(self, choice: Mapping[int, int]) -> MemoryEstimate:
        return _estimate(self.problem.space, self.problem.expand(self.lift(choice)),
                         self.split, self.roomy, self.loops)

    def peak(self, choice: Mapping[int, int]) -> float:
        return 0.0 if self.roomy else self.estimate(choice).peak

    def fits(self, choice: Mapping[int, int]) -> bool:
        return self.peak(choice) <= self.budget

    def cut(self, choice: Mapping[int, int]) -> tuple[dict[int, np.ndarray], float]:
        """The linear constraint that the bytes live where ``choice`` peaks shrink by the
        factor ``choice`` is over the budget.  The estimate (fused, packed) is not linear in
        the choice; the cut counts the values live there unfused (:func:`live_ranges`), so
        its bound is ``choice``'s own count scaled by that factor (of the part the choice
        moves: the pipeline loops' insides are fixed)."""
        est = self.estimate(choice)
        coeffs, _ = _memory_cut(self.problem, est.at, self.budget)
        lifted = self.lift(choice)
        live = sum(float(vec[lifted[r]]) for r, vec in coeffs.items())
        fixed = sum(b for b, _ in self.loops)
        scale = max(self.budget - fixed, 0.0) / max(est.peak - fixed, 1.0)
        return _fold((coeffs, live * scale), self.owner)

    def refusal(self, smallest: float) -> NoPlanFits:
        return NoPlanFits(
            f"jaxpar ({self.search_mode}): no plan fits the memory budget of "
            f"{_bytes(self.budget)} per device (HardwareProfile.memory_per_device); the "
            f"smallest plan found needs {_bytes(smallest)}. Use more devices, a smaller batch, "
            f"or raise memory_per_device.", smallest)


def priced(solve: Callable[[Problem, float], dict[int, int]]) -> Solver:
    """A solver of cost alone, ``solve(problem, memory_price)``, made to respect memory: a plan
    over the budget is re-solved with memory priced in, cheapest price first."""

    def solver(target: Problem, memory: Memory) -> Solution:
        choice = solve(target, 0.0)
        if not memory.fits(choice):
            return Solution(_fit_memory(target, choice, solve, memory), notes=(SQUEEZED,))
        return Solution(choice)

    return solver


def with_memory_price(problem: Problem, price: float) -> Problem:
    """``problem`` with each candidate's bytes per device priced at ``price`` s/byte."""
    if price == 0.0:
        return problem
    cost = {r: problem.cost[r] + price * problem.mem[r] for r in problem.reps}
    return dataclasses.replace(problem, cost=cost)


def coarse_search(name: str, solver: Solver) -> Search:
    """The search mode ``name`` that solves the coarse problem with ``solver``."""

    def search(request: SearchRequest) -> SearchResult:
        return _search(name, solver, request)

    search.__name__ = search.__qualname__ = f"coarse_search({name!r})"
    return search


def _search(search_mode: str, solver: Solver, request: SearchRequest) -> SearchResult:
    t0 = time.perf_counter()
    space = request.space
    base = _baseline(space, request.baseline_pins, request.ties) \
        if request.baseline_pins is not None else None
    if base is not None:  # how large XLA's combined gradient all-reduces are (combine.py)
        space.calibrate(base)
    graph = space.graph
    budget = float(space.model.hw.memory_per_device)
    # A pipeline's loop is one operator of this graph; what it holds inside (its residual
    # slots, accumulators: pipeline/memory.py) is fixed by the pipeline's own plan, and is
    # most of a pipelined step's memory: every estimate counts it, as plan.memory_bytes does.
    loops = _loop_temporaries(graph)
    # then no plan can exceed the budget
    roomy = replicated_peak(graph) + sum(b for b, _ in loops) <= budget
    run = functools.partial(_solve, request=request, search_mode=search_mode, solver=solver,
                            budget=budget, roomy=roomy, loops=loops, start=base)
    problem, choice, optimal, notes, started = run(space)
    strategies = problem.expand(choice)
    objective = space.price(strategies).step_s  # as XLA runs it: combined, overlapped
    # (the gradients all-reduced, as the search priced them: ZeRO 1-3's reduce-scatters
    # are no reason to price the all-reduces alone)
    combined = space.price(strategies, as_lowered=False).step_s
    if space.bucket_bytes > 0 and combined > problem.objective(choice) * (1 + 1e-6):
        # The search priced each gradient all-reduce as a share of one combined all-reduce,
        # but this plan's few pay a latency of their own: search again with every gradient
        # all-reduce alone, and keep the plan that is cheaper as XLA runs it.
        other = run(space.alone())
        alternative = other[0].expand(other[1])
        alternative_s = space.price(alternative).step_s
        if alternative_s < objective * (1 - 1e-9):
            problem, choice, optimal, notes, started = other
            strategies, objective = alternative, alternative_s
            notes = notes + ["searched again with gradient all-reduces priced alone: cheaper"]
    pinned = {p.node for p in request.pins}
    split = _split(request)

    def option(name: str, plan: Mapping[int, OpStrategy]) -> _Option:
        plan = split_inputs(space, plan, pinned)  # as each would end: compared as used
        return _Option(name, plan, space.price(plan).step_s,
                       functools.partial(_estimate, space, plan, split, roomy, loops))

    # The search went on from data parallel and local search found nothing cheaper: its plan
    # is data parallel's, used as the baseline is (not polished, no cost terms: as before)
    found_baseline = started and strategies == base
    options = [] if found_baseline else [option("search", strategies)]
    baseline_s = None
    if base is not None:
        options.append(option("baseline", base))
        baseline_s = options[-1].step_s
    lean, untried = choice, None
    if not found_baseline:
        untried = _beyond_tie(options, budget, roomy)
        if untried is None:  # (priced after the baseline, listed before it: ties go to the lean)
            lean = _lean(problem, choice)
            if lean != choice:
                options.insert(1, option("lean", problem.expand(lean)))
    chosen, why = _choose(options, budget, roomy)
    if chosen is None:
        smallest = min(o.estimate.peak for o in options)
        raise Memory(problem, None, budget, roomy, search_mode).refusal(smallest)
    strategies, objective, est = chosen.strategies, chosen.step_s, chosen.estimate
    used_baseline = chosen.name == "baseline"
    if chosen.name != "search":
        # a tie on time keeps the search's proof: the plan is as fast as the proven optimum
        optimal = optimal if optimal and chosen.step_s <= options[0].step_s * (1 + 1e-9) \
            else False
    if why:
        notes.append(why)
    if untried is not None:
        notes.append(untried)
    renamed = False
    if request.baseline_pins is not None:  # equal costs: batch on dp-like axes, weights mp-like
        batch = {p.node for p in request.baseline_pins
                 if p.origin == "data_parallel" and not p.strategy.out_specs[0].is_replicated}
        named = prefer_names(space, strategies, batch, pinned)
        if named != strategies:
            strategies, renamed = named, True
            notes.append("interchangeable mesh axes exchanged to follow their names")
    strategies = split_inputs(space, strategies, pinned)
    origins = {n: problem.origins.get(n, search_mode) for n in strategies}
    if used_baseline:
        origins = {n: problem.origins.get(n, "data-parallel baseline") for n in strategies}
    else:
        for f, (rep, _) in problem.follow.items():
            if f not in problem.origins:
                origins[f] = f"{search_mode} (follows #{rep})"
    # Per node cost terms and runner-up, of the plan used when the search made it (found only
    # then: issue 14, data parallel or a renamed plan has none)
    details = {} if renamed or used_baseline else \
        _details(problem, lean if chosen.name == "lean" else choice)
    report = SearchReport(search_mode, objective, time.perf_counter() - t0, len(problem.reps),
                          est.peak, budget, optimal, baseline_s, used_baseline, tuple(notes))
    return SearchResult(Assignment(strategies, origins), search_mode, report, details)


@dataclasses.dataclass(frozen=True)
class _Option:
    """A finished plan the frame compares: the search's, its memory-lean polish, data
    parallel.  Its memory is measured when first asked (``measure``): where every plan fits
    (``roomy``), only the options within :data:`NEAR` of the fastest need it (issue 14: a
    deep model's data-parallel plan, far slower, is not measured).

    >>> o = _Option("x", {}, 1.0, lambda: print("measured") or 7)
    >>> o.estimate
    measured
    7
    >>> o.estimate
    7
    """

    name: str
    strategies: dict[int, OpStrategy]
    step_s: float  # priced whole, as XLA runs it
    measure: Callable[[], MemoryEstimate]

    @functools.cached_property
    def estimate(self) -> MemoryEstimate:
        return self.measure()


def _lean(problem: Problem, choice: dict[int, int]) -> dict[int, int]:
    """``choice`` polished by local search with memory priced in, at a price that makes the
    bytes its results hold worth :data:`NEAR` of its time: moves that save memory for little
    time (a layout held split where replicating it saves no communication)."""
    objective = problem.objective(choice)
    held = sum(float(problem.mem[r][choice[r]]) for r in problem.reps)
    if objective <= 0.0 or held <= 0.0:
        return choice
    return improve(with_memory_price(problem, NEAR * objective / held), choice)


def _beyond_tie(options: Sequence[_Option], budget: float, roomy: bool) -> str | None:
    """Why the memory-lean polish (:func:`_lean`) is not tried, or ``None`` to try it.

    The polish is a tie-break: its moves save memory at a price that lets them add at most
    :data:`NEAR` of the time the search priced (each move lowers time plus priced bytes, and
    the bytes saved are at most the bytes held), and :func:`_choose` takes it only if it is
    within :data:`NEAR` of the fastest plan.  When the search's own plan, priced whole, is
    more than that twice over (``(1 + NEAR) ** 2``) slower than another plan that fits, the
    polish would have to gain more than :data:`NEAR` of the time, which is not what it is for
    (a local search in time ended the search): it is not run (issue 14: on a deep GPT, whose
    plan is pure data parallel, 60% faster than the search's, it was a local search over the
    full problem of every layer, for a plan then set aside).  The note says so.  A decision,
    not a bound: nothing proves the polish cannot gain more (where it moved a plan of
    ``bench/same_plans.py`` or the 6-layer GPT, the whole price moved by -0.13% to +6.7%,
    and every plan it is now skipped on is the plan it was).

    >>> from jaxpar._src.search.memory import MemoryEstimate
    >>> o = lambda name, s: _Option(name, {}, s, lambda: MemoryEstimate(1.0, 0.0, 0))
    >>> _beyond_tie([o("search", 1.03), o("baseline", 1.0)], 1e9, True) is None
    False
    >>> _beyond_tie([o("search", 1.01), o("baseline", 1.0)], 1e9, True) is None
    True
    """
    search = options[0]
    fitting = [o for o in options[1:] if roomy or o.estimate.peak <= budget]
    if not fitting:
        return None
    fastest = min(fitting, key=lambda o: o.step_s)
    if search.step_s <= fastest.step_s * (1 + NEAR) ** 2:
        return None
    what = {"baseline": "pure data parallel"}.get(fastest.name, fastest.name)
    return (f"the search's plan is {search.step_s / fastest.step_s - 1:.0%} slower than "
            f"{what} under the cost model, beyond a tie: its polish with memory priced in "
            f"(which breaks ties on time within {NEAR:.0%}) was not tried")


def _choose(options: Sequence[_Option], budget: float, roomy: bool
            ) -> tuple[_Option | None, str]:
    """Of the plans that fit the budget, the one with the least predicted peak memory among
    those within :data:`NEAR` of the fastest (the fastest when memory ties), and a note
    saying why when that is not the search's own plan; ``None`` when none fits."""
    fitting = [o for o in options if roomy or o.estimate.peak <= budget]
    if not fitting:
        return None, ""
    fastest = min(fitting, key=lambda o: o.step_s)
    chosen = fastest
    for o in fitting:
        if o.step_s <= fastest.step_s * (1 + NEAR) and \
                o.estimate.peak < chosen.estimate.peak * (1 - 1e-6):
            chosen = o
    search = options[0]
    mib = 2.0**20
    if chosen is search:
        return chosen, ""
    what = {"lean": "the search's plan polished with memory priced in",
            "baseline": "pure data parallel"}[chosen.name]
    if chosen is fastest:
        if chosen.name == "baseline":
            return chosen, ("pure data parallel was cheaper than the search's plan under the "
                            "cost model, and is used")
        return chosen, f"{what} was cheaper, and is used"
    return chosen, (
        f"memory breaks the tie: {what} is used, {chosen.estimate.peak / mib:.2f} MiB "
        f"predicted per device instead of {search.estimate.peak / mib:.2f} MiB, at "
        f"{chosen.step_s / search.step_s - 1:+.2%} step time (plans within "
        f"{NEAR:.0%} of the fastest tie on time; the least memory wins)")


def _solve(space: SearchSpace, *, request: SearchRequest, search_mode: str, solver: Solver,
           budget: float, roomy: bool, loops: tuple[tuple[float, int], ...] = (),
           start: Mapping[int, OpStrategy] | None = None
           ) -> tuple[Problem, dict[int, int], bool | None, list[str], bool]:
    """Builds the problem on ``space`` and solves it with ``solver`` within the budget: the
    problem, the choice (of the full problem), whether it is proven optimal, notes, and
    whether the answer went on from ``start``: a plan (data parallel's) the answer must not
    be dearer than under the problem's own cost (:func:`_from_start`)."""
    problem = build_problem(space, request.pins, ties=request.ties,
                            fully_use_devices=request.fully_use_devices)
    notes: list[str] = []
    owner: dict[int, int] | None = None
    target = problem
    if len(problem.reps) > SHARE_LAYERS_ABOVE and problem.groups:
        target, owner = quotient(problem)
        notes.append(f"repeated layers share strategies: {len(problem.reps)} nodes searched as "
                     f"{len(target.reps)}")
    memory = Memory(problem, owner, budget, roomy, search_mode, _split(request), loops)
    solution = solver(target, memory)
    notes.extend(solution.notes)
    choice = solution.choice
    if start is not None and not solution.optimal and SQUEEZED not in solution.notes:
        choice = _from_start(target, choice, start, memory, notes)
    return problem, memory.lift(choice), solution.optimal, notes, choice is not solution.choice


def _from_start(target: Problem, choice: dict[int, int], start: Mapping[int, OpStrategy],
                memory: Memory, notes: list[str]) -> dict[int, int]:
    """``choice``, or ``start`` polished by local search where the problem's own cost says
    ``start`` is cheaper: a heuristic search (the recursive rounds, star eliminations) can end
    far above a plain plan under its own objective (the 24-layer GPT step of
    ``bench/first_call.py``: the rounds' plan 0.0402 s, data parallel 0.0240 s), and the frame
    then only set the search's plan aside for data parallel, priced whole.  Searching on from
    data parallel makes the search's answer at least as good as data parallel under the
    problem's cost, so the frame compares like with like (and at 2, 6 and 96 GPT layers the
    second search, with gradient all-reduces priced alone, is not needed: its trigger, a plan
    the problem's cost underprices, is gone).  ``start`` is used only where it is a candidate
    of every node (pins respected) and fits the memory budget, and not after a solver had to
    price memory in (its note says the budget binds).  Where local search finds nothing
    cheaper, the search's plan is data parallel's, and the frame uses it as it uses the
    baseline (``found_baseline`` in :func:`_search`: neither polished with memory priced in
    nor given per-node cost terms, as before; a search that finds data parallel by itself is
    polished as any search's plan)."""
    index: dict[int, int] = {}
    for r in target.reps:
        try:
            k = index[r] = target.cands[r].index(start[r])
        except (KeyError, ValueError):  # no start for it, or not one of its candidates
            return choice
        if target.forced.get(r, k) != k:
            return choice
    was = target.objective(choice)
    if not better(target.objective(index), was):
        return choice
    polished = improve(target, index, sweeps=2)
    if not memory.fits(polished):
        return choice
    more = (f"the search's own plan cost {was / target.objective(polished) - 1:.0%} more than "
            f"pure data parallel")
    if polished == index:
        notes.append(f"{more} under the search's cost model: the search went on from data "
                     f"parallel, local search found nothing cheaper, and data parallel is used")
    else:
        notes.append(f"{more} polished by local search, under the search's cost model: the "
                     f"search went on from data parallel")
    return polished


def _fit_memory(problem: Problem, choice: dict[int, int],
                solve: Callable[[Problem, float], dict[int, int]], memory: Memory
                ) -> dict[int, int]:
    """Re-solves with memory priced in, cheapest price first, until the plan fits (else the
    smallest plan, which the frame refuses)."""
    objective = max(problem.objective(choice), 1e-12)
    peak = max(memory.peak(choice), 1.0)
    smallest = choice
    for scale in 10.0 ** np.arange(-3, 7):
        candidate = solve(problem, scale * objective / peak)
        if memory.fits(candidate):
            return candidate
        if memory.peak(candidate) < memory.peak(smallest):
            smallest = candidate
    return smallest


def _split(request: SearchRequest) -> frozenset[int]:
    """The inputs ZeRO level 3 splits (the parallel optimizer's pins): the lowering gathers
    them again for the backward pass."""
    graph = request.space.graph
    return frozenset(p.node for p in request.pins
                     if p.origin == REGATHERED and graph.nodes[p.node].kind is NodeKind.INPUT)


def _estimate(space: SearchSpace, strategies: Mapping[int, OpStrategy], split: frozenset[int],
              roomy: bool, loops: tuple[tuple[float, int], ...] = ()) -> MemoryEstimate:
    """What the compiled program of ``strategies`` holds (search/memory.py), the packing left
    out where the budget cannot bind (``roomy``: the estimate only breaks ties); ``loops``:
    what pipeline loops hold inside, temporaries of their operators."""
    again = Regather.find(space.graph, strategies, split)
    return peak_memory(space.graph, strategies, space.model.mesh,
                       again=again.applies if again else None, packed=not roomy,
                       temporaries=loops)


def _loop_temporaries(graph: OpGraph) -> tuple[tuple[float, int], ...]:
    """``(bytes, node)`` of every pipeline loop of ``graph``: what it holds inside
    (:func:`jaxpar._src.pipeline.memory.loop_temporaries`)."""
    from jaxpar._src.pipeline.memory import loop_temporaries  # the pipeline plans with search

    return tuple(loop_temporaries(graph))


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


def _fold(cut: tuple[dict[int, np.ndarray], float], owner: Mapping[int, int] | None
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
