"""Pipeline schedules as tick tables, and the timeline they give.

One SPMD program runs the pipeline in lock-step *ticks*: in each tick every stage runs at most one
forward (``F``) and at most one backward (``B``) task of one micro-batch through one chunk of
layers, then activations move one stage on and cotangents one stage back (``ppermute`` over
``"pp"``).  A schedule is the table ``tick x stage -> (F task, B task)``.  Chunk ``c`` of
``C = S * v`` runs on stage ``c % S``; with ``v > 1`` (interleave) a micro-batch goes round the
ring of stages ``v`` times.

The tables come from one list scheduler: each tick, each stage takes its most urgent *ready*
task (the activation or cotangent it needs arrived in an earlier tick).  The policies:

* ``gpipe``: every forward first (micro-batches in order, round by round: the circular pipeline
  of praxis and MaxText when ``v > 1``), then every backward in mirror order;
* ``1f1b``: a backward as soon as it is ready, in the same tick as a forward: after a warm-up of
  ``S - 1`` ticks each stage runs one forward and one backward per tick, so a stage holds the
  residuals of ``O(S)`` micro-batches instead of ``M``.  With ``v > 1`` forwards go in groups of
  ``S`` micro-batches per chunk (Megatron's interleaved order).
* ``forward``: the forwards alone (a loss that is not differentiated).

>>> s = PipelineSchedule.build("gpipe", stages=4, micro_batches=8)
>>> round(s.timeline().bubble_fraction, 4) == round(3 / (8 + 3), 4)
True
>>> print(PipelineSchedule.build("1f1b", stages=2, micro_batches=3).render())
tick    0 1 2 3 4
stage 0 F F X B B
stage 1 . X X X .
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpar._src.errors import ContextError

KINDS = ("gpipe", "1f1b", "forward")


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One forward or backward of micro-batch ``micro`` through chunk ``chunk``."""

    kind: str  # "F" | "B"
    micro: int
    chunk: int


Slot = tuple[Task | None, Task | None]  # one stage's (forward, backward) in one tick


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A lock-step pipeline schedule: ``ticks[t][s] = (forward task, backward task)``.

    Build one with :meth:`build`; :meth:`timeline` simulates it under per-task costs.

    >>> s = PipelineSchedule.build("1f1b", stages=4, micro_batches=16)
    >>> s.num_ticks, s.in_flight()  # lock-step 1F1B: stage s holds 2 (S - 1 - s) + 1
    (22, (7, 5, 3, 1))
    """

    kind: str
    stages: int
    micro_batches: int
    repeats: int
    ticks: tuple[tuple[Slot, ...], ...]

    @property
    def chunks(self) -> int:
        return self.stages * self.repeats

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    @property
    def has_backward(self) -> bool:
        return self.kind != "forward"

    @classmethod
    def build(cls, kind: str, stages: int, micro_batches: int, repeats: int = 1
              ) -> PipelineSchedule:
        """The table of schedule ``kind`` (``"gpipe"``, ``"1f1b"``, ``"forward"``).

        >>> PipelineSchedule.build("gpipe", 2, 2).num_ticks  # 3 forward ticks, 3 backward
        6
        """
        if kind not in KINDS:
            raise ContextError(f"jaxpar: pipeline schedule {kind!r} is not one of "
                               f"{list(KINDS)}.")
        if stages < 1 or micro_batches < 1 or repeats < 1:
            raise ContextError(f"jaxpar: a pipeline needs stages, micro_batches and repeats "
                               f">= 1, got {stages}, {micro_batches}, {repeats}.")
        if repeats > 1 and micro_batches < stages:
            raise ContextError(
                f"jaxpar: an interleaved pipeline needs at least as many micro-batches as "
                f"stages (a micro-batch must leave the last stage before the first stage "
                f"needs it again); got micro_batches={micro_batches}, stages={stages}. "
                f"Raise micro_batches or set pipeline_interleave=False.")
        ticks = _list_schedule(kind, stages, micro_batches, repeats)
        out = cls(kind, stages, micro_batches, repeats, ticks)
        out.validate()
        return out

    # -- checks ---------------------------------------------------------------------------------
    def tasks(self) -> dict[Task, tuple[int, int]]:
        """Every task with its ``(tick, stage)``."""
        out: dict[Task, tuple[int, int]] = {}
        for t, row in enumerate(self.ticks):
            for s, slot in enumerate(row):
                for task in slot:
                    if task is not None:
                        out[task] = (t, s)
        return out

    def validate(self) -> None:
        """Every task runs once, on its chunk's stage, after what it needs (an activation or
        cotangent sent in an earlier tick; the last chunk's backward may follow its forward
        in the same tick, the epilogue between them).  Raises ``AssertionError`` otherwise:
        a broken table is a jaxpar bug, not a user error."""
        S, C, M = self.stages, self.chunks, self.micro_batches
        where = self.tasks()
        kinds = ("F", "B") if self.has_backward else ("F",)
        want = {Task(k, m, c) for k in kinds for m in range(M) for c in range(C)}
        if set(where) != want:
            raise AssertionError(f"schedule {self.kind}: tasks missing or extra")
        for task, (t, s) in where.items():
            if s != task.chunk % S:
                raise AssertionError(f"{task} on stage {s}")
            if task.kind == "F" and task.chunk > 0:
                if where[Task("F", task.micro, task.chunk - 1)][0] >= t:
                    raise AssertionError(f"{task} before its input")
            if task.kind == "B":
                tf = where[Task("F", task.micro, task.chunk)][0]
                if tf > t or (tf == t and task.chunk != C - 1):
                    raise AssertionError(f"{task} before its forward")
                if task.chunk < C - 1 and where[Task("B", task.micro, task.chunk + 1)][0] >= t:
                    raise AssertionError(f"{task} before its cotangent")

    # -- views ----------------------------------------------------------------------------------
    def in_flight(self) -> tuple[int, ...]:
        """Per stage, the most micro-batch chunks whose forward ran and backward did not yet
        (the residuals a stage holds at once)."""
        if not self.has_backward:
            return (0,) * self.stages
        peak = [0] * self.stages
        live = [0] * self.stages
        for row in self.ticks:
            for s, (f, b) in enumerate(row):
                if f is not None:
                    live[s] += 1
                    peak[s] = max(peak[s], live[s])
                if b is not None:
                    live[s] -= 1
        return tuple(peak)

    def timeline(self, forward_cost: Sequence[float] | float | None = None,
                 backward_cost: Sequence[float] | float | None = None,
                 extra_first: float = 0.0, extra_last: float = 0.0,
                 tick_overhead: float = 0.0) -> Timeline:
        """The simulated timeline: each tick lasts as long as its busiest stage.

        Args:
          forward_cost: seconds of one chunk's forward, one per chunk or one for all
            (default ``1 / v``: a whole stage's forward is one unit).
          backward_cost: the same for a backward (default twice the forward).
          extra_first: seconds the first chunk adds to its forward (the prologue: embedding).
          extra_last: seconds the last chunk adds to its forward (the epilogue and its
            backward: head and loss).
          tick_overhead: seconds every tick adds (the ``ppermute`` of an activation).
        """
        C = self.chunks
        fc = _per_chunk(forward_cost, C, 1.0 / self.repeats)
        bc = _per_chunk(backward_cost, C, None) if backward_cost is not None else \
            tuple(2 * f for f in fc)
        work = []
        for row in self.ticks:
            line = []
            for f, b in row:
                w = 0.0
                if f is not None:
                    w += fc[f.chunk] + (extra_first if f.chunk == 0 else 0.0) + \
                        (extra_last if f.chunk == C - 1 else 0.0)
                if b is not None:
                    w += bc[b.chunk]
                line.append(w)
            work.append(tuple(line))
        seconds = tuple(max(line) + tick_overhead for line in work)
        return Timeline(self, seconds, tuple(work))

    def render(self) -> str:
        """One row per stage, one column per tick: ``F``, ``B``, ``X`` (both), ``.`` (idle)."""
        width = len(str(self.num_ticks - 1))
        head = "tick    " + " ".join(str(t).rjust(width) for t in range(self.num_ticks))
        rows = [head]
        for s in range(self.stages):
            cells = []
            for row in self.ticks:
                f, b = row[s]
                cells.append(("X" if f and b else "F" if f else "B" if b else ".").rjust(width))
            rows.append(f"stage {s} " + " ".join(cells))
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A schedule played under per-task costs: how long each tick lasts and what each stage
    does in it.

    >>> tl = PipelineSchedule.build("gpipe", stages=2, micro_batches=2).timeline(
    ...     forward_cost=[1.0, 3.0], backward_cost=[2.0, 6.0])
    >>> tl.tick_seconds, tl.total_s, round(tl.bubble_fraction, 3)
    ((1.0, 3.0, 3.0, 6.0, 6.0, 2.0), 21.0, 0.429)
    """

    schedule: PipelineSchedule
    tick_seconds: tuple[float, ...]
    work: tuple[tuple[float, ...], ...]  # [tick][stage] busy seconds

    @property
    def total_s(self) -> float:
        """Simulated seconds of one step through the pipeline."""
        return sum(self.tick_seconds)

    @property
    def busy_s(self) -> tuple[float, ...]:
        """Per stage, the seconds it computes."""
        return tuple(sum(line[s] for line in self.work) for s in range(self.schedule.stages))

    @property
    def bubble_fraction(self) -> float:
        """The share of stage-time spent idle: ``1 - busy / (stages * total)``."""
        total = self.total_s * self.schedule.stages
        return 0.0 if total == 0 else 1.0 - sum(self.busy_s) / total

    def summary(self) -> str:
        s = self.schedule
        return (f"{s.kind} schedule, {s.stages} stages x {s.micro_batches} micro-batches"
                f"{f' x {s.repeats} repeats' if s.repeats > 1 else ''}: {s.num_ticks} ticks, "
                f"bubble {self.bubble_fraction:.1%}, in flight per stage "
                f"{list(s.in_flight())}")


def _per_chunk(cost: Sequence[float] | float | None, chunks: int, default: float | None
               ) -> tuple[float, ...]:
    if cost is None:
        if default is None:
            raise ContextError("jaxpar: a cost per chunk is needed (no default here).")
        cost = default
    if isinstance(cost, (int, float)):
        return (float(cost),) * chunks
    cost = tuple(float(c) for c in cost)
    if len(cost) != chunks:
        raise ContextError(f"jaxpar: one cost per chunk ({chunks}) expected, got {len(cost)}.")
    return cost


def _list_schedule(kind: str, S: int, M: int, v: int) -> tuple[tuple[Slot, ...], ...]:
    """The list scheduler: per tick and stage, the most urgent ready forward and backward."""
    C = S * v

    def f_key(task: Task) -> tuple:
        r, m = divmod(task.chunk, S)[0], task.micro
        if kind == "1f1b" and v > 1:
            return (m // S, r, m)  # Megatron's interleaved order: S micro-batches per chunk
        return (r, m)

    def b_key(task: Task) -> tuple:
        r, m = v - 1 - task.chunk // S, task.micro
        if kind == "1f1b" and v > 1:
            return (m // S, r, m)
        return (r, m)

    forwards = [sorted((Task("F", m, c) for m in range(M) for c in range(s, C, S)), key=f_key)
                for s in range(S)]
    backwards = [sorted((Task("B", m, c) for m in range(M) for c in range(s, C, S)), key=b_key)
                 for s in range(S)] if kind != "forward" else [[] for _ in range(S)]
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    total_f = M * C
    ticks = []
    t = 0
    while any(forwards) or any(backwards):
        row = []
        all_forward_done = len(f_done) == total_f and max(f_done.values(), default=-1) < t
        for s in range(S):
            f = next((x for x in forwards[s] if x.chunk == 0 or
                      f_done.get((x.micro, x.chunk - 1), t) < t), None)
            if f is not None:
                forwards[s].remove(f)
            b = None
            if kind == "1f1b" or (kind == "gpipe" and all_forward_done):
                for x in backwards[s]:
                    tf = f_done.get((x.micro, x.chunk))
                    same = f is not None and (f.micro, f.chunk) == (x.micro, x.chunk)
                    fwd_ok = (tf is not None and tf < t) or (same and x.chunk == C - 1)
                    ct_ok = x.chunk == C - 1 or b_done.get((x.micro, x.chunk + 1), t) < t
                    if fwd_ok and ct_ok:
                        b = x
                        break
                if b is not None:
                    backwards[s].remove(b)
            row.append((f, b))
        for f, b in row:
            if f is not None:
                f_done[(f.micro, f.chunk)] = t
            if b is not None:
                b_done[(b.micro, b.chunk)] = t
        ticks.append(tuple(row))
        t += 1
        if t > 4 * (M * C + C) + 8:  # pragma: no cover - a scheduler bug, never user input
            raise AssertionError(f"schedule {kind} does not finish")
    return tuple(ticks)
