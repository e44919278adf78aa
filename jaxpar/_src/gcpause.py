"""Pausing Python's cyclic garbage collector while jaxpar plans.

Tracing, planning and lowering allocate millions of small objects (jaxpr equations, layouts,
strategies, cost tables) that all live until the plan is built.  Each collection of the oldest
generation rescans every one of them, so the collector's cost grows with the square of the
model: at 24 GPT layers it was a third of jaxpar's time.  Nothing is freed by collecting then,
so jaxpar pauses the collector for the duration, as compilers written in Python commonly do.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Runs the block with the cyclic collector off (restored after, also on errors).

    >>> import gc
    >>> with paused_gc():
    ...     gc.isenabled()
    False
    >>> gc.isenabled()
    True
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
