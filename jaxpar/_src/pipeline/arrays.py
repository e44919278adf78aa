"""Array helpers of the tick loop: slot buffers read and written at a traced index, the floating
inputs (the only ones with gradients) split from the rest, cotangents made dense.

>>> import jax.numpy as jnp
>>> buf = put(jnp.zeros((3, 2)), 1, jnp.ones(2))
>>> get(buf, 1).tolist(), add_at(buf, 1, jnp.ones(2))[1].tolist()
([1.0, 1.0], [2.0, 2.0])
>>> merge([1, 2], floats([jnp.float32(0.5), 2]))
[Array(0.5, dtype=float32), 2]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._src.pipeline.pieces import Pieces, is_float
from jaxpar._src.spec import Spec


def filled(aval: Any, fill: float, lead: tuple[int, ...] = ()) -> Any:
    """An array of ``aval``'s shape (after ``lead``) holding ``fill``; integers hold zero."""
    shape = lead + tuple(aval.shape)
    if is_float(aval):
        return jnp.full(shape, fill, aval.dtype)
    return jnp.zeros(shape, aval.dtype)


def constrain(pieces: Pieces, x: Any, spec: Spec | None, lead: int = 0) -> Any:
    if spec is None:
        return x
    return pieces.constrain(x, Spec(((),) * lead + spec.dims))


def get(buf: Any, i: Any) -> Any:
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def put(buf: Any, i: Any, x: Any) -> Any:
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def add_at(buf: Any, i: Any, x: Any) -> Any:
    if not is_float(buf):
        return buf
    return put(buf, i, get(buf, i) + x.astype(buf.dtype))


def add(a: list, b: list) -> list:
    return [x + y if is_float(x) else x for x, y in zip(a, b, strict=True)]


def floats(xs: Sequence[Any]) -> list:
    """The floating inputs (the only ones with gradients); others become ``None`` leaves."""
    return [x if is_float(x) else None for x in xs]


def merge(full: Sequence[Any], floats: Sequence[Any]) -> list:
    return [f if f is not None else x for x, f in zip(full, floats, strict=True)]


def dense(cts: Sequence[Any], like: Sequence[Any]) -> list:
    """Cotangents as arrays of the primal's dtype (zeros where JAX gave float0 or None)."""
    out = []
    for ct, x in zip(cts, like, strict=True):
        if ct is None or not is_float(x) or getattr(ct, "dtype", None) == jax.dtypes.float0:
            out.append(jnp.zeros(jnp.shape(x), jnp.result_type(x)))
        else:
            out.append(ct.astype(jnp.result_type(x)))
    return out


def floats_like(cts: Sequence[Any]) -> list:
    """Cotangents for the carried values: float0 zeros for the integer ones."""
    return [ct if is_float(ct) else np.zeros(ct.shape, jax.dtypes.float0) for ct in cts]
