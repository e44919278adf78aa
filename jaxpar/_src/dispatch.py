"""The per-call fast path of ``Parallelized``: a call like the previous one goes straight to its
jitted program.

The full path of a call finds the plan in Python: the context and settings, the cache key of
the arguments (tree, shapes, dtypes, weak types, static values) and every argument moved to its
layout: on a GPT train step, hundreds of microseconds to milliseconds a call
(``bench/first_call.py``).  Most calls are like the last one: same context, same signature,
arguments already where the plan wants them (the state the last step returned).  ``jax.jit``
checks all of that again, in C++, for its own cache, so the fast path hands the arguments
straight to the last call's jitted function when jaxpar's own context and algorithm parameters
are those of that call.

Why that is safe: ``jax.jit`` keys its cache on everything :func:`call_key` keys on (the tree,
every leaf's shape, dtype and weak type, static arguments by type and value, the trace context)
and on the arguments' shardings besides; a call it serves from its cache is one the plan was made
for.  A call it does not know makes it trace the wrapped function again, and there
:func:`refuse_fast_trace` raises :class:`Retrace`: another key needs its own plan, and the same
key in other layouts (arrays not yet placed, say the arguments of the first call passed again)
would have ``jax.jit`` trace, lower and compile the plan's program a second time for them (a
whole XLA compile: 8.5 s for the 2-layer GPT step of ``bench/first_call.py``), where the
full path moves them to the plan's layouts and runs the program compiled for those.
``jax.jit`` also refuses arguments committed to other
layouts than the plan's.  Either way the fast path gives up and the full path runs (and places
the arguments, or raises the real error).  A give-up costs a few milliseconds (an abandoned
trace, and JAX filtering the traceback of the exception), so after one the fast path sits out a
few calls, twice as many each time it gives up again; a long run of successes brings it back.

>>> import jax.numpy as jnp, jaxpar
>>> f = jaxpar.parallelize(lambda x: x * 2, mesh=jaxpar.make_mesh((8,), ("d",)),
...                        parallel_mode="semi_auto_parallel", in_strategy=((8,),))
>>> y = f(jnp.ones(8))        # the full path: plan, compile, place
>>> z = f(y)                  # the fast path: y is already where the plan wants it
>>> f(jnp.ones(16)).shape     # another signature: the fast path gives up, a new plan
(16,)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from jaxpar._src.context import algo_parameters, current_context
from jaxpar._src.execution import pynative

MISS = object()  # what FastPath.call returns when the full path must run
_MAX_BACKOFF = 10  # after its n-th give-up the fast path sits out 2**n - 1 calls (n <= 10) ...
_FORGIVE = 64  # ... and n drops by one after this many successes in a row


class Retrace(Exception):
    """A fast-path call reached ``jax.jit`` with arguments the plan was not made for."""


_armed = threading.local()  # set while a fast-path call is in jax.jit


def refuse_fast_trace() -> None:
    """Called where ``jax.jit`` traces the jitted function: raises :class:`Retrace` inside a
    fast-path call, which ``jax.jit`` has no program for (see the module's docstring).
    Outside a fast-path call it does nothing: the full path has chosen the plan for exactly
    these arguments and placed them."""
    if getattr(_armed, "on", False):
        raise Retrace


class FastPath:
    """The last call's jitted function, and the context it was planned in."""

    def __init__(self) -> None:
        self._hot: tuple[Any, Any, Callable] | None = None  # context, algo parameters, jitted
        self._misses = 0  # give-ups, less one per _FORGIVE successes in a row
        self._wins = 0  # successes since the last give-up or forgiveness
        self._skip = 0  # calls left before the fast path is tried again

    def remember(self, ctx: Any, algo: Any, jitted: Callable) -> None:
        """The full path ran ``jitted`` in this context: the next call may go straight to it."""
        self._hot = (ctx, algo, jitted)

    def forget(self) -> None:
        self._hot = None

    def call(self, args: tuple) -> Any:
        """``jitted(*args)`` if the context is the last call's and ``jax.jit`` takes these
        arguments as they are; else :data:`MISS`."""
        hot = self._hot
        if hot is None:
            return MISS
        if self._skip:
            self._skip -= 1
            return MISS
        ctx, algo, jitted = hot
        now = current_context()
        if now is not ctx:
            if now != ctx:  # another with-block of the same options is the same context
                return MISS
            self._hot = (now, algo, jitted)
        if algo_parameters() != algo or pynative():
            return MISS
        before = getattr(_armed, "on", False)
        _armed.on = True
        try:
            out = jitted(*args)
        except Exception:  # noqa: BLE001 - Retrace, or jit refusing the arguments' layouts
            self._misses = min(self._misses + 1, _MAX_BACKOFF)
            self._skip, self._wins = 2 ** self._misses - 1, 0
            return MISS
        finally:
            _armed.on = before
        if self._misses:
            self._wins += 1
            if self._wins >= _FORGIVE:
                self._misses, self._wins = self._misses - 1, 0
        return out
