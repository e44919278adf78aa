"""The persistent plan cache: a plan searched once is found again by later processes.

With ``jaxpar.config.plan_cache_dir`` set, every plan ``parallelize`` searches is written there,
and a later process (the same script run again, another rank) that traces the same program with
the same settings loads it instead of searching: ``<dir>/<key digest>.json`` holds the key's
description and the plan in the format of :meth:`ShardingPlan.to_json`.  The program is still
traced (the key is computed from the traced graph); what a hit skips is building the search
problem, the search and the pricing of the plan.  Beside the entry, the first call of a plan
keeps the executable XLA compiled for it (``<key digest>.<executable key digest>.xla``, see
``executable_cache.py``): a later process whose plan is a hit loads it instead of lowering and
compiling.

The key is a SHA-256 of everything a plan depends on:

* the program: every node of the traced graph (operator, operands, result shapes and dtypes,
  equation parameters, loop structure, source line), the value of every closed-over constant
  (``jax.jit`` bakes it into the program: :func:`constant_digest`), the argument and result
  trees and paths;
* the arguments as ``jax.jit`` keys them (:func:`call_key`: shapes, dtypes, weak types, static
  values by type);
* the mesh (axis names and sizes, device ids, kinds and platform), the parallel and search
  modes, the hardware profile, the algorithm parameters, the dataset strategy, the user's
  strategies (``in_strategy``, ``out_strategy``, ``parameter_plan``, ``batch_argnums``) and the
  registered operator rules;
* jaxpar's version and a digest of its own source, JAX's and jaxlib's versions;
* for a program with ``jaxpar.recompute(policy="auto")`` blocks (keyed by its trace with nothing
  recomputed), what the choice of their policies depends on besides: the blocks, the policies
  offered, the ladder and the budget.  The entry keeps the chosen policies (``"choice"``) beside
  the plan, so a later process traces the chosen program once and loads its plan instead of
  climbing the ladder (``recompute_choice.py``).

Change any of them and the key changes: the old entry is not read.  An entry that cannot be read
(not JSON, another format, a plan that does not fit the program) is ignored with a
:class:`JaxparWarning`, and the plan searched afresh replaces it.  Entries are written under a
temporary name and renamed into place, so a reader never sees half a file, and processes writing
the same entry at once do not corrupt it.  A directory that cannot be written warns once and is
then left alone: a cache never stops a run.

>>> import jax.numpy as jnp, jaxpar, tempfile
>>> f = lambda x, w: jnp.tanh(x @ w)
>>> x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
>>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
>>> jaxpar.config.update("plan_cache_dir", tempfile.mkdtemp())
>>> first = jaxpar.parallelize(f, mesh=mesh, parallel_mode="auto_parallel").plan(x, w)
>>> again = jaxpar.parallelize(f, mesh=mesh, parallel_mode="auto_parallel").plan(x, w)
>>> again.notes[-1].startswith("loaded from the plan cache")
True
>>> again.input_layouts() == first.input_layouts()
True
>>> jaxpar.config.update("plan_cache_dir", None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import numpy as np

from jaxpar._src.errors import JaxparWarning, PlanError, warn_once
from jaxpar._src.graph import Const, OpGraph
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.plan_files import structure_mismatch
from jaxpar._src.plan_json import plan_from_dict, plan_to_dict

FORMAT = "jaxpar.plan-cache/1"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # object addresses differ between processes
HIT_NOTE = "loaded from the plan cache"  # the start of a loaded plan's last note
TEXT_SHA = "text_sha256"  # read_entry's addition to an entry: a SHA-256 of the file's text


@dataclasses.dataclass(frozen=True)
class CacheKey:
    """The key of one plan: its digest (the file name) and what it was computed from."""

    digest: str
    description: Mapping[str, Any]  # JSON data: stored in the entry and checked on load

    def path(self, directory: str) -> str:
        return os.path.join(directory, f"{self.digest}.json")


def plan_cache_key(*, graph: OpGraph, in_tree: Any, out_tree: Any, signature: Sequence[Any],
                   settings: Any, info: Any, choice: Mapping[str, Any] | None = None
                   ) -> CacheKey:
    """The key of the plan of ``graph`` traced from arguments of ``signature`` (a
    :func:`call_key`), under ``settings`` (``api.Settings``) and ``parallelize``'s arguments
    ``info`` (``ParallelizeInfo``).  For a program with ``jaxpar.recompute(policy="auto")``
    blocks, ``graph`` is the program traced with nothing recomputed and ``choice`` what the
    recompute choice depends on besides (``recompute_choice.choice_key``: blocks, policies,
    ladder, budget); the entry then keeps the choice beside the plan."""
    mesh = settings.mesh
    devices = list(mesh.devices.flat)
    description = {
        "format": FORMAT,
        "versions": _versions(),
        "program": program_digest(graph, in_tree, out_tree),
        "arguments": _sha(_text(tuple(signature)[1:])),  # [0] is the trace context: the graph
        "mesh": {"axes": list(mesh.axis_names), "sizes": [int(n) for n in mesh.devices.shape],
                 "devices": [int(d.id) for d in devices],
                 "kinds": sorted({str(d.device_kind) for d in devices}),
                 "platform": str(devices[0].platform)},
        "mode": str(settings.mode.value), "search_mode": str(settings.search_mode),
        "hardware": _text(settings.hardware), "algo": _text(settings.algo),
        "dataset_strategy": _text(settings.dataset_strategy),
        "pipeline": _text(settings.pipeline),
        "optimizer": _text(settings.optimizer),
        "strategies": _sha(_text((info.in_strategy, info.out_strategy,
                                  None if info.parameter_plan is None
                                  else sorted(info.parameter_plan.items()),
                                  info.batch_argnums, info.static_argnums))),
        "rules": _rules_digest(),
    }
    if choice is not None:
        description["recompute_choice"] = dict(choice)
    description = json.loads(json.dumps(description))  # as it reads back from the file
    digest = _sha(json.dumps(description, sort_keys=True))
    return CacheKey(digest, description)


def load_cached(directory: str, key: CacheKey, graph: OpGraph, *, api: str
                ) -> ShardingPlan | None:
    """The plan stored under ``key``, or ``None`` (no entry, or one that cannot be used: then
    with a warning)."""
    entry = read_entry(directory, key, api=api)
    return None if entry is None else entry_plan(entry, key.path(directory), graph, api=api)


def read_entry(directory: str, key: CacheKey, *, api: str) -> dict[str, Any] | None:
    """The entry stored under ``key`` (its format and key checked), or ``None`` (no entry, or
    one that cannot be used: then with a warning)."""
    path = key.path(directory)
    try:
        read = read_json(path)
    except Unusable as e:
        _ignored(api, path, str(e))  # here, not in read_json: the warning's stacklevel
        return None
    if read is None:  # no entry (the write says why, if bad)
        return None
    data, text = read
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        _ignored(api, path, f"it is not a {FORMAT} entry (found {found!r})")
        return None
    if data.get("key") != key.description:
        _ignored(api, path, "its key is not the key its name stands for")
        return None
    data[TEXT_SHA] = _sha(text)  # the executable stored beside it is keyed on it
    return data


class Unusable(Exception):
    """A plan-cache file that exists but cannot be read as JSON: the message says why."""


def read_json(path: str) -> tuple[Any, str] | None:
    """The JSON data in the file at ``path`` (any JSON value: ``null`` is ``None``) and the
    file's text; ``None`` when there is no file.  Raises :class:`Unusable` when it cannot be
    read or is not JSON; the caller warns, so that the warning's ``stacklevel`` counts from it.

    >>> read_json("/nonexistent/entry.json") is None
    True
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise Unusable(f"it cannot be read ({e})") from None
    try:
        return json.loads(text), text
    except json.JSONDecodeError as e:
        raise Unusable(f"it is not JSON ({e.msg} at line {e.lineno})") from None


def entry_plan(entry: Mapping[str, Any], path: str, graph: OpGraph, *, api: str,
               lazy: bool = False) -> ShardingPlan | None:
    """The plan of an entry read from ``path`` if it fits ``graph``, with the note that it was
    loaded; else ``None``, with a warning.  ``lazy``: its decisions converted when read
    (``plan_json.LoadedDecisions``), for an entry whose executable is kept beside it (its key
    holds the digest of the entry's text, which jaxpar wrote: a hand-edited entry has none,
    and every decision of it is converted here, so one that cannot be is warned about and the
    plan searched anew)."""
    try:
        plan = plan_from_dict(entry["plan"], source=f"plan cache entry {path!r}", lazy=lazy)
        differs = structure_mismatch(plan, graph)
    except (PlanError, KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        _ignored(api, path, f"its plan is not well-formed ({type(e).__name__}: {e})")
        return None
    if differs is not None:
        _ignored(api, path, f"its plan does not fit this program: {differs}")
        return None
    return dataclasses.replace(plan, notes=plan.notes + (f"{HIT_NOTE} ({path}); not searched",))


def entry_choice(entry: Mapping[str, Any], path: str, allowed: Sequence[str], n: int, *,
                 api: str) -> tuple[str, ...] | None:
    """The recompute choice an entry keeps: ``n`` policies from ``allowed``; else ``None``,
    with a warning."""
    choice = entry.get("choice")
    if not (isinstance(choice, list) and len(choice) == n and all(
            isinstance(p, str) and p in allowed for p in choice)):
        _ignored(api, path, f"its recompute choice {choice!r} is not {n} of {allowed}")
        return None
    return tuple(choice)


def store_cached(directory: str, key: CacheKey, plan: ShardingPlan, *, api: str,
                 choice: Any = None) -> str | None:
    """Writes ``plan`` (and, for a program with automatic recomputation, the ``choice`` of
    policies) under ``key``, atomically; a directory that cannot be written warns once and the
    run goes on.  A SHA-256 of the text written (``None`` if nothing was)."""
    entry = {"format": FORMAT, "key": key.description, "plan": plan_to_dict(plan)}
    if choice is not None:
        entry["choice"] = choice
    text = json.dumps(entry, check_circular=False)  # plain data made here: the same text, faster
    if not write_atomically(key.path(directory), text.encode("utf-8"), what="plans", api=api):
        return None
    return _sha(text)


def write_atomically(path: str, data: bytes, *, what: str, api: str) -> bool:
    """Writes ``data`` to ``path`` in the plan cache under a temporary name, renamed into place
    (a reader never sees half a file); a directory that cannot be written warns once (``what``
    are not kept there) and the run goes on.  Whether it was written."""
    directory = os.path.dirname(path)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp",
                                   dir=directory)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warn_once(f"plan-cache-write:{directory}",
                  f"{api}: cannot write to the plan cache {directory!r} ({e}); {what} are not "
                  f"kept there. Make the directory writable, or set jaxpar.config.plan_cache_dir "
                  f"to another one (or None).")
        return False
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return True


def program_digest(graph: OpGraph, in_tree: Any, out_tree: Any) -> str:
    """A SHA-256 of the traced program: every node in order with its operands, result shapes
    and dtypes, equation parameters, loop structure and source line, a constant's value; the
    trees of arguments and results.  Equal for two traces of the same function on the same
    argument types (and constants), in any process."""
    h = hashlib.sha256()
    h.update(_text((in_tree, out_tree, graph.order, graph.inputs, graph.outputs,
                    graph.remats)).encode())
    values = graph.values
    types: dict[tuple[Any, Any], str] = {}  # printing a dtype is slow: once per (shape, dtype)

    def typed(shape: Any, dtype: Any) -> str:
        text = types.get((shape, dtype))
        if text is None:
            text = types[(shape, dtype)] = f"{shape}{dtype}"
        return text

    lines = []  # hashed at once: one update per node costs more than the text
    for node in graph.nodes:
        ins = ",".join(str(o) if isinstance(o, int) else
                       typed(o.shape, o.dtype) + _scalar(o) for o in node.inputs)
        outs = ",".join(typed(values[v].shape, values[v].dtype) for v in node.outputs)
        params = _params(node.eqn.params, control=node.structure is not None) \
            if node.eqn is not None else ""
        if node.constant is not None:  # a closed-over array: its value is in the program
            params += f"|const={constant_digest(node.constant)}"
        lines.append(f"{node.kind}|{node.name}|{ins}|{outs}|{node.weight}|{node.region}|"
                     f"{node.label}|{node.remat}|{node.crossing}|{node.structure}|"
                     f"{node.source}|{params}\n")
    h.update("".join(lines).encode())
    return h.hexdigest()


def constant_digest(value: Any) -> str:
    """A SHA-256 of a closed-over constant's dtype, shape and bytes: ``jax.jit`` bakes the
    value into the program it compiles, so a constant of another value (a module-level array
    the script changed, a function closing over another array) is another program, and its
    stored plan's executable would compute with the old value.

    >>> constant_digest(np.ones(3)) == constant_digest(np.ones(3, np.float32))
    False
    >>> constant_digest(np.ones(3)) == constant_digest(np.full(3, 2.0))
    False

    A global array this process holds only part of (under ``jax.distributed``) counts by its
    dtype and shape: its bytes cannot be read here, and no executable is kept across
    processes (``executable_cache.py``), so its value reaches no stored program; the plan
    itself depends on shapes only.
    """
    if getattr(value, "is_fully_addressable", True) is False:
        return hashlib.sha256(f"{value.dtype}{tuple(value.shape)}|global".encode()).hexdigest()
    if jax.dtypes.issubdtype(getattr(value, "dtype", None), jax.dtypes.extended):
        value = jax.random.key_data(value)  # a PRNG key: its raw data
    array = np.asarray(value)
    h = hashlib.sha256(f"{array.dtype}{array.shape}".encode())
    h.update(array.tobytes())
    return h.hexdigest()


def _scalar(c: Const) -> str:
    """A literal operand's value when it is a scalar (arrays count by shape and dtype)."""
    return f"={np.asarray(c.value).tolist()!r}" if not c.shape else ""


def _params(params: Mapping[str, Any], *, control: bool) -> str:
    """An equation's parameters as text.  A control node's bodies are graph nodes of their own,
    so its jaxpr parameters are left out; functions are named by module and qualified name."""
    parts = []
    for name in sorted(params):
        v = params[name]
        if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)):
            text = "<body>" if control else str(v)
        elif callable(v) and hasattr(v, "__qualname__"):
            text = f"{getattr(v, '__module__', '?')}.{v.__qualname__}"
        elif isinstance(v, (set, frozenset)):  # in an order that does not depend on hashing
            text = f"{{{', '.join(sorted(map(repr, v)))}}}"
        else:
            text = repr(v)
        parts.append(f"{name}={text}")
    return _unaddressed(";".join(parts))


def _text(x: Any) -> str:
    return _unaddressed(repr(x))


def _unaddressed(text: str) -> str:
    """``text`` without object addresses (the substring test first: the program's ten
    thousand equations have almost none)."""
    return _ADDRESS.sub("", text) if " at 0x" in text else text


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@functools.cache
def _versions() -> dict[str, str]:
    """jaxpar's version and a digest of its source (plans made by other code are not reused,
    released or not), JAX's and jaxlib's versions."""
    import jaxlib

    import jaxpar

    root = os.path.dirname(os.path.abspath(jaxpar.__file__))
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return {"jaxpar": jaxpar.__version__, "jaxpar_source": h.hexdigest(),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _rules_digest() -> str:
    """The registered operator rules, by primitive, function and category (a rule registered
    by the user changes which strategies exist)."""
    from jaxpar._src.rules.registry import _RULES

    return _sha(";".join(f"{name}:{getattr(fn, '__module__', '?')}."
                         f"{getattr(fn, '__qualname__', type(fn).__name__)}:{kind}"
                         for name, (fn, kind) in sorted(_RULES.items())))


def _ignored(api: str, path: str, why: str) -> None:
    """No plan, with a warning saying why the entry at ``path`` is not used."""
    warnings.warn(f"{api}: ignoring the plan cache entry {path!r}: {why}. Planning afresh; the "
                  f"new plan replaces it.", JaxparWarning, stacklevel=4)
    return None
