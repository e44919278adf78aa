"""``DistributedGradReducer``: the gradient all-reduce of data-parallel training.

MindSpore's cell of that name averages (or sums) every gradient over the data-parallel devices.
In jaxpar it has two places to run:

* **per replica** (inside :func:`jaxpar.per_replica`, or a ``jax.shard_map`` of your own): each
  replica holds the gradients of its slice of the batch, and the reducer all-reduces them, fused
  into buckets by the communication-fusion configuration (``comm_fusion`` /
  ``all_reduce_fusion_config``).  XLA:CPU merges independent all-reduces on its own, so each
  bucket's all-reduce is made to depend on the previous one (through an exact zero): the
  compiled step has exactly one all-reduce per bucket, the configuration decides.  (In a
  ``shard_map`` of your own with ``check_vma=True``, JAX's autodiff has already summed the
  gradients of replicated parameters; the reducer then only divides them for the mean.)
* **in a global-view program** (``jax.jit`` or ``jaxpar.parallelize`` over the whole batch): the
  gradients of a loss averaged over the global batch already are the mean over devices (XLA
  inserted that all-reduce), so ``mean=True`` returns them unchanged and ``mean=False`` gives
  MindSpore's sum, ``degree`` times the mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._src.compat import manual_axes, varying_axes
from jaxpar._src.context import current_context
from jaxpar._src.errors import ContextError
from jaxpar._src.tracing_state import count_reducer_call, replica_axes, tracing_mesh
from jaxpar._src.train.buckets import allreduce_fusion, buckets


class DistributedGradReducer:
    """Averages (or sums) gradients over the data-parallel replicas.

    Args:
      parameters: the parameters (a pytree, or ``None``); when given, the gradients passed in
        must have the same structure.
      mean: average (``True``) or sum (``False``); ``None`` takes the context's
        ``gradients_mean``.
      degree: the divisor of the mean; ``None`` is the number of replicas.
      fusion: which gradients share one all-reduce: ``None`` (the context's ``comm_fusion`` or
        ``all_reduce_fusion_config``), a dict such as ``{"mode": "size", "config": 32}``, or
        split indices such as ``[20, 35]``.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> params = {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)}
    >>> reducer = jaxpar.DistributedGradReducer(params, mean=True)
    >>> @jaxpar.per_replica(batch_argnums=(1,))
    ... def step(params, x):
    ...     grads = jax.grad(lambda p: jnp.mean(x @ p["w"] + p["b"]))(params)
    ...     grads = reducer(grads)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    >>> step(params, jnp.ones((8, 4)))["b"]
    Array([-0.05, -0.05], dtype=float32)
    """

    def __init__(self, parameters: Any = None, mean: bool | None = None,
                 degree: int | None = None, fusion: Any = None) -> None:
        if mean is not None and not isinstance(mean, bool):
            raise ContextError(f"DistributedGradReducer: mean must be True, False or None, got "
                               f"{mean!r}.")
        if degree is not None and (not isinstance(degree, int) or degree < 1):
            raise ContextError(f"DistributedGradReducer: degree must be a positive int, got "
                               f"{degree!r}.")
        self._structure = None if parameters is None else jax.tree.structure(parameters)
        self._mean = mean
        self._degree = degree
        self._fusion = fusion
        if fusion is not None:
            allreduce_fusion(fusion)  # validate now, not at the first step

    @property
    def mean(self) -> bool:
        return current_context().gradients_mean if self._mean is None else self._mean

    def __call__(self, grads: Any) -> Any:
        if self._structure is not None and jax.tree.structure(grads) != self._structure:
            raise ContextError(
                f"DistributedGradReducer: the gradients have structure "
                f"{jax.tree.structure(grads)}, but the reducer was built for parameters with "
                f"structure {self._structure}. Pass the gradients of those parameters.")
        count_reducer_call()
        axes = replica_axes()
        if axes is not None:
            return self._all_reduce(grads, axes)
        axes = manual_axes()
        if not axes:
            return self._global_view(grads)
        if varying_axes(jax.lax.axis_index(axes)):
            # Your own shard_map with check_vma=True: JAX's autodiff already summed the
            # gradients of replicated parameters over the replicas; only varying ones remain.
            summed = {i for i, g in enumerate(jax.tree.leaves(grads))
                      if _is_float(g) and not varying_axes(g) & set(axes)}
            return self._all_reduce(grads, axes, summed=summed)
        return self._all_reduce(grads, axes)

    def _replicas(self, axes: Sequence[str]) -> int:
        mesh = jax.sharding.get_abstract_mesh()
        return int(np.prod([mesh.shape[a] for a in axes]))

    def _global_view(self, grads: Any) -> Any:
        if self.mean:
            return grads
        degree = self._degree or _device_count()
        return jax.tree.map(lambda g: g * degree if _is_float(g) else g, grads)

    def _all_reduce(self, grads: Any, axes: tuple[str, ...],
                    summed: frozenset[int] | set[int] = frozenset()) -> Any:
        leaves, treedef = jax.tree.flatten(grads)
        divisor = self._degree or self._replicas(axes)
        if self.mean:  # already summed by autodiff: only the mean is left to take
            leaves = [g / jnp.asarray(divisor, g.dtype) if i in summed else g
                      for i, g in enumerate(leaves)]
        floats = [i for i, g in enumerate(leaves) if _is_float(g) and i not in summed]
        sizes = [leaves[i].size * leaves[i].dtype.itemsize for i in floats]
        out = list(leaves)
        previous = None
        for bucket in buckets(sizes, allreduce_fusion(self._fusion)):
            members = [floats[k] for k in bucket]
            values = [leaves[i] for i in members]
            if previous is not None:
                # XLA's all-reduce combiner merges all-reduces that do not depend on each
                # other; an exact zero computed from the previous bucket keeps them apart.
                values[0] = values[0] + _zero_from(previous).astype(values[0].dtype)
            reduced = jax.lax.psum(values, axes)
            if self.mean:
                reduced = [r / jnp.asarray(divisor, r.dtype) for r in reduced]
            for i, r in zip(members, reduced, strict=True):
                out[i] = r
            previous = reduced[0]
        return jax.tree.unflatten(treedef, out)


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_from(x: jax.Array) -> jax.Array:
    """``0.0`` that XLA cannot prove is zero (so it depends on ``x``), also for inf and NaN."""
    first = jnp.ravel(x)[0].astype(jnp.float32)
    return jnp.where(jnp.isfinite(first), first, 0.0) * 0.0


def _device_count() -> int:
    mesh = tracing_mesh() or current_context().mesh
    if mesh is not None:
        return int(mesh.devices.size)
    return current_context().device_num or len(jax.devices())
