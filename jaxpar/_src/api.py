"""``jaxpar.parallelize``: the whole-program transform (trace -> plan -> lower), jit-like."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar._src.arguments import parallelize_info
from jaxpar._src.cache_key import call_key
from jaxpar._src.cached_build import (
    executable_kept,
    keep_compiled,
    start_prefetch,
    stored_executable,
    stored_plan,
)
from jaxpar._src.config import config
from jaxpar._src.context import (
    CHANGES,
    AlgoParameters,
    ParallelMode,
    algo_parameters,
    current_context,
)
from jaxpar._src.cost import CostModel
from jaxpar._src.data_parallel import arrival_specs, infer_batch_argnums
from jaxpar._src.dispatch import MISS, FastPath, refuse_fast_trace
from jaxpar._src.errors import ContextError, PlanError, StrategyError
from jaxpar._src.executable_cache import (
    ExecutableKey,
    Loaded,
    compile_to_keep,
    store_in_background,
)
from jaxpar._src.execution import pynative
from jaxpar._src.gcpause import paused_gc
from jaxpar._src.hardware import HardwareProfile, resolve_hardware
from jaxpar._src.implicit_mesh import discover, implicit_mesh, outer_requests
from jaxpar._src.inspection import flops as inspect_flops
from jaxpar._src.inspection import memory as inspect_memory
from jaxpar._src.lower import make_evaluator, named_sharding
from jaxpar._src.memory_choices import MemoryChoices, with_residuals
from jaxpar._src.mesh import check_auto_axes, make_mesh, single_device_mesh
from jaxpar._src.optimizer_parallel import (
    OptimizerParallel,
    accumulator_leaves,
    choose_level,
    optimizer_pins,
)
from jaxpar._src.pins import baseline_pins, batch_pins, gather_pins
from jaxpar._src.pipeline import tracing as pipeline_tracing
from jaxpar._src.pipeline.outer import attach_pipeline, loops_in, pipeline_settings
from jaxpar._src.pipeline.residual_choice import bounded
from jaxpar._src.placing import abstract_as, place_leaf, placed_as
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.plan_cache import plan_cache_key, store_cached
from jaxpar._src.plan_files import check_save_path
from jaxpar._src.planner import decide, load_strategies, make_plan
from jaxpar._src.prefetch import Prefetch
from jaxpar._src.program_memory import with_lowered_memory
from jaxpar._src.recompute import choosing
from jaxpar._src.recompute_choice import (
    Rung,
    cpu_memory_scheduler,
    remat_notes,
)
from jaxpar._src.regather import Regather, regather_note
from jaxpar._src.regather import compiler_options as regather_options
from jaxpar._src.report.context import remember
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
    optimizer: Any = None  # OptimizerParallel (enable_parallel_optimizer), else None


@dataclasses.dataclass(frozen=True, eq=False)
class Compiled:
    """One input signature's traced program, plan and jitted function (built when first
    needed: a call that runs an executable loaded from the plan cache never needs it)."""

    program: TracedProgram
    plan: ShardingPlan
    settings: Settings
    build_jit: Callable[[], Any]  # the jitted function (memoized)
    in_shardings: tuple[Any, ...]  # flat, per dynamic leaf
    timings: Mapping[str, float]  # seconds: trace, search (plan), executable (its loading)
    loaded: Loaded | None = None  # the executable loaded from the plan cache
    # (directory, key, pre-key) while the executable is still to be stored in the plan cache:
    # once stored, the pre-key's index names it (prefetch.py)
    pending: list[tuple[str, ExecutableKey, str | None]] = dataclasses.field(
        default_factory=list)

    @property
    def jitted(self) -> Any:
        """The ``jax.jit`` of the lowered plan (``.lower``, ``.trace``; its executable is the
        loaded one's)."""
        return self.build_jit()

    @property
    def runner(self) -> Callable[..., Any]:
        """What a call runs: the loaded executable, else the jitted function."""
        return self.loaded if self.loaded is not None else self.build_jit()

    @property
    def fast_runner(self) -> Callable[..., Any]:
        """What the per-call fast path (``dispatch.py``) runs: :attr:`runner`, or straight
        JAX's C++ dispatch of the loaded executable where there are no static arguments for
        :class:`Loaded` to check and drop (tracers, which :class:`Loaded` hands to the jitted
        function, make the fast path give up, and the full path does that)."""
        loaded = self.loaded
        return self.runner if loaded is None or loaded.has_static else loaded.run


class Parallelized(MemoryChoices):
    """A function transformed by :func:`parallelize`: call it, ``.lower`` it, ``.plan`` it.

    >>> import jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> f = jaxpar.parallelize(lambda x: jnp.tanh(x) * 2, mesh=jaxpar.make_mesh((8,), ("d",)),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=((8, 1),))
    >>> x = jnp.ones((16, 4))
    >>> f(x).shape, f.plan(x).input_layouts() == {"x": P("d")}
    ((16, 4), True)
    >>> len(jaxpar.inspect.collectives(f.lower(x)))  # rows apart: nothing to communicate
    0
    """

    def __init__(self, fn: Callable, *, mesh: Mesh | None, parallel_mode: Any,
                 search_mode: str | None, in_strategy: Any, out_strategy: Any,
                 hardware: HardwareProfile | str | None, batch_argnums: Sequence[int] | int | None,
                 donate_argnums: Sequence[int] | int, static_argnums: Sequence[int] | int,
                 parameter_plan: Mapping[str, Any] | None, api: str = "jaxpar.parallelize",
                 micro_batches: int | None = None):
        functools.update_wrapper(self, fn)
        self._info = parallelize_info(
            fn, mesh=mesh, parallel_mode=parallel_mode, search_mode=search_mode,
            in_strategy=in_strategy, out_strategy=out_strategy, hardware=hardware,
            batch_argnums=batch_argnums, donate_argnums=donate_argnums,
            static_argnums=static_argnums, parameter_plan=parameter_plan, api=api,
            micro_batches=micro_batches)
        self._cache: dict[Any, Compiled] = {}
        self._implicit: dict[Any, Mesh | None] = {}  # meshes built from the strategies
        self._fast = FastPath()  # the last call's program, for a call like it (dispatch.py)
        self._rungs: dict[Any, Rung] = {}  # recompute choices planned and compiled

    # -- public -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            out = self._fast.call(args)
            if out is not MISS:
                return out
        info = self._info
        args = info.bind(args, kwargs)
        stamp = CHANGES.count  # before the state it stands for is read (context.Changes)
        ctx, algo = current_context(), algo_parameters()
        entry = self._compiled(args)
        full = self._placed(args, entry)
        if pynative():  # eager, op by op, on the arguments placed as the plan says
            with jax.disable_jit(), _mesh_context(self._trace_mesh(entry.settings)):
                return info.fn(*full)
        with paused_gc():  # a first call traces the evaluator: many objects, none to free
            keep = self._compile_to_keep(entry, full) if entry.pending else None
            runner = entry.runner
            out = runner(*full)
        if keep is not None:  # serialized and written once the step has run, by a thread
            store_in_background(*keep, api=self._info.api, after=out)
        self._fast.remember(stamp, ctx, algo, entry.fast_runner)
        return out

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The ``jax.stages.Lowered`` program; ``.compile().as_text()`` is the partitioned HLO."""
        args = self._info.bind(args, kwargs)
        entry = self._compiled(args)
        with paused_gc():  # shapes and layouts only: lowering moves no data
            return entry.jitted.lower(*self._placed(args, entry, abstract_as))

    def plan(self, *args: Any, **kwargs: Any) -> ShardingPlan:
        """The :class:`ShardingPlan` for these arguments (only their shapes and dtypes matter)."""
        return self._compiled(self._info.bind(args, kwargs)).plan

    def report(self, *args: Any, path: str | None = None, other: ShardingPlan | None = None,
               title: str | None = None) -> Any:
        """The HTML report of the plan for these arguments, with the compiled program's
        collectives and their causes (see :meth:`ShardingPlan.report`).  Compiles the program;
        pass the function's arguments positionally."""
        from jaxpar._src.report.build import build_report

        entry = self._compiled(args)
        compiled = self.lower(*args).compile()
        return build_report(entry.plan, compiled=compiled, graph=entry.program.graph,
                            other=other, title=title or f"jaxpar plan of {self._info.api}",
                            path=path)

    def compiled_entry(self, *args: Any, **kwargs: Any) -> Compiled:
        """The traced program, plan, settings and timings for these arguments."""
        return self._compiled(self._info.bind(args, kwargs))

    # -- internals ----------------------------------------------------------------------------
    def _compile_to_keep(self, entry: Compiled, full: list
                         ) -> tuple[str, ExecutableKey, Any, str | None] | None:
        """Compiles the entry's program: the directory, key and executable to store in the plan
        cache (``executable_cache.py``) and the pre-key whose index is to name it once stored
        (``prefetch.py``), or ``None`` (nothing to keep).  The call dispatches the step, then
        hands it to a thread that serializes and writes it once the step's outputs are ready
        (:func:`store_in_background`: serialized beside the running step it took three times
        as long, and the serialization holds the GIL).  Lowered from the arguments as the call
        has placed them (``full``): the call's ``jax.jit`` then finds this lowering and
        executable in its caches, and no abstract copy of the arguments is made (880 leaves of
        a 24-layer GPT)."""
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(full)):
            return None  # called inside a transformation: no executable of its own to keep
        directory, key, ahead = entry.pending.pop()
        # kept in the plan cache, which a later process reads: not also in JAX's cache
        compiled = compile_to_keep(entry.jitted.lower(*full), jax_cache_write=False)
        return None if compiled is None else (directory, key, compiled, ahead)

    def _placed(self, args: tuple, entry: Compiled, place: Callable[[Any, Any], Any] | None = None
                ) -> list:
        """The arguments moved to the layouts the plan takes them in (arrays placed elsewhere,
        e.g. batches on another mesh, are resharded); with ``place``, what it makes of each."""
        return placed_as(args, self._info.static_argnums, entry.in_shardings,
                         place or place_leaf)

    def _settings(self, args: tuple) -> Settings:
        ctx = current_context()
        info = self._info
        mode = info.mode if info.mode is not None else ctx.parallel_mode
        search = info.search_mode or ctx.search_mode
        mesh: Mesh | None
        if mode is ParallelMode.STAND_ALONE:
            mesh = single_device_mesh()
        else:
            mesh = info.mesh or ctx.mesh or self._strategy_mesh(ctx, mode, args)
            if mesh is None:
                n = ctx.device_num or len(jax.devices())
                mesh = make_mesh((n,), ("devices",))
        check_auto_axes(mesh, info.api)
        hardware = resolve_hardware(info.hardware or ctx.hardware, mesh)
        if mode is not ParallelMode.STAND_ALONE and not ctx.gradients_mean:
            raise ContextError(
                f"{info.api}: gradients_mean=False asks for the sum of per-device gradients, "
                f"but a JAX program sees the global batch: its gradients are the device mean "
                f"(gradients_mean=True), which XLA all-reduces for you. Scale the loss by the "
                f"number of devices if you want the MindSpore sum.")
        return Settings(mode, search, mesh, hardware, algo_parameters(),
                        str(ctx.strategy_ckpt_load_file), str(ctx.strategy_ckpt_save_file),
                        ctx.dataset_strategy,
                        pipeline_settings(ctx, info.micro_batches, info.api),
                        None if mode is ParallelMode.STAND_ALONE
                        else OptimizerParallel.from_context(ctx))

    def _strategy_mesh(self, ctx: Any, mode: ParallelMode, args: tuple) -> Mesh | None:
        """MindSpore's device matrix when no mesh is given: one mesh from every strategy of the
        program, the nested ``jaxpar.shard``s first (see ``implicit_mesh.py``)."""
        info = self._info
        n = ctx.device_num or len(jax.devices())
        key = (call_key(args, info.static_argnums, api=info.api,
                        names=info.arg_names(len(args))), n, mode, ctx.dataset_strategy)
        if key not in self._implicit:
            found = outer_requests(in_strategy=info.in_strategy, out_strategy=info.out_strategy,
                                   parameter_plan=info.parameter_plan,
                                   dataset_strategy=ctx.dataset_strategy, api=info.api)
            if mode in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
                found = discover(info.fn, args, info.static_argnums) + found
            self._implicit[key] = implicit_mesh(found, n)
        return self._implicit[key]

    def _trace_mesh(self, settings: Settings) -> Mesh:
        """The mesh a bare ``PartitionSpec`` in the function refers to: the plan's (in
        ``stand_alone``, the mesh the function would otherwise run on, if any: its sharding
        constraints are then only checked, not applied)."""
        if settings.mode is ParallelMode.STAND_ALONE:
            return self._info.mesh or current_context().mesh or settings.mesh
        return settings.mesh

    def _compiled(self, args: tuple) -> Compiled:
        settings = self._settings(args)
        info = self._info
        signature = call_key(args, info.static_argnums, api=info.api,
                             names=info.arg_names(len(args)))
        key = (signature, settings)
        entry = self._cache.get(key)
        if entry is None:
            with paused_gc():
                entry = self._cache[key] = self._build(args, settings, signature)
            remember(entry.plan, entry.program.graph)  # for plan.report() / notebooks
        return entry

    def _build(self, args: tuple, settings: Settings, signature: tuple) -> Compiled:
        info = self._info
        t0 = time.perf_counter()
        if settings.ckpt_save:  # before planning, not after it
            check_save_path(settings.ckpt_save, f"{info.api}: strategy_ckpt_save_file")
        names = info.arg_names(len(args))
        cache_dir = config.plan_cache_dir
        # the executable last used for this function and call, read while it is traced
        ahead, prefetch = start_prefetch(cache_dir, settings, signature, info)
        try:
            return self._build_traced(args, settings, signature, names, t0, ahead, prefetch)
        finally:
            if prefetch is not None:
                prefetch.drop()

    def _build_traced(self, args: tuple, settings: Settings, signature: tuple,
                      names: list[str], t0: float, ahead: str | None,
                      prefetch: Prefetch | None) -> Compiled:
        info = self._info
        mesh = settings.mesh
        auto_residuals = settings.pipeline is not None and \
            settings.pipeline.config.residuals == "auto"
        if auto_residuals:  # traced storing first (residual_choice.py)
            settings = with_residuals(settings, "store")
        program, batch, layers = self._trace(args, settings, names, None)
        t1 = time.perf_counter()
        settings.hardware.check_mesh(MeshShape.of(mesh), info.api)
        # The persistent plan cache (plan_cache.py); a strategy file, when given, is the plan.
        cache_dir = config.plan_cache_dir
        key = plan = rung = text_sha = None
        hit = False
        if auto_residuals and loops_in(program.graph) and \
                bounded(settings.hardware.memory_per_device):
            # store or recompute, by the budget; the choice is not kept in the plan cache
            if layers:
                raise PlanError(
                    f"{info.api}: pipeline_residuals='auto' is not chosen together with "
                    f"jaxpar.recompute(policy='auto') blocks yet; give pipeline_residuals "
                    f"'store' or 'recompute', or the blocks fixed policies.")
            settings, rung = self._residuals_choice(args, settings, names, program, batch)
            program, batch, plan = rung.program, rung.batch, rung.plan
        elif layers and settings.mode is ParallelMode.AUTO_PARALLEL and not settings.ckpt_load:
            # jaxpar.recompute(policy="auto") blocks: a policy per block (recompute_choice.py),
            # kept in the plan cache with the plan
            program, batch, plan, rung, key, text_sha, hit = self._recompute_choice(
                args, settings, names, signature, layers, program, batch)
        elif cache_dir and not settings.ckpt_load and \
                settings.mode is not ParallelMode.STAND_ALONE:
            key = plan_cache_key(graph=program.graph, in_tree=program.in_tree,
                                 out_tree=program.out_tree, signature=signature,
                                 settings=settings, info=info)
            program, batch, plan, hit, text_sha = stored_plan(
                cache_dir, key, program, batch, api=info.api,
                kept=executable_kept(cache_dir, key, signature=signature, info=info, mesh=mesh),
                retrace=(lambda level: self._trace(args, _at_level(settings, level), names,
                                                   None)[:2])
                if _per_level(settings, program) else None)
        if plan is None:
            program, batch, plan = self._plan(args, program, settings, names, batch)
            plan = dataclasses.replace(plan, notes=plan.notes + remat_notes(program.graph))
            if key is not None and cache_dir:
                text_sha = store_cached(cache_dir, key, plan, api=info.api)
        plan = attach_pipeline(plan, program.graph)  # from the graph: also for a cached plan
        if auto_residuals and rung is None and loops_in(program.graph):
            plan = dataclasses.replace(plan, notes=plan.notes + (
                "pipeline_residuals (auto): store chosen, no memory budget "
                "(HardwareProfile.memory_per_device)",))
        if settings.ckpt_save:
            plan.save(settings.ckpt_save)
        t2 = time.perf_counter()
        loaded: Loaded | None = None
        pending: list[tuple[str, ExecutableKey, str | None]] = []
        if rung is not None:  # the chosen rung's jitted function, its executable compiled
            flat_in = rung.in_shardings  # (lowering reads plan.decisions)
            build = _given(rung.jitted)
            # where XLA compiled it in this process, kept beside the entry of the choice
            keep_compiled(cache_dir, key, text_sha, rung.executable, signature=signature,
                          info=info, mesh=mesh, ahead=ahead)
        else:
            in_shapes = [program.graph.values[program.graph.nodes[n].outputs[0]].shape
                         for n in program.graph.inputs]
            arrivals = arrival_specs(program, batch, settings.dataset_strategy, in_shapes)
            flat_in = _in_shardings(plan, mesh, arrivals)
            build = functools.cache(functools.partial(
                self._jit, program, plan, mesh, settings, arrivals, flat_in))
            loaded, pending, plan = stored_executable(
                cache_dir, key, text_sha, plan, hit=hit, args=args, signature=signature,
                info=info, mesh=mesh, out_tree=program.out_tree, build=build, ahead=ahead,
                prefetch=prefetch)
        t3 = time.perf_counter()
        return Compiled(program, plan, settings, build, flat_in,
                        {"trace": t1 - t0, "search": t2 - t1, "executable": t3 - t2},
                        loaded, pending)

    def _trace(self, args: tuple, settings: Settings, names: list[str],
               policies: tuple[str, ...] | None
               ) -> tuple[TracedProgram, tuple[int, ...] | None, list[str]]:
        """The traced program (its ``jaxpar.recompute(policy="auto")`` blocks given
        ``policies``), the batch arguments where the mode needs them, and the auto blocks."""
        info = self._info
        trace_mesh = self._trace_mesh(settings)
        pipelining = pipeline_tracing.pipelining(pipeline_tracing.Tracing(
            settings.pipeline, settings.mesh, settings.mode, settings.search_mode,
            settings.hardware, settings.optimizer, args=args))
        # A fresh function object each time: JAX's trace cache would otherwise serve an
        # earlier trace, whose recompute(policy="auto") blocks this one would not see.
        fresh = functools.wraps(info.fn)(lambda *a, **k: info.fn(*a, **k))
        with tracing_with(settings.mesh, trace_mesh), pipelining, choosing(policies) as auto:
            try:
                program = trace(fresh, args, static_argnums=info.static_argnums,
                                arg_names=names)
            except ValueError as e:
                if "is not found in mesh" not in str(e):  # JAX's words for an unknown axis
                    raise
                raise StrategyError(
                    f"{info.api}: a sharding constraint in the function names a mesh axis "
                    f"the plan's mesh {MeshShape.of(trace_mesh)} does not have ({e}). A bare "
                    f"PartitionSpec refers to the plan's mesh: use its axis names, or pass "
                    f"mesh=... with the axes the function uses.") from e
            batch = None
            if settings.mode is ParallelMode.DATA_PARALLEL or (
                    settings.mode is not ParallelMode.STAND_ALONE
                    and settings.dataset_strategy != "data_parallel"):
                batch = self._batch(args, program, names)
        return program, batch, auto.seen

    def _compiled_rung(self, args: tuple, settings: Settings, policies: tuple[str, ...],
                       program: TracedProgram, batch: tuple[int, ...] | None,
                       plan: ShardingPlan) -> Rung:
        """``plan`` lowered, compiled and measured (``memory_analysis``): a :class:`Rung`
        whose jitted function the call then runs."""
        in_shapes = [program.graph.values[program.graph.nodes[n].outputs[0]].shape
                     for n in program.graph.inputs]
        arrivals = arrival_specs(program, batch, settings.dataset_strategy, in_shapes)
        flat_in = _in_shardings(plan, settings.mesh, arrivals)
        jitted = self._jit(program, plan, settings.mesh, settings, arrivals, flat_in)
        # Lowered from the arguments as the call places them, so that the call's jax.jit
        # finds this lowering and executable in its caches: no second compile.
        lowered = jitted.lower(*placed_as(args, self._info.static_argnums, flat_in,
                                          abstract_as))
        keep = compile_to_keep(lowered)  # None: JAX's persistent cache served it
        compiled = keep if keep is not None else lowered.compile()  # (now in memory)
        return Rung(policies, program, batch, plan, float(inspect_memory(compiled)["total"]),
                    inspect_flops(compiled), jitted, flat_in,
                    executable=keep)  # what the plan cache may keep

    def _plan(self, args: tuple, program: TracedProgram, settings: Settings, names: list[str],
              batch: tuple[int, ...] | None, policies: tuple[str, ...] | None = None
              ) -> tuple[TracedProgram, tuple[int, ...] | None, ShardingPlan]:
        """The plan of ``program``: pins gathered, strategies searched (or loaded from the
        strategy file), every node and edge priced; with ``"optimizer_level": "auto"``, the
        ZeRO level that fits the memory budget (``choose_level``).  Returned with the program
        and batch arguments it plans: a pipelined program is traced again at each level
        tried (``policies``: its recompute choice), since its loop is built for the level
        (ZeRO's reduce-scattered stage gradients) and holds memory of its own, which
        ``plan.memory_bytes`` counts (``pipeline/memory.py``): each level is weighed by the
        memory of the program that would run."""
        opt = settings.optimizer
        if opt is None or not opt.automatic:
            return program, batch, self._plan_once(args, program, settings, names, batch)
        # Gradients held across calls (accumulators): level 2 splits them, and Model's
        # gradient constraint follows the level traced for (shard_gradients)
        holds = bool(accumulator_leaves(args, self._info.static_argnums))
        again = _per_level(settings, program) or holds
        traced: dict[int, tuple[TracedProgram, tuple[int, ...] | None]] = {}

        def plan_for(o: OptimizerParallel | None) -> ShardingPlan:
            at = dataclasses.replace(settings, optimizer=o)
            # traced at "auto" (level 0), the program is the one with the optimizer off: no
            # scattered gradients in the loop, none constrained (below level 2)
            p, b = self._trace(args, at, names, policies)[:2] if again and (
                o is not None or opt.shards_gradients) else (program, batch)
            plan = self._plan_once(args, p, at, names, b)
            traced[plan.optimizer_level] = (p, b)
            return plan

        plan = choose_level(plan_for, opt, float(settings.hardware.memory_per_device or 0.0),
                            levels=(1, 2, 3) if holds else (1, 3))
        return *traced[plan.optimizer_level], plan

    def _plan_once(self, args: tuple, program: TracedProgram, settings: Settings,
                   names: list[str], batch: tuple[int, ...] | None) -> ShardingPlan:
        info = self._info
        mesh = settings.mesh
        model = CostModel(MeshShape.of(mesh), settings.hardware)
        space = SearchSpace(program.graph, model, optimizer_level=0 if settings.optimizer is None
                            else settings.optimizer.level)
        pins = gather_pins(info, args, program, space, mesh, mode=settings.mode,
                           dataset_strategy=settings.dataset_strategy, batch=batch)
        if settings.mode is ParallelMode.SEMI_AUTO_PARALLEL and \
                settings.dataset_strategy == "data_parallel" and (not pins or (
                    settings.optimizer is not None  # only level 2's gradient constraints
                    and not any(p.node in program.graph.inputs for p in pins))):
            pins = pins + self._data_parallel_default(args, program, space, names)
        if settings.optimizer is not None:  # ZeRO: the state split over data parallel
            pins = optimizer_pins(settings.optimizer, program, args, info.static_argnums,
                                  space, pins, api=info.api)
        ties = state_ties(program, args, info.static_argnums)
        if settings.ckpt_load:
            decision = load_strategies(settings.ckpt_load, space, api=info.api)
        else:
            decision = decide(space, pins, ties, mode=settings.mode,
                              search_mode=settings.search_mode,
                              baseline_pins=self._baseline_pins(args, program, space, settings,
                                                                pins, names),
                              api=info.api)
        plan = make_plan(
            program.graph, decision.assignment, space,
            device_ids=[d.id for d in mesh.devices.flat], parallel_mode=settings.mode.value,
            search_mode=decision.search_mode, details=decision.details, report=decision.report)
        # memory_bytes as the lowering (_jit) makes the program: program_memory.py
        again = Regather.of(program.graph, plan) if settings.mode is not \
            ParallelMode.STAND_ALONE else Regather()
        plan = regather_note(program.graph, plan, again)
        if not (again or plan.scatters or loops_in(program.graph)):
            return plan  # make_plan's estimate is the lowered program's
        return with_lowered_memory(program.graph, plan, regather=again)

    def _batch(self, args: tuple, program: TracedProgram, names: list[str]) -> tuple[int, ...]:
        info = self._info
        if info.batch_argnums is not None:
            return info.batch_argnums
        return infer_batch_argnums(args, program.out_shapes, info.static_argnums, names,
                                   api=info.api)

    def _data_parallel_default(self, args: tuple, program: TracedProgram, space: SearchSpace,
                               names: list[str]) -> list[Pin]:
        """MindSpore's semi-automatic default where nothing is configured: the batch arrives
        split over every device (``dataset_strategy="data_parallel"``); the rest propagates."""
        try:
            batch = self._batch(args, program, names)
        except PlanError as e:
            raise PlanError(
                f"{self._info.api}: semi_auto_parallel needs at least one fixed strategy to "
                f"propagate from, and none is given. Like MindSpore it then splits the batch "
                f"over every device (dataset_strategy='data_parallel'), but: {e} Or give a "
                f"strategy (in_strategy, jaxpar.shard).") from None
        return batch_pins(program, space, batch, api=self._info.api)

    def _baseline_pins(self, args: tuple, program: TracedProgram, space: SearchSpace,
                       settings: Settings, pins: list[Pin], names: list[str]
                       ) -> list[Pin] | None:
        """Pins of pure data parallel (plus the user's), the yardstick of the fast searches."""
        if settings.mode is not ParallelMode.AUTO_PARALLEL:
            return None
        try:
            batch = self._batch(args, program, names)
            return baseline_pins(program, space, batch, pins, api=self._info.api)
        except (PlanError, StrategyError):
            return None

    def _jit(self, program: TracedProgram, plan: ShardingPlan, mesh: Mesh,
             settings: Settings, arrivals: Sequence[Spec | None],
             flat_in: tuple[Any, ...]) -> Any:
        """The ``jax.jit`` of the plan's evaluator; ``flat_in``: :func:`_in_shardings` of the
        plan and ``arrivals`` (the caller has them already)."""
        info = self._info
        graph = program.graph
        constrain = settings.mode is not ParallelMode.STAND_ALONE
        # ZeRO 1-3's reduce-scatters are the plan's (plan.scatters); ZeRO 3 (regather.py):
        regather = Regather.of(graph, plan) if constrain else Regather()
        run = make_evaluator(graph, plan, mesh, constrain=constrain,
                             name=getattr(info.fn, "__name__", "parallelized"),
                             regather=regather)
        # Leaves that arrive in another layout (full_batch) are sliced to the plan's on entry.
        entry = {k: named_sharding(mesh, s) for k, (s, a) in
                 enumerate(zip(plan.input_specs, arrivals, strict=True))
                 if a is not None and a != s}
        flat_out = [named_sharding(mesh, s) for s in plan.output_specs]
        static = set(info.static_argnums)
        in_tree, out_tree = program.in_tree, program.out_tree

        def wrapped(*args: Any) -> Any:
            # A fast-path call that jit traces anew goes the full path instead (dispatch.py).
            refuse_fast_trace()
            dyn = tuple(a for i, a in enumerate(args) if i not in static)
            leaves = jax.tree.leaves(dyn)
            for k, sharding in entry.items():
                leaves[k] = jax.lax.with_sharding_constraint(leaves[k], sharding)
            outs = run(*leaves)
            return jax.tree.unflatten(out_tree, outs)

        wrapped.__name__ = getattr(info.fn, "__name__", "parallelized")
        in_shardings = tuple(jax.tree.unflatten(in_tree, flat_in))
        out_shardings = jax.tree.unflatten(out_tree, flat_out)
        jitted = jax.jit(wrapped, in_shardings=in_shardings, out_shardings=out_shardings,
                         static_argnums=info.static_argnums, donate_argnums=info.donate_argnums,
                         compiler_options=cpu_memory_scheduler(
                             mesh.devices.flat[0].platform, graph) or regather_options(
                             mesh.devices.flat[0].platform, regather))
        return jitted


def _per_level(settings: Settings, program: TracedProgram) -> bool:
    """Whether ``program`` is traced again for each parallel optimizer level tried
    (``"optimizer_level": "auto"``): where it runs a pipeline, whose loop is built for
    the level."""
    opt = settings.optimizer
    return opt is not None and opt.automatic and bool(loops_in(program.graph))


def _at_level(settings: Settings, level: Any) -> Settings:
    """``settings`` with the automatic parallel optimizer at ``level`` (0: off)."""
    opt = settings.optimizer
    assert opt is not None
    return dataclasses.replace(settings, optimizer=dataclasses.replace(opt, level=level)
                               if isinstance(level, int) and level > 0 else None)


def _given(x: Any) -> Callable[[], Any]:
    """A function that returns ``x``."""
    return lambda: x


def _in_shardings(plan: ShardingPlan, mesh: Mesh, arrivals: Sequence[Spec | None]
                  ) -> tuple[Any, ...]:
    """The flat ``in_shardings`` of the jitted function: the plan's input layouts, or the
    layout a leaf arrives in where it arrives otherwise (``full_batch``)."""
    return tuple(named_sharding(mesh, a if a is not None else s)
                 for s, a in zip(plan.input_specs, arrivals, strict=True))


@contextlib.contextmanager
def _mesh_context(mesh: Mesh) -> Iterator[None]:
    """``mesh`` as JAX's context mesh while PyNative runs the function eagerly:
    ``with_sharding_constraint(x, P(...))`` in it then needs no ``jax.set_mesh`` of its own
    (tracing gets the abstract mesh from ``tracing_with``)."""
    with jax.set_mesh(mesh):
        yield


def parallelize(
    fn: Callable,
    *,
    mesh: Mesh | None = None,
    parallel_mode: str | ParallelMode | None = None,
    search_mode: str | None = None,
    in_strategy: Any = None,
    out_strategy: Any = None,
    hardware: HardwareProfile | str | None = None,
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
      hardware: the :class:`HardwareProfile` the cost model prices, a preset name, or
        ``"calibrated"`` (what :func:`jaxpar.calibrate` measured on these devices and this mesh,
        cached on disk; see :func:`jaxpar.calibration_path`); default: the context's, else the
        CPU preset.
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
