"""Per-primitive sharding rules and the rules of jaxpar's pseudo-operators.

Importing this package registers every rule; :func:`rule_for` is what the search calls.
"""

from __future__ import annotations

from jaxpar._src.graph import Node, NodeKind, OpGraph, Role
from jaxpar._src.rules import contraction, elementwise, indexing, random, reductions, shape_ops
from jaxpar._src.rules.factors import (
    FactorRule,
    OpCategory,
    OpStrategy,
    RuleBuilder,
    enumerate_strategies,
    specs_for,
    strategy_for_specs,
)
from jaxpar._src.rules.registry import OpView, register_rule, registered_primitives, rule_of

__all__ = [
    "FactorRule", "OpCategory", "OpStrategy", "OpView", "RuleBuilder", "enumerate_strategies",
    "op_view", "register_rule", "registered_primitives", "rule_for", "specs_for",
    "strategy_for_specs",
]
del contraction, elementwise, indexing, random, reductions, shape_ops
from jaxpar._src.rules import stacking  # noqa: E402, F401 - registers stack / unstack

IDENTITY_OPS = ("sharding_constraint",)


def op_view(graph: OpGraph, node: Node) -> OpView:
    return OpView(
        node.name,
        tuple(graph.operand_shape(o) for o in node.inputs),
        tuple(graph.operand_dtype(o) for o in node.inputs),
        tuple(graph.values[v].shape for v in node.outputs),
        tuple(graph.values[v].dtype for v in node.outputs),
        node.eqn.params if node.eqn is not None else {},
    )


def rule_for(graph: OpGraph, node: Node, view: OpView | None = None) -> FactorRule:
    """The factor rule of any searchable node; ``view``: an operator's :func:`op_view`, when
    the caller has it already."""
    if node.kind is NodeKind.OP and node.name not in IDENTITY_OPS:
        return rule_of(op_view(graph, node) if view is None else view)
    b = RuleBuilder()
    if node.kind in (NodeKind.INPUT, NodeKind.CONST):
        return b.build([], [b.factors(graph.values[node.outputs[0]].shape)])
    if node.kind is NodeKind.OUTPUT:
        return b.build([b.factors(graph.operand_shape(node.inputs[0]))], [])
    if node.role is Role.XS:
        outer = graph.operand_shape(node.inputs[0])
        lead = b.factor(outer[0], blocked=True)
        dims = b.factors(outer[1:])
        return b.build([[lead] + dims], [dims])
    if node.role is Role.YS:
        inner = graph.operand_shape(node.inputs[0])
        dims = b.factors(inner)
        lead = b.factor(graph.values[node.outputs[0]].shape[0], blocked=True)
        return b.build([dims], [[lead] + dims])
    # Identity over every operand and result: sharding_constraint, loop carries, consts, merges.
    shape = (graph.values[node.outputs[0]].shape if node.outputs
             else graph.operand_shape(node.inputs[0]))
    dims = b.factors(shape)
    operands = [dims if graph.operand_shape(o) == shape else [None] * len(graph.operand_shape(o))
                for o in node.inputs]
    return b.build(operands, [dims] * len(node.outputs))
