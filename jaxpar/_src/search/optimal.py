"""``search_mode="optimal"``: the exact optimum of the cost model, as an integer program.

One binary variable per (coarse node, candidate), one-hot per node (on large graphs the nodes
are those of the quotient problem, one per group of repeated layers).  Each edge contributes a
joint distribution ``w[a, b]`` over the distinct layouts its two ends can take, whose marginals
are the two nodes' choices (the tight formulation of Alpa's ILP); the objective is node seconds
plus edge seconds.  Solved by HiGHS through
``scipy.optimize.milp``.

References: Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism" (OSDI 2022),
section 4.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from jaxpar._src.errors import PlanError
from jaxpar._src.search.problem import Problem


@dataclasses.dataclass(frozen=True)
class IlpResult:
    choice: dict[int, int]
    objective: float
    optimal: bool  # proven optimal (else the best found within the time limit)
    gap: float  # relative gap between the solution and the best bound
    variables: int
    constraints: int


def solve_optimal(problem: Problem, *, time_limit: float = 300.0,
                  extra_rows: list[tuple[dict[int, np.ndarray], float]] | None = None,
                  exact: bool = True) -> IlpResult:
    """Solves the problem exactly (within ``time_limit`` seconds).

    ``extra_rows`` adds constraints ``sum_r coeff[r] . x_r <= bound`` (the memory cuts).
    ``exact=False``: when the linear relaxation is fractional, solve the integer program over
    the candidates the relaxation supports only (fast, near the optimum: the dynamic
    programming's final graph).  Residual networks are where this matters: a Megatron-like
    alternation of channel splits around each residual block is a cycle the relaxation can
    only half satisfy (every node 0.5/0.5), and the exact integer program branched for minutes.
    """
    offset: dict[int, int] = {}
    n = 0
    for r in problem.reps:
        offset[r] = n
        n += len(problem.cands[r])
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
    add_rows(np.repeat(np.arange(len(sizes)), sizes), np.arange(n), 1.0, len(sizes), 1.0, 1.0)
    w_costs: list[np.ndarray] = []
    w_total = 0
    for (u, v), m in problem.edges.items():
        # Candidates with the same row (column) of costs behave alike on this edge.
        row_ids, row_keys = _classes(m)
        col_ids, table_t = _classes(row_keys.T)
        table = table_t.T
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
    for coeffs, bound in extra_rows or []:
        r_cols = [offset[r] + np.arange(len(vec)) for r, vec in coeffs.items()]
        r_vals = [np.asarray(vec, dtype=float) for vec in coeffs.values()]
        col = np.concatenate(r_cols) if r_cols else np.zeros(0, dtype=np.int64)
        add_rows(np.zeros(len(col), dtype=np.int64), col,
                 np.concatenate(r_vals) if r_vals else np.zeros(0), 1, -np.inf, bound)
    total = n + w_total
    cost = np.concatenate([c, *w_costs])
    # Costs are seconds, often nanoseconds: rescale so the solver's absolute tolerances do not
    # swallow them (the largest coefficient becomes 1e4).
    finite = cost[np.isfinite(cost)]
    top = float(np.max(np.abs(finite))) if finite.size else 0.0
    if top > 0:
        cost = cost * (1e4 / top)
    lb = np.zeros(total)
    ub = np.ones(total)
    for r, k in problem.forced.items():
        ub[offset[r]:offset[r] + len(problem.cands[r])] = 0.0
        lb[offset[r] + k] = ub[offset[r] + k] = 1.0
    banned = ~np.isfinite(cost)  # candidates priced infinite are not allowed
    ub[banned] = 0.0
    cost[banned] = 0.0
    a = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
                          shape=(count, total))
    bounds = Bounds(lb, ub)
    constraints = LinearConstraint(a, np.concatenate(lo), np.concatenate(hi))
    options = {"time_limit": time_limit, "mip_rel_gap": 1e-6, "disp": False}
    # The relaxation is usually integral already (the joint-distribution formulation is tight):
    # an integral LP optimum is the integer optimum, found without branching or cuts.
    res = milp(cost, integrality=np.zeros(total), bounds=bounds, constraints=constraints,
               options=options | {"presolve": False})
    relaxed = None if res.x is None or _integral(res.x[:n]) else res.x[:n]
    if relaxed is not None and not exact and not extra_rows:
        return _solve_supported(problem, relaxed, offset, time_limit)
    if res.x is None or relaxed is not None:
        integrality = np.zeros(total)
        integrality[:n] = 1
        res = milp(cost, integrality=integrality, bounds=bounds, constraints=constraints,
                   options=options)
    fallback = None
    if res.status != 0 and relaxed is not None and not extra_rows:
        # Stopped at the time limit: the restricted solve may have found better.
        fallback = _solve_supported(problem, relaxed, offset, time_limit)
    if res.x is None:
        if fallback is not None:
            return fallback
        raise PlanError(f"jaxpar (optimal search): the integer program found no solution "
                        f"({res.message}).")
    x = res.x[:n]
    choice = {}
    for r in problem.reps:
        choice[r] = int(np.argmax(x[offset[r]:offset[r] + len(problem.cands[r])]))
    if fallback is not None and fallback.objective < problem.objective(choice):
        return fallback
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return IlpResult(choice, problem.objective(choice), res.status == 0, gap, total, count)


def _solve_supported(problem: Problem, x: np.ndarray, offset: Mapping[int, int],
                     time_limit: float) -> IlpResult:
    """The exact solve restricted to each node's candidates with weight in the relaxation."""
    keep = {}
    for r in problem.reps:
        v = x[offset[r]:offset[r] + len(problem.cands[r])]
        keep[r] = np.flatnonzero(v > 1e-6)
        if not len(keep[r]):
            keep[r] = np.array([int(np.argmax(v))])
    small = dataclasses.replace(
        problem, cands={r: tuple(problem.cands[r][k] for k in keep[r]) for r in problem.reps},
        cost={r: problem.cost[r][keep[r]] for r in problem.reps},
        mem={r: problem.mem[r][keep[r]] for r in problem.reps},
        edges={(u, v): m[np.ix_(keep[u], keep[v])] for (u, v), m in problem.edges.items()},
        forced={r: 0 for r in problem.forced})
    result = solve_optimal(small, time_limit=time_limit)
    choice = {r: int(keep[r][k]) for r, k in result.choice.items()}
    return IlpResult(choice, problem.objective(choice), False, result.gap, result.variables,
                     result.constraints)


def _integral(x: np.ndarray) -> bool:
    return bool(np.all(np.minimum(np.abs(x), np.abs(1.0 - x)) < 1e-6))


def _classes(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The class of each row of ``m`` (equal rows, one class) and one row per class."""
    seen: dict[bytes, int] = {}
    ids = np.array([seen.setdefault(row.tobytes(), len(seen)) for row in m], dtype=np.int64)
    first = np.zeros(len(seen), dtype=np.int64)
    first[ids[::-1]] = np.arange(len(ids))[::-1]
    return ids, m[first]
