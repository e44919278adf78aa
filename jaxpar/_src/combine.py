"""What XLA runs: a plan's collectives after XLA's combiners, and the step time they make.

The cost model prices each operator and each layout change on its own, but XLA does not run
those collectives one by one: after SPMD partitioning, its combiner passes merge independent
collectives into one, and on GPUs its scheduler runs collectives beside compute.  This module
prices a whole plan the way XLA will run it.

1. **Raw collectives.**  Every operator's partial-sum all-reduces and every layout change on an
   edge (one per value and target layout: XLA's CSE merges identical ones; at ZeRO level 3 a
   split parameter's backward readers get one of their own, made after an optimization barrier
   so CSE cannot merge it: :mod:`jaxpar._src.regather`), in the order of XLA's instruction
   post order (a depth-first walk from the program's results, operands in order), with the
   collectives each depends on (through the dataflow, and a second gather's barrier).
2. **Combining.**  XLA's ``AllReduceCombiner``, ``AllGatherCombiner`` and
   ``ReduceScatterCombiner`` (``collective_combiner_utils.h``: ``CombineInstructionsByKey``)
   walk the post order: the first collective left opens a group; later ones with the same key
   (kind, reduction, element type, replica groups = mesh axes, and here the loop body) join it
   until one depends on a member, the group would pass the byte threshold, or it holds 256
   (``HardwareProfile.combine_threshold_*``).  XLA:CPU only combines all-reduces, without a
   size limit; XLA:GPU combines the three kinds up to 30 MiB each.  A combined collective pays
   its latency once.  A train step's gradient all-reduces are independent of one another and
   become one (or one per 30 MiB); the all-reduces between the layers of a Megatron plan depend
   on one another and stay apart.
3. **Time.**  Without overlap (``HardwareProfile.overlap_collectives=False``, XLA:CPU) the step
   is every device's compute plus every collective.  With overlap (XLA:GPU's asynchronous
   collectives and latency-hiding scheduler) a list schedule on two streams, compute and
   network, each in order: an operator waits for its operands, a collective for its operands
   and the network; a collective whose result nothing waits for soon (a gradient reduction in
   the backward pass) hides behind compute, one on the critical path (an activation all-reduce
   between layers) does not.

**How the searches see it.**  The searches solve a problem of per-node and per-edge costs, and
combining and overlap are properties of whole plans.  The searches therefore see a local
approximation, and whole plans are then re-priced exactly:

* an operator whose results reach no contraction (:func:`deferred_nodes`: gradients and the
  optimizer update, the loss) is *deferred*: its all-reduces are independent of the others of
  its kind and XLA combines them.  Each pays its bytes' share of one combined all-reduce, as
  large as pure data parallel's gradient all-reduces are once combined (measured on that plan
  by ``SearchSpace.calibrate``, or estimated by :func:`deferred_bucket`), so that data
  parallel is priced in the search as it is whole;
* every other collective (activations between layers, layout changes) is on the critical path
  and pays its full latency;
* the plan a search returns, and pure data parallel, are then priced by :func:`price_plan`; the
  cheaper is used (``auto.py``), and ``ShardingPlan`` reports the combined collectives, whose
  count is what the compiled program has.

>>> from jaxpar._src.hardware import HardwareProfile
>>> HardwareProfile().combine_threshold("all-gather"), HardwareProfile("h100").overlap_collectives
(0.0, True)
"""

from __future__ import annotations

import dataclasses
import heapq
import weakref
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from jaxpar._src.cost import Collective, CostModel
from jaxpar._src.graph import Const, OpGraph
from jaxpar._src.rules import OpStrategy
from jaxpar._src.spec import Spec

if TYPE_CHECKING:  # scatter.py and regather.py read plans, which hold what this module prices
    from jaxpar._src.regather import Regather
    from jaxpar._src.scatter import Scatter


@dataclasses.dataclass(frozen=True)
class RawCollective:
    """One collective the partitioned program has before XLA's combiners run."""

    collective: Collective
    node: int  # the operator it belongs to (its own all-reduce) or the first consumer it feeds
    after: int  # the node whose result it needs
    value: int | None  # the value whose layout it changes; None for an operator's all-reduce
    readers: tuple[int, ...]  # a layout change: every consumer reading the value through it
    weight: float  # executions per call (loop trips)
    region: int | None  # the loop body it runs in
    deferred: bool  # off the critical path (a gradient on its way to the optimizer)
    # nodes whose results it waits for besides ``after``: a level-3 second gather's barrier
    # ties it to its first backward reader's other operands (regather.py)
    waits: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class IssuedCollective:
    """One collective of the program after combining: ``members`` index the raw ones."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float  # payload per device, the members' together
    wire_bytes: float  # bytes one device sends per execution
    time: float  # seconds per execution: one latency, the members' bytes
    count: float  # executions per call
    members: tuple[int, ...]
    deferred: bool  # every member is deferred


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """A whole plan priced as XLA runs it."""

    raw: tuple[RawCollective, ...]
    collectives: tuple[IssuedCollective, ...]
    compute_s: float  # every device's compute, per call
    communication_s: float  # every collective, per call
    step_s: float  # simulated seconds per call (compute plus exposed communication)

    @property
    def exposed_s(self) -> float:
        """Communication seconds not hidden behind compute."""
        return self.step_s - self.compute_s


def deferred_nodes(graph: OpGraph, contractions: frozenset[int]) -> frozenset[int]:
    """Operators whose results reach no contraction (``contractions``: the nodes whose rule is
    an ``OpCategory.CONTRACTION``, the work worth splitting, so a collective feeding one is on
    the critical path): gradients, the optimizer's update, the loss.  Their all-reduces are
    independent of one another (XLA combines them) and nothing heavy waits for them."""
    reaches = np.zeros(len(graph.nodes), dtype=bool)
    for node in reversed(graph.nodes):
        hit = False
        for vid in node.outputs:
            for consumer, _ in graph.consumers[vid]:
                if consumer <= node.id:  # a loop's back edge
                    continue
                if reaches[consumer] or consumer in contractions:
                    hit = True
                    break
            if hit:
                break
        reaches[node.id] = hit
    return frozenset(n.id for n in graph.nodes if n.kind == "op" and not reaches[n.id])


def sibling_buckets(graph: OpGraph, contractions: frozenset[int]) -> dict[int, float]:
    """Contractions whose results only meet in a sum (the ``add_any`` of the input gradients
    of a value read by several contractions: the query, key and value projections): split the
    same way, their all-reduces are independent and adjacent, and XLA combines them.  Per such
    contraction, the bytes of its siblings' results together."""

    def only_reader(nid: int) -> int | None:
        node = graph.nodes[nid]
        if len(node.outputs) != 1:
            return None
        readers = {c for c, _ in graph.consumers[node.outputs[0]]}
        if len(readers) != 1:
            return None
        (reader,) = readers
        return reader if graph.nodes[reader].name in _SUMS else None

    root: dict[int, int] = {}

    def tree_root(nid: int) -> int:  # climb a tree of sums whose partial sums go nowhere else
        path = []
        while nid not in root:
            path.append(nid)
            up = only_reader(nid)
            if up is None:
                break
            nid = up
        top = root.get(nid, nid)
        for n in path:
            root[n] = top
        return top

    groups: dict[int, list[int]] = {}
    for node in graph.nodes:
        if node.id in contractions:
            up = only_reader(node.id)
            if up is not None:
                groups.setdefault(tree_root(up), []).append(node.id)
    out: dict[int, float] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        total = float(sum(graph.values[graph.nodes[n].outputs[0]].nbytes for n in group))
        for n in group:
            out[n] = total
    return out


_SUMS = frozenset({"add_any", "add"})


def deferred_bucket(graph: OpGraph, model: CostModel, deferred: frozenset[int],
                    contractions: frozenset[int]) -> float:
    """Bytes of the combined all-reduce a deferred all-reduce travels in, before a data-parallel
    plan tells (``SearchSpace.calibrate``): every deferred result that may all-reduce, up to
    XLA's threshold; 0 where XLA does not combine all-reduces."""
    threshold = model.hw.combine_threshold("all-reduce")
    if threshold <= 0:
        return 0.0
    total = sum(graph.values[v].nbytes for n in deferred
                if n in contractions or graph.nodes[n].name.startswith("reduce_")
                for v in graph.nodes[n].outputs)
    return float(min(total, threshold))


def raw_collectives(graph: OpGraph, strategies: Mapping[int, OpStrategy], model: CostModel,
                    deferred: frozenset[int], edge_weight,
                    scatters: Mapping[int, Scatter] | None = None,
                    regather: Regather | None = None) -> list[RawCollective]:
    """Every collective of the plan before combining, in no particular order.  ``scatters``
    (ZeRO levels 1-3, ``scatter.py``): contractions lowered by reduce-scatter, whose
    ``strategies`` hold the layouts as lowered (the result split from the contraction on);
    ``regather`` (ZeRO level 3, ``regather.py``): the split parameters whose backward readers
    share a layout change of their own, apart from the forward readers'."""
    scatters = scatters or {}
    out: list[RawCollective] = []
    # (value, target layout, a level-3 second gather) -> readers, as the lowering keys them
    changes: dict[tuple[int, Spec, bool], list[int]] = {}
    # layout_changes of every node, in node and input order, over the edges at once
    for nid, i, operand, producer, index in _read_edges(graph):
        dst = strategies[nid].in_specs[i]
        src = strategies[producer].out_specs[index]
        if src is not dst and src != dst:  # (most are the same object)
            again = regather is not None and regather.applies(nid, operand)
            changes.setdefault((operand, dst, again), []).append(nid)
    for node in graph.searchable():
        strat = strategies[node.id]
        scatter = scatters.get(node.id)
        own: tuple[Collective, ...]
        if scatter is not None and scatter.partial:  # a term of a sum, added locally
            own = ()
        elif scatter is not None:
            value = graph.values[node.outputs[0]]
            own = model.scatter_collectives(scatter.axes, scatter.summed, strat.out_specs[0],
                                            value.shape, value.dtype)
        elif not strat.partial:  # no partial sums, no all-reduces (most operators: issue 14)
            continue
        else:
            own = model.op_collectives(strat, [graph.values[v].shape for v in node.outputs],
                                       [graph.values[v].dtype for v in node.outputs])
        for c in own:
            out.append(RawCollective(c, node.id, node.id, None, (), node.weight, node.region,
                                     node.id in deferred))
    for (vid, dst, again), readers in changes.items():
        value = graph.values[vid]
        producer, first = value.producer, readers[0]
        src = strategies[producer].out_specs[value.index]
        w = max(edge_weight(producer, r) for r in readers)
        region = graph.nodes[first].region if graph.nodes[first].weight <= \
            graph.nodes[producer].weight else graph.nodes[producer].region
        waits = tuple(dict.fromkeys(graph.values[o].producer for o in regather.ties(
            graph, first, vid))) if again and regather is not None else ()
        for c in model.redistribution(src, dst, value.shape, value.dtype):
            out.append(RawCollective(c, first, producer, vid, tuple(readers), w, region,
                                     False, waits))
    return out


def layout_changes(graph: OpGraph, strategies: Mapping[int, OpStrategy], nid: int
                   ) -> list[tuple[int, int, Spec, Spec]]:
    """``(input index, value id, source layout, target layout)`` of every input of node ``nid``
    whose producer's layout differs from the one the node reads it in (constants and a loop's
    edge to itself left out)."""
    out = []
    reads = strategies[nid].in_specs
    for i, operand in enumerate(graph.nodes[nid].inputs):
        if isinstance(operand, Const):
            continue
        value = graph.values[operand]
        src = strategies[value.producer].out_specs[value.index]
        if src is not reads[i] and src != reads[i] and value.producer != nid:  # (most: same)
            out.append((i, operand, src, reads[i]))
    return out


def _read_edges(graph: OpGraph) -> tuple[tuple[int, int, int, int, int], ...]:
    """``(reader, input index, value, producer, output index)`` of every value an operator or
    output reads (constants, control nodes and a loop's edge to itself left out), by reader
    and input: where :func:`layout_changes` looks, found once per graph (a search prices
    several plans of one graph: issue 14)."""
    found = _READ_EDGES.get(graph)
    if found is None:
        nodes = graph.nodes
        found = _READ_EDGES[graph] = tuple(
            (e.consumer, e.in_index, nodes[e.producer].outputs[e.out_index], e.producer,
             e.out_index) for e in graph.edges()
            if e.producer != e.consumer and nodes[e.consumer].kind != "control")
    return found


_READ_EDGES: weakref.WeakKeyDictionary[OpGraph, tuple[tuple[int, int, int, int, int], ...]] \
    = weakref.WeakKeyDictionary()


def _post_order(graph: OpGraph) -> tuple[np.ndarray, dict[tuple[int, int], int]]:
    """Positions in a depth-first post order from the results, operands in order, as XLA's
    ``MakeInstructionPostOrder`` visits the partitioned program: per node, and per
    ``(value, consumer)`` edge (where a layout change of that operand sits).  Found once per
    graph (they depend on nothing else): a search prices several plans of one graph."""
    found = _POST_ORDERS.get(graph)
    if found is None:
        found = _POST_ORDERS[graph] = _find_post_order(graph)
    return found


_POST_ORDERS: weakref.WeakKeyDictionary[OpGraph, tuple[np.ndarray, dict[tuple[int, int], int]]] \
    = weakref.WeakKeyDictionary()


def _find_post_order(graph: OpGraph) -> tuple[np.ndarray, dict[tuple[int, int], int]]:
    # positions in a list while the walk reads them one at a time (an array's items are
    # slower to read and write one by one: issue 14), an array once found
    position = [-1] * len(graph.nodes)
    edges: dict[tuple[int, int], int] = {}
    k = 0
    roots = list(graph.outputs) + [n.id for n in graph.nodes if n.kind != "output"]
    for root in roots:
        if position[root] >= 0:
            continue
        stack = [(root, 0)]
        while stack:
            nid, i = stack.pop()
            if position[nid] >= 0:
                continue
            inputs = graph.nodes[nid].inputs
            while i < len(inputs):
                operand = inputs[i]
                if isinstance(operand, int):
                    p = graph.values[operand].producer
                    if p < nid and position[p] < 0:
                        stack.append((nid, i))
                        stack.append((p, 0))
                        break
                    edges[(operand, nid)] = k
                    k += 1
                i += 1
            else:
                position[nid] = k
                k += 1
    return np.asarray(position, dtype=np.int64), edges


def combine(graph: OpGraph, raw: list[RawCollective], model: CostModel
            ) -> tuple[list[RawCollective], list[tuple[int, ...]]]:
    """XLA's combiners on the raw collectives: returns them in post order and the groups
    (indices into that order) that become one collective each."""
    position, edges = _post_order(graph)
    # A layout change sits where its first reader takes the operand; an operator's own
    # all-reduce just after the operator.
    def place(k: int) -> tuple[int, int]:
        r = raw[k]
        at = position[r.node] if r.value is None else edges.get((r.value, r.node),
                                                                position[r.node])
        return at, k

    order = sorted(range(len(raw)), key=place)
    raw = [raw[k] for k in order]
    deps = _dependencies(graph, raw)
    hw = model.hw
    keys, sizes, limits = [], [], []
    for r in raw:
        c = r.collective
        limit = hw.combine_threshold(c.kind)
        keys.append(None if limit <= 0 else
                    (c.kind, c.reduction, c.dtype, c.axes, r.region, r.weight))
        sizes.append(c.nbytes)
        limits.append(limit)
    groups = issued_groups(keys, sizes, limits, deps, hw.combine_threshold_count)
    return raw, groups


def issued_groups(keys: Sequence[Hashable | None], sizes: Sequence[float],
                  limits: Sequence[float], deps: list[int], count_limit: int
                  ) -> list[tuple[int, ...]]:
    """XLA's combiners' walk over collectives in the order they are met: per collective its
    combining key (``None``: never combined), bytes and threshold (bytes), and ``deps``,
    the bitsets of those it depends on (updated: what depended on a member of a group ends
    depending on the whole group); the groups (indices) that become one collective each.
    The first left opens a group; later ones of its key join until one depends on a member,
    or a member on it, or the group would pass its threshold or ``count_limit`` members.

    >>> issued_groups(["k", "k", "k"], [1.0] * 3, [8.0] * 3, [0, 0, 0], 10)  # independent
    [(0, 1, 2)]
    >>> issued_groups(["k", "k", None], [1.0] * 3, [8.0] * 3, [0, 1, 0], 10)  # 1 reads 0
    [(0,), (1,), (2,)]
    """
    n = len(keys)
    # The collectives not yet grouped, in post order, as a doubly linked list (``end`` ends
    # it): a group unlinks its members at once, where rebuilding a list after every group
    # made pricing a plan quadratic in its collectives (issue 14: 96 layers, two seconds).
    end = n
    after_k = list(range(1, n + 1)) + [0]  # after_k[end]: the first
    before_k = [end] + list(range(n))  # before_k[0] = end; before_k[end] unused

    def remaining():
        k = after_k[end]
        while k != end:
            yield k
            k = after_k[k]

    groups: list[tuple[int, ...]] = []
    while after_k[end] != end:
        members: list[int] = []
        mask = 0
        below = 0  # what the members depend on: a collective there cannot join them
        size = 0.0
        key = None
        taken = []
        for k in remaining():
            if keys[k] is None:
                if not members:  # never combined: its own collective
                    groups.append((k,))
                    taken.append(k)
                    break
                continue
            if not members:
                key = keys[k]
            elif keys[k] != key:
                continue
            nbytes = sizes[k]
            limit = limits[k]
            if nbytes > limit:
                groups.append((k,))
                taken.append(k)
                if not members:
                    key = None
                continue
            # Either direction of a dependency keeps a collective out of the group: the
            # post order rules out a member depending on a later collective only until groups
            # combine, and joining one the members wait for would make a cycle (a deadlock).
            if size + nbytes > limit or deps[k] & mask or below >> k & 1:
                break
            members.append(k)
            taken.append(k)
            mask |= 1 << k
            below |= deps[k]
            size += nbytes
            if len(members) >= count_limit:
                break
        for k in taken:
            after_k[before_k[k]] = after_k[k]
            before_k[after_k[k]] = before_k[k]
        if members:
            groups.append(tuple(members))
            if len(members) > 1:  # what depended on one member now depends on all of them
                closure = mask
                for k in members:
                    closure |= deps[k]
                for k in remaining():
                    if deps[k] & mask:
                        deps[k] |= closure
    return groups


def _dependencies(graph: OpGraph, raw: list[RawCollective]) -> list[int]:
    """Per raw collective, the bitset of raw collectives it depends on through the dataflow."""
    own: dict[int, list[int]] = {}
    on_edge: dict[tuple[int, int], list[int]] = {}  # (value, reader) -> its layout change
    for k, r in enumerate(raw):
        if r.value is None:
            own.setdefault(r.node, []).append(k)
        else:
            for reader in r.readers:
                on_edge.setdefault((r.value, reader), []).append(k)
    changed = {v for v, _ in on_edge}  # values with a layout change (few: look up by value)
    after = [0] * len(graph.nodes)  # collectives a node's results depend on
    deps = [0] * len(raw)
    for node in graph.nodes:
        acc = 0
        for operand in node.inputs:
            if not isinstance(operand, int):
                continue
            p = graph.values[operand].producer
            if p >= node.id:  # a loop's back edge
                continue
            incoming = after[p]
            if operand not in changed:
                # (operands often carry the same set, the same object: no new one made)
                if incoming is not acc and incoming:
                    acc = incoming if not acc else acc | incoming
                continue
            for k in on_edge.get((operand, node.id), ()):
                deps[k] = after[p]
                for w in raw[k].waits:  # a second gather's barrier (its reader's operands)
                    deps[k] |= after[w]
                incoming |= 1 << k
            acc |= incoming
        result = acc
        for k in own.get(node.id, ()):
            deps[k] = acc
            result |= 1 << k
        after[node.id] = result
    return deps


def price_plan(graph: OpGraph, strategies: Mapping[int, OpStrategy], model: CostModel,
               flops: Mapping[int, float], deferred: frozenset[int], edge_weight,
               scatters: Mapping[int, Scatter] | None = None,
               regather: Regather | None = None) -> ProgramCost:
    """The whole plan as XLA runs it: combined collectives and the step time.

    ``flops``: per node, per-device FLOPs per call (loop trips included); ``scatters`` and
    ``regather``: see :func:`raw_collectives`.
    """
    raw, groups = combine(graph, raw_collectives(graph, strategies, model, deferred,
                                                 edge_weight, scatters, regather), model)
    issued = []
    for members in groups:
        first = raw[members[0]].collective
        nbytes = sum(raw[k].collective.nbytes for k in members)
        wire = sum(raw[k].collective.wire_bytes for k in members)
        time = model.collective_time(first.kind, nbytes, first.axes)
        issued.append(IssuedCollective(first.kind, first.axes, nbytes, wire, time,
                                       raw[members[0]].weight, members,
                                       all(raw[k].deferred for k in members)))
    rate = model.hw.flops_per_s
    assert rate is not None, "HardwareProfile fills fields from its preset"
    compute = sum(flops.values()) / rate
    comm = sum(c.time * c.count for c in issued)
    if model.hw.overlap_collectives and issued:
        step = _schedule(graph, raw, issued, flops, rate)
    else:
        step = compute + comm
    return ProgramCost(tuple(raw), tuple(issued), compute, comm, step)


def _schedule(graph: OpGraph, raw: list[RawCollective], issued: list[IssuedCollective],
              flops: Mapping[int, float], rate: float) -> float:
    """Makespan of a list schedule on a compute stream and a network stream."""
    n_nodes = len(graph.nodes)
    group_of = {}
    for g, c in enumerate(issued):
        for k in c.members:
            group_of[k] = g
    # Units 0..n_nodes-1 are nodes, n_nodes + g is issued collective g.
    preds: list[set[int]] = [set() for _ in range(n_nodes + len(issued))]
    own_groups: dict[int, set[int]] = {}
    edge_groups: dict[tuple[int, int], set[int]] = {}
    for k, r in enumerate(raw):
        g = n_nodes + group_of[k]
        if r.value is None:
            own_groups.setdefault(r.node, set()).add(g)
            preds[g].add(r.node)
        else:
            for reader in r.readers:
                edge_groups.setdefault((r.value, reader), set()).add(g)
            preds[g].add(r.after)
            preds[g].update(r.waits)
    for node in graph.nodes:
        for operand in node.inputs:
            if not isinstance(operand, int):
                continue
            p = graph.values[operand].producer
            if p >= node.id:
                continue
            via = edge_groups.get((operand, node.id))
            preds[node.id] |= via if via else ({p} | own_groups.get(p, set()))
    for k, r in enumerate(raw):  # a layout change reads the all-reduced value (and waits)
        if r.value is not None:
            for p in (r.after, *r.waits):
                preds[n_nodes + group_of[k]] |= own_groups.get(p, set())
    succs: list[list[int]] = [[] for _ in preds]
    indegree = [0] * len(preds)
    for u, ps in enumerate(preds):
        ps.discard(u)
        for p in ps:
            succs[p].append(u)
        indegree[u] = len(ps)
    duration = [flops.get(n, 0.0) / rate for n in range(n_nodes)] + \
               [c.time * c.count for c in issued]
    # Whatever can start first goes first (ties: program order), so that a unit waiting for a
    # collective never holds back compute that is ready.
    heap = [(0.0, u, u) for u in range(len(preds)) if indegree[u] == 0]
    heapq.heapify(heap)
    ready = [0.0] * len(preds)
    free = [0.0, 0.0]  # compute, network
    end = 0.0
    done = 0
    while heap:
        _, _, u = heapq.heappop(heap)
        stream = 0 if u < n_nodes else 1
        start = max(free[stream], ready[u])
        finish = start + duration[u]
        free[stream] = finish
        end = max(end, finish)
        done += 1
        for v in succs[u]:
            ready[v] = max(ready[v], finish)
            indegree[v] -= 1
            if indegree[v] == 0:
                heapq.heappush(heap, (ready[v], _priority(v, n_nodes, issued, raw), v))
    # A unit never scheduled (a cycle through combined collectives) would drop its time.
    assert done == len(preds), "combined collectives depend on one another in a cycle"
    return end


def _priority(u: int, n_nodes: int, issued: list[IssuedCollective],
              raw: list[RawCollective]) -> int:
    if u < n_nodes:
        return u
    return max(raw[k].node for k in issued[u - n_nodes].members)
