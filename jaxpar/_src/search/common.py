"""What every search shares: candidate strategies and costs per node, pins, and the result."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxpar._src.combine import (
    ProgramCost,
    deferred_bucket,
    deferred_nodes,
    price_plan,
    sibling_buckets,
)
from jaxpar._src.cost import Cost, CostModel
from jaxpar._src.graph import Const, Edge, Node, NodeKind, OpGraph
from jaxpar._src.regather import Regather
from jaxpar._src.rules import (
    FactorRule,
    OpCategory,
    OpStrategy,
    OpView,
    enumerate_strategies,
    op_view,
    rule_for,
)
from jaxpar._src.scatter_plan import LEVELS, lowered
from jaxpar._src.spec import Spec

if TYPE_CHECKING:
    from jaxpar._src.scatter import Scatter


@dataclasses.dataclass(frozen=True, slots=True)
class Pin:
    """A strategy fixed by the user (or by the mode); no search may change it."""

    node: int
    strategy: OpStrategy
    origin: str  # "in_strategy", "out_strategy", "shard", "parameter_plan", "data_parallel", ...


@dataclasses.dataclass(frozen=True)
class Assignment:
    """A search's answer: a strategy and its origin for every searchable node."""

    strategies: Mapping[int, OpStrategy]
    origins: Mapping[int, str]


class SearchSpace:
    """Lazily computed rules, candidates and costs of a graph on one mesh."""

    def __init__(self, graph: OpGraph, model: CostModel, optimizer_level: int = 0) -> None:
        self.graph = graph
        self.model = model
        # The parallel optimizer's ZeRO level (0: off): at levels 1-3 a plan is priced as the
        # lowering runs it, its split gradients reduce-scattered (scatter_plan.py).
        self.optimizer_level = optimizer_level
        # The inputs ZeRO level 3 splits (the parallel optimizer's pins, which set it): a plan
        # is priced with their second gathers for the backward pass (regather.py).
        self.regathered: frozenset[int] = frozenset()
        self._rules: dict[int, FactorRule] = {}
        # One object per distinct rule: the nodes of repeated layers derive equal rules, and
        # the search's caches are keyed by them; a look-up with the same object is an
        # identity hit, with an equal other one a field-by-field comparison (issue 14).
        self._canonical: dict[FactorRule, FactorRule] = {}
        self._kinds: dict[int, int] = {}  # each node's kind (:meth:`kind`)
        self._signatures: dict[tuple, tuple[FactorRule, int]] = {}  # rule and kind, by signature
        self._type_ids: dict[tuple, int] = {}  # (shape, dtype) numbered
        self._types: list[int] | None = None  # each value's numbered (shape, dtype), by id
        self._op_costs: dict[tuple[int, OpStrategy], Cost] = {}
        self._signature_costs: dict[tuple, Cost] = {}  # repeated layers share their prices
        self._views: dict[int, tuple] = {}  # each operator's shapes and dtypes, looked up once
        self._weights: list[float] | None = None  # each node's loop weight, by id
        self._neighbours: tuple[tuple[tuple[int, Edge], ...], ...] | None = None
        self._op_views: dict[int, OpView] = {}
        self._deferred: frozenset[int] | None = None
        self._bucket: float | None = None
        self._siblings: dict[int, float] | None = None
        self._priced: dict[tuple, ProgramCost] = {}
        self._categories: dict[frozenset, frozenset[int]] = {}
        # What a problem build finds that no price changes (the useless factors, the layer
        # groups), by the build's inputs: shared with :meth:`alone`'s space (issue 14).
        self.unpriced: dict[tuple, Any] = {}

    def rule(self, nid: int) -> FactorRule:
        rule = self._rules.get(nid)
        if rule is None:
            rule = self._derive(nid)[0]
        return rule

    def kind(self, nid: int) -> int:
        """A number naming what the node's rule is derived from: nodes of one kind have equal
        rules and equal shapes and dtypes on every operand and result (the nodes of repeated
        layers are of one kind; a node whose parameters cannot be hashed is a kind alone).

        >>> import jax, jax.numpy as jnp
        >>> from jaxpar._src.cost import CostModel
        >>> from jaxpar._src.hardware import HardwareProfile
        >>> from jaxpar._src.spec import MeshShape
        >>> from jaxpar._src.trace import trace
        >>> x = jnp.ones((4, 8))
        >>> graph = trace(lambda x: jnp.tanh(jnp.tanh(x)) @ jnp.ones((8, 2)), (x,)).graph
        >>> space = SearchSpace(graph, CostModel(MeshShape(("x",), (2,)),
        ...                                      HardwareProfile()))
        >>> a, b = [n.id for n in graph.nodes if n.name == "tanh"]
        >>> space.kind(a) == space.kind(b), space.rule(a) is space.rule(b)
        (True, True)
        >>> dot = next(n.id for n in graph.nodes if n.name == "dot_general")
        >>> space.kind(dot) == space.kind(a)
        False
        """
        kind = self._kinds.get(nid)
        if kind is None:
            kind = self._derive(nid)[1]
        return kind

    def _derive(self, nid: int) -> tuple[FactorRule, int]:
        """The node's rule and kind, found by its signature (what :func:`rule_for` reads: the
        node's kind, role and name, its operands' and results' shapes and dtypes, an
        operator's parameters) before any rule is built: the nodes of repeated layers share
        one signature, and build no view (issue 14: the baseline propagation derived the rule
        of every operator of a deep model afresh)."""
        node = self.graph.nodes[nid]
        signature = self._signature(node)
        try:
            found = self._signatures.get(signature)
        except TypeError:  # parameters that cannot be hashed (arrays): a kind of its own
            found = (self._built(node), -1 - nid)
        if found is None:
            found = self._signatures[signature] = (self._built(node), len(self._signatures))
        self._rules[nid], self._kinds[nid] = found
        return found

    def _built(self, node: Node) -> FactorRule:
        rule = rule_for(self.graph, node, self._op_view(node))
        return self._canonical.setdefault(rule, rule)

    def _signature(self, node: Node) -> tuple:
        types = self._types
        if types is None:  # each value's shape and dtype as one number, numbered once
            types = self._types = [self._type(v.shape, v.dtype) for v in self.graph.values]
        ins = tuple([types[o] if o.__class__ is int else self._operand_type(o)
                     for o in node.inputs])
        outs = tuple([types[o] for o in node.outputs])
        params = node.eqn.params.items() \
            if node.kind is NodeKind.OP and node.eqn is not None else ()
        return node.kind, node.role, node.name, ins, outs, tuple(params)

    def _type(self, shape: tuple[int, ...], dtype: Any) -> int:
        return self._type_ids.setdefault((shape, dtype), len(self._type_ids))

    def _operand_type(self, operand: Any) -> int:
        if isinstance(operand, Const):
            return self._type(operand.shape, operand.dtype)
        return self._type(self.graph.operand_shape(operand), self.graph.operand_dtype(operand))

    def _op_view(self, node: Node) -> OpView | None:
        """An operator's shapes, dtypes and parameters, worked out once for its rule and its
        price (issue 14); ``None`` for other nodes."""
        if node.kind is not NodeKind.OP:
            return None
        view = self._op_views.get(node.id)
        if view is None:
            view = self._op_views[node.id] = op_view(self.graph, node)
        return view

    def candidates(self, nid: int) -> tuple[OpStrategy, ...]:
        return enumerate_strategies(self.rule(nid), self.model.mesh)

    def op_cost(self, nid: int, strategy: OpStrategy) -> Cost:
        """The operator's compute and own collectives, as the searches price them: a deferred
        operator's all-reduces pay their share of a combined all-reduce of
        :attr:`bucket_bytes` (``combine.py``)."""
        key = (nid, strategy)
        cost = self._op_costs.get(key)
        if cost is None:
            node = self.graph.nodes[nid]
            view = self._views.get(nid)
            if view is None:  # every candidate of a node, and every plan priced, asks again
                view = self._views[nid] = _shapes(self.graph, node, self._op_view(node))
            rule = self.rule(nid)
            bucket = self.bucket_of(nid)
            signature = (rule, strategy, view[1], view[3], node.weight, bucket)
            cost = self._signature_costs.get(signature)
            if cost is None:
                cost = self._signature_costs[signature] = self.model.op_cost(
                    rule, strategy, *view, weight=node.weight, bucket=bucket)
            self._op_costs[key] = cost
        return cost

    def flops(self, nid: int, strategy: OpStrategy) -> float:
        """``op_cost(nid, strategy).flops`` without the rest of the price: a whole plan's price
        needs only this of every operator, most of them in layouts no search priced.  The
        operator's FLOPs over the devices ``strategy`` splits them on (``CostModel.op_flops``,
        the same sum), that split found once per strategy (``CostModel.split``)."""
        rule = self._rules.get(nid)
        if rule is None:
            rule = self.rule(nid)
        return rule.flops / self.model.split(strategy) * self.graph.nodes[nid].weight

    def _plan_flops(self, strategies: Mapping[int, OpStrategy], nodes: list[int]
                    ) -> dict[int, float]:
        """:meth:`flops` of every node of a plan, as one loop: the operator's FLOPs over the
        devices its strategy splits them on (``CostModel.op_flops``, the same sum), that
        split found once per strategy (issue 14: a plan's price asked :meth:`flops` of every
        node, and the plans compared differ in most nodes' strategy objects)."""
        rules = self._rules
        splits = self.model._splits
        split = self.model.split
        graph_nodes = self.graph.nodes
        out = {}
        for n in nodes:
            strategy = strategies[n]
            k = splits.get(strategy)
            if k is None:
                k = split(strategy)
            rule = rules.get(n)
            if rule is None:
                rule = self.rule(n)
            out[n] = rule.flops / k * graph_nodes[n].weight
        return out

    def in_category(self, *categories: OpCategory) -> frozenset[int]:
        """The operators whose rule declares one of ``categories`` (``register_rule``'s
        ``category=``): what the pricing and pruning treat as contractions or indexing."""
        key = frozenset(categories)
        found = self._categories.get(key)
        if found is None:
            found = self._categories[key] = frozenset(
                n.id for n in self.graph.nodes
                if n.kind is NodeKind.OP and self.rule(n.id).category in key)
        return found

    @property
    def contractions(self) -> frozenset[int]:
        return self.in_category(OpCategory.CONTRACTION)

    @property
    def deferred(self) -> frozenset[int]:
        """Operators whose results reach no contraction (gradients, optimizer, loss): XLA
        combines their all-reduces, and nothing heavy waits for them."""
        if self._deferred is None:
            self._deferred = deferred_nodes(self.graph, self.contractions)
        return self._deferred

    @property
    def bucket_bytes(self) -> float:
        """Bytes of the combined all-reduce a deferred all-reduce travels in (0: XLA does not
        combine all-reduces on this hardware)."""
        if self._bucket is None:
            self._bucket = deferred_bucket(self.graph, self.model, self.deferred,
                                           self.contractions)
        return self._bucket

    def bucket_of(self, nid: int) -> float:
        """Bytes of the combined all-reduce the operator's all-reduces travel in (0: alone):
        deferred operators' all-reduces travel with the gradients; contractions whose results
        are summed with their siblings' travel with those (``combine.py``)."""
        deferred = self._deferred  # (asked of every node by every pass: no property)
        if deferred is None:
            deferred = self.deferred
        if nid in deferred:
            bucket = self._bucket
            return self.bucket_bytes if bucket is None else bucket
        siblings = self._siblings
        if siblings is None:
            siblings = self._siblings = sibling_buckets(self.graph, self.contractions) \
                if self.model.hw.combine_threshold("all-reduce") > 0 else {}
        return siblings.get(nid, 0.0)

    def alone(self) -> SearchSpace:
        """This space with every gradient all-reduce priced on its own (no combining)."""
        other = SearchSpace(self.graph, self.model, self.optimizer_level)
        other.regathered = self.regathered
        other._rules = self._rules
        other._canonical = self._canonical
        other._kinds = self._kinds
        other._signatures = self._signatures
        other._type_ids = self._type_ids
        other._types = self._types
        other._views = self._views
        other._neighbours = self._neighbours
        other._op_views = self._op_views
        other._signature_costs = self._signature_costs  # keyed on the bucket: still right
        other._deferred = self.deferred
        other._siblings = self._siblings
        other._categories = self._categories
        other.unpriced = self.unpriced
        other._bucket = 0.0
        return other

    def calibrate(self, strategies: Mapping[int, OpStrategy]) -> None:
        """Sets :attr:`bucket_bytes` from a full plan (pure data parallel): the size of the
        combined all-reduces its gradients become."""
        # as the searches price the gradients: all-reduced (at levels 1-3 the lowering makes
        # them by reduce-scatter, which the whole plan's price then says)
        priced = self.price(strategies, as_lowered=False)
        buckets = [c.nbytes for c in priced.collectives if c.deferred]
        if buckets:
            self._bucket = sum(buckets) / len(buckets)
            # Only the deferred operators' prices depend on the bucket; the signature prices
            # are keyed on it, so they stay right (and the baseline's are reused).
            deferred = self.deferred
            self._op_costs = {k: c for k, c in self._op_costs.items() if k[0] not in deferred}

    def neighbours(self, nid: int) -> tuple[tuple[int, Edge], ...]:
        """The node's edges to other searchable nodes (not to itself, nor to a control node),
        each with the node at its other end, in :meth:`OpGraph.neighbours` order: what a
        propagation reads of a node's surroundings, worked out once for every node (issue 14:
        the baseline propagation walked each node's edges twice, sorting them out each time).
        """
        around = self._neighbours
        if around is None:
            nodes, control = self.graph.nodes, NodeKind.CONTROL
            around = self._neighbours = tuple(
                tuple([(o, e) for e in edges
                       for o in (e.consumer if e.producer == n else e.producer,)
                       if o != n and nodes[o].kind is not control])
                for n, edges in enumerate(self.graph._around))
        return around[nid]

    def edge_weight(self, producer: int, consumer: int) -> float:
        """How often a layout change on this edge runs: once per run of the rarer end."""
        weights = self._weights
        if weights is None:  # (asked once per edge by every pass: issue 14)
            weights = self._weights = [n.weight for n in self.graph.nodes]
        a, b = weights[producer], weights[consumer]
        return b if b < a else a

    def edge_time(self, producer: int, out_index: int, src: Spec, consumer: int, dst: Spec
                  ) -> float:
        """Seconds of the layout change ``src -> dst`` on an edge, per program call."""
        value = self.graph.values[self.graph.nodes[producer].outputs[out_index]]
        colls = self.model.redistribution(src, dst, value.shape, value.dtype)
        if not colls:
            return 0.0
        return self.edge_weight(producer, consumer) * sum(c.time for c in colls)

    def lowered(self, strategies: Mapping[int, OpStrategy]
                ) -> tuple[Mapping[int, OpStrategy], dict[int, Scatter]]:
        """``strategies`` as the lowering runs them, and the contractions it lowers by
        reduce-scatter (ZeRO levels 1-3: ``scatter_plan.py``; else unchanged, none)."""
        if self.optimizer_level not in LEVELS:
            return strategies, {}
        return lowered(self.graph, strategies, self.model.mesh)

    def price(self, strategies: Mapping[int, OpStrategy], as_lowered: bool = True,
              regathered: frozenset[int] | None = None) -> ProgramCost:
        """A full assignment priced as XLA runs it: combined collectives, overlap, step time;
        at ZeRO levels 1-3 its split gradients reduce-scattered (:meth:`lowered`), at level 3
        the split parameters ``regathered`` (default :attr:`regathered`) gathered again for
        the backward pass (``regather.py``); ``as_lowered=False``: neither, the gradients
        all-reduced, as the searches price each node."""
        nodes = [n.id for n in self.graph.searchable()]
        as_lowered = as_lowered and self.optimizer_level in LEVELS  # one price when alike
        split = (self.regathered if regathered is None else regathered) if as_lowered \
            else frozenset()
        key = (tuple(strategies[n] for n in nodes), as_lowered, split)
        found = self._priced.get(key)
        if found is None:
            if len(self._priced) > 8:  # a few plans are compared; keep the memory small
                self._priced.clear()
            scatters: dict[int, Scatter] = {}
            if as_lowered:
                strategies, scatters = self.lowered(strategies)
            # the backward readers as lowered (a reduce-scattered gradient's layouts)
            again = Regather.find(self.graph, strategies, split) if split else None
            flops = self._plan_flops(strategies, nodes)
            found = self._priced[key] = price_plan(self.graph, strategies, self.model, flops,
                                                   self.deferred, self.edge_weight,
                                                   scatters, again)
        return found

    def total_time(self, strategies: Mapping[int, OpStrategy]) -> float:
        """Seconds of a full assignment as the searches price it (every node's cost and every
        layout change, each on its own); :meth:`price` is what XLA will run."""
        graph = self.graph
        hw = self.model.hw
        total = sum(self.op_cost(n.id, strategies[n.id]).time(hw) for n in graph.searchable())
        for e in graph.priced_edges():
            src = strategies[e.producer].out_specs[e.out_index]
            dst = strategies[e.consumer].in_specs[e.in_index]
            if src != dst:
                total += self.edge_time(e.producer, e.out_index, src, e.consumer, dst)
        return total

    def edge_cost(self, producer: int, out_index: int, src: Spec, consumer: int, dst: Spec
                  ) -> Cost:
        value = self.graph.values[self.graph.nodes[producer].outputs[out_index]]
        return self.model.edge_cost(src, dst, value.shape, value.dtype,
                                    self.edge_weight(producer, consumer))


def _shapes(graph: OpGraph, node: Node, view: OpView | None) -> tuple:
    if view is not None:  # an operator's
        return view.in_shapes, view.in_dtypes, view.out_shapes, view.out_dtypes
    ins = tuple(graph.operand_shape(o) for o in node.inputs)
    in_dt = tuple(graph.operand_dtype(o) for o in node.inputs)
    outs = tuple(graph.values[v].shape for v in node.outputs)
    out_dt = tuple(graph.values[v].dtype for v in node.outputs)
    return ins, in_dt, outs, out_dt
