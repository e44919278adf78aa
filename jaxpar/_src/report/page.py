"""The report's HTML sections, each a function of plain data, and the page around them."""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import Any

from jaxpar._src.plan import ShardingPlan, _bytes, _seconds
from jaxpar._src.report import figures, svg
from jaxpar._src.report.causes import (
    DIFFERENT,
    PREDICTED,
    UNPREDICTED,
    XLA_OWN,
    CauseAnalysis,
    CompiledCollective,
)
from jaxpar._src.report.context import NodeContext
from jaxpar._src.report.figures import LayoutTable
from jaxpar._src.report.svg import esc

STATUS_CLASS = {PREDICTED: "ok", DIFFERENT: "diff", UNPREDICTED: "new", XLA_OWN: "xla"}

CSS = """
.jxr{font:13px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#222;
max-width:1200px}
.jxr h1{font-size:20px;margin:4px 0}.jxr h2{font-size:16px;margin:22px 0 6px;
border-bottom:1px solid #ddd;padding-bottom:3px}
.jxr table{border-collapse:collapse;margin:4px 0}.jxr td,.jxr th{border-bottom:1px solid #eee;
padding:2px 8px;text-align:left;vertical-align:top}.jxr th{background:#f6f6f6}
.jxr td.num{text-align:right;font-variant-numeric:tabular-nums}
.jxr .muted{color:#777}.jxr nav a{margin-right:12px}
.jxr .cards{display:flex;flex-wrap:wrap;gap:10px}.jxr .card{border:1px solid #ddd;
border-radius:6px;padding:6px 10px;min-width:150px}.jxr .card b{display:block;font-size:16px}
.jxr .pill{border-radius:9px;padding:0 7px;font-size:11px;white-space:nowrap}
.jxr .ok{background:#dff0d8}.jxr .diff{background:#fcf1c8}.jxr .new{background:#f9d6d5}
.jxr .xla{background:#dde3f0}
.jxr .chip{display:inline-block;border-radius:3px;padding:0 4px;margin:1px;font:11px monospace;
color:#111}.jxr .sw{margin-right:12px}.jxr .sw i{display:inline-block;width:10px;height:10px;
margin-right:4px;border-radius:2px}
.jxr .jxr-layouts{display:flex;flex-wrap:wrap;gap:14px}.jxr figure{margin:2px 8px 2px 0;
display:inline-block;vertical-align:top}.jxr figcaption{font:11px monospace}
.jxr details>summary{cursor:pointer;padding:2px 0}.jxr .jxr-body{margin-left:14px}
.jxr code{font-size:12px}.jxr .cause{max-width:620px}.jxr .cause ul{margin:0;padding-left:16px}
.jxr svg text{font-family:system-ui,sans-serif;fill:#222}
"""

# Recorded into the page, so a headless browser run can see script errors in the DOM.
ERROR_HOOK = ("window.addEventListener('error',function(e){var r=document.documentElement;"
              "r.setAttribute('data-js-errors',(r.getAttribute('data-js-errors')||'')+"
              "e.message+';');});")


def document(title: str, body: str) -> str:
    """A self-contained page around a report fragment (no external resources)."""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}'
            f'</title><meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<script>{ERROR_HOOK}</script></head><body>{body}</body></html>")


def header(plan: ShardingPlan, title: str, sections: Sequence[tuple[str, str]], uid: str) -> str:
    ops = sum(1 for d in plan.decisions if str(getattr(d.kind, "value", d.kind)) == "op")
    nav = "".join(f'<a href="#{uid}-{key}">{esc(name)}</a>' for key, name in sections)
    return (f"<h1>{esc(title)}</h1><div class=muted>mesh {esc(plan.mesh)} · "
            f"{esc(plan.parallel_mode)} · search {esc(plan.search_mode)} · hardware "
            f"{esc(plan.hardware)} · {ops} operators, {len(plan.decisions)} nodes</div>"
            f"<nav>{nav}</nav>")


def section(uid: str, key: str, title: str, body: str) -> str:
    return f'<section id="{uid}-{key}" data-section="{key}"><h2>{esc(title)}</h2>{body}</section>'


def summary(plan: ShardingPlan, s: Mapping[str, Any], analysis: CauseAnalysis | None,
            memory: Mapping[str, int] | None, flops: float | None) -> str:
    comm = s["collectives"]
    cards = [("simulated step", _seconds(s["step_time_s"]),
              f"compute {_seconds(s['compute_s'])}, communication "
              f"{_seconds(s['communication_s'])}")]
    predicted = sum(v["count"] for v in comm.values())
    line = f"{predicted:g} predicted ({_bytes(s['collective_wire_bytes'])} on the wire)"
    if analysis is not None:
        records = [c.record for c in analysis.collectives]
        cards.append(("collectives", f"{sum(r.count for r in records)} compiled", line))
        explained = len(analysis.collectives) - analysis.count(XLA_OWN)
        cards.append(("causes", f"{explained} of {len(records)} traced to the plan",
                      ", ".join(f"{analysis.count(k)} {k}" for k in
                                (PREDICTED, DIFFERENT, UNPREDICTED, XLA_OWN))))
    else:
        cards.append(("collectives", f"{predicted:g} predicted", "compiled program not given"))
    mem = _bytes(plan.memory_bytes) + " est."
    cards.append(("memory / device", mem, f"compiled: {_bytes(memory['total'])}"
                  if memory else f"budget {_bytes(plan.memory_budget)}"))
    est_flops = sum(d.flops for d in plan.decisions)
    cards.append(("FLOPs / device", f"{est_flops:.3g} est.",
                  f"compiled: {flops:.3g}" if flops is not None else ""))
    if plan.baseline_s is not None:
        cards.append(("pure data parallel", _seconds(plan.baseline_s),
                      f"search {plan.search_s:.2f} s"))
    out = "".join(f'<div class="card">{esc(k)}<b>{esc(v)}</b><span class="muted">{esc(m)}'
                  f"</span></div>" for k, v, m in cards)
    notes = "".join(f"<li>{esc(n)}</li>" for n in plan.notes)
    return f'<div class="cards">{out}</div>' + (f"<ul>{notes}</ul>" if notes else "")


def collectives(analysis: CauseAnalysis | None, contexts: Sequence[NodeContext]) -> str:
    if analysis is None:
        return ("<p>Pass the compiled program to see each collective XLA inserted and why: "
                "<code>plan.report(path, compiled=step.lower(*args).compile())</code> or "
                "<code>step.report(*args)</code>.</p>")
    if not analysis.collectives:
        body = "<p>The compiled program has no collectives.</p>"
    else:
        rows = "".join(_collective_row(i, c, contexts)
                       for i, c in enumerate(analysis.collectives))
        body = ("<table class=jxr-colls><tr><th>#</th><th>instruction</th><th>kind</th>"
                "<th>axes</th><th>runs</th><th>bytes/device</th><th>status</th>"
                f"<th>cause</th></tr>{rows}</table>")
    if analysis.mismatched_tags:
        body += (f"<p class=new>{analysis.mismatched_tags} instructions name nodes this plan "
                 "does not have: was the program compiled from another plan?</p>")
    if analysis.absent:
        groups: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
        for c in analysis.absent:
            groups[(c.operator, contexts[c.node].location, c.reason, c.detail)] += 1
        rows = "".join(f"<tr><td>{esc(o)}</td><td>{esc(loc)}</td><td>{esc(r)}: {esc(d)}</td>"
                       f"<td class=num>{n}</td></tr>" for (o, loc, r, d), n in groups.items())
        body += (f"<details><summary>{len(analysis.absent)} predicted collectives are not in "
                 "the compiled program (XLA merged, moved or avoided them)</summary><table>"
                 "<tr><th>operator</th><th>source</th><th>predicted</th><th>times</th></tr>"
                 f"{rows}</table></details>")
    legend = ("<p class=muted><span class='pill ok'>predicted</span> the plan priced it at "
              "that operator · <span class='pill diff'>predicted differently</span> the plan "
              "expected another kind or axes there · <span class='pill new'>not predicted"
              "</span> the operator's layouts made XLA insert it, the plan priced nothing · "
              "<span class='pill xla'>XLA's own</span> no plan operator names it</p>")
    return legend + body


def _collective_row(i: int, c: CompiledCollective, contexts: Sequence[NodeContext]) -> str:
    r = c.record
    causes = [f"<li><b>{esc(x.operator)}</b> #{x.node} at <code>"
              f"{esc(contexts[x.node].location)}</code>"
              + (f" — {esc(x.reason)}: {esc(x.detail)}" if x.reason else
                 " — the plan predicted no collective here") + "</li>" for x in c.causes]
    if not causes:
        where = f" at <code>{esc(c.location)}</code>" if c.location else ""
        cell = (f"XLA added it on its own: no plan operator names it (op_name "
                f"<code>{esc(c.op_name or '?')}</code>{where})")
    elif len(causes) <= 4:
        cell = f"<ul>{''.join(causes)}</ul>"
    else:
        cell = (f"<ul>{''.join(causes[:3])}</ul><details><summary>{len(causes) - 3} more "
                f"operators (combined by XLA)</summary><ul>{''.join(causes[3:])}</ul></details>")
    shapes = " ".join(r.shapes)
    return (f'<tr data-hlo="{esc(r.name)}" data-status="{esc(c.status)}"><td>{i}</td>'
            f"<td><code>{esc(r.name)}</code></td><td>{esc(r.kind)}</td><td>{esc(c.axes)}</td>"
            f'<td class=num>{r.count}</td><td class=num title="{esc(shapes)}">'
            f'{esc(_bytes(r.nbytes))}</td><td><span class="pill {STATUS_CLASS[c.status]}">'
            f'{esc(c.status)}</span></td><td class="cause">{cell}</td></tr>')


def compare(plan: ShardingPlan, analysis: CauseAnalysis | None,
            memory: Mapping[str, int] | None, flops: float | None) -> str:
    rows = []
    if analysis is not None:
        for r in analysis.rows:
            rows.append(f"<tr><td>{esc(r.kind)}</td><td>{esc(r.axes)}</td>"
                        f"<td class=num>{r.predicted_count:g}</td><td class=num>"
                        f"{esc(_bytes(r.predicted_wire_bytes))}</td><td class=num>"
                        f"{r.compiled_count}</td><td class=num>{r.compiled_instructions}</td>"
                        f"<td class=num>{esc(_bytes(r.compiled_wire_bytes))}</td></tr>")
        table = ("<table><tr><th>kind</th><th>mesh axes</th><th>predicted runs</th>"
                 "<th>predicted wire bytes</th><th>compiled runs</th><th>instructions</th>"
                 f"<th>compiled wire bytes</th></tr>{''.join(rows)}</table>"
                 "<p class=muted>Per device and call. XLA combines independent collectives "
                 "into one instruction, so compiled runs can be fewer than predicted ones for "
                 "the same bytes.</p>")
    else:
        for kind, v in sorted(plan.communication_summary().items()):
            rows.append(f"<tr><td>{esc(kind)}</td><td class=num>{v['count']:g}</td>"
                        f"<td class=num>{esc(_bytes(v['wire_bytes']))}</td></tr>")
        table = ("<table><tr><th>kind</th><th>predicted runs</th><th>wire bytes</th></tr>"
                 f"{''.join(rows)}</table>")
    est = sum(d.flops for d in plan.decisions)
    flop_line = (f"<p>FLOPs per device: {est:.4g} estimated"
                 + (f", {flops:.4g} counted by XLA (a loop body counts once)" if flops is not
                    None else "") + "</p>")
    return (table + "<h3>Memory per device</h3>" + figures.memory_bars(plan, memory)
            + flop_line)


def timeline(plan: ShardingPlan, contexts: Sequence[NodeContext], step_s: float) -> str:
    return (f"<p>{figures.kind_legend()}</p>" + figures.step_timeline(plan, contexts)
            + f"<p class=muted>The cost model's schedule under the {esc(plan.hardware)} "
            f"profile: each operator's compute, then its collectives, one after another; "
            f"simulated step time {esc(_seconds(step_s))}. Hover for operators.</p>")


def layouts(plan: ShardingPlan, table: LayoutTable) -> str:
    figs = []
    for k, (spec, count, color) in enumerate(zip(table.specs, table.counts, table.colors,
                                                 strict=True)):
        grid = svg.device_grid(spec, plan.mesh, plan.device_ids)
        figs.append(f'<figure data-l="{k}" data-name="{esc(spec)}" data-color="{color}">'
                    f'<figcaption><span class=chip style="background:{color}">{esc(spec)}'
                    f"</span> {count} uses</figcaption>{grid}</figure>")
    return ("<p class=muted>Each layout names the mesh axes that split each tensor dimension "
            "(<code>-</code>: whole). The grid is the mesh (rows: first axis); a cell is a "
            "device, labelled with the block of the tensor it holds; devices of one colour "
            f"hold the same block.</p><div class=jxr-layouts>{''.join(figs)}</div>")


def runner_ups(rows: Sequence[tuple[str, str, str, str, int, str]]) -> str:
    if not rows:
        return "<p>No searched operator had an alternative.</p>"
    body = "".join(f"<tr><td>{esc(a)}</td><td><code>{esc(b)}</code></td><td>{esc(c)}</td>"
                   f"<td>{esc(d)}</td><td class=num>{n}</td><td class=num>{esc(e)}</td></tr>"
                   for a, b, c, d, n, e in rows)
    return ("<p class=muted>The search's choice for each contraction, gather and pin, beside "
            "the next best strategy with the rest of the plan fixed and how much longer the "
            "simulated step would be; identical layers are folded together. Every node's "
            "runner-up is in the operator graph.</p><table><tr><th>operator</th><th>source</th>"
            "<th>chosen</th><th>runner-up</th><th>nodes</th><th>extra cost</th></tr>"
            f"{body}</table>")


def fragment(uid: str, parts: Sequence[str], extra_css: str = "") -> str:
    return f'<div class="jxr" id="{uid}"><style>{CSS}{extra_css}</style>{"".join(parts)}</div>'

