"""``jaxpar.PipelineCell``: a loss that runs as a pipeline (MindSpore's ``PipelineCell``).

Wrap the function that computes a scalar loss from the parameters and a batch; differentiate it
as usual.  Under a pipeline configuration (``pipeline_stages > 1`` and a mesh with a ``"pp"``
axis) the call runs the tick loop of ``loop.py``; otherwise it calls the function itself, so the
same train step runs with and without a pipeline.

The loss is a ``jax.custom_vjp`` whose forward already runs the whole schedule, forwards and
backwards (that is what lets 1F1B interleave them in one program), and keeps the gradients; its
backward scales them by the incoming cotangent.  Called without differentiation it runs the
forwards alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar._src.context import ParallelMode, current_context
from jaxpar._src.errors import ContextError, MeshError, PlanError, warn_once
from jaxpar._src.hardware import resolve_hardware
from jaxpar._src.pipeline import tracing
from jaxpar._src.pipeline.config import AXIS, PipelineConfig, check_micro_batches
from jaxpar._src.pipeline.loop import make_loop
from jaxpar._src.pipeline.program import PipelineProgram, build_program
from jaxpar._src.pipeline.stacked import StackedParams, copies_of, stack, stack_groups, stack_layout
from jaxpar._src.spec import Spec
from jaxpar._src.trace import wider_than_canonical
from jaxpar._src.tracing_state import tracing_mesh


class PipelineCell:
    """A loss function pipelined over the ``"pp"`` mesh axis, in micro-batches.

    ``fn(*args)`` must return one scalar loss; the arguments in ``batch_argnums`` (default:
    all but the first) carry the batch along their leading dimension, which splits into
    ``micro_size`` micro-batches (strided: micro-batch ``m`` is rows ``m, m + M, ...``, so a
    batch split over ``dp`` stays split).  Micro-batch losses are averaged (``reduction`` in
    ``pipeline_config``; MindSpore sums them), so for a mean loss the pipelined loss and
    gradients equal the unpipelined ones.

    The stages, schedule and interleave come from the auto-parallel context
    (``pipeline_stages``, ``pipeline_config``); the micro-batch count from ``micro_size``, else
    ``parallelize(micro_batches=...)``, else the context's ``micro_batches``, else the stage
    count.  The layers to pipeline are the user's :class:`jaxpar.pipeline_stage` regions, or
    the identical layers jaxpar finds, split to balance the cost model's time (see
    ``plan.explain()``).  Per-layer parameters live on every stage; :meth:`stack` keeps each
    stage's layers on it (:class:`jaxpar.StackedParams`).

    Args:
      fn: ``fn(params, *batch) -> loss`` (any argument order; see ``batch_argnums``).
      micro_size: micro-batches per call (MindSpore's name).
      batch_argnums: the arguments that carry the batch.
      bubble_fill: what empty pipeline slots hold; tests use NaN to show that no bubble
        reaches a result.

    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> def loss(w, x):
    ...     for i in range(4):
    ...         x = jnp.tanh(x @ w[i])
    ...     return jnp.mean(x ** 2)
    >>> w, x = jnp.ones((4, 8, 8)) * 0.1, jnp.ones((16, 8))
    >>> mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    >>> with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
    ...                                   pipeline_stages=2):
    ...     step = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(loss)),
    ...                               micro_batches=4, batch_argnums=1)
    ...     value, grad = step(w, x)
    >>> ref_value, ref_grad = jax.value_and_grad(loss)(w, x)
    >>> bool(np.allclose(value, ref_value)) and bool(np.allclose(grad, ref_grad, atol=1e-6))
    True
    """

    def __init__(self, fn: Callable, micro_size: int | None = None, *,
                 batch_argnums: Sequence[int] | int | None = None,
                 bubble_fill: float = 0.0) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.micro_size = None if micro_size is None else check_micro_batches(
            micro_size, "jaxpar.PipelineCell")
        self.batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else (
            None if batch_argnums is None else tuple(batch_argnums))
        self.bubble_fill = float(bubble_fill)
        self._programs: dict[Any, PipelineProgram] = {}
        self._copies: dict[Any, int] = {}  # the optimizer state's copies stack() was given
        self._runs: dict[Any, Callable] = {}
        self.last_program: PipelineProgram | None = None  # the program of the last call

    def __call__(self, *args: Any) -> Any:
        where = f"jaxpar.PipelineCell({getattr(self.fn, '__name__', 'fn')})"
        found = self._resolve(where)
        if found is None:
            return self.fn(*[a.unstack() if isinstance(a, StackedParams) else a for a in args])
        _check_canonical_dtypes(args, where)
        program = self._program(args, found, where)
        leaves: list[Any] = []
        given: dict[int, Any] = {}  # stacked position -> the stacked array the caller holds
        for a in args:
            if not isinstance(a, StackedParams):
                leaves.extend(jax.tree.leaves(a))
                continue
            groups = stack_groups(program, len(a.layout.avals), len(leaves))
            if a.layout.grid == tuple(program.slot_layer.shape):
                for j, group in groups.items():
                    if group in a.layout.groups:
                        shape = program.graph.values[program.stacked_values(j)[0]].shape
                        x = a.stacked[a.layout.groups.index(group)]
                        given[j] = jnp.reshape(x, tuple(x.shape[:3]) + tuple(shape))
            if len(given) < len(a.layout.groups):
                warn_once(f"stacked-layout:{program.id}",
                          f"{where}: StackedParams stacked for another stage split than this "
                          f"pipeline's {tuple(program.split.counts)}; the step restacks them "
                          f"(moving the layer weights over 'pp' every step). Stack them with "
                          f"this cell under the same context (PipelineCell.stack).")
            leaves.extend(a.leaves())
        run = self._runs.get(program.id)
        if run is None:
            run = self._runs[program.id] = _pipelined(program, self.bubble_fill)
        return run(leaves, given)

    def stack(self, *args: Any, argnum: int = 0, opt_state: Any = None) -> StackedParams:
        """Argument ``argnum`` (the parameters) with the pipeline's layer weights stacked
        ``[S, v, k, ...]`` and put split over ``"pp"`` (the layout this pipeline's loop reads),
        as a :class:`jaxpar.StackedParams` to pass, and to update, in their place.

        ``args`` are what the cell will be called with (the batch gives the micro-batch shape
        the stage split is planned for); call it under the same pipeline context.  A weight
        stacked here never moves over ``"pp"``: each stage holds and updates its own layers.

        ``opt_state``: the optimizer state the step will update the parameters with (or its
        abstract shapes): the stage split's memory check counts its copies of the parameters
        (Adam's moments: two), laid out as ZeRO places them (split over the data-parallel
        axes where the parallel optimizer is on; else as the weights), so under
        ``HardwareProfile.memory_per_device`` the split fits with the state; the cell's
        calls in the step then keep this split.  Without it the check counts no optimizer
        state for the split stacked here (the step keeps it too); a step
        ``jaxpar.parallelize`` traces with the parameters not stacked counts the copies of
        them among its own arguments.
        """
        where = f"jaxpar.PipelineCell({getattr(self.fn, '__name__', 'fn')}).stack"
        found = self._resolve(where)
        if found is None:
            raise ContextError(f"{where}: stacking needs a pipeline: set pipeline_stages > 1 "
                               f"and a mesh with a 'pp' axis (semi_auto_parallel or "
                               f"auto_parallel) in the context.")
        if isinstance(args[argnum], StackedParams):
            return args[argnum]
        copies = 0 if opt_state is None else copies_of(args[argnum], opt_state)
        program = self._program(args, found, where, copies)
        offset = len(jax.tree.leaves(list(args[:argnum])))
        groups = stack_groups(program, len(jax.tree.leaves(args[argnum])), offset)
        if not groups:
            raise PlanError(f"{where}: no layer weight of this pipeline is a leaf of argument "
                            f"{argnum} as it is (each layer's weights are derived in the "
                            f"loss); there is nothing to stack.")
        layout = stack_layout(program, args[argnum], offset)
        leaves = jax.tree.leaves(args[argnum])
        shardings = []
        for j, group in groups.items():
            value = program.graph.values[program.stacked_values(j)[0]]
            first = leaves[next(x for x in group if x >= 0)]
            spec = program.weight_spec(j).to_partition_spec() \
                if tuple(np.shape(first)) == tuple(value.shape) else PartitionSpec(AXIS)
            shardings.append(NamedSharding(program.mesh, spec))
        return stack(layout, args[argnum], shardings)

    def _program(self, args: Sequence[Any], found: tuple, where: str,
                 copies: int | None = None) -> PipelineProgram:
        """The program for ``args``; its split's memory check counts ``copies`` copies of the
        weights of optimizer state (``stack(opt_state=)``), else those its stacking counted,
        else those among the arguments of the step ``parallelize`` traces."""
        config, mesh, mode, search_mode, hardware, tr = found
        stacking = copies is not None  # cell.stack: the step will pass a StackedParams
        # outside parallelize's trace (cell.stack) the context's parallel optimizer, as the
        # step will trace it: the split's memory check counts ZeRO's terms (early.py), so the
        # weights are stacked for the split the step's pipeline chooses
        from jaxpar._src.optimizer_parallel import OptimizerParallel

        optimizer = tr.optimizer if tr is not None else OptimizerParallel.from_context()
        batch_argnums = self.batch_argnums if self.batch_argnums is not None else \
            tuple(range(1, len(args)))
        if not batch_argnums:
            raise ContextError(f"{where}: the function takes one argument; say which "
                               f"arguments carry the batch with batch_argnums.")
        avals = [jax.tree.map(_abstract, a.abstract() if isinstance(a, StackedParams) else a)
                 for a in args]
        base = (_signature(avals), config, mesh, mode, search_mode, hardware, batch_argnums,
                optimizer)
        if copies is not None:
            self._copies[base] = copies
        elif base in self._copies:  # the split the weights were stacked for
            copies = self._copies[base]
        elif tr is not None and tr.args is not None:  # less the parameters themselves
            copies = max([copies_of(a, tr.args) - 1 for i, a in enumerate(args)
                          if i not in batch_argnums] + [0])
        # called with each layer's weights (not stacked, nor stacking them): every stage
        # holds all of them and their gradients, which the split's memory check counts
        per_layer = not stacking and not any(isinstance(a, StackedParams) for a in args)
        key = base + (copies or 0, per_layer)
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = build_program(
                self.fn, avals, batch_argnums=batch_argnums, config=config, mesh=mesh,
                mode=mode, search_mode=search_mode, hardware=hardware, where=where,
                optimizer=optimizer, state_copies=copies or 0, per_layer=per_layer)
        self.last_program = program
        if tr is not None:
            tr.built.append(program)
        from jaxpar._src.pipeline.outer import register

        register(program)
        return program

    def _resolve(self, where: str) -> tuple | None:
        tr = tracing.current()
        ctx = current_context()
        mesh: Mesh | None
        hardware: Any  # a profile, a preset name or 'calibrated' until resolved
        if tr is not None:
            config, mesh = tr.settings.config, tr.mesh
            mode, search_mode, hardware = tr.mode, tr.search_mode, tr.hardware
        else:
            config = PipelineConfig.from_options(ctx.pipeline_stages, dict(ctx.pipeline_config),
                                                 micro_batches=ctx.micro_batches, where=where)
            mesh = tracing_mesh() or ctx.mesh
            mode, search_mode = ctx.parallel_mode, ctx.search_mode
            hardware = ctx.hardware  # resolved below, once the mesh is known
        if self.micro_size is not None:
            config = PipelineConfig(config.stages, self.micro_size, config.schedule,
                                    config.repeats, config.residuals, config.reduction)
        if not config.enabled:
            return None
        if mode not in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
            warn_once(f"pipeline-mode:{mode}",
                      f"{where}: pipeline_stages={config.stages} is ignored in {mode.value} "
                      f"mode (as in MindSpore, pipelines run in semi_auto_parallel and "
                      f"auto_parallel); the loss runs unpipelined.")
            return None
        if mesh is None:
            raise MeshError(f"{where}: pipeline_stages={config.stages} needs a mesh with a "
                            f"'pp' axis of that size: pass mesh= to parallelize or set it in "
                            f"the context.")
        return config, mesh, mode, search_mode, resolve_hardware(hardware, mesh), tr


def _check_canonical_dtypes(args: Sequence[Any], where: str) -> None:
    """Refuses a 64-bit array outside ``jax_enable_x64`` (one made under ``jax.enable_x64``):
    ``jax.jit`` traces it as it is, but the pipeline's loop makes its buffers and branches in
    the dtypes JAX canonicalizes to (32 bits), which cannot meet it (``lax.cond`` refused
    float64 against float32)."""
    for i, a in enumerate(args):
        if isinstance(a, StackedParams):
            continue
        for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
            dtype = getattr(x, "dtype", None)
            if dtype is None or not wider_than_canonical(dtype):
                continue
            raise PlanError(
                f"{where}: argument {i}{jax.tree_util.keystr(path)} is {dtype} outside "
                f"jax_enable_x64 (an array made under jax.enable_x64(True)); the pipeline "
                f"runs in the dtypes JAX canonicalizes to and cannot take it. Convert it "
                f"first (x.astype({jax.dtypes.canonicalize_dtype(dtype).name})), or call "
                f"the step under jax.enable_x64(True).")


def _pipelined(program: PipelineProgram, fill: float) -> Callable:
    """The pipelined loss over the flat leaves of the arguments: weight work, stacking and
    micro-batching in the enclosing program, then the custom_vjp loop."""
    from jaxpar._src.pipeline.pieces import Pieces

    run_both = make_loop(program, backward=True, fill=fill)
    run_forward = make_loop(program, backward=False, fill=fill)
    pieces = Pieces(program)
    graph = program.graph
    M = program.config.micro_batches
    batch_avals: list[Any] = []
    # ZeRO: the layout of a gradient the loop reduce-scatters (program.scatters)
    split = {j: program.grad_spec(j) for j, _, _ in program.scatters}
    split_rest = {i: program.rest_grad_spec(i) for i, _, _ in program.rest_scatters}

    @jax.custom_vjp
    def loop(weights: list, rest: list, batch: list) -> Any:
        return run_forward(weights, rest, batch)

    def fwd(weights: list, rest: list, batch: list) -> tuple[Any, tuple]:
        loss, g_w, g_rest, g_batch = run_both(weights, rest, batch)
        g_batch = [g if jnp.issubdtype(b.dtype, jnp.inexact) else None
                   for g, b in zip(g_batch, batch, strict=True)]
        return loss, (g_w, g_rest, g_batch)

    def bwd(grads: tuple, ct: Any) -> tuple:
        def scale(g: Any) -> Any:
            return None if g is None else g * ct.astype(g.dtype)

        g_w, g_rest, g_batch = grads
        return ([scale(g) for g in g_w], [scale(g) for g in g_rest],
                [_zero_or(scale(g), b) for g, b in zip(g_batch, batch_avals, strict=True)])

    loop.defvjp(fwd, bwd)

    def run(leaves: Sequence[Any], given: dict[int, Any]) -> Any:
        env = {graph.nodes[nid].outputs[0]: x for nid, x in zip(graph.inputs, leaves,
                                                                strict=True)}
        with jax.named_scope("jaxpar_pipeline_weights"):
            pieces.weight_work(env)
        weights = [_constrain(given[j] if j in given else
                              _stack(program, [env[v] for v in program.stacked_values(j)]),
                              program.weight_spec(j), program, split.get(j))
                   for j in range(len(program.stacked))]
        rest = [_constrain(env[v], program.spec(v), program, split_rest.get(i))
                for i, v in enumerate(program.rest)]
        batch = [_constrain(_micro(env[v], M), program.batch_spec(j), program)
                 for j, v in enumerate(program.batch)]
        batch_avals[:] = [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in batch]
        return loop(weights, rest, batch)

    return run


def _zero_or(g: Any, aval: Any) -> Any:
    """A batch input's cotangent; integer inputs take JAX's ``float0`` zeros."""
    if g is not None:
        return g
    return np.zeros(aval.shape, jax.dtypes.float0)


def _stack(program: PipelineProgram, per_layer: Sequence[Any]) -> Any:
    """One weight of every layer as ``[S, v, slots, ...]`` (padding slots zero)."""
    zero = jnp.zeros_like(per_layer[0])
    S, v, k = program.slot_layer.shape
    flat = [per_layer[layer] if layer >= 0 else zero
            for layer in program.slot_layer.reshape(-1).tolist()]
    # concatenate, not jnp.stack: every operator here needs a sharding rule in the step's plan
    return jnp.concatenate([x[None] for x in flat]).reshape((S, v, k) + tuple(per_layer[0].shape))


def _micro(x: Any, M: int) -> Any:
    """``[B, ...] -> [M, B / M, ...]``, micro-batch ``m`` = rows ``m, m + M, ...``."""
    rows = x.shape[0] // M
    return jnp.swapaxes(x.reshape((rows, M) + tuple(x.shape[1:])), 0, 1)


def _constrain(x: Any, spec: Spec, program: PipelineProgram, grad: Spec | None = None) -> Any:
    """``x`` laid out ``spec``; its gradient laid out ``grad`` (default: ``spec``, the
    transpose of a sharding constraint), which keeps a reduce-scattered gradient split."""
    if grad is not None:
        return _split_grad(x, spec, grad, program)
    mesh: Any = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != tuple(program.mesh.axis_names):
        mesh = program.mesh
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec.to_partition_spec()))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _split_grad(x: Any, spec: Spec, grad: Spec, program: PipelineProgram) -> Any:
    return _constrain(x, spec, program)


def _split_grad_fwd(x: Any, spec: Spec, grad: Spec, program: PipelineProgram) -> tuple:
    return _constrain(x, spec, program), None


def _split_grad_bwd(spec: Spec, grad: Spec, program: PipelineProgram, _: Any, g: Any
                    ) -> tuple:
    return (_constrain(g, grad, program),)


_split_grad.defvjp(_split_grad_fwd, _split_grad_bwd)


def _abstract(x: Any) -> Any:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return x


def _signature(avals: Sequence[Any]) -> Any:
    leaves, tree = jax.tree.flatten(list(avals))
    return tree, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x))))
                       for x in leaves)
