"""``jaxpar.shard``: MindSpore's operator sharding (``Primitive.shard``, ``mindspore.shard``,
``Cell.shard``).

Called on concrete arrays, a sharded function runs as its own semi-automatic program: its inputs
and outputs take the given layouts and the operators inside are propagated from them (a Flax NNX
module runs functionally: its state goes in and comes back, so ``parameter_plan`` may lay out its
parameters).  Called while a function is being traced (inside ``jaxpar.parallelize`` or
``jax.jit``), it pins the layouts of its inputs and outputs with sharding constraints; the
enclosing plan treats those as fixed and propagates or searches around them.  By hand the nested
form is::

    x = with_sharding_constraint(x, NamedSharding(mesh, P("dp", None)))   # per in_strategy
    y = fn(x, ...)
    y = with_sharding_constraint(y, NamedSharding(mesh, P("dp", "mp")))   # per out_strategy

Around a single operator it is MindSpore's ``Primitive.shard``: the operator's own strategy is
pinned too (see ``operator_shard.py``).  Inside ``parallelize`` the constraints are written on
JAX's abstract mesh of the program being traced, never on a concrete one, so a cached trace
cannot carry one program's mesh into another.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from jaxpar._src import pins as pinlib
from jaxpar._src.api import Parallelized, parallelize
from jaxpar._src.compat import is_tracer
from jaxpar._src.context import current_context
from jaxpar._src.errors import MeshError
from jaxpar._src.implicit_mesh import Found, MeshUse, implicit_mesh, strategy_requests
from jaxpar._src.modules import get_value, module_of, module_params, set_value
from jaxpar._src.operator_shard import (
    OPERATOR_SCOPE,
    Operator,
    device_matrix,
    operator_specs,
    single_operator,
)
from jaxpar._src.spec import MeshShape, Spec
from jaxpar._src.strategy import is_slice_counts, normalize
from jaxpar._src.tracing_state import recorder, tracing_mesh


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
        self._name = getattr(fn, "__name__", type(fn).__name__)
        self._api = f"jaxpar.shard({self._name})"
        self._standalone: dict[Any, Parallelized] = {}
        self._operators: dict[Any, Operator | None] = {}
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
            return self._constrained(self._fn, args)
        module = module_of(self._fn)
        if module is not None:
            from flax import nnx

            graphdef, state = nnx.split(module)
            out, new_state = self._module_program(graphdef)(state, *args)
            nnx.update(module, new_state)
            return out
        return self._program()(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The standalone program (semi-automatic, on these arguments), lowered."""
        module = module_of(self._fn)
        if module is not None:
            from flax import nnx

            graphdef, state = nnx.split(module)
            return self._module_program(graphdef).lower(state, *args)
        return self._program().lower(*args)

    def plan(self, *args: Any) -> Any:
        """The standalone program's :class:`ShardingPlan` for these arguments."""
        module = module_of(self._fn)
        if module is not None:
            from flax import nnx

            graphdef, state = nnx.split(module)
            return self._module_program(graphdef).plan(state, *args)
        return self._program().plan(*args)

    # -- standalone: a semi-automatic program whose pins are this function's layouts ----------
    def _program(self) -> Parallelized:
        program = self._standalone.get(None)
        if program is None:
            @functools.wraps(self._fn)
            def pinned(*args: Any) -> Any:
                return self._constrained(self._fn, args)

            # No mesh here means the context's, else the one these strategies describe.
            program = self._standalone[None] = parallelize(
                pinned, mesh=self._mesh, parallel_mode="semi_auto_parallel")
        return program

    def _module_program(self, graphdef: Any) -> Parallelized:
        """An NNX module runs functionally: ``(state, *args) -> (out, state)``, the module
        rebuilt inside the trace so its parameters may take their layouts."""
        program = self._standalone.get(graphdef)
        if program is None:
            from flax import nnx

            bound = getattr(self._fn, "__func__", None)

            def run(state: Any, *args: Any) -> Any:
                module = nnx.merge(graphdef, state)
                fn = functools.partial(bound, module) if bound is not None else module
                out = self._constrained(fn, args)
                return out, nnx.state(module)

            run.__name__ = self._name
            run.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
                [inspect.Parameter("state", inspect.Parameter.POSITIONAL_ONLY)] +
                [inspect.Parameter(n, inspect.Parameter.POSITIONAL_ONLY)
                 for n in self._arg_names])
            program = self._standalone[graphdef] = parallelize(
                run, mesh=self._mesh, parallel_mode="semi_auto_parallel")
        return program

    # -- nested: pin the boundary with sharding constraints ------------------------------------
    def _constrained(self, fn: Callable, args: tuple) -> Any:
        names = self._names(len(args))
        leaves, tree = jax.tree.flatten(list(args))
        module = module_of(fn)
        params = module_params(module) if module is not None and self._plan else []
        leaf_names = [n for _, n in pinlib.leaf_names(args, names)]
        by_name = pinlib.parameter_plan_strategies(
            self._plan, leaf_names + [name for name, _ in params], api=self._api)
        raw = pinlib.argument_strategies(self._in, args, names, api=self._api)
        raw = pinlib.merge(raw, by_name[: len(leaves)], leaf_names, api=self._api)
        param_raw = by_name[len(leaves):]
        op = self._operator(fn, args, raw) if module is None else None

        found = recorder()
        if found is not None:  # a discovery trace: only say what this shard asks for
            found.extend(self._requests(op, raw, leaf_names, params, param_raw))
            return fn(*args)

        mesh, target = self._mesh_here(op, raw, leaf_names, params, param_raw)
        shape = MeshShape.of(mesh)
        specs: Sequence[Spec | None] | None = None
        if op is not None and all(is_slice_counts(r) for r in raw):
            specs = operator_specs(op, raw, shape, where=f"{self._api}: operator {op.name}")
        if specs is None:
            specs = pinlib.normalize_all(raw, [x.shape for x in leaves],
                                         [x.dtype for x in leaves], mesh,
                                         [f"{self._api}: strategy of '{n}'" for n in leaf_names])
        leaves = [_constrain(x, s, target) for x, s in zip(leaves, specs, strict=True)]
        for (name, var), strategy in zip(params, param_raw, strict=True):
            if strategy is None:
                continue
            value = get_value(var)
            spec = normalize(strategy, value.shape, mesh, dtype=value.dtype,
                             where=f"{self._api}: parameter_plan for '{name}'")
            set_value(var, _constrain(value, spec, target))
        scope = jax.named_scope(OPERATOR_SCOPE) if op is not None else contextlib.nullcontext()
        with scope:
            out = fn(*jax.tree.unflatten(tree, leaves))
        if self._out is None:
            return out
        out_leaves, out_tree = jax.tree.flatten(out)
        raw_out = pinlib.output_strategies(self._out, out, api=self._api)
        out_specs = pinlib.normalize_all(
            raw_out, [x.shape for x in out_leaves], [x.dtype for x in out_leaves], mesh,
            [f"{self._api}: out_strategy[{i}]" for i in range(len(out_leaves))])
        out_leaves = [_constrain(x, s, target) for x, s in zip(out_leaves, out_specs, strict=True)]
        return jax.tree.unflatten(out_tree, out_leaves)

    def _operator(self, fn: Callable, args: tuple, raw: list[Any]) -> Operator | None:
        """The single operator ``fn`` is, when every input has a strategy (MindSpore's
        ``Primitive.shard``); ``None`` for any other function."""
        if any(r is None for r in raw):
            return None
        leaves, tree = jax.tree.flatten(list(args))
        key = (tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
        if key not in self._operators:
            self._operators[key] = single_operator(fn, args)
        return self._operators[key]

    def _requests(self, op: Operator | None, raw: list[Any], leaf_names: list[str],
                  params: list[tuple[str, Any]], param_raw: list[Any]) -> list[Found]:
        """The device matrices this call asks for (see ``implicit_mesh.py``)."""
        from jaxpar._src.device_matrix import Request

        found: list[Found] = []
        if self._mesh is not None:
            found.append(MeshUse(self._mesh, f"{self._api}: mesh="))
        matrix = None
        if op is not None and all(is_slice_counts(r) for r in raw):
            where = f"{self._api}: operator {op.name}"
            matrix = device_matrix(op, raw, where=where)
        if matrix is not None:
            found.append(Request(matrix[1], where, exact=True))
        else:
            for name, strategy in zip(leaf_names, raw, strict=True):
                found += strategy_requests(strategy, f"{self._api}: '{name}'")
        for (name, _), strategy in zip(params, param_raw, strict=True):
            found += strategy_requests(strategy, f"{self._api}: parameter_plan for '{name}'")
        found += strategy_requests(self._out, f"{self._api}: out_strategy")
        return found

    def _mesh_here(self, op: Operator | None, raw: list[Any], leaf_names: list[str],
                   params: list[tuple[str, Any]], param_raw: list[Any]) -> tuple[Mesh, Any]:
        """The mesh of the layouts, and what the constraints are written on: the abstract mesh
        of an enclosing ``parallelize`` (resolved when it lowers), else a concrete mesh."""
        if self._mesh is not None:
            return self._mesh, self._mesh
        traced = tracing_mesh()
        if traced is not None:
            return traced, traced.abstract_mesh
        mesh = current_context().mesh
        if mesh is None:
            n = current_context().device_num or len(jax.devices())
            mesh = implicit_mesh(self._requests(op, raw, leaf_names, params, param_raw), n)
        if mesh is None:
            raise MeshError(
                f"{self._api}: no mesh to place these layouts on. Call it inside "
                f"jaxpar.parallelize, pass mesh=..., set_auto_parallel_context(mesh=...), or "
                f"give slice counts or a jaxpar.Layout.")
        return mesh, mesh


def _constrain(x: Any, spec: Spec | None, target: Any) -> Any:
    if spec is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(target, spec.to_partition_spec()))


def shard(fn: Callable | None = None, in_strategy: Any = None, out_strategy: Any = None,
          parameter_plan: Mapping[str, Any] | None = None, *,
          mesh: Mesh | None = None) -> Any:
    """Fixes the layouts of a function's inputs and outputs (MindSpore ``mindspore.shard``).

    Args:
      fn: the function; omit it to use ``shard`` as a decorator.  When ``fn`` is one operator
        (``x @ w``, ``jnp.matmul``) and every input has a strategy, the operator's own strategy
        is fixed too, as MindSpore's ``Primitive.shard``.
      in_strategy: one strategy per positional argument: slice counts such as ``(2, 1)``, a
        ``PartitionSpec``, a ``jaxpar.Layout``, ``None`` (free), or a tree of them.
      out_strategy: strategies for the results, in the same forms.
      parameter_plan: ``{name or glob: strategy}`` for arguments by name (``"w"``,
        ``"params.w1"``) and, when ``fn`` is a Flax NNX module or its method, for the module's
        parameters by path (``"fc1.kernel"``), as MindSpore's ``Cell.shard``.
      mesh: the mesh; default: the enclosing ``parallelize``'s, else the context's, else the
        one the strategies describe (MindSpore's device matrix, see ``jaxpar.make_mesh``).

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
