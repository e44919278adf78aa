"""What a function being traced by ``parallelize`` can ask about its surroundings.

While ``parallelize`` traces, JAX's own abstract mesh is set to the program's mesh: JAX keys its
trace caches (nested ``jax.jit``) on it, so a body traced for one mesh is never reused on
another, and ``jaxpar.shard`` writes its sharding constraints on that abstract mesh (names and
sizes, no devices), resolved when the program is lowered.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh

_state = threading.local()


def tracing_mesh() -> Mesh | None:
    """The mesh of the ``parallelize`` currently tracing on this thread, if any."""
    stack = getattr(_state, "meshes", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def tracing_with(mesh: Mesh, context_mesh: Mesh | None = None) -> Iterator[None]:
    """Traces on this thread plan for ``mesh``; JAX's abstract mesh while tracing is
    ``context_mesh`` (default ``mesh``): the mesh a bare ``PartitionSpec`` in the function
    refers to, which in ``stand_alone`` is the user's mesh, not the one-device plan's."""
    stack = getattr(_state, "meshes", None)
    if stack is None:
        stack = _state.meshes = []
    stack.append(mesh)
    try:
        with jax.sharding.use_abstract_mesh((context_mesh or mesh).abstract_mesh):
            yield
    finally:
        stack.pop()


def recorder() -> list[Any] | None:
    """The list a discovery trace (:func:`discovering`) collects strategies into, if any."""
    stack = getattr(_state, "recorders", None)
    return stack[-1] if stack else None


_discovery_ids = itertools.count()


@contextlib.contextmanager
def discovering() -> Iterator[list[Any]]:
    """A trace that only collects the strategies of the ``jaxpar.shard`` calls it meets.

    Its abstract mesh is a fresh one-device mesh, so JAX's trace caches neither serve this trace
    from an earlier one (whose shards would go unseen) nor keep its constraint-free bodies for a
    later one.
    """
    stack = getattr(_state, "recorders", None)
    if stack is None:
        stack = _state.recorders = []
    found: list[Any] = []
    stack.append(found)
    fresh = AbstractMesh((1,), (f"jaxpar_discovery_{next(_discovery_ids)}",),
                         axis_types=(AxisType.Auto,))
    try:
        with jax.sharding.use_abstract_mesh(fresh):
            yield found
    finally:
        stack.pop()


def replica_axes() -> tuple[str, ...] | None:
    """The mesh axes the replicas of a running :func:`jaxpar.per_replica` step span, if any."""
    stack = getattr(_state, "replicas", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def replicas_with(axes: tuple[str, ...]) -> Iterator[None]:
    stack = getattr(_state, "replicas", None)
    if stack is None:
        stack = _state.replicas = []
    stack.append(axes)
    try:
        yield
    finally:
        stack.pop()


def reducer_calls() -> int:
    """How many times a DistributedGradReducer reduced gradients on this thread."""
    return getattr(_state, "reductions", 0)


def count_reducer_call() -> None:
    _state.reductions = reducer_calls() + 1
