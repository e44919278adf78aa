"""Loss scaling for low-precision training (MindSpore's loss-scale managers).

The loss is multiplied by a scale before differentiation so small gradients survive float16;
the gradients are divided by it again, and an overflow (an inf or NaN gradient) skips the
update.  The scale is state a train step threads through (:class:`LossScaleState`):

>>> import jax, jax.numpy as jnp, jaxpar
>>> manager = jaxpar.DynamicLossScaleManager(init_loss_scale=2.0**10, scale_factor=2,
...                                          scale_window=2)
>>> state = manager.init()
>>> def step(w, state):
...     grads = jax.grad(lambda w: manager.scale(jnp.sum(w ** 2), state))(w)
...     grads, finite, state = manager.apply(grads, state)
...     return manager.select(finite, w - 0.1 * grads, w), state
>>> w, state = step(jnp.ones(2), state)
>>> w.tolist(), float(state.scale)
([0.800000011920929, 0.800000011920929], 1024.0)

Inside a :func:`jaxpar.per_replica` step (or a ``shard_map``) the overflow flag is agreed over
the replicas, so an overflow on any device skips the update everywhere.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxpar._src.compat import manual_axes
from jaxpar._src.errors import ContextError
from jaxpar._src.tracing_state import replica_axes


class LossScaleState(NamedTuple):
    """The loss scale and the number of overflow-free steps since it last changed.

    >>> import jaxpar
    >>> state = jaxpar.FixedLossScaleManager(1024.0).init()
    >>> float(state.scale), int(state.good_steps)
    (1024.0, 0)
    """

    scale: jax.Array
    good_steps: jax.Array


def all_finite(tree: Any) -> jax.Array:
    """``True`` when every float in ``tree`` is finite (agreed over replicas, if any).

    >>> import jax.numpy as jnp, jaxpar
    >>> bool(jaxpar.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.nan])}))
    False
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves \
        else jnp.asarray(True)
    axes = replica_axes() or manual_axes()
    if axes:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axes) > 0
    return finite


class _Manager:
    _initial: float  # the first loss scale

    def init(self) -> LossScaleState:
        return LossScaleState(jnp.asarray(self._initial, jnp.float32), jnp.asarray(0, jnp.int32))

    def scale(self, loss: Any, state: LossScaleState) -> Any:
        """The loss times the scale (differentiate this)."""
        return jax.tree.map(lambda x: x * state.scale.astype(jnp.result_type(x)), loss)

    def unscale(self, grads: Any, state: LossScaleState) -> Any:
        """Gradients divided by the scale."""
        return jax.tree.map(lambda g: g / state.scale.astype(g.dtype)
                            if jnp.issubdtype(g.dtype, jnp.inexact) else g, grads)

    def apply(self, grads: Any, state: LossScaleState) -> tuple[Any, jax.Array, LossScaleState]:
        """Unscaled gradients, whether they are all finite, and the next state."""
        grads = self.unscale(grads, state)
        finite = all_finite(grads)
        return grads, finite, self.adjust(finite, state)

    def select(self, finite: jax.Array, updated: Any, previous: Any) -> Any:
        """``updated`` unless an overflow drops this step's update (then ``previous``)."""
        if not self.get_drop_overflow_update():
            return updated
        return jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated, previous)

    def get_loss_scale(self) -> float:
        return float(self._initial)

    def get_drop_overflow_update(self) -> bool:
        return True

    def adjust(self, finite: jax.Array, state: LossScaleState) -> LossScaleState:
        raise NotImplementedError


class FixedLossScaleManager(_Manager):
    """A constant scale; with ``drop_overflow_update`` an overflowing step is skipped.

    >>> import jax.numpy as jnp, jaxpar
    >>> manager = jaxpar.FixedLossScaleManager(128.0)
    >>> state = manager.init()
    >>> grads, finite, state = manager.apply({"w": jnp.full(2, 256.0)}, state)
    >>> grads["w"].tolist(), bool(finite), float(state.scale)
    ([2.0, 2.0], True, 128.0)
    """

    def __init__(self, loss_scale: float = 128.0, drop_overflow_update: bool = True) -> None:
        if not loss_scale >= 1:
            raise ContextError(f"FixedLossScaleManager: loss_scale must be >= 1, got "
                               f"{loss_scale!r}.")
        self._initial = float(loss_scale)
        self._drop = bool(drop_overflow_update)

    def get_drop_overflow_update(self) -> bool:
        return self._drop

    def adjust(self, finite: jax.Array, state: LossScaleState) -> LossScaleState:
        return state


class DynamicLossScaleManager(_Manager):
    """A scale that falls by ``scale_factor`` on overflow (the step is skipped) and rises by it
    after ``scale_window`` overflow-free steps.

    >>> import jax.numpy as jnp, jaxpar
    >>> manager = jaxpar.DynamicLossScaleManager(init_loss_scale=1024.0, scale_factor=2.0)
    >>> state = manager.init()
    >>> _, finite, state = manager.apply({"w": jnp.array([jnp.inf])}, state)  # overflow
    >>> bool(finite), float(state.scale)  # the step is skipped and the scale halves
    (False, 512.0)
    """

    def __init__(self, init_loss_scale: float = 2.0**24, scale_factor: float = 2.0,
                 scale_window: int = 2000) -> None:
        if not init_loss_scale >= 1 or not scale_factor > 1 or \
                not isinstance(scale_window, int) or scale_window < 1:
            raise ContextError(
                f"DynamicLossScaleManager: need init_loss_scale >= 1, scale_factor > 1 and a "
                f"positive int scale_window; got {init_loss_scale!r}, {scale_factor!r}, "
                f"{scale_window!r}.")
        self._initial = float(init_loss_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window

    def adjust(self, finite: jax.Array, state: LossScaleState) -> LossScaleState:
        grown = state.good_steps + 1 >= self.scale_window
        scale = jnp.where(finite,
                          jnp.where(grown, state.scale * self.scale_factor, state.scale),
                          jnp.maximum(state.scale / self.scale_factor, 1.0))
        good = jnp.where(finite & ~grown, state.good_steps + 1, 0)
        return LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32))
