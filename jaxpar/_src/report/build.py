"""``plan.report()`` / ``step.report(*args)``: one self-contained HTML file about one plan."""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from typing import Any

from jaxpar._src.errors import PlanError
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.report import explorer, figures, page
from jaxpar._src.report.causes import CauseAnalysis, analyse
from jaxpar._src.report.context import node_contexts
from jaxpar._src.report.diff import PlanDiff, diff_plans
from jaxpar._src.report.hlo_meta import HloIndex

_ids = itertools.count()


@dataclasses.dataclass(frozen=True)
class Report:
    """A plan report: ``save(path)`` writes the page; in a notebook it renders itself.

    Attributes:
      fragment: the report as one HTML element (what a notebook shows).
      title: the page title.
      analysis: every compiled collective with its cause (``None`` without a compiled program).
      diff: the comparison with another plan, if one was given.
      build_s: seconds it took to build (compiling the program not included).

    >>> import jax.numpy as jnp, jaxpar
    >>> f = jaxpar.parallelize(lambda x, w: x @ w, mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")),
    ...                        parallel_mode="semi_auto_parallel", in_strategy=((2, 1), (1, 4)))
    >>> report = f.plan(jnp.ones((8, 16)), jnp.ones((16, 4))).report()  # no compiled program
    >>> report.html.startswith("<!DOCTYPE html>"), report.analysis is None
    (True, True)
    """

    fragment: str
    title: str
    analysis: CauseAnalysis | None = None
    diff: PlanDiff | None = None
    build_s: float = 0.0

    @property
    def html(self) -> str:
        """The whole page: no external resources, so it opens anywhere, offline."""
        return page.document(self.title, self.fragment)

    def save(self, path: str | os.PathLike) -> str:
        """Writes the page to ``path`` and returns the path."""
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        return os.fspath(path)

    def _repr_html_(self) -> str:
        return self.fragment

    def __str__(self) -> str:
        text = self.analysis.table() if self.analysis is not None else \
            "compiled collectives: not given"
        return f"{self.title}\n{text}"


def build_report(plan: ShardingPlan, *, compiled: Any = None, graph: Any = None,
                 other: ShardingPlan | None = None, title: str | None = None,
                 path: str | os.PathLike | None = None) -> Report:
    """Builds the report of ``plan``; see :meth:`ShardingPlan.report`."""
    t0 = time.perf_counter()
    text, memory, flops = _read_compiled(compiled)
    index = HloIndex(text) if text is not None else None
    analysis = analyse(plan, text, index) if text is not None else None
    contexts = node_contexts(plan, graph, index)
    layouts = figures.layout_table(plan)
    totals = plan.summary()
    uid = f"jxr{os.getpid():x}{next(_ids)}"
    title = title or f"jaxpar plan: {plan.parallel_mode} on mesh {plan.mesh}"
    searched = any(d.runner_up is not None for d in plan.decisions)
    sections = [("summary", "Summary"), ("collectives", "Collectives and their causes"),
                ("compare", "Predicted vs compiled"), ("timeline", "Step timeline"),
                ("layouts", "Layouts"), ("graph", "Operator graph")]
    if searched:
        sections.append(("search", "Runner-ups"))
    difference = diff_plans(other, plan) if other is not None else None
    if difference is not None:
        sections.append(("diff", "Changes from the other plan"))
    bodies = {
        "summary": page.summary(plan, totals, analysis, memory, flops),
        "collectives": page.collectives(analysis, contexts),
        "compare": page.compare(plan, analysis, memory, flops),
        "timeline": page.timeline(plan, contexts, totals["step_time_s"]),
        "layouts": page.layouts(plan, layouts),
        "graph": explorer.explorer_html(uid, explorer.explorer_data(plan, contexts, layouts)),
    }
    if searched:
        bodies["search"] = page.runner_ups(explorer.runner_up_rows(plan, contexts))
    if difference is not None:
        bodies["diff"] = ("<p class=muted>a = the other plan, b = this one.</p>"
                          + difference.to_html())
    parts = [page.header(plan, title, sections, uid)]
    parts += [page.section(uid, key, name, bodies[key]) for key, name in sections]
    report = Report(page.fragment(uid, parts), title, analysis, difference,
                    time.perf_counter() - t0)
    if path is not None:
        report.save(path)
    return report


def _read_compiled(compiled: Any) -> tuple[str | None, dict[str, int] | None, float | None]:
    """HLO text, memory and FLOPs of a ``Compiled`` / ``Lowered`` program, or of HLO text."""
    if compiled is None:
        return None, None, None
    if isinstance(compiled, str):
        return compiled, None, None
    from jaxpar._src import inspection

    try:
        import jax

        if isinstance(compiled, jax.stages.Lowered):
            compiled = compiled.compile()
        text = compiled.as_text()
    except AttributeError:
        raise PlanError(f"jaxpar report: compiled= takes a jax.stages.Compiled, a "
                        f"jax.stages.Lowered or HLO text, not {type(compiled).__name__}; "
                        f"pass step.lower(*args).compile().") from None
    try:
        memory = inspection.memory(compiled)
    except Exception:  # noqa: BLE001 - some backends have no memory analysis
        memory = None
    try:
        flops = inspection.flops(compiled)
    except Exception:  # noqa: BLE001 - nor cost analysis
        flops = None
    return text, memory, flops
