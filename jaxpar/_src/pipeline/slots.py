"""Buffer slots: where each stage keeps what waits between ticks, as tables the loop reads.

A stage keeps three kinds of values across ticks: activations that arrived for a forward it runs
later, cotangents that arrived (or that its own epilogue made) for a later backward, and the
residuals of a forward until its backward.  Each lives from the tick it is written to the tick it
is read; slots are allocated like registers (interval colouring, first free slot), so a buffer has
as many slots as values are alive at once: ``M`` residuals per stage under GPipe, ``O(S)`` under
1F1B.  Within a tick the order is: store arrivals, forward, backward; a slot freed by a read in
tick ``t`` is written again from tick ``t + 1`` on.

The loop indexes the tables by tick and by its own stage (``axis_index("pp")``); an idle entry
points at a scratch slot one past the end, so every write is unconditional.

>>> from jaxpar._src.pipeline.schedule import PipelineSchedule
>>> t = SlotTables.of(PipelineSchedule.build("gpipe", 2, 4))
>>> t.act_slots, t.res_slots, t.ct_slots
(1, 4, 4)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpar._src.pipeline.schedule import PipelineSchedule, Task

FIELDS = (
    # forward task: on, micro-batch, local chunk (c // S), first chunk, last chunk, the slot of
    # its input activation, of its residuals, of the cotangent its epilogue makes (last chunk)
    "f_on", "f_micro", "f_local", "f_first", "f_last", "f_in", "f_res", "f_ct",
    # backward task: on, micro-batch, local chunk, first chunk, residual slot, cotangent slot
    "b_on", "b_micro", "b_local", "b_first", "b_res", "b_ct",
    # arrivals stored at the start of the tick: activation slot, cotangent slot (or scratch)
    "recv_act", "recv_ct",
)


@dataclasses.dataclass(frozen=True, eq=False)
class SlotTables:
    """Per tick and stage, which task runs and which slots it touches (``int32 [T, S]`` each)."""

    schedule: PipelineSchedule
    act_slots: int
    res_slots: int
    ct_slots: int
    tables: dict[str, np.ndarray]

    @classmethod
    def of(cls, schedule: PipelineSchedule) -> SlotTables:
        S, C = schedule.stages, schedule.chunks
        T = schedule.num_ticks
        where = schedule.tasks()
        act_iv: list[tuple[int, int, int, tuple]] = []  # (stage, start, end, key)
        ct_iv: list[tuple[int, int, int, tuple]] = []
        res_iv: list[tuple[int, int, int, tuple]] = []
        for task, (t, s) in where.items():
            m, c = task.micro, task.chunk
            if task.kind == "F":
                if c > 0:
                    sent = where[Task("F", m, c - 1)][0]
                    act_iv.append((s, sent + 1, t, ("act", m, c)))
                if schedule.has_backward:
                    tb = where[Task("B", m, c)][0]
                    res_iv.append((s, t, tb, ("res", m, c)))
                    if c == C - 1:
                        ct_iv.append((s, t, tb, ("ct", m, c)))
            elif c < C - 1:
                sent = where[Task("B", m, c + 1)][0]
                ct_iv.append((s, sent + 1, t, ("ct", m, c)))
        act_of, act_n = _colour(act_iv, S)
        ct_of, ct_n = _colour(ct_iv, S)
        res_of, res_n = _colour(res_iv, S)
        tab = {name: np.zeros((T, S), np.int32) for name in FIELDS}
        # idle slot fields point one past the end (the scratch slot)
        for name in ("f_in", "recv_act"):
            tab[name][:] = act_n
        for name in ("f_ct", "b_ct", "recv_ct"):
            tab[name][:] = ct_n
        for name in ("f_res", "b_res"):
            tab[name][:] = res_n
        for task, (t, s) in where.items():
            m, c = task.micro, task.chunk
            if task.kind == "F":
                tab["f_on"][t, s] = 1
                tab["f_micro"][t, s] = m
                tab["f_local"][t, s] = c // S
                tab["f_first"][t, s] = c == 0
                tab["f_last"][t, s] = c == C - 1
                if c > 0:
                    tab["f_in"][t, s] = act_of[("act", m, c)]
                    sent = where[Task("F", m, c - 1)][0]
                    tab["recv_act"][sent + 1, s] = act_of[("act", m, c)]
                if schedule.has_backward:
                    tab["f_res"][t, s] = res_of[("res", m, c)]
                    if c == C - 1:
                        tab["f_ct"][t, s] = ct_of[("ct", m, c)]
            else:
                tab["b_on"][t, s] = 1
                tab["b_micro"][t, s] = m
                tab["b_local"][t, s] = c // S
                tab["b_first"][t, s] = c == 0
                tab["b_res"][t, s] = res_of[("res", m, c)]
                tab["b_ct"][t, s] = ct_of[("ct", m, c)]
                if c < C - 1:
                    sent = where[Task("B", m, c + 1)][0]
                    tab["recv_ct"][sent + 1, s] = ct_of[("ct", m, c)]
        return cls(schedule, act_n, res_n, ct_n, tab)

    def phases(self) -> tuple[tuple[int, int, bool, bool], ...]:
        """Runs of ticks with the same kinds of work: ``(start, stop, forward?, backward?)``.
        The loop compiles one scan per phase with only the code that phase needs (GPipe: a
        forward phase and a backward phase; 1F1B: warm-up, steady state, cool-down)."""
        f_any = np.count_nonzero(self.tables["f_on"], axis=1) > 0
        b_any = np.count_nonzero(self.tables["b_on"], axis=1) > 0
        out: list[tuple[int, int, bool, bool]] = []
        for t in range(self.schedule.num_ticks):
            key = (bool(f_any[t]), bool(b_any[t]))
            if out and (out[-1][2], out[-1][3]) == key:
                out[-1] = (out[-1][0], t + 1, *key)
            else:
                out.append((t, t + 1, *key))
        return tuple(out)


def _colour(intervals: list[tuple[int, int, int, tuple]], stages: int
            ) -> tuple[dict[tuple, int], int]:
    """First-fit slots per stage for inclusive tick intervals; the slot count is the largest
    over stages (every stage holds buffers of one shape: one SPMD program)."""
    slot_of: dict[tuple, int] = {}
    count = 0
    for s in range(stages):
        mine = sorted((start, end, key) for st, start, end, key in intervals if st == s)
        free_at: list[int] = []  # per slot, the last tick it is busy
        for start, end, key in mine:
            for k, busy in enumerate(free_at):
                if busy < start:
                    free_at[k] = end
                    slot_of[key] = k
                    break
            else:
                free_at.append(end)
                slot_of[key] = len(free_at) - 1
        count = max(count, len(free_at))
    return slot_of, count
