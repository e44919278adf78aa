"""``ShardingPlan``: what jaxpar decided, why, and what it expects to cost.

A plan holds, for every node of the traced graph, the layouts of its operands and results, where
that choice came from (a user pin, propagation, a search) and the collectives the cost model
predicts for it: the operator's own (partial sums to combine) and the layout changes on its input
edges.  It prints as a table (:meth:`ShardingPlan.explain`) and round-trips through JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

from jaxpar._src.cost import Collective, CostModel
from jaxpar._src.graph import Const, OpGraph
from jaxpar._src.search.common import Assignment, SearchSpace
from jaxpar._src.spec import MeshShape, Spec

FORMAT = "jaxpar.plan/1"
USER_ORIGINS = frozenset({"in_strategy", "out_strategy", "shard", "data_parallel"})
HEAVY = frozenset({"dot_general", "conv_general_dilated", "gather", "scatter-add", "scatter",
                   "sharding_constraint"})


@dataclasses.dataclass(frozen=True)
class PredictedCollective:
    """A collective the cost model expects, per call of the program."""

    kind: str
    axes: tuple[str, ...]
    nbytes: float  # payload per device (all-reduce size, gathered size, ...)
    wire_bytes: float  # bytes one device sends, times how often it runs
    time: float  # seconds, times how often it runs
    count: float  # how often it runs per call (loop trips)

    @classmethod
    def of(cls, c: Collective, weight: float) -> PredictedCollective:
        return cls(c.kind, c.axes, c.nbytes, c.wire_bytes * weight, c.time * weight, weight)


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
    """The strategy of one node."""

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
    """

    mesh: MeshShape
    device_ids: tuple[int, ...]
    parallel_mode: str
    search_mode: str
    decisions: tuple[OpDecision, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    notes: tuple[str, ...] = ()

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

    def predicted_collectives(self) -> tuple[PredictedCollective, ...]:
        out = []
        for d in self.decisions:
            out.extend(d.collectives)
            for r in d.redistributions:
                out.extend(r.collectives)
        return tuple(out)

    def communication_summary(self) -> dict[str, dict[str, float]]:
        """Per collective kind: how many run per call and the wire bytes per device."""
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
        for d in self.decisions:
            if d.kind == "control" or (d.kind == "const" and not verbose):
                continue
            pinned = d.origin in USER_ORIGINS
            if d.kind == "input":
                keep = pinned and not d.out_specs[0].is_replicated
            elif d.kind == "output":
                keep = False
            else:
                keep = d.comm_bytes > 0 or d.name in HEAVY or pinned
            if not (keep or verbose):
                continue
            name = d.label if d.kind in ("input", "output") else (
                d.name if d.kind == "op" else f"{d.kind}:{d.name}")
            loop = f" x{d.weight:g}" if d.weight != 1 else ""
            rows.append((str(d.node), d.kind if d.kind != "op" else "", name,
                         d.source if d.kind not in ("input", "output") else "",
                         d.strategy_str(), _comm_str(d) + loop, d.origin))
        header = ("#", "kind", "operator", "source", "layout (mesh axes per dim)",
                  "comm/device (est.)", "origin")
        lines = [f"ShardingPlan on mesh {self.mesh}  mode={self.parallel_mode}  "
                 f"search={self.search_mode}"]
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
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    # -- persistence --------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(_plan_to_dict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        return _plan_from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ShardingPlan:
        with open(path) as f:
            return cls.from_json(f.read())


def make_plan(graph: OpGraph, assignment: Assignment, space: SearchSpace, *, device_ids:
              Sequence[int], parallel_mode: str, search_mode: str,
              notes: Iterable[str] = ()) -> ShardingPlan:
    """Assembles a plan from a search's assignment, pricing every node and edge."""
    model: CostModel = space.model
    strategies = assignment.strategies
    decisions = []
    for node in graph.nodes:
        in_shapes = tuple(graph.operand_shape(o) for o in node.inputs)
        out_shapes = tuple(graph.values[v].shape for v in node.outputs)
        if node.kind == "control":
            decisions.append(OpDecision(node.id, "control", node.name, node.source, "",
                                        in_shapes, out_shapes, (), (), "", node.weight, (), ()))
            continue
        strat = strategies[node.id]
        own = model.op_collectives(strat, out_shapes,
                                   [graph.values[v].dtype for v in node.outputs])
        redists = []
        for i, operand in enumerate(node.inputs):
            if isinstance(operand, Const):
                continue
            value = graph.values[operand]
            producer = value.producer
            src = strategies[producer].out_specs[value.index]
            dst = strat.in_specs[i]
            if src == dst or producer == node.id:
                continue
            w = space.edge_weight(producer, node.id)
            colls = model.redistribution(src, dst, value.shape, value.dtype)
            redists.append(Redistribution(producer, value.index, node.id, i, src, dst,
                                          tuple(PredictedCollective.of(c, w) for c in colls)))
        decisions.append(OpDecision(
            node.id, node.kind, node.name, node.source, node.label, in_shapes, out_shapes,
            strat.in_specs, strat.out_specs, assignment.origins.get(node.id, ""),
            node.weight, tuple(PredictedCollective.of(c, node.weight) for c in own),
            tuple(redists)))
    unreached = sum(1 for o in assignment.origins.values() if o == "unreached")
    notes = list(notes)
    if unreached:
        notes.append(f"{unreached} nodes were not reached by propagation and stay replicated")
    return ShardingPlan(model.mesh, tuple(int(i) for i in device_ids), parallel_mode,
                        search_mode, tuple(decisions), graph.inputs, graph.outputs, tuple(notes))


# -- formatting helpers -------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


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


# -- JSON ---------------------------------------------------------------------------------------
def _coll_to(c: PredictedCollective) -> dict:
    return dataclasses.asdict(c) | {"axes": list(c.axes)}


def _coll_from(d: dict) -> PredictedCollective:
    return PredictedCollective(d["kind"], tuple(d["axes"]), d["nbytes"], d["wire_bytes"],
                               d["time"], d["count"])


def _plan_to_dict(plan: ShardingPlan) -> dict:
    decisions = []
    for d in plan.decisions:
        decisions.append({
            "node": d.node, "kind": d.kind, "name": d.name, "source": d.source,
            "label": d.label, "in_shapes": [list(s) for s in d.in_shapes],
            "out_shapes": [list(s) for s in d.out_shapes],
            "in_specs": [s.to_json() for s in d.in_specs],
            "out_specs": [s.to_json() for s in d.out_specs], "origin": d.origin,
            "weight": d.weight, "collectives": [_coll_to(c) for c in d.collectives],
            "redistributions": [{
                "producer": r.producer, "out_index": r.out_index, "consumer": r.consumer,
                "in_index": r.in_index, "src": r.src.to_json(), "dst": r.dst.to_json(),
                "collectives": [_coll_to(c) for c in r.collectives]} for r in d.redistributions],
        })
    return {"format": FORMAT, "mesh": {"names": list(plan.mesh.names),
                                       "sizes": list(plan.mesh.sizes)},
            "device_ids": list(plan.device_ids), "parallel_mode": plan.parallel_mode,
            "search_mode": plan.search_mode, "inputs": list(plan.inputs),
            "outputs": list(plan.outputs), "notes": list(plan.notes), "decisions": decisions}


def _plan_from_dict(data: dict) -> ShardingPlan:
    from jaxpar._src.errors import PlanError

    if data.get("format") != FORMAT:
        raise PlanError(f"jaxpar: not a plan file of format {FORMAT!r} "
                        f"(found {data.get('format')!r}).")
    decisions = []
    for d in data["decisions"]:
        decisions.append(OpDecision(
            d["node"], d["kind"], d["name"], d["source"], d["label"],
            tuple(tuple(s) for s in d["in_shapes"]), tuple(tuple(s) for s in d["out_shapes"]),
            tuple(Spec.from_json(s) for s in d["in_specs"]),
            tuple(Spec.from_json(s) for s in d["out_specs"]), d["origin"], d["weight"],
            tuple(_coll_from(c) for c in d["collectives"]),
            tuple(Redistribution(r["producer"], r["out_index"], r["consumer"], r["in_index"],
                                 Spec.from_json(r["src"]), Spec.from_json(r["dst"]),
                                 tuple(_coll_from(c) for c in r["collectives"]))
                  for r in d["redistributions"])))
    mesh = MeshShape(tuple(data["mesh"]["names"]), tuple(data["mesh"]["sizes"]))
    return ShardingPlan(mesh, tuple(data["device_ids"]), data["parallel_mode"],
                        data["search_mode"], tuple(decisions), tuple(data["inputs"]),
                        tuple(data["outputs"]), tuple(data["notes"]))
