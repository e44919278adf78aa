"""``PipelinePlan``: what a plan says about its pipeline (``plan.pipeline``).

It carries the schedule and its simulated timeline (under the cost model, and with the textbook
unit costs whose bubble is ``(S-1)/(v*M+S-1)``), the split and why, the layers found, and the
micro-batch plan that lays out every stage over the other mesh axes.

>>> from jaxpar._src.pipeline.schedule import PipelineSchedule
>>> s = PipelineSchedule.build("gpipe", 2, 4)
>>> f"{s.timeline().bubble_fraction:.3f}"
'0.200'
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from jaxpar._src.pipeline.config import AXIS, PipelineConfig
from jaxpar._src.pipeline.memory import LoopMemory, loop_memory
from jaxpar._src.pipeline.schedule import PipelineSchedule, Timeline
from jaxpar._src.pipeline.split import BACKWARD_FACTOR, StageSplit

MAX_GRID_TICKS = 64  # draw the tick grid in explain() up to this many ticks


@dataclasses.dataclass(frozen=True, eq=False)
class PipelinePlan:
    """A pipeline in a plan.

    Attributes:
      config: stages, micro-batches, schedule, repeats.
      schedule: the tick table (:class:`PipelineSchedule`).
      timeline: the schedule under the cost model's per-chunk times (seconds).
      unit_timeline: the schedule with a stage's forward = 1 and backward = 2 (the textbook
        bubble fraction).
      split: layers per chunk and what they cost (:class:`StageSplit`).
      sub_plan: the micro-batch loss planned on the mesh without ``"pp"``.
      sub_how: how ``sub_plan`` was chosen (in ``auto_parallel``: by the mode's search).
      layers, period, marked, prologue_ops, epilogue_ops, stacked_weights: what was found.
      crossing_bytes: bytes of one micro-batch's activation per device (one ``ppermute``).
      micro_rows: rows per micro-batch.
      gradient_reduction: how the stacked weights' gradients, and the prologue's, epilogue's
        and shared unstacked weights', are reduced over the data-parallel axes
        (:class:`GradientReduction`; ``None`` if the rows are not split).
      memory: what the tick loop holds per device beyond its operands and results
        (:class:`~jaxpar._src.pipeline.memory.LoopMemory`; ``plan.memory_bytes`` counts it).

    >>> import jax, jax.numpy as jnp, jaxpar
    >>> def loss(w, x):
    ...     for i in range(4):
    ...         x = jnp.tanh(x @ w[i])
    ...     return jnp.mean(x ** 2)
    >>> mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    >>> with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
    ...                                   pipeline_stages=2, micro_batches=4):
    ...     step = jaxpar.parallelize(jax.grad(jaxpar.PipelineCell(loss)), batch_argnums=1)
    ...     pipe = step.plan(jnp.ones((4, 8, 8)), jnp.ones((16, 8))).pipeline
    >>> pipe.layers, pipe.split.counts, round(pipe.unit_timeline.bubble_fraction, 3)
    (4, (2, 2), 0.2)
    >>> pipe.gradient_reduction.once, pipe.gradient_reduction.axes  # once a step, over dp
    (True, ('dp',))
    """

    config: PipelineConfig
    schedule: PipelineSchedule
    timeline: Timeline
    unit_timeline: Timeline
    split: StageSplit
    sub_plan: Any
    sub_how: str
    layers: int
    period: int
    marked: bool
    prologue_ops: int
    epilogue_ops: int
    stacked_weights: int
    crossing_bytes: float
    micro_rows: int
    gradient_reduction: GradientReduction | None = None
    memory: LoopMemory | None = None

    @classmethod
    def of(cls, program: Any, *, backward: bool = True) -> PipelinePlan:
        """The plan of ``program``'s loop (``backward=False``: its forwards alone)."""
        split, sched, hw = program.split, program.schedule, program.hardware
        from jaxpar._src.spec import MeshShape

        mesh = MeshShape.of(program.mesh)
        link = hw.latency(AXIS, mesh) + program.act_bytes / hw.bandwidth(AXIS, mesh)
        timeline = sched.timeline(
            forward_cost=split.chunk_forward_s(),
            backward_cost=tuple(BACKWARD_FACTOR * f for f in split.chunk_forward_s()),
            extra_first=split.prologue_s, extra_last=split.epilogue_s, tick_overhead=link)
        ls = program.layers
        return cls(program.config, sched, timeline, sched.timeline(), split, program.sub_plan,
                   program.sub_how,
                   len(ls.layers), ls.period, ls.marked, len(program.pro_nodes),
                   len(program.epi_nodes), len(program.stacked), program.act_bytes,
                   program.micro_size, GradientReduction.of(program),
                   loop_memory(program, backward=backward))

    @property
    def bubble_fraction(self) -> float:
        """The idle share of stage-time under the cost model."""
        return self.timeline.bubble_fraction

    def explain(self) -> str:
        c, s = self.config, self.schedule
        v = f", {c.repeats} repeats (interleaved)" if c.repeats > 1 else ""
        found = ("the user's pipeline_stage markers" if self.marked else
                 f"repeats, cut where {_bytes(self.crossing_bytes)} per device cross")
        lines = [
            f"pipeline: {c.stages} stages on '{AXIS}' x {c.micro_batches} micro-batches of "
            f"{self.micro_rows} rows, schedule {c.schedule}{v}",
            f"  layers: {self.layers} identical layers of {self.period} operators (found by "
            f"{found}); prologue {self.prologue_ops} operators on stage 0, epilogue "
            f"{self.epilogue_ops} on stage {c.stages - 1}; {self.stacked_weights} weights "
            f"stacked per layer",
        ]
        sp = self.split
        if sp.how == "markers":
            lines.append("  split: one marked region per chunk")
        else:
            slowest = max(sp.chunk_cost_s(i) for i in range(sp.chunks))
            why = f"the slowest chunk costs {_ms(slowest)} vs {_ms(sp.even_cost_s)} even"
            lines.append(f"  split: counts {list(sp.counts)} balance the cost model's time "
                         f"(forward + backward per micro-batch; {why})"
                         + ("" if sp.fits else "; the memory estimate exceeds the budget"))
        lines.extend("    " + line for line in sp.stage_lines())
        inner = self.sub_plan
        lines.append(f"  each stage on {inner.mesh}: {self.sub_how} "
                     f"(plan.pipeline.sub_plan.explain())")
        lines.append(
            f"  schedule: {s.num_ticks} ticks; bubble {self.timeline.bubble_fraction:.1%} under "
            f"the cost model ({_ms(self.timeline.total_s)} per step), "
            f"{self.unit_timeline.bubble_fraction:.1%} with unit costs; in flight per stage "
            f"{list(s.in_flight())} chunk micro-batches")
        per_stage = sp.slots * c.repeats * sp.layer_bytes
        loop = f"; {self.memory.explain()}" if self.memory is not None else ""
        check = (f"; the split's check {_bytes(sp.memory_bytes)} (weights, gradients, loop)"
                 if sp.memory_bytes else "")
        lines.append(f"  memory per device (est.): stacked weights {_bytes(per_stage)}{loop}"
                     f"{check}")
        if self.gradient_reduction is not None:
            lines.append("  " + self.gradient_reduction.explain())
        if s.num_ticks <= MAX_GRID_TICKS:
            lines.extend("    " + line for line in s.render().splitlines())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


@dataclasses.dataclass(frozen=True)
class GradientReduction:
    """How the stacked layer weights' gradients are reduced over the data-parallel axes
    (``groups.py``), as the compiled step's all-reduces over ``axes`` should show them.

    Attributes:
      axes: the mesh axes the micro-batch's rows are split over.
      once: reduced once per step, after the loop (else once per chunk backward, inside it).
      runs: how many times a step reduces (loop trip counts: every tick of the loop's phases
        with backward work, times the chunk's layer slots, runs the backward's code).
      run_bytes: per device, what one run reduces.
      why: grouped, or why not.
      scattered_bytes: of ``run_bytes``, what is reduce-scattered, not all-reduced (the
        parallel optimizer on: split as the weights' optimizer state, ``program.scatters``).
      ends_bytes: per device, the gradients of the weights the prologue and epilogue read
        (embedding, head, final norm) that a step reduces once after the loop, summed per
        row group in it (``ends.py``); ``0`` where they are reduced per micro-batch.
      ends_why: how the prologue's and the epilogue's gradients are reduced, and why.
      ends_scattered_bytes: of ``ends_bytes``, what is reduce-scattered, not all-reduced
        (the parallel optimizer on: one dimension split over the row axes,
        ``program.rest_scatters``).
      loss_bytes: per device, the loss's parts summed per row group in the loop and once
        after it (``tail.py``: one scalar of ``program.loss_dtype``, 4 B in float32, 8 under
        x64); ``0`` where the loss's sum over the rows
        crosses the row axes per micro-batch.
    """

    axes: tuple[str, ...]
    once: bool
    runs: int
    run_bytes: float
    why: str
    scattered_bytes: float = 0.0
    ends_bytes: float = 0.0
    ends_why: str = ""
    ends_scattered_bytes: float = 0.0
    loss_bytes: float = 0.0

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collective kinds the stacked weights' reduction runs as in the compiled step."""
        kinds = ("reduce-scatter",) if self.scattered_bytes else ()
        return kinds + (("all-reduce",) if self.run_bytes > self.scattered_bytes else ())

    @property
    def after_loop_bytes(self) -> float:
        """Per device, what a step all-reduces over ``axes`` after the loop: the stacked
        weights' gradients not reduce-scattered (when ``once``), the ends' not
        reduce-scattered and the loss's parts."""
        return (self.run_bytes - self.scattered_bytes if self.once else 0.0) + \
            self.ends_bytes - self.ends_scattered_bytes + self.loss_bytes

    @property
    def after_loop_scattered_bytes(self) -> float:
        """Per device, what a step reduce-scatters over ``axes`` after the loop (the
        collectives' operands): the stacked weights' and the ends' split gradients."""
        return (self.scattered_bytes if self.once else 0.0) + self.ends_scattered_bytes

    @property
    def step_bytes(self) -> float:
        return self.runs * self.run_bytes

    @classmethod
    def of(cls, program: Any) -> GradientReduction | None:
        from jaxpar._src.pipeline.groups import strip
        from jaxpar._src.pipeline.slots import SlotTables
        from jaxpar._src.spec import MeshShape

        groups = program.groups
        if not groups.axes:
            return None
        mesh = MeshShape.of(program.mesh)
        layer = 0.0  # one layer's stacked weight gradients, per device
        scattered = 0.0  # of which reduce-scattered
        split = {j for j, _, _ in program.scatters}
        for j in range(len(program.stacked)):
            v = program.graph.values[program.stacked_values(j)[0]]
            if not jnp.issubdtype(v.dtype, jnp.inexact) or not _from_inputs(program.graph,
                                                                              v.id):
                continue  # no gradient (a constant's is dead: XLA drops it)
            spec = strip(program.spec(program.rep_layer.weights[program.stacked[j]]),
                         groups.axes)
            nbytes = math.prod(spec.shard_shape(v.shape, mesh)) * v.nbytes / max(
                math.prod(v.shape), 1)
            layer += nbytes
            scattered += nbytes if j in split else 0.0
        k, repeats = program.split.slots, program.config.repeats
        ends_bytes, ends_scattered, ends_why = _ends(program, mesh)
        if groups.on:
            # the loss's parts' sum
            loss = float(jnp.dtype(program.loss_dtype).itemsize) \
                if program.ends.affine is not None else 0.0
            return cls(groups.axes, True, 1, repeats * k * layer, groups.why,
                       repeats * k * scattered, ends_bytes, ends_why, ends_scattered, loss)
        ticks = sum(stop - start for start, stop, _, has_b in
                    SlotTables.of(program.schedule).phases() if has_b)
        return cls(groups.axes, False, ticks * k, layer, groups.why, 0.0, ends_bytes, ends_why,
                   ends_scattered)

    def explain(self) -> str:
        axes = "+".join(self.axes)
        scatter = (f"reduce-scatter (split as the optimizer state) of "
                   f"{_bytes(self.scattered_bytes)}" if self.scattered_bytes else "")
        rest = self.run_bytes - self.scattered_bytes
        once = " + ".join(([scatter] if scatter else []) +
                          ([f"all-reduce of {_bytes(rest)}"] if rest else []))
        how = (f"1 {once} over {axes} per device after the loop" if self.once else
               f"all-reduces over {axes} inside the loop, {self.runs} runs of "
               f"{_bytes(self.run_bytes)} per device ({_bytes(self.step_bytes)} a step)")
        line = f"stage weight gradients: {how}; {self.why}"
        if self.ends_why:
            line += f"\n  {self.ends_why}"
        return line


def _ends(program: Any, mesh: Any) -> tuple[float, float, str]:
    """The prologue's and epilogue's part of :class:`GradientReduction`: bytes summed per row
    group and reduced once after the loop, of which reduce-scattered, and one line saying how
    and why."""
    from jaxpar._src.pipeline.groups import strip

    ends, axes = program.ends, program.groups.axes
    split = {i for i, _, _ in program.rest_scatters}
    total = scattered = 0.0
    for i in ends.grouped:
        v = program.graph.values[program.rest[i]]
        if not _from_inputs(program.graph, v.id):
            continue  # a constant's gradient is dead: XLA drops it
        spec = strip(program.spec(v.id), axes)
        nbytes = math.prod(spec.shard_shape(v.shape, mesh)) * v.nbytes / max(
            math.prod(v.shape), 1)
        total += nbytes
        scattered += nbytes if i in split else 0.0
    if ends.on:
        once = " + ".join(
            ([f"reduce-scatter (split as the optimizer state) of {_bytes(scattered)}"]
             if scattered else []) +
            ([f"all-reduce of {_bytes(total - scattered)}"] if total > scattered else []))
        how = (f"1 {once or 'all-reduce of 0 B'} over {'+'.join(axes)} per device after the "
               f"loop for those summed per group")
    elif ends.prologue and ends.epilogue:
        how = "none summed per group (no weight read there)"
    else:
        how = "inside the loop, per micro-batch"
    return total, scattered, (f"prologue/epilogue weight gradients: {how}; prologue: "
                              f"{ends.why_prologue}; epilogue: {ends.why_epilogue}")


def _from_inputs(graph: Any, vid: int) -> bool:
    """Whether value ``vid`` depends on an argument of the function (not only constants)."""
    from jaxpar._src.graph import Const, NodeKind

    seen, work = set(), [vid]
    while work:
        v = work.pop()
        if v in seen:
            continue
        seen.add(v)
        node = graph.nodes[graph.values[v].producer]
        if node.kind is NodeKind.INPUT:
            return True
        work.extend(o for o in node.inputs if not isinstance(o, Const))
    return False


def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _ms(s: float) -> str:
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"
