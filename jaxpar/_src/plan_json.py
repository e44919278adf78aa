"""``ShardingPlan`` <-> JSON.  The format is versioned; a plan file of another format is refused."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any, overload

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
    """Layouts as JSON data: each ``Spec.to_json()`` but as the spec's own tuples (the same
    text; a plan entry writes about 30,000 layouts of a few distinct ones: issue 14)."""
    return [s.dims for s in specs]


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
        "in_shapes": d.in_shapes, "out_shapes": d.out_shapes,  # (tuples: the same text)
        "in_specs": _specs(d.in_specs), "out_specs": _specs(d.out_specs), "origin": d.origin,
        "weight": d.weight, "flops": d.flops,
        "collectives": [_coll_to(c) for c in d.collectives],
        "redistributions": [{
            "producer": r.producer, "out_index": r.out_index, "consumer": r.consumer,
            "in_index": r.in_index, "src": r.src.dims, "dst": r.dst.dims,
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


def plan_from_dict(data: dict, *, source: str = "jaxpar", lazy: bool = False) -> ShardingPlan:
    """The plan of ``data`` (:func:`plan_to_dict`'s form).  With ``lazy``, its decisions are
    a :class:`LoadedDecisions`, each converted when first read (the plan cache's loaded
    plans: a call whose executable is loaded reads a few)."""
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
    raw = data["decisions"]
    if not isinstance(raw, list):
        raise TypeError(f"its decisions are a {type(raw).__name__}, not a list")
    decisions: Sequence[OpDecision] = LoadedDecisions(raw, seen, source) if lazy else \
        tuple(_decision_from(d, seen) for d in raw)
    return ShardingPlan(mesh, tuple(data["device_ids"]), data["parallel_mode"],
                        data["search_mode"], decisions,
                        tuple(data["inputs"]), tuple(data["outputs"]), tuple(data["notes"]),
                        **scalars,
                        collectives=tuple(_coll_from(c) for c in data.get("collectives", ())),
                        optimizer_level=int(data.get("optimizer_level", 0)),
                        scatters=scatters)


class LoadedDecisions(Sequence[OpDecision]):
    """A loaded plan's decisions, each converted from its JSON form (:func:`plan_to_dict`)
    when first read, then kept: the same :class:`OpDecision` as :func:`plan_from_dict`
    without ``lazy`` makes.

    A plan cache hit whose executable is loaded too reads the decisions of the arguments and
    results (their layouts; a tenth of the nodes of a GPT step) and, to check that the entry
    fits the program, every node's kind, operator and result shapes (:meth:`header`, read
    from the JSON form); the rest are converted when asked for (``plan.explain()``, the
    lowering where the executable fails to load).  It compares, hashes and pickles as the
    tuple of its decisions.  The plan cache makes one only for an entry whose executable is
    kept beside it (whose key holds the digest of the entry's text: jaxpar wrote it); should
    a decision still fail to convert, it raises a :class:`PlanError` naming the entry when
    it is read.

    >>> from jaxpar._src.spec import Spec
    >>> d = OpDecision(0, "input", "x", "", "x", (), ((8,),), (), (Spec((("dp",),)),),
    ...                "pinned", 0.0, (), ())
    >>> loaded = LoadedDecisions([_decision_to(d)], {}, "a test")
    >>> loaded.header(0), loaded[0] == d, loaded == (d,), list(loaded) == [d]
    (('input', 'x', ((8,),)), True, True, True)
    """

    __slots__ = ("_raw", "_made", "_seen", "_source")

    def __init__(self, raw: list[dict], seen: dict, source: str) -> None:
        self._raw, self._seen, self._source = raw, seen, source
        self._made: list[OpDecision | None] = [None] * len(raw)

    def __len__(self) -> int:
        return len(self._raw)

    @overload
    def __getitem__(self, i: int) -> OpDecision: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[OpDecision, ...]: ...

    def __getitem__(self, i: int | slice) -> OpDecision | tuple[OpDecision, ...]:
        if isinstance(i, slice):
            return tuple(self._get(j) for j in range(*i.indices(len(self._raw))))
        return self._get(i)

    def _get(self, i: int) -> OpDecision:
        made = self._made[i]
        if made is None:
            try:
                made = _decision_from(self._raw[i], self._seen)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
                raise PlanError(
                    f"jaxpar: decision {i % len(self._raw)} of {self._source} is not "
                    f"well-formed ({type(e).__name__}: {e}); delete the file (it is written "
                    f"anew)") from None
            self._made[i] = made
        return made

    def __iter__(self) -> Iterator[OpDecision]:
        return (self._get(i) for i in range(len(self._raw)))

    def header(self, i: int) -> tuple[str, str, tuple[tuple[int, ...], ...]]:
        """Decision ``i``'s kind, operator and result shapes, read without converting it."""
        d = self._raw[i]
        return d["kind"], d["name"], tuple(map(tuple, d["out_shapes"]))

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, (tuple, LoadedDecisions)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def __add__(self, other: Sequence[OpDecision]) -> tuple[OpDecision, ...]:
        return tuple(self) + tuple(other)

    def __radd__(self, other: Sequence[OpDecision]) -> tuple[OpDecision, ...]:
        return tuple(other) + tuple(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (tuple(self),)  # unpickled as the tuple it stands for


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
