"""Graph or PyNative execution (MindSpore's ``set_context(mode=...)``).

``GRAPH_MODE`` (the default) compiles each parallelized step into one XLA program.
``PYNATIVE_MODE`` runs it eagerly, operator by operator, on the same sharded arrays, so ``print``
shows values and breakpoints stop inside the step: a ``jaxpar.parallelize`` function runs its
Python body under ``jax.disable_jit()`` with its arguments placed as the plan says, a
``jaxpar.per_replica`` step runs its ``shard_map`` eagerly.  Same numbers, much slower.

>>> import jaxpar
>>> jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE)
>>> jaxpar.get_context("mode") == jaxpar.PYNATIVE_MODE
True
>>> jaxpar.set_context(mode=jaxpar.GRAPH_MODE)
"""

from __future__ import annotations

from typing import Any

from jaxpar._src.context import CHANGES
from jaxpar._src.errors import ContextError

GRAPH_MODE = 0
PYNATIVE_MODE = 1

_options: dict[str, Any] = {"mode": GRAPH_MODE}


def set_context(**kwargs: Any) -> None:
    """Sets execution options; ``mode`` is ``GRAPH_MODE`` or ``PYNATIVE_MODE``.

    >>> import jaxpar
    >>> jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE)  # steps run eagerly, operator by operator
    >>> jaxpar.get_context("mode") == jaxpar.PYNATIVE_MODE
    True
    >>> jaxpar.set_context(mode=jaxpar.GRAPH_MODE)
    """
    for key, value in kwargs.items():
        if key != "mode":
            raise ContextError(f"jaxpar.set_context: unknown option {key!r}; jaxpar's execution "
                               f"context has 'mode' (parallel options go to "
                               f"set_auto_parallel_context).")
        if value not in (GRAPH_MODE, PYNATIVE_MODE):
            raise ContextError(f"jaxpar.set_context: mode must be jaxpar.GRAPH_MODE (0) or "
                               f"jaxpar.PYNATIVE_MODE (1), got {value!r}.")
        _options[key] = value
        CHANGES.bump()  # the per-call fast path checks the mode only when something changed


def get_context(key: str) -> Any:
    """One execution option's value (``"mode"``).

    >>> import jaxpar
    >>> jaxpar.get_context("mode") == jaxpar.GRAPH_MODE  # the default: compiled steps
    True
    """
    if key not in _options:
        raise ContextError(f"jaxpar.get_context: unknown option {key!r}; known: 'mode'.")
    return _options[key]


def pynative() -> bool:
    """Whether steps run eagerly."""
    return _options["mode"] == PYNATIVE_MODE
