"""Compiled executables in the plan cache: a second process skips lowering and XLA.

A plan-cache hit (``plan_cache.py``) spares the search, but the program still had to be lowered
(JAX's trace of the jitted function and its StableHLO) and compiled, or read back from JAX's
persistent compilation cache, which is keyed on the lowered module and so must lower first.
With ``jaxpar.config.plan_cache_dir`` set, the first call of a plan also writes the executable XLA
compiled for it (``jax.experimental.serialize_executable``) beside the plan entry, as
``<plan key digest>.<executable key digest>.xla``; a later process whose plan is a cache hit loads
it (``deserialize_and_load``) and runs it: nothing is lowered or compiled.  ``.lower()`` still
works: the jitted function is built and lowered when asked for.

The executable's key is the plan's key (program, arguments as ``jax.jit`` keys them, mesh devices
and platform, modes, versions: see ``plan_cache.py``) and a digest of the plan entry's text, and
besides what changes the compiled program but not the plan: ``donate_argnums`` and
``static_argnums``, JAX's trace context (``jax_enable_x64``, default matmul precision, the mesh of
``jax.set_mesh``, ...), every other ``jax.config`` value but the logging and cache settings,
``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``, the backend's platform version, and the number of
processes.  Out shardings and compiler options follow from the plan.  Under ``jax.distributed``
(more than one process) executables are neither stored nor loaded: each process compiles its own
(an executable of a multi-process program is tied to the processes that compiled it).

``deserialize_and_load`` unpickles the payload: the plan cache directory must be as trusted as
the code that runs (written only by the user or their job).

An executable file that cannot be read or loaded (truncated, another format or key, a backend
that refuses it) or whose payload is not the bytes written (the header keeps their SHA-256,
checked before XLA reads them: :func:`intact`) is ignored with one :class:`JaxparWarning`; the
program is lowered and compiled as without it, and the new executable replaces the file. Files
are written under a temporary name and renamed into place, as the plans are, by a background
thread (:func:`store_in_background`): the first call dispatches the step and returns; the
thread serializes and writes its executable once the step's outputs are ready; the
interpreter waits for that thread before it exits. Beside one plan
entry at most :data:`KEEP_PER_PLAN` (4) executables are kept, the most recently written or
loaded (:func:`prune`): each change of what keys an executable but not its plan (JAX's
configuration, ``XLA_FLAGS``, ``donate_argnums``) adds one, and the older ones are deleted when
a new one is written, with the pre-key indexes (``prefetch.py``) that name an executable no
longer there.

An executable that JAX's persistent compilation cache served (a process that found no plan, or
no executable, but whose program JAX's cache holds) is not kept: serialized again it would not
run on XLA:CPU (:func:`compile_to_keep`); such a process runs as without executables, lowering
and reading JAX's cache.  Conversely an executable kept here is not also written to JAX's
cache (:func:`compile_to_keep`): the later process loads it from here without asking JAX's.

The loaded executable (a ``jax.stages.Compiled``) accepts arguments ``jax.jit`` would trace anew
(a weakly typed scalar where the plan's was strongly typed, another JAX configuration), so
:class:`Loaded` checks what ``jax.stages.Compiled`` does not: static arguments by type and value,
JAX's trace context, the arguments' tree and every leaf's weak type; it flattens the arguments
in Python only for calls JAX's C++ dispatch has not seen before (see :class:`Loaded`).

>>> import jax.numpy as jnp, jaxpar, tempfile
>>> f = lambda x, w: jnp.tanh(x @ w)
>>> x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
>>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
>>> jaxpar.config.update("plan_cache_dir", tempfile.mkdtemp())
>>> first = jaxpar.parallelize(f, mesh=mesh, parallel_mode="auto_parallel")
>>> y = first(x, w)                                   # searched, compiled, both stored
>>> again = jaxpar.parallelize(f, mesh=mesh, parallel_mode="auto_parallel")
>>> bool((again(x, w) == y).all()), LOADED_NOTE in again.plan(x, w).notes[-1]
(True, True)
>>> jaxpar.config.update("plan_cache_dir", None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.experimental import serialize_executable

from jaxpar._src.cache_key import aval_key, static_key
from jaxpar._src.compat import checked_cpp_call, no_compilation_cache_write, trace_context
from jaxpar._src.dispatch import Retrace
from jaxpar._src.errors import JaxparWarning, PlanError, warn_once
from jaxpar._src.plan_cache import (
    _text,  # reprs without object addresses, as for plans
    write_atomically,
)

FORMAT = b"jaxpar.executable/2\n"  # /2: the payload's SHA-256 in the header
LOADED_NOTE = "executable loaded from the plan cache"  # in a loaded plan's last note
_SKIP_CONFIG = ("cache", "log", "explain")  # jax.config values that do not change a program
KEEP_PER_PLAN = 4  # executables kept beside one plan entry (prune): the most recently used
_STALE_TMP_NS = 3600 * 10**9  # a temporary file this old is a killed process's (prune)
_writing: list[threading.Thread] = []  # background writes not yet joined (store_in_background)
_writing_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class ExecutableKey:
    """The key of one executable: its digest and what it was computed from."""

    plan_digest: str  # the plan entry's key digest: the file sits beside that entry
    digest: str
    description: Mapping[str, Any]  # JSON data: stored in the file and checked on load

    def path(self, directory: str) -> str:
        return os.path.join(directory, f"{self.plan_digest}.{self.digest}.xla")


def storable() -> bool:
    """Whether executables are kept: one process only (see the module's docstring)."""
    return jax.process_count() == 1


def executable_key(plan_digest: str, plan_text_sha: str, *, signature: Sequence[Any],
                   donate_argnums: Sequence[int], static_argnums: Sequence[int],
                   platform: str) -> ExecutableKey:
    """The key of the executable of the plan entry ``plan_digest`` (whose text has SHA-256
    ``plan_text_sha``) for a call of ``signature`` (a :func:`call_key`)."""
    values = getattr(jax.config, "values", {})
    backend = jax.devices(platform)[0].client
    description = {
        "format": FORMAT.decode().strip(),
        "plan": plan_digest, "plan_text": plan_text_sha,
        "donate_argnums": sorted(int(i) for i in donate_argnums),
        "static_argnums": sorted(int(i) for i in static_argnums),
        "trace_context": _text(tuple(signature)[0]),
        "config": {k: _text(v) for k, v in sorted(values.items())
                   if not any(s in k for s in _SKIP_CONFIG)},
        "env": {k: os.environ.get(k, "") for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")},
        "platform": platform, "platform_version": str(backend.platform_version),
        "processes": jax.process_count(),
    }
    description = json.loads(json.dumps(description))  # as it reads back from the file
    digest = hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()
    return ExecutableKey(plan_digest, digest, description)


def compile_to_keep(lowered: Any, *, jax_cache_write: bool = True) -> Any | None:
    """``lowered.compile()``, or ``None`` when JAX's persistent compilation cache served it:
    an executable read back from that cache and serialized again loads, but fails when run on
    XLA:CPU (JAX 0.10: "Function ... not found"), so only one XLA compiled here is kept.  (The
    call's ``jax.jit`` then finds JAX's executable in its own caches.)

    ``jax_cache_write=False``: what XLA compiles is not also written to JAX's persistent cache
    (still read from it), for an executable the caller keeps in the plan cache: a later process
    whose plan is a hit loads it from there and never asks JAX's cache, so a second copy there
    would only cost the first call a second serialization (0.7 s of the main thread's CPU for
    the 24-layer GPT step of ``bench/first_call.py`` at load 9)."""
    hits = []

    def listen(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        with contextlib.nullcontext() if jax_cache_write else no_compilation_cache_write():
            compiled = lowered.compile()
    finally:
        jax.monitoring.unregister_event_listener(listen)
    return None if hits else compiled


def store_executable(directory: str, key: ExecutableKey, compiled: Any,
                     pre_key: str | None = None, *, api: str) -> bool:
    """Writes ``compiled`` (a ``jax.stages.Compiled``) under ``key``, atomically, names it in the
    index of ``pre_key`` (``prefetch.py``: written after the executable, an index never names
    one not yet there), then prunes the plan entry's older executables and the indexes of
    executables gone (:func:`prune`); an executable that cannot be serialized or a directory
    that cannot be written warns once and the run goes on.  Whether it was written."""
    try:
        payload, _, _ = serialize_executable.serialize(compiled)
    except (ValueError, NotImplementedError, TypeError) as e:
        warn_once(f"executable-serialize:{type(e).__name__}",
                  f"{api}: the compiled program cannot be kept in the plan cache ({e}); later "
                  f"processes load the plan and compile it again.")
        return False
    header = json.dumps(key.description, sort_keys=True).encode() + b"\n" + \
        hashlib.sha256(payload).hexdigest().encode() + b"\n"
    written = write_atomically(key.path(directory), FORMAT + header + payload,
                               what="executables", api=api)
    if written:
        if pre_key is not None:
            from jaxpar._src.prefetch import write_index  # (prefetch.py imports this module)

            write_index(directory, pre_key, key, api=api)
        prune(directory, key.plan_digest)
    return written


def store_in_background(directory: str, key: ExecutableKey, compiled: Any,
                        pre_key: str | None = None, *, api: str, after: Any = None) -> None:
    """:func:`store_executable` in a thread of its own: the call that compiled the program runs
    it meanwhile instead of waiting for the executable to be serialized and written.  One
    write at a time (a new one waits for the last: at most one payload in memory); the thread
    is not a daemon, so the interpreter waits for it before it exits, and a reader in this
    process (:func:`load_executable`) waits for it too (:func:`flush`).

    ``after``: the outputs of the step just dispatched; the thread waits for them before it
    serializes.  Serialized while the step runs, the executable took 1.4-1.8 s at 24 GPT layers
    (both cores busy with the step; the serialization holds the GIL, so the caller's return
    from the step waited for it too), 0.45-0.6 s once the step was done (load 3-4).  An output
    deleted or donated meanwhile counts as ready.

    >>> import tempfile, jax, jax.numpy as jnp
    >>> compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile()
    >>> key = ExecutableKey("ab" * 32, "cd" * 32, {})
    >>> d = tempfile.mkdtemp()
    >>> store_in_background(d, key, compiled, api="f", after=jnp.ones(4))
    >>> flush(); os.path.exists(key.path(d))
    True
    """
    waiting = [after]

    def write() -> None:
        try:
            jax.block_until_ready(waiting.pop())  # (the GIL is free while it waits)
        except Exception:  # noqa: BLE001, S110 - deleted or donated: done with
            pass
        try:
            store_executable(directory, key, compiled, pre_key, api=api)
        except Exception as e:  # noqa: BLE001 - a cache never stops a run
            warn_once(f"executable-write:{type(e).__name__}",
                      f"{api}: the compiled program could not be kept in the plan cache "
                      f"({type(e).__name__}: {str(e)[:200]}); later processes compile it again.")

    flush()
    thread = threading.Thread(target=write, name="jaxpar-executable-write", daemon=False)
    with _writing_lock:
        _writing.append(thread)
    thread.start()


def flush() -> None:
    """Waits until the executables being written in the background are in the plan cache.

    >>> from jaxpar._src.executable_cache import flush
    >>> flush()  # nothing pending: returns at once
    """
    with _writing_lock:
        threads = list(_writing)
        _writing.clear()
    for thread in threads:
        thread.join()


def prune(directory: str, plan_digest: str, keep: int | None = None) -> list[str]:
    """Deletes all but the ``keep`` (default :data:`KEEP_PER_PLAN`) most recently written or
    loaded executables of the plan entry ``plan_digest`` (the others were compiled for another
    JAX configuration, ``XLA_FLAGS``, ``donate_argnums``, ...: each such change adds one, and
    without a bound they would pile up beside the entry), the entry's temporary files
    older than an hour (left by a process killed while it wrote), and the pre-key indexes
    of the directory that name an executable no longer there (``prefetch.py``: deleted here
    or before; read ahead, they would only look for it).  The paths deleted."""
    from jaxpar._src.prefetch import stale_indexes  # (prefetch.py imports this module)

    keep = KEEP_PER_PLAN if keep is None else keep
    prefix = f"{plan_digest}."
    found, stale = [], []
    now = time.time_ns()
    names: list[str] = []
    with contextlib.suppress(OSError):
        names = os.listdir(directory)
        for name in names:
            path = os.path.join(directory, name)
            if name.startswith(prefix) and name.endswith(".xla"):
                with contextlib.suppress(OSError):
                    found.append((os.stat(path).st_mtime_ns, path))
            elif name.startswith(f".{prefix}") and name.endswith(".tmp"):
                # the temporary file of a write whose process was killed (SIGKILL) before the
                # rename; one being written now is younger than _STALE_TMP_NS
                with contextlib.suppress(OSError):
                    if now - os.stat(path).st_mtime_ns > _STALE_TMP_NS:
                        stale.append(path)
    found.sort(reverse=True)
    gone = []
    for _, path in found[keep:] + [(0, p) for p in stale]:
        with contextlib.suppress(OSError):
            os.unlink(path)
            gone.append(path)
    for path in stale_indexes(directory, names):  # after the executables: theirs too
        with contextlib.suppress(OSError):
            os.unlink(path)
            gone.append(path)
    return gone


def load_executable(directory: str, key: ExecutableKey, in_tree: Any, out_tree: Any,
                    devices: Sequence[Any], *, api: str) -> Any | None:
    """The ``jax.stages.Compiled`` stored under ``key`` for arguments of pytree ``in_tree``
    (:func:`call_in_tree`) and results of ``out_tree``, run on ``devices`` (the
    mesh's, in its order: the executable's device assignment); ``None`` when there is none, or,
    with a warning, when it cannot be used."""
    flush()  # an executable this process is still writing
    path = key.path(directory)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        _ignored(api, path, f"it cannot be read ({e})")
        return None
    if not data.startswith(FORMAT):
        _ignored(api, path, f"it is not a {FORMAT.decode().strip()} file")
        return None
    description, checksum, payload = split_file(data)
    if description != key.description:
        _ignored(api, path, "its key is not the key its name stands for")
        return None
    if not intact(checksum, payload):
        _ignored(api, path, "its executable is not the bytes written (cut short or changed: "
                 "its SHA-256 differs)")
        return None
    try:
        compiled = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                             execution_devices=list(devices))
    except Exception as e:  # noqa: BLE001 - unpickling and XLA raise anything on a bad file
        _ignored(api, path, f"it cannot be loaded ({type(e).__name__}: {str(e)[:200]})")
        return None
    with contextlib.suppress(OSError):  # recently used: pruned last (prune)
        os.utime(path)
    return compiled


def split_file(data: bytes) -> tuple[Any, bytes, bytes]:
    """The key description, the payload's stored SHA-256 (hex) and the payload of an
    executable file's bytes ``data`` (which start with :data:`FORMAT`); the description is
    ``None`` where the header is not JSON.

    >>> split_file(FORMAT + b'{"a": 1}\\n' + b"0" * 64 + b"\\npayload")
    ({'a': 1}, b'0000000000000000000000000000000000000000000000000000000000000000', b'payload')
    """
    header, sep, rest = data[len(FORMAT):].partition(b"\n")
    checksum, _, payload = rest.partition(b"\n")
    try:
        description = json.loads(header) if sep else None
    except (json.JSONDecodeError, UnicodeDecodeError):
        description = None
    return description, checksum, payload


def intact(checksum: bytes, payload: bytes) -> bool:
    """Whether ``payload`` is the bytes written: its SHA-256 is the stored ``checksum``.  A
    file cut short, with bytes appended or changed (one flipped byte inside XLA's program can
    still deserialize, into another program that runs and computes other numbers) is not.

    >>> intact(hashlib.sha256(b"x").hexdigest().encode(), b"x"), intact(b"0" * 64, b"x")
    (True, False)
    """
    return hashlib.sha256(payload).hexdigest().encode() == checksum


class _Traced(Exception):
    """A loaded executable was called with tracers: the jitted function takes the call."""


class Loaded:
    """A loaded executable called like the jitted function: with the static arguments, which it
    checks and drops.  A call ``jax.jit`` would trace anew (other static values, another trace
    context, another tree, a leaf of another shape, dtype or weak type) raises
    :class:`~jaxpar._src.dispatch.Retrace`, so that the fast path gives up and the full path
    finds (or makes) the right plan; tracers (a call inside another transformation) go to the
    jitted function, built when first needed.

    The executable runs through JAX's C++ dispatch (``compat.checked_cpp_call``), which keys
    its cache on what ``jax.jit``'s C++ cache keys on (tree, shapes, dtypes, weak types,
    shardings, JAX's jit context): a call like an earlier one costs what a ``jax.jit`` cache hit
    costs, and only a call it does not know is checked in Python (:meth:`_check`), before it
    runs.  ``jax.stages.Compiled`` alone would run a weakly typed scalar where the plan's was
    strongly typed, and a call in another JAX configuration."""

    def __init__(self, compiled: Any, tree: Any, signature: tuple[Any, ...],
                 static_argnums: Sequence[int], jitted: Callable[[], Any]):
        self._tree = tree  # the pytree of the dynamic arguments (a tuple)
        self._context = signature[0]
        self._static = tuple((i, signature[1 + i][1]) for i in sorted(static_argnums))
        self._avals = tuple(k for i, part in enumerate(signature[1:])
                            if i not in static_argnums for k in part[1])
        self._jitted = jitted
        self.compiled = compiled  # the jax.stages.Compiled (called on the dynamic arguments)
        fast = checked_cpp_call(compiled, self._check)
        self.run = fast if fast is not None else self._checked  # what a call runs

    @property
    def has_static(self) -> bool:
        """Whether calls pass static arguments, which :meth:`__call__` checks and drops."""
        return bool(self._static)

    def __call__(self, *args: Any) -> Any:
        if self._static:
            for i, expected in self._static:
                if static_key(args[i], where="") != expected:
                    raise Retrace
            drop = {i for i, _ in self._static}
            dyn = tuple(a for i, a in enumerate(args) if i not in drop)
        else:
            dyn = args
        try:
            return self.run(*dyn)
        except _Traced:
            return self._jitted()(*args)

    def _checked(self, *dyn: Any) -> Any:
        """Every call checked in Python (where ``checked_cpp_call`` is not available)."""
        self._check(*dyn)
        return self.compiled(*dyn)

    def _check(self, *dyn: Any) -> None:
        """Raises :class:`Retrace` for dynamic arguments the plan was not made for (another
        JAX configuration, tree, shape, dtype or weak type), :class:`_Traced` for tracers."""
        if trace_context() != self._context:
            raise Retrace
        leaves, tree = jax.tree.flatten(dyn)
        if tree != self._tree:
            raise Retrace
        for x, expected in zip(leaves, self._avals, strict=True):
            if isinstance(x, jax.core.Tracer):
                raise _Traced
            try:
                if aval_key(x, where="") != expected:  # shape, dtype, weak type
                    raise Retrace
            except PlanError:  # not an array: the full path says so
                raise Retrace from None


def dynamic_tree(args: Sequence[Any], static_argnums: Sequence[int]) -> Any:
    """The pytree of the dynamic arguments of a call with ``args`` (a tuple)."""
    return jax.tree.structure(tuple(a for i, a in enumerate(args) if i not in static_argnums))


def call_in_tree(args: Sequence[Any], static_argnums: Sequence[int]) -> Any:
    """The argument pytree the executable is loaded with: the dynamic arguments as positional
    arguments, no keywords (what ``jax.stages.Compiled`` flattens a call into)."""
    return jax.tree.structure((tuple(a for i, a in enumerate(args) if i not in static_argnums),
                               {}))


def _ignored(api: str, path: str, why: str) -> None:
    """No executable, with a warning saying why the file at ``path`` is not used."""
    warnings.warn(f"{api}: ignoring the executable {path!r} in the plan cache: {why}. Lowering "
                  f"and compiling the plan afresh; the new executable replaces it.",
                  JaxparWarning, stacklevel=4)
