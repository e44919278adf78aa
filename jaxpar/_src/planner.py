"""Choosing every node's strategy for a mode, MindSpore's strategy checkpoint files, and the
:class:`ShardingPlan` that a choice makes (:func:`make_plan`: every node and edge priced).

* ``stand_alone``: everything replicated on one device;
* ``data_parallel`` and ``semi_auto_parallel``: sharding propagation from the pins;
* ``auto_parallel``: the registered search mode (``search/modes.py``: ``sharding_propagation``,
  ``recursive_programming``, ``dynamic_programming``, ``optimal``);
* ``strategy_ckpt_load_file``: the strategies of a saved plan, checked against this program,
  instead of any search (MindSpore's ``strategy_ckpt_load_file``); ``strategy_ckpt_save_file``
  writes the plan after planning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from jaxpar._src.context import ParallelMode, algo_parameters
from jaxpar._src.cost import CostModel
from jaxpar._src.errors import PlanError
from jaxpar._src.graph import Const, NodeKind, OpGraph
from jaxpar._src.plan import OpDecision, PredictedCollective, Redistribution, ShardingPlan
from jaxpar._src.plan_files import input_mismatch, structure_mismatch
from jaxpar._src.regather import split_inputs
from jaxpar._src.rules import OpStrategy, strategy_for_specs
from jaxpar._src.scatter import Scatter, unscattered
from jaxpar._src.search import (
    Assignment,
    Pin,
    SearchRequest,
    SearchResult,
    SearchSpace,
    get_search,
)
from jaxpar._src.search.memory import peak_memory


def decide(space: SearchSpace, pins: Sequence[Pin], ties: Sequence[tuple[int, int]], *,
           mode: ParallelMode, search_mode: str, baseline_pins: Sequence[Pin] | None,
           api: str) -> SearchResult:
    """Every searchable node's strategy for ``mode``: replicated (``stand_alone``),
    propagated from the pins (``data_parallel``, ``semi_auto_parallel``), or searched by the
    registered ``search_mode`` (``auto_parallel``)."""
    graph = space.graph
    if mode is ParallelMode.STAND_ALONE:
        return SearchResult(
            Assignment({n.id: space.candidates(n.id)[0] for n in graph.searchable()},
                       {n.id: "stand_alone" for n in graph.searchable()}), "none")
    name = search_mode if mode is ParallelMode.AUTO_PARALLEL else "sharding_propagation"
    request = SearchRequest(space, tuple(pins), tuple(ties),
                            None if baseline_pins is None else tuple(baseline_pins),
                            algo_parameters().fully_use_devices, api)
    return get_search(name, where=api)(request)


def load_strategies(path: str, space: SearchSpace, *, api: str) -> SearchResult:
    """The strategies of the plan saved at ``path``, checked node by node against this graph."""
    try:
        saved = ShardingPlan.load(path)
    except FileNotFoundError:
        raise PlanError(f"{api}: strategy_ckpt_load_file {path!r} does not exist.") from None
    graph = space.graph
    mesh = space.model.mesh
    if saved.mesh != mesh:
        raise PlanError(f"{api}: the strategy file {path!r} was made for mesh {saved.mesh}, "
                        f"this program runs on mesh {mesh}.")
    differs = input_mismatch(saved, graph)
    if differs is not None:
        raise PlanError(
            f"{api}: the strategy file {path!r} does not match this program: {differs}. It was "
            f"saved for other arguments: call with those, or plan this call afresh (unset "
            f"strategy_ckpt_load_file; strategy_ckpt_save_file writes a new one).")
    differs = structure_mismatch(saved, graph)
    if differs is not None:
        raise PlanError(f"{api}: the strategy file {path!r} does not match this program: "
                        f"{differs}.")
    strategies, origins = {}, {}
    scattered = dict(saved.scatters)
    for node, d in zip(graph.nodes, saved.decisions, strict=True):
        if node.kind is NodeKind.CONTROL:
            continue
        specs = {("in", i): s for i, s in enumerate(d.in_specs)}
        specs.update({("out", j): s for j, s in enumerate(d.out_specs)})
        # its rule's layout: the result before the reduce-scatter (a partial sum has it)
        if node.id in scattered and not scattered[node.id].partial:
            specs[("out", 0)] = unscattered(d.out_specs[0], scattered[node.id])
        strategy = strategy_for_specs(space.rule(node.id), specs, mesh)
        if strategy is None:
            raise PlanError(f"{api}: the strategy file {path!r} gives node {node.id} "
                            f"({node.name} at {node.source}) layouts its rule does not allow.")
        strategies[node.id] = strategy
        origins[node.id] = f"loaded ({d.origin})" if d.origin else "loaded"
    return SearchResult(Assignment(strategies, origins), f"loaded:{saved.search_mode}")


def make_plan(graph: OpGraph, assignment: Assignment, space: SearchSpace, *, device_ids:
              Sequence[int], parallel_mode: str, search_mode: str,
              notes: Iterable[str] = (), details: Mapping[int, Any] | None = None,
              report: Any = None) -> ShardingPlan:
    """Assembles a plan from a search's assignment, pricing every node and edge.

    ``details`` (per node: cost terms and runner-up) and ``report`` (a search report) come
    from the automatic searches.  At the parallel optimizer's levels 1-3
    (``space.optimizer_level``) the split gradients are made by reduce-scatter, found here once
    (``scatter_plan.py``): the plan holds the layouts and collectives the lowering makes, and
    what it needs to make them (``plan.scatters``).
    """
    model: CostModel = space.model
    optimizer_level = space.optimizer_level
    # the layouts as lowered: at levels 1-3 the gradient split from its contraction on
    strategies, scatters = space.lowered(assignment.strategies)
    details = details or {}
    decisions = _decisions(graph, strategies, assignment.origins, space, details, scatters)
    unreached = sum(1 for o in assignment.origins.values() if o == "unreached")
    notes = list(notes)
    if unreached:
        notes.append(f"{unreached} nodes were not reached by propagation and stay replicated")
    if scatters:
        whole = sum(graph.values[graph.nodes[n].outputs[0]].nbytes for n in scatters) / 2.0**20
        notes.append(f"parallel optimizer level {optimizer_level}: {len(scatters)} split "
                     f"gradients ({whole:.2f} MiB whole) are made by reduce-scatter where the "
                     f"backward pass contracts over the batch, not by all-reduce and a slice")
    hw = model.hw
    assert hw.flops_per_s is not None and hw.memory_per_device is not None, \
        "HardwareProfile fills fields from its preset"
    # as lowered: level 3's second gathers of the inputs the lowering finds split (regather.py)
    priced = space.price(assignment.strategies,
                         regathered=split_inputs(graph, assignment.origins))
    stats: dict[str, Any] = {
        "hardware": hw.preset, "flops_per_s": float(hw.flops_per_s),
        # the search's layouts (memory.py prices the plan's peak from them)
        "memory_bytes": peak_memory(graph, assignment.strategies, model.mesh).peak,
        "memory_budget": float(hw.memory_per_device),
        "collectives": tuple(PredictedCollective.issued(c) for c in priced.collectives),
        "compute_s": priced.compute_s, "step_s": priced.step_s,
        "optimizer_level": optimizer_level, "scatters": tuple(sorted(scatters.items()))}
    if report is not None:
        notes.extend(report.notes)
        stats.update(search_s=report.search_s, objective_s=report.objective_s,
                     baseline_s=report.baseline_s, optimal=report.optimal)
    return ShardingPlan(model.mesh, tuple(int(i) for i in device_ids), parallel_mode,
                        search_mode, decisions, graph.inputs, graph.outputs, tuple(notes),
                        **stats)


def _decisions(graph: OpGraph, strategies: Mapping[int, OpStrategy],
               origins: Mapping[int, str], space: SearchSpace, details: Mapping[int, Any],
               scatters: Mapping[int, Scatter]) -> tuple[OpDecision, ...]:
    """Every node's decision: its layouts, own collectives (a reduce-scatter for the
    contractions in ``scatters``) and the layout changes on its input edges, priced.

    What a decision's pieces depend on is worked out once per kind and shared by the
    nodes of repeated layers (issue 14: this ran per node over the whole graph): a strategy's
    split, its own collectives for the node's result shapes, their prices at the node's loop
    weight, whether two layouts differ; the caches are keyed by the objects' ids, which
    ``strategies`` (and the caches' values) keep alive while this runs."""
    model: CostModel = space.model
    mesh_split = model.split
    values = graph.values
    rules = space._rules
    decisions = []
    names: dict[Any, str] = {}  # each rule category's name (an enum's str() calls Python)
    splits: dict[int, int] = {}  # id(strategy) -> devices its work is split over
    owns: dict[tuple, tuple[PredictedCollective, ...]] = {}  # (id(strategy), shapes, weight)
    differ: dict[tuple[int, int], bool] = {}  # (id(src), id(dst)) -> src != dst
    for node in graph.nodes:
        nid = node.id
        in_shapes = tuple([o.shape if isinstance(o, Const) else values[o].shape
                           for o in node.inputs])
        outputs = node.outputs
        out_shapes = tuple([values[v].shape for v in outputs])
        if node.kind is NodeKind.CONTROL:
            decisions.append(OpDecision.made(nid, "control", node.name, node.source, "",
                                        in_shapes, out_shapes, (), (), "", node.weight, (), ()))
            continue
        strat = strategies[nid]
        scatter = scatters.get(nid)
        weight = node.weight
        priced: tuple[PredictedCollective, ...]
        if scatter is not None and scatter.partial:  # a term of a sum, added locally
            priced = ()
        elif scatter is not None:
            value = values[outputs[0]]
            priced = tuple(PredictedCollective.of(c, weight) for c in model.scatter_collectives(
                scatter.axes, scatter.summed, strat.out_specs[0], value.shape, value.dtype))
        elif not strat.partial:  # (most nodes: no collective of their own)
            priced = ()
        else:
            key = (id(strat), out_shapes, tuple([values[v].dtype for v in outputs]), weight)
            found = owns.get(key)
            if found is None:
                found = owns[key] = tuple(
                    PredictedCollective.of(c, weight)
                    for c in model.op_collectives(strat, out_shapes, key[2]))
            priced = found
        redists = []
        reads = strat.in_specs
        for i, operand in enumerate(node.inputs):  # combine.layout_changes, its ids compared
            if isinstance(operand, Const):
                continue
            value = values[operand]
            producer = value.producer
            src = strategies[producer].out_specs[value.index]
            dst = reads[i]
            if src is dst or producer == nid:
                continue
            pair = (id(src), id(dst))
            changed = differ.get(pair)
            if changed is None:
                changed = differ[pair] = src != dst
            if changed:
                w = space.edge_weight(producer, nid)
                colls = model.redistribution(src, dst, value.shape, value.dtype)
                redists.append(Redistribution(producer, value.index, nid, i, src, dst,
                                              tuple(PredictedCollective.of(c, w) for c in colls)))
        detail = details.get(nid)
        extra: dict[str, Any] = {}  # OpDecision's optional fields, set where known
        if detail is not None:
            extra["terms"] = (detail.compute_s, detail.comm_s, detail.redistribution_s)
            if detail.runner_up is not None:
                extra["runner_up"] = (detail.runner_up.in_specs, detail.runner_up.out_specs)
                extra["runner_up_extra_s"] = detail.runner_up_extra_s
        rule = rules.get(nid)
        if rule is None:
            rule = space.rule(nid)
        category = rule.category
        name = names.get(category)
        if name is None:
            name = names[category] = str(category)
        split = splits.get(id(strat))
        if split is None:
            split = splits[id(strat)] = mesh_split(strat)
        decisions.append(OpDecision.made(
            nid, node.kind, node.name, node.source, node.label, in_shapes, out_shapes,
            strat.in_specs, strat.out_specs, origins.get(nid, ""), weight, priced,
            tuple(redists), flops=rule.flops / split * weight,  # space.flops, its split kept
            category=name, **extra))
    return tuple(decisions)
