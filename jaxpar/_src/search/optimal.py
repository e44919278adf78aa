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
                  extra_rows: list[tuple[dict[int, np.ndarray], float]] | None = None
                  ) -> IlpResult:
    """Solves the problem exactly (within ``time_limit`` seconds).

    ``extra_rows`` adds constraints ``sum_r coeff[r] . x_r <= bound`` (the memory cuts).
    """
    offset: dict[int, int] = {}
    n = 0
    for r in problem.reps:
        offset[r] = n
        n += len(problem.cands[r])
    c = np.zeros(n)
    for r in problem.reps:
        c[offset[r]:offset[r] + len(problem.cands[r])] += problem.cost[r]
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        row = len(lo)
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lo.append(lb)
        hi.append(ub)

    for r in problem.reps:
        add_row([(offset[r] + k, 1.0) for k in range(len(problem.cands[r]))], 1.0, 1.0)
    w_costs = []
    for (u, v), m in problem.edges.items():
        # Candidates with the same row (column) of costs behave alike on this edge.
        row_keys, row_ids = np.unique(m, axis=0, return_inverse=True)
        table, col_ids = np.unique(row_keys, axis=1, return_inverse=True)
        row_ids, col_ids = row_ids.reshape(-1), col_ids.reshape(-1)
        na, nb = table.shape
        base = n + len(w_costs)
        w_costs.extend(table.reshape(-1).tolist())
        for a in range(na):
            entries = [(base + a * nb + b, 1.0) for b in range(nb)]
            entries += [(offset[u] + k, -1.0) for k in np.flatnonzero(row_ids == a)]
            add_row(entries, 0.0, 0.0)
        for b in range(nb):
            entries = [(base + a * nb + b, 1.0) for a in range(na)]
            entries += [(offset[v] + k, -1.0) for k in np.flatnonzero(col_ids == b)]
            add_row(entries, 0.0, 0.0)
    for coeffs, bound in extra_rows or []:
        entries = []
        for r, vec in coeffs.items():
            entries += [(offset[r] + k, float(x)) for k, x in enumerate(vec) if x]
        add_row(entries, -np.inf, bound)
    total = n + len(w_costs)
    cost = np.concatenate([c, np.asarray(w_costs)])
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
    integrality = np.zeros(total)
    integrality[:n] = 1
    a = sparse.csr_matrix((vals, (rows, cols)), shape=(len(lo), total))
    res = milp(cost, integrality=integrality, bounds=Bounds(lb, ub),
               constraints=LinearConstraint(a, np.asarray(lo), np.asarray(hi)),
               options={"time_limit": time_limit, "mip_rel_gap": 1e-6, "disp": False})
    if res.x is None:
        raise PlanError(f"jaxpar (optimal search): the integer program found no solution "
                        f"({res.message}).")
    x = res.x[:n]
    choice = {}
    for r in problem.reps:
        choice[r] = int(np.argmax(x[offset[r]:offset[r] + len(problem.cands[r])]))
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return IlpResult(choice, problem.objective(choice), res.status == 0, gap, total, len(lo))
