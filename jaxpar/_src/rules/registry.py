"""The per-primitive rule registry: one pure rule per primitive, registered by decorator.

A rule reads the operator's operand and result shapes and its parameters and returns a
:class:`FactorRule`.  It never looks at the mesh or at global state.  A primitive without a rule
is replicated, with one warning naming it.

>>> from jaxpar._src.rules.factors import RuleBuilder
>>> @register_rule("my_identity_prim")
... def _my_identity_rule(op):
...     b = RuleBuilder()
...     dims = b.factors(op.out_shapes[0])
...     return b.build([dims], [dims])
>>> "my_identity_prim" in registered_primitives()
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jaxpar._src.errors import warn_once
from jaxpar._src.rules.factors import FactorRule, RuleBuilder


@dataclasses.dataclass(frozen=True)
class OpView:
    """What a rule may read about an operator."""

    name: str
    in_shapes: tuple[tuple[int, ...], ...]
    in_dtypes: tuple[Any, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    out_dtypes: tuple[Any, ...]
    params: Mapping[str, Any]


RuleFn = Callable[[OpView], FactorRule]
_RULES: dict[str, RuleFn] = {}
_BUILT: dict[tuple, FactorRule] = {}  # rules already built, by view


def register_rule(*names: str) -> Callable[[RuleFn], RuleFn]:
    """Registers ``fn`` as the rule of the primitives ``names``."""

    def deco(fn: RuleFn) -> RuleFn:
        for name in names:
            if name in _RULES:
                raise ValueError(f"a rule for primitive {name!r} is already registered "
                                 f"({_RULES[name].__qualname__})")
            _RULES[name] = fn
        return fn

    return deco


def registered_primitives() -> frozenset[str]:
    return frozenset(_RULES)


def replicated_rule(op: OpView) -> FactorRule:
    """Every dimension whole: the always-correct fallback."""
    b = RuleBuilder()
    return b.build([[None] * len(s) for s in op.in_shapes],
                   [[None] * len(s) for s in op.out_shapes])


def rule_of(op: OpView) -> FactorRule:
    """The rule for ``op``; an unknown primitive is replicated and warned about once.

    A rule depends on the view only, so repeated layers build each rule once."""
    fn = _RULES.get(op.name)
    if fn is None:
        warn_once(
            f"unsupported:{op.name}",
            f"jaxpar has no sharding rule for primitive '{op.name}'; it is computed replicated "
            f"(correct, but every device does all of its work). Register one with "
            f"jaxpar.register_rule('{op.name}') if it matters.")
        return replicated_rule(op)
    try:
        key = (op.name, op.in_shapes, op.in_dtypes, op.out_shapes, op.out_dtypes,
               tuple(op.params.items()))  # same primitive, same order: no sort needed
        rule = _BUILT.get(key)
    except TypeError:  # parameters that cannot be hashed (arrays): build it afresh
        return fn(op)
    if rule is None:
        if len(_BUILT) > 65536:
            _BUILT.clear()
        rule = _BUILT[key] = fn(op)
    return rule
