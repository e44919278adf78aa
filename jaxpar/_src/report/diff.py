"""``plan.diff(other)``: what changed between two plans: layouts, collectives, cost.

Nodes are matched by id when both plans come from the same traced program (same operators in
the same order), else by the order in which each (operator, source line, shapes) occurs.  Changes
that repeat in every layer are folded into one line with a count.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxpar._src.plan import OpDecision, ShardingPlan, _bytes, _seconds
from jaxpar._src.report.svg import esc

TEXT_ROWS = 12  # operator changes listed in the text form
HTML_ROWS = 300  # and in the report

@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """One node's layouts in each plan (repeats across layers folded: ``count``)."""

    kind: str
    name: str  # operator, or the argument / result path
    source: str
    before: str
    after: str
    count: int = 1


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """The differences between plan ``a`` and plan ``b``; ``str()`` is a text report.

    >>> import jax.numpy as jnp
    >>> import jaxpar
    >>> mesh = jaxpar.make_mesh((8,), ("dp",))
    >>> f = lambda x, w: x @ w
    >>> x, w = jnp.ones((16, 8)), jnp.ones((8, 8))
    >>> a = jaxpar.parallelize(f, mesh=mesh, parallel_mode="data_parallel",
    ...                        batch_argnums=0).plan(x, w)
    >>> b = jaxpar.parallelize(f, mesh=mesh, parallel_mode="semi_auto_parallel",
    ...                        in_strategy=((1, 1), (1, 8))).plan(x, w)
    >>> d = a.diff(b)
    >>> [(c.name, c.before, c.after) for c in d.arguments]
    [('x', '[dp, -]', '[-, -]'), ('w', '[-, -]', '[-, dp]')]
    """

    settings: tuple[tuple[str, str, str], ...]  # (field, a, b) that differ
    aligned_by: str  # "node id" or "operator order"
    nodes: int  # nodes compared
    unmatched: tuple[int, int]  # nodes only in a, only in b
    arguments: tuple[LayoutChange, ...]
    results: tuple[LayoutChange, ...]
    operators: tuple[LayoutChange, ...]  # folded
    changed_operators: int  # before folding
    collectives: tuple[tuple[str, str, float, float, float, float], ...]  # kind, axes, n, B, n, B
    costs: tuple[tuple[str, float, float], ...]  # metric, a, b (seconds or bytes)

    @property
    def same(self) -> bool:
        return not (self.settings or self.arguments or self.results or self.operators
                    or any(r[2] != r[4] or r[3] != r[5] for r in self.collectives))

    def __str__(self) -> str:
        lines = ["plan diff (a -> b)"]
        lines += [f"  {k}: {a} -> {b}" for k, a, b in self.settings]
        if self.same:
            lines.append("  no differences in layouts, collectives or settings")
        for title, items in (("arguments", self.arguments), ("results", self.results)):
            if items:
                lines.append(f"{title}: {len(items)} changed")
                lines += [f"  {c.name}: {c.before} -> {c.after}" for c in items]
        if self.operators:
            lines.append(f"operators: {self.changed_operators} of {self.nodes} nodes changed "
                         f"layout (matched by {self.aligned_by})")
            lines += [f"  {c.name} {c.source}{f' x{c.count}' if c.count > 1 else ''}: "
                      f"{c.before}  =>  {c.after}" for c in self.operators[:TEXT_ROWS]]
            if len(self.operators) > TEXT_ROWS:
                lines.append(f"  ... and {len(self.operators) - TEXT_ROWS} more kinds of change "
                             f"(all of them: .operators, or the report)")
        if any(self.unmatched):
            lines.append(f"unmatched nodes: {self.unmatched[0]} only in a, "
                         f"{self.unmatched[1]} only in b")
        if self.collectives:
            lines.append("predicted collectives per call (count, wire bytes per device):")
            lines += [f"  {k} over {ax}: {na:g} ({_bytes(ba)}) -> {nb:g} ({_bytes(bb)})"
                      for k, ax, na, ba, nb, bb in self.collectives]
        lines.append("cost:")
        for metric, a, b in self.costs:
            fmt = _bytes if "memory" in metric else _seconds
            change = f" ({(b / a - 1) * 100:+.0f}%)" if a else ""
            lines.append(f"  {metric}: {fmt(a)} -> {fmt(b)}{change}")
        return "\n".join(lines)

    def to_html(self) -> str:
        """The differences as an HTML fragment (also a report section)."""
        parts = []
        if self.settings:
            parts.append("<p>" + "; ".join(f"{esc(k)}: <b>{esc(a)}</b> → <b>{esc(b)}</b>"
                                           for k, a, b in self.settings) + "</p>")
        rows = "".join(f"<tr><td>{esc(m)}</td><td class=num>{esc(_fmt(m, a))}</td>"
                       f"<td class=num>{esc(_fmt(m, b))}</td><td class=num>"
                       f"{(b / a - 1) * 100:+.0f}%</td></tr>" if a else
                       f"<tr><td>{esc(m)}</td><td class=num>{esc(_fmt(m, a))}</td>"
                       f"<td class=num>{esc(_fmt(m, b))}</td><td></td></tr>"
                       for m, a, b in self.costs)
        parts.append(f"<table><tr><th>cost</th><th>a</th><th>b</th><th>change</th></tr>{rows}"
                     "</table>")
        if self.collectives:
            rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(ax)}</td><td class=num>{na:g} "
                           f"({esc(_bytes(ba))})</td><td class=num>{nb:g} ({esc(_bytes(bb))})"
                           f"</td></tr>" for k, ax, na, ba, nb, bb in self.collectives)
            parts.append("<table><tr><th>collective</th><th>axes</th><th>a: runs (wire)</th>"
                         f"<th>b: runs (wire)</th></tr>{rows}</table>")
        changes = [("argument", c) for c in self.arguments]
        changes += [("result", c) for c in self.results]
        changes += [("operator", c) for c in self.operators[:HTML_ROWS]]
        if changes:
            rows = "".join(f"<tr><td>{esc(what)}</td><td>{esc(c.name)}</td><td><code>"
                           f"{esc(c.source)}</code></td><td class=num>{c.count}</td><td><code>"
                           f"{esc(c.before)}</code></td><td><code>{esc(c.after)}</code></td></tr>"
                           for what, c in changes)
            parts.append(f"<p>{self.changed_operators} of {self.nodes} operator nodes changed "
                         f"layout (matched by {esc(self.aligned_by)}).</p><table><tr><th></th>"
                         "<th>name</th><th>source</th><th>nodes</th><th>a</th><th>b</th></tr>"
                         f"{rows}</table>")
        else:
            parts.append("<p>No layout changed.</p>")
        return "".join(parts)

    def _repr_html_(self) -> str:
        return f'<div class="jxr-diff">{self.to_html()}</div>'


def _fmt(metric: str, v: float) -> str:
    return _bytes(v) if "memory" in metric else _seconds(v)


def diff_plans(a: ShardingPlan, b: ShardingPlan) -> PlanDiff:
    """See :class:`PlanDiff`."""
    settings = tuple((k, str(getattr(a, k)), str(getattr(b, k)))
                     for k in ("mesh", "parallel_mode", "search_mode", "hardware",
                               "optimizer_level")
                     if str(getattr(a, k)) != str(getattr(b, k)))
    pairs, aligned_by, unmatched = _align(a.decisions, b.decisions)
    arguments, results = [], []
    ops: collections.Counter[tuple[str, str, str, str, str]] = collections.Counter()
    changed = 0
    for da, db in pairs:
        before, after = da.strategy_str(), db.strategy_str()
        if before == after:
            continue
        kind = str(getattr(da.kind, "value", da.kind))
        if kind == "input":
            arguments.append(LayoutChange(kind, da.label, "", before, after))
        elif kind == "output":
            results.append(LayoutChange(kind, da.label, "", before, after))
        elif kind != "control":
            changed += 1
            ops[(kind, da.name, da.source, before, after)] += 1
    folded = tuple(LayoutChange(k, n, s, x, y, c) for (k, n, s, x, y), c in
                   sorted(ops.items(), key=lambda kv: -kv[1]))
    return PlanDiff(settings, aligned_by, len(pairs), unmatched, tuple(arguments),
                    tuple(results), folded, changed, _collectives(a, b), _costs(a, b))


def _align(a: Sequence[OpDecision], b: Sequence[OpDecision]
           ) -> tuple[list[tuple[OpDecision, OpDecision]], str, tuple[int, int]]:
    if len(a) == len(b) and all(x.name == y.name and x.kind == y.kind and
                                x.in_shapes == y.in_shapes for x, y in zip(a, b, strict=True)):
        return list(zip(a, b, strict=True)), "node id", (0, 0)

    def key(d: OpDecision) -> tuple:
        return (str(d.kind), d.name, d.source, d.label, d.in_shapes, d.out_shapes)

    seen: dict[tuple, list[OpDecision]] = collections.defaultdict(list)
    for d in b:
        seen[key(d)].append(d)
    used: dict[tuple, int] = collections.defaultdict(int)
    pairs = []
    for d in a:
        k = key(d)
        if used[k] < len(seen[k]):
            pairs.append((d, seen[k][used[k]]))
            used[k] += 1
    return pairs, "operator order", (len(a) - len(pairs), len(b) - len(pairs))


def _collectives(a: ShardingPlan, b: ShardingPlan
                 ) -> tuple[tuple[str, str, float, float, float, float], ...]:
    table: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0] * 4)
    for k, plan in enumerate((a, b)):
        for c in plan.predicted_collectives():
            if c.wire_bytes <= 0:
                continue
            row = table[(c.kind, "+".join(c.axes))]
            row[2 * k] += c.count
            row[2 * k + 1] += c.wire_bytes
    return tuple((k, ax, v[0], v[1], v[2], v[3]) for (k, ax), v in sorted(table.items()))


def _costs(a: ShardingPlan, b: ShardingPlan) -> tuple[tuple[str, float, float], ...]:
    sa, sb = a.summary(), b.summary()
    return (("simulated step time", sa["step_time_s"], sb["step_time_s"]),
            ("compute", sa["compute_s"], sb["compute_s"]),
            ("communication", sa["communication_s"], sb["communication_s"]),
            ("memory per device (est.)", sa["memory_bytes_per_device"],
             sb["memory_bytes_per_device"]))
