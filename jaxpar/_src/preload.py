"""A kept executable loaded while the call traces: the warm first call's two longest phases at once.

A later process whose plan is a cache hit still traces the step (the plan's key is the traced
program's) and then loads the executable kept beside the plan (``executable_cache.py``): for the
24-layer GPT step of ``bench/first_call.py`` 2.0 s of JAX's trace, then 2.1 s of XLA's
deserialization, one after the other.  XLA deserializes without holding the GIL, so the two
can run together; but which executable to load is known only from the trace.

So each call that finds or stores an executable leaves a *hint* in ``<plan_cache_dir>/hints/``:
under a digest of what is known before tracing (the function's module, name and source line,
the arguments as ``jax.jit`` keys them, the settings, the devices), the executable's file name
and the output tree it was compiled for.  The next process reads the hint before it traces and
deserializes that file in a thread (:class:`Preload`); once the trace has given the real key,
:meth:`Preload.take` hands the executable over only if it is the file the real key names, its
stored key is the real key and its output tree is the program's; otherwise it is dropped and the
call loads (or compiles) as it would have.  A hint is a guess, never trusted: a stale one (the
function's code changed) costs a deserialization in the background and nothing else.

Hints are unpickled, as executables are: the plan cache must be as trusted as the code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import threading
from collections.abc import Sequence
from typing import Any

from jax.experimental import serialize_executable

from jaxpar._src.executable_cache import FORMAT, ExecutableKey
from jaxpar._src.plan_cache import _text, write_atomically

HINTS = "hints"  # the sub-directory of the plan cache the hints live in
_HINT_FORMAT = b"jaxpar.hint/1\n"


def hint_digest(fn: Any, signature: Sequence[Any], settings: Any) -> str:
    """What a call is known by before it traces: ``fn``'s module, name and first source line,
    the call's ``signature`` (``cache_key.call_key``) and ``settings``, without object
    addresses.

    >>> def f(x): return x
    >>> hint_digest(f, ("ctx", 1), "s") == hint_digest(f, ("ctx", 1), "s") != hint_digest(
    ...     f, ("ctx", 2), "s")
    True
    """
    code = getattr(fn, "__code__", None)
    where = (getattr(fn, "__module__", None), getattr(fn, "__qualname__", type(fn).__name__),
             getattr(code, "co_filename", None), getattr(code, "co_firstlineno", None))
    text = _text((where, tuple(signature), settings))
    return hashlib.sha256(text.encode()).hexdigest()


def leave_hint(directory: str, digest: str, key: ExecutableKey, out_tree: Any, *,
               api: str) -> None:
    """Records that the call known as ``digest`` runs the executable under ``key`` (whose
    results have pytree ``out_tree``); not rewritten when the hint already says so."""
    path = os.path.join(directory, HINTS, digest)
    data = _HINT_FORMAT + pickle.dumps((os.path.basename(key.path(directory)), out_tree))
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except OSError:
        pass
    write_atomically(path, data, what="hints", api=api)


class Preload:
    """The executable a hint names, deserialized in a thread of its own from the moment this is
    made; :meth:`take` returns it once the real key is known (or ``None``).

    The thread is not a daemon: the interpreter waits for a deserialization in flight before it
    exits (not stopping XLA half-way)."""

    def __init__(self, directory: str, digest: str, in_tree: Any, devices: Sequence[Any]) -> None:
        self.name: str | None = None
        self._result: tuple[Any, Any] | None = None  # (stored key description, executable)
        self._thread: threading.Thread | None = None
        try:
            with open(os.path.join(directory, HINTS, digest), "rb") as f:
                data = f.read()
            if not data.startswith(_HINT_FORMAT):
                return
            name, out_tree = pickle.loads(data[len(_HINT_FORMAT):])
        except Exception:  # noqa: BLE001 - no hint, or one that cannot be read: no guess
            return
        self.name = str(name)
        path = os.path.join(directory, self.name)

        def load() -> None:
            try:
                with open(path, "rb") as f:
                    data = f.read()
                if not data.startswith(FORMAT):
                    return
                header, _, payload = data[len(FORMAT):].partition(b"\n")
                compiled = serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=list(devices))
                self._result = (header, compiled)
            except Exception:  # noqa: BLE001 - the call loads it again and says what is wrong
                return

        self._thread = threading.Thread(target=load, name="jaxpar-executable-preload",
                                        daemon=False)
        self._thread.start()

    def take(self, directory: str, key: ExecutableKey, out_tree: Any) -> Any | None:
        """The executable stored under ``key`` for results of pytree ``out_tree``, if it is the
        one this preloaded; ``None`` otherwise (the caller loads as without a preload)."""
        if self._thread is None or self.name != os.path.basename(key.path(directory)):
            return None
        self._thread.join()
        if self._result is None:
            return None
        header, compiled = self._result
        self._result = None
        try:
            stored = json.loads(header)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if stored != key.description or compiled.out_tree != out_tree:
            return None
        with contextlib.suppress(OSError):  # recently used: pruned last (executable_cache.prune)
            os.utime(key.path(directory))
        return compiled
