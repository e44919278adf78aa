"""``jaxpar.shard``: MindSpore's functional operator sharding (``mindspore.shard``/``Cell.shard``).

Called on concrete arrays, a sharded function runs as its own semi-automatic program: its inputs
and outputs take the given layouts and the operators inside are propagated from them.  Called
while a function is being traced (inside ``jaxpar.parallelize`` or ``jax.jit``), it pins the
layouts of its inputs and outputs with sharding constraints; the enclosing plan treats those as
fixed and propagates or searches around them.  By hand the nested form is::

    x = with_sharding_constraint(x, NamedSharding(mesh, P("dp", None)))   # per in_strategy
    y = fn(x, ...)
    y = with_sharding_constraint(y, NamedSharding(mesh, P("dp", "mp")))   # per out_strategy
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar._src import pins as pinlib
from jaxpar._src.api import Parallelized, parallelize
from jaxpar._src.compat import is_tracer
from jaxpar._src.context import current_context
from jaxpar._src.errors import MeshError
from jaxpar._src.lower import named_sharding
from jaxpar._src.modules import get_value, module_of, module_params, set_value
from jaxpar._src.strategy import (
    is_slice_counts,
    is_strategy_leaf,
    mesh_for_slice_counts,
    normalize,
)
from jaxpar._src.tracing_state import tracing_mesh


class Sharded:
    """A function with fixed input/output layouts; see :func:`shard`."""

    def __init__(self, fn: Callable, in_strategy: Any, out_strategy: Any,
                 parameter_plan: Mapping[str, Any] | None, mesh: Mesh | None) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._in = in_strategy
        self._out = out_strategy
        self._plan = parameter_plan
        self._mesh = mesh
        self._name = getattr(fn, "__name__", "fn")
        self._api = f"jaxpar.shard({self._name})"
        self._standalone: dict[Mesh, Parallelized] = {}
        try:
            params = inspect.signature(fn).parameters
            self._arg_names = [n for n, p in params.items() if p.kind in (
                p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            self._arg_names = []

    def _names(self, n: int) -> list[str]:
        return [self._arg_names[i] if i < len(self._arg_names) else f"arg{i}" for i in range(n)]

    def __call__(self, *args: Any) -> Any:
        if any(is_tracer(x) for x in jax.tree.leaves(args)):
            return self._constrained(args)
        return self._parallelized()(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The standalone program (semi-automatic, on these arguments), lowered."""
        return self._parallelized().lower(*args)

    def plan(self, *args: Any) -> Any:
        return self._parallelized().plan(*args)

    def _parallelized(self) -> Parallelized:
        """Run standalone: a semi-automatic program whose pins are this function's layouts."""
        mesh = self._mesh_here()
        program = self._standalone.get(mesh)
        if program is None:
            @functools.wraps(self._fn)
            def pinned(*args: Any) -> Any:
                return self._constrained(args)

            program = self._standalone[mesh] = parallelize(
                pinned, mesh=mesh, parallel_mode="semi_auto_parallel")
        return program

    # -- nested: pin the boundary with sharding constraints ------------------------------------
    def _mesh_here(self) -> Mesh:
        mesh = self._mesh or tracing_mesh() or current_context().mesh
        if mesh is not None:
            return mesh
        counts = [x for t in (self._in, self._out) if t is not None
                  for x in jax.tree.leaves(t, is_leaf=is_strategy_leaf) if is_slice_counts(x)]
        counts += [x for x in (self._plan or {}).values() if is_slice_counts(x)]
        if not counts:
            raise MeshError(
                f"{self._api}: no mesh to place these layouts on. Call it inside "
                f"jaxpar.parallelize, pass mesh=..., or set_auto_parallel_context(mesh=...).")
        n = current_context().device_num or len(jax.devices())
        return mesh_for_slice_counts(counts, n, where=self._api)

    def _constrained(self, args: tuple) -> Any:
        mesh = self._mesh_here()
        names = self._names(len(args))
        leaves, tree = jax.tree.flatten(list(args))
        module = module_of(self._fn)
        params = module_params(module) if module is not None and self._plan else []
        leaf_names = [n for _, n in pinlib.leaf_names(args, names)]
        all_names = leaf_names + [name for name, _ in params]
        by_name = pinlib.parameter_plan_strategies(self._plan, all_names, api=self._api)
        raw = pinlib.argument_strategies(self._in, args, names, api=self._api)
        raw = pinlib.merge(raw, by_name[: len(leaves)], leaf_names, api=self._api)
        wheres = [f"{self._api}: strategy of '{n}'" for n in leaf_names]
        specs = pinlib.normalize_all(raw, [x.shape for x in leaves], [x.dtype for x in leaves],
                                     mesh, wheres)
        leaves = [x if s is None else jax.lax.with_sharding_constraint(x, named_sharding(mesh, s))
                  for x, s in zip(leaves, specs, strict=True)]
        for (name, var), strategy in zip(params, by_name[len(leaves):], strict=True):
            if strategy is None:
                continue
            value = get_value(var)
            spec = normalize(strategy, value.shape, mesh, dtype=value.dtype,
                             where=f"{self._api}: parameter_plan for '{name}'")
            set_value(var, jax.lax.with_sharding_constraint(value, named_sharding(mesh, spec)))
        out = self._fn(*jax.tree.unflatten(tree, leaves))
        if self._out is None:
            return out
        out_leaves, out_tree = jax.tree.flatten(out)
        raw_out = pinlib.output_strategies(self._out, out, api=self._api)
        out_specs = pinlib.normalize_all(
            raw_out, [x.shape for x in out_leaves], [x.dtype for x in out_leaves], mesh,
            [f"{self._api}: out_strategy[{i}]" for i in range(len(out_leaves))])
        out_leaves = [x if s is None else jax.lax.with_sharding_constraint(
            x, named_sharding(mesh, s)) for x, s in zip(out_leaves, out_specs, strict=True)]
        return jax.tree.unflatten(out_tree, out_leaves)


def shard(fn: Callable | None = None, in_strategy: Any = None, out_strategy: Any = None,
          parameter_plan: Mapping[str, Any] | None = None, *,
          mesh: Mesh | None = None) -> Any:
    """Fixes the layouts of a function's inputs and outputs (MindSpore ``mindspore.shard``).

    Args:
      fn: the function; omit it to use ``shard`` as a decorator.
      in_strategy: one strategy per positional argument: slice counts such as ``(2, 1)``, a
        ``PartitionSpec``, a ``jaxpar.Layout``, ``None`` (free), or a tree of them.
      out_strategy: strategies for the results, in the same forms.
      parameter_plan: ``{name or glob: strategy}`` for arguments by name (``"w"``,
        ``"params.w1"``) and, when ``fn`` is a Flax NNX module or its method, for the module's
        parameters by path (``"fc1.kernel"``), as MindSpore's ``Cell.shard``.
      mesh: the mesh; default: the enclosing ``parallelize``'s, else the context's, else one
        built from the slice counts.

    Returns:
      A callable.  On concrete arrays it runs as a semi-automatic program of its own (it also
      has ``.lower`` and ``.plan``); inside a traced function it pins the layouts and the
      enclosing plan propagates around them.

    >>> import jax.numpy as jnp
    >>> mesh = make_mesh((2, 4), ("dp", "mp"))
    >>> @shard(in_strategy=((2, 1), (1, 4)), mesh=mesh)
    ... def dense(x, w):
    ...     return x @ w
    >>> y = dense(jnp.ones((8, 16)), jnp.ones((16, 32)))
    >>> y.sharding.spec == P("dp", "mp")
    True
    """
    if fn is None:
        return lambda f: Sharded(f, in_strategy, out_strategy, parameter_plan, mesh)
    return Sharded(fn, in_strategy, out_strategy, parameter_plan, mesh)
