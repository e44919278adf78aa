"""The plan cache's executable read while the program is traced: a second run's first call.

A later process whose plan is a plan-cache hit loads the executable kept beside the entry
(``executable_cache.py``), but its key is a digest of the traced program, so the read could only
start after the trace: on the 24-layer GPT step of ``bench/first_call.py`` the trace (2.9 s) and
then the read (2.6 s, almost all of it XLA deserializing the executable, in XLA's own threads
with the GIL released) were most of the second run's first call.

This module starts the read before the trace.  A *pre-key* that needs no trace (the function's
module, qualified name and byte code, the arguments as ``jax.jit`` keys them with JAX's trace
context, the mesh, the modes, ``donate_argnums`` and ``static_argnums``) names, through a small
index file in the plan cache (``<dir>/<pre-key>.last``), the executable last used for it; a
thread reads that file and has XLA deserialize and load the executable
(:func:`~jaxpar._src.compat.prefetch_xla_executables`: every other object in the file is left
for later, so the thread reads no JAX configuration, which is partly thread-local:
``jax.experimental.enable_x64``, ``jax.transfer_guard``, ``jax.set_mesh``), while the calling
thread traces.  After the trace the plan's and the executable's full keys are computed as
without it, and the executable read ahead is used only if the file's key is the full key,
exactly (:meth:`Prefetch.take`, which then reads the rest of the file in the calling thread);
otherwise it is dropped and the executable is loaded as before.  The pre-key only guesses: a
wrong guess costs the thread's work, never a wrong executable.

An index is written only once the executable it names is in the plan cache (after the first
call's background write, ``executable_cache.store_executable``, or when a later process loads
it): a ``.plan()`` that compiles nothing writes none.  Pruning (``executable_cache.prune``)
deletes the indexes whose executable is gone (:func:`stale_indexes`), so they do not outlive
it.  An index that cannot be read (not JSON, another format, a name that is not an
executable's) is ignored with a :class:`JaxparWarning` and rewritten; a missing one (a first
run) starts no thread.  A file the thread cannot read or deserialize is dropped silently: the
load that follows reads it again and warns as ``executable_cache.py`` does.  Under
``jax.distributed`` nothing is read ahead (executables are not kept).  The thread is not a
daemon (XLA's deserialization cannot be interrupted), so a process that exits meanwhile waits
for it: at most one executable's deserialization; a guess found wrong before the thread
reaches XLA stops it there.

>>> import tempfile
>>> d = tempfile.mkdtemp()
>>> read_index(d, "0" * 64, api="f") is None   # no index yet: nothing read ahead
True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from jaxpar._src.compat import load_prefetched, prefetch_xla_executables
from jaxpar._src.errors import JaxparWarning
from jaxpar._src.executable_cache import FORMAT, ExecutableKey, intact, split_file
from jaxpar._src.plan_cache import Unusable, _text, read_json, write_atomically

INDEX_FORMAT = "jaxpar.prefetch/1"
_NAME = re.compile(r"[0-9a-f]{64}\.[0-9a-f]{64}\.xla")  # an executable's file name, no path


def pre_key(fn: Any, signature: Sequence[Any], settings: Any, info: Any) -> str:
    """A SHA-256 of what names a call's executable before its trace: the function (module,
    qualified name, byte code), the arguments as ``jax.jit`` keys them with JAX's trace context
    (``signature``, a :func:`~jaxpar._src.cache_key.call_key`), the mesh, the parallel and
    search modes, ``donate_argnums`` and ``static_argnums``.  Only a guess (see the module's
    docstring): what else keys the plan is checked by the full keys.

    >>> from types import SimpleNamespace as S
    >>> import jaxpar
    >>> mesh = jaxpar.make_mesh((8,), ("d",))
    >>> s = S(mesh=mesh, mode="auto", search_mode="rp")
    >>> info = S(donate_argnums=(), static_argnums=())
    >>> pre_key(abs, ((), 1), s, info) == pre_key(abs, ((), 2), s, info)
    False
    """
    mesh = settings.mesh
    code = getattr(fn, "__code__", None)
    described = (getattr(fn, "__module__", None),
                 getattr(fn, "__qualname__", type(fn).__qualname__),
                 hashlib.sha256(getattr(code, "co_code", b"")).hexdigest(),
                 tuple(signature), tuple(mesh.axis_names), tuple(mesh.devices.shape),
                 tuple(int(d.id) for d in mesh.devices.flat),
                 str(mesh.devices.flat[0].platform), str(settings.mode),
                 str(settings.search_mode), tuple(info.donate_argnums),
                 tuple(info.static_argnums))
    return hashlib.sha256(_text(described).encode()).hexdigest()


def index_path(directory: str, key: str) -> str:
    return os.path.join(directory, f"{key}.last")


def read_index(directory: str, key: str, *, api: str) -> str | None:
    """The file name of the executable the index of pre-key ``key`` names; ``None`` when there
    is no index or, with a warning, when it cannot be used."""
    path = index_path(directory, key)
    try:
        read = read_json(path)
    except Unusable as e:
        _ignored(api, path, str(e))  # here, not in read_json: the warning's stacklevel
        return None
    if read is None:
        return None
    data = read[0]
    name = data.get("executable") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("format") != INDEX_FORMAT or \
            not isinstance(name, str) or not _NAME.fullmatch(name):
        _ignored(api, path, f"it is not a {INDEX_FORMAT} index naming an executable")
        return None
    return name


def stale_indexes(directory: str, names: Iterable[str]) -> list[str]:
    """The paths of the indexes among the file ``names`` of ``directory`` that name an
    executable no longer there (pruned, ``executable_cache.prune``, or deleted by hand): an
    index is written only once its executable is, so one whose executable is missing is
    stale for good.  An index that is not a readable one is left to :func:`read_index`, which
    warns and has it rewritten.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> gone = "0" * 64 + "." + "1" * 64 + ".xla"
    >>> with open(index_path(d, "2" * 64), "w") as f:
    ...     _ = f.write(json.dumps({"format": INDEX_FORMAT, "executable": gone}))
    >>> [os.path.basename(p) for p in stale_indexes(d, os.listdir(d))] == ["2" * 64 + ".last"]
    True
    """
    stale = []
    for file in names:
        if not file.endswith(".last"):
            continue
        path = os.path.join(directory, file)
        try:
            read = read_json(path)
        except Unusable:
            continue
        data = read[0] if read is not None else None
        name = data.get("executable") if isinstance(data, dict) else None
        if isinstance(name, str) and _NAME.fullmatch(name) and \
                not os.path.exists(os.path.join(directory, name)):
            stale.append(path)
    return stale


def write_index(directory: str, key: str, executable: ExecutableKey, *, api: str) -> None:
    """Names ``executable`` in the index of pre-key ``key`` (atomically, as entries are)."""
    name = os.path.basename(executable.path(directory))
    text = json.dumps({"format": INDEX_FORMAT, "executable": name})
    write_atomically(index_path(directory, key), text.encode(), what="plans", api=api)


class Prefetch:
    """The executable ``name`` in ``directory`` read and deserialized by XLA on ``devices``, in
    a thread started at once; :meth:`take` it after the trace, or :meth:`drop` it."""

    def __init__(self, directory: str, name: str, devices: Sequence[Any]):
        self.path = os.path.join(directory, name)
        self._devices = list(devices)
        self._stop = threading.Event()
        self._got: tuple[Any, bytes, list[Any]] | None = None  # description, payload, XLA's
        self._thread = threading.Thread(target=self._read, name="jaxpar-executable-prefetch",
                                        daemon=False)
        self._thread.start()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
            if not data.startswith(FORMAT) or self._stop.is_set():
                return
            description, checksum, payload = split_file(data)
            if self._stop.is_set() or not intact(checksum, payload):
                return  # (a file not intact: the load that follows warns)
            self._got = (description, payload,
                         prefetch_xla_executables(payload, self._devices))
        except Exception:  # noqa: BLE001, S110 - a guess: the load that follows says why
            pass

    def take(self, directory: str, key: ExecutableKey, in_tree: Any, out_tree: Any,
             devices: Sequence[Any]) -> Any | None:
        """The ``jax.stages.Compiled`` read ahead, if it is the executable of ``key`` (the file
        is ``key``'s and its stored key is ``key``'s, exactly) on ``devices``; else ``None``
        (then load it as without a prefetch)."""
        if key.path(directory) != self.path or list(devices) != self._devices:
            self.drop()
            return None
        self._thread.join()
        got, self._got = self._got, None
        if got is None or got[0] != key.description:
            return None
        try:
            compiled = load_prefetched(got[1], got[2], in_tree, out_tree, devices)
        except Exception:  # noqa: BLE001 - then loaded as without a prefetch, which warns
            return None
        with contextlib.suppress(OSError):  # recently used: pruned last (executable_cache)
            os.utime(self.path)
        return compiled

    def drop(self) -> None:
        """Not needed: the thread stops before XLA's deserialization if it has not begun it,
        and what it read is let go."""
        self._stop.set()
        self._got = None


def _ignored(api: str, path: str, why: str) -> None:
    warnings.warn(f"{api}: ignoring the plan cache's index {path!r}: {why}. Nothing is read "
                  f"ahead of the trace; the index is rewritten.", JaxparWarning, stacklevel=4)
