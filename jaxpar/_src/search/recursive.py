"""``search_mode="recursive_programming"``: D-Rec/SAPP generalised to meshes of several axes.

MindSpore's D-Rec bisects the devices ``log2(P)`` times; each round orders the operators by
weight and lets each cut one dimension (or none) by its own cost plus the cost of differing from
the neighbours already decided in that round.  Here a round is one mesh axis (outermost, slowest
links first), and "cutting a dimension" is giving that axis to one of the operator's factors
(or to none), which keeps the candidates that agree:

* weight: an operator's FLOPs (contractions first; cheap operators last, so they follow);
* own cost of an option: the cheapest candidate left in it, plus D-Rec's symbolic price of the
  cut for contractions: an operand the cut does not split must be whole on every device of the
  axis (a weight's gradient is all-reduced, an activation gathered), priced as moving it;
* redistribution: for each neighbour decided in this round, the cheapest pair of candidates.

After the last axis each operator holds one strategy (up to axis order, settled by cost); a
sweep of best responses against the neighbours' final choices then fixes what the greedy
rounds could not see.  The rounds run twice, in weight order and in graph order (MindSpore's
``TopologyOrder`` option, which lets each layer see the one before it); the cheaper plan under
the cost model wins.  Linear in the number of operators per axis.

References: Wang et al., "Efficient and Systematic Partitioning of Large and Deep Neural
Networks for Parallelization", Euro-Par 2021; MindSpore ``rec_core/rec_partition.cc``.
"""

from __future__ import annotations

import collections

import numpy as np

from jaxpar._src.graph import Const
from jaxpar._src.search.problem import Problem

CONTRACTIONS = ("dot_general", "conv_general_dilated")


def solve_recursive(problem: Problem, *, sweeps: int = 3) -> dict[int, int]:
    """Rounds in weight order and, as MindSpore's ``TopologyOrder`` option, in graph order;
    the cheaper plan under the cost model is kept."""
    space = problem.space
    graph = space.graph
    adjacency = problem.neighbours()
    implied = {r: _implied_cost(problem, r) for r in problem.reps}
    weight = {r: max(space.rule(r).flops * graph.nodes[r].weight, 0.0)
              if graph.nodes[r].kind == "op" else 0.0 for r in problem.reps}
    light = {r for r in problem.reps if weight[r] == 0.0 or graph.nodes[r].name not in
             CONTRACTIONS}
    best, best_cost = None, None
    for order in (sorted(problem.reps, key=lambda r: (-weight[r], r)), list(problem.reps)):
        choice = improve(problem, _rounds(problem, order, adjacency, implied, light),
                         sweeps=sweeps)
        cost = problem.objective(choice)
        if best_cost is None or cost < best_cost:
            best, best_cost = choice, cost
    return best


def _rounds(problem: Problem, order: list[int], adjacency: dict[int, set[int]],
            implied: dict[int, np.ndarray], light: set[int]) -> dict[int, int]:
    """One round per mesh axis in ``order``; returns a full choice.

    A light operator (no contraction) whose neighbours are all undecided waits, once, until
    the end of the round: with nothing to follow yet, it would only guess.
    """
    alive = {r: np.arange(len(problem.cands[r])) for r in problem.reps}
    for axis in problem.space.model.mesh.names:
        decided: set[int] = set()
        queue = collections.deque(order)
        waited: set[int] = set()
        while queue:
            r = queue.popleft()
            if r in light and r not in waited and not (adjacency[r] & decided):
                waited.add(r)
                queue.append(r)
                continue
            options = _split_by_axis(problem, r, alive[r], axis)
            best_cls, best_score = None, None
            for cls in options:
                own = float(np.min(problem.cost[r][cls] + implied[r][cls]))
                redist = 0.0
                for u in adjacency[r]:
                    if u in decided:
                        redist += float(_edge(problem, r, u)[np.ix_(cls, alive[u])].min())
                score = own + redist
                if best_score is None or _better(score, best_score):
                    best_cls, best_score = cls, score
            alive[r] = best_cls
            decided.add(r)
    choice = {}
    for r in order:  # settle axis order (and ties) by cost against what is chosen so far
        cls = alive[r]
        total = problem.cost[r][cls].copy()
        for u in adjacency[r]:
            if u in choice:
                total += _edge(problem, r, u)[cls, choice[u]]
        choice[r] = int(cls[int(np.argmin(total))])
    return choice


def improve(problem: Problem, choice: dict[int, int], *, sweeps: int = 3) -> dict[int, int]:
    """Local search: each node, then each pair of neighbours, takes its cheapest candidates
    given the rest, until nothing improves (or ``sweeps`` rounds)."""
    adjacency = problem.neighbours()
    choice = dict(choice)

    def context(r: int, skip: int = -1) -> np.ndarray:
        total = problem.cost[r].copy()
        for u in adjacency[r]:
            if u != skip:
                total += _edge(problem, r, u)[:, choice[u]]
        return total

    for _ in range(sweeps):
        changed = False
        for r in problem.reps:
            if r in problem.forced:
                continue
            total = context(r)
            best = int(np.argmin(total))
            if _better(total[best], total[choice[r]]):
                choice[r] = best
                changed = True
        for u, v in problem.edges:
            if u in problem.forced and v in problem.forced:
                continue
            joint = context(u, v)[:, None] + context(v, u)[None, :] + problem.edges[(u, v)]
            if u in problem.forced:
                joint[np.arange(len(joint)) != choice[u], :] = np.inf
            if v in problem.forced:
                joint[:, np.arange(joint.shape[1]) != choice[v]] = np.inf
            ku, kv = np.unravel_index(int(np.argmin(joint)), joint.shape)
            if _better(joint[ku, kv], joint[choice[u], choice[v]]):
                choice[u], choice[v] = int(ku), int(kv)
                changed = True
        if not changed:
            break
    return choice


def _better(a: float, b: float) -> bool:
    """``a`` is smaller than ``b`` beyond rounding (relative 1e-12)."""
    return a < b - 1e-12 * abs(b)


def _edge(problem: Problem, r: int, u: int) -> np.ndarray:
    """Edge costs with ``r``'s candidates as rows."""
    return problem.edges[(r, u)] if r < u else problem.edges[(u, r)].T


def _split_by_axis(problem: Problem, r: int, alive: np.ndarray, axis: str) -> list[np.ndarray]:
    """The candidates of ``r`` still alive, grouped by the factor that takes ``axis``."""
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for k in alive:
        cand = problem.cands[r][int(k)]
        where = next((f for f, axes in enumerate(cand.factor_axes) if axis in axes), -1)
        groups[where].append(int(k))
    return [np.asarray(v, dtype=np.int64) for _, v in sorted(groups.items())]


def _implied_cost(problem: Problem, r: int) -> np.ndarray:
    """D-Rec's symbolic price of a contraction's cut: operands left whole along a split axis
    must be moved whole (a weight's gradient all-reduced, an activation gathered)."""
    space = problem.space
    graph = space.graph
    node = graph.nodes[r]
    out = np.zeros(len(problem.cands[r]))
    if node.kind != "op" or node.name not in CONTRACTIONS:
        return out
    model = space.model
    for k, cand in enumerate(problem.cands[r]):
        used = [a for axes in cand.factor_axes for a in axes]
        for operand, spec in zip(node.inputs, cand.in_specs, strict=True):
            if isinstance(operand, Const):
                continue
            missing = [a for a in used if a not in spec.axes]
            if not missing:
                continue
            value = graph.values[operand]
            whole = value.nbytes * spec.shard_fraction(model.mesh)  # what each device needs
            out[k] += node.weight * model.collective("all-gather", whole, missing).time
    return out
