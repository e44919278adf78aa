"""How the enclosing plan treats a pipeline: its loop is one operator with fixed layouts.

A train step that calls a :class:`~jaxpar.PipelineCell` traces to a program in which the whole
pipeline is one ``shard_map`` equation (the loop of ``loop.py``), surrounded by the stacking of
the layer weights, the micro-batching of the batch and the optimizer.  jaxpar plans that program
like any other, with two additions:

* a sharding rule for ``shard_map``: every dimension of every operand and result is its own
  factor (the loop's body constrains its own layouts; only the boundary matters).  A
  ``shard_map`` that is not a pipeline loop keeps the old fallback: replicated, with a warning;
* a pin per pipeline loop (:func:`pipeline_pins`): its operands and results take the layouts the
  pipeline chose: stacked weights ``P("pp", None, None, ...)``, the rest as planned for one
  micro-batch.  The search plans everything around it.
"""

from __future__ import annotations

import re
from typing import Any

from jaxpar._src.compat import jaxpr_function_name, name_stack
from jaxpar._src.errors import PlanError, warn_once
from jaxpar._src.graph import NodeKind
from jaxpar._src.pipeline.loop import LOOP_NAME, LOOP_SCOPE
from jaxpar._src.rules import register_rule, specs_for
from jaxpar._src.rules.factors import FactorRule, RuleBuilder
from jaxpar._src.rules.registry import OpView, replicated_rule
from jaxpar._src.search import Pin, SearchSpace
from jaxpar._src.spec import MeshShape, Spec

_SCOPE_RE = re.compile(LOOP_SCOPE + r"(\d+)")
_PROGRAMS: dict[int, Any] = {}  # program id -> PipelineProgram, the most recent ones


def register(program: Any) -> None:
    """Remembers ``program`` so the plan of the step it runs in can pin its loop."""
    _PROGRAMS[program.id] = program
    while len(_PROGRAMS) > 256:
        _PROGRAMS.pop(next(iter(_PROGRAMS)))


def is_pipeline_loop(params: Any) -> bool:
    return jaxpr_function_name(params.get("jaxpr")) == LOOP_NAME


@register_rule("shard_map")
def _shard_map_rule(op: OpView) -> FactorRule:
    if not is_pipeline_loop(op.params):
        warn_once("unsupported:shard_map",
                  "jaxpar has no sharding rule for primitive 'shard_map'; it is computed "
                  "replicated (correct, but every device does all of its work). Register one "
                  "with jaxpar.register_rule('shard_map') if it matters.")
        return replicated_rule(op)
    b = RuleBuilder()
    return b.build([b.factors(s) for s in op.in_shapes], [b.factors(s) for s in op.out_shapes])


def loop_specs(program: Any, *, backward: bool) -> tuple[list[Spec], list[Spec]]:
    """The layouts of a pipeline loop's operands and results on the whole mesh."""
    w = [program.weight_spec(j) for j in range(len(program.stacked))]
    rest = [program.spec(v) for v in program.rest]
    batch = [program.batch_spec(j) for j in range(len(program.batch))]
    ins = w + rest + batch
    grads = [program.grad_spec(j) for j in range(len(program.stacked))]
    g_rest = [program.rest_grad_spec(i) for i in range(len(program.rest))]
    outs = [Spec(())] + (grads + g_rest + batch if backward else [])
    return ins, outs


def pipeline_pins(space: SearchSpace, mesh: MeshShape) -> list[Pin]:
    """A pin for every pipeline loop of the traced program (see the module docstring)."""
    pins = []
    for node in space.graph.nodes:
        if node.kind is not NodeKind.OP or node.name != "shard_map" or not is_pipeline_loop(
                node.eqn.params):
            continue
        found = _SCOPE_RE.findall(name_stack(node.eqn))
        program = _PROGRAMS.get(int(found[-1])) if found else None
        if program is None:
            raise PlanError(f"jaxpar: a pipeline loop at {node.source} belongs to no pipeline "
                            f"this process built; trace the step again.")
        backward = len(node.outputs) > 1
        ins, outs = loop_specs(program, backward=backward)
        extra = len(node.inputs) - len(ins)  # constants the body closes over come first
        ins = [Spec.replicated(len(space.graph.operand_shape(o)))
               for o in node.inputs[:max(extra, 0)]] + ins
        if len(ins) != len(node.inputs) or len(outs) != len(node.outputs):
            raise PlanError(f"jaxpar: internal error: the pipeline loop at {node.source} has "
                            f"{len(node.inputs)} operands and {len(node.outputs)} results, "
                            f"expected {len(ins)} and {len(outs)}.")
        strategy = _opaque_strategy(space.rule(node.id), ins + outs, mesh)
        if strategy is None:
            shapes = [space.graph.operand_shape(o) for o in node.inputs] + [
                space.graph.values[v].shape for v in node.outputs]
            raise PlanError(f"jaxpar: internal error: the pipeline loop's layouts "
                            f"{[str(x) for x in ins + outs]} do not fit its shapes {shapes} "
                            f"on mesh {mesh}.")
        pins.append(Pin(node.id, strategy, "pipeline"))
    return pins


def _opaque_strategy(rule: FactorRule, specs: list[Spec], mesh: MeshShape) -> Any:
    """The strategy giving every operand and result of an opaque operator its own layout.

    A factor rule's strategies use each mesh axis for one factor (one loop nest); the loop's
    operands are laid out independently (every stacked weight on ``"pp"``), so the strategy
    is assembled from the layouts directly.  Its own cost is nil: the loop's work and
    communication are priced by the pipeline's timeline, not by the step's plan."""
    tensors = list(rule.operands) + list(rule.results)
    axes: list[tuple[str, ...]] = [()] * len(rule.sizes)
    for tensor, spec in zip(tensors, specs, strict=True):
        if len(tensor) != spec.ndim:
            return None
        for dim, dim_axes in zip(tensor, spec.dims, strict=True):
            if not dim_axes:
                continue
            if len(dim) != 1 or rule.sizes[dim[0]] % mesh.product(dim_axes):
                return None
            axes[dim[0]] = tuple(dim_axes)
    return specs_for(rule, axes)


def _distinct(loops: list[tuple[int, Any]]) -> list[Any]:
    """The pipelines of :func:`loops_in`'s loops, each once, in order."""
    out: list[Any] = []
    for _, program in loops:
        if program not in out:
            out.append(program)
    return out


def loops_in(graph: Any) -> list[tuple[int, Any]]:
    """``(node id, program)`` of every pipeline loop of a traced graph this process built."""
    if not _PROGRAMS:  # no pipeline built in this process: no pass over the graph
        return []
    out = []
    for node in graph.nodes:
        if node.kind is NodeKind.OP and node.name == "shard_map" and is_pipeline_loop(
                node.eqn.params):
            found = _SCOPE_RE.findall(name_stack(node.eqn))
            program = _PROGRAMS.get(int(found[-1])) if found else None
            if program is not None:
                out.append((node.id, program))
    return out


def pipeline_settings(ctx: Any, micro_batches: int | None, where: str) -> Any:
    """The pipeline part of a ``parallelize``'s settings: the context's stages and
    ``pipeline_config``, its micro-batch count unless ``micro_batches`` (checked by
    ``parallelize_info``) is given."""
    from jaxpar._src.pipeline.config import PipelineConfig
    from jaxpar._src.pipeline.tracing import PipelineSettings

    given = micro_batches is not None or ctx.micro_batches is not None
    config = PipelineConfig.from_options(
        ctx.pipeline_stages, dict(ctx.pipeline_config),
        micro_batches=micro_batches if micro_batches is not None else ctx.micro_batches,
        where=where)
    return PipelineSettings(config, given)


def attach_pipeline(plan: Any, graph: Any) -> Any:
    """``plan`` with the :class:`PipelinePlan` of the pipeline its program runs, if any."""
    import dataclasses

    from jaxpar._src.pipeline.report import PipelinePlan

    loops = loops_in(graph)
    programs = _distinct(loops)
    if not programs:
        return plan
    notes = plan.notes
    if len(programs) > 1:
        notes += (f"{len(programs)} pipelines run in this step; plan.pipeline describes the "
                  f"first",)
    backward = any(len(graph.nodes[nid].outputs) > 1 for nid, p in loops if p is programs[0])
    return dataclasses.replace(plan, pipeline=PipelinePlan.of(programs[0], backward=backward),
                               notes=notes)
