"""``jaxpar.save_checkpoint``: a sharded checkpoint with its strategy (and plan) beside it."""

from __future__ import annotations

import json
import os
from typing import Any

from jaxpar._src.checkpoint import digest, store
from jaxpar._src.checkpoint.layouts import ArrayLayout, ParameterLayouts
from jaxpar._src.checkpoint.paths import flatten
from jaxpar._src.checkpoint.strategy import of_arrays
from jaxpar._src.errors import CheckpointError

API = "jaxpar.save_checkpoint"


def strategy_with_sums(tree: Any, *, where: str) -> ParameterLayouts:
    """The layouts of ``tree``'s arrays with the checksums of their contents."""
    layouts = of_arrays(tree, where=where)
    _, leaves, _ = flatten(tree)
    sums = digest.tree_sums(leaves)
    arrays = {p: ArrayLayout(a.spec, a.shape, a.dtype, s)
              for (p, a), s in zip(layouts.arrays.items(), sums, strict=True)}
    return ParameterLayouts(layouts.mesh, arrays, layouts.device_ids, layouts.origin)


def plan_dict(plan: Any, where: str) -> dict | None:
    if plan is None:
        return None
    from jaxpar._src.plan import ShardingPlan

    if not isinstance(plan, ShardingPlan):
        raise CheckpointError(f"{where}: plan must be a jaxpar.ShardingPlan (step.plan(...)), "
                              f"got {type(plan).__name__}.")
    return json.loads(plan.to_json())


def save_checkpoint(state: Any, directory: str | os.PathLike, *, plan: Any = None,
                    overwrite: bool = False, chunk_bytes: int | None = None
                    ) -> ParameterLayouts:
    """Saves a tree of (sharded) arrays with orbax, its strategy and plan beside it.

    Every process calls it with the same tree; each writes only the shards its devices hold
    (one copy of replicated data).  The directory appears whole or not at all: orbax writes
    under a temporary name and renames it once every process has finished, so a crash or an
    error mid-save leaves no checkpoint behind (and the next save cleans up).

    The checkpoint holds ``state/`` (orbax's PyTree checkpoint), ``strategy/strategy.json``
    (every array's path, shape, dtype, layout on the mesh and a checksum of its contents) and,
    when ``plan`` is given, ``plan/plan.json``.  Save a train state as a dict keyed by the
    step's argument names (``{"params": ..., "opt_state": ...}``): the array paths are then
    those of the step's plan.

    Args:
      state: a pytree of ``jax.Array`` (any sharding) and host values.
      directory: where to save (created; its parent too).
      plan: the :class:`jaxpar.ShardingPlan` of the program the state belongs to.
      overwrite: replace an existing checkpoint (the old one stays until the new is complete).
      chunk_bytes: the largest chunk orbax stores (default: one chunk per saved shard); smaller
        chunks let a load on another layout read closer to only the bytes it needs.

    Returns:
      The :class:`ParameterLayouts` written beside the arrays.

    >>> import tempfile, jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    >>> w = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("dp", "mp")))
    >>> path = tempfile.mkdtemp() + "/step_1"
    >>> jaxpar.save_checkpoint({"params": {"w": w}}, path)["params.w"] == P("dp", "mp")
    True
    """
    strategy = strategy_with_sums(state, where=API)
    store.write(directory, state, strategy, plan_dict(plan, API), overwrite=overwrite,
                chunk_bytes=chunk_bytes, where=API)
    return strategy
