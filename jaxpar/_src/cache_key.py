"""The cache key of one call: what ``jax.jit`` keys its compiled programs on.

A plan (and the program compiled from it) may be reused only for a call that ``jax.jit`` would
serve from the same cache entry, or jaxpar would run a program traced for other types:

* every array argument by its pytree structure and abstract value: shape, dtype *and weak type*
  (``x * 1.001`` with a Python float keeps ``x``'s dtype; with ``jnp.float32(1.001)`` it
  promotes, so the two are different programs);
* every static argument by its type *and* value: ``1``, ``1.0`` and ``True`` are equal and hash
  alike in Python but trace different programs (``jnp.full((2,), n)`` is int32, float32 or
  bool), so, as ``jax.jit`` does, the type is part of the key; an unhashable static argument is
  an error;
* the configuration a trace depends on (``jax_enable_x64``, default matmul precision, dtype
  promotion, the mesh set by ``jax.set_mesh``, ...): JAX's own trace context.

>>> import jax.numpy as jnp
>>> call_key((jnp.ones(2), 1.0), (), api="f") == call_key((jnp.ones(2), 1), (), api="f")
False
>>> call_key((1,), (0,), api="f") == call_key((True,), (0,), api="f")
False
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxpar._src.compat import trace_context
from jaxpar._src.errors import PlanError


def call_key(args: Sequence[Any], static_argnums: Sequence[int], *, api: str,
             names: Sequence[str] | None = None) -> tuple[Any, ...]:
    """A hashable key equal for two calls exactly when ``jax.jit`` would reuse its program."""
    parts: list[Any] = [trace_context()]
    for i, a in enumerate(args):
        name = names[i] if names is not None and i < len(names) else f"arg{i}"
        if i in static_argnums:
            parts.append(("static", static_key(a, where=f"{api}: static argument {i} ('{name}')")))
            continue
        leaves, tree = jax.tree.flatten(a)
        parts.append((tree, tuple(aval_key(x, where=f"{api}: argument {i} ('{name}')")
                                  for x in leaves)))
    return tuple(parts)


def aval_key(x: Any, *, where: str) -> tuple[Any, ...]:
    """``(shape, dtype, weak_type)`` of an array-like leaf, as JAX sees it."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        raise PlanError(
            f"{where} holds a {type(x).__name__} ({x!r:.60}), which is not an array. Pass "
            f"arrays (or Python numbers) as arguments, or mark the argument static with "
            f"static_argnums.") from None
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))


def static_key(value: Any, *, where: str) -> Any:
    """A static argument by type and value; containers by their elements' types too."""
    try:
        hash(value)
    except TypeError as e:
        raise PlanError(
            f"{where} is a {type(value).__name__}, which is not hashable ({e}); static "
            f"arguments key the plan cache, as in jax.jit. Pass a hashable value (a tuple "
            f"instead of a list, a frozen dataclass instead of a dict), or make it a regular "
            f"(traced) argument.") from None
    if type(value) is tuple:
        return (tuple, tuple(static_key(v, where=where) for v in value))
    if type(value) is frozenset:
        return (frozenset, frozenset(static_key(v, where=where) for v in value))
    return (type(value), value)
