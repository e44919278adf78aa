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

After the last axis each operator holds one strategy (up to axis order, settled by cost).  A
local search (each node, then each pair of neighbours, taking its best choice given the rest)
and a refinement (the elimination DP over a few alternatives per node: the best given its
neighbours and the cheapest on its own), both in ``polish.py``, then fix what the greedy
rounds could not see.  The
rounds run in weight order and in graph order (MindSpore's ``TopologyOrder`` option, which
lets each layer see the one before it); the cheaper start under the cost model is refined.
Linear in the number of operators per axis, apart from the refinement's solve of the graph's
core (an integer program of bounded size).

References: Wang et al., "Efficient and Systematic Partitioning of Large and Deep Neural
Networks for Parallelization", Euro-Par 2021; MindSpore ``rec_core/rec_partition.cc``.
"""

from __future__ import annotations

import collections

import numpy as np

from jaxpar._src.graph import Const, NodeKind
from jaxpar._src.rules import OpCategory
from jaxpar._src.search.polish import better, edge_rows, improve, least, refine
from jaxpar._src.search.problem import Problem


def solve_recursive(problem: Problem, *, sweeps: int = 2) -> dict[int, int]:
    """D-Rec rounds in weight order and in graph order (MindSpore's ``TopologyOrder``); each
    start is polished by local search, the cheapest refined."""
    space = problem.space
    graph = space.graph
    adjacency = problem.neighbours()
    priced: dict[tuple, np.ndarray] = {}  # repeated layers price their cuts once
    implied = {r: _implied_total(problem, r, priced) for r in problem.reps}
    weight = {r: sum(space.rule(m).flops * graph.nodes[m].weight for m in problem.members_of(r))
              if graph.nodes[r].kind is NodeKind.OP else 0.0 for r in problem.reps}
    light = {r for r in problem.reps
             if weight[r] == 0.0 or space.rule(r).category is not OpCategory.CONTRACTION}
    best, best_cost = None, None
    orders = (sorted(problem.reps, key=lambda r: (-weight[r], r)), list(problem.reps))
    axes = tuple(space.model.mesh.names)
    takers: dict = {}  # per candidate list and axis, the factor each candidate gives it
    starts = [_rounds(problem, order, adjacency, implied, light, axes, takers)
              for order in orders]
    for start in starts:
        choice = improve(problem, start, sweeps=sweeps)
        cost = problem.objective(choice)
        if best_cost is None or cost < best_cost:
            best, best_cost = choice, cost
    return improve(problem, refine(problem, best), sweeps=sweeps)


def _rounds(problem: Problem, order: list[int], adjacency: dict[int, set[int]],
            implied: dict[int, np.ndarray], light: set[int], axes: tuple[str, ...],
            takers: dict | None = None) -> dict[int, int]:
    """One round per mesh axis in ``order``; returns a full choice.

    A light operator (no contraction) whose neighbours are all undecided waits, once, until
    the end of the round: with nothing to follow yet, it would only guess.
    """
    alive = {r: np.arange(len(problem.cands[r])) for r in problem.reps}
    takers = {} if takers is None else takers  # see :func:`_split_by_axis`
    for axis in axes:
        decided: set[int] = set()
        queue = collections.deque(order)
        waited: set[int] = set()
        while queue:
            r = queue.popleft()
            if r in light and r not in waited and not (adjacency[r] & decided):
                waited.add(r)
                queue.append(r)
                continue
            options = _split_by_axis(problem, r, alive[r], axis, takers)
            if len(options) == 1:  # nothing to choose, nothing to price
                alive[r] = options[0]
                decided.add(r)
                continue
            best_cls, best_score = None, None
            own_r = problem.cost[r] + implied[r]
            # each decided neighbour's cheapest pair per candidate of ``r``, once: the least of
            # an option's block is the least of its rows' (issue 14: a block per option was
            # cut out of the matrix)
            near = [np.minimum.reduce(edge_rows(problem, r, u)[:, alive[u]], axis=1)
                    for u in adjacency[r] if u in decided]
            for cls in options:
                own = float(least(own_r[cls]))
                redist = 0.0
                for row_least in near:
                    redist += float(least(row_least[cls]))
                score = own + redist
                if best_score is None or better(score, best_score):
                    best_cls, best_score = cls, score
            alive[r] = best_cls
            decided.add(r)
    choice = {}
    for r in order:  # settle axis order (and ties) by cost against what is chosen so far
        cls = alive[r]
        total = problem.cost[r][cls].copy()
        for u in adjacency[r]:
            if u in choice:
                total += edge_rows(problem, r, u)[cls, choice[u]]
        choice[r] = int(cls[int(total.argmin())])
    return choice


def _split_by_axis(problem: Problem, r: int, alive: np.ndarray, axis: str,
                   takers: dict | None = None) -> list[np.ndarray]:
    """The candidates of ``r`` still alive, grouped by the factor that takes ``axis`` (-1:
    none), groups in factor order.  ``takers`` remembers each candidate list's factors by
    the list's identity, and its groups when every candidate is alive (repeated layers share
    a few lists, and each start's first round splits every list whole: issue 14).

    >>> import dataclasses
    >>> from jaxpar._src.rules import OpStrategy
    >>> cands = tuple(OpStrategy(f, (), ()) for f in ((("x",), ()), ((), ("x",)), ((), ())))
    >>> p = Problem.from_tables({0: np.zeros(3)}, {})
    >>> p = dataclasses.replace(p, cands={0: cands})
    >>> [g.tolist() for g in _split_by_axis(p, 0, np.arange(3), "x")]
    [[2], [0], [1]]
    """
    cands = problem.cands[r]
    whole = len(alive) == len(cands)  # (then ``alive`` is every candidate, in order)
    key = (id(cands), axis)
    found = takers.get(key) if takers is not None else None
    if found is None or found[0] is not cands:
        where = np.array([next((f for f, axes in enumerate(c.factor_axes) if axis in axes), -1)
                          for c in cands], dtype=np.int64)
        found = [cands, where, None]
        if takers is not None:
            takers[key] = found
    elif whole and found[2] is not None:  # the first axis splits every list whole, once
        return found[2]
    taker = found[1][alive]
    # the factors in order, as np.unique lists them (a set of a few small numbers sorted is
    # cheaper than np.unique's sort, asked per operator and axis: issue 14)
    groups = [alive[taker == f] for f in sorted(set(taker.tolist()))]
    if whole:
        found[2] = groups
    return groups


def _implied_total(problem: Problem, r: int, cache: dict) -> np.ndarray:
    """:func:`_implied_cost` summed over the graph nodes ``r`` stands for, in their order.
    Only contractions have a cut to price: the others' zeros are not made and added (adding
    zeros changes no sum; issue 14: a quotient node of a deep model stands for many)."""
    space = problem.space
    total = None
    for m in problem.members_of(r):
        if space.rule(m).category is OpCategory.CONTRACTION:
            cut = _implied_cost(problem, r, m, cache)
            total = cut + 0.0 if total is None else total + cut
    return np.zeros(len(problem.cands[r])) if total is None else total


def _implied_cost(problem: Problem, r: int, member: int, cache: dict | None = None
                  ) -> np.ndarray:
    """D-Rec's symbolic price of a contraction's cut: operands left whole along a split axis
    must be moved whole (a weight's gradient all-reduced, an activation gathered).  ``member``
    is the graph node priced (``r`` itself, or one of the layers ``r`` stands for)."""
    space = problem.space
    graph = space.graph
    node = graph.nodes[member]
    if space.rule(member).category is not OpCategory.CONTRACTION:
        return np.zeros(len(problem.cands[r]))
    # the candidate list by identity (hashing it hashes every strategy: issue 14, 96 layers);
    # the lists outlive ``cache`` (the problem holds them), so their ids stay theirs
    key = (id(problem.cands[r]), node.weight, tuple(graph.operand_shape(o) for o in node.inputs),
           tuple(graph.operand_dtype(o) for o in node.inputs))
    if cache is not None and key in cache:
        return cache[key]
    out = np.zeros(len(problem.cands[r]))
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
    if cache is not None:
        cache[key] = out
    return out
