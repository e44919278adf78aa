"""Operator-level shard: ``jaxpar.shard`` around one operator fixes that operator's strategy.

MindSpore's ``Primitive.shard(in_strategy)`` fixes how the operator itself runs, not only the
layouts around it: ``P.MatMul().shard(((4, 2), (2, 1)))`` computes on a ``4 x 2`` device matrix
with partial sums over the ``2`` (``tests/ut/python/parallel/test_two_matmul.py``,
``test_two_matmul``).  When the function a ``jaxpar.shard`` wraps is exactly one operator
(``x @ w``, ``jnp.matmul``, ``lax.conv_general_dilated``, ...) and every input has a strategy:

* its slice counts are read as the operator's device matrix, the operator's loop dimensions in
  order of first appearance (``[i, k, j]`` for a matmul, MindSpore's ``matmul_info.cc``), and laid
  on the mesh together, so its inputs agree on the shared dimensions (:func:`operator_specs`);
  counts that disagree on a shared dimension are an error, as in MindSpore;
* the operator is traced under the scope :data:`OPERATOR_SCOPE`, and :func:`operator_pins` pins
  its strategy to the one its inputs' layouts give: no search may run it another way.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxpar._src.compat import name_stack
from jaxpar._src.device_matrix import lay_counts
from jaxpar._src.errors import StrategyError
from jaxpar._src.rules import FactorRule, specs_for, strategy_for_specs
from jaxpar._src.rules.registry import OpView, registered_primitives, rule_of
from jaxpar._src.search import Pin, SearchSpace
from jaxpar._src.spec import MeshShape, Spec

OPERATOR_SCOPE = "jaxpar_operator_shard"
_MARKED = re.compile(rf"(?:[a-z_]+\()*{OPERATOR_SCOPE}\)*")


@dataclasses.dataclass(frozen=True)
class Operator:
    """The one operator a sharded function is: its primitive and its factor rule."""

    name: str
    rule: FactorRule


def single_operator(fn: Callable, args: Sequence[Any]) -> Operator | None:
    """The operator ``fn(*args)`` is, if it is exactly one operator applied to its inputs."""
    leaves, tree = jax.tree.flatten(list(args))
    if not leaves or any(not hasattr(x, "shape") for x in leaves):
        return None
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    try:
        closed = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, list(xs))))(*structs)
    except Exception:  # noqa: BLE001 - not traceable alone: not an operator-level shard
        return None
    jaxpr = closed.jaxpr
    if len(jaxpr.eqns) != 1 or jaxpr.constvars:
        return None
    eqn = jaxpr.eqns[0]
    if eqn.primitive.name not in registered_primitives() or \
            list(eqn.invars) != list(jaxpr.invars) or \
            list(eqn.outvars) != list(jaxpr.outvars) or len(eqn.outvars) != 1:
        return None
    view = OpView(eqn.primitive.name, tuple(tuple(v.aval.shape) for v in eqn.invars),
                  tuple(v.aval.dtype for v in eqn.invars),
                  tuple(tuple(v.aval.shape) for v in eqn.outvars),
                  tuple(v.aval.dtype for v in eqn.outvars), eqn.params)
    return Operator(eqn.primitive.name, rule_of(view))


def device_matrix(op: Operator, counts: Sequence[Sequence[int]], *, where: str
                  ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The operator's device matrix from its inputs' slice counts: ``(factors, counts)``, the
    factors in order of first appearance over the inputs' dimensions; ``None`` when the counts
    cut a dimension the operator keeps whole (a sort axis, the minor part of a reshaped
    dimension): then each input is laid by itself and the plan moves data as it must.

    Raises:
      StrategyError: a dimension shared by two inputs is cut differently (MindSpore refuses
        such a strategy too).
    """
    rule = op.rule
    got: dict[int, int] = {}
    seen: dict[int, str] = {}
    for i, (dims, tensor_counts) in enumerate(zip(rule.operands, counts, strict=True)):
        for d, (factors, c) in enumerate(zip(dims, tensor_counts, strict=True)):
            real = [f for f in factors if rule.sizes[f] > 1]
            if not real:
                if c != 1:
                    return None
                continue
            f = real[0]
            if c != 1 and (f in rule.blocked or len(real) > 1):
                return None
            if f in got and got[f] != c:
                raise StrategyError(
                    f"{where}: {op.name}'s inputs cut one shared dimension differently: "
                    f"{seen[f]} in {got[f]}, dimension {d} of input {i} in {c}. MindSpore "
                    f"requires equal counts there (e.g. MatMul ((A, B), (B, C))); make them "
                    f"agree.")
            if f not in got:
                got[f], seen[f] = c, f"dimension {d} of input {i}"
    order = tuple(got)
    return order, tuple(got[f] for f in order)


def operator_specs(op: Operator, counts: Sequence[Sequence[int]], mesh: MeshShape, *,
                   where: str) -> list[Spec] | None:
    """The inputs' layouts when the operator's device matrix is laid on ``mesh`` as a whole,
    or ``None`` when it cannot be (the caller then lays each input by itself)."""
    matrix = device_matrix(op, counts, where=where)
    if matrix is None:
        return None
    order, factor_counts = matrix
    axes = lay_counts(factor_counts, mesh)
    if axes is None:
        return None
    by_factor = dict(zip(order, axes, strict=True))
    strategy = specs_for(op.rule, tuple(by_factor.get(f, ()) for f in range(len(op.rule.sizes))))
    return list(strategy.in_specs)


def is_operator_shard(eqn: Any) -> bool:
    """Whether ``eqn`` is the forward computation of an operator-level shard (not its
    transpose: the backward pass is planned around the pinned forward)."""
    last = name_stack(eqn).rsplit("/", 1)[-1]
    return bool(_MARKED.fullmatch(last)) and "transpose(" not in last


def operator_pins(space: SearchSpace, mesh: MeshShape) -> list[Pin]:
    """Pins the strategy of every operator-level shard: the one its inputs' layouts give."""
    graph = space.graph
    pins = []
    for node in graph.nodes:
        if node.kind != "op" or node.eqn is None or not is_operator_shard(node.eqn):
            continue
        specs = {}
        for i, operand in enumerate(node.inputs):
            if isinstance(operand, int):
                producer = graph.nodes[graph.values[operand].producer]
                if producer.kind == "op" and producer.name == "sharding_constraint":
                    sharding = producer.eqn.params["sharding"]
                    specs[("in", i)] = Spec.from_partition_spec(sharding.spec,
                                                                len(graph.operand_shape(operand)))
                    continue
            break
        else:
            strategy = strategy_for_specs(space.rule(node.id), specs, mesh)
            if strategy is not None:
                pins.append(Pin(node.id, strategy, "shard"))
    return pins
