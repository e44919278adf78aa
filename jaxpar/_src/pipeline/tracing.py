"""What ``parallelize`` tells a :class:`PipelineCell` traced inside it, and what it hears back.

While ``parallelize`` traces a function under a pipeline configuration, the settings it resolved
(stages, micro-batches, schedule; mode, search, hardware; the mesh) sit here, and every pipeline
built during the trace is recorded, so the plan can explain its split and schedule and pin the
pipeline's loop (``outer.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

from jax.sharding import Mesh

from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.pipeline.config import PipelineConfig


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """A ``parallelize``'s pipeline settings (part of its plan cache key)."""

    config: PipelineConfig
    micro_batches_given: bool  # micro_batches came from parallelize or the context


@dataclasses.dataclass
class Tracing:
    settings: PipelineSettings
    mesh: Mesh
    mode: Any
    search_mode: str
    hardware: HardwareProfile
    optimizer: Any = None  # OptimizerParallel (ZeRO): the stacked gradients reduce-scattered
    built: list[Any] = dataclasses.field(default_factory=list)  # PipelineProgram, in order
    # the traced step's arguments: the split's memory check counts the optimizer state's
    # copies of the cell's parameters among them (stacked.copies_of)
    args: Any = None


_state = threading.local()


def current() -> Tracing | None:
    """The pipeline settings of the ``parallelize`` tracing on this thread, if any."""
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def pipelining(tracing: Tracing) -> Iterator[Tracing]:
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(tracing)
    try:
        yield tracing
    finally:
        stack.pop()
