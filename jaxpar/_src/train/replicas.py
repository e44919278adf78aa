"""``per_replica``: MindSpore's data-parallel execution, one program per replica.

In MindSpore's data-parallel mode every device runs the network on its own slice of the batch and
a :class:`~jaxpar.DistributedGradReducer` averages the gradients.  ``per_replica(step)`` gives a
JAX step that shape: ``step`` is traced once, as the program of one replica (``jax.shard_map``
over every mesh axis underneath), its batch arguments split along dimension 0, everything else
replicated.  What comes back:

* a result that returns an argument's state (same structure, shapes, dtypes: updated parameters,
  optimizer state) is the same on every replica once the gradients are reduced, and comes back
  once (jaxpar warns when the step never called a reducer);
* any other result (a replica's loss, its metrics) comes back stacked, one row per replica.

A replica's gradients are its own, as in MindSpore (``jax.shard_map`` with ``check_vma=False``:
JAX does not sum them behind your back), until the reducer all-reduces them.

The context's ``dataset_strategy`` applies: ``"full_batch"`` gives every replica the whole batch.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar._src.arguments import check_argnums
from jaxpar._src.cache_key import call_key
from jaxpar._src.context import current_context
from jaxpar._src.data_parallel import infer_batch_argnums
from jaxpar._src.errors import ContextError, StrategyError, warn_once
from jaxpar._src.execution import pynative
from jaxpar._src.mesh import check_auto_axes, make_mesh
from jaxpar._src.state import threaded_state
from jaxpar._src.tracing_state import reducer_calls, replicas_with

API = "jaxpar.per_replica"


def per_replica(fn: Callable | None = None, *, batch_argnums: int | Sequence[int] | None = None,
                static_argnums: int | Sequence[int] = (), mesh: Mesh | None = None,
                donate_argnums: int | Sequence[int] = ()) -> Any:
    """Runs ``fn`` once per data-parallel replica on its slice of the batch.

    Args:
      fn: the step of one replica; reduce its gradients with
        :class:`~jaxpar.DistributedGradReducer`. Also usable as a decorator, with or without
        arguments.
      batch_argnums: the positional arguments that carry the batch; inferred, as in
        ``data_parallel`` mode, from a step that returns its state.
      static_argnums: as ``jax.jit``.
      mesh: the devices; default the context's mesh, else every device on one axis. The
        replicas span all of its axes.
      donate_argnums: as ``jax.jit``.

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> @jaxpar.per_replica(batch_argnums=(0,))
    ... def rows(x):
    ...     return jnp.sum(x)
    >>> rows(jnp.ones((16, 3))).tolist()  # 8 replicas of 2 rows each
    [6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0, 6.0]
    """
    options: dict[str, Any] = dict(batch_argnums=batch_argnums, static_argnums=static_argnums,
                                   mesh=mesh, donate_argnums=donate_argnums)
    if fn is None:
        return lambda f: PerReplica(f, **options)
    return PerReplica(fn, **options)


class PerReplica:
    """A step run once per replica; call it like the function (see :func:`per_replica`).

    >>> import jax.numpy as jnp, jaxpar
    >>> step = jaxpar.per_replica(lambda x: jnp.mean(x), batch_argnums=(0,))
    >>> isinstance(step, jaxpar.PerReplica), step(jnp.arange(16.0)).shape  # one mean per replica
    (True, (8,))
    """

    def __init__(self, fn: Callable, *, batch_argnums: Any, static_argnums: Any,
                 mesh: Mesh | None, donate_argnums: Any) -> None:
        self._fn = fn
        self._batch, self._donate, self._static = check_argnums(
            fn, f"{API}({getattr(fn, '__name__', 'fn')})", batch_argnums=batch_argnums,
            donate_argnums=donate_argnums, static_argnums=static_argnums)
        self._mesh = mesh
        self._cache: dict[Any, tuple[Any, Callable]] = {}
        try:
            self._names = [p for p in inspect.signature(fn).parameters]
        except (TypeError, ValueError):
            self._names = []
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any) -> Any:
        jitted, eager = self._compiled(args)
        if pynative():  # the shard_map runs eagerly, operator by operator
            with jax.disable_jit():
                return eager(*args)
        return jitted(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` program of one step on every replica."""
        return self._compiled(args)[0].lower(*args)

    # -- internals ----------------------------------------------------------------------------
    def _settings(self) -> tuple[Mesh, Any]:
        ctx = current_context()
        mesh = self._mesh or ctx.mesh
        if mesh is None:
            mesh = make_mesh((ctx.device_num or len(jax.devices()),), ("devices",))
        check_auto_axes(mesh, API)
        if not isinstance(ctx.dataset_strategy, str):
            raise ContextError(
                f"{API}: dataset_strategy={ctx.dataset_strategy!r} splits more than the batch "
                f"dimension; a replica's program cannot see such tiles. Use "
                f"jaxpar.parallelize in semi_auto_parallel or auto_parallel mode for it, or "
                f"dataset_strategy='data_parallel' / 'full_batch' here.")
        return mesh, ctx.dataset_strategy

    def _compiled(self, args: tuple) -> tuple[Any, Callable]:
        """The jitted step and its eager form (for PYNATIVE_MODE)."""
        mesh, dataset_strategy = self._settings()
        key = (call_key(args, self._static, api=API, names=self._names), mesh, dataset_strategy)
        built = self._cache.get(key)
        if built is None:
            built = self._cache[key] = self._build(args, mesh, dataset_strategy)
        return built

    def _name(self, i: int) -> str:
        return self._names[i] if i < len(self._names) else f"arg{i}"

    def _build(self, args: tuple, mesh: Mesh, dataset_strategy: str
               ) -> tuple[Any, Callable]:
        axes = tuple(mesh.axis_names)
        n = int(mesh.devices.size)
        dyn = [i for i in range(len(args)) if i not in self._static]
        whole = [jax.tree.map(lambda _: P(), args[i]) for i in dyn]
        shapes = self._shapes(args, mesh, whole)
        batch = self._batch
        if batch is None:
            batch = infer_batch_argnums(args, shapes, self._static,
                                        [self._name(i) for i in range(len(args))], api=API)
        in_specs = []
        for i, spec in zip(dyn, whole, strict=True):
            if i in batch and dataset_strategy == "data_parallel":
                spec = jax.tree.map(lambda x, i=i: self._batch_spec(x, i, axes, n, mesh), args[i])
            in_specs.append(spec)
        # One result, or several (a tuple or list); a list that is itself a returned argument
        # (a list of layers' parameters) is one result.
        single = not isinstance(shapes, (tuple, list)) or bool(
            threaded_state(args, (shapes,), self._static))
        results = (shapes,) if single else tuple(shapes)
        state = {k for _, k in threaded_state(args, results, self._static)}
        out_specs = tuple(P() if k in state else P(axes) for k in range(len(results)))
        reduced: list[bool] = []

        def replica(*dyn_args: Any) -> Any:
            calls = reducer_calls()
            out = self._call(args, dyn, dyn_args, axes)
            reduced.append(reducer_calls() > calls)
            outs = (out,) if single else tuple(out)
            return tuple(o if k in state else jax.tree.map(lambda x: jnp.asarray(x)[None], o)
                         for k, o in enumerate(outs))

        # check_vma=False: a replica's gradients stay its own (MindSpore's semantics) until the
        # DistributedGradReducer all-reduces them in the buckets the fusion config chose.
        mapped = jax.shard_map(replica, mesh=mesh, in_specs=tuple(in_specs),
                               out_specs=out_specs, check_vma=False)

        def run(*call_args: Any) -> Any:
            outs = mapped(*[call_args[i] for i in dyn])
            if state and reduced and not reduced[-1] and any(
                    jnp.issubdtype(x.dtype, jnp.inexact)
                    for k in state for x in jax.tree.leaves(results[k])):
                warn_once(f"per_replica_unreduced:{id(self)}", (
                    f"{API}: '{getattr(self._fn, '__name__', 'fn')}' returns updated state but "
                    f"never called a DistributedGradReducer: each replica updates from its own "
                    f"gradients, and the state returned is replica 0's. Reduce the gradients "
                    f"with jaxpar.DistributedGradReducer (or jax.lax.pmean) before the update."))
            if single:
                return outs[0]
            return list(outs) if isinstance(shapes, list) else outs

        donate = tuple(i for i in self._donate if i not in self._static)
        return jax.jit(run, static_argnums=self._static, donate_argnums=donate), run

    def _call(self, args: tuple, dyn: Sequence[int], dyn_args: Sequence[Any],
              axes: tuple[str, ...]) -> Any:
        full = list(args)
        for i, a in zip(dyn, dyn_args, strict=True):
            full[i] = a
        with replicas_with(axes):
            return self._fn(*full)

    def _shapes(self, args: tuple, mesh: Mesh, in_specs: Sequence[Any]) -> Any:
        """The result shapes of one replica's step (each seeing every argument whole: only
        structure, shapes and dtypes matter here)."""
        axes = tuple(mesh.axis_names)
        dyn = [i for i in range(len(args)) if i not in self._static]

        def replica(*dyn_args: Any) -> Any:
            out = self._call(args, dyn, dyn_args, axes)
            return jax.tree.map(lambda x: jnp.asarray(x)[None], out)

        mapped = jax.shard_map(replica, mesh=mesh, in_specs=tuple(in_specs), out_specs=P(axes),
                               check_vma=False)
        stacked = jax.eval_shape(mapped, *[args[i] for i in dyn])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), stacked)

    def _batch_spec(self, x: Any, i: int, axes: tuple[str, ...], n: int, mesh: Mesh) -> P:
        shape = getattr(x, "shape", ())
        if not shape:
            return P()
        if shape[0] % n:
            raise StrategyError(
                f"{API}: argument '{self._name(i)}' (shape {list(shape)}) is split along "
                f"dimension 0 over the {n} replicas of mesh {dict(mesh.shape)}, but {shape[0]} "
                f"is not divisible by {n}. Use a global batch that is a multiple of {n} (drop "
                f"the remainder), or pass batch_argnums without it.")
        return P(axes)
