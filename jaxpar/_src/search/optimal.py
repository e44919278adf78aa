"""``search_mode="optimal"``: the exact optimum of the cost model, as an integer program.

One binary variable per (coarse node, candidate), one-hot per node; repeated layers share one
vector.  Each edge contributes a joint distribution ``w[a, b]`` over the distinct layouts its
two ends can take, whose marginals are the two nodes' choices (the tight formulation of Alpa's
ILP); the objective is node seconds plus edge seconds.  Solved by HiGHS through
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
    owner = {r: r for r in problem.reps}
    for group in problem.groups:
        for r in group:
            owner[r] = group[0]
    owners = sorted(set(owner.values()))
    offset: dict[int, int] = {}
    n = 0
    for o in owners:
        offset[o] = n
        n += len(problem.cands[o])
    c = np.zeros(n)
    for r in problem.reps:
        o = owner[r]
        c[offset[o]:offset[o] + len(problem.cands[r])] += problem.cost[r]
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add_row(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        row = len(lo)
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lo.append(lb)
        hi.append(ub)

    for o in owners:
        add_row([(offset[o] + k, 1.0) for k in range(len(problem.cands[o]))], 1.0, 1.0)
    w_costs = []
    for (u, v), m in problem.edges.items():
        ou, ov = owner[u], owner[v]
        if ou == ov:  # two members of one group: the same candidate on both ends
            c[offset[ou]:offset[ou] + m.shape[0]] += np.diag(m)
            continue
        # Candidates with the same row (column) of costs behave alike on this edge.
        row_keys, row_ids = np.unique(m, axis=0, return_inverse=True)
        table, col_ids = np.unique(row_keys, axis=1, return_inverse=True)
        row_ids, col_ids = row_ids.reshape(-1), col_ids.reshape(-1)
        na, nb = table.shape
        base = n + len(w_costs)
        w_costs.extend(table.reshape(-1).tolist())
        for a in range(na):
            entries = [(base + a * nb + b, 1.0) for b in range(nb)]
            entries += [(offset[ou] + k, -1.0) for k in np.flatnonzero(row_ids == a)]
            add_row(entries, 0.0, 0.0)
        for b in range(nb):
            entries = [(base + a * nb + b, 1.0) for a in range(na)]
            entries += [(offset[ov] + k, -1.0) for k in np.flatnonzero(col_ids == b)]
            add_row(entries, 0.0, 0.0)
    for coeffs, bound in extra_rows or []:
        entries = []
        for r, vec in coeffs.items():
            o = owner[r]
            entries += [(offset[o] + k, float(x)) for k, x in enumerate(vec) if x]
        add_row(entries, -np.inf, bound)
    total = n + len(w_costs)
    cost = np.concatenate([c, np.asarray(w_costs)])
    # Costs are seconds, often nanoseconds: rescale so the solver's absolute tolerances do not
    # swallow them (the largest coefficient becomes 1e4).
    top = float(np.max(np.abs(cost))) if cost.size else 0.0
    if top > 0:
        cost = cost * (1e4 / top)
    lb = np.zeros(total)
    ub = np.ones(total)
    for r, k in problem.forced.items():
        o = owner[r]
        ub[offset[o]:offset[o] + len(problem.cands[o])] = 0.0
        lb[offset[o] + k] = ub[offset[o] + k] = 1.0
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
        o = owner[r]
        choice[r] = int(np.argmax(x[offset[o]:offset[o] + len(problem.cands[o])]))
    gap = float(getattr(res, "mip_gap", 0.0) or 0.0)
    return IlpResult(choice, problem.objective(choice), res.status == 0, gap, total, len(lo))
