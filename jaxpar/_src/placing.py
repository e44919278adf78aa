"""Moving a call's arguments to the plan's layouts (or standing them in as abstract values).

``Parallelized`` places the dynamic leaves of a call's arguments on the shardings its plan
chose before running the jitted function, and lowers from abstract stand-ins laid out the same
way.  The leaves that move go in one ``jax.device_put`` (JAX batches the transfers of a call).

>>> import jax, jax.numpy as jnp
>>> s = jax.sharding.SingleDeviceSharding(jax.devices()[0])
>>> placed_as((jnp.ones(2), 3), (1,), (s,), abstract_as)[0].shape
(2,)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxpar._src.trace import wider_than_canonical


def placed_as(args: tuple, static: Sequence[int], in_shardings: tuple[Any, ...],
              place: Callable[[Any, Any], Any]) -> list:
    """``args`` with ``place(leaf, sharding)`` for each dynamic leaf (static ones as they are)."""
    dyn = [a for i, a in enumerate(args) if i not in static]
    leaves, tree = jax.tree.flatten(dyn)
    if place is place_leaf:
        placed = place_all(leaves, in_shardings)
    else:
        placed = [place(x, s) for x, s in zip(leaves, in_shardings, strict=True)]
    it = iter(jax.tree.unflatten(tree, placed))
    return [a if i in static else next(it) for i, a in enumerate(args)]


def abstract_as(x: Any, sharding: Any) -> Any:
    """An array as its shape, dtype and the plan's layout (what ``lower`` needs: moving the
    data there would compile and run resharding programs for nothing).  A 64-bit array outside
    ``jax_enable_x64`` is placed instead: its struct would canonicalize to 32 bits, while the
    program was traced, as ``jax.jit`` traces it, for the array's own dtype."""
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        if wider_than_canonical(x.dtype):
            return place_leaf(x, sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
    return x


def moves(x: Any, sharding: Any) -> bool:
    """Whether ``x`` is an array not yet laid out as ``sharding``."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    try:
        return not x.sharding.is_equivalent_to(sharding, x.ndim)
    except Exception:  # noqa: BLE001 - different device sets compare by moving
        return True


def place_leaf(x: Any, sharding: Any) -> Any:
    """``x`` laid out as ``sharding`` (moved only if it is not already)."""
    return jax.device_put(x, sharding) if moves(x, sharding) else x


def place_all(leaves: Sequence[Any], shardings: Sequence[Any]) -> list:
    """``leaves`` laid out as ``shardings``: the ones that move in one ``jax.device_put`` (JAX
    batches the transfers of one call: 0.48-0.63 s against 0.62-1.2 s leaf by leaf for the
    24-layer GPT's 880 replicated leaves on 8 CPU devices)."""
    out = list(leaves)
    move = [i for i, (x, s) in enumerate(zip(leaves, shardings, strict=True)) if moves(x, s)]
    if move:
        for i, y in zip(move, jax.device_put([leaves[i] for i in move],
                                             [shardings[i] for i in move]), strict=True):
            out[i] = y
    return out
