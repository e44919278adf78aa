"""``pipeline_residuals="auto"``: a pipelined step stores its residuals where it fits the
memory budget, else recomputes them.

``"store"`` keeps each chunk's backward residuals from its forward, for every micro-batch in
flight (GPipe: ``M``); ``"recompute"`` keeps only the chunk's input and runs its forward again
in the backward: less memory, one more forward of each chunk (``pipeline/memory.py``).  With
``pipeline_residuals="auto"`` ``parallelize`` tries, least compute first::

    store -> recompute

each traced and planned for time alone, and with ``"optimizer_level": "auto"`` each at the
parallel optimizer's levels first, as the recompute ladder of non-pipelined steps does
(``api._recompute_choice``: ZeRO costs a little communication, recomputation compute)::

    store: off -> level 1 -> level 3 -> recompute: off -> level 1 -> level 3

A choice is taken when the plan's predicted peak (``plan.memory_bytes``, which counts the
loop: ``pipeline/memory.py``) and then the compiled program's (``memory_analysis()``) are both
within ``HardwareProfile.memory_per_device``; one predicted over the budget is not compiled.
Each choice's plan does not depend on the budget, so the chosen program's compiled peak falls
(or stays) as the budget falls.  Without a budget (``memory_per_device=float("inf")``; a
profile left at ``None`` has its preset's memory, which is a budget) ``"auto"`` stores.

>>> t = Tried("store", "", None, 3.0 * 2**20, 3.1 * 2**20)
>>> fits(t, 4.0 * 2**20), fits(t, 3.05 * 2**20)
(True, False)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from jaxpar._src.errors import PlanError
from jaxpar._src.pipeline.view import format_bytes

CHOICES = ("store", "recompute")  # least compute first


@dataclasses.dataclass(frozen=True)
class Tried:
    """One choice of ``pipeline_residuals``, traced and planned."""

    residuals: str
    level: str  # the parallel optimizer's, where "optimizer_level" is "auto" ("off", "level1",
    # "level3"); else ""
    rung: Any  # recompute_choice.Rung: the program, plan and compiled function; None if not
    predicted: float  # plan.memory_bytes, per device
    compiled: float | None  # memory_analysis total per device; None: predicted over budget


def bounded(budget: float | None) -> bool:
    """Whether ``memory_per_device`` is a budget at all (0, ``None`` and infinity are not).

    >>> bounded(2.0**30), bounded(0.0), bounded(None), bounded(float("inf"))
    (True, False, False, False)
    """
    return budget is not None and math.isfinite(budget) and budget > 0


def fits(t: Tried, budget: float) -> bool:
    """Predicted and compiled peaks both within ``budget``."""
    return t.predicted <= budget and t.compiled is not None and t.compiled <= budget


def choose(budget: float, attempt: Callable[[str, Any], Tried], levels: Sequence[Any] = (None,)
           ) -> tuple[Tried | None, list[Tried]]:
    """The first of :data:`CHOICES` x ``levels`` (the parallel optimizer's, tried first) that
    fits ``budget`` (else ``None``), and all tried."""
    tried = []
    for residuals in CHOICES:
        for level in levels:
            tried.append(attempt(residuals, level))
            if fits(tried[-1], budget):
                return tried[-1], tried
    return None, tried


def note(budget: float, chosen: Tried, tried: Sequence[Tried]) -> str:
    """The plan's note: which was chosen, and why (predicted and compiled bytes vs budget)."""
    why = ("storing fits" if chosen.residuals == "store" else
           "storing does not fit; recomputing (one more forward of each chunk in the backward) "
           "does")
    return (f"pipeline_residuals (auto, budget {format_bytes(budget)}/device): "
            f"{_name(chosen)} chosen, {why}; tried " + ", ".join(
                f"{_name(t)} {_peaks(t)}" for t in tried)
            + " (store first: recomputing costs compute"
            + (", the parallel optimizer's levels first at each" if chosen.level else "") + ")")


def refusal(api: str, budget: float, tried: Sequence[Tried]) -> PlanError:
    """Neither choice fits: the error names the budget and the smallest prediction.

    >>> e = refusal("f", 2.0**20, [Tried("store", "", None, 3 * 2.0**20, None),
    ...                            Tried("recompute", "", None, 2 * 2.0**20, None)])
    >>> "the smallest, recompute, is predicted 2 MiB per device" in str(e)
    True
    """
    least = min(tried, key=lambda t: t.predicted)
    return PlanError(
        f"{api}: pipeline_residuals='auto' found no choice within the memory budget of "
        f"{format_bytes(budget)} per device (HardwareProfile.memory_per_device): the smallest, "
        f"{_name(least)}, is predicted {format_bytes(least.predicted)} per device"
        + (f" ({format_bytes(least.compiled)} compiled)" if least.compiled is not None else "")
        + "; tried " + ", ".join(f"{_name(t)} {_peaks(t)}" for t in tried)
        + ". Raise memory_per_device, use more pipeline stages or micro-batches, the 1f1b "
        "schedule, or the parallel optimizer (enable_parallel_optimizer=True, "
        "optimizer_level 'auto').")


def _peaks(t: Tried) -> str:
    compiled = "not compiled" if t.compiled is None else f"{format_bytes(t.compiled)} compiled"
    return f"{format_bytes(t.predicted)} predicted, {compiled}"


def _name(t: Tried) -> str:
    return t.residuals + (f" (parallel optimizer {t.level})" if t.level else "")
