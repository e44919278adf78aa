"""The memory choices that compile their candidates: ``jaxpar.recompute(policy="auto")``'s
ladder of recompute policies and ``pipeline_residuals="auto"`` (store or recompute a
pipeline's residuals), each with the parallel optimizer's levels where it is ``"auto"``.

Both try candidates least compute first, plan each for time alone, compile it and take the
first whose compiled peak (``memory_analysis()``) fits ``HardwareProfile.memory_per_device``;
the call then runs that candidate's compiled program.  They are methods of ``Parallelized``
(:class:`MemoryChoices` is its base): they trace, plan and compile with its ``_trace``,
``_plan`` and ``_compiled_rung``.  The ladder and the residuals' choice themselves are
``recompute_choice.py`` and ``pipeline/residual_choice.py``; this module is what ties them to
the call.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jaxpar._src.cached_build import stored_choice
from jaxpar._src.config import config
from jaxpar._src.errors import NoPlanFits, PlanError
from jaxpar._src.pipeline.residual_choice import Tried
from jaxpar._src.pipeline.residual_choice import choose as choose_residuals
from jaxpar._src.pipeline.residual_choice import note as residuals_note
from jaxpar._src.pipeline.residual_choice import refusal as residuals_refusal
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.plan_cache import CacheKey, plan_cache_key, store_cached
from jaxpar._src.recompute import POLICIES
from jaxpar._src.recompute_choice import (
    Rung,
    choice_key,
    choose,
    explain_choice,
    ladder,
    refusal,
    remat_notes,
)
from jaxpar._src.trace import TracedProgram

if TYPE_CHECKING:
    from jaxpar._src.api import Settings


class MemoryChoices:
    """The candidates' choices of ``Parallelized`` (see the module's docstring)."""

    if TYPE_CHECKING:  # Parallelized's, which these methods call
        _info: Any
        _rungs: dict[Any, Rung]

        def _trace(self, args: tuple, settings: Settings, names: list[str],
                   policies: tuple[str, ...] | None
                   ) -> tuple[TracedProgram, tuple[int, ...] | None, list[str]]: ...

        def _plan(self, args: tuple, program: TracedProgram, settings: Settings,
                  names: list[str], batch: tuple[int, ...] | None,
                  policies: tuple[str, ...] | None = None
                  ) -> tuple[TracedProgram, tuple[int, ...] | None, ShardingPlan]: ...

        def _compiled_rung(self, args: tuple, settings: Settings, policies: tuple[str, ...],
                           program: TracedProgram, batch: tuple[int, ...] | None,
                           plan: ShardingPlan) -> Rung: ...

    def _recompute_choice(self, args: tuple, settings: Settings, names: list[str],
                          signature: tuple, layers: list[str], base: TracedProgram,
                          base_batch: tuple[int, ...] | None
                          ) -> tuple[TracedProgram, tuple[int, ...] | None, ShardingPlan,
                                     Rung | None, CacheKey | None, str | None, bool]:
        """The first rung of the recompute ladder whose compiled peak fits the budget: its
        program, batch arguments, plan, and the rung (whose jitted function is compiled).
        With a plan cache, a stored choice is traced and its plan loaded instead (no rung);
        ``base`` is the program traced with nothing recomputed.  Then the plan cache entry's
        key, the SHA-256 of its text (``None`` without one) and whether it was read (a hit)."""
        info = self._info
        budget = float(settings.hardware.memory_per_device or 0.0)  # filled from the preset
        cache_dir, entry_key = config.plan_cache_dir, None
        if cache_dir:
            entry_key = plan_cache_key(graph=base.graph, in_tree=base.in_tree,
                                       out_tree=base.out_tree, signature=signature,
                                       settings=settings, info=info,
                                       choice=choice_key(layers, budget))
            hit = stored_choice(
                cache_dir, entry_key, base, base_batch, layers, POLICIES, api=info.api,
                retrace=lambda policies: self._trace(args, settings, names, policies))
            if hit is not None:
                program, batch, plan, sha = hit
                return program, batch, plan, None, entry_key, sha, True
        free = dataclasses.replace(settings, hardware=dataclasses.replace(
            settings.hardware, memory_per_device=float("inf")))

        def rung(policies: tuple[str, ...], within: Settings = free) -> Rung:
            key = (signature, within, policies)
            if key not in self._rungs:
                # a pipeline's loop is built for the parallel optimizer it runs with
                program, batch, seen = self._trace(args, dataclasses.replace(
                    settings, optimizer=within.optimizer), names, policies)
                if len(seen) != len(layers):
                    raise PlanError(
                        f"{info.api}: tracing again with chosen recompute policies met "
                        f"{len(seen)} jaxpar.recompute(policy='auto') blocks instead of "
                        f"{len(layers)}; a jax.jit around them caches its first trace. Put "
                        f"the blocks outside nested jits, or give them fixed policies.")
                program, batch, plan = self._plan(args, program, within, names, batch,
                                                  policies)
                self._rungs[key] = self._compiled_rung(
                    args, settings, policies, program, batch,
                    dataclasses.replace(plan, memory_budget=budget))
            return self._rungs[key]

        levels: dict[int, str] = {}

        def joint(policies: tuple[str, ...]) -> Rung:
            """With ``"optimizer_level": "auto"`` too, the ZeRO levels (off, 1, 3: least
            communication first) come before recomputing more: the first that fits."""
            opt = settings.optimizer
            if opt is None or not opt.automatic:
                return rung(policies)
            for level in (0, 1, 3):
                o = dataclasses.replace(opt, level=level) if level else None
                r = rung(policies, dataclasses.replace(free, optimizer=o))
                levels[id(r)] = f"level{level}" if level else "off"
                if r.compiled_bytes <= budget:
                    break
            return r

        chosen, tried = choose(layers, budget, joint)
        fallback = chosen is None
        if chosen is None:  # the search's own lever: memory priced in, all blocks full
            try:
                chosen = rung(ladder(len(layers))[-1], settings)
            except NoPlanFits:
                raise refusal(info.api, layers, budget, tried) from None
            if chosen.compiled_bytes > budget:
                raise refusal(info.api, layers, budget, [*tried, chosen])
        notes = explain_choice(layers, budget, chosen, tried, fallback=fallback)
        if id(chosen) in levels:
            notes += (f"parallel optimizer: {levels[id(chosen)]} chosen with this recompute "
                      f"choice (tried first at each rung: off, level1, level3)",)
        plan = dataclasses.replace(chosen.plan, notes=chosen.plan.notes + notes
                                   + remat_notes(chosen.program.graph))
        text_sha = None
        if entry_key is not None and cache_dir:
            text_sha = store_cached(cache_dir, entry_key, plan, api=info.api,
                                    choice=list(chosen.policies))
        return chosen.program, chosen.batch, plan, chosen, entry_key, text_sha, False

    def _residuals_choice(self, args: tuple, settings: Settings, names: list[str],
                          program: TracedProgram, batch: tuple[int, ...] | None
                          ) -> tuple[Settings, Rung]:
        """``pipeline_residuals="auto"`` (``pipeline/residual_choice.py``): storing, then
        recomputing, each planned (at the parallel optimizer's levels where it is
        ``"auto"``), the first whose predicted and compiled peaks fit the budget.  ``program``
        is the step traced storing.  The settings it runs with, and its compiled rung."""
        budget = float(settings.hardware.memory_per_device or 0.0)  # bounded: checked
        free = dataclasses.replace(settings.hardware, memory_per_device=float("inf"))
        opt = settings.optimizer
        auto = opt is not None and opt.automatic

        def attempt(residuals: str, level: int | None) -> Tried:
            at = with_residuals(settings, residuals)
            o = opt if not auto else dataclasses.replace(opt, level=level) if level else None
            # planned for time alone at a fixed level, as the recompute ladder's rungs are; a
            # pipeline's loop is built for the parallel optimizer it runs with ("program",
            # traced storing at "auto", i.e. level 0, is the one with the optimizer off, as
            # in _plan, unless "auto" shards the gradients)
            same = residuals == "store" and (not auto or (o is None and not opt.shards_gradients))
            p, b = (program, batch) if same else \
                self._trace(args, dataclasses.replace(at, optimizer=o), names, None)[:2]
            p, b, plan = self._plan(args, p, dataclasses.replace(at, hardware=free, optimizer=o),
                                    names, b)
            plan = dataclasses.replace(plan, memory_budget=budget,
                                       notes=plan.notes + remat_notes(p.graph))
            name = "" if not auto else f"level{level}" if level else "off"
            if plan.memory_bytes > budget:  # not compiled: predicted over the budget
                return Tried(residuals, name, None, plan.memory_bytes, None)
            rung = self._compiled_rung(args, at, (), p, b, plan)
            return Tried(residuals, name, rung, plan.memory_bytes, rung.compiled_bytes)

        chosen, tried = choose_residuals(budget, attempt, (0, 1, 3) if auto else (None,))
        if chosen is None:
            raise residuals_refusal(self._info.api, budget, tried)
        rung = chosen.rung
        plan = dataclasses.replace(rung.plan, notes=rung.plan.notes
                                   + (residuals_note(budget, chosen, tried),))
        return with_residuals(settings, chosen.residuals), dataclasses.replace(rung, plan=plan)


def with_residuals(settings: Settings, residuals: str) -> Settings:
    """``settings`` with the pipeline's ``pipeline_residuals`` set to ``residuals``."""
    p = settings.pipeline
    return dataclasses.replace(settings, pipeline=dataclasses.replace(
        p, config=dataclasses.replace(p.config, residuals=residuals)))
