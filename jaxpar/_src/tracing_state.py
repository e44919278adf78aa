"""What a function being traced by ``parallelize`` can ask about its surroundings."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from jax.sharding import Mesh

_state = threading.local()


def tracing_mesh() -> Mesh | None:
    """The mesh of the ``parallelize`` currently tracing on this thread, if any."""
    stack = getattr(_state, "meshes", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def tracing_with(mesh: Mesh) -> Iterator[None]:
    stack = getattr(_state, "meshes", None)
    if stack is None:
        stack = _state.meshes = []
    stack.append(mesh)
    try:
        yield
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
