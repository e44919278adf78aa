"""``PipelineProgram``: a pipelined loss for one argument signature, built once.

1. The loss is traced at micro-batch size and planned by jaxpar on the mesh without ``"pp"``
   (the context's mode and search: in ``auto_parallel`` the search sees a micro-batch's forward
   and backward, then the forward is laid out from the inputs it chose).
2. Its layer sequence is found (``layers.py``) and split into chunks (``split.py``).
3. The prologue's nodes are sorted into those the layers need (stage 0, per micro-batch) and
   those only the loss needs (moved to the epilogue, on the last stage); the carried values are
   fixed.  Weight work (what reads no batch input) runs before the loop, in the enclosing
   program, where autodiff carries its gradients back to the parameters.
4. The schedule and its slot tables are made, and the layouts of the loop's inputs over the whole
   mesh: stacked weights ``P("pp", None, None, *layer layout)``, the rest as planned.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

from jaxpar._src.errors import MeshError, PlanError, StrategyError
from jaxpar._src.graph import Const, NodeKind, OpGraph
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.pipeline.config import AXIS, PipelineConfig
from jaxpar._src.pipeline.early import Draft, early_memory, most_slots
from jaxpar._src.pipeline.ends import EndGroups, end_groups, end_scatters
from jaxpar._src.pipeline.groups import RowGroups, gradient_scatters, row_groups, strip
from jaxpar._src.pipeline.layers import Layer, LayerSequence, control_of, find_layers, members
from jaxpar._src.pipeline.residuals import layer_stored
from jaxpar._src.pipeline.schedule import PipelineSchedule
from jaxpar._src.pipeline.split import (
    BACKWARD_FACTOR,
    StageSplit,
    choose_split,
    marked_split,
)
from jaxpar._src.pipeline.transpose import EpilogueComm, epilogue_collectives
from jaxpar._src.pipeline.view import LayerView, local_bytes
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.spec import MeshShape, Spec

_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineProgram(LayerView):
    """Everything the loop needs for one pipelined loss; see the module docstring."""

    id: int
    config: PipelineConfig
    mesh: Mesh
    sub_plan: ShardingPlan  # the micro-batch loss planned on the mesh without "pp"
    sub_how: str  # how sub_plan was chosen, for explain()
    graph: OpGraph
    layers: LayerSequence
    rep: int  # the layer whose nodes every layer runs
    split: StageSplit
    schedule: PipelineSchedule
    forward_schedule: PipelineSchedule
    rest: tuple[int, ...]  # weights passed whole: read by prologue, epilogue, or every layer
    batch: tuple[int, ...]  # value ids of the batch inputs
    pro_nodes: tuple[int, ...]
    epi_nodes: tuple[int, ...]
    carried_shared: tuple[int, ...]
    carried_in: tuple[int, ...]  # layer 0's activation, then carried_shared
    out_operand: Any
    stacked: tuple[int, ...]  # the layer weight positions stacked by stage
    batch_leaves: tuple[int, ...]  # flat argument leaves that are batch inputs
    n_leaves: int
    micro_size: int  # rows per micro-batch
    active: np.ndarray  # [S, v, slots] bool: which stacked layer slots hold a layer
    slot_layer: np.ndarray  # [S, v, slots] int: the layer in each slot (-1: padding)
    hardware: HardwareProfile
    act_bytes: float  # the carried values of one micro-batch, per device
    groups: RowGroups  # the chunks per data-parallel row group (groups.py), or why not
    # ZeRO: (stacked position, dimension of [S, v, k, ...], axes) of the gradients summed over
    # the row groups by reduce-scatter, split as their optimizer state (groups.scatters)
    scatters: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
    # the prologue's backward and the epilogue per row group too (ends.py), or why not
    ends: EndGroups = EndGroups()
    # ZeRO: (rest index, dimension, axes) of the ends' gradients summed over the row groups
    # by reduce-scatter, that dimension split further over the row axes (ends.end_scatters)
    rest_scatters: tuple[tuple[int, int, tuple[str, ...]], ...] = ()
    # ZeRO level 3: the scattered stacked weights are split as their moments too (the step
    # gathers them before the loop), so their updated values, the step's outputs, are slices
    params_split: bool = False
    # the optimizer state's copies of the weights the split's memory check counted (early.py)
    state_copies: int = 0
    optimizer: Any = None  # jaxpar.OptimizerParallel the program was built for (ZeRO)
    # the step passes each layer's weights (not a StackedParams): the split's memory check
    # counts every layer's weight, gradient and optimizer state whole over "pp" (early.py)
    per_layer: bool = False
    # the epilogue's collectives per micro-batch, forward and backward, the split priced
    epilogue_comm: EpilogueComm = EpilogueComm()

    def weight_spec(self, j: int) -> Spec:
        """Stacked weight ``j``'s layout ``[S, v, slots, ...]`` on the whole mesh (``j``
        counts the stacked positions)."""
        return Spec(((AXIS,), (), ()) + self.spec(self.rep_layer.weights[self.stacked[j]]).dims)

    def grad_spec(self, j: int) -> Spec:
        """Stacked weight ``j``'s gradient layout: :meth:`weight_spec`, split further where
        the loop reduce-scatters it (``scatters``, ZeRO)."""
        dims = list(self.weight_spec(j).dims)
        for i, dim, axes in self.scatters:
            if i == j:
                dims[dim] = dims[dim] + axes
        return Spec(tuple(dims))

    def rest_grad_spec(self, i: int) -> Spec:
        """The gradient layout of rest weight ``i`` (a rest index): its layout, or where the
        loop reduce-scatters it (``rest_scatters``, ZeRO) whole over the row axes but for
        the dimension it splits over them."""
        spec = self.spec(self.rest[i])
        for k, dim, axes in self.rest_scatters:
            if k == i:
                dims = list(strip(spec, self.groups.axes).dims)
                dims[dim] = dims[dim] + axes
                return Spec(tuple(dims))
        return spec

    def stacked_values(self, j: int) -> tuple[int, ...]:
        """Stacked weight ``j``'s value in every layer."""
        return tuple(layer.weights[self.stacked[j]] for layer in self.layers.layers)

    @property
    def loss_dtype(self) -> Any:
        """The dtype the loop accumulates the loss in and returns it in: the loss's, at least
        float32 (float64 under ``jax_enable_x64``, as the unpipelined step; a bfloat16 loss
        summed over the micro-batches in float32)."""
        return jnp.promote_types(self.graph.operand_dtype(self.out_operand), jnp.float32)

    def batch_spec(self, j: int) -> Spec:
        """Batch input ``j``'s layout micro-batched, ``[M, rows, ...]``."""
        return Spec(((),) + self.spec(self.batch[j]).dims)


def sub_mesh(mesh: Mesh, where: str) -> Mesh:
    """The devices of stage 0 over the mesh's other axes (plans name axes, not devices)."""
    names = tuple(mesh.axis_names)
    if AXIS not in names:
        raise MeshError(f"{where}: a pipeline runs its stages on the mesh axis {AXIS!r}, but "
                        f"the mesh has axes {names}. Build it with one, e.g. "
                        f"jaxpar.make_mesh((2, 2, 2), ('dp', 'tp', 'pp')).")
    k = names.index(AXIS)
    devices = np.take(mesh.devices, 0, axis=k)
    rest = names[:k] + names[k + 1:]
    if not rest:
        return Mesh(np.asarray(devices).reshape(1), ("stage",), axis_types=(AxisType.Auto,))
    return Mesh(devices, rest, axis_types=(AxisType.Auto,) * len(rest))


def build_program(fn: Callable, args: Sequence[Any], *, batch_argnums: tuple[int, ...],
                  config: PipelineConfig, mesh: Mesh, mode: Any, search_mode: str,
                  hardware: HardwareProfile, where: str, optimizer: Any = None,
                  state_copies: int = 0, per_layer: bool = False) -> PipelineProgram:
    """Traces, plans and splits ``fn(*args)`` (abstract arguments) for ``config``; with
    ``optimizer`` (``jaxpar.OptimizerParallel``) the stacked gradients are reduce-scattered;
    the split's memory check counts ``state_copies`` copies of the weights (the optimizer
    state's: Adam's moments) laid out as ZeRO places them, and, ``per_layer`` (the step
    passes each layer's weights, not a ``StackedParams``), every layer's (early.py)."""
    from jaxpar._src.context import ParallelMode

    S, M = config.stages, config.micro_batches
    size = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True)).get(AXIS)
    if size is None:
        sub_mesh(mesh, where)  # raises the error that says how to add the axis
    if size != S:
        raise MeshError(f"{where}: pipeline_stages={S} but the mesh axis {AXIS!r} has {size} "
                        f"devices; they must be equal.")
    sub = sub_mesh(mesh, where)
    micro_args, rows = _micro_args(args, batch_argnums, M, where)
    sub_mode = mode if sub.devices.size > 1 else ParallelMode.STAND_ALONE
    try:
        entry, how = _plan(fn, micro_args, batch_argnums, sub, sub_mode, search_mode, hardware)
    except StrategyError as e:
        _check_rows(rows, M, sub, where, e)
        raise
    program, plan = entry.program, entry.plan
    graph = program.graph
    n_leaves = len(graph.inputs)
    batch_leaves = tuple(i for i, a in enumerate(program.arg_index) if a in batch_argnums)
    batch = tuple(graph.nodes[graph.inputs[i]].outputs[0] for i in batch_leaves)
    if len(graph.outputs) != 1:
        raise PlanError(f"{where}: a pipelined function returns one scalar loss; this one "
                        f"returns {len(graph.outputs)} arrays.")
    out_operand = graph.nodes[graph.outputs[0]].inputs[0]
    if graph.operand_shape(out_operand) != ():
        raise PlanError(f"{where}: a pipelined function returns one scalar loss; this one "
                        f"returns shape {graph.operand_shape(out_operand)}.")
    layers = find_layers(graph, program.jaxpr, frozenset(batch), where=where)
    n = len(layers.layers)
    C = config.chunks
    if layers.marked and n != C:
        raise PlanError(f"{where}: {n} stages are marked with jaxpar.pipeline_stage, but the "
                        f"pipeline has {C} chunks ({S} stages x {config.repeats} repeats).")
    if n < C:
        raise PlanError(f"{where}: found {n} identical layers ({layers.period} operators "
                        f"each), fewer than the {C} chunks of the pipeline ({S} stages x "
                        f"{config.repeats} repeats). Use fewer stages or a deeper model.")
    rep = n // 2
    parts = _partition(graph, layers, frozenset(batch))
    costs = _costs(graph, plan, layers.layers[rep], parts, hardware)
    costs["residual_bytes"] = _stored_bytes(graph, plan, sub, layers, rep, parts, batch, rows)
    schedule = PipelineSchedule.build(config.schedule, S, M, config.repeats)
    forward = PipelineSchedule.build("forward", S, M, config.repeats)
    rep_layer = layers.layers[rep]
    # the row groups and the ends depend on the layers, not on the split: made first, so the
    # split's memory check counts what they hold (early.py)
    groups = row_groups(
        graph=graph, plan=plan, layer=rep_layer,
        carried_in=tuple(layers.layers[0].act_in) + tuple(rep_layer.act_in)
        + parts["carried_shared"], batch=batch, rest=parts["rest"],
        stacked=tuple(rep_layer.weights[j] for j in layers.stacked), rows=rows,
        retrace=lambda r: _retrace(fn, args, batch_argnums, rows * M // r, where, sub))
    ends = end_groups(
        graph=graph, small=groups.graph, rows=rows, size=groups.size,
        pro_nodes=parts["pro_nodes"], epi_nodes=parts["epi_nodes"], pro_seeds=batch,
        pro_outs=tuple(layers.layers[0].act_in) + parts["carried_shared"],
        epi_seeds=tuple(layers.layers[-1].act_out) + parts["carried_shared"] + batch,
        rest=parts["rest"], out=out_operand,
        floats=[bool(jnp.issubdtype(graph.values[v].dtype, jnp.inexact))
                for v in parts["rest"]],
        layer_reads=_layer_reads(graph, rep_layer, parts["rest"], groups))
    stacked_avals = [graph.values[rep_layer.weights[j]] for j in layers.stacked]
    stacked_specs = [Spec(((AXIS,), (), ()) + plan.decisions[v.producer].out_specs[v.index].dims)
                     for v in stacked_avals]
    rest_scatters = end_scatters(ends, groups.axes, optimizer,
                                 [graph.values[v] for v in parts["rest"]],
                                 [plan.decisions[graph.values[v].producer]
                                  .out_specs[graph.values[v].index] for v in parts["rest"]],
                                 MeshShape.of(mesh))
    # the epilogue's collectives as the loop runs them: its backward's too (transpose.py);
    # where it runs per row group, its weights' gradients and an affine tail's sum over the
    # rows cross the row axes after the loop
    epi_comm = epilogue_collectives(
        graph, plan, parts["epi_nodes"],
        tuple(layers.layers[-1].act_out) + parts["carried_shared"] + parts["rest"], hardware,
        grouped={parts["rest"][i] for i in ends.grouped} if ends.epilogue else set(),
        row_axes=groups.axes, group_tail=ends.tail if ends.affine is not None else ())
    costs["epilogue_s"] = costs["epilogue_compute_s"] * (1.0 + BACKWARD_FACTOR) + epi_comm.time

    def scatters_for(k: int) -> tuple[tuple[int, int, tuple[str, ...]], ...]:
        return gradient_scatters(groups, optimizer, stacked_avals, (S, config.repeats, k),
                                 stacked_specs, MeshShape.of(mesh))

    def splits(scatters: tuple) -> bool:  # level 3: the stacked weights split as their moments
        return bool(scatters) and optimizer is not None and optimizer.shards_parameters

    if layers.marked:
        split = marked_split(n, stages=S, layer_s=costs["layer_s"],
                             prologue_s=costs["prologue_s"], epilogue_s=costs["epilogue_s"],
                             layer_bytes=costs["layer_bytes"],
                             residual_bytes=costs["residual_bytes"])
    else:
        needs: dict[int, float] = {}

        def need(k: int) -> float:  # the candidate's memory per device (early.py)
            if k not in needs:
                needs[k] = draft_bytes(k)
            return needs[k]

        def draft_bytes(k: int) -> float:
            scatters = scatters_for(k)
            return early_memory(Draft(
                config, mesh, plan, graph, layers, rep,
                StageSplit((k,) * C, S, layer_bytes=costs["layer_bytes"],
                           residual_bytes=costs["residual_bytes"]),
                schedule, parts["rest"], batch,
                tuple(layers.layers[0].act_in) + parts["carried_shared"], layers.stacked,
                groups, ends, scatters, rest_scatters, splits(scatters), rows,
                state_copies=state_copies, optimizer=optimizer,
                per_layer=per_layer)).total

        assert hardware.memory_per_device is not None  # a profile fills every field
        max_slots, fits = most_slots(need, float(hardware.memory_per_device), layers=n,
                                     chunks=C)
        split = choose_split(n, stages=S, repeats=config.repeats, layer_s=costs["layer_s"],
                             prologue_s=costs["prologue_s"], epilogue_s=costs["epilogue_s"],
                             max_slots=max_slots, layer_bytes=costs["layer_bytes"],
                             residual_bytes=costs["residual_bytes"], fits=fits,
                             idle_s=costs["idle_s"])
        split = dataclasses.replace(split, memory_bytes=need(split.slots))
    slot_layer = np.full((S, config.repeats, split.slots), -1, np.int32)
    for c in range(C):
        start = split.first_layer(c)
        for i in range(split.counts[c]):
            slot_layer[c % S, c // S, i] = start + i
    scatters = scatters_for(split.slots)
    return PipelineProgram(
        next(_ids), config, mesh, plan, how, graph, layers, rep, split, schedule, forward,
        parts["rest"], batch, parts["pro_nodes"], parts["epi_nodes"], parts["carried_shared"],
        tuple(layers.layers[0].act_in) + parts["carried_shared"], out_operand, layers.stacked,
        batch_leaves, n_leaves, rows, slot_layer >= 0, slot_layer, hardware,
        costs["act_bytes"], groups, scatters, ends, rest_scatters,
        splits(scatters), state_copies, optimizer, per_layer, epi_comm)


def _layer_reads(graph: OpGraph, layer: Layer, rest: Sequence[int], groups: RowGroups
                 ) -> tuple[int, ...]:
    """The rest indices the layers read whole (a weight they share), where they run per row
    group: each group's gradient of it is its own (``ends.py``)."""
    if not groups.on:
        return ()
    cut = {i for kind, i, _, _ in groups.cuts if kind == "r"}
    read = {o for top in layer.nodes for nid in members(graph, top)
            for o in graph.nodes[nid].inputs if not isinstance(o, Const)}
    return tuple(i for i, v in enumerate(rest) if v in read and i not in cut)


def _micro_args(args: Sequence[Any], batch_argnums: tuple[int, ...], M: int, where: str
                ) -> tuple[list[Any], int]:
    """The arguments with every batch leaf cut to one micro-batch's rows."""
    missing = [i for i in batch_argnums if not -len(args) <= i < len(args)]
    if missing:
        raise PlanError(f"{where}: batch_argnums={tuple(batch_argnums)} names argument "
                        f"{missing[0]}, but the function is called with {len(args)} "
                        f"arguments; name the arguments that carry the batch (0 to "
                        f"{len(args) - 1}).")
    rows = None
    out = []
    for i, a in enumerate(args):
        if i not in batch_argnums:
            out.append(a)
            continue

        def cut(x: Any, i: int = i) -> Any:
            nonlocal rows
            shape = tuple(getattr(x, "shape", ()))
            if not shape or shape[0] % M:
                raise PlanError(f"{where}: argument {i} is a batch input of shape {shape}; "
                                f"its leading (batch) dimension must split into "
                                f"micro_batches={M} equal parts.")
            if rows is not None and shape[0] // M != rows:
                raise PlanError(f"{where}: the batch inputs disagree on the batch size.")
            rows = shape[0] // M
            return jax.ShapeDtypeStruct((rows,) + shape[1:], x.dtype)

        out.append(jax.tree.map(cut, a))
    if rows is None:
        raise PlanError(f"{where}: no batch input to split into micro-batches; say which "
                        f"arguments carry the batch (batch_argnums).")
    return out, rows


def _check_rows(rows: int, M: int, sub: Mesh, where: str, error: Exception) -> None:
    """The stage's plan refused to split a micro-batch of ``rows`` over the stage's devices
    (``error``: semi_auto_parallel lays a stage's micro-batch out over every mesh axis but
    ``"pp"``, as data parallelism does): says so in the pipeline's terms, with the
    micro-batch counts that would split, where that error named only a batch of ``rows``
    (not the user's) and data parallelism."""
    n = int(sub.devices.size)
    if n <= 1 or rows % n == 0:
        return
    batch = rows * M
    fits = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % n == 0]
    below = [m for m in fits if m <= M]
    hint = (f"micro_batches={below[-1] if below else fits[0]} (any of {fits[:8]} cuts "
            f"{batch} rows into micro-batches of a multiple of {n})" if fits else
            f"a batch that is a multiple of {M * n} rows")
    axes = ", ".join(f"{a}={k}" for a, k in zip(sub.axis_names, sub.axis_sizes, strict=True))
    raise PlanError(f"{where}: micro_batches={M} cuts the batch of {batch} rows into "
                    f"micro-batches of {rows}, which do not split over the {n} devices of a "
                    f"stage ({axes}: each stage splits its micro-batch over every mesh axis "
                    f"but 'pp'). Use {hint}. (The stage's plan: {error})") from error


def _retrace(fn: Callable, args: Sequence[Any], batch_argnums: tuple[int, ...], M: int,
             where: str, mesh: Mesh) -> OpGraph:
    """``fn``'s graph traced with its batch cut into ``M`` micro-batches (``groups.py``), on
    the stage's ``mesh`` as the micro-batch's own trace (``_plan``): a ``jaxpar.shard`` in the
    loss writes its constraints on the mesh being traced for, so the two traces' constraints
    are equal (on the step's mesh, ``"pp"`` in it, a tp-split head's constraint differed and
    ``rowflow`` refused the epilogue per row group as another operator)."""
    from jaxpar._src.trace import trace
    from jaxpar._src.tracing_state import tracing_with

    small, _ = _micro_args(args, batch_argnums, M, where)
    with jax.sharding.use_abstract_mesh(AbstractMesh((), ())), tracing_with(mesh):
        return trace(fn, small).graph


def _plan(fn: Callable, args: list[Any], batch_argnums: tuple[int, ...], mesh: Mesh,
          mode: Any, search_mode: str, hardware: HardwareProfile) -> tuple[Any, str]:
    """The micro-batch loss planned on ``mesh`` (see the module docstring), and how."""
    from jaxpar._src.api import parallelize
    from jaxpar._src.context import ParallelMode, auto_parallel_context

    # A separate trace of a separate function: JAX refuses a smaller abstract mesh on top of the
    # enclosing step's, so clear it first (the step's own trace is untouched).
    with jax.sharding.use_abstract_mesh(AbstractMesh((), ())), auto_parallel_context(
            pipeline_stages=1, dataset_strategy="data_parallel", strategy_ckpt_load_file="",
            strategy_ckpt_save_file=""):
        if mode is ParallelMode.AUTO_PARALLEL:
            params = tuple(i for i in range(len(args)) if i not in batch_argnums)
            train = parallelize(jax.value_and_grad(fn, argnums=params), mesh=mesh,
                                parallel_mode=mode, search_mode=search_mode, hardware=hardware,
                                batch_argnums=batch_argnums)
            chosen = train.compiled_entry(*args).plan.input_specs
            leaves = iter(s.to_partition_spec() for s in chosen)
            strategy = tuple(jax.tree.map(lambda _: next(leaves), a) for a in args)
            fwd = parallelize(fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=strategy, hardware=hardware,
                              batch_argnums=batch_argnums)
            how = (f"auto_parallel/{search_mode} searched the micro-batch's gradient step; "
                   f"its input layouts, propagated through the loss, lay out the stage")
        else:
            fwd = parallelize(fn, mesh=mesh, parallel_mode=mode, search_mode=search_mode,
                              hardware=hardware, batch_argnums=batch_argnums)
            how = f"{getattr(mode, 'value', mode)}/{search_mode}"
        return fwd.compiled_entry(*args), how


def _partition(graph: OpGraph, layers: LayerSequence, batch: frozenset[int]) -> dict:
    """Sorts the prologue (see the module docstring) and lists what the pieces read."""
    pro = list(layers.prologue)
    pro_set = set(pro)
    layer_nodes = [n for layer in layers.layers for n in layer.nodes]
    needed: set[int] = set()  # prologue nodes the layers need
    work = [graph.values[o].producer for n in layer_nodes for o in _reads(graph, n)
            if graph.values[o].producer in pro_set]
    while work:
        nid = work.pop()
        if nid in needed:
            continue
        needed.add(nid)
        node = graph.nodes[nid]
        if node.kind is NodeKind.EXIT:
            work.append(control_of(node))
        work.extend(graph.values[o].producer for o in _reads(graph, nid)
                    if graph.values[o].producer in pro_set)
    pro_nodes = tuple(n for n in pro if n in needed)
    epi_nodes = tuple(n for n in pro if n not in needed) + tuple(layers.epilogue)
    made_on_stage0 = {v for n in pro_nodes for v in graph.nodes[n].outputs}
    act0 = set(layers.layers[0].act_in)
    shared = sorted({o for nid in tuple(layer_nodes) + epi_nodes for o in _reads(graph, nid)
                     if o in made_on_stage0} - (act0 - set(layers.shared)))
    weight_made = {v for n in layers.weight_nodes for v in graph.nodes[n].outputs}
    inputs = {graph.nodes[n].outputs[0] for n in graph.inputs}
    rest = {o for nid in pro_nodes + epi_nodes for o in _reads(graph, nid)
            if (o in inputs and o not in batch) or o in weight_made}
    rest |= {layers.layers[0].weights[j] for j in layers.common}
    return {"pro_nodes": pro_nodes, "epi_nodes": epi_nodes, "carried_shared": tuple(shared),
            "rest": tuple(sorted(rest))}


def _reads(graph: OpGraph, nid: int) -> list[int]:
    """Value ids a top-level node reads from outside itself (a loop's operands)."""
    node = graph.nodes[nid]
    if node.kind is NodeKind.EXIT:
        return []
    return [o for o in node.inputs if isinstance(o, int) and not isinstance(o, Const)]


def _costs(graph: OpGraph, plan: ShardingPlan, rep: Layer, parts: dict,
           hardware: HardwareProfile) -> dict[str, float]:
    """Seconds and bytes per device of a layer, the prologue and the epilogue (cost model)."""
    mesh = plan.mesh

    assert hardware.flops_per_s is not None  # a profile fills every field
    assert hardware.operator_latency is not None
    flops_per_s, per_op = float(hardware.flops_per_s), float(hardware.operator_latency)

    def seconds(nodes: Sequence[int]) -> tuple[float, float]:
        """Compute (FLOPs and each operator's fixed cost) and collectives, apart."""
        compute = comm = 0.0
        for nid in nodes:
            for inner in _nested(graph, nid):
                d = plan.decisions[inner]
                compute += d.flops / flops_per_s
                compute += per_op if graph.nodes[inner].kind is NodeKind.OP else 0.0
                comm += d.comm_time
        return compute, comm

    def value_bytes(vid: int) -> float:
        v = graph.values[vid]
        spec = plan.decisions[v.producer].out_specs[v.index]
        shape = spec.shard_shape(v.shape, mesh) if spec.ndim == len(v.shape) else v.shape
        return float(math.prod(shape) * graph.values[vid].nbytes / max(math.prod(v.shape), 1))

    epi_compute, _ = seconds(parts["epi_nodes"])
    return {
        "layer_s": sum(seconds(rep.nodes)),
        "prologue_s": sum(seconds(parts["pro_nodes"])),
        # The backward costs about twice the forward's compute; the epilogue's collectives,
        # forward and backward, are priced once the row groups are known (transpose.py): a
        # forward collective tripled with the compute (the loss's scalar all-reduce) priced
        # the test GPT's epilogue at 143 of its layers (its 8 blocks split [7, 1]; the clock:
        # [4, 4] 16-36% less CPU per step, bench/pipeline_split.py).
        "epilogue_compute_s": epi_compute,
        # an idle slot touches each stacked weight (its gradient zeroed in the backward) and
        # each carried value (passed through) once
        "idle_s": per_op * (len(rep.weights) + len(rep.act_in) + len(parts["carried_shared"])),
        "layer_bytes": sum(value_bytes(v) for v in rep.weights),
        "rest_bytes": sum(value_bytes(v) for v in parts["rest"]),
        "act_bytes": sum(value_bytes(v) for v in rep.act_in),
    }


def _stored_bytes(graph: OpGraph, plan: ShardingPlan, mesh: Mesh, layers: LayerSequence,
                  rep: int, parts: dict, batch: Sequence[int], rows: int) -> float:
    """One layer's stored residuals per micro-batch per device, before the loop is traced:
    the leaves ``jax.vjp`` of the layer keeps (``residuals.layer_stored``), each laid out as
    the layer's value it is (or is computed from), else with its rows split as the carried
    input's where its first dimension is the micro-batch's rows (as ``memory.py`` lays out a
    probed leaf no constraint names), else whole."""
    layer = layers.layers[rep]
    carried = tuple(layers.layers[0].act_in) + tuple(parts["carried_shared"])
    leaves = layer_stored(graph, plan, mesh, layer, stacked=layers.stacked,
                          shared=parts["carried_shared"], carried=carried, rest=parts["rest"],
                          batch=batch)
    first = graph.values[carried[0]] if carried else None
    row_axes = (plan.decisions[first.producer].out_specs[first.index].dims[0]
                if first is not None and first.shape else ())
    shape = MeshShape.of(mesh)
    total = 0.0
    for aval, spec in leaves:
        if spec is None and aval.shape and aval.shape[0] == rows:
            spec = Spec((tuple(row_axes),) + ((),) * (len(aval.shape) - 1))
        total += local_bytes(aval, spec, shape)
    return total


def _nested(graph: OpGraph, nid: int) -> list[int]:
    return members(graph, nid)

