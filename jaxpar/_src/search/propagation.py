"""Sharding propagation (MindSpore ``search_mode="sharding_propagation"``).

Outward from every fixed node, in both directions along the edges.  As in MindSpore, an operator
with several inputs waits until its inputs are decided: the next node decided is one whose
producers are all decided (dataflow order), else one whose consumers all are, else the node
discovered first (producers that no pin reaches, such as a broadcast literal or an unpinned
argument, are not waited for: they follow their consumers).  Each node takes, among its
candidate strategies that split over no mesh axis its decided neighbours do not use (follow,
never invent: such a split shrinks the node's own all-reduce only to leave gathers after it),
the one that is cheapest against all of its neighbours decided so far, compared in this order:

1. the communication time of the layout changes on those edges plus the node's own (its
   partial sums to combine): zero first.  MindSpore compares the edges alone and the node's own
   communication only to break ties; then a matmul whose weight is split on the contraction
   dimension (FSDP's layout) takes the contraction split and all-reduces whole activations,
   where XLA's own propagation all-gathers the weight (issue 11: 2.5x the bytes, 2x the
   memory on a GPT train step);
2. the number of edges whose layouts still differ (an exact match beats a free local slice),
   among the candidates whose communication is within 5% of the least (``NEAR``);
3. the node's own communication (partial sums to combine), again;
4. the number of mesh axes it uses (follow the neighbours; never invent new splits);
5. its per-device FLOPs, then the candidate order (deterministic).

Fixed nodes are never changed.  Where two propagation fronts meet with different layouts, the
edge keeps a layout change, which the plan reports with its cost.  Nodes no front reaches stay
replicated.

References: MindSpore ``graph_costmodel.cc`` (``StrategyPropagate``, ``BFS``, the waiting list
of multi-input operators) and ``edge_costmodel.cc``
(``GetNextOpSwcByPrevOpStrategyWithMiniComm``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from jaxpar._src.errors import PlanError
from jaxpar._src.graph import Edge, NodeKind, OpGraph, Role
from jaxpar._src.rules import OpStrategy, strategy_for_specs
from jaxpar._src.search.common import Assignment, Pin, SearchSpace
from jaxpar._src.spec import Spec

NEAR = 0.05  # communication within 5% of the least counts as tied (criterion 2 then decides)


def propagate(space: SearchSpace, pins: Sequence[Pin], *,
              ties: Sequence[tuple[int, int]] = (), where: str = "jaxpar") -> Assignment:
    """Runs sharding propagation from ``pins``; raises :class:`PlanError` without any pin.

    ``ties`` pairs nodes that must share one layout (a state argument and the result that
    returns it): once one side is decided, the other takes its layout.
    """
    graph = space.graph
    if not pins:
        raise PlanError(
            f"{where}: sharding propagation needs at least one fixed strategy, and none was "
            f"given. Fix the layout of some tensors: in_strategy=/out_strategy= on "
            f"jaxpar.parallelize, a jaxpar.shard(...) around a sub-computation, or "
            f"jax.lax.with_sharding_constraint inside the function.")
    strategies: dict[int, OpStrategy] = {}
    origins: dict[int, str] = {}
    for pin in pins:
        strategies[pin.node] = pin.strategy
        origins[pin.node] = pin.origin
    producers, consumers = _dataflow(graph)
    anchored = _anchored(list(strategies), consumers)
    producers = {n: ps & anchored for n, ps in producers.items()}
    discovered: dict[int, int] = {}
    counter = itertools.count()
    heap: list[tuple[int, int, int]] = []

    decided = strategies.keys()  # (a set view: a subset test runs in C)
    around = space.neighbours

    def readiness(v: int) -> int:
        if producers[v] <= decided:
            return 0
        if consumers[v] <= decided:
            return 1
        return 2

    push = heapq.heappush

    def discover(u: int) -> None:
        for v, _ in around(u):
            if v in strategies:
                continue
            order = discovered.get(v)
            if order is None:
                order = discovered[v] = next(counter)
            # (readiness, inline: once per edge of every node decided)
            if producers[v] <= decided:
                push(heap, (0, order, v))
            else:
                push(heap, (1 if consumers[v] <= decided else 2, order, v))

    partner: dict[int, int] = {}
    for a, b in ties:
        partner[a], partner[b] = b, a

    def decide(v: int, strategy: OpStrategy, origin: str) -> None:
        strategies[v] = strategy
        origins[v] = origin
        discover(v)
        other = partner.get(v)
        if other is not None and other not in strategies:
            tied = _tied_strategy(space, other, strategy)
            if tied is not None:
                decide(other, tied, "state")

    for u in sorted(strategies):
        discover(u)
        other = partner.get(u)
        if other is not None and other not in strategies:
            tied = _tied_strategy(space, other, strategies[u])
            if tied is not None:
                decide(other, tied, "state")
    answers: dict[tuple, OpStrategy] = {}  # repeated layers ask the same questions
    while heap:
        cls, _, v = heapq.heappop(heap)
        if v in strategies or cls != readiness(v):
            continue  # decided already, or a fresher entry with a better class is queued
        decide(v, best_response(space, v, strategies, answers), "propagated")
    for node in graph.searchable():
        if node.id not in strategies:
            strategies[node.id] = space.candidates(node.id)[0]
            origins[node.id] = "unreached"
    return Assignment(strategies, origins)


def _tied_strategy(space: SearchSpace, node: int, strategy: OpStrategy) -> OpStrategy | None:
    """The strategy giving ``node`` (an input or output) the layout of its partner."""
    spec = (strategy.out_specs or strategy.in_specs)[0]
    side = "out" if space.graph.nodes[node].kind in (NodeKind.INPUT, NodeKind.CONST) else "in"
    return strategy_for_specs(space.rule(node), {(side, 0): spec}, space.model.mesh)


def _dataflow(graph: OpGraph) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """Producers and consumers per node, leaving out loop back edges and control nodes."""
    producers: dict[int, set[int]] = {n.id: set() for n in graph.nodes}
    consumers: dict[int, set[int]] = {n.id: set() for n in graph.nodes}
    carries = {n.id for n in graph.nodes if n.role is Role.CARRY}  # (few: found once)
    for producer, _, consumer, in_index in graph.priced_edges():
        if in_index == 1 and consumer in carries:
            continue  # the back edge: deciding the carry must not wait for the loop body
        producers[consumer].add(producer)
        consumers[producer].add(consumer)
    return producers, consumers


def _anchored(pinned: Sequence[int], consumers: dict[int, set[int]]) -> set[int]:
    """Nodes downstream of a pin.  Others (a broadcast literal, an unpinned argument) have no
    layout of their own to wait for: they follow their consumers."""
    seen = set(pinned)
    work = list(pinned)
    while work:
        for c in consumers[work.pop()]:
            if c not in seen:
                seen.add(c)
                work.append(c)
    return seen


def best_response(space: SearchSpace, v: int, decided: dict[int, OpStrategy],
                  answers: dict[tuple, OpStrategy] | None = None) -> OpStrategy:
    """The candidate of ``v`` that fits its decided neighbours best (module docstring order).

    ``answers`` remembers the answers by what they depend on (:func:`_question`): the nodes of
    repeated layers ask the same question of alike neighbours (issue 14: the baseline
    propagation of a deep model answered it once per operator)."""
    edges: list[tuple[Edge, OpStrategy]] = []  # to decided neighbours, with their strategy
    get = decided.get
    for other, e in space.neighbours(v):
        strategy = get(other)
        if strategy is not None:
            edges.append((e, strategy))
    if answers is None:
        return _best_response(space, v, edges)
    question = _question(space, v, edges)
    found = answers.get(question)
    if found is None:
        found = answers[question] = _best_response(space, v, edges)
    return found


def _question(space: SearchSpace, v: int, edges: list[tuple[Edge, OpStrategy]]) -> tuple:
    """All that :func:`_best_response` reads of ``v`` and its decided neighbours: the node's
    kind (``SearchSpace.kind``: its rule, so its candidates, and the shapes and dtypes of its
    operands and results, so with its loop weight and gradient bucket its own price, as
    ``SearchSpace.op_cost`` keys it, and what a layout change on each of its edges moves),
    and per edge, in order, its ports, the neighbour's strategy and the edge's weight.

    (The kind stands for the shapes and dtypes, which the question once spelled out per node
    and per edge: issue 14.)"""
    weight = space.edge_weight
    ports = tuple([(producer == v, out_index, in_index, other, weight(producer, consumer))
                   for (producer, out_index, consumer, in_index), other in edges])
    return space.kind(v), space.graph.nodes[v].weight, space.bucket_of(v), ports


def _best_response(space: SearchSpace, v: int, edges: list[tuple[Edge, OpStrategy]]
                   ) -> OpStrategy:
    # Fast path: the candidate that matches every decided neighbour exactly and splits nothing
    # else, if it needs no communication of its own, wins on every criterion.
    wanted: dict[tuple[str, int], Spec] = {}
    for e, other in edges:
        port, spec = (("out", e.out_index), other.in_specs[e.in_index]) if e.producer == v \
            else (("in", e.in_index), other.out_specs[e.out_index])
        if wanted.setdefault(port, spec) != spec:
            break
    else:
        exact = strategy_for_specs(space.rule(v), wanted, space.model.mesh)
        if exact is not None and not exact.partial:
            return exact
    candidates = space.candidates(v)
    # Follow, never invent: a candidate splitting over a mesh axis none of its decided
    # neighbours uses would shrink its own all-reduce only to leave gathers behind it.
    seen = {a for e, other in edges for spec in (other.in_specs + other.out_specs)
            for a in spec.axes}
    if not any({a for spec in c.in_specs + c.out_specs for a in spec.axes} <= seen
               for c in candidates):
        seen = set(space.model.mesh.names)
    scored = []
    memo: dict[tuple[int, Spec], float] = {}  # candidates share port layouts: price each once
    for index, cand in enumerate(candidates):
        if not {a for spec in cand.in_specs + cand.out_specs for a in spec.axes} <= seen:
            continue
        comm, mismatches = 0.0, 0
        for k, (e, other) in enumerate(edges):
            if e.producer == v:
                mine = src = cand.out_specs[e.out_index]
                dst = other.in_specs[e.in_index]
            else:
                src, mine = other.out_specs[e.out_index], cand.in_specs[e.in_index]
                dst = mine
            if src != dst:
                mismatches += 1
                t = memo.get((k, mine))
                if t is None:
                    t = memo[(k, mine)] = space.edge_time(e.producer, e.out_index, src,
                                                          e.consumer, dst)
                comm += t
        if cand.partial:  # its own all-reduce of partial sums is paid on the same wire
            comm += space.op_cost(v, cand).comm_time
        scored.append((round(comm, 15), mismatches, index))
    # Communication within NEAR of the cheapest is a tie (a few bytes on a latency-bound
    # collective are the cost model's noise): there an exact match of the neighbours' layouts
    # wins, so a small reduction does not take a split of its own to shrink an all-reduce by
    # bytes and leave gathers behind it.
    least = min(comm for comm, _, _ in scored)
    near = [c for c in scored if c[0] <= least * (1 + NEAR)]
    fewest = min(mismatches for _, mismatches, _ in near)
    near = [c for c in near if c[1] == fewest]
    best_comm = min(comm for comm, _, _ in near)
    # Only candidates tied on the edges need their own costs (the expensive part).
    tied = [index for comm, _, index in near if comm == best_comm]
    if len(tied) == 1:
        return candidates[tied[0]]

    def own(index: int) -> tuple:
        cand = candidates[index]
        cost = space.op_cost(v, cand)
        return cost.comm_time, cand.axes_used, cost.flops, index

    return candidates[min(tied, key=own)]
