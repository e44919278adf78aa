"""``ShardingPlan``: what jaxpar decided, why, and what it expects to cost.

A plan holds, for every node of the traced graph, the layouts of its operands and results, where
that choice came from (a user pin, propagation, a search) and the collectives the cost model
predicts for it: the operator's own (partial sums to combine) and the layout changes on its input
edges.  Beside them it holds the program's collectives as XLA will run them, after its
combiners merged independent ones (``combine.py``): their count is what the compiled program
has, and the step time is priced from them.  It prints as a table
(:meth:`ShardingPlan.explain`) and round-trips through JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from jaxpar._src.combine import IssuedCollective
from jaxpar._src.cost import Collective
from jaxpar._src.spec import MeshShape, Spec

if TYPE_CHECKING:  # scatter.py reads plans
    from jaxpar._src.scatter import Scatter

USER_ORIGINS = frozenset({"in_strategy", "out_strategy", "shard", "data_parallel"})
# Listed by explain() besides anything that communicates: the categories of work worth seeing
# (the rules say which operators are contractions or gathers), and the user's own pins.
LISTED_CATEGORIES = frozenset({"contraction", "indexing"})


@dataclasses.dataclass(frozen=True)
class PredictedCollective:
    """A collective the cost model expects, per call of the program."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float  # payload per device (all-reduce size, gathered size, ...)
    wire_bytes: float  # bytes one device sends, times how often it runs
    time: float  # seconds, times how often it runs
    count: float  # how often it runs per call (loop trips)
    members: int = 1  # collectives XLA combined into this one
    deferred: bool = False  # off the critical path (gradients on their way to the optimizer)

    @classmethod
    def of(cls, c: Collective, weight: float) -> PredictedCollective:
        return cls(c.kind, c.axes, c.nbytes, c.wire_bytes * weight, c.time * weight, weight)

    @classmethod
    def issued(cls, c: IssuedCollective) -> PredictedCollective:
        return cls(c.kind, c.axes, c.nbytes, c.wire_bytes * c.count, c.time * c.count, c.count,
                   len(c.members), c.deferred)


@dataclasses.dataclass(frozen=True)
class Redistribution:
    """A layout change on an edge: the producer's result layout differs from what the consumer
    reads."""

    producer: int
    out_index: int
    consumer: int
    in_index: int
    src: Spec
    dst: Spec
    collectives: tuple[PredictedCollective, ...]


@dataclasses.dataclass(frozen=True)
class OpDecision:
    """The strategy of one node.

    >>> import jax.numpy as jnp, jaxpar
    >>> f = jaxpar.parallelize(lambda x, w: x @ w, mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=((2, 1), (1, 4)))
    >>> dot = f.plan(jnp.ones((8, 16)), jnp.ones((16, 32))).ops("dot_general")[0]
    >>> dot.strategy_str(), dot.origin
    ('[dp, -]·[-, mp] -> [dp, mp]', 'propagated')
    """

    node: int
    kind: str  # input, const, output, op, enter, exit, control
    name: str
    source: str
    label: str
    in_shapes: tuple[tuple[int, ...], ...]
    out_shapes: tuple[tuple[int, ...], ...]
    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    origin: str
    weight: float
    collectives: tuple[PredictedCollective, ...]
    redistributions: tuple[Redistribution, ...]
    flops: float = 0.0  # per device, times loop trips
    # For searched nodes: (compute s, own collectives s, layout changes to neighbours s), and
    # the best alternative (its layouts) with how much more it would cost, the rest fixed.
    terms: tuple[float, float, float] | None = None
    runner_up: tuple[tuple[Spec, ...], tuple[Spec, ...]] | None = None
    runner_up_extra_s: float = 0.0
    category: str = "other"  # of its rule: "contraction", "indexing" or "other"

    @classmethod
    def made(cls, node: int, kind: str, name: str, source: str, label: str,
             in_shapes: tuple[tuple[int, ...], ...], out_shapes: tuple[tuple[int, ...], ...],
             in_specs: tuple[Spec, ...], out_specs: tuple[Spec, ...], origin: str,
             weight: float, collectives: tuple[PredictedCollective, ...],
             redistributions: tuple[Redistribution, ...], flops: float = 0.0,
             terms: tuple[float, float, float] | None = None,
             runner_up: tuple[tuple[Spec, ...], tuple[Spec, ...]] | None = None,
             runner_up_extra_s: float = 0.0, category: str = "other") -> OpDecision:
        """The decision the constructor makes, its fields set at once: a frozen dataclass's
        constructor sets each of the 18 through ``object.__setattr__``, which was a third of
        making a plan's decisions (12,243 of them at 24 GPT layers: issue 14).

        >>> d = OpDecision.made(0, "input", "x", "", "x", (), ((4,),), (), (Spec(((),)),),
        ...                     "pinned", 1.0, (), ())
        >>> d == OpDecision(0, "input", "x", "", "x", (), ((4,),), (), (Spec(((),)),),
        ...                 "pinned", 1.0, (), ())
        True
        """
        decision = object.__new__(cls)
        decision.__dict__.update(
            node=node, kind=kind, name=name, source=source, label=label, in_shapes=in_shapes,
            out_shapes=out_shapes, in_specs=in_specs, out_specs=out_specs, origin=origin,
            weight=weight, collectives=collectives, redistributions=redistributions,
            flops=flops, terms=terms, runner_up=runner_up,
            runner_up_extra_s=runner_up_extra_s, category=category)
        return decision

    @property
    def comm_time(self) -> float:
        own = sum(c.time for c in self.collectives)
        return own + sum(c.time for r in self.redistributions for c in r.collectives)

    def runner_up_str(self) -> str:
        if self.runner_up is None:
            return ""
        ins, outs = self.runner_up
        body = "·".join(str(s) for s in ins) + " -> " + ",".join(str(s) for s in outs)
        if self.kind in ("input", "const"):
            body = ",".join(str(s) for s in outs)
        return f"{body} (+{_seconds(self.runner_up_extra_s)})"

    @property
    def comm_bytes(self) -> float:
        """Wire bytes per device of this node's own collectives and its input layout changes."""
        own = sum(c.wire_bytes for c in self.collectives)
        return own + sum(c.wire_bytes for r in self.redistributions for c in r.collectives)

    def strategy_str(self) -> str:
        ins = "·".join(str(s) for s in self.in_specs)
        outs = ",".join(str(s) for s in self.out_specs)
        if self.kind in ("input", "const"):
            return outs
        if self.kind == "output":
            return ins
        return f"{ins} -> {outs}" if ins else f"-> {outs}"


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Layouts for every node of a traced program, with predicted collectives.

    Use :meth:`explain` for a readable table, :meth:`to_json`/:meth:`from_json` or
    :meth:`save`/:meth:`load` to keep it.

    >>> import jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> f = jaxpar.parallelize(lambda x, w: x @ w, mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=((2, 1), (1, 4)))
    >>> plan = f.plan(jnp.ones((8, 16)), jnp.ones((16, 32)))
    >>> plan.output_layouts() == {"out": P("dp", "mp")}
    True
    >>> jaxpar.ShardingPlan.from_json(plan.to_json()) == plan
    True
    """

    mesh: MeshShape
    device_ids: tuple[int, ...]
    parallel_mode: str
    search_mode: str
    decisions: Sequence[OpDecision]  # by node id: a tuple (a loaded plan's: plan_json.py)
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    notes: tuple[str, ...] = ()
    hardware: str = "cpu"  # the HardwareProfile preset the costs were priced with
    flops_per_s: float = 5e10  # its per-device FLOP rate
    memory_bytes: float = 0.0  # estimated peak bytes per device
    memory_budget: float = 0.0  # the profile's memory_per_device
    search_s: float = 0.0  # wall seconds the search took
    objective_s: float | None = None  # the search's simulated seconds (auto_parallel)
    baseline_s: float | None = None  # pure data parallel's, under the same model
    optimal: bool | None = None  # proven optimal (search_mode="optimal")
    # The program's collectives as XLA runs them (after its combiners) and the step time they
    # make; empty / None in plans saved before they were recorded.
    collectives: tuple[PredictedCollective, ...] = ()
    compute_s: float | None = None
    step_s: float | None = None
    # The parallel optimizer's ZeRO level the plan was made for (0: off), and at levels 1-3
    # the contractions the program makes a split gradient with by reduce-scatter
    # (``scatter.py``: node -> how), found once when planning; ``decisions`` then hold the
    # layouts the program runs (the gradient split from its contraction on) and
    # ``collectives`` the reduce-scatters.
    optimizer_level: int = 0
    scatters: tuple[tuple[int, Scatter], ...] = ()
    # The pipeline the program runs (jaxpar.PipelineCell): split, schedule, timeline; not in
    # the JSON form (a strategy file describes layouts).
    pipeline: Any = dataclasses.field(default=None, compare=False)

    # -- views --------------------------------------------------------------------------------
    @property
    def input_specs(self) -> tuple[Spec, ...]:
        return tuple(self.decisions[n].out_specs[0] for n in self.inputs)

    @property
    def output_specs(self) -> tuple[Spec, ...]:
        return tuple(self.decisions[n].in_specs[0] for n in self.outputs)

    def input_layouts(self) -> dict[str, Any]:
        """``{argument path: PartitionSpec}`` for every flattened input."""
        return {self.decisions[n].label: self.decisions[n].out_specs[0].to_partition_spec()
                for n in self.inputs}

    def output_layouts(self) -> dict[str, Any]:
        return {self.decisions[n].label: self.decisions[n].in_specs[0].to_partition_spec()
                for n in self.outputs}

    def ops(self, name: str | None = None) -> tuple[OpDecision, ...]:
        """Decisions of primitive operators, optionally of one primitive."""
        return tuple(d for d in self.decisions
                     if d.kind == "op" and (name is None or d.name == name))

    def conflicts(self) -> tuple[Redistribution, ...]:
        """Every edge whose two ends disagree on the layout (the plan pays a layout change)."""
        return tuple(r for d in self.decisions for r in d.redistributions)

    def predicted_collectives(self, combined: bool = True) -> tuple[PredictedCollective, ...]:
        """The collectives the program runs: after XLA's combiners (one entry per collective of
        the compiled program), or with ``combined=False`` one per operator and layout change."""
        if combined and self.collectives:
            return self.collectives
        out = []
        for d in self.decisions:
            out.extend(d.collectives)
            for r in d.redistributions:
                out.extend(r.collectives)
        return tuple(out)

    def step_time(self) -> float:
        """Simulated seconds per call: every device's compute plus the communication it does
        not hide (all of it without overlap), collectives priced after combining."""
        if self.step_s is not None:
            return self.step_s
        compute = sum(d.flops for d in self.decisions) / self.flops_per_s
        return compute + sum(d.comm_time for d in self.decisions)

    def summary(self) -> dict[str, Any]:
        """Totals: predicted collectives per kind (after combining), memory, simulated step
        time (compute, communication, and how much of it compute does not hide), search."""
        comm = self.communication_summary()
        compute = self.compute_s if self.compute_s is not None else \
            sum(d.flops for d in self.decisions) / self.flops_per_s
        out = {
            "mesh": str(self.mesh), "parallel_mode": self.parallel_mode,
            "search_mode": self.search_mode, "hardware": self.hardware,
            "collectives": comm,
            "collective_wire_bytes": sum(v["wire_bytes"] for v in comm.values()),
            "memory_bytes_per_device": self.memory_bytes,
            "memory_budget_bytes": self.memory_budget,
            "compute_s": compute,
            "communication_s": sum(v["time"] for v in comm.values()),
            "exposed_communication_s": self.step_time() - compute,
            "step_time_s": self.step_time(), "search_s": self.search_s,
        }
        if self.objective_s is not None:
            out["objective_s"] = self.objective_s
        if self.baseline_s is not None:
            out["data_parallel_s"] = self.baseline_s
        if self.optimal is not None:
            out["proven_optimal"] = self.optimal
        recompute = tuple(n for n in self.notes if n.startswith(("recompute",
                                                                 "pipeline_residuals"))
                          or "(jaxpar.recompute)" in n)  # what is recomputed, and why
        if recompute:
            out["recompute"] = recompute
        return out

    def communication_summary(self) -> dict[str, dict[str, float]]:
        """Per collective kind, after XLA's combiners: how many run per call (what the compiled
        program has), the wire bytes per device and their seconds."""
        table: dict[str, dict[str, float]] = collections.defaultdict(
            lambda: {"count": 0.0, "wire_bytes": 0.0, "time": 0.0})
        for c in self.predicted_collectives():
            row = table[c.kind]
            row["count"] += c.count
            row["wire_bytes"] += c.wire_bytes
            row["time"] += c.time
        return dict(table)

    # -- presentation -------------------------------------------------------------------------
    def explain(self, verbose: bool = False) -> str:
        """A table: operator, source line, layouts, estimated communication, origin.

        By default it lists the heavy operators (contractions, gathers, reductions), user pins,
        split arguments the user fixed, and everything that communicates; a summary line counts
        the arguments and results.  ``verbose=True`` lists every node.
        """
        rows = []
        searched = any(d.terms is not None for d in self.decisions)
        for d in self.decisions:
            if d.kind == "control" or (d.kind == "const" and not verbose):
                continue
            pinned = d.origin in USER_ORIGINS
            if d.kind == "input":
                keep = pinned and not d.out_specs[0].is_replicated
            elif d.kind == "output":
                keep = False
            else:
                keep = (d.comm_bytes > 0 or d.category in LISTED_CATEGORIES or pinned
                        or d.name == "sharding_constraint")
            if not (keep or verbose):
                continue
            name = d.label if d.kind in ("input", "output") else (
                d.name if d.kind == "op" else f"{d.kind}:{d.name}")
            loop = f" x{d.weight:g}" if d.weight != 1 else ""
            row = [str(d.node), d.kind if d.kind != "op" else "", name,
                   d.source if d.kind not in ("input", "output") else "",
                   d.strategy_str(), _comm_str(d) + loop, d.origin]
            if searched:
                row += [_terms_str(d), d.runner_up_str()]
            rows.append(tuple(row))
        header = ("#", "kind", "operator", "source", "layout (mesh axes per dim)",
                  "comm/device (est.)", "origin")
        if searched:
            header += ("compute / comm / layout change", "runner-up (extra cost)")
        lines = [f"ShardingPlan on mesh {self.mesh}  mode={self.parallel_mode}  "
                 f"search={self.search_mode}"
                 + (f"  optimizer=level{self.optimizer_level}" if self.optimizer_level else "")]
        lines.append(_table([header] + rows))
        split_in = sum(not s.is_replicated for s in self.input_specs)
        split_out = sum(not s.is_replicated for s in self.output_specs)
        lines.append(f"arguments: {len(self.inputs)} arrays, {split_in} split "
                     f"(plan.input_layouts()); results: {len(self.outputs)} arrays, "
                     f"{split_out} split (plan.output_layouts())")
        summary = self.communication_summary()
        if summary:
            parts = [f"{k} x{v['count']:g} ({_bytes(v['wire_bytes'])})"
                     for k, v in sorted(summary.items())]
            lines.append("predicted collectives: " + ", ".join(parts))
        else:
            lines.append("predicted collectives: none")
        line = (f"simulated step time ({self.hardware}): {_seconds(self.step_time())}; "
                f"memory per device (est.): {_bytes(self.memory_bytes)}")
        if self.baseline_s is not None:
            line += f"; pure data parallel: {_seconds(self.baseline_s)}"
        lines.append(line)
        lines.extend(f"note: {n}" for n in self.notes)
        if self.pipeline is not None:
            lines.append(self.pipeline.explain())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    # -- reports (jaxpar/_src/report) -----------------------------------------------------------
    def report(self, path: str | os.PathLike | None = None, *, compiled: Any = None,
               other: ShardingPlan | None = None, title: str | None = None) -> Any:
        """A self-contained HTML report of this plan (a :class:`jaxpar.Report`).

        It shows the operator graph grouped by layer, source line or module path and coloured
        by layout, each layout as a device grid, the simulated step timeline, memory and FLOPs,
        the search's runner-ups, and, given the compiled program, every collective XLA inserted
        with its cause: the plan operators (and source lines) whose layouts made it.

        Args:
          path: where to write the page (``None``: only return the report).
          compiled: the compiled program, ``step.lower(*args).compile()`` (or its ``Lowered``,
            or HLO text): needed for the collectives and their causes.
            ``step.report(*args)`` compiles it for you.
          other: another plan to compare with (a "changes" section, see :meth:`diff`).
          title: the page title.

        >>> import jax.numpy as jnp
        >>> import jaxpar
        >>> f = jaxpar.parallelize(lambda x, w: x @ w, mesh=jaxpar.make_mesh((8,), ("dp",)),
        ...                        parallel_mode="data_parallel", batch_argnums=0)
        >>> r = f.plan(jnp.ones((16, 8)), jnp.ones((8, 4))).report()
        >>> r.html.startswith("<!DOCTYPE html>"), "Operator graph" in r.html
        (True, True)
        """
        from jaxpar._src.report.build import build_report

        return build_report(self, compiled=compiled, other=other, title=title, path=path)

    def diff(self, other: ShardingPlan) -> Any:
        """What changed from this plan to ``other``: settings, argument and operator layouts
        (repeated layers folded), predicted collectives and cost.  ``str()`` of the result is a
        text report; in a notebook it renders as tables."""
        from jaxpar._src.report.diff import diff_plans

        return diff_plans(self, other)

    def _repr_html_(self) -> str:
        return self.report().fragment

    # -- persistence --------------------------------------------------------------------------
    def to_json(self) -> str:
        from jaxpar._src.plan_json import plan_to_dict

        return json.dumps(plan_to_dict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        from jaxpar._src.plan_files import plan_from_json

        return plan_from_json(text)

    def save(self, path: str | os.PathLike) -> None:
        from jaxpar._src.plan_files import save_plan

        save_plan(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> ShardingPlan:
        from jaxpar._src.plan_files import load_plan

        return load_plan(path)


# -- formatting helpers -------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def _terms_str(d: OpDecision) -> str:
    if d.terms is None:
        return ""
    return " / ".join(_seconds(t) if t else "0" for t in d.terms)


def _comm_str(d: OpDecision) -> str:
    parts = [f"{c.kind} {'+'.join(c.axes)} {_bytes(c.nbytes)}" for c in d.collectives]
    for r in d.redistributions:
        parts.extend(f"{c.kind} {'+'.join(c.axes)} {_bytes(c.nbytes)} (in {r.in_index})"
                     for c in r.collectives)
    return "; ".join(parts) if parts else "-"


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
