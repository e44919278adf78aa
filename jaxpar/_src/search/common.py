"""What every search shares: candidate strategies and costs per node, pins, and the result."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxpar._src.cost import Cost, CostModel
from jaxpar._src.graph import Node, NodeKind, OpGraph
from jaxpar._src.rules import (
    FactorRule,
    OpCategory,
    OpStrategy,
    enumerate_strategies,
    op_view,
    rule_for,
)
from jaxpar._src.spec import Spec


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

    def __init__(self, graph: OpGraph, model: CostModel) -> None:
        self.graph = graph
        self.model = model
        self._rules: dict[int, FactorRule] = {}
        self._op_costs: dict[tuple[int, OpStrategy], Cost] = {}
        self._signature_costs: dict[tuple, Cost] = {}  # repeated layers share their prices
        self._gradients: frozenset[int] | None = None

    def rule(self, nid: int) -> FactorRule:
        rule = self._rules.get(nid)
        if rule is None:
            rule = self._rules[nid] = rule_for(self.graph, self.graph.nodes[nid])
        return rule

    def candidates(self, nid: int) -> tuple[OpStrategy, ...]:
        return enumerate_strategies(self.rule(nid), self.model.mesh)

    def op_cost(self, nid: int, strategy: OpStrategy) -> Cost:
        key = (nid, strategy)
        cost = self._op_costs.get(key)
        if cost is None:
            node = self.graph.nodes[nid]
            view = _shapes(self.graph, node)
            rule = self.rule(nid)
            combined = nid in self.gradients
            signature = (rule, strategy, view[1], view[3], node.weight, combined)
            cost = self._signature_costs.get(signature)
            if cost is None:
                cost = self._signature_costs[signature] = self.model.op_cost(
                    rule, strategy, *view, weight=node.weight, combined=combined)
            self._op_costs[key] = cost
        return cost

    @property
    def gradients(self) -> frozenset[int]:
        """Operators whose results reach a non-scalar result of the program through no other
        contraction: gradients (and the updates made from them).  Their partial-sum
        all-reduces are independent of one another, and XLA combines them."""
        if self._gradients is None:
            graph = self.graph
            seen: set[int] = set()
            work = [n for n in graph.outputs if graph.nodes[n].inputs and
                    graph.operand_shape(graph.nodes[n].inputs[0])]
            while work:
                nid = work.pop()
                if nid in seen:
                    continue
                seen.add(nid)
                node = graph.nodes[nid]
                if self.rule(nid).category is OpCategory.CONTRACTION \
                        and nid not in graph.outputs:
                    continue  # the contraction that made the gradient: stop here
                for o in node.inputs:
                    if isinstance(o, int):
                        work.append(graph.values[o].producer)
            self._gradients = frozenset(seen)
        return self._gradients

    def edge_weight(self, producer: int, consumer: int) -> float:
        """How often a layout change on this edge runs: once per run of the rarer end."""
        return min(self.graph.nodes[producer].weight, self.graph.nodes[consumer].weight)

    def edge_time(self, producer: int, out_index: int, src: Spec, consumer: int, dst: Spec
                  ) -> float:
        """Seconds of the layout change ``src -> dst`` on an edge, per program call."""
        value = self.graph.values[self.graph.nodes[producer].outputs[out_index]]
        colls = self.model.redistribution(src, dst, value.shape, value.dtype)
        if not colls:
            return 0.0
        return self.edge_weight(producer, consumer) * sum(c.time for c in colls)

    def total_time(self, strategies: Mapping[int, OpStrategy]) -> float:
        """Simulated seconds of a full assignment: every node's cost and every layout change."""
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


def _shapes(graph: OpGraph, node: Node) -> tuple:
    if node.kind is NodeKind.OP:
        view = op_view(graph, node)
        return view.in_shapes, view.in_dtypes, view.out_shapes, view.out_dtypes
    ins = tuple(graph.operand_shape(o) for o in node.inputs)
    in_dt = tuple(graph.operand_dtype(o) for o in node.inputs)
    outs = tuple(graph.values[v].shape for v in node.outputs)
    out_dt = tuple(graph.values[v].dtype for v in node.outputs)
    return ins, in_dt, outs, out_dt
