"""The built-in search modes, each one registered object (see ``registry.py``).

* ``sharding_propagation``: outward from the pins (``propagation.py``);
* ``recursive_programming``: D-Rec rounds per mesh axis, polished (``recursive.py``);
* ``dynamic_programming``: elimination DP, polished where it approximated (``elimination.py``);
* ``optimal``: the integer program (``optimal.py``) within bounds, with memory as constraints.

The last three are solvers of the coarse problem in the frame of ``auto.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from jaxpar._src.errors import PlanError
from jaxpar._src.search.auto import (
    SQUEEZED,
    Memory,
    Solution,
    coarse_search,
    priced,
    with_memory_price,
)
from jaxpar._src.search.elimination import solve_elimination
from jaxpar._src.search.optimal import (
    IlpResult,
    ilp_variables,
    optimality_gap,
    solve_optimal,
)
from jaxpar._src.search.polish import polish
from jaxpar._src.search.problem import Problem
from jaxpar._src.search.propagation import propagate
from jaxpar._src.search.recursive import solve_recursive
from jaxpar._src.search.registry import SearchRequest, SearchResult, register_search

# Largest integer program ``optimal`` solves (variables: see ``optimal.ilp_variables``): its
# relaxation takes a few seconds, as on the GPT benchmarks (75,000 variables, 2 s).  A GPT
# block on a mesh of three axes needs a million.
OPTIMAL_VARIABLES = 100_000
# Largest one branch and bound may run on when the relaxation is not integral (on meshes of
# three axes it rarely is, and HiGHS's root cuts alone then take tens of seconds at 50,000).
BRANCH_VARIABLES = 20_000
# When the relaxation is not integral, a plan this close (relative) to its bound is the answer.
GOOD_ENOUGH = 0.01
TIME_LIMIT = 30.0  # seconds of each HiGHS solve at most
MEMORY_CUTS = 20  # memory constraints the exact search adds at most, one per re-solve


@register_search("sharding_propagation")
def _propagation(request: SearchRequest) -> SearchResult:
    return SearchResult(propagate(request.space, request.pins, ties=request.ties,
                                  where=request.where), "sharding_propagation")


def recursive_plan(problem: Problem, price: float) -> dict[int, int]:
    return solve_recursive(with_memory_price(problem, price))


def elimination_plan(problem: Problem, price: float) -> dict[int, int]:
    choice, stats = solve_elimination(problem, memory_price=price)
    if not stats.exact:  # star eliminations or a rounded core: polish their decisions
        choice = polish(with_memory_price(problem, price), choice)
    return choice


def fast_plan(problem: Problem, price: float) -> dict[int, int]:
    """The cheaper of the recursive and the elimination searches' plans."""
    costed = with_memory_price(problem, price)
    return min((recursive_plan(problem, price), elimination_plan(problem, price)),
               key=costed.objective)


register_search("recursive_programming")(
    coarse_search("recursive_programming", priced(recursive_plan)))
register_search("dynamic_programming")(
    coarse_search("dynamic_programming", priced(elimination_plan)))


def _optimal(target: Problem, memory: Memory) -> Solution:
    """The integer program: exact when its relaxation is integral; else the best of the
    relaxation's neighbourhood and the recursive plan, with its gap to the bound; too large a
    program is not attempted.  A plan over the memory budget adds the violated constraint."""
    variables = ilp_variables(target, limit=OPTIMAL_VARIABLES)
    if variables > OPTIMAL_VARIABLES:
        # The relaxation alone of a program this size takes minutes: solve as the fast
        # searches do, and say that the plan is not proven optimal.
        solution = priced(fast_plan)(target, memory)
        return Solution(solution.choice, False, (
            f"the integer program would have more than {OPTIMAL_VARIABLES:,} variables, too "
            f"many to solve in seconds; the plan is the better of recursive and dynamic "
            f"programming's, not proven optimal",))

    @functools.cache
    def fast() -> dict[int, int]:  # the plan to fall back on (computed once, if needed)
        return polish(target, solve_recursive(target))

    solve = functools.partial(solve_optimal, target, time_limit=TIME_LIMIT,
                              fallback=lambda: dict(fast()), polish=polish,
                              good_enough=GOOD_ENOUGH, branch=variables <= BRANCH_VARIABLES)
    result = _final_graph(target, variables, fast) or solve()
    cuts = []
    smallest = float("inf")
    for _ in range(0 if memory.roomy else MEMORY_CUTS):
        peak = memory.peak(result.choice)
        smallest = min(smallest, peak)
        if peak <= memory.budget:
            break
        cuts.append(memory.cut(result.choice))
        try:
            result = solve(extra_rows=cuts)
        except PlanError:  # the cuts admit no plan at all
            raise memory.refusal(smallest) from None
    notes: tuple[str, ...] = () if result.optimal else (_unproven(result),)
    if cuts:
        notes += (SQUEEZED,)
    return Solution(result.choice, result.optimal, notes)


def _final_graph(target: Problem, variables: int, fast: Callable[[], dict[int, int]]
                 ) -> IlpResult | None:
    """The exact eliminations of ``elimination.py`` first (leaves, chains, pairs: they lose
    nothing, so the optimum of the final graph they leave is the problem's), then the integer
    program of that final graph, smaller than the whole one and with a relaxation at least as
    tight: the proven optimum when the relaxation is integral; else the relaxation bounds the
    optimum, and the plan is the cheapest of the final graph's relaxation neighbourhood and
    the recursive plan, polished.  None (solve the whole program) when a star elimination had
    to come first (no bound), or when the program is small enough to branch and the plan is
    more than :data:`GOOD_ENOUGH` above the bound."""
    choice, stats = solve_elimination(target, core_variables=OPTIMAL_VARIABLES)
    if stats.exact:
        return IlpResult(choice, target.objective(choice), True, 0.0, variables, 0)
    if stats.bound is None:
        return None
    best = min((polish(target, choice), dict(fast())), key=target.objective)
    objective = target.objective(best)
    gap = optimality_gap(objective, stats.bound)
    if variables <= BRANCH_VARIABLES and gap > GOOD_ENOUGH:
        return None
    return IlpResult(best, objective, False, gap, variables, 0, stats.bound)


def _unproven(result: IlpResult) -> str:
    if np.isfinite(result.gap):
        return (f"not proven optimal: the integer program's relaxation is not integral; the "
                f"plan is at most {result.gap:.2%} above the optimum (the relaxation's bound)")
    return (f"not proven optimal: branch and bound stopped at its time limit ({TIME_LIMIT:g} "
            f"s) without a bound")


register_search("optimal")(coarse_search("optimal", _optimal))
