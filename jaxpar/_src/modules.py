"""Named parameters of a Flax NNX module, for ``shard(module, parameter_plan=...)``.

MindSpore's ``Cell.shard(parameter_plan={"fc1.weight": ...})`` names a cell's own parameters.
The NNX equivalent is a module (or a bound method of one) whose ``Param`` variables are found by
their attribute path, e.g. ``"fc1.kernel"`` or ``"blocks.0.attn.q.kernel"``.  Flax is optional:
without it no function is a module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def module_of(fn: Callable) -> Any | None:
    """The NNX module ``fn`` is, or is a bound method of; ``None`` otherwise."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is an optional dependency
        return None
    for candidate in (fn, getattr(fn, "__self__", None)):
        if isinstance(candidate, nnx.Module):
            return candidate
    return None


def module_params(module: Any) -> list[tuple[str, Any]]:
    """``(dotted path, Param variable)`` for every parameter of ``module``."""
    from flax import nnx

    out = []
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Param):
            out.append((".".join(str(k) for k in path), node))
    return out


def get_value(var: Any) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def set_value(var: Any, value: Any) -> None:
    if hasattr(var, "set_value"):
        var.set_value(value)
    else:  # pragma: no cover - older flax
        var.value = value
