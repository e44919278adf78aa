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


def reclass_call(module: Any, cache: dict[type, type], marker: str,
                 wrap: Callable[[type], Callable]) -> Any:
    """Re-classes ``module`` in place as a subclass of its class whose ``__call__`` is
    ``wrap(base)`` (made once per base class, kept in ``cache``), as ``jaxpar.pipeline_stage``
    and ``jaxpar.recompute`` mark NNX modules: class attributes survive ``nnx.split``/``merge``.
    The subclass names its base in its own ``marker`` attribute, so marking it again wraps the
    base, not the wrapper, while another kind of mark above it is kept.

    >>> class Net:
    ...     def __call__(self, x):
    ...         return x + 1
    >>> wrap = lambda base: lambda self, x: 2 * base.__call__(self, x)
    >>> net = reclass_call(Net(), {}, "_doubled", wrap)
    >>> net(1), type(net).__name__, type(net)._doubled is Net
    (4, 'Net', True)
    """
    cls = type(module)
    base = cls.__dict__.get(marker, cls)
    sub = cache.get(base)
    if sub is None:
        sub = cache[base] = type(base.__name__, (base,), {
            "__call__": wrap(base), "__module__": base.__module__,
            "__qualname__": base.__qualname__, marker: base, "__doc__": base.__doc__})
    object.__setattr__(module, "__class__", sub)
    return module


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
