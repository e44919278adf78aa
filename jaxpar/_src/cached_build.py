"""What a build of ``parallelize`` takes from the plan cache, and what it leaves there.

``api.py`` builds a call signature's program in three steps: trace, plan, jitted function.  With
``jaxpar.config.plan_cache_dir`` set, each step can be served by what an earlier process kept:

* before the trace, the executable last used for the call (named by the index of its pre-key)
  is read ahead in a thread (:func:`start_prefetch`, ``prefetch.py``);
* after the trace, the plan stored under the program's key (:func:`stored_plan`,
  ``plan_cache.py``), or for a program with ``jaxpar.recompute(policy="auto")`` blocks the
  recompute choice and its plan (:func:`stored_choice`);
* after the plan, the executable stored beside it (:func:`stored_executable`): the one read
  ahead if its key is the full key, else loaded (``executable_cache.py``), and then the index
  of the pre-key is made to name it (:func:`index`); without one, the call compiles it and keeps
  it for the next process (``pending``), and a recompute choice compiled while it was chosen is
  kept at once (:func:`keep_compiled`): the index is then written once the executable is
  (:func:`~jaxpar._src.executable_cache.store_executable`), so that an index only ever names an
  executable that was in the plan cache (``.plan()`` alone, which compiles nothing, writes
  none; pruning deletes an index whose executable is gone).

Every function here reads or writes only the plan cache; tracing, planning and lowering stay
in ``api.py`` (passed in as callables where a stored entry needs a program traced again).
Warnings about unusable files are raised by the readers with ``stacklevel=4``: called from
these functions, which ``api.py`` calls, they point into ``api.py``, as before this module.

>>> from types import SimpleNamespace as S
>>> start_prefetch(None, S(), (), S())   # no plan cache: nothing read ahead
(None, None)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from jaxpar._src.context import ParallelMode
from jaxpar._src.executable_cache import (
    LOADED_NOTE,
    ExecutableKey,
    Loaded,
    call_in_tree,
    dynamic_tree,
    executable_key,
    load_executable,
    storable,
    store_in_background,
)
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.plan_cache import TEXT_SHA, CacheKey, entry_choice, entry_plan, read_entry
from jaxpar._src.prefetch import Prefetch, pre_key, read_index, write_index
from jaxpar._src.trace import TracedProgram

Batch = tuple[int, ...] | None  # the batch arguments a mode needs (api.Parallelized._batch)


def start_prefetch(cache_dir: str | None, settings: Any, signature: tuple, info: Any
                   ) -> tuple[str | None, Prefetch | None]:
    """The call's pre-key and the executable its index names, being read ahead
    (``prefetch.py``); ``(None, None)`` where no executable would be loaded.  ``settings``:
    ``api.Settings``; ``info``: ``parallelize``'s arguments (``ParallelizeInfo``)."""
    if not cache_dir or settings.ckpt_load or settings.mode is ParallelMode.STAND_ALONE \
            or not storable():
        return None, None
    ahead = pre_key(info.fn, signature, settings, info)
    name = read_index(cache_dir, ahead, api=info.api)
    return ahead, None if name is None else Prefetch(cache_dir, name,
                                                     list(settings.mesh.devices.flat))


def stored_plan(cache_dir: str, key: CacheKey, program: TracedProgram, batch: Batch, *,
                retrace: Callable[[Any], tuple[TracedProgram, Batch]] | None, api: str,
                kept: Callable[[str], bool] = lambda text_sha: False
                ) -> tuple[TracedProgram, Batch, ShardingPlan | None, bool, str | None]:
    """The plan stored under ``key`` for ``program``: the program and batch arguments it plans,
    the plan (``None``: no usable entry, with a warning if there is one), whether it was read
    (a hit) and the SHA-256 of the entry's text (``None`` without an entry).  ``retrace``
    (where the program is traced per parallel optimizer level: its pipeline loop is built for
    the level) traces it again at the stored plan's ``optimizer_level``.  ``kept(text_sha)``:
    whether the executable of the entry whose text has that SHA-256 is in the directory
    (:func:`executable_kept`); then the plan's decisions are converted when read (a call
    that loads it reads the arguments' few)."""
    cached = read_entry(cache_dir, key, api=api)
    if cached is None:
        return program, batch, None, False, None
    if retrace is not None:  # the loop of the level the plan chose
        stored = cached.get("plan")
        program, batch = retrace(stored.get("optimizer_level") if isinstance(stored, dict)
                                 else None)
    plan = entry_plan(cached, key.path(cache_dir), program.graph, api=api,
                      lazy=kept(cached[TEXT_SHA]))
    return program, batch, plan, plan is not None, cached[TEXT_SHA]


def executable_kept(cache_dir: str, key: CacheKey, *, signature: tuple, info: Any, mesh: Mesh
                    ) -> Callable[[str], bool]:
    """Whether the executable of a call of ``signature`` is kept beside the plan entry of
    ``key`` whose text has the SHA-256 given (:func:`stored_plan`'s ``kept``)."""

    def kept(text_sha: str) -> bool:
        return storable() and os.path.exists(
            _executable_key(key, text_sha, signature, info, mesh).path(cache_dir))

    return kept


def stored_choice(cache_dir: str, key: CacheKey, base: TracedProgram, base_batch: Batch,
                  layers: Sequence[str], policies_allowed: Sequence[str], *,
                  retrace: Callable[[tuple[str, ...]], tuple[TracedProgram, Batch, list[str]]],
                  api: str) -> tuple[TracedProgram, Batch, ShardingPlan, str] | None:
    """The recompute choice and plan stored under ``key``: the program traced with the
    stored policies (``retrace``; none when nothing is recomputed: then ``base``), the plan
    loaded for it and the SHA-256 of the entry's text; ``None`` when there is no usable
    entry."""
    entry = read_entry(cache_dir, key, api=api)
    if entry is None:
        return None
    policies = entry_choice(entry, key.path(cache_dir), policies_allowed, len(layers), api=api)
    if policies is None:
        return None
    program, batch = base, base_batch
    if set(policies) != {"none"}:
        program, batch, seen = retrace(policies)
        if len(seen) != len(layers):  # the ladder says why
            return None
    plan = entry_plan(entry, key.path(cache_dir), program.graph, api=api)
    return None if plan is None else (program, batch, plan, entry[TEXT_SHA])


def keep_compiled(cache_dir: str | None, key: CacheKey | None, text_sha: str | None,
                  kept: Any, *, signature: tuple, info: Any, mesh: Mesh, ahead: str | None
                  ) -> None:
    """Keeps ``kept``, the executable XLA compiled in this process for the recompute choice
    stored under ``key`` (``None``: JAX's persistent cache served it, which is not kept),
    beside the entry; once written, the index of pre-key ``ahead`` names it."""
    if cache_dir and key is not None and text_sha is not None and storable() and \
            kept is not None:  # kept beside the entry the choice is stored in
        exec_key = _executable_key(key, text_sha, signature, info, mesh)
        store_in_background(cache_dir, exec_key, kept, ahead, api=info.api)


def stored_executable(cache_dir: str | None, key: CacheKey | None, text_sha: str | None,
                      plan: ShardingPlan, *, hit: bool, args: tuple, signature: tuple,
                      info: Any, mesh: Mesh, out_tree: Any, build: Callable[[], Any],
                      ahead: str | None, prefetch: Prefetch | None
                      ) -> tuple[Loaded | None, list[tuple[str, ExecutableKey, str | None]],
                                 ShardingPlan]:
    """The executable beside the plan entry of ``key`` (``executable_cache.py``): on a hit, the
    one read ahead if its key is the full key, exactly, else the one loaded; the plan's last
    note then says so, and the index of pre-key ``ahead`` names it.  Without one,
    ``(directory, key, ahead)`` for the call to compile and keep (``pending``): the index is
    written with the executable, not before it (a ``.plan()`` that is never called compiles
    nothing, and an index naming nothing would only send the next process's read ahead
    after a file that is not there).  ``build``: the plan's jitted function, which a loaded
    executable's :class:`Loaded` falls back to."""
    loaded: Loaded | None = None
    pending: list[tuple[str, ExecutableKey, str | None]] = []
    if cache_dir and key is not None and text_sha is not None and storable():
        # the executable beside the plan (executable_cache.py)
        exec_key = _executable_key(key, text_sha, signature, info, mesh)
        tree = dynamic_tree(args, info.static_argnums)
        in_tree, devices = call_in_tree(args, info.static_argnums), list(mesh.devices.flat)
        compiled = None
        if hit and prefetch is not None:  # only if its key is exec_key, exactly
            compiled = prefetch.take(cache_dir, exec_key, in_tree, out_tree, devices)
        if hit and compiled is None:
            compiled = load_executable(cache_dir, exec_key, in_tree, out_tree, devices,
                                       api=info.api)
        if compiled is None:
            pending.append((cache_dir, exec_key, ahead))
        else:
            index(cache_dir, ahead, prefetch, exec_key, api=info.api)
            loaded = Loaded(compiled, tree, signature, info.static_argnums, build)
            plan = dataclasses.replace(plan, notes=plan.notes[:-1] + (
                f"{plan.notes[-1]}; {LOADED_NOTE} ({exec_key.path(cache_dir)}), not "
                f"lowered or compiled",))
    return loaded, pending, plan


def index(cache_dir: str, ahead: str | None, prefetch: Prefetch | None,
          exec_key: ExecutableKey, *, api: str) -> None:
    """Names ``exec_key``'s executable in the index of pre-key ``ahead`` for the next
    process (``prefetch.py``), unless it does already."""
    if ahead is not None and (prefetch is None or prefetch.path != exec_key.path(cache_dir)):
        write_index(cache_dir, ahead, exec_key, api=api)


def _executable_key(key: CacheKey, text_sha: str, signature: tuple, info: Any, mesh: Mesh
                    ) -> ExecutableKey:
    return executable_key(key.digest, text_sha, signature=signature,
                          donate_argnums=info.donate_argnums,
                          static_argnums=info.static_argnums,
                          platform=mesh.devices.flat[0].platform)
