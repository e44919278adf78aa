"""The split's memory check before the loop is traced: a candidate's memory per device.

The split (``split.py``) bounds the layer slots per chunk ``k`` by
``HardwareProfile.memory_per_device``, before the loop is built, so before the probe of
``residuals.py`` has found what a chunk stores.  What the row groups, ZeRO and level 3 change is
known by then: the row groups (``groups.py``) and the ends (``ends.py``) depend on the layers,
not on the split, and the reduce-scatter decision of each stacked weight
(``groups.gradient_scatters``) on its ``[S, v, k, ...]`` shape, which each candidate ``k`` fixes.
So each candidate is a :class:`Draft`: the fields of a ``PipelineProgram`` that the loop's
memory model (``memory.loop_memory``) reads, with that ``k``, its scatters and whether level 3
splits the weights, and :func:`early_memory` counts, per device:

* **weights**: the stacked ones ``[v, k, ...]`` as the step passes them (split over the row axes
  at level 3, like their moments) and the rest; where the step passes each layer's weights
  (``Draft.per_layer``: no ``StackedParams``), every layer's too, whole over ``"pp"``
  (each stage holds all of them), with their gradients and optimizer state;
* **gathered**: at level 3 the stacked weights the step gathers whole before the loop (the
  rest's it gathers too are counted whole among the weights, their split arguments left out);
* **gradients**: the loop's results, the stacked ones reduce-scattered over the row axes where
  ZeRO splits them (``1/G``), the rest's as their accumulators are laid out;
* **batch**: the batch as the step passes it and, micro-batched, the loop's copy of it;
* **loop**: ``memory.loop_memory`` of the draft, with a layer's stored residuals estimated
  from the leaves ``jax.vjp`` of one layer keeps (``residuals.layer_stored``): the slots,
  the row groups' ``[v, G, k, ...]`` accumulators and the reduce-scatter's operand, the
  rest's per-group gradients, one tick
  (with the zeros its weight gradients start from), level 3's second copy of the gathered
  weights, and, interleaved, the stage's ``[v, k, ...]`` weights copied into the loop's state.

* **state**: the optimizer state's copies of the weights (``Draft.state_copies``: Adam's
  moments, two) where they are known (``PipelineCell.stack(opt_state=)``, or the traced step's
  arguments), per argument leaf, laid out as ZeRO pins them (``_state_copy``); none otherwise.

Left out: the step's own temporaries; the step's plan counts them (``plan.memory_bytes``).
A layer's stored residuals, once every operator result of the layer (26.1 KiB against the
probe's 13.9 on the bench's GPT), are the leaves ``jax.vjp`` of one layer keeps (13.4 KiB;
equal to the probe's on the tests' toy and MLP).  With Adam's state the check is 0.952-1.065
of the compiled total on the 19 bench rows (README; mean |error| 1.74%), 0.741-1.031 without it
(before the batch's copy was counted).

>>> from jaxpar._src.pipeline.early import EarlyMemory
>>> EarlyMemory(weights=10.0, gathered=0.0, gradients=10.0, batch=1.0, loop=50.0).total
71.0
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from jaxpar._src.pipeline.config import AXIS
from jaxpar._src.pipeline.groups import strip
from jaxpar._src.pipeline.memory import loop_memory
from jaxpar._src.pipeline.view import LayerView, format_bytes, local_bytes
from jaxpar._src.spec import MeshShape, Spec


@dataclasses.dataclass(frozen=True)
class EarlyMemory:
    """A split candidate's memory per device before the loop is traced (module docstring)."""

    weights: float
    gathered: float
    gradients: float
    batch: float
    loop: float
    state: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gathered + self.gradients + self.batch + self.loop + \
            self.state

    def explain(self) -> str:
        return (f"{format_bytes(self.total)}: weights {format_bytes(self.weights)}, gradients "
                f"{format_bytes(self.gradients)}, batch {format_bytes(self.batch)}, loop "
                f"{format_bytes(self.loop)}" + (f", gathered {format_bytes(self.gathered)}"
                                          if self.gathered else "")
                + (f", optimizer state {format_bytes(self.state)}" if self.state else ""))


@dataclasses.dataclass(frozen=True, eq=False)
class Draft(LayerView):
    """What ``memory.loop_memory`` reads of a ``PipelineProgram``, for one candidate's slots
    ``k`` (``split``: ``(k,) * chunks``), before the loop exists (``id`` 0: never traced)."""

    config: Any
    mesh: Any
    sub_plan: Any
    graph: Any
    layers: Any
    rep: int
    split: Any
    schedule: Any
    rest: tuple[int, ...]
    batch: tuple[int, ...]
    carried_in: tuple[int, ...]
    stacked: tuple[int, ...]
    groups: Any
    ends: Any
    scatters: tuple[tuple[int, int, tuple[str, ...]], ...]
    rest_scatters: tuple[tuple[int, int, tuple[str, ...]], ...]
    params_split: bool
    micro_size: int
    id: int = 0
    state_copies: int = 0  # the optimizer state's copies of the weights (Adam: 2), if known
    optimizer: Any = None  # jaxpar.OptimizerParallel (ZeRO): how it splits those copies
    per_layer: bool = False  # the step passes each layer's weights, not a StackedParams


def early_memory(draft: Draft) -> EarlyMemory:
    """``draft``'s memory per device (see the module docstring)."""
    mesh = MeshShape.of(draft.mesh)
    v, k, M = draft.config.repeats, draft.split.slots, draft.config.micro_batches
    graph = draft.graph
    split = {j: mesh.product(axes) for j, _, axes in draft.scatters}
    weights = gathered = grads = 0.0
    leaves = _leaves(draft) if draft.per_layer else set()
    for j, pos in enumerate(draft.stacked):
        w = graph.values[draft.rep_layer.weights[pos]]
        whole = v * k * local_bytes(w, draft.spec(w.id), mesh)
        if draft.params_split and j in split:
            weights += whole / split[j]
            gathered += whole
        else:
            weights += whole
        if _inexact(w):
            grads += whole / split.get(j, 1)
        if w.id in leaves:  # every layer's own: the argument and its gradient, beside the stack
            every = len(draft.layers.layers) * local_bytes(w, draft.spec(w.id), mesh)
            weights += every
            grads += every if _inexact(w) else 0.0
    rest_split = {i: (dim, axes) for i, dim, axes in draft.rest_scatters}
    for i, vid in enumerate(draft.rest):
        value = graph.values[vid]
        spec = draft.spec(vid)
        # whole, at level 3 too: there the step passes it split as its moments (1/G) and
        # gathers it whole before the loop; the whole value stands for the gathered copy, the
        # slice is left out (counting it put the checks over: README)
        weights += local_bytes(value, spec, mesh)
        if not _inexact(value):
            continue
        if i in rest_split:  # reduce-scattered: whole over the row axes but that dimension
            dim, axes = rest_split[i]
            dims = list(strip(spec, draft.groups.axes).dims)
            dims[dim] = dims[dim] + axes
            spec = Spec(tuple(dims))
        grads += local_bytes(value, spec, mesh)
    # the batch as passed and, micro-batched (rows m::M of each micro-batch m), the loop's
    # [M, ...] copy of it, live through the loop (a transpose: the toy's [64, 32] batch as a
    # [4, 16, 32] ``wrapped_copy`` at the peak of its dp=1 steps, --xla_dump_to)
    batch = (2 if M > 1 else 1) * M * sum(local_bytes(graph.values[b], draft.spec(b), mesh)
                                          for b in draft.batch)
    return EarlyMemory(weights, gathered, grads, batch,
                       loop_memory(draft, backward=draft.schedule.has_backward).total,
                       draft.state_copies * _state_copy(draft, mesh) if draft.state_copies
                       else 0.0)


def _state_copy(draft: Draft, mesh: MeshShape) -> float:
    """One copy of the weights as the optimizer state holds it (Adam's ``mu``): split as ZeRO
    pins it (``optimizer_parallel.optimizer_pins``: the stacked ``[S, v, k, ...]`` on its first
    later dimension that divides, the rest on dimension 0, over the data-parallel axes), else
    whole as the weights.  Per argument leaf the layer's and the rest's values are read from
    (through reshapes: ``stacked.through_reshapes``), once; a value the loss computes (a
    layer's attention mask) has none."""
    from jaxpar._src.optimizer_parallel import stacked_dim
    from jaxpar._src.pipeline.stacked import through_reshapes

    opt, graph = draft.optimizer, draft.graph
    # ZeRO's data-parallel axes are those the step splits the batch's rows over: the pipelined
    # batch's are every mesh axis ("pp" too: a stacked weight's own is "pp" already)
    dp = mesh.names
    v, k, S = draft.config.repeats, draft.split.slots, draft.config.stages
    total = 0.0
    inputs = {graph.nodes[nid].outputs[0] for nid in graph.inputs}
    seen: set[int] = set()  # a parameter read twice (as it is and reshaped) has one copy
    for vid, stacked in [(draft.rep_layer.weights[p], True) for p in draft.stacked] + \
            [(r, False) for r in draft.rest]:
        vid = through_reshapes(graph, vid)  # the parameter leaf, as the state holds it
        w = graph.values[vid]
        if vid in seen or vid not in inputs or not _inexact(w):
            continue  # read twice, a layer's constant (an attention mask), or an integer
        seen.add(vid)
        spec = draft.spec(vid)
        if stacked and draft.per_layer:  # each layer's state, laid out as its weight's
            axes = opt.split_axes(w.shape, w.dtype, spec, dp, mesh) if opt is not None else ()
            one = len(draft.layers.layers) * local_bytes(w, spec, mesh) / mesh.product(axes)
        elif stacked:
            one = v * k * local_bytes(w, spec, mesh)
            if opt is not None:
                aval = jax.ShapeDtypeStruct((S, v, k) + tuple(w.shape), w.dtype)
                _, axes = stacked_dim(opt, aval, Spec(((AXIS,), (), ()) + spec.dims), dp, mesh)
                one /= mesh.product(axes)
        else:
            axes = opt.split_axes(w.shape, w.dtype, spec, dp, mesh) if opt is not None else ()
            one = local_bytes(w, spec, mesh) / mesh.product(axes)
        total += one
    return total


def _leaves(draft: Draft) -> set[int]:
    """The representative layer's stacked weights that are argument leaves (through reshapes),
    as the step passes them when it passes each layer's weights (``Draft.per_layer``)."""
    from jaxpar._src.pipeline.stacked import through_reshapes

    graph = draft.graph
    inputs = {graph.nodes[nid].outputs[0] for nid in graph.inputs}
    out = set()
    for pos in draft.stacked:
        vid = draft.rep_layer.weights[pos]
        if through_reshapes(graph, vid) in inputs:
            out.add(vid)
    return out


def most_slots(need: Any, budget: float, *, layers: int, chunks: int) -> tuple[int, bool]:
    """The most layer slots per chunk ``k`` with ``need(k) <= budget`` (``need``: the
    estimate, about linear in ``k``; not exactly, since the scatter decision follows the
    ``[S, v, k]`` shape), and whether the even split's ``k`` fits: the even split first, a
    line through it and the next guesses the largest, which is then checked down or up.

    >>> most_slots(lambda k: 10.0 * k, 45.0, layers=8, chunks=2)
    (4, True)
    >>> most_slots(lambda k: 10.0 * k, 35.0, layers=8, chunks=2)
    (4, False)
    """
    even = -(-layers // chunks)
    top = layers - chunks + 1
    if budget <= 0 or not math.isfinite(budget):  # no budget: no bound
        return layers, True
    if need(even) > budget:
        return even, False
    if even >= top:
        return even, True
    slope = need(even + 1) - need(even)
    k = top if slope <= 0 else min(top, even + int((budget - need(even)) // slope))
    while k > even and need(k) > budget:
        k -= 1
    while k < top and need(k + 1) <= budget:
        k += 1
    return k, True


def _inexact(value: Any) -> bool:
    import jax.numpy as jnp

    return bool(jnp.issubdtype(value.dtype, jnp.inexact))


def draft_of(program: Any) -> Draft:
    """The draft of a built ``PipelineProgram`` at its own split's slots: what the split's
    check counted for it, to compare with the traced model (``bench/pipeline_memory.py``)."""
    from jaxpar._src.pipeline.split import StageSplit

    split = program.split
    return Draft(program.config, program.mesh, program.sub_plan, program.graph, program.layers,
                 program.rep, StageSplit((split.slots,) * split.chunks, split.stages,
                                         layer_bytes=split.layer_bytes,
                                         residual_bytes=split.residual_bytes),
                 program.schedule, program.rest, program.batch, program.carried_in,
                 program.stacked, program.groups, program.ends, program.scatters,
                 program.rest_scatters, program.params_split, program.micro_size,
                 state_copies=program.state_copies, optimizer=program.optimizer,
                 per_layer=program.per_layer)
