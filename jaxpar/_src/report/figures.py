"""The report's pictures, from a plan's data: step timeline, memory bars, layout colours."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jaxpar._src.plan import ShardingPlan, _bytes, _seconds
from jaxpar._src.report import svg
from jaxpar._src.spec import Spec

KIND_COLORS = {"all-reduce": "#e15759", "all-gather": "#f28e2b", "reduce-scatter": "#59a14f",
               "all-to-all": "#b07aa1", "collective-permute": "#9c755f"}


@dataclasses.dataclass(frozen=True)
class LayoutTable:
    """Every distinct layout of a plan, most used first, with its colour; and per node the
    indices of its operands' and results' layouts."""

    specs: tuple[Spec, ...]
    counts: tuple[int, ...]  # operands and results with that layout
    colors: tuple[str, ...]  # grey for whole tensors, the palette by frequency else
    ins: tuple[tuple[int, ...], ...]  # per decision
    outs: tuple[tuple[int, ...], ...]


def layout_table(plan: ShardingPlan) -> LayoutTable:
    """One pass over the plan (a 24-layer model has forty thousand layouts to count)."""
    ids: dict[Spec, int] = {}
    counts: list[int] = []
    ins: list[list[int]] = []
    outs: list[list[int]] = []
    for d in plan.decisions:
        for specs, out in ((d.in_specs, ins), (d.out_specs, outs)):
            row = []
            for spec in specs:
                k = ids.get(spec)
                if k is None:
                    k = ids[spec] = len(counts)
                    counts.append(0)
                counts[k] += 1
                row.append(k)
            out.append(row)
    first = list(ids)
    rank = sorted(range(len(first)), key=lambda k: -counts[k])
    new = [0] * len(first)
    for r, k in enumerate(rank):
        new[k] = r
    colors, k = [], 0
    for old in rank:
        if first[old].is_replicated:
            colors.append(svg.REPLICATED)
        else:
            colors.append(svg.color(k))
            k += 1
    return LayoutTable(tuple(first[i] for i in rank), tuple(counts[i] for i in rank),
                       tuple(colors), tuple(tuple(new[i] for i in row) for row in ins),
                       tuple(tuple(new[i] for i in row) for row in outs))


def step_timeline(plan: ShardingPlan, contexts: Sequence = ()) -> str:
    """The simulated step: every node's compute, then its collectives, one after another (the
    cost model's serial schedule), on a compute lane and one lane per set of mesh axes."""
    order = {a: i for i, a in enumerate(plan.mesh.names)}
    lanes = ["compute"]
    lane_of: dict[str, int] = {}
    segments = []
    t = 0.0
    for d in plan.decisions:
        where = contexts[d.node].location if contexts else d.source
        if d.flops:
            dt = d.flops / plan.flops_per_s
            segments.append((0, t, dt, svg.COMPUTE, f"{d.name} #{d.node} {where}"))
            t += dt
        colls = [(c, "") for c in d.collectives]
        colls += [(c, f" (input {r.in_index} {r.src} -> {r.dst})")
                  for r in d.redistributions for c in r.collectives]
        for c, note in colls:
            if c.time <= 0:
                continue
            axes = "+".join(sorted(c.axes, key=lambda a: order.get(a, 99))) or "-"
            if axes not in lane_of:
                lane_of[axes] = len(lanes)
                lanes.append(axes)
            segments.append((lane_of[axes], t, c.time, KIND_COLORS.get(c.kind, "#777"),
                             f"{c.kind} over {axes}, {_bytes(c.nbytes)}: {_seconds(c.time)} — "
                             f"{d.name} #{d.node} {where}{note}"))
            t += c.time
    # lanes after compute in mesh order
    ranked = sorted(lanes[1:], key=lambda a: [order.get(x, 99) for x in a.split("+")])
    remap = {lane_of[a]: i + 1 for i, a in enumerate(ranked)}
    segments = [(remap.get(lane, lane), s, dt, f, tip) for lane, s, dt, f, tip in segments]
    return svg.timeline(["compute"] + [f"{a} axis" for a in ranked], segments, t, _seconds)


def memory_bars(plan: ShardingPlan, compiled: Mapping[str, int] | None) -> str:
    """Per-device memory: the plan's estimate beside what XLA allocated (when compiled)."""
    rows = [("plan (estimate)", [("peak live bytes", plan.memory_bytes, "#4e79a7")])]
    if compiled is not None:
        rows.append(("compiled (XLA)", [
            ("arguments", compiled["argument"], "#76b7b2"),
            ("outputs not aliased", max(compiled["output"] - compiled["alias"], 0), "#59a14f"),
            ("temporaries", compiled["temp"], "#edc948")]))
    marker = ("memory_per_device", plan.memory_budget) if plan.memory_budget else None
    parts = [(part, fill) for _, row in rows for part, _, fill in row]
    return svg.stacked_bars(rows, _bytes, marker=marker) + f"<div>{svg.legend(parts)}</div>"


def kind_legend() -> str:
    return svg.legend([("compute", svg.COMPUTE)] + list(KIND_COLORS.items()))
