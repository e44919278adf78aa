"""Why each collective of a compiled program is there: its cause in the plan.

Every instruction of a program lowered from a plan names its plan node in its op metadata
(``jaxpar#<id>``, see :mod:`hlo_meta`).  A collective is then explained by the node(s) it names
and what the plan predicted there:

* ``predicted``: the node's layouts need this collective and the cost model priced it (the
  partial sums of a split contraction, or a layout change on one of its input edges);
* ``predicted differently``: the plan expected communication at that node, but of another kind
  or over other mesh axes (XLA found another way to move the same data);
* ``not predicted``: the node's layouts made XLA insert it, the cost model priced nothing there;
* ``XLA's own``: no plan node names it (the partitioner or a pass added it on its own).

Each predicted collective that no compiled collective names is listed too.
"""

from __future__ import annotations

import dataclasses
import re
import types
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar._src.hlo import CollectiveRecord, parse_collectives
from jaxpar._src.plan import (
    OpDecision,
    PredictedCollective,
    Redistribution,
    ShardingPlan,
    _bytes,
)
from jaxpar._src.report.hlo_meta import Frame, HloIndex, short_path

PREDICTED = "predicted"
DIFFERENT = "predicted differently"
UNPREDICTED = "not predicted"
XLA_OWN = "XLA's own"
STATUSES = (PREDICTED, DIFFERENT, UNPREDICTED, XLA_OWN)
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]")


@dataclasses.dataclass(frozen=True)
class Cause:
    """One plan node behind a compiled collective, and what the plan said about it."""

    node: int
    operator: str  # primitive (or pseudo-operator) name
    source: str  # the plan's "file.py:12 (fn)"
    reason: str  # "partial sums", "layout change", or "" (nothing predicted)
    detail: str  # e.g. "input 1: [mp, -] -> [-, -]"
    predicted: PredictedCollective | None = None
    redistribution: Redistribution | None = None

    def __str__(self) -> str:
        what = f"{self.operator} #{self.node} at {self.source}"
        return f"{what}: {self.reason} {self.detail}".rstrip(": ") if self.reason else what


@dataclasses.dataclass(frozen=True)
class CompiledCollective:
    """One collective instruction of the compiled program with its causes."""

    record: CollectiveRecord
    status: str  # one of STATUSES
    causes: tuple[Cause, ...]
    op_name: str
    location: str  # the user's source line the instruction's metadata points at ("" if none)

    @property
    def axes(self) -> str:
        r = self.record.axes
        return "+".join(r) if r else ("-" if r == () else "?")

    def cause_text(self) -> str:
        """One line: the operators and source lines, or why none."""
        if not self.causes:
            where = f" at {self.location}" if self.location else ""
            return (f"XLA's own: no plan operator names it (op_name {self.op_name or '?'}"
                    f"{where})")
        head = "; ".join(str(c) for c in self.causes[:3])
        more = len(self.causes) - 3
        return head + (f"; and {more} more" if more > 0 else "")


@dataclasses.dataclass(frozen=True)
class KindAxesRow:
    """Predicted against compiled collectives of one kind over one set of mesh axes."""

    kind: str
    axes: str
    predicted_count: float
    predicted_wire_bytes: float
    compiled_count: int  # executions per call
    compiled_instructions: int
    compiled_wire_bytes: float


@dataclasses.dataclass(frozen=True)
class CauseAnalysis:
    """Every compiled collective with its causes, and what was predicted but not compiled."""

    collectives: tuple[CompiledCollective, ...]
    absent: tuple[Cause, ...]  # predicted collectives no compiled one names
    rows: tuple[KindAxesRow, ...]
    mismatched_tags: int  # instructions naming a node that does not fit this plan

    def count(self, status: str) -> int:
        return sum(1 for c in self.collectives if c.status == status)

    def table(self) -> str:
        """A text table: one line per collective instruction with its cause."""
        if not self.collectives:
            return "compiled collectives: none"
        lines = ["compiled collectives and their causes:"]
        for c in self.collectives:
            r = c.record
            times = f" x{r.count}" if r.count != 1 else ""
            lines.append(f"  {r.kind} {c.axes} {_bytes(r.nbytes)}{times} [{r.name}] "
                         f"{c.status}: {c.cause_text()}")
        if self.absent:
            lines.append(f"predicted but not in the compiled program: {len(self.absent)} "
                         f"(e.g. {self.absent[0]})")
        return "\n".join(lines)


def analyse(plan: ShardingPlan, hlo_text: str, index: HloIndex | None = None) -> CauseAnalysis:
    """Matches the collectives of ``hlo_text`` (compiled from ``plan``) to the plan's nodes.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jaxpar
    >>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    >>> f = jaxpar.parallelize(lambda x, w: x @ w, mesh=mesh, parallel_mode="semi_auto_parallel",
    ...                        in_strategy=(P("dp", "mp"), P("mp", None)))
    >>> x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
    >>> found = analyse(f.plan(x, w), f.lower(x, w).compile().as_text())
    >>> [(c.status, c.causes[0].operator, c.causes[0].reason) for c in found.collectives]
    [('predicted', 'dot_general', 'partial sums')]
    """
    index = index if index is not None else HloIndex(hlo_text)
    records = parse_collectives(hlo_text, _mesh_like(plan))
    named: set[int] = set()
    out = []
    mismatched = 0
    n = len(plan.decisions)
    for rec in records:
        meta = index.metadata(rec.name)
        op_name = meta.op_name if meta is not None else ""
        location = _user_frame(meta.frames) if meta is not None else ""
        tags = [t for t in index.tags(rec.name) if t < n]
        mismatched += len(index.tags(rec.name)) - len(tags)
        causes = [_cause(plan.decisions[t], rec) for t in tags]
        named.update(tags)
        out.append(CompiledCollective(rec, _status(causes, rec), tuple(causes), op_name,
                                      location))
    absent = []
    for d in plan.decisions:
        if d.node in named:
            continue
        for c in d.collectives:
            if c.wire_bytes > 0:
                absent.append(Cause(d.node, d.name, d.source, "partial sums",
                                    _pred_str(c), predicted=c))
        for r in d.redistributions:
            for c in r.collectives:
                if c.wire_bytes > 0:
                    absent.append(Cause(d.node, d.name, d.source, "layout change",
                                        f"{_redist_str(r)} ({_pred_str(c)})", predicted=c,
                                        redistribution=r))
    return CauseAnalysis(tuple(out), tuple(absent), _rows(plan, records), mismatched)


def _cause(d: OpDecision, rec: CollectiveRecord) -> Cause:
    """What the plan predicted at node ``d`` that best explains ``rec``."""
    options: list[tuple[PredictedCollective, Redistribution | None]] = [
        (c, None) for c in d.collectives if c.wire_bytes > 0]
    options += [(c, r) for r in d.redistributions for c in r.collectives if c.wire_bytes > 0]
    if not options:
        return Cause(d.node, d.name, d.source, "", "")
    axes = set(rec.axes) if rec.axes is not None else None

    def score(option: tuple[PredictedCollective, Redistribution | None]) -> int:
        c = option[0]
        return 2 * (c.kind == rec.kind) + (axes is not None and set(c.axes) == axes)

    best, redist = max(options, key=score)
    if redist is None:
        return Cause(d.node, d.name, d.source, "partial sums", _pred_str(best), predicted=best)
    return Cause(d.node, d.name, d.source, "layout change",
                 f"{_redist_str(redist)} ({_pred_str(best)})", predicted=best,
                 redistribution=redist)


def _status(causes: Sequence[Cause], rec: CollectiveRecord) -> str:
    if not causes:
        return XLA_OWN
    predicted = [c.predicted for c in causes if c.predicted is not None]
    if not predicted:
        return UNPREDICTED
    axes = set(rec.axes) if rec.axes is not None else None
    for p in predicted:
        if p.kind == rec.kind and (axes is None or set(p.axes) == axes):
            return PREDICTED
    return DIFFERENT


def _rows(plan: ShardingPlan, records: Sequence[CollectiveRecord]) -> tuple[KindAxesRow, ...]:
    table: dict[tuple[str, str], list[float]] = {}
    for c in plan.predicted_collectives():
        if c.wire_bytes <= 0:
            continue
        row = table.setdefault((c.kind, _axes_key(c.axes, plan)), [0.0] * 5)
        row[0] += c.count
        row[1] += c.wire_bytes
    for r in records:
        key = (r.kind, _axes_key(r.axes, plan) if r.axes is not None else "?")
        row = table.setdefault(key, [0.0] * 5)
        row[2] += r.count
        row[3] += 1
        row[4] += r.wire_bytes * r.count
    return tuple(KindAxesRow(k, a, v[0], v[1], int(v[2]), int(v[3]), v[4])
                 for (k, a), v in sorted(table.items()))


def _axes_key(axes: Sequence[str], plan: ShardingPlan) -> str:
    order = {a: i for i, a in enumerate(plan.mesh.names)}
    return "+".join(sorted(axes, key=lambda a: order.get(a, len(order)))) or "-"


def _mesh_like(plan: ShardingPlan) -> Any:
    """What ``parse_collectives`` needs of a mesh to name axes: names and a device grid."""
    return types.SimpleNamespace(axis_names=plan.mesh.names,
                                 devices=np.empty(plan.mesh.sizes, dtype=object))


def _user_frame(frames: Sequence[Frame]) -> str:
    own = [f for f in frames if not _LIBRARY.search(f.file)]
    if not (own or frames):
        return ""
    f = (own or frames)[0]
    return f"{short_path(f.file)}:{f.line} ({f.function})"


def _pred_str(c: PredictedCollective) -> str:
    times = f" x{c.count:g}" if c.count != 1 else ""
    return f"{c.kind} over {'+'.join(c.axes)}, {_bytes(c.nbytes)}{times}"


def _redist_str(r: Redistribution) -> str:
    return f"input {r.in_index} from #{r.producer}: {r.src} -> {r.dst}"
