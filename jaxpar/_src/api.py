"""``jaxpar.parallelize``: the whole-program transform (trace -> plan -> lower), jit-like."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar._src import pins as pinlib
from jaxpar._src.context import (
    SEARCH_MODES,
    AlgoParameters,
    ParallelMode,
    algo_parameters,
    current_context,
)
from jaxpar._src.cost import CostModel
from jaxpar._src.data_parallel import (
    arrival_specs,
    batch_specs,
    dataset_specs,
    infer_batch_argnums,
)
from jaxpar._src.errors import ContextError, PlanError, StrategyError
from jaxpar._src.execution import pynative
from jaxpar._src.gcpause import paused_gc
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.implicit_mesh import discover, implicit_mesh, outer_requests
from jaxpar._src.lower import make_evaluator, named_sharding
from jaxpar._src.mesh import check_auto_axes, make_mesh, single_device_mesh
from jaxpar._src.operator_shard import operator_pins
from jaxpar._src.pipeline import tracing as pipeline_tracing
from jaxpar._src.pipeline.outer import attach_pipeline, pipeline_pins, pipeline_settings
from jaxpar._src.plan import ShardingPlan, make_plan
from jaxpar._src.planner import decide, load_strategies
from jaxpar._src.report.context import remember
from jaxpar._src.rules import strategy_for_specs
from jaxpar._src.search import Pin, SearchSpace
from jaxpar._src.spec import MeshShape, Spec
from jaxpar._src.state import state_ties
from jaxpar._src.trace import TracedProgram, trace
from jaxpar._src.tracing_state import tracing_with


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything a plan depends on besides the function and its argument signature."""

    mode: ParallelMode
    search_mode: str
    mesh: Mesh
    hardware: HardwareProfile
    algo: AlgoParameters
    ckpt_load: str  # strategy_ckpt_load_file
    ckpt_save: str  # strategy_ckpt_save_file
    dataset_strategy: str | tuple = "data_parallel"  # how batch arguments arrive
    pipeline: Any = None  # PipelineSettings: stages, micro-batches, schedule


@dataclasses.dataclass(frozen=True, eq=False)
class Compiled:
    """One input signature's traced program, plan and jitted function."""

    program: TracedProgram
    plan: ShardingPlan
    settings: Settings
    jitted: Any
    in_shardings: tuple[Any, ...]  # flat, per dynamic leaf
    timings: Mapping[str, float]  # seconds: trace, search (plan)


class Parallelized:
    """A function transformed by :func:`parallelize`: call it, ``.lower`` it, ``.plan`` it."""

    def __init__(self, fn: Callable, *, mesh: Mesh | None, parallel_mode: Any,
                 search_mode: str | None, in_strategy: Any, out_strategy: Any,
                 hardware: HardwareProfile | None, batch_argnums: Sequence[int] | int | None,
                 donate_argnums: Sequence[int] | int, static_argnums: Sequence[int] | int,
                 parameter_plan: Mapping[str, Any] | None, api: str = "jaxpar.parallelize",
                 micro_batches: int | None = None):
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._mesh = mesh
        self._mode = None if parallel_mode is None else _mode(parallel_mode)
        if search_mode is not None and search_mode not in SEARCH_MODES:
            raise ContextError(f"{api}: search_mode {search_mode!r} is not one of "
                               f"{list(SEARCH_MODES)}.")
        self._search_mode = search_mode
        self._in_strategy = in_strategy
        self._out_strategy = out_strategy
        self._hardware = hardware
        self._batch_argnums = _argnums(batch_argnums)
        self._donate = _argnums(donate_argnums) or ()
        self._static = _argnums(static_argnums) or ()
        self._parameter_plan = parameter_plan
        self._micro_batches = micro_batches
        self._api = f"{api}({getattr(fn, '__name__', 'fn')})"
        self._signature = _signature(fn)
        self._cache: dict[Any, Compiled] = {}
        self._implicit: dict[Any, Mesh | None] = {}  # meshes built from the strategies
        if mesh is not None:
            check_auto_axes(mesh, self._api)

    # -- public -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = self._bind(args, kwargs)
        entry = self._compiled(args)
        full = self._placed(args, entry)
        if pynative():  # eager, op by op, on the arguments placed as the plan says
            with jax.disable_jit():
                return self._fn(*full)
        return entry.jitted(*full)

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` program; ``.compile().as_text()`` is the partitioned HLO."""
        args = self._bind(args, kwargs)
        entry = self._compiled(args)
        with paused_gc():
            return entry.jitted.lower(*self._placed(args, entry))

    def plan(self, *args: Any, **kwargs: Any) -> ShardingPlan:
        """The :class:`ShardingPlan` for these arguments (only their shapes and dtypes matter)."""
        return self._compiled(self._bind(args, kwargs)).plan

    def report(self, *args: Any, path: str | None = None, other: ShardingPlan | None = None,
               title: str | None = None) -> Any:
        """The HTML report of the plan for these arguments, with the compiled program's
        collectives and their causes (see :meth:`ShardingPlan.report`).  Compiles the program;
        pass the function's arguments positionally."""
        from jaxpar._src.report.build import build_report

        entry = self._compiled(args)
        compiled = self.lower(*args).compile()
        return build_report(entry.plan, compiled=compiled, graph=entry.program.graph,
                            other=other, title=title or f"jaxpar plan of {self._api}",
                            path=path)

    def compiled_entry(self, *args: Any, **kwargs: Any) -> Compiled:
        """The traced program, plan, settings and timings for these arguments."""
        return self._compiled(self._bind(args, kwargs))

    # -- internals ----------------------------------------------------------------------------
    def _placed(self, args: tuple, entry: Compiled) -> list:
        """The arguments moved to the layouts the plan takes them in (arrays placed elsewhere,
        e.g. batches on another mesh, are resharded)."""
        dyn = [a for i, a in enumerate(args) if i not in self._static]
        leaves, tree = jax.tree.flatten(dyn)
        placed = [_place(x, s) for x, s in zip(leaves, entry.in_shardings, strict=True)]
        it = iter(jax.tree.unflatten(tree, placed))
        return [a if i in self._static else next(it) for i, a in enumerate(args)]

    def _bind(self, args: tuple, kwargs: dict) -> tuple:
        if not kwargs:
            return args
        if self._signature is None:
            raise TypeError(f"{self._api}: pass arguments positionally.")
        bound = self._signature.bind(*args, **kwargs)
        if bound.kwargs:
            raise TypeError(f"{self._api}: keyword-only arguments {sorted(bound.kwargs)} are not "
                            f"supported; make them positional.")
        return tuple(bound.args)

    def _settings(self, args: tuple) -> Settings:
        ctx = current_context()
        mode = self._mode if self._mode is not None else ctx.parallel_mode
        search = self._search_mode or ctx.search_mode
        hardware = self._hardware or ctx.hardware or HardwareProfile()
        if mode is ParallelMode.STAND_ALONE:
            mesh = single_device_mesh()
        else:
            mesh = self._mesh or ctx.mesh or self._strategy_mesh(ctx, mode, args)
            if mesh is None:
                n = ctx.device_num or len(jax.devices())
                mesh = make_mesh((n,), ("devices",))
        check_auto_axes(mesh, self._api)
        if mode is ParallelMode.DATA_PARALLEL and not ctx.gradients_mean:
            raise ContextError(
                f"{self._api}: gradients_mean=False asks for the sum of per-device gradients, "
                f"but a JAX program sees the global batch: its gradients are the device mean "
                f"(gradients_mean=True), which XLA all-reduces for you. Scale the loss by the "
                f"number of devices if you want the MindSpore sum.")
        return Settings(mode, search, mesh, hardware, algo_parameters(),
                        str(ctx.strategy_ckpt_load_file), str(ctx.strategy_ckpt_save_file),
                        ctx.dataset_strategy,
                        pipeline_settings(ctx, self._micro_batches, self._api))

    def _strategy_mesh(self, ctx: Any, mode: ParallelMode, args: tuple) -> Mesh | None:
        """MindSpore's device matrix when no mesh is given: one mesh from every strategy of the
        program, the nested ``jaxpar.shard``s first (see ``implicit_mesh.py``)."""
        n = ctx.device_num or len(jax.devices())
        key = (_signature_key(args, self._static), n, mode, ctx.dataset_strategy)
        if key not in self._implicit:
            found = outer_requests(in_strategy=self._in_strategy, out_strategy=self._out_strategy,
                                   parameter_plan=self._parameter_plan,
                                   dataset_strategy=ctx.dataset_strategy, api=self._api)
            if mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
                found = discover(self._fn, args, self._static) + found
            self._implicit[key] = implicit_mesh(found, n)
        return self._implicit[key]

    def _compiled(self, args: tuple) -> Compiled:
        settings = self._settings(args)
        key = (_signature_key(args, self._static), settings)
        entry = self._cache.get(key)
        if entry is None:
            with paused_gc():
                entry = self._cache[key] = self._build(args, settings)
            remember(entry.plan, entry.program.graph)  # for plan.report() / notebooks
        return entry

    def _build(self, args: tuple, settings: Settings) -> Compiled:
        t0 = time.perf_counter()
        names = self._arg_names(len(args))
        mesh = settings.mesh
        with tracing_with(mesh), pipeline_tracing.pipelining(pipeline_tracing.Tracing(
                settings.pipeline, mesh, settings.mode, settings.search_mode,
                settings.hardware)):
            program = trace(self._fn, args, static_argnums=self._static, arg_names=names)
            batch = None
            if settings.mode is ParallelMode.DATA_PARALLEL or (
                    settings.mode is not ParallelMode.STAND_ALONE
                    and settings.dataset_strategy != "data_parallel"):
                batch = self._batch(args, program, names)
        t1 = time.perf_counter()
        model = CostModel(MeshShape.of(mesh), settings.hardware)
        space = SearchSpace(program.graph, model)
        pins = self._pins(args, program, mesh, space, settings, batch)
        ties = state_ties(program, args, self._static)
        if settings.ckpt_load:
            decision = load_strategies(settings.ckpt_load, space, api=self._api)
        else:
            decision = decide(space, pins, ties, mode=settings.mode,
                              search_mode=settings.search_mode,
                              baseline_pins=self._baseline_pins(args, program, space, settings,
                                                                pins, names),
                              api=self._api)
        plan = make_plan(program.graph, decision.assignment, space,
                         device_ids=[d.id for d in mesh.devices.flat],
                         parallel_mode=settings.mode.value, search_mode=decision.search_mode,
                         details=decision.details, report=decision.report)
        plan = attach_pipeline(plan, program.graph)
        if settings.ckpt_save:
            plan.save(settings.ckpt_save)
        t2 = time.perf_counter()
        in_shapes = [program.graph.values[program.graph.nodes[n].outputs[0]].shape
                     for n in program.graph.inputs]
        arrivals = arrival_specs(program, batch, settings.dataset_strategy, in_shapes)
        jitted, flat_in = self._jit(program, plan, mesh, settings, arrivals)
        return Compiled(program, plan, settings, jitted, flat_in,
                        {"trace": t1 - t0, "search": t2 - t1})

    def _arg_names(self, n: int) -> list[str]:
        names = list(self._signature.parameters) if self._signature is not None else []
        names = [p for p in names if self._signature.parameters[p].kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        return [names[i] if i < len(names) else f"arg{i}" for i in range(n)]

    def _batch(self, args: tuple, program: TracedProgram, names: list[str]) -> tuple[int, ...]:
        if self._batch_argnums is not None:
            return self._batch_argnums
        return infer_batch_argnums(args, program.out_shapes, self._static, names, api=self._api)

    def _pins(self, args: tuple, program: TracedProgram, mesh: Mesh, space: SearchSpace,
              settings: Settings, batch: tuple[int, ...] | None) -> list[Pin]:
        graph = program.graph
        mshape = MeshShape.of(mesh)
        in_shapes = [graph.values[graph.nodes[n].outputs[0]].shape for n in graph.inputs]
        in_dtypes = [graph.values[graph.nodes[n].outputs[0]].dtype for n in graph.inputs]
        pins: list[Pin] = []
        if settings.mode is ParallelMode.STAND_ALONE:
            return pins
        if settings.mode is ParallelMode.DATA_PARALLEL:
            specs = batch_specs(program, batch, mshape, in_shapes, api=self._api)
            for nid, spec in zip(graph.inputs, specs, strict=True):
                pins.append(self._pin(space, nid, "out", spec, "data_parallel"))
        if isinstance(settings.dataset_strategy, tuple):
            tiles = dataset_specs(program, batch, settings.dataset_strategy, mesh, in_shapes,
                                  in_dtypes, api=self._api)
            by_node = {p.node: k for k, p in enumerate(pins)}
            for nid, spec in zip(graph.inputs, tiles, strict=True):
                if spec is None:
                    continue
                pin = self._pin(space, nid, "out", spec, "dataset_strategy")
                if nid in by_node:
                    pins[by_node[nid]] = pin
                else:
                    pins.append(pin)
        dyn_args = [a for i, a in enumerate(args) if i not in self._static]
        dyn_names = [n for i, n in enumerate(self._arg_names(len(args))) if i not in self._static]
        leaf_names = [name for _, name in pinlib.leaf_names(dyn_args, dyn_names)]
        raw = pinlib.argument_strategies(self._in_strategy, dyn_args, dyn_names, api=self._api)
        by_name = pinlib.parameter_plan_strategies(self._parameter_plan, leaf_names,
                                                   api=self._api)
        raw = pinlib.merge(raw, by_name, leaf_names, api=self._api)
        wheres = [f"{self._api}: strategy of argument '{nm}'" for nm in leaf_names]
        specs = pinlib.normalize_all(raw, in_shapes, in_dtypes, mesh, wheres)
        pinned_inputs = {p.node for p in pins}
        for nid, spec in zip(graph.inputs, specs, strict=True):
            if spec is None:
                continue
            if nid in pinned_inputs and settings.mode is ParallelMode.DATA_PARALLEL:
                raise StrategyError(
                    f"{self._api}: in data_parallel mode the layouts of the arguments are "
                    f"fixed by the mode; drop in_strategy/parameter_plan or use "
                    f"parallel_mode='semi_auto_parallel'.")
            if nid in pinned_inputs:
                raise StrategyError(
                    f"{self._api}: argument leaf '{leaf_names[graph.inputs.index(nid)]}' has "
                    f"its layout from dataset_strategy and from in_strategy/parameter_plan; "
                    f"give it one.")
            pins.append(self._pin(space, nid, "out", spec, "in_strategy"))
        out_raw = pinlib.output_strategies(self._out_strategy, program.out_shapes, api=self._api)
        out_nodes = graph.outputs
        out_shapes = [graph.operand_shape(graph.nodes[n].inputs[0]) for n in out_nodes]
        out_dtypes = [graph.operand_dtype(graph.nodes[n].inputs[0]) for n in out_nodes]
        out_specs = pinlib.normalize_all(
            out_raw, out_shapes, out_dtypes, mesh,
            [f"{self._api}: out_strategy for {p}" for p in program.out_paths])
        for nid, spec in zip(out_nodes, out_specs, strict=True):
            if spec is not None:
                pins.append(self._pin(space, nid, "in", spec, "out_strategy"))
        pins.extend(_constraint_pins(space, mshape, self._api))
        pins.extend(operator_pins(space, mshape))
        pins.extend(pipeline_pins(space, mshape))
        if not pins and settings.mode is ParallelMode.SEMI_AUTO_PARALLEL and \
                settings.dataset_strategy == "data_parallel":
            pins = self._data_parallel_default(args, program, space, in_shapes)
        return pins

    def _data_parallel_default(self, args: tuple, program: TracedProgram, space: SearchSpace,
                               in_shapes: list) -> list[Pin]:
        """MindSpore's semi-automatic default where nothing is configured: the batch arrives
        split over every device (``dataset_strategy="data_parallel"``); the rest propagates."""
        try:
            batch = self._batch(args, program, self._arg_names(len(args)))
        except PlanError as e:
            raise PlanError(
                f"{self._api}: semi_auto_parallel needs at least one fixed strategy to "
                f"propagate from, and none is given. Like MindSpore it then splits the batch "
                f"over every device (dataset_strategy='data_parallel'), but: {e} Or give a "
                f"strategy (in_strategy, jaxpar.shard).") from None
        specs = batch_specs(program, batch, space.model.mesh, in_shapes, api=self._api)
        return [self._pin(space, nid, "out", spec, "data_parallel")
                for nid, spec in zip(program.graph.inputs, specs, strict=True)
                if not spec.is_replicated]

    def _pin(self, space: SearchSpace, nid: int, side: str, spec: Spec, origin: str) -> Pin:
        strategy = strategy_for_specs(space.rule(nid), {(side, 0): spec}, space.model.mesh)
        if strategy is None:  # normalisation checked divisibility; this is a jaxpar bug
            raise PlanError(f"{self._api}: internal error pinning node {nid} to {spec}.")
        return Pin(nid, strategy, origin)

    def _baseline_pins(self, args: tuple, program: TracedProgram, space: SearchSpace,
                       settings: Settings, pins: list[Pin], names: list[str]
                       ) -> list[Pin] | None:
        """Pins of pure data parallel (plus the user's), the yardstick of the fast searches."""
        if settings.mode is not ParallelMode.AUTO_PARALLEL:
            return None
        try:
            batch = self._batch(args, program, names)
            specs = batch_specs(program, batch, space.model.mesh, [
                program.graph.values[program.graph.nodes[n].outputs[0]].shape
                for n in program.graph.inputs], api=self._api)
        except (PlanError, StrategyError):
            return None
        pinned = {p.node for p in pins}
        base = [self._pin(space, nid, "out", spec, "data_parallel")
                for nid, spec in zip(program.graph.inputs, specs, strict=True)
                if nid not in pinned]
        return base + list(pins)

    def _jit(self, program: TracedProgram, plan: ShardingPlan, mesh: Mesh,
             settings: Settings, arrivals: Sequence[Spec | None]
             ) -> tuple[Any, tuple[Any, ...]]:
        graph = program.graph
        constrain = settings.mode is not ParallelMode.STAND_ALONE
        run = make_evaluator(graph, plan, mesh, constrain=constrain)
        flat_in = tuple(named_sharding(mesh, a if a is not None else s)
                        for s, a in zip(plan.input_specs, arrivals, strict=True))
        # Leaves that arrive in another layout (full_batch) are sliced to the plan's on entry.
        entry = {k: named_sharding(mesh, s) for k, (s, a) in
                 enumerate(zip(plan.input_specs, arrivals, strict=True))
                 if a is not None and a != s}
        flat_out = [named_sharding(mesh, s) for s in plan.output_specs]
        static = set(self._static)
        in_tree, out_tree = program.in_tree, program.out_tree

        def wrapped(*args: Any) -> Any:
            dyn = tuple(a for i, a in enumerate(args) if i not in static)
            leaves = jax.tree.leaves(dyn)
            for k, sharding in entry.items():
                leaves[k] = jax.lax.with_sharding_constraint(leaves[k], sharding)
            outs = run(*leaves)
            return jax.tree.unflatten(out_tree, outs)

        wrapped.__name__ = getattr(self._fn, "__name__", "parallelized")
        in_shardings = tuple(jax.tree.unflatten(in_tree, flat_in))
        out_shardings = jax.tree.unflatten(out_tree, flat_out)
        jitted = jax.jit(wrapped, in_shardings=in_shardings, out_shardings=out_shardings,
                         static_argnums=tuple(self._static), donate_argnums=tuple(self._donate))
        return jitted, flat_in


def _constraint_pins(space: SearchSpace, mesh: MeshShape, api: str) -> list[Pin]:
    """``with_sharding_constraint`` in the user's function (or from ``jaxpar.shard``) pins."""
    pins = []
    graph = space.graph
    for node in graph.nodes:
        if node.kind != "op" or node.name != "sharding_constraint":
            continue
        sharding = node.eqn.params["sharding"]
        smesh = getattr(sharding, "mesh", None)
        if smesh is None or MeshShape.of(smesh) != mesh:
            raise StrategyError(
                f"{api}: the sharding constraint at {node.source} uses mesh "
                f"{MeshShape.of(smesh) if smesh is not None else sharding}, but the program runs "
                f"on mesh {mesh}. Build its NamedSharding on the same mesh, or use "
                f"jaxpar.shard inside the function.")
        if node.eqn.params.get("unconstrained_dims"):
            continue
        spec = Spec.from_partition_spec(sharding.spec, len(graph.values[node.outputs[0]].shape))
        strategy = strategy_for_specs(space.rule(node.id), {("in", 0): spec, ("out", 0): spec},
                                      mesh)
        if strategy is not None:
            pins.append(Pin(node.id, strategy, "shard"))
    return pins


def _mode(mode: Any) -> ParallelMode:
    try:
        return ParallelMode(str(mode.value if isinstance(mode, ParallelMode) else mode))
    except ValueError:
        raise ContextError(f"jaxpar: parallel_mode {mode!r} is not one of "
                           f"{[m.value for m in ParallelMode]}.") from None


def _argnums(x: Sequence[int] | int | None) -> tuple[int, ...] | None:
    if x is None:
        return None
    return (x,) if isinstance(x, int) else tuple(x)


def _signature(fn: Callable) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _signature_key(args: tuple, static: Sequence[int]) -> Any:
    parts = []
    for i, a in enumerate(args):
        if i in static:
            parts.append(("static", a))
            continue
        leaves, tree = jax.tree.flatten(a)
        parts.append((tree, tuple(_aval_key(x) for x in leaves)))
    return tuple(parts)


def _aval_key(x: Any) -> Any:
    shape = tuple(getattr(x, "shape", ()))
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        dtype = jax.numpy.asarray(x).dtype
    return shape, str(dtype), bool(getattr(x, "weak_type", False))


def _place(x: Any, sharding: Any) -> Any:
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        try:
            if x.sharding.is_equivalent_to(sharding, x.ndim):
                return x
        except Exception:  # noqa: BLE001 - different device sets compare by moving
            pass
        return jax.device_put(x, sharding)
    return x


def parallelize(
    fn: Callable,
    *,
    mesh: Mesh | None = None,
    parallel_mode: str | ParallelMode | None = None,
    search_mode: str | None = None,
    in_strategy: Any = None,
    out_strategy: Any = None,
    hardware: HardwareProfile | None = None,
    batch_argnums: Sequence[int] | int | None = None,
    donate_argnums: Sequence[int] | int = (),
    static_argnums: Sequence[int] | int = (),
    parameter_plan: Mapping[str, Any] | None = None,
    micro_batches: int | None = None,
) -> Parallelized:
    """Transforms single-device ``fn`` into a sharded, jit-compiled program.

    jaxpar traces ``fn`` to a jaxpr, chooses a layout for every operator (user pins, then
    propagation or search per ``parallel_mode``), constrains every value to its layout and lets
    XLA's SPMD partitioner insert the collectives.

    Args:
      fn: the function, written for one device.
      mesh: the device mesh (see :func:`jaxpar.make_mesh`); default: the context's ``mesh``, else
        MindSpore's device matrix of the program's strategies (the nested ``jaxpar.shard`` s
        first, then these arguments'; see ``implicit_mesh.py``), else a 1-D mesh
        ``("devices",)`` of ``device_num`` devices.
      parallel_mode: ``"stand_alone"``, ``"data_parallel"``, ``"semi_auto_parallel"`` or
        ``"auto_parallel"``; default: the context's.  ``semi_auto_parallel`` with no strategy
        at all splits the batch over every device (MindSpore's default) and propagates.
      search_mode: the search of ``auto_parallel``; default: the context's.
      in_strategy: one strategy per positional argument (a slice-count tuple, ``PartitionSpec``,
        ``jaxpar.Layout`` or ``None`` = free), or a tree of them matching the argument.
      out_strategy: strategies for the result, in the same forms.
      hardware: the :class:`HardwareProfile` the cost model prices; default: the context's, else
        the CPU preset.
      batch_argnums: arguments that carry the global batch (``data_parallel``); inferred when
        omitted: arguments that come back as results are state, the others data.
      donate_argnums: arguments whose buffers may be reused, as in ``jax.jit``.
      static_argnums: arguments that are Python values, as in ``jax.jit``.
      parameter_plan: ``{name or glob: strategy}`` for arrays named by their path, such as
        ``{"params.w1": (1, 4)}`` or ``{"*.kernel": P(None, "mp")}``.
      micro_batches: micro-batches per step for the :class:`jaxpar.PipelineCell` losses in
        ``fn`` when the context has ``pipeline_stages > 1`` (default: the context's
        ``micro_batches``, else the stage count).

    Returns:
      A :class:`Parallelized`: call it like ``fn``; ``.lower(*args)`` gives the
      ``jax.stages.Lowered`` and ``.plan(*args)`` the :class:`ShardingPlan`.  Plans are cached
      per argument signature.

    The equivalent by hand, for a Megatron MLP, would be ``jax.jit`` with ``in_shardings`` and a
    ``with_sharding_constraint`` after every layer; jaxpar writes those for you:

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = make_mesh((2, 4), ("dp", "mp"))
    >>> def mlp(x, w1, w2):
    ...     return jnp.maximum(x @ w1, 0) @ w2
    >>> f = parallelize(mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
    ...                 in_strategy=((2, 1), (1, 4), (4, 1)))
    >>> x, w1, w2 = jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 16))
    >>> f(x, w1, w2).shape
    (8, 16)
    >>> f.plan(x, w1, w2).output_layouts() == {"out": P("dp")}
    True
    """
    return Parallelized(fn, mesh=mesh, parallel_mode=parallel_mode, search_mode=search_mode,
                        in_strategy=in_strategy, out_strategy=out_strategy, hardware=hardware,
                        batch_argnums=batch_argnums, donate_argnums=donate_argnums,
                        static_argnums=static_argnums, parameter_plan=parameter_plan,
                        micro_batches=micro_batches)
