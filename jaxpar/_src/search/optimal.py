"""``search_mode="optimal"``: the exact optimum of the cost model, as an integer program.

One binary variable per (coarse node, candidate), one-hot per node (on large graphs the nodes
are those of the quotient problem, one per group of repeated layers).  Each edge contributes a
joint distribution ``w[a, b]`` over the distinct layouts its two ends can take, whose marginals
are the two nodes' choices (the tight formulation of Alpa's ILP); the objective is node seconds
plus edge seconds.  Solved by HiGHS (:mod:`jaxpar._src.search.highs`).

References: Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism" (OSDI 2022),
section 4.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np

from jaxpar._src.errors import PlanError
from jaxpar._src.search import highs
from jaxpar._src.search.problem import Problem

# Largest integer program solved by branch and bound over a relaxation's neighbourhood.
NEIGHBOURHOOD_VARIABLES = 20_000
# Edge tables with at most this many rows are grouped by a dict of rows (most of them: an
# operator has 1 to 27 candidates on meshes of one or two axes), larger ones by projections.
SMALL_TABLE = 32


@dataclasses.dataclass(frozen=True)
class IlpResult:
    choice: dict[int, int]
    objective: float
    optimal: bool  # proven optimal
    gap: float  # else: at most this much above the optimum, relative to it (inf: unknown)
    variables: int
    constraints: int
    bound: float | None = None  # a proven lower bound of the optimum (seconds), if not optimal


Classes = tuple[np.ndarray, np.ndarray, np.ndarray]  # an edge's _edge_classes
Seen = dict[int, tuple[np.ndarray, Classes]]  # edges' classes by the table's identity


def ilp_variables(problem: Problem, *, limit: float = np.inf, seen: Seen | None = None) -> int:
    """How many variables the integer program of ``problem`` has: one per candidate, and one
    per pair of distinct cost rows and columns of every edge.  What the solver's time grows
    with (faster than linearly): the searches check it before solving.  Counting stops once
    the count exceeds ``limit``.  ``seen`` remembers the edges' classes counted before (by
    identity: the solvers never change a cost table in place), for a caller that asks again
    or then solves the program (:func:`solve_optimal`'s ``seen``).

    >>> from jaxpar._src.search.problem import Problem
    >>> costs = {0: np.zeros(3), 1: np.zeros(4)}
    >>> ilp_variables(Problem.from_tables(costs, {(0, 1): np.ones((3, 4))}))  # 3 + 4 + 1 x 1
    8
    """
    n = sum(len(problem.cands[r]) for r in problem.reps)
    for m in sorted(problem.edges.values(), key=lambda m: m.size):
        if n > limit:  # the caller only needs to know that it is too large
            break
        n += _classes_of(m, seen)[2].size
    return n


def _classes_of(m: np.ndarray, seen: Seen | None) -> Classes:
    """``_edge_classes(m)``, remembered in ``seen`` when given."""
    known = seen.get(id(m)) if seen is not None else None
    if known is None or known[0] is not m:
        known = (m, _edge_classes(m))
        if seen is not None:
            seen[id(m)] = known
    return known[1]


Rows = list[tuple[dict[int, np.ndarray], float]]  # constraints sum_r coeff[r] . x_r <= bound


def solve_optimal(problem: Problem, *, time_limit: float = 300.0, extra_rows: Rows | None = None,
                  fallback: Callable[[], dict[int, int]] | None = None,
                  polish: Callable[[Problem, dict[int, int]], dict[int, int]] | None = None,
                  good_enough: float = 0.0, branch: bool = True, seen: Seen | None = None
                  ) -> IlpResult:
    """Solves the problem exactly, or says how far from exact its answer may be.

    The linear relaxation is solved first.  When it is integral (the usual case on meshes of
    one or two axes: the formulation is tight) it is the proven optimum.  Otherwise its value
    bounds every plan from below, and two plans are made: the integer program restricted to
    the candidates the relaxation uses (relaxation-induced neighbourhood search), then
    ``polish``-ed, and ``fallback``'s (a fast search), each if given.  The cheaper is the
    answer when it is within ``good_enough`` (relative) of the bound or ``branch`` is false;
    else branch and bound runs for at most ``time_limit`` seconds and the best plan found is
    the answer (``gap``: how far from the optimum it may be).

    ``extra_rows`` adds constraints ``sum_r coeff[r] . x_r <= bound`` (the memory cuts).
    ``seen``: the edges' classes found before (:func:`ilp_variables`), not found again.

    Raises:
      PlanError: no plan satisfies the constraints (or none was found in time).
    """
    program = _Program(problem, extra_rows or [], seen)
    relaxed = program.solve(integer=False, time_limit=time_limit)
    if relaxed.x is not None and _integral(relaxed.x[:program.n]):
        return program.result(program.choice(relaxed.x), optimal=True, bound=None)
    bound = program.bound(relaxed)
    plans = []
    if relaxed.x is not None:
        near = _neighbourhood(program, relaxed.x, time_limit)
        if near is not None and polish is not None and not extra_rows:
            near = polish(problem, near)  # (polishing does not know the memory cuts)
        plans.append(near)
    if fallback is not None:
        plans.append(fallback())
    feasible = [p for p in plans if p is not None and program.feasible(p)]
    best = min(feasible, key=problem.objective, default=None)
    if best is not None and (not branch or (
            bound is not None and optimality_gap(problem.objective(best), bound) <= good_enough)):
        return program.result(best, optimal=False, bound=bound)
    res = program.solve(integer=True, time_limit=time_limit)
    if res.x is not None:
        found = program.choice(res.x)
        if best is None or problem.objective(found) < problem.objective(best):
            best = found
        if res.optimal:  # proven: no plan is cheaper than what it found
            return program.result(best, optimal=True, bound=None)
        proven = program.bound(res, mip=True)
        if proven is not None:
            bound = proven if bound is None else max(bound, proven)
    if best is None:
        raise PlanError(f"jaxpar (optimal search): the integer program found no solution "
                        f"({res.message}).")
    return program.result(best, optimal=False, bound=bound)


def _neighbourhood(program: _Program, x: np.ndarray, time_limit: float
                   ) -> dict[int, int] | None:
    """The integer program over the candidates a fractional relaxation ``x`` uses (a few per
    node where it is undecided, one elsewhere): small, and usually solved at once."""
    problem = program.problem
    kept = {}
    for r in problem.reps:
        segment = x[program.offset[r]:program.offset[r] + len(problem.cands[r])]
        kept[r] = np.flatnonzero(segment > 1e-6)
        if not len(kept[r]):
            kept[r] = np.array([int(np.argmax(segment))])
    rows = [({r: np.asarray(vec)[kept[r]] for r, vec in coeffs.items()}, bound)
            for coeffs, bound in program.extra_rows]
    restricted = problem.restricted(kept)
    if ilp_variables(restricted, limit=NEIGHBOURHOOD_VARIABLES) > NEIGHBOURHOOD_VARIABLES:
        return None  # a relaxation undecided almost everywhere: no small neighbourhood
    small = _Program(restricted, rows)
    res = small.solve(integer=True, time_limit=time_limit)
    if res.x is None:
        return None
    return {r: int(kept[r][k]) for r, k in small.choice(res.x).items()}


class _Program:
    """The integer program of a problem, as HiGHS takes it (:class:`highs.Model`)."""

    def __init__(self, problem: Problem, extra_rows: Rows, seen: Seen | None = None) -> None:
        self.problem = problem
        self.extra_rows = extra_rows
        offset: dict[int, int] = {}
        n = 0
        for r in problem.reps:
            offset[r] = n
            n += len(problem.cands[r])
        self.offset, self.n = offset, n
        c = np.zeros(n)
        for r in problem.reps:
            c[offset[r]:offset[r] + len(problem.cands[r])] += problem.cost[r]
        # Constraint rows as (row, column, value) triplets, built as arrays; bounds per row.
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        lo: list[np.ndarray] = []
        hi: list[np.ndarray] = []
        count = 0

        def add_rows(r: np.ndarray, col: np.ndarray, val: np.ndarray | float, k: int,
                     lb: float, ub: float) -> None:
            nonlocal count
            rows.append(count + r)
            cols.append(col)
            vals.append(np.broadcast_to(np.asarray(val, dtype=float), col.shape))
            lo.append(np.full(k, lb))
            hi.append(np.full(k, ub))
            count += k

        sizes = np.array([len(problem.cands[r]) for r in problem.reps], dtype=np.int64)
        add_rows(np.repeat(np.arange(len(sizes)), sizes), np.arange(n), 1.0, len(sizes), 1.0,
                 1.0)
        w_costs: list[np.ndarray] = []
        w_total = 0
        for (u, v), m in problem.edges.items():
            row_ids, col_ids, table = _classes_of(m, seen)
            na, nb = table.shape
            base = n + w_total
            w_costs.append(table.reshape(-1))
            w_total += na * nb
            w = base + np.arange(na * nb)
            # sum_b w[a, b] = sum of u's candidates in row class a, for every a; then columns.
            add_rows(np.concatenate([np.repeat(np.arange(na), nb), row_ids]),
                     np.concatenate([w, offset[u] + np.arange(len(row_ids))]),
                     np.concatenate([np.ones(na * nb), -np.ones(len(row_ids))]), na, 0.0, 0.0)
            add_rows(np.concatenate([np.tile(np.arange(nb), na), col_ids]),
                     np.concatenate([w, offset[v] + np.arange(len(col_ids))]),
                     np.concatenate([np.ones(na * nb), -np.ones(len(col_ids))]), nb, 0.0, 0.0)
        for coeffs, bound in extra_rows:
            r_cols = [offset[r] + np.arange(len(vec)) for r, vec in coeffs.items()]
            r_vals = [np.asarray(vec, dtype=float) for vec in coeffs.values()]
            col = np.concatenate(r_cols) if r_cols else np.zeros(0, dtype=np.int64)
            add_rows(np.zeros(len(col), dtype=np.int64), col,
                     np.concatenate(r_vals) if r_vals else np.zeros(0), 1, -np.inf, bound)
        total = n + w_total
        cost = np.concatenate([c, *w_costs])
        # Costs are seconds, often nanoseconds: rescale so the solver's absolute tolerances do
        # not swallow them (the largest coefficient becomes 1e4).
        finite = cost[np.isfinite(cost)]
        top = float(np.max(np.abs(finite))) if finite.size else 0.0
        self.scale = 1e4 / top if top > 0 else 1.0
        cost = cost * self.scale
        lb = np.zeros(total)
        ub = np.ones(total)
        for r, k in problem.forced.items():
            ub[offset[r]:offset[r] + len(problem.cands[r])] = 0.0
            lb[offset[r] + k] = ub[offset[r] + k] = 1.0
        banned = ~np.isfinite(cost)  # candidates priced infinite are not allowed
        ub[banned] = 0.0
        cost[banned] = 0.0
        self.total, self.constraints = total, count
        self.model = highs.Model.from_triplets(
            cost, rows=np.concatenate(rows), cols=np.concatenate(cols),
            values=np.concatenate(vals), row_lower=np.concatenate(lo),
            row_upper=np.concatenate(hi), lower=lb, upper=ub)

    def solve(self, *, integer: bool, time_limit: float) -> highs.Solution:
        """The integer program (the candidates' variables integral; the edges' follow), or
        its linear relaxation: an integral vertex of it is what the relaxation is for."""
        mask = np.arange(self.total) < self.n if integer else None
        return highs.solve(self.model, integer=mask, time_limit=time_limit)

    def bound(self, res: highs.Solution, *, mip: bool = False) -> float | None:
        """The lower bound (seconds) a solve proved: a relaxation's value, or branch and
        bound's best bound."""
        if mip:
            value = res.dual_bound
        else:
            value = res.objective if res.optimal else None
        return None if value is None or not np.isfinite(value) else float(value) / self.scale

    def choice(self, x: np.ndarray) -> dict[int, int]:
        return {r: int(np.argmax(x[self.offset[r]:self.offset[r] + len(self.problem.cands[r])]))
                for r in self.problem.reps}

    def feasible(self, choice: dict[int, int]) -> bool:
        problem = self.problem
        if any(choice.get(r) != k for r, k in problem.forced.items()):
            return False
        if not np.isfinite(problem.objective(choice)):
            return False
        return all(sum(float(vec[choice[r]]) for r, vec in coeffs.items()) <= bound
                   for coeffs, bound in self.extra_rows)

    def result(self, choice: dict[int, int], *, optimal: bool, bound: float | None
               ) -> IlpResult:
        objective = self.problem.objective(choice)
        gap = 0.0 if optimal or bound is None else optimality_gap(objective, bound)
        return IlpResult(choice, objective, optimal, gap if not optimal else 0.0,
                         self.total, self.constraints, bound)


def optimality_gap(objective: float, bound: float) -> float:
    """How far ``objective`` may be above the optimum, relative to it: at most this much."""
    if objective <= 0:
        return 0.0
    return max(0.0, (objective - bound) / max(bound, 1e-300)) if bound > 0 else np.inf


def _integral(x: np.ndarray) -> bool:
    return bool(np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) < 1e-6))


def _edge_classes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Candidates with the same row (column) of costs behave alike on an edge: the row class
    and column class of every candidate, and the table of costs between classes."""
    row_ids, row_keys = _classes(m)
    col_ids, table_t = _classes(row_keys.T)
    return row_ids, col_ids, table_t.T


def _classes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The class of each row of ``m`` (equal rows, one class; classes numbered in order of
    first appearance) and one row per class."""
    if m.shape[0] == 0 or m.shape[1] == 0:  # no rows, or rows that are all alike
        return np.zeros(m.shape[0], dtype=np.int64), m[:1]
    if m.shape[0] <= SMALL_TABLE:  # a few rows: a dict of their bytes is ten times faster
        return _classes_by_bytes(m)
    # Rows are grouped by two random projections (sorting numbers, not rows), then checked:
    # equal projections of unequal rows (a collision) fall back to comparing bytes.
    finite = np.where(np.isfinite(m), m, 1e300)
    keys = finite @ _PROJECTIONS(m.shape[1])
    _, first, inverse = np.unique(keys[:, 0] + 1j * keys[:, 1], return_index=True,
                                  return_inverse=True)
    inverse = inverse.reshape(-1)
    if not np.array_equal(m, m[first[inverse]]):
        return _classes_by_bytes(m)
    order = np.argsort(first, kind="stable")  # sorted classes -> first-appearance order
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse].astype(np.int64), m[first[order]]


@functools.lru_cache(maxsize=64)
def _PROJECTIONS(n: int) -> np.ndarray:  # noqa: N802 - a cached constant
    return np.random.default_rng(0).uniform(0.5, 1.5, size=(n, 2))


def _classes_by_bytes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    seen: dict[bytes, int] = {}
    ids = np.array([seen.setdefault(row.tobytes(), len(seen)) for row in m], dtype=np.int64)
    first = np.zeros(len(seen), dtype=np.int64)
    first[ids[::-1]] = np.arange(len(ids))[::-1]
    return ids, m[first]
