"""User strategies for whole arguments and results: trees of strategies, names, and pins.

``in_strategy`` has one entry per positional argument; an entry is one strategy (applied to every
array of that argument) or a tree of strategies that is a prefix of the argument's pytree.
``parameter_plan`` maps parameter names (``"w1"``, ``"params.layers.0.kernel"``, or glob
patterns such as ``"*.kernel"``) to strategies.  Both are normalised into one :class:`Spec` (or
``None``) per flattened array.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar._src.errors import StrategyError
from jaxpar._src.spec import Spec
from jaxpar._src.strategy import is_strategy_leaf, normalize
from jaxpar._src.trace import dotted


def leaf_names(args: Sequence[Any], arg_names: Sequence[str]) -> list[tuple[int, str]]:
    """``(argument index, dotted name)`` of every array leaf of ``args``, in flatten order."""
    out = []
    for i, a in enumerate(args):
        for path, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            name = dotted(path)
            out.append((i, f"{arg_names[i]}.{name}" if name else arg_names[i]))
    return out


def expand_tree(strategy: Any, tree: Any, *, where: str) -> list[Any]:
    """One strategy per leaf of ``tree``, from a strategy or a prefix tree of strategies."""
    n = len(jax.tree.leaves(tree))
    if is_strategy_leaf(strategy):
        return [strategy] * n
    try:
        per_subtree = jax.tree.map(lambda s, sub: _Group(s, len(jax.tree.leaves(sub))),
                                   strategy, tree, is_leaf=is_strategy_leaf)
    except (ValueError, TypeError) as e:
        raise StrategyError(
            f"{where}: the strategy tree does not match the structure of the value "
            f"({jax.tree.structure(tree)}): {e}. Give one strategy for the whole value or a "
            f"tree with the same containers and keys.") from None
    groups = jax.tree.leaves(per_subtree, is_leaf=lambda x: isinstance(x, _Group))
    return [g.strategy for g in groups for _ in range(g.count)]


class _Group:
    """A strategy standing for ``count`` leaves (an opaque leaf while flattening)."""

    def __init__(self, strategy: Any, count: int) -> None:
        self.strategy = strategy
        self.count = count


def argument_strategies(in_strategy: Any, args: Sequence[Any], arg_names: Sequence[str], *,
                        api: str) -> list[Any]:
    """Raw (unnormalised) strategy per flattened leaf of ``args``, from ``in_strategy``."""
    n_leaves = len(jax.tree.leaves(list(args)))
    if in_strategy is None:
        return [None] * n_leaves
    entries = in_strategy
    if is_strategy_leaf(in_strategy):
        if len(args) != 1:
            raise StrategyError(
                f"{api}: in_strategy={in_strategy!r} is one strategy, but the function takes "
                f"{len(args)} arguments ({', '.join(arg_names)}). Give a tuple with one "
                f"strategy per argument, e.g. in_strategy=({in_strategy!r}, None).")
        entries = (in_strategy,)
    if not isinstance(entries, (tuple, list)) or len(entries) != len(args):
        raise StrategyError(
            f"{api}: in_strategy has {len(entries) if isinstance(entries, (tuple, list)) else 1} "
            f"entries but the function takes {len(args)} arguments ({', '.join(arg_names)}). "
            f"Give one strategy (or None) per argument.")
    out = []
    for i, (entry, arg) in enumerate(zip(entries, args, strict=True)):
        out.extend(expand_tree(entry, arg, where=f"{api}: in_strategy[{i}] (argument "
                                                 f"'{arg_names[i]}')"))
    return out


def output_strategies(out_strategy: Any, out_shapes: Any, *, api: str) -> list[Any]:
    """Raw strategy per flattened output leaf."""
    n = len(jax.tree.leaves(out_shapes))
    if out_strategy is None:
        return [None] * n
    if not is_strategy_leaf(out_strategy) and isinstance(out_strategy, (tuple, list)) and \
            len(out_strategy) == 1 and is_strategy_leaf(out_strategy[0]) and \
            not isinstance(out_shapes, (tuple, list)):
        out_strategy = out_strategy[0]  # MindSpore style: one strategy per output, one output
    return expand_tree(out_strategy, out_shapes, where=f"{api}: out_strategy")


def parameter_plan_strategies(parameter_plan: Mapping[str, Any] | None,
                              names: Sequence[str], *, api: str) -> list[Any]:
    """Raw strategy per leaf named in ``names`` from name patterns; unmatched keys raise."""
    out: list[Any] = [None] * len(names)
    if not parameter_plan:
        return out
    for pattern, strategy in parameter_plan.items():
        hits = [k for k, name in enumerate(names) if _matches(pattern, name)]
        if not hits:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise StrategyError(
                f"{api}: parameter_plan key {pattern!r} names no parameter. Parameters are: "
                f"{shown}. Use one of these names or a glob pattern such as '*.kernel'.")
        for k in hits:
            out[k] = strategy
    return out


def _matches(pattern: str, name: str) -> bool:
    short = name.split(".", 1)[1] if "." in name else name
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(short, pattern)


def normalize_all(raw: Sequence[Any], shapes: Sequence[tuple[int, ...]],
                  dtypes: Sequence[Any], mesh: Mesh, wheres: Sequence[str]) -> list[Spec | None]:
    return [normalize(s, shape, mesh, where=w, dtype=dt)
            for s, shape, dt, w in zip(raw, shapes, dtypes, wheres, strict=True)]


def merge(first: list[Any], second: list[Any], names: Sequence[str], *, api: str) -> list[Any]:
    """Combines two per-leaf strategy lists; a leaf given in both must agree."""
    out = []
    for a, b, name in zip(first, second, names, strict=True):
        if a is not None and b is not None and a != b:
            raise StrategyError(
                f"{api}: '{name}' has a strategy in both in_strategy ({a!r}) and parameter_plan "
                f"({b!r}); give it in one place.")
        out.append(a if a is not None else b)
    return out
