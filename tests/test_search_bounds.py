"""The searches' work stays bounded on meshes of three axes (issue 10, item 4).

On a (2, 2, 2) mesh an operator has 27 to 125 candidate strategies, an edge up to 15,000
candidate pairs; the exact integer program of a 171-operator train step has 420,000 variables
and a relaxation that is not integral, which once made ``dynamic_programming`` and ``optimal``
take minutes.  These tests count the work (integer program sizes, elimination tables) rather
than time it, with one generous clock bound as a backstop.
"""

import time

import numpy as np
import pytest

import jaxpar
from jaxpar._src.cost import CostModel
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.search import SearchRequest, elimination, get_search, highs, modes, optimal, polish
from jaxpar._src.search.common import SearchSpace
from jaxpar._src.search.problem import Problem, build_problem
from jaxpar._src.spec import MeshShape
from jaxpar._src.trace import trace
from tests import auto_models as am

MODES = ("recursive_programming", "dynamic_programming", "optimal")


@pytest.fixture(scope="module")
def scan_cumprod_space():
    step, args = am.scan_cumprod()
    mesh = jaxpar.make_mesh((2, 2, 2), ("a", "b", "c"))
    graph = trace(step, args).graph
    assert 137 <= graph.count("op") <= 218  # the size of the programs the issue reported
    return SearchSpace(graph, CostModel(MeshShape.of(mesh), HardwareProfile()))


@pytest.fixture
def work(monkeypatch):
    """Records every linear or integer program HiGHS is given and every elimination's
    statistics."""
    record = {"relaxations": [], "integer": [], "eliminations": []}
    real_highs = highs.solve

    def solve(model, *, integer, **kwargs):
        kind = "integer" if integer is not None and np.any(integer) else "relaxations"
        record[kind].append(len(model.cost))
        return real_highs(model, integer=integer, **kwargs)

    real_solve = elimination.solve_elimination

    def solve_elimination(problem, **kwargs):
        choice, stats = real_solve(problem, **kwargs)
        record["eliminations"].append(stats)
        return choice, stats

    monkeypatch.setattr(highs, "solve", solve)
    for module in (modes, polish):
        monkeypatch.setattr(module, "solve_elimination", solve_elimination)
    return record


@pytest.mark.parametrize("mode", MODES)
def test_searches_on_a_three_axis_mesh_stay_within_their_work_bounds(scan_cumprod_space, work,
                                                                      mode):
    space = scan_cumprod_space
    full = optimal.ilp_variables(build_problem(space, []))
    assert full > 3 * modes.OPTIMAL_VARIABLES  # what an unbounded exact search would solve
    t0 = time.perf_counter()
    result = get_search(mode)(SearchRequest(space))
    assignment, report = result.assignment, result.report
    elapsed = time.perf_counter() - t0
    assert max(work["relaxations"], default=0) <= modes.OPTIMAL_VARIABLES
    assert max(work["integer"], default=0) <= max(modes.BRANCH_VARIABLES,
                                                  optimal.NEIGHBOURHOOD_VARIABLES)
    for stats in work["eliminations"]:
        assert stats.largest_table <= elimination.WORK_LIMIT
        assert stats.core_variables <= elimination.CORE_VARIABLES
    if mode == "optimal":
        assert report.optimal is False and any("not proven optimal" in n for n in report.notes)
    assert set(assignment.strategies) == {n.id for n in space.graph.searchable()}
    assert np.isfinite(report.objective_s)
    assert elapsed < 120  # minutes before the bounds; seconds on two idle cores


def _grid_problem(rows: int, cols: int, candidates: int, seed: int = 0) -> Problem:
    """A grid of nodes (every inner node has four neighbours: no exact elimination applies),
    with random node costs and layout-change-like edge costs (zero on the diagonal)."""
    rng = np.random.default_rng(seed)
    node = {r * cols + c: rng.uniform(0, 1, candidates) for r in range(rows) for c in range(cols)}
    edges = {}
    for r in range(rows):
        for c in range(cols):
            for dr, dc in ((0, 1), (1, 0)):
                if r + dr < rows and c + dc < cols:
                    m = rng.uniform(0.5, 2, (candidates, candidates))
                    np.fill_diagonal(m, 0.0)
                    edges[(r * cols + c, (r + dr) * cols + c + dc)] = m
    return Problem.from_tables(node, edges)


def test_elimination_solves_a_small_core_exactly_and_bounds_a_large_one():
    small = _grid_problem(3, 3, 6)
    choice, stats = elimination.solve_elimination(small)
    assert stats.core_variables <= elimination.CORE_VARIABLES
    exact = optimal.solve_optimal(small)
    if stats.exact:  # nothing approximated: the DP's answer is the optimum
        assert small.objective(choice) == pytest.approx(exact.objective, rel=1e-9)
    large = _grid_problem(6, 6, 64)
    assert optimal.ilp_variables(large) > elimination.CORE_VARIABLES
    choice, stats = elimination.solve_elimination(large)
    assert not stats.exact and stats.core_variables <= elimination.CORE_VARIABLES
    assert set(choice) == set(large.reps)
    polished = polish.polish(large, choice)
    assert large.objective(polished) <= large.objective(choice)


def _frustrated_problem(n: int, candidates: int, seed: int) -> Problem:
    """A grid with diagonals and random pairwise costs: odd cycles whose preferences
    conflict, where the linear relaxation is fractional."""
    rng = np.random.default_rng(seed)
    node = {i: rng.uniform(0, 0.1, candidates) for i in range(n * n)}
    edges = {}
    for r in range(n):
        for c in range(n):
            for dr, dc in ((0, 1), (1, 0), (1, 1)):
                if r + dr < n and c + dc < n:
                    edges[(r * n + c, (r + dr) * n + c + dc)] = rng.uniform(
                        0, 1, (candidates, candidates))
    return Problem.from_tables(node, edges)


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_optimal_certifies_its_gap_when_the_relaxation_is_fractional(seed):
    problem = _frustrated_problem(4, 3, seed)
    certified = optimal.solve_optimal(problem, branch=False)
    exact = optimal.solve_optimal(problem)  # branch and bound proves these small ones
    assert exact.optimal and not certified.optimal and 0 < certified.gap < np.inf
    assert certified.bound <= exact.objective * (1 + 1e-9)
    assert exact.objective <= certified.objective <= certified.bound * (1 + certified.gap) + 1e-9
    # the relaxation's neighbourhood alone lands within a few per cent of the optimum
    assert certified.objective <= 1.05 * exact.objective
