"""``ShardingPlan`` <-> JSON.  The format is versioned; a plan file of another format is refused."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxpar._src.errors import PlanError
from jaxpar._src.plan import OpDecision, PredictedCollective, Redistribution, ShardingPlan
from jaxpar._src.spec import MeshShape, Spec

FORMAT = "jaxpar.plan/3"  # 3: the optimizer level and the reduce-scatters (ZeRO levels 1-3)
READS = (FORMAT, "jaxpar.plan/2")  # a /2 plan was made with the parallel optimizer off or
# lowered its gradients by all-reduce: it reads as level 0 (no reduce-scatters)
_PLAN_SCALARS = ("parallel_mode", "search_mode", "hardware", "flops_per_s", "memory_bytes",
                 "memory_budget", "search_s", "objective_s", "baseline_s", "optimal")
_OPTIONAL_SCALARS = ("compute_s", "step_s")  # absent from plans saved before they existed


def _coll_to(c: PredictedCollective) -> dict:
    # dataclasses.asdict's fields, without its deep copies (the fields are plain values; a
    # 24-layer plan writes thousands of collectives)
    out = {name: getattr(c, name) for name in _COLL_FIELDS}
    out["axes"] = list(c.axes)
    return out


_COLL_FIELDS = tuple(f.name for f in dataclasses.fields(PredictedCollective))


def _coll_from(d: dict) -> PredictedCollective:
    return PredictedCollective(d["kind"], tuple(d["axes"]), d["nbytes"], d["wire_bytes"],
                               d["time"], d["count"], d.get("members", 1),
                               d.get("deferred", False))


def _specs(specs: Any) -> list:
    return [s.to_json() for s in specs]


def _unspecs(data: Any, seen: dict | None = None) -> tuple[Spec, ...]:
    return tuple(_unspec(s, seen) for s in data)


def _unspec(data: Any, seen: dict | None) -> Spec:
    """``Spec.from_json(data)``; ``seen`` keeps the layouts read so far (a plan repeats a few
    layouts thousands of times: each is built once)."""
    if seen is None:
        return Spec.from_json(data)
    key = tuple(map(tuple, data))
    spec = seen.get(key)
    if spec is None:
        spec = seen[key] = Spec(key)
    return spec


def _decision_to(d: OpDecision) -> dict:
    out = {
        "node": d.node, "kind": d.kind, "name": d.name, "source": d.source, "label": d.label,
        "in_shapes": [list(s) for s in d.in_shapes], "out_shapes": [list(s) for s in d.out_shapes],
        "in_specs": _specs(d.in_specs), "out_specs": _specs(d.out_specs), "origin": d.origin,
        "weight": d.weight, "flops": d.flops,
        "collectives": [_coll_to(c) for c in d.collectives],
        "redistributions": [{
            "producer": r.producer, "out_index": r.out_index, "consumer": r.consumer,
            "in_index": r.in_index, "src": r.src.to_json(), "dst": r.dst.to_json(),
            "collectives": [_coll_to(c) for c in r.collectives]} for r in d.redistributions],
    }
    if d.category != "other":
        out["category"] = d.category
    if d.terms is not None:
        out["terms"] = list(d.terms)
    if d.runner_up is not None:
        out["runner_up"] = [_specs(d.runner_up[0]), _specs(d.runner_up[1])]
        out["runner_up_extra_s"] = d.runner_up_extra_s
    return out


def _decision_from(d: dict, seen: dict | None = None) -> OpDecision:
    return OpDecision(
        d["node"], d["kind"], d["name"], d["source"], d["label"],
        tuple(tuple(s) for s in d["in_shapes"]), tuple(tuple(s) for s in d["out_shapes"]),
        _unspecs(d["in_specs"], seen), _unspecs(d["out_specs"], seen), d["origin"], d["weight"],
        tuple(_coll_from(c) for c in d["collectives"]),
        tuple(Redistribution(r["producer"], r["out_index"], r["consumer"], r["in_index"],
                             _unspec(r["src"], seen), _unspec(r["dst"], seen),
                             tuple(_coll_from(c) for c in r["collectives"]))
              for r in d["redistributions"]),
        flops=d.get("flops", 0.0),
        terms=tuple(d["terms"]) if "terms" in d else None,
        runner_up=(_unspecs(d["runner_up"][0], seen), _unspecs(d["runner_up"][1], seen))
        if "runner_up" in d else None,
        runner_up_extra_s=d.get("runner_up_extra_s", 0.0),
        category=d.get("category", "other"))


def plan_to_dict(plan: ShardingPlan) -> dict:
    out: dict[str, Any] = {
        "format": FORMAT,
        "mesh": {"names": list(plan.mesh.names), "sizes": list(plan.mesh.sizes)},
        "device_ids": list(plan.device_ids), "inputs": list(plan.inputs),
        "outputs": list(plan.outputs), "notes": list(plan.notes)}
    out.update({k: getattr(plan, k) for k in _PLAN_SCALARS + _OPTIONAL_SCALARS})
    out["collectives"] = [_coll_to(c) for c in plan.collectives]
    out["optimizer_level"] = plan.optimizer_level
    out["scatters"] = [{"node": node, **_plain(dataclasses.asdict(sc))}
                       for node, sc in plan.scatters]
    out["decisions"] = [_decision_to(d) for d in plan.decisions]
    return out


def plan_from_dict(data: dict, *, source: str = "jaxpar") -> ShardingPlan:
    if data.get("format") not in READS:
        raise PlanError(f"jaxpar: {source} is not a plan file of format {FORMAT!r} "
                        f"(found {data.get('format')!r}).")
    mesh = MeshShape(tuple(data["mesh"]["names"]), tuple(data["mesh"]["sizes"]))
    # JSON values, typed as the fields they fill.
    scalars: dict[str, Any] = {k: data[k] for k in _PLAN_SCALARS
                               if k not in ("parallel_mode", "search_mode")}
    scalars.update({k: data.get(k) for k in _OPTIONAL_SCALARS})
    seen: dict = {}
    scatters: tuple[tuple[int, Any], ...] = ()
    if data.get("scatters"):
        from jaxpar._src.scatter import Scatter  # it reads plans: imported when met

        scatters = tuple((int(d["node"]), Scatter(**{k: _tuples(v) for k, v in d.items()
                                                      if k != "node"}))
                         for d in data["scatters"])
    return ShardingPlan(mesh, tuple(data["device_ids"]), data["parallel_mode"],
                        data["search_mode"],
                        tuple(_decision_from(d, seen) for d in data["decisions"]),
                        tuple(data["inputs"]), tuple(data["outputs"]), tuple(data["notes"]),
                        **scalars,
                        collectives=tuple(_coll_from(c) for c in data.get("collectives", ())),
                        optimizer_level=int(data.get("optimizer_level", 0)),
                        scatters=scatters)


def _plain(x: Any) -> Any:
    """JSON's form of a dataclass's fields: tuples as lists."""
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _tuples(x: Any) -> Any:
    """The inverse of :func:`_plain` for frozen dataclasses' fields: lists as tuples."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
