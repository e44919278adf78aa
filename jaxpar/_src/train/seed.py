"""Identical starting weights on every replica: ``set_seed`` and ``parameter_broadcast``.

MindSpore's ``set_seed`` seeds every random source so that each process draws the same initial
weights; ``parameter_broadcast`` copies rank 0's parameters to everyone instead.  JAX has no
hidden global generator, so here ``set_seed`` fixes the seed jaxpar's own randomness uses
(:func:`random_key`, dataset shuffling) and seeds NumPy's and Python's global generators, as
MindSpore does; ``parameter_broadcast`` returns the parameters as arrays replicated over the
mesh, with process 0's values in multi-process runs.
"""

from __future__ import annotations

import random
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar._src.context import current_context
from jaxpar._src.errors import ContextError

_seed: int | None = None


def set_seed(seed: int) -> None:
    """Seeds jaxpar, NumPy and Python's ``random`` (MindSpore's ``set_seed``).

    >>> import jaxpar
    >>> jaxpar.set_seed(1)
    >>> jaxpar.get_seed()
    1
    """
    global _seed
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ContextError(f"jaxpar.set_seed: seed must be an int in [0, 2**32), got {seed!r}.")
    _seed = seed
    np.random.seed(seed)
    random.seed(seed)


def get_seed() -> int | None:
    """The seed given to :func:`set_seed`, or ``None``.

    >>> import jaxpar
    >>> jaxpar.set_seed(7)
    >>> jaxpar.get_seed()
    7
    """
    return _seed


def random_key(salt: int = 0) -> jax.Array:
    """A JAX key from the global seed (0 when none was set), the same in every process.

    >>> import jaxpar
    >>> jaxpar.set_seed(3)
    >>> bool((jaxpar.random_key() == jaxpar.random_key()).all())
    True
    """
    key = jax.random.key(_seed or 0)
    return jax.random.fold_in(key, salt) if salt else key


def parameter_broadcast(params: Any, mesh: Mesh | None = None) -> Any:
    """``params`` replicated on every device of ``mesh``, with process 0's values everywhere.

    In one process this places the arrays replicated over the mesh; across processes (after
    ``jaxpar.init()``) process 0's values are broadcast first, so replicas that initialised
    differently still start from one set of weights.

    >>> import jax.numpy as jnp, jaxpar
    >>> w = jaxpar.parameter_broadcast({"w": jnp.ones(3)})["w"]
    >>> w.sharding.is_fully_replicated
    True
    """
    mesh = mesh or current_context().mesh
    if mesh is None:
        n = current_context().device_num or len(jax.devices())
        from jaxpar._src.mesh import make_mesh

        mesh = make_mesh((n,), ("devices",))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params = multihost_utils.broadcast_one_to_all(params)
    sharding = NamedSharding(mesh, P())
    if jax.process_count() > 1:
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), params)
    return jax.device_put(params, sharding)
