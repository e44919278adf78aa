"""The per-call fast path of ``Parallelized``: a call like the previous one goes straight to its
jitted program.

The full path of a call finds the plan in Python: the context and settings, the cache key of
the arguments (tree, shapes, dtypes, weak types, static values) and every argument moved to its
layout: on a GPT train step, hundreds of microseconds to milliseconds a call
(``bench/first_call.py``).  Most calls are like the last one: same context, same signature,
arguments already where the plan wants them (the state the last step returned).  ``jax.jit``
checks all of that again, in C++, for its own cache, so the fast path hands the arguments
straight to the last call's jitted function (or the loaded executable's C++ dispatch) when
jaxpar's own context, algorithm parameters and execution mode are those of that call: checked
by comparing a number that changes with any of them and the calling thread
(:class:`FastPath`), so that a hit is a few microseconds of Python around JAX's C++ dispatch.

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

import sys
from collections.abc import Callable
from threading import get_ident
from types import FrameType
from typing import Any

from jaxpar._src.context import CHANGES, algo_parameters, current_context
from jaxpar._src.execution import pynative

MISS = object()  # what FastPath.call returns when the full path must run
_MAX_BACKOFF = 10  # after its n-th give-up the fast path sits out 2**n - 1 calls (n <= 10) ...
_FORGIVE = 64  # ... and n drops by one after this many successes in a row


class Retrace(Exception):
    """A fast-path call reached ``jax.jit`` with arguments the plan was not made for."""


def refuse_fast_trace() -> None:
    """Called where ``jax.jit`` traces the jitted function: raises :class:`Retrace` inside a
    fast-path call, which ``jax.jit`` has no program for (see the module's docstring).
    Outside a fast-path call it does nothing: the full path has chosen the plan for exactly
    these arguments and placed them.

    A fast-path call is one whose trace runs under :meth:`FastPath.call`'s frame: this thread's
    Python stack is walked (``jax.jit``'s C++ dispatch calls back into Python for a trace, and
    the frames of its caller stay linked).  A flag set around the call would do as well, but a
    thread-local one costs the hot call more than the rest of its Python together (set, then
    restored after the step is dispatched: each on cold caches, see :class:`FastPath`), and a
    trace, which walks the stack instead, comes only with a new signature."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _FAST_CALL:
            raise Retrace
        frame = frame.f_back


class FastPath:
    """The last call's program, and the context it was planned in.

    A call is checked, in Python, only for what ``jax.jit``'s C++ cache does not see: jaxpar's
    own context, algorithm parameters and execution mode.  The hot check is two comparisons:
    :data:`~jaxpar._src.context.CHANGES` (a number that changes with any of them, in any thread)
    and the calling thread (``with``-block contexts are per thread) against what they were at
    the last full call; only when one differs are the context and parameters compared
    themselves (:meth:`_rewarm`: another ``with``-block of the same options is the same
    context).  A hit is then a few microseconds of Python around JAX's C++ dispatch, and
    every object it touches counts: the first instructions after the last step was waited for
    run on cold caches.  On ``bench/first_call.py``'s cheap 89-leaf step at load 10 the
    context's thread-local lookup (which raised and caught ``AttributeError``) alone took
    24 us (best call; 1.3 us warm) and the thread-local flag set and restored around the step
    (now :func:`refuse_fast_trace`'s stack walk) another 16-20 us (median)."""

    def __init__(self) -> None:
        # (CHANGES.count, thread, runner) while calls may go straight to runner without a check
        self._hot: tuple[int, int, Callable] | None = None
        self._last: tuple[Any, Any, Callable] | None = None  # context, algo parameters, runner
        self._misses = 0  # give-ups, less one per _FORGIVE successes in a row
        self._wins = 0  # successes since the last give-up or forgiveness
        self._skip = 0  # calls left before the fast path is tried again

    def remember(self, stamp: int, ctx: Any, algo: Any, runner: Callable) -> None:
        """The full path ran ``runner`` in this context (``stamp``: ``CHANGES.count`` read
        before the context was): the next call may go straight to it."""
        self._last = (ctx, algo, runner)
        self._hot = None if self._misses else (stamp, get_ident(), runner)

    def forget(self) -> None:
        self._hot = self._last = None

    def call(self, args: tuple) -> Any:
        """``runner(*args)`` if the context is the last call's and ``jax.jit`` takes these
        arguments as they are; else :data:`MISS`."""
        hot = self._hot
        if hot is None or hot[0] != CHANGES.count or hot[1] != get_ident():
            runner = self._rewarm()
            if runner is None:
                return MISS
        else:
            runner = hot[2]
        try:  # a trace under this frame raises Retrace (refuse_fast_trace)
            return runner(*args)
        except Exception:  # noqa: BLE001 - Retrace, or jit refusing the arguments' layouts
            self._give_up()
            return MISS

    def _rewarm(self) -> Callable | None:
        """The last runner where the context, algorithm parameters and mode are the last full
        call's (compared themselves), else ``None``; counts the calls of a backing-off fast
        path (which stays off the hot check until it is forgiven every give-up)."""
        last = self._last
        if last is None:
            return None
        if self._skip:
            self._skip -= 1
            return None
        stamp = CHANGES.count  # read before the state it stands for
        ctx, algo, runner = last
        now = current_context()
        if now is not ctx:
            if now != ctx:  # another with-block of the same options is the same context
                return None
            self._last = (now, algo, runner)
        if algo_parameters() != algo or pynative():
            return None
        if self._misses:  # counted as a success now; a give-up resets the count
            self._wins += 1
            if self._wins >= _FORGIVE:
                self._misses, self._wins = self._misses - 1, 0
        if not self._misses:
            self._hot = (stamp, get_ident(), runner)
        return runner

    def _give_up(self) -> None:
        """The runner refused the arguments: back off (see the module's docstring)."""
        self._hot = None
        self._misses = min(self._misses + 1, _MAX_BACKOFF)
        self._skip, self._wins = 2 ** self._misses - 1, 0


_FAST_CALL = FastPath.call.__code__  # the frame refuse_fast_trace looks for
