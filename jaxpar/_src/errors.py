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
    """A sharding strategy cannot be applied: wrong rank, not divisible, unknown mesh axis, ..."""


class MeshError(JaxparError):
    """A mesh is missing, too large for the devices, or does not fit the strategies."""


class ContextError(JaxparError):
    """An unknown or invalid option of the auto-parallel context."""


class PlanError(JaxparError):
    """A plan cannot be made or does not fit the program (nothing fixed, wrong signature, ...)."""


class DatasetError(JaxparError):
    """A dataset is built or used inconsistently (columns, shards, batch sizes, ...)."""


class JaxparWarning(UserWarning):
    """Something jaxpar handled safely but the user should know about."""


_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Emits ``message`` as a :class:`JaxparWarning` the first time ``key`` is seen."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, JaxparWarning, stacklevel=3)


class PSError(JaxparError):
    """Parameter-server training cannot go on: a bad configuration, or nothing left to run on."""


class CheckpointError(JaxparError):
    """A checkpoint cannot be written, read or laid out again: it does not match the network,
    a shard is missing or damaged, or a strategy belongs to another program."""
