"""Polishing passes: improve a full choice of a coarse problem without starting over.

* :func:`improve`: local search; each node, then each pair of neighbours, takes its cheapest
  candidates given the rest;
* :func:`refine`: a large-neighbourhood step; every node keeps a few alternatives (its choice,
  its best given the neighbours, its cheapest alone) and the elimination DP solves that small
  problem, exactly when its final graph's integer program is small;
* :func:`polish`: both, repeated while the plan gets cheaper.

The recursive search ends with them; the elimination DP uses them after star eliminations (its
only approximate step); the exact search uses them for the plan it falls back on.
"""

from __future__ import annotations

import numpy as np

from jaxpar._src.search.elimination import solve_elimination
from jaxpar._src.search.problem import Problem

ROUNDS = 2  # refinements in a row at most: each takes about as long as the search before it;
# a third rarely gained anything on the benchmark programs


def polish(problem: Problem, choice: dict[int, int], *, rounds: int | None = None
           ) -> dict[int, int]:
    """:func:`improve` then :func:`refine`, again while the objective drops (at most
    ``rounds`` times, default :data:`ROUNDS`)."""
    choice = improve(problem, choice)
    for _ in range(ROUNDS if rounds is None else rounds):
        refined = improve(problem, refine(problem, choice))
        if not better(problem.objective(refined), problem.objective(choice)):
            break
        choice = refined
    return choice


def improve(problem: Problem, choice: dict[int, int], *, sweeps: int = 3) -> dict[int, int]:
    """Local search: each node, then each pair of neighbours, takes its cheapest candidates
    given the rest, until nothing improves (or ``sweeps`` rounds).

    A node (a pair) whose own choice and whose neighbours' choices are all as they were when
    it was last looked at is not looked at again: it would find what it found then (its
    sums are the same sums, in the same order), and after the first sweep most are (issue 14:
    the first call polishes every node of a deep model's problem).

    >>> p = Problem.from_tables({0: np.array([0.0, 1.0]), 1: np.array([0.5, 0.0])},
    ...                         {(0, 1): np.array([[0.0, 2.0], [2.0, 0.0]])})
    >>> improve(p, {0: 1, 1: 1})
    {0: 0, 1: 0}
    """
    adjacency = problem.neighbours()
    choice = dict(choice)
    # Each node's edge matrices with its candidates as rows, in the order the sums run.
    rows = {r: [(u, edge_rows(problem, r, u)) for u in adjacency[r]] for r in problem.reps}
    # ``near[r]``: when a choice of ``r`` or of a neighbour last changed (a node's sums read
    # exactly those); ``looked``: when each node or pair was last looked at.
    near = dict.fromkeys(problem.reps, -1)
    looked: dict = {}
    clock = 0
    lowest: dict = {}  # each edge matrix's least entry

    def changed_at(*nodes: int) -> None:
        for x in nodes:
            near[x] = clock
            for y in adjacency[x]:
                near[y] = clock

    def context(r: int, skip: int = -1) -> np.ndarray:
        total = problem.cost[r].copy()
        for u, m in rows[r]:
            if u != skip:
                total += m[:, choice[u]]
        return total

    for _ in range(sweeps):
        changed = False
        for r in problem.reps:
            if r in problem.forced:
                continue
            if looked.get(r, -2) >= near[r]:
                continue
            total = context(r)
            best = int(total.argmin())
            if better(total[best], total[choice[r]]):
                choice[r] = best
                clock += 1
                changed_at(r)
                changed = True
            looked[r] = clock
        for u, v in problem.edges:
            if u in problem.forced and v in problem.forced:
                continue
            if looked.get((u, v), -2) >= max(near[u], near[v]):
                continue
            mine, theirs, edge = context(u, v), context(v, u), problem.edges[(u, v)]
            # No pair can be better than the least of each part (the sums below are
            # rounded alike, and rounding keeps order): then the pair table, most of a
            # sweep's time, is not built (issue 14: the first sweep looks at every edge).
            low = lowest.get((u, v))
            if low is None:
                low = lowest[(u, v)] = least(edge)
            if not better(least(mine) + least(theirs) + low,
                          mine[choice[u]] + theirs[choice[v]] + edge[choice[u], choice[v]]):
                looked[(u, v)] = clock
                continue
            joint = mine[:, None] + theirs[None, :] + edge
            if u in problem.forced:
                joint[np.arange(len(joint)) != choice[u], :] = np.inf
            if v in problem.forced:
                joint[:, np.arange(joint.shape[1]) != choice[v]] = np.inf
            ku, kv = divmod(int(joint.argmin()), joint.shape[1])
            if better(joint[ku, kv], joint[choice[u], choice[v]]):
                choice[u], choice[v] = int(ku), int(kv)
                clock += 1
                changed_at(u, v)
                changed = True
            looked[(u, v)] = clock
        if not changed:
            break
    return choice


def refine(problem: Problem, choice: dict[int, int], keep: int = 8) -> dict[int, int]:
    """Re-solves over a few alternatives per operator with the elimination DP: its current
    choice, its ``keep`` best given the neighbours' current choices, and its ``keep`` cheapest
    on its own.  The rounds decide what is worth considering, the DP how it fits together."""
    adjacency = problem.neighbours()
    kept: dict[int, np.ndarray] = {}
    for r in problem.reps:
        local = problem.cost[r].copy()
        for u in adjacency[r]:
            local += edge_rows(problem, r, u)[:, choice[u]]
        ranked = [int(k) for k in np.argsort(local, kind="stable")[:keep]]
        ranked += [int(k) for k in np.argsort(problem.cost[r], kind="stable")[:keep]]
        # In candidate order: a node keeping all its candidates then keeps them as they were,
        # and when every node does, the sub-problem is the problem itself, whose elimination's
        # final graph was solved before (elimination.py remembers it).
        kept[r] = np.unique([choice[r]] + ranked).astype(np.int64)
    whole = all(len(kept[r]) == len(problem.cands[r]) for r in problem.reps)
    picked, _ = solve_elimination(problem if whole else problem.restricted(kept))
    refined = {r: int(kept[r][picked[r]]) for r in problem.reps}
    return refined if problem.objective(refined) < problem.objective(choice) else choice


def better(a: float, b: float) -> bool:
    """``a`` is smaller than ``b`` beyond rounding (relative 1e-12)."""
    return a < b - 1e-12 * abs(b)


def least(a: np.ndarray) -> float:
    """``a.min()``, the same element, at a third of its cost on the small arrays the searches
    compare: NumPy's ``min`` runs Python of its own per call, ``argmin`` does not (issue 14:
    the first call's searches ask it tens of thousands of times).  A NaN is the least, as
    ``min`` has it.

    >>> float(least(np.array([[3.0, 1.0], [2.0, 1.0]])))
    1.0
    """
    return a.flat[a.argmin()]


def edge_rows(problem: Problem, r: int, u: int) -> np.ndarray:
    """Edge costs with ``r``'s candidates as rows."""
    return problem.edges[(r, u)] if r < u else problem.edges[(u, r)].T
