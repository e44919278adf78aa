"""The automatic choice of recomputation: one ``jax.checkpoint`` policy per ``"auto"`` block.

A block marked ``jaxpar.recompute(block, policy="auto")`` is a *layer* of the choice (the k-th
call while the function is traced).  In ``auto_parallel`` the plan walks one fixed *ladder* of
choices, least recomputation first::

    all none -> dots on layer 0 -> dots on layers 0, 1 -> ... -> all dots
             -> full on layer 0 -> ... -> all full

(``dots`` keeps the products with weights and recomputes the rest; ``full`` keeps only the
block's inputs; earlier layers first, as their activations are held longest.)  Each rung is
traced with its policies, planned by the search for time alone, lowered and compiled, and the
first rung whose *compiled* peak (``memory_analysis()``: arguments + outputs - aliased +
temporaries, per device) is within ``HardwareProfile.memory_per_device`` is the plan.  Each
rung's plan does not depend on the budget, so the chosen plan's peak is monotone in the budget
by construction: a larger budget stops at the same or an earlier rung, and an earlier rung is
chosen only when its peak exceeds the smaller budget.  Compiling each rung costs time but makes
the fit exact: jaxpar's memory model (``search/memory.py``: live bytes in program order)
misjudges XLA's buffer reuse and fusion in both directions (see README "Recomputation").

When no rung fits, the last (all ``full``) is searched again with memory priced in (the
search's own lever, ``search/auto.py``); if that does not fit either, jaxpar raises with the
budget and the fixes.  Rungs are memoised per ``parallelize``'d function, signature and
settings, so a sweep of budgets compiles each rung once.

The compile that measured the chosen rung is the one its calls run: a rung keeps its jitted
function (``Rung.jitted``), lowered from the arguments placed as a call places them, so the
call's ``jax.jit`` finds the lowering and executable in its caches; a first call compiles once
per rung tried (``tests/test_recompute_compiles.py`` counts them).  With
``jaxpar.config.plan_cache_dir`` the choice is kept beside the plan (``plan_cache.py``, keyed
with :func:`choice_key` as well): a later process traces the stored policies and loads the plan
instead of climbing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jaxpar._src.errors import PlanError
from jaxpar._src.graph import OpGraph
from jaxpar._src.plan import ShardingPlan, _bytes
from jaxpar._src.recompute import POLICIES


@dataclasses.dataclass(frozen=True)
class Rung:
    """One choice of the ladder, planned and compiled."""

    policies: tuple[str, ...]  # per auto block, in call order
    program: Any  # TracedProgram
    batch: tuple[int, ...] | None
    plan: ShardingPlan
    compiled_bytes: float  # memory_analysis: argument + output - alias + temp, per device
    flops: float  # cost_analysis, per device
    # The jitted function the rung was compiled from and its flat input shardings: the call
    # of a chosen rung runs it, and jax.jit's caches hold the executable measured above.
    jitted: Any = None
    in_shardings: tuple[Any, ...] = ()
    # The executable XLA compiled for the rung in this process, which the plan cache may keep
    # beside the entry holding the choice; None where JAX's persistent cache served it.
    executable: Any = None


def ladder(n: int) -> list[tuple[str, ...]]:
    """The choices for ``n`` auto blocks, least recomputation first.

    >>> ladder(2)
    [('none', 'none'), ('dots', 'none'), ('dots', 'dots'), ('full', 'dots'), ('full', 'full')]
    """
    rungs = [("none",) * n]
    for level, below in zip(POLICIES[1:], POLICIES[:-1], strict=True):
        rungs.extend((level,) * k + (below,) * (n - k) for k in range(1, n + 1))
    return rungs


def choice_key(layers: Sequence[str], budget: float) -> dict[str, Any]:
    """What the choice depends on besides the program and settings, for the plan cache's key:
    the blocks, the policies offered, the ladder's order and the budget.

    >>> choice_key(["block (m.py:3)"], 2.0**20)["ladder"]
    [['none'], ['dots'], ['full']]
    """
    return {"blocks": list(layers), "policies": list(POLICIES),
            "ladder": [list(r) for r in ladder(len(layers))], "budget": float(budget)}


def choose(layers: Sequence[str], budget: float, rung: Callable[[tuple[str, ...]], Rung]
           ) -> tuple[Rung | None, list[Rung]]:
    """The first rung of the ladder whose compiled peak fits ``budget`` (else ``None``), and
    every rung tried."""
    tried = []
    for policies in ladder(len(layers)):
        r = rung(policies)
        tried.append(r)
        if r.compiled_bytes <= budget:
            return r, tried
    return None, tried


def explain_choice(layers: Sequence[str], budget: float, chosen: Rung, tried: Sequence[Rung],
                   *, fallback: bool = False) -> tuple[str, ...]:
    """The plan's notes: what was recomputed, why, and the memory predicted beside compiled."""
    first = tried[0]
    n = len(layers)
    how = ("no rung of the ladder fit; the all-full rung was searched again with memory "
           "priced in" if fallback else
           f"rung {len(tried)} of {len(ladder(n))} on the ladder none -> dots -> full "
           f"(earlier layers first), the first whose compiled peak fits")
    notes = [
        f"recompute (auto, {n} blocks, budget {_bytes(budget)}/device): {_summary(chosen)}; "
        f"{how}. Compiled peak {_bytes(chosen.compiled_bytes)} (memory_analysis), predicted "
        f"{_bytes(chosen.plan.memory_bytes)} (ratio {_ratio(chosen)}); without recomputation "
        f"{_bytes(first.compiled_bytes)} compiled, {_bytes(first.plan.memory_bytes)} predicted; "
        f"FLOPs x{chosen.flops / max(first.flops, 1.0):.3f}."]
    notes.extend(f"recompute block {k} {name}: {policy}"
                 for k, (name, policy) in enumerate(zip(layers, chosen.policies, strict=True)))
    return tuple(notes)


def _summary(r: Rung) -> str:
    counts = {p: r.policies.count(p) for p in POLICIES if p in r.policies}
    if counts.get("none") == len(r.policies):
        return "nothing recomputed, the plan fits without"
    return ", ".join(f"{c} {p}" for p, c in counts.items())


def _ratio(r: Rung) -> str:
    return f"{r.plan.memory_bytes / r.compiled_bytes:.2f}" if r.compiled_bytes else "-"


def refusal(api: str, layers: Sequence[str], budget: float, tried: Sequence[Rung]
            ) -> PlanError:
    """No recomputation fits: the error names the budget, the smallest compiled peak of the
    programs ``tried`` (the ladder's rungs and, where it was made, the all-full rung searched
    with memory priced in) with its policies, and the fixes.  The search with memory priced
    in judges by the model, not by XLA's buffer assignment (README "Recomputation": on the
    zoo's 2-layer Gemma it predicted 260 KiB for a program that compiled 304 KiB, the
    ladder's all-full rung 488 KiB), so the smallest program may be any of them.

    >>> r = lambda policies, peak: Rung(policies, None, None, None, peak, 0.0)
    >>> e = refusal("f", ["a", "b"], 2.0**10, [r(("none", "none"), 4e5),
    ...             r(("full", "dots"), 3e5), r(("full", "full"), 5e5)])
    >>> "(policies full, dots) still needs 293 KiB, of 3 tried" in str(e)
    True
    """
    smallest = min(tried, key=lambda r: r.compiled_bytes)
    return PlanError(
        f"{api}: no recompute policy fits the memory budget of {_bytes(budget)} per device "
        f"(HardwareProfile.memory_per_device): the smallest program compiled (policies "
        f"{', '.join(smallest.policies)}) still needs {_bytes(smallest.compiled_bytes)}, of "
        f"{len(tried)} tried for the {len(layers)} jaxpar.recompute(policy='auto') blocks. "
        f"Raise memory_per_device, use more devices or a smaller batch, or wrap more of the "
        f"model in jaxpar.recompute.")


def remat_notes(graph: OpGraph) -> tuple[str, ...]:
    """A note on the checkpoint bodies the plan keeps (fixed policies, or chosen)."""
    if not graph.remats:
        return ()
    ops = sum(1 for n in graph.nodes if n.remat is not None)
    return (f"{len(graph.remats)} jax.checkpoint bodies (jaxpar.recompute) are recomputed in "
            f"the backward pass: {ops} operators run again instead of keeping activations",)


def cpu_memory_scheduler(platform: str, graph: OpGraph) -> dict[str, Any] | None:
    """XLA options for a program that recomputes: on CPU, XLA's default scheduler orders for
    concurrency and ignores memory, so recomputation would free nothing (measured: equal
    temporaries for none, dots and full); its memory-optimised scheduler is used instead.
    (``xla_cpu_enable_concurrency_optimized_scheduler=False`` has that effect only in
    ``XLA_FLAGS``; as a compile option it is ignored.)"""
    if platform != "cpu" or not graph.remats:
        return None
    return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
