"""Errors and warnings jaxpar raises, written for the person who has to fix the input.

Every error about user input is a :class:`JaxparError`, a ``ValueError`` subclass, so code that
already catches ``ValueError`` keeps working.  Messages name the API and argument (or the operator
with its source line), the shape, the mesh, and end with how to fix it.
"""

from __future__ import annotations

import warnings


class JaxparError(ValueError):
    """Base class of every error jaxpar raises about its input.

    >>> issubclass(JaxparError, ValueError)
    True
    """


class StrategyError(JaxparError):
    """A sharding strategy cannot be applied: wrong rank, not divisible, unknown mesh axis, ...

    >>> import jax.numpy as jnp, jaxpar
    >>> f = jaxpar.parallelize(lambda x: x * 2, mesh=jaxpar.make_mesh((8,), ("d",)),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=(3,))
    >>> try:
    ...     f(jnp.ones(8))
    ... except jaxpar.StrategyError as e:
    ...     print(str(e).split(": ", 2)[-1][:44])
    strategy (3,) cuts dimension 0 of the f32[8]
    """


class MeshError(JaxparError):
    """A mesh is missing, too large for the devices, or does not fit the strategies.

    >>> import jaxpar
    >>> try:
    ...     jaxpar.make_mesh((4, 4), ("dp", "mp"))  # 16 devices; there are 8
    ... except jaxpar.MeshError as e:
    ...     print(type(e).__name__)
    MeshError
    """


class ContextError(JaxparError):
    """An unknown or invalid option of the auto-parallel context.

    >>> import jaxpar
    >>> try:
    ...     jaxpar.set_auto_parallel_context(parallel_mode="auto")
    ... except jaxpar.ContextError as e:
    ...     print(str(e)[:35])
    jaxpar: parallel_mode 'auto' is not
    """


class PlanError(JaxparError):
    """A plan cannot be made or does not fit the program (nothing fixed, wrong signature, ...).

    >>> import jaxpar
    >>> try:
    ...     jaxpar.ShardingPlan.from_json("{")
    ... except jaxpar.PlanError as e:
    ...     print(str(e)[:42])
    jaxpar: the text is not a plan file: it is
    """


class NoPlanFits(PlanError):
    """The automatic search found no plan within ``HardwareProfile.memory_per_device``;
    ``smallest_bytes``: the peak per device of the smallest plan it found (what a caller that
    tries other settings reports of this one).

    >>> e = NoPlanFits("no plan fits", 3.0 * 2**20)
    >>> isinstance(e, PlanError), e.smallest_bytes
    (True, 3145728.0)
    """

    def __init__(self, message: str, smallest_bytes: float) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


class DatasetError(JaxparError):
    """A dataset is built or used inconsistently (columns, shards, batch sizes, ...).

    >>> import numpy as np, jaxpar
    >>> from jaxpar import dataset as ds
    >>> try:
    ...     ds.NumpySlicesDataset((np.zeros(4), np.zeros(5)))
    ... except jaxpar.DatasetError as e:
    ...     print(type(e).__name__)
    DatasetError
    """


class JaxparWarning(UserWarning):
    """Something jaxpar handled safely but the user should know about.

    >>> import warnings, jaxpar
    >>> issubclass(jaxpar.JaxparWarning, UserWarning)  # warnings.simplefilter can select it
    True
    """


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emits ``message`` as a :class:`JaxparWarning` the first time ``key`` is seen."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, JaxparWarning, stacklevel=3)


class PSError(JaxparError):
    """Parameter-server training cannot go on: a bad configuration, or nothing left to run on.

    >>> from jaxpar import ps
    >>> try:
    ...     ps.read_on_workers(lambda step, part, n: (), batch_size=0)
    ... except ps.PSError as e:
    ...     print(e)
    read_on_workers: batch_size=0 must be a positive int.
    """


class CheckpointError(JaxparError):
    """A checkpoint cannot be written, read or laid out again: it does not match the network,
    a shard is missing or damaged, or a strategy belongs to another program.

    >>> import tempfile, jaxpar
    >>> try:
    ...     jaxpar.load_checkpoint(tempfile.mkdtemp())
    ... except jaxpar.CheckpointError as e:
    ...     print(str(e).split(":")[0], "-", "not a jaxpar checkpoint" in str(e))
    jaxpar.load_checkpoint - True
    """
