"""Per-device memory of a pipeline's tick loop: what it holds beyond its operands and results.

The step's plan treats the loop as one operator (``outer.py``): the stacked weights, the rest,
the micro-batched batch and the gradients the loop returns are values of the step's graph, laid
out by its plan and counted by :mod:`jaxpar._src.program_memory` like any other.  What the loop
allocates inside is not; :func:`loop_memory` models it from the schedule's slot tables
(``slots.py``) and the shapes ``loop.py`` gives its buffers, per device:

* **residual slots**: ``res_slots + 1`` (the scratch slot idle ticks write) times one chunk's
  stored residuals of one micro-batch: ``k`` layer slots of the leaves :mod:`residuals` keeps
  (with ``pipeline_residuals="recompute"`` only the chunk's input).  GPipe holds ``M`` per stage,
  1F1B ``O(S)``; an interleaved stage ``v`` times as many chunk micro-batches of ``k`` layers.
* **activation and cotangent slots**: ``slots + 1`` plus the value that arrived this tick
  (``in_act``, ``in_ct``), each one micro-batch's carried values.
* **accumulators**: the stage weights' gradients ``[v, (G,) k, ...]`` (``G``, the row groups of
  ``groups.py``, is split over the row axes: one group per device) and the rest's, per
  micro-batch and ``[G, ...]`` per group (``ends.py``); the loop's results are their sums, a
  buffer of the step's own.  Reduce-scattered (ZeRO), the stage weights' whole accumulator
  and the loop body's sum of it; at level 3 also its carry, which at lower levels XLA puts
  in the updated weights' output allocation (whole there, the weight's slice at level 3).
* **one tick**: what a chunk's forward or backward makes and drops within the tick: the
  chunk's weights copied out of the stage's stack (both); the forward's residuals before they
  are written to their slot; the backward's weight gradients (the chunk's and the rest's)
  before they are added to the accumulators, and the residuals it reads: sliced out of their
  slot, or, recomputing, the whole chunk's, remade.
* **the stage's stack, interleaved** (``v > 1``): the stage's ``[v, k, ...]`` weights, which
  XLA copies into the loop's state for the whole loop (its ticks slice the repeat they run
  out of it; the ``v = 1`` loop reads the argument as it is): :func:`_stack_copy_arrays`.

Before the loop is traced (the split's memory check, ``early.py``, calls :func:`loop_memory`
on a draft of the program per candidate split) a layer's stored residuals are estimated
from the leaves ``jax.vjp`` of one layer keeps (``residuals.layer_stored``, once per
build).  Once it is traced, :func:`record` keeps what the probe of :mod:`residuals` found,
and :func:`loop_memory` counts those leaves.  The step's
plan adds the loop's arrays as temporaries of the loop operator, one by one once the loop is
traced (:func:`jaxpar._src.program_memory.lowered_memory`), so ``plan.memory_bytes`` is the
step's arguments (parameters, optimizer state, split by ZeRO as planned), results,
temporaries, and the loop, whose arrays share the output allocations of the step made after
the loop (the updated weights and Adam moments), as XLA's buffer assignment puts them there
(:func:`loop_temporaries`).  Against ``compiled.memory_analysis()``
(``bench/pipeline_memory.py``, README): 0.986-1.080 of the compiled total on the 19 GPT rows
(GPipe, 1F1B, interleaved, S = 2 and 4, ZeRO off, level 1 and 3, stored and recomputed
residuals, row groups on and off; the interleaved ones 1.042-1.065 with the stage's weights
copied into the loop, 0.989-1.039 before), where the loop as one temporary, sharing no output, was
0.953-1.164 (over by 10-16% on the three that recompute with row groups).  Not counted: the
zeros a backward's weight gradients start from and XLA's heap fragmentation (under), an
accumulator XLA keeps in fewer bytes (over).  The zeros are broadcasts that start the
``[k, G, ...]`` gradient buffers of the backward's scan over the chunk's layers, copied into
the scan's loop state and live beside the copy: at the backward's peak of the GPT's S=2 M=4
1F1B step (``--xla_dump_to``) those of the MLP's two kernels and first bias, one of the four
attention kernels and one ``[16]`` vector (20.75 KiB of the chunk's 33.75 KiB of weights; 2.5
KiB more are masks); the other weights' buffers are not kept so.  Which ones is XLA's
choice, not a shape's, so no term models them (all of them, 33.75 KiB, would add about 6%
to every row with a backward, most of which are over already).  At ZeRO level 3 (the
stacked weights split, gathered by the step before the loop) the accumulator's carry finds
no output allocation to live in, and where a scan runs forward and backward ticks on one
chunk per stage XLA holds the gathered weights twice: both counted (the GPT, S=2 M=4 1F1B
level 3: 1.021 of the compiled total; 0.832 without them).

>>> from jaxpar._src.pipeline.schedule import PipelineSchedule
>>> m = estimate(PipelineSchedule.build("gpipe", 2, 4), slots=3, layer_bytes=100.0,
...              stored_bytes=10.0, full_bytes=10.0, carried_bytes=1.0)
>>> m.residual_slots  # 4 micro-batches in flight + the scratch slot, 3 layers of 10 bytes each
150.0
>>> PipelineSchedule.build("1f1b", 2, 4).in_flight(), estimate(
...     PipelineSchedule.build("1f1b", 2, 4), slots=3, layer_bytes=100.0, stored_bytes=10.0,
...     full_bytes=10.0, carried_bytes=1.0).residual_slots  # 1F1B: 3 in flight on stage 0
((3, 1), 120.0)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from jaxpar._src.pipeline.schedule import PipelineSchedule
from jaxpar._src.pipeline.slots import SlotTables
from jaxpar._src.pipeline.view import format_bytes, local_bytes
from jaxpar._src.spec import MeshShape, Spec

# program id -> (stored, full) per layer slot, and each stored and remade leaf's bytes per chunk
_TRACED: dict[int, tuple[float, float, tuple[float, ...], tuple[float, ...]]] = {}


@dataclasses.dataclass(frozen=True)
class LoopMemory:
    """Bytes per device the tick loop holds beyond its operands and results.

    Attributes:
      residual_slots: ``(res_slots + 1) x`` one chunk's stored residuals per micro-batch.
      activation_slots: ``(act_slots + 2) x`` one micro-batch's carried values.
      cotangent_slots: ``(ct_slots + 2) x`` the same (their cotangents).
      accumulators: the gradient accumulators of the stage weights and of the rest.
      tick: one tick's transient (the chunk's weights, residuals and weight gradients).
      res_slots, act_slots, ct_slots: the slot counts of the schedule (``slots.py``).
      slots: layer slots per chunk ``k``; repeats: chunks per stage ``v``.
      layer_stored: one layer's stored residuals per micro-batch; ``how``: ``"traced"`` (the
        probe's leaves) or ``"layer vjp"`` (one layer's, before tracing:
        ``residuals.layer_stored``).
      weight_copies: ZeRO level 3: the second copy XLA makes of the gathered stage weights
        where one scan runs forward and backward ticks on one chunk per stage
        (:func:`_weight_copies`).
      stack_copy: interleaved (``v > 1``): the stage's ``[v, k, ...]`` weights copied into
        the loop's state, whose ticks index the repeat (:func:`_stack_copy_arrays`).
      arrays: once traced, the bytes of each array the parts are made of (a residual leaf's
        slots, a carried value's, an accumulator, a tick's copied weight, weight gradient,
        rest gradient and residual leaf): they sum to ``total``; empty before tracing.  The
        step's buffer assignment places them one by one (:func:`loop_temporaries`).
    """

    residual_slots: float
    activation_slots: float
    cotangent_slots: float
    accumulators: float
    tick: float
    res_slots: int
    act_slots: int
    ct_slots: int
    slots: int
    repeats: int
    layer_stored: float
    how: str = "layer vjp"
    weight_copies: float = 0.0
    arrays: tuple[float, ...] = ()
    stack_copy: float = 0.0

    @property
    def total(self) -> float:
        return (self.residual_slots + self.activation_slots + self.cotangent_slots
                + self.accumulators + self.tick + self.weight_copies + self.stack_copy)

    def explain(self) -> str:
        """One line for ``plan.pipeline.explain()``."""
        b = format_bytes
        return (f"loop {b(self.total)}: residual slots {b(self.residual_slots)} "
                f"({self.res_slots} + 1 scratch x {self.slots} layers x "
                f"{b(self.layer_stored)}, {self.how}), activation + cotangent slots "
                f"{b(self.activation_slots + self.cotangent_slots)}, gradient "
                f"accumulators {b(self.accumulators)}, one tick {b(self.tick)}"
                + (f", gathered weights' second copy {b(self.weight_copies)}"
                   if self.weight_copies else "")
                + (f", the stage's weights copied into the loop {b(self.stack_copy)}"
                   if self.stack_copy else ""))


def estimate(schedule: PipelineSchedule, *, slots: int, layer_bytes: float,
             stored_bytes: float, full_bytes: float, carried_bytes: float,
             recompute: bool = False, extra_grad_bytes: float = 0.0,
             tick_grad_bytes: float = 0.0) -> LoopMemory:
    """The loop's memory for ``slots`` layers per chunk (see the module docstring).

    Args:
      schedule: the tick table (its slot counts).
      slots: layer slots per chunk ``k``.
      layer_bytes: one layer's weights per device (its gradient accumulator is as large).
      stored_bytes: one layer's stored residuals per micro-batch per device.
      full_bytes: one layer's whole residual set (what a recomputing backward remakes).
      carried_bytes: one micro-batch's carried values per device (a chunk's input).
      recompute: ``pipeline_residuals="recompute"``: a chunk stores its input only.
      extra_grad_bytes: the gradient accumulators beyond the loop's results (the loop's
        last carry is its result's buffer, :func:`_extra_grads`).
      tick_grad_bytes: the rest's weight gradients a backward makes in its tick before
        they are added to their accumulators (a head run in the loop: :func:`_tick_grads`).
    """
    if not schedule.has_backward:
        # forwards alone: no residual or cotangent slots, no accumulators; a tick runs the
        # chunk's layer slots one after another, each on its layer's weights sliced from the
        # stack (XLA's buffer assignment: one [32, 32] slice on the toy stack, not the chunk's)
        t = SlotTables.of(schedule)
        return LoopMemory(0.0, (t.act_slots + 2) * carried_bytes, 0.0, 0.0,
                          layer_bytes if slots else 0.0, 0, t.act_slots, 0, slots,
                          schedule.repeats, 0.0)
    t = SlotTables.of(schedule)
    v, k = schedule.repeats, slots
    chunk_stored = carried_bytes if recompute else k * stored_bytes
    # both: the chunk's weights, copied out of the stage's stack for the tick's scan over its
    # k layers; forward: the chunk's residuals, stacked over the k layers, before their slot;
    # backward: the chunk's weight gradients before the accumulators, and the residuals it
    # reads (recomputing: remade; storing: its micro-batch's, sliced out of their slot);
    # the two never live at once (one runs after the other).  XLA's buffer assignment of
    # the GPT's S=2 M=4 1F1B step holds each of these at the backward's peak, storing and
    # recomputing (README)
    forward = k * layer_bytes + k * (full_bytes if not recompute else 0.0)
    backward = (2 * k * layer_bytes + tick_grad_bytes
                + k * (full_bytes if recompute else stored_bytes))
    return LoopMemory(
        residual_slots=(t.res_slots + 1) * chunk_stored,
        activation_slots=(t.act_slots + 2) * carried_bytes,
        cotangent_slots=(t.ct_slots + 2) * carried_bytes,
        accumulators=extra_grad_bytes,
        tick=max(forward, backward), res_slots=t.res_slots, act_slots=t.act_slots,
        ct_slots=t.ct_slots, slots=k, repeats=v,
        layer_stored=carried_bytes / max(k, 1) if recompute else stored_bytes)


def record(program: Any, stored: Sequence[Any], specs: Sequence[Spec | None],
           full: Sequence[Any], full_specs: Sequence[Spec | None]) -> None:
    """Keeps what the loop's probe found (``loop.py``): a chunk's stored residual leaves and,
    recomputing, the leaves the backward remakes; avals over the mesh without ``"pp"``."""
    mesh = MeshShape.of(program.mesh)
    k = max(program.split.slots, 1)

    def leaves(avals: Sequence[Any], specs: Sequence[Spec | None]) -> tuple[float, ...]:
        return tuple(local_bytes(a, sp if sp is not None else _rows_spec(program, a), mesh)
                     for a, sp in zip(avals, specs, strict=True))

    s, f = leaves(stored, specs), leaves(full, full_specs)
    _TRACED[program.id] = (sum(s) / k, sum(f) / k, s, f)
    while len(_TRACED) > 256:
        _TRACED.pop(next(iter(_TRACED)))


def loop_temporaries(graph: Any) -> list[tuple[float, int]]:
    """``(bytes, node id)`` of every pipeline loop in a step's graph: its :func:`loop_memory`,
    temporaries held while the loop operator runs (``program_memory.py``), one per array
    once the loop is traced.  One by one, XLA's buffer assignment puts them where they fit,
    in the step's output allocations made after the loop (the updated weights and their Adam
    moments) among them: at the backward's peak of the GPT's S=2 M=4 1F1B step those hold
    loop arrays in 130,088 and 130,060 of their 130,608 bytes, recomputing and storing
    (``--xla_dump_to``); one lump, larger than any output, would share none."""
    from jaxpar._src.pipeline.outer import loops_in

    out: list[tuple[float, int]] = []
    for nid, program in loops_in(graph):
        m = loop_memory(program, backward=len(graph.nodes[nid].outputs) > 1)
        out.extend((b, nid) for b in (m.arrays or (m.total,)))
    return out


def loop_memory(program: Any, *, backward: bool = True) -> LoopMemory:
    """The loop of ``program`` (a ``PipelineProgram``; ``backward=False``: its forwards
    alone): with the probe's residuals once the loop is traced, else one layer's vjp's."""
    mesh = MeshShape.of(program.mesh)
    split, config = program.split, program.config
    carried = sum(local_bytes(program.graph.values[v], program.spec(v), mesh)
                  for v in program.carried_in)
    recompute = config.residuals == "recompute"
    traced = _TRACED.get(program.id)
    stored, full = traced[:2] if traced is not None else (split.residual_bytes,
                                                          split.residual_bytes)
    if recompute and traced is not None:
        stored = full
    m = estimate(program.schedule if backward else program.forward_schedule,
                 slots=split.slots, layer_bytes=split.layer_bytes, stored_bytes=stored,
                 full_bytes=full, carried_bytes=carried,
                 recompute=recompute, extra_grad_bytes=_extra_grads(program, mesh),
                 tick_grad_bytes=sum(_tick_grads(program, mesh)))
    m = dataclasses.replace(m, how="traced" if traced is not None else "layer vjp",
                            weight_copies=_weight_copies(program, mesh) if backward else 0.0,
                            stack_copy=sum(_stack_copy_arrays(program, mesh)) if backward
                            else 0.0)
    if traced is None or not backward:
        return m
    return _with_arrays(program, m, mesh, *traced[2:])


def _with_arrays(program: Any, m: LoopMemory, mesh: MeshShape, stored: tuple[float, ...],
                 full: tuple[float, ...]) -> LoopMemory:
    """``m`` (a traced backward loop's) with :attr:`LoopMemory.arrays`: each stored leaf's
    ``[res_slots + 1, ...]`` slots (recomputing: each carried value's), each carried value's
    activation and cotangent slots and the one that arrived, each accumulator of
    :func:`_extra_grads`, the bigger tick's arrays (forward: each of the chunk's weights
    copied out of the stack, but level 3's gathered ones, and the leaves it makes; backward:
    the copy, each weight's gradient, the rest's (:func:`_tick_grads`) and the residual
    leaves it reads) and level 3's weight copies.  The tick is its arrays' sum (the weights
    as the layer's values: within bytes of ``split.layer_bytes``)."""
    carried = [local_bytes(program.graph.values[v], program.spec(v), mesh)
               for v in program.carried_in]
    k = m.slots
    recompute = program.config.residuals == "recompute"
    slots = [(m.res_slots + 1) * b for b in (carried if recompute else stored)]
    for n in (m.act_slots, m.ct_slots):
        slots += [(n + 1) * b for b in carried] + carried
    values = [program.graph.values[w] for w in program.rep_layer.weights]
    # at ZeRO level 3 the loop reads the gathered weights XLA relays into the shapes the
    # loop reads (the step's gathered value and :func:`_weight_copies`), not a copy per tick
    gathered = ({program.rep_layer.weights[program.stacked[j]] for j, _, _ in program.scatters}
                if program.params_split else set())
    copy = [k * local_bytes(w, program.spec(w.id), mesh) for w in values if w.id not in gathered]
    grads = [k * local_bytes(w, program.spec(w.id), mesh) for w in values
             if jnp.issubdtype(w.dtype, jnp.inexact)]
    forward = copy + ([] if recompute else list(full))
    backward = copy + grads + _tick_grads(program, mesh) + list(full if recompute else stored)
    tick = forward if sum(forward) > sum(backward) else backward
    arrays = tuple(slots + _extra_grad_arrays(program, mesh) + tick
                   + _weight_copy_arrays(program, mesh) + _stack_copy_arrays(program, mesh))
    return dataclasses.replace(m, tick=sum(tick), arrays=arrays)


def _weight_copies(program: Any, mesh: MeshShape) -> float:
    """ZeRO level 3 (the stacked weights split as their moments, gathered by the step before
    the loop): the gathered stage weights a second time, where a scan of the loop (a phase,
    ``slots.py``) runs forward and backward ticks (1F1B's steady state) on one chunk per
    stage (``v = 1``).  The all-gather makes them with the gathered dimension major, and XLA
    copies them into each shape the loop reads them in (the buffer assignments of
    ``--xla_dump_to``): the toy stack and the GPT under 1F1B, two copies (``[k, ...]`` and
    ``[v, k, ...]``), GPipe (a forward phase, then a backward one) one; interleaved (``v =
    2``: a tick slices its chunk out of the stack) one, by the compiled totals (the toy's
    interleaved 1F1B: 0.967 of the compiled total without the copy, 1.096 with it).  The
    step's model counts the gathered value once."""
    return sum(_weight_copy_arrays(program, mesh))


def _weight_copy_arrays(program: Any, mesh: MeshShape) -> list[float]:
    """:func:`_weight_copies` one array per weight."""
    if not program.params_split or program.config.repeats != 1:
        return []
    if not any(f and b for _, _, f, b in SlotTables.of(program.schedule).phases()):
        return []
    weights = [program.graph.values[program.rep_layer.weights[program.stacked[j]]]
               for j, _, _ in program.scatters]
    return [program.split.slots * local_bytes(w, program.spec(w.id), mesh) for w in weights]


def _stack_copy_arrays(program: Any, mesh: MeshShape) -> list[float]:
    """Interleaved (``v > 1``): each stacked weight's ``[v, k, ...]`` as the loop's state holds
    it, a copy of the stage's share of the argument for the whole loop (its ticks
    dynamic-slice the repeat they run out of it; at ZeRO level 3 the gathered ones are
    relayed, not copied: :func:`_with_arrays`).  The buffer assignments of the GPT's S=4 M=16
    1F1B ``v = 2`` step (``k = 1``) and S=2 M=4 GPipe ``v = 2`` (``k = 2``) hold a ``wrapped_copy``
    of each stacked weight (the masks a broadcast) in the loop's layout through the loop,
    none of the ``v = 1`` rows' (S=4 M=16 1F1B, ``k = 2``): without it the split's check was
    0.935 and 0.953 of their compiled totals (``--xla_dump_to``, ``bench/pipeline_memory.py``)."""
    v, k = program.config.repeats, program.split.slots
    if v == 1:
        return []
    gathered = ({program.rep_layer.weights[program.stacked[j]] for j, _, _ in program.scatters}
                if program.params_split else set())
    values = [program.graph.values[program.rep_layer.weights[p]] for p in program.stacked]
    return [v * k * local_bytes(w, program.spec(w.id), mesh) for w in values
            if w.id not in gathered]


def _extra_grads(program: Any, mesh: MeshShape) -> float:
    """The bytes of :func:`_extra_grad_arrays`."""
    return sum(_extra_grad_arrays(program, mesh))


def _extra_grad_arrays(program: Any, mesh: MeshShape) -> list[float]:
    """The gradient accumulators that are not the loop's results: a stage weight's where the
    result is reduce-scattered (ZeRO: the result is split over the row axes, the accumulator
    and the collective's operand whole), the rest's per micro-batch (their result is their
    sum over ``"pp"``) and ``[G, ...]`` per row group (one group per device) summed into the
    rest's result after the loop."""
    from jaxpar._src.pipeline.groups import strip

    groups, ends = program.groups, program.ends
    # the rest's per-micro-batch accumulators: their result is their sum over "pp", another
    # buffer (a placeholder scalar where only the per-group sum is kept)
    total = _rest_grad_arrays(program, mesh)
    if not groups.on:
        return total
    v, k = program.config.repeats, program.split.slots
    scattered = {j for j, _, _ in program.scatters}
    for j in range(len(program.stacked)):
        # the accumulator [v, G, k, ...] (one group per device), summed over the row axes
        # after the loop into the result: by all-reduce, the result a buffer of its own, or,
        # reduce-scattered, also the collective's operand, the group dropped ([v, k, ...]):
        # each whole.  Reduce-scattered at level 1, XLA's buffer assignment puts the loop's
        # accumulator carry in the updated weights' output allocation (whole, made after the
        # loop: the toy's dump); at level 3 that output is the weight's slice, 1/G as large,
        # so the carry is a buffer of its own: one more
        w = program.graph.values[program.rep_layer.weights[program.stacked[j]]]
        copies = (3 if program.params_split else 2) if j in scattered else 1
        total += [v * k * local_bytes(w, strip(program.spec(w.id), groups.axes), mesh)] * copies
    for i in ends.grouped if ends.on else ():
        vid = program.rest[i]
        total.append(local_bytes(program.graph.values[vid], strip(program.spec(vid), groups.axes),
                            mesh))
    return total


def _rest_grad_arrays(program: Any, mesh: MeshShape) -> list[float]:
    """The rest's gradients accumulated per micro-batch in the loop (a placeholder scalar
    where only the per-group sum is kept, ``ends.only``): the accumulators beyond the loop's
    results."""
    groups, ends = program.groups, program.ends
    only = set(ends.only) if groups.on and ends.on else set()
    return [local_bytes(program.graph.values[vid], program.spec(vid), mesh)
            for i, vid in enumerate(program.rest) if i not in only
            and jnp.issubdtype(program.graph.values[vid].dtype, jnp.inexact)]


def _tick_grads(program: Any, mesh: MeshShape) -> list[float]:
    """The rest's gradients one backward makes before adding them to their accumulators
    (the toy stack's 4096-column head; the GPT's embedding and head, per row group where the
    ends run per group, as their accumulators: XLA's buffer assignment holds them at the
    backward's peak).

    A grouped one the loop reduce-scatters (``program.rest_scatters``, ZeRO) that a
    ``dot_general`` of the epilogue's head reads (a head's weight) twice: the backward holds
    its gradient as the transposed product makes it (``[vocab, d]``) and copied into the
    layout of the tick's result, beside its accumulator (``--xla_dump_to`` of the memory toy
    with a ``[32, 2048]`` head, ZeRO off, level 1 and 3 alike: three whole buffers of it in
    the loop).  Where the gradient is all-reduced XLA puts one of them in the gradient's whole
    result, which the split's check counts (``early.py``: the loop's results) and the step's
    outputs hold; reduce-scattered, that result is a slice, and the split's check was 0.81 of
    the toy's compiled total at level 3 and 0.82 at level 1 (``test_pipeline_memory.py``).
    An embedding's gradient (a scatter-add, no product) is not counted twice."""
    from jaxpar._src.pipeline.groups import strip
    from jaxpar._src.pipeline.layers import members

    groups, ends = program.groups, program.ends
    grouped = set(ends.grouped) if groups.on and ends.on else set()
    graph = program.graph
    products = {o for top in ends.head for nid in members(graph, top)
                if graph.nodes[nid].name == "dot_general" for o in graph.nodes[nid].inputs}
    scattered = {i for i, _, _ in program.rest_scatters
                 if i in grouped and program.rest[i] in products}
    out = []
    for i, vid in enumerate(program.rest):
        v = program.graph.values[vid]
        if jnp.issubdtype(v.dtype, jnp.inexact):
            spec = strip(program.spec(vid), groups.axes) if i in grouped else program.spec(vid)
            out += [local_bytes(v, spec, mesh)] * (2 if i in scattered else 1)
    return out


def _rows_spec(program: Any, aval: Any) -> Spec | None:
    """The layout XLA gives a residual leaf no constraint names: its rows split as the
    chunk's input's where its first dimension after the layer slots (``[k, ...]``: a chunk of
    more than one slot is a scan) is the row groups (``[G, ...]``, on the row axes) or the
    micro-batch's rows; else whole."""
    shape = tuple(aval.shape)
    lead = 0 if program.split.slots == 1 and not program.split.padded else 1
    if len(shape) <= lead:
        return None
    groups = program.groups
    first = program.spec(program.carried_in[0]) if program.carried_in else None
    if groups.on and shape[lead] == groups.size:
        axes: tuple[str, ...] = tuple(groups.axes)
    elif shape[lead] == program.micro_size and first is not None and first.ndim:
        axes = tuple(first.dims[0])
    else:
        return None
    return Spec(((),) * lead + (axes,) + ((),) * (len(shape) - lead - 1))
