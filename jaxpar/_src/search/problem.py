"""The search problem shared by the fully automatic searches.

From the operator graph and the cost model it builds a smaller *coarse graph*:

* every searchable node gets its candidate strategies, a pinned node exactly one.
  ``fully_use_devices`` (MindSpore's algorithm parameter, on by default) makes contractions
  (rules registered as ``OpCategory.CONTRACTION``: ``dot_general``, convolutions, the work worth
  splitting) split over every device when they can;
* a node that only passes one input through (an elementwise operator of one tensor, a
  conversion, an unpinned result) **follows** its producer: it is folded into the producer,
  taking, for each of the producer's candidates, the candidate that matches it exactly; a state
  result follows the argument it returns instead, so train steps chain without resharding;
* node costs are simulated seconds (compute at the device's FLOP rate plus the operator's own
  collectives, times loop trips); edge costs are the seconds of layout changes between two
  candidates, priced once per pair of distinct port layouts;
* nodes that repeat once per unrolled layer form *groups* (see :func:`_layer_groups`); on
  large graphs the searches solve the :func:`quotient` problem, where each group shares one
  strategy, so their work grows with one layer rather than with the depth.

A search picks one candidate index per coarse node; :meth:`Problem.expand` turns that into a
strategy for every node of the graph.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jaxpar._src.compat import call_sites
from jaxpar._src.graph import Const, Node, NodeKind, OpGraph, Role
from jaxpar._src.rules import FactorRule, OpCategory, OpStrategy
from jaxpar._src.search.common import Pin, SearchSpace
from jaxpar._src.search.useful import prune, useless_factors
from jaxpar._src.spec import Spec


@dataclasses.dataclass
class Problem:
    """Coarse graph: candidates, node and edge costs, pins, followers and groups."""

    space: SearchSpace
    reps: list[int]  # coarse nodes (graph node ids), in graph order
    cands: dict[int, tuple[OpStrategy, ...]]
    cost: dict[int, np.ndarray]  # seconds per candidate, followers and inner edges included
    mem: dict[int, np.ndarray]  # bytes per device per candidate (results it holds)
    edges: dict[tuple[int, int], np.ndarray]  # (u, v), u < v: seconds per candidate pair
    follow: dict[int, tuple[int, np.ndarray]]  # follower -> (rep, rep candidate -> own index)
    forced: dict[int, int]  # rep -> the only allowed candidate index (pins)
    groups: Sequence[list[int]]  # reps that may share one strategy (found when asked)
    origins: dict[int, str]  # pin origins
    members: dict[int, tuple[int, ...]] | None = None  # quotient: the reps each node stands for
    # How much pricing the build did: nodes and layout-changing edges priced (each a
    # vector or matrix over candidates), against the nodes and edges of the graph they cover.
    # Repeated layers price each kind of node and edge once: these do not grow with depth.
    priced: Mapping[str, int] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_tables(cls, cost: Mapping[int, np.ndarray],
                    edges: Mapping[tuple[int, int], np.ndarray]) -> Problem:
        """A problem given by its cost tables alone (no graph behind it; candidates are
        numbered): what the solvers of ``elimination.py`` and ``optimal.py`` need, for tests
        and for sub-problems.

        >>> p = Problem.from_tables({0: np.array([1.0, 0.0]), 1: np.zeros(3)},
        ...                         {(0, 1): np.ones((2, 3))})
        >>> p.objective({0: 1, 1: 0})
        1.0
        """
        reps = sorted(cost)
        return cls(None, reps, {r: tuple(range(len(cost[r]))) for r in reps},  # type: ignore
                   {r: np.asarray(cost[r], dtype=float) for r in reps},
                   {r: np.zeros(len(cost[r])) for r in reps},
                   {k: np.asarray(m, dtype=float) for k, m in edges.items()}, {}, {}, [], {})

    def restricted(self, kept: Mapping[int, np.ndarray]) -> Problem:
        """The problem where node ``r`` may take only the candidates ``kept[r]`` (indices
        into its list, including a pinned node's one); its choices index into ``kept[r]``.
        For solving only (:meth:`expand` needs the full problem).

        >>> p = Problem.from_tables({0: np.array([3.0, 1.0, 2.0])}, {})
        >>> p.restricted({0: np.array([0, 2])}).cost[0]
        array([3., 2.])
        """
        forced = {}
        for r, k in self.forced.items():
            (where,) = np.flatnonzero(kept[r] == k)
            forced[r] = int(where)
        return dataclasses.replace(
            self, cands={r: tuple(self.cands[r][k] for k in kept[r]) for r in self.reps},
            cost={r: self.cost[r][kept[r]] for r in self.reps},
            mem={r: self.mem[r][kept[r]] for r in self.reps},
            edges={(u, v): m[np.ix_(kept[u], kept[v])] for (u, v), m in self.edges.items()},
            forced=forced)

    def members_of(self, r: int) -> tuple[int, ...]:
        return self.members[r] if self.members is not None else (r,)

    # -- evaluation ---------------------------------------------------------------------------
    def objective(self, choice: Mapping[int, int]) -> float:
        total = sum(float(self.cost[r][choice[r]]) for r in self.reps)
        for (u, v), m in self.edges.items():
            total += float(m[choice[u], choice[v]])
        return total

    def neighbours(self) -> dict[int, set[int]]:
        adj: dict[int, set[int]] = {r: set() for r in self.reps}
        for u, v in self.edges:
            adj[u].add(v)
            adj[v].add(u)
        return adj

    def expand(self, choice: Mapping[int, int]) -> dict[int, OpStrategy]:
        """A strategy for every searchable node of the graph."""
        out = {r: self.cands[r][choice[r]] for r in self.reps}
        for f, (rep, index_map) in self.follow.items():
            out[f] = self.cands[f][int(index_map[choice[rep]])]
        return out


def build_problem(space: SearchSpace, pins: Sequence[Pin], *, ties: Sequence[tuple[int, int]] = (),
                  fully_use_devices: bool = True, share: bool = True) -> Problem:
    """The coarse problem of ``space`` under ``pins``.  Nodes (and edges) alike in everything
    their price depends on (rule, candidates, shapes, dtypes, loop weight, gradient bucket) are
    priced once and share the result, so a stack of identical layers is priced like one layer
    (``Problem.priced`` counts what was priced); ``share=False`` prices every node and edge on
    its own, for comparison.

    What no node price changes (candidates, followers, edges: :class:`_Layout`) is found once
    per space and pins and shared with :meth:`SearchSpace.alone`'s space: a search again with
    gradient all-reduces priced alone prices its nodes anew and nothing else (issue 14)."""
    unpriced_key = (tuple(pins), tuple(ties), fully_use_devices)
    layout = space.unpriced.get(("layout", unpriced_key, share))
    if layout is None:
        layout = space.unpriced[("layout", unpriced_key, share)] = _layout(
            space, pins, ties, fully_use_devices, share, unpriced_key)
    reps, cands = layout.reps, layout.cands

    # -- node costs ---------------------------------------------------------------------------
    hw = space.model.hw
    cost: dict[int, np.ndarray] = {}
    mem: dict[int, np.ndarray] = {}
    vectors: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    # A coarse node's vectors are the sum of its members' (in order), so coarse nodes whose
    # members are alike, member by member, have equal sums: each is summed once and copied
    # (issue 14: repeated layers repeat their coarse nodes; the sums were per node).
    summed: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    bucket_of = space.bucket_of
    for r in reps:
        group = layout.members[r]
        signatures = tuple([(alike, bucket_of(nid)) for nid, alike in group] if share
                           else [(nid,) for nid, _ in group])
        found_sum = summed.get(signatures)
        if found_sum is None:
            times_sum = np.zeros(len(cands[r]))
            held_sum = np.zeros(len(cands[r]))
            for (nid, _), signature in zip(group, signatures, strict=True):
                found = vectors.get(signature)
                if found is None:  # repeated layers: price each kind of node once
                    options = cands[nid]
                    index = layout.follow[nid][1] if nid in layout.follow else None
                    strategies = options if index is None else [options[int(k)] for k in index]
                    times = np.array([space.op_cost(nid, s).time(hw) for s in strategies])
                    held = np.array([_result_bytes(space, nid, s) for s in strategies])
                    found = vectors[signature] = (times, held)
                times_sum += found[0]
                held_sum += found[1]
            # Among equally fast plans prefer the one holding fewer bytes (a batch argument
            # split rather than replicated and sliced): a picosecond per GiB breaks the tie.
            times_sum += TIE_BREAK_S_PER_BYTE * held_sum
            found_sum = summed[signatures] = (times_sum, held_sum)
        cost[r] = found_sum[0].copy()  # (the layout changes inside it are added below)
        mem[r] = found_sum[1].copy()
    # layout changes inside a coarse node (a follower and its rep), in the build's order
    for r, k, seconds in layout.inner:
        cost[r][k] += seconds

    pinned = {p.node for p in pins}
    forced = {r: 0 for r in reps if r in pinned}
    at_build = (list(reps), dict(cands), dict(forced))  # as they are now, whenever asked
    # Candidates, followers and pins, so the groups, do not depend on prices: a build of the
    # same pins on the space with gradient all-reduces priced alone (``SearchSpace.alone``)
    # shares them.
    groups = space.unpriced.get(("groups", unpriced_key))
    if groups is None or not share:
        groups = LazyGroups(lambda: _layer_groups(space, at_build[0], at_build[1],
                                                  at_build[2]))
        space.unpriced[("groups", unpriced_key)] = groups
    origins = {p.node: p.origin for p in pins}
    priced = {"nodes": len(vectors), "of_nodes": layout.searchable, "edges": layout.matrices,
              "of_edges": layout.edges_between}
    return Problem(space, list(reps), dict(cands), cost, mem, dict(layout.edges),
                   dict(layout.follow), forced, groups, origins, priced=priced)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What a problem build finds that no node price changes.

    Attributes:
      reps, cands, follow: as :class:`Problem`'s.
      members: per rep, the graph nodes it stands for, each with a number for what its price
        depends on but the gradient bucket (nodes alike in it share one price per bucket).
      inner: ``(rep, candidate, seconds)`` of every layout change inside a coarse node, in
        the order the build adds them to the rep's cost.
      edges: the edge matrices between coarse nodes.
      searchable, matrices, edges_between: ``Problem.priced``'s counts.
    """

    reps: list[int]
    cands: dict[int, tuple[OpStrategy, ...]]
    follow: dict[int, tuple[int, np.ndarray]]
    members: dict[int, list[tuple[int, int]]]
    inner: list[tuple[int, int, float]]
    edges: dict[tuple[int, int], np.ndarray]
    searchable: int
    matrices: int
    edges_between: int


def _layout(space: SearchSpace, pins: Sequence[Pin], ties: Sequence[tuple[int, int]],
            fully_use_devices: bool, share: bool, unpriced_key: tuple) -> _Layout:
    graph = space.graph
    nodes = graph.nodes
    mesh = space.model.mesh
    pinned = {p.node: p for p in pins}
    searchable = [n.id for n in graph.searchable()]
    # Each node's rule, looked up once for the passes below (issue 14: four look-ups a node).
    rules = {nid: space.rule(nid) for nid in searchable}
    cands: dict[int, tuple[OpStrategy, ...]] = {}
    # What a node's candidate list depends on (its rule and how it is filtered, or its pin):
    # nodes with one key share one list, and the caches below are keyed by it, numbered
    # (a number hashes at once; the key's tuple hashed anew on every look-up: issue 14).
    kinds: dict[int, int] = {}
    kind_ids: dict[tuple, int] = {}
    lists: list[tuple[OpStrategy, ...]] = []  # by kind
    # Splits no contraction can use (search/useful.py); the same for every bucket size.
    dead = space.unpriced.get(("useless", unpriced_key))
    if dead is None:
        dead = space.unpriced[("useless", unpriced_key)] = useless_factors(space, pins)
    op = NodeKind.OP
    for nid in searchable:
        pin = pinned.get(nid)
        rule = rules[nid]
        key: tuple = ("pin", pin.strategy) if pin is not None else \
            ("rule", rule, fully_use_devices and nodes[nid].kind is op, dead.get(nid))
        kind = kind_ids.get(key)
        if kind is None:
            kind = kind_ids[key] = len(lists)
            if pin is not None:
                options: tuple[OpStrategy, ...] = (pin.strategy,)
            else:
                # A dimension split over several axes takes them in mesh order (the other
                # orders only permute which device holds which block; pins may still use
                # them).  An axis of size 1 splits nothing: candidates using it only
                # duplicate others.
                options = tuple(c for c in space.candidates(nid) if all(
                    list(axes) == sorted(axes, key=mesh.names.index)
                    and all(mesh.size(a) > 1 for a in axes) for axes in c.factor_axes))
                if key[2]:
                    options = _use_all_devices(options, mesh,
                                               rule.category is OpCategory.CONTRACTION)
                if key[3]:
                    options = prune(options, key[3])
            lists.append(options)
        kinds[nid] = kind
        cands[nid] = lists[kind]

    # -- followers ----------------------------------------------------------------------------
    tied_to_input = {out: inp for inp, out in ties}
    follow: dict[int, tuple[int, np.ndarray]] = {}
    # A follower's index depends on its candidates, its leader's and the leader's own index
    # (kept alive in ``follow``, so its id stays its own): repeated layers find it once.
    indices: dict[tuple, np.ndarray | None] = {}
    through: dict[tuple, bool] = {}  # _pass_through's verdict on an operator's rule
    for nid in searchable:
        if nid in pinned:
            continue
        tied = tied_to_input.get(nid)
        if tied is not None and tied in cands:
            leader, j, i = tied, 0, 0
        else:
            leader_port = _pass_through(graph, nodes[nid], rules[nid], through)
            if leader_port is None:
                continue
            leader, j, i = leader_port
        rep, base = leader, None
        followed = follow.get(leader)
        if followed is not None:
            rep, base = followed
        key = (kinds[nid], i, kinds[leader], j, None if base is None else id(base))
        index = indices.get(key, False)
        if index is False:
            index = indices[key] = _follower_index(cands[nid], i, cands[leader], j,
                                                   len(cands[rep]), base)
        if index is not None:
            follow[nid] = (rep, index)

    reps = [n for n in searchable if n not in follow]

    # Layouts are compared by number: every distinct port layout gets an id, and each node's
    # port is an array of ids over its rep's candidates (repeated layers share the arrays).
    spec_ids: dict[Spec, int] = {}
    specs: list[Spec] = []
    own_ports: dict[tuple[int, str, int], np.ndarray] = {}
    # A port over its rep's candidates, and its bytes, by the node's kind and its follower
    # index (by identity: ``follow`` keeps the index alive, and repeated layers share it).
    ports: dict[tuple, tuple[np.ndarray, bytes]] = {}

    def port(nid: int, side: str, idx: int) -> tuple[np.ndarray, bytes]:
        followed = follow.get(nid)
        index = None if followed is None else followed[1]
        key = (kinds[nid], side, idx)
        found = ports.get((key, None if index is None else id(index)))
        if found is not None:
            return found
        own = own_ports.get(key)
        if own is None:
            ids = []
            for c in cands[nid]:
                spec = (c.out_specs if side == "out" else c.in_specs)[idx]
                sid = spec_ids.get(spec)
                if sid is None:
                    sid = spec_ids[spec] = len(specs)
                    specs.append(spec)
                ids.append(sid)
            own = own_ports[key] = np.asarray(ids, dtype=np.int64)
        at = own if index is None else own[index]
        found = ports[(key, None if index is None else id(index))] = (at, at.tobytes())
        return found

    # -- what each node's price depends on, but the bucket ------------------------------------
    # (numbered: equal tuples one number, which the build's look-ups hash at once)
    members: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    alike_ids: dict[tuple, int] = {}
    alike_of: dict[int, int] = {}  # each node's number
    # A follower index's contents by its identity (``follow`` keeps the indices alive, and
    # repeated layers share them): equal contents, one number.
    contents: dict[bytes, int] = {}
    content_of: dict[int, int] = {}
    values = graph.values
    for nid in searchable:
        node = nodes[nid]
        followed = follow.get(nid)
        content = None
        if followed is not None:
            content = content_of.get(id(followed[1]))
            if content is None:
                content = content_of[id(followed[1])] = contents.setdefault(
                    followed[1].tobytes(), len(contents))
        outs = tuple([(values[v].shape, values[v].dtype) for v in node.outputs])
        dtypes = tuple([o.dtype if isinstance(o, Const) else values[o].dtype
                        for o in node.inputs])
        alike = (rules[nid], kinds[nid], content, node.weight, outs, dtypes)
        number = alike_of[nid] = alike_ids.setdefault(alike, len(alike_ids))
        members[nid if followed is None else followed[0]].append((nid, number))

    # -- edges --------------------------------------------------------------------------------
    inner: list[tuple[int, int, float]] = []
    edges: dict[tuple[int, int], np.ndarray] = {}
    matrices: dict[tuple, tuple[np.ndarray, bool]] = {}  # and whether anything moves
    moves: dict[tuple, float] = {}  # seconds of one layout change, by layout ids (_edge_matrix)
    edges_between = 0  # edges between two coarse nodes (each needs a matrix)
    # An edge's layout changes depend on its two ports (each end's candidates and follower
    # index, and the port's number), its value's shape and dtype (the producer's results')
    # and its weight (the ends' loop weights): the ends' numbers above hold all of it, so
    # edges alike in ``(producer's number, out index, consumer's number, in index)`` share
    # them, found on the first (issue 14: repeated layers repeat their edges; each edge
    # looked up its two ports anew).
    within: dict[tuple, list[tuple[int, float]]] = {}  # (candidate, seconds) inside a node
    between: dict[tuple, tuple[np.ndarray, bool]] = {}  # the matrix and whether it moves
    for producer, j, consumer, i in graph.priced_edges():
        followed = follow.get(producer)
        ru = producer if followed is None else followed[0]
        followed = follow.get(consumer)
        rv = consumer if followed is None else followed[0]
        ends = (alike_of[producer], j, alike_of[consumer], i) if share else \
            (producer, j, consumer, i)
        if ru == rv:
            changes = within.get(ends)
            if changes is None:
                src, _ = port(producer, "out", j)
                dst, _ = port(consumer, "in", i)
                changes = within[ends] = [
                    (k, space.edge_time(producer, j, specs[src[k]], consumer, specs[dst[k]]))
                    for k in np.flatnonzero(src != dst).tolist()]
            for k, seconds in changes:
                inner.append((ru, k, seconds))
            continue
        edges_between += 1
        found = between.get(ends)
        if found is None:
            src, src_bytes = port(producer, "out", j)
            dst, dst_bytes = port(consumer, "in", i)
            value = values[graph.nodes[producer].outputs[j]]
            signature = (src_bytes, dst_bytes, value.shape, value.dtype,
                         space.edge_weight(producer, consumer)) if share else ends
            found = matrices.get(signature)
            if found is None:  # repeated layers repeat their edges: price each kind once
                matrix = _edge_matrix(space, producer, j, consumer, src, dst, specs,
                                      moves if share else {})
                found = matrices[signature] = (matrix, bool(matrix.any()))
            between[ends] = found
        matrix, moving = found
        if not moving:
            continue
        key, m = ((ru, rv), matrix) if ru < rv else ((rv, ru), matrix.T)
        edges[key] = edges[key] + m if key in edges else m
    return _Layout(reps, cands, follow, dict(members), inner, edges, len(searchable),
                   len(matrices), edges_between)


TIE_BREAK_S_PER_BYTE = 1e-21


def _follower_index(options: Sequence[OpStrategy], i: int, leader_options: Sequence[OpStrategy],
                    j: int, n: int, base: np.ndarray | None) -> np.ndarray | None:
    """Per candidate of the rep (``n`` of them; the leader's through ``base`` when the
    leader follows it), the candidate of the follower whose operand ``i`` takes the leader's
    result ``j`` as it is; ``None`` when one has none."""
    own = {c.in_specs[i]: k for k, c in enumerate(options)}
    index = np.empty(n, dtype=np.int64)
    for k in range(n):
        lead = leader_options[k if base is None else int(base[k])]
        match = own.get(lead.out_specs[j])
        if match is None:
            return None
        index[k] = match
    return index


class LazyGroups(Sequence[list[int]]):
    """The layer groups, found the first time they are asked for: only searches of graphs
    large enough to share strategies across layers ask (``auto.py``), and finding them costs
    a colour refinement over the whole graph (issue 14: the first call).

    >>> g = LazyGroups(lambda: [[1, 2]])
    >>> g.found, list(g), g.found
    (False, [[1, 2]], True)
    """

    def __init__(self, find: Callable[[], list[list[int]]]) -> None:
        self._find: Callable[[], list[list[int]]] | None = find
        self._groups: list[list[int]] = []

    @property
    def found(self) -> bool:
        return self._find is None

    def _all(self) -> list[list[int]]:
        if self._find is not None:
            self._groups, self._find = self._find(), None
        return self._groups

    def __getitem__(self, index):
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())


def _use_all_devices(options: tuple[OpStrategy, ...], mesh, contraction: bool
                     ) -> tuple[OpStrategy, ...]:
    """MindSpore's ``fully_use_devices``, for the operators whose work is worth splitting: a
    contraction splits over every device whenever it can.  The operators between contractions
    keep every option, so hybrid plans (an elementwise chain split over ``dp`` only, replicated
    over ``mp`` as in Megatron) stay reachable."""
    if not contraction:
        return options
    n = mesh.num_devices
    full = tuple(c for c in options
                 if mesh.product(a for axes in c.factor_axes for a in axes) == n)
    return full or options


def _result_bytes(space: SearchSpace, nid: int, strategy: OpStrategy) -> float:
    graph = space.graph
    total = 0.0
    for vid, spec in zip(graph.nodes[nid].outputs, strategy.out_specs, strict=True):
        total += graph.values[vid].nbytes * spec.shard_fraction(space.model.mesh)
    return total


def _pass_through(graph: OpGraph, node: Node, rule: FactorRule,
                  memo: dict[tuple, bool] | None = None) -> tuple[int, int, int] | None:
    """``(producer, out index, in index)`` when ``node`` (of ``rule``) just carries one
    input's layout on.  ``memo`` remembers what an operator's rule says (repeated layers
    share their rules)."""
    if node.kind not in (NodeKind.OP, NodeKind.OUTPUT, NodeKind.EXIT) or len(node.outputs) > 1:
        return None
    values = [(i, o) for i, o in enumerate(node.inputs) if not isinstance(o, Const)]
    if len(values) != 1:
        return None
    i, operand = values[0]
    if node.kind is NodeKind.OP:
        key = (rule, i, bool(node.outputs))
        carries = memo.get(key) if memo is not None else None
        if carries is None:
            carries = _rule_carries(rule, i, bool(node.outputs))
            if memo is not None:
                memo[key] = carries
        if not carries:
            return None
    elif node.kind is NodeKind.EXIT and node.role is not Role.CARRY_OUT:
        return None
    v = graph.values[operand]
    return v.producer, v.index, i


def _rule_carries(rule, i: int, has_outputs: bool) -> bool:
    """Whether an operator of ``rule`` carries operand ``i``'s layout to its result as it is:
    no reduction or blocked factor, the result's dimensions the operand's, every other
    operand without factors of its own."""
    if rule.reductions or rule.blocked:
        return False
    if has_outputs and rule.operands[i] != rule.results[0]:
        return False
    others = [t for k, t in enumerate(rule.operands) if k != i]
    return not any(any(d) for t in others for d in t)


def _edge_matrix(space: SearchSpace, producer: int, j: int, consumer: int,
                 src: np.ndarray, dst: np.ndarray, specs: Sequence[Spec],
                 moves: dict[tuple, float]) -> np.ndarray:
    """Seconds of the layout change per pair of candidates (``src``, ``dst``: layout ids).
    ``moves`` remembers each change's seconds (unweighted) by layout ids, shape and dtype:
    edges of one shape meet the same pairs of layouts (issue 14: three quarters of the
    pairs priced at 24 layers were priced before)."""
    su, iu = np.unique(src, return_inverse=True)
    sv, iv = np.unique(dst, return_inverse=True)
    value = space.graph.values[space.graph.nodes[producer].outputs[j]]
    weight = space.edge_weight(producer, consumer)
    model = space.model
    shape, dtype = value.shape, value.dtype
    table = np.zeros((len(su), len(sv)))
    for a, x in enumerate(su.tolist()):
        for b, y in enumerate(sv.tolist()):
            if x != y:
                key = (x, y, shape, dtype)
                seconds = moves.get(key)
                if seconds is None:
                    colls = model.redistribution(specs[x], specs[y], shape, dtype)
                    seconds = moves[key] = sum(c.time for c in colls)
                table[a, b] = weight * seconds
    return table[iu.reshape(-1)][:, iv.reshape(-1)]


def _layer_groups(space: SearchSpace, reps: Sequence[int], cands: Mapping, forced: Mapping
                  ) -> list[list[int]]:
    """Nodes that repeat once per layer.

    Each node starts from a key: an operator its primitive, rule and call sites (every line of
    the user's code on the way to it: one line in a helper, such as a dense layer called for the
    query and for the output projection, is two operators, not one repeated); an argument its
    path with layer numbers blanked; anything else its kind and shapes.  Keys are then refined
    by the neighbours' keys, round by round (the Weisfeiler-Lehman colour refinement), so that
    operators one line of library code makes for many tensors (an optimizer's update of every
    parameter) are told apart by the parameter they update, while the layers in the middle of a
    stack stay alike.  Nodes still alike after the rounds share a strategy.  Layers near the
    ends of the stack (where it meets the embedding and the head) come apart within the
    rounds' reach.  (Identical layers that should alternate, such as a Megatron MLP written as a
    loop over one layer, therefore only alternate in graphs small enough to search unshared.)
    """
    graph = space.graph
    first: dict[tuple, int] = {}
    colour = []
    # Candidate lists by number, equal lists one number: hashing a list hashes every strategy
    # in it, and repeated layers share a few lists (looked up by identity: ``cands`` holds
    # them, so their ids stay theirs while this runs).
    by_value: dict[tuple, int] = {}
    by_id: dict[int, int | None] = {}

    def listed(nid: int) -> int | None:
        options = cands.get(nid)
        found = by_id.get(id(options), -1)
        if found == -1:
            found = by_id[id(options)] = None if options is None else \
                by_value.setdefault(options, len(by_value))
        return found

    values = graph.values
    for node in graph.nodes:
        nid = node.id
        if node.kind is NodeKind.OP and node.source != "?":
            where = call_sites(node.eqn) if node.eqn is not None else ()
            key: tuple = ("op", node.name, where or node.source, space.rule(nid), node.weight,
                          listed(nid))
        elif node.kind is NodeKind.OP:
            key = ("op", node.name, space.rule(nid), node.weight, listed(nid))
        else:  # (the results' shapes, which only these keys hold)
            shapes = tuple([values[v].shape for v in node.outputs])
            if node.kind in (NodeKind.INPUT, NodeKind.CONST) and node.label:
                key = ("arg", re.sub(r"\d+", "#", node.label), shapes, listed(nid))
            else:
                key = (node.kind, node.name, shapes, node.weight, listed(nid))
        colour.append(first.setdefault(key, len(first)))
    # A node's neighbourhood, each neighbour ``(side, own port, its port, its colour)`` as one
    # number: ``colour * ports + (side, a, b)`` numbered; equal multisets of numbers are equal
    # multisets of those tuples, so the colours are the same as refined from the tuples, and
    # sorting numbers is cheaper (issue 14).
    colour = _refine(colour, list(graph.edges()), len(first))
    buckets: dict[int, list[int]] = collections.defaultdict(list)
    for r in reps:
        if r not in forced:
            buckets[colour[r]].append(r)
    return [members for members in buckets.values() if len(members) > 1]


def _refine(colour: list[int], edges: Sequence[tuple[int, int, int, int]], classes: int
            ) -> list[int]:
    """The colours after :data:`REFINE_ROUNDS` rounds of refinement (fewer once a round splits
    no class): nodes keep one colour while their colours and the multisets of their
    neighbours' ``(side, own port, its port, colour)`` are equal.  Only the partition counts
    (the colours' numbers are arbitrary); it is found with NumPy, node rows grouped by degree
    and compared by sorting (:func:`_row_classes`; issue 14: per node in Python, these rounds
    were a third of finding the groups at 96 layers).

    >>> colours = _refine([0, 0, 0, 0], [(0, 0, 1, 0), (2, 0, 3, 0)], 1)  # 0 -> 1, 2 -> 3
    >>> colours[0] == colours[2] != colours[1] == colours[3]
    True
    """
    n = len(colour)
    if n == 0:
        return colour
    e = np.fromiter(itertools.chain.from_iterable(edges), dtype=np.int64,
                    count=4 * len(edges)).reshape(-1, 4)
    producer, j, consumer, i = e.T
    width = 1 + int(e[:, [1, 3]].max(initial=0))
    ports = 2 * width * width
    # Each neighbour as ``colour * ports + (side, own port, its port)`` numbered: equal
    # multisets of numbers are equal multisets of those tuples.
    owner = np.concatenate([producer, consumer])
    other = np.concatenate([consumer, producer])
    static = np.concatenate([(j * width + i) * 2, (i * width + j) * 2 + 1])
    order = np.argsort(owner, kind="stable")
    owner, other, static = owner[order], other[order], static[order]
    degree = np.bincount(owner, minlength=n)
    start = np.concatenate([[0], np.cumsum(degree)[:-1]])
    by_degree = [(d, np.flatnonzero(degree == d)) for d in np.unique(degree).tolist()]
    current = np.asarray(colour, dtype=np.int64)
    for _ in range(REFINE_ROUNDS):
        value = current[other] * ports + static
        value = value[np.lexsort((value, owner))]  # each node's numbers, sorted, in a row
        new = np.empty(n, dtype=np.int64)
        found = 0
        for d, nodes in by_degree:
            rows = np.empty((len(nodes), d + 1), dtype=np.int64)
            rows[:, 0] = current[nodes]
            if d:
                rows[:, 1:] = value[start[nodes][:, None] + np.arange(d)]
            inverse, classes_here = _row_classes(rows)
            new[nodes] = found + inverse
            found += classes_here
        current = new
        if found == classes:
            break
        classes = found
    return current.tolist()


def _row_classes(rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Per row of ``rows``, a number shared by the equal rows only, and how many numbers:
    ``np.unique(rows, axis=0, return_inverse=True)``'s partition, found by sorting the rows
    with ``np.lexsort`` (``np.unique`` of rows sorts them as opaque bytes, one comparison
    call per pair: issue 14, two fifths of a colour refinement at 24 GPT layers).

    >>> inverse, n = _row_classes(np.array([[1, 2], [0, 5], [1, 2]]))
    >>> inverse.tolist(), n
    ([1, 0, 1], 2)
    """
    order = np.lexsort(rows.T[::-1])
    ordered = rows[order]
    starts = np.empty(len(rows), dtype=np.int64)
    starts[0] = 1
    starts[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    numbers = np.cumsum(starts) - 1
    inverse = np.empty(len(rows), dtype=np.int64)
    inverse[order] = numbers
    return inverse, int(numbers[-1]) + 1


REFINE_ROUNDS = 4  # enough to reach from a parameter through its optimizer update


def quotient(problem: Problem) -> tuple[Problem, dict[int, int]]:
    """The problem where each group is one node: its members share one candidate.  Returns it
    and the owner (group representative) of every node of ``problem``."""
    owner = {r: r for r in problem.reps}
    for group in problem.groups:
        for r in group:
            owner[r] = group[0]
    reps = [r for r in problem.reps if owner[r] == r]
    cost = {r: np.zeros(len(problem.cands[r])) for r in reps}
    mem = {r: np.zeros(len(problem.cands[r])) for r in reps}
    for r in problem.reps:
        cost[owner[r]] += problem.cost[r]
        mem[owner[r]] += problem.mem[r]
    edges: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in problem.edges.items():
        ou, ov = owner[u], owner[v]
        if ou == ov:
            cost[ou] += np.diag(m)
            continue
        key, m = ((ou, ov), m) if ou < ov else ((ov, ou), m.T)
        edges[key] = edges[key] + m if key in edges else m
    members: dict[int, list[int]] = {r: [] for r in reps}
    for r in problem.reps:
        members[owner[r]].append(r)
    shared = dataclasses.replace(
        problem, reps=reps, cands={r: problem.cands[r] for r in reps}, cost=cost, mem=mem,
        edges=edges, forced={r: k for r, k in problem.forced.items() if owner[r] == r},
        groups=[], members={r: tuple(m) for r, m in members.items()})
    return shared, owner
