"""Plan files: reading, writing, and checking a saved plan against the program it is reused for.

Every failure is a :class:`PlanError` that names the file: text that is not JSON, JSON of another
structure, a missing file or directory, a plan saved for other arguments (which argument, and
how it differs).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from jaxpar._src.errors import PlanError
from jaxpar._src.graph import OpGraph
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.plan_json import FORMAT, READS, LoadedDecisions, plan_from_dict


def plan_from_json(text: str, *, source: str = "the text") -> ShardingPlan:
    """The plan in ``text`` (JSON written by :meth:`ShardingPlan.to_json`).

    >>> plan_from_json('{"format": "jaxpar.plan/3", "mesh": []}', source="p.json")
    Traceback (most recent call last):
    ...
    jaxpar._src.errors.PlanError: jaxpar: p.json is not a well-formed jaxpar.plan/3 plan \
(TypeError: list indices must be integers or slices, not str). Write plan files with \
plan.save(path) or strategy_ckpt_save_file, and do not edit them by hand.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"jaxpar: {source} is not a plan file: it is not JSON ({e.msg} at line "
                        f"{e.lineno}, column {e.colno}). Write plan files with plan.save(path) or "
                        f"strategy_ckpt_save_file.") from None
    if not isinstance(data, dict):
        raise PlanError(f"jaxpar: {source} is not a plan file: it holds a JSON "
                        f"{type(data).__name__}, not an object with 'format': {FORMAT!r}.")
    try:
        return plan_from_dict(data, source=source)
    except PlanError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        form = data.get("format") if data.get("format") in READS else FORMAT
        raise PlanError(f"jaxpar: {source} is not a well-formed {form} plan ({what}). Write "
                        f"plan files with plan.save(path) or strategy_ckpt_save_file, and do not "
                        f"edit them by hand.") from None


def load_plan(path: str | os.PathLike) -> ShardingPlan:
    """The plan saved at ``path``; every failure names the file."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise PlanError(f"jaxpar: plan file {os.fspath(path)!r} does not exist.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"jaxpar: cannot read plan file {os.fspath(path)!r}: {e}.") from None
    return plan_from_json(text, source=f"plan file {os.fspath(path)!r}")


def check_save_path(path: str | os.PathLike, where: str) -> None:
    """Raises unless a plan could be written at ``path`` (its directory exists), so a bad
    ``strategy_ckpt_save_file`` is reported before planning rather than after it.

    >>> check_save_path("/no/such/dir/plan.json", "jaxpar")
    Traceback (most recent call last):
    ...
    jaxpar._src.errors.PlanError: jaxpar: cannot save the plan to '/no/such/dir/plan.json': \
directory '/no/such/dir' does not exist. Create it first, or choose another path.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PlanError(f"{where}: cannot save the plan to {path!r}: it is a directory. Give a "
                        f"file name such as {os.path.join(path, 'plan.json')!r}.")
    if not os.path.isdir(folder):
        raise PlanError(f"{where}: cannot save the plan to {path!r}: directory "
                        f"{os.path.dirname(path) or folder!r} does not exist. Create it first, "
                        f"or choose another path.")


def save_plan(plan: ShardingPlan, path: str | os.PathLike) -> None:
    check_save_path(path, "jaxpar: ShardingPlan.save")
    try:
        with open(path, "w") as f:
            f.write(plan.to_json())
    except OSError as e:
        raise PlanError(f"jaxpar: cannot save the plan to {os.fspath(path)!r}: {e}.") from None


def structure_mismatch(saved: ShardingPlan, graph: OpGraph) -> str | None:
    """How the program ``saved`` was made for differs from ``graph``, or ``None``: its
    arguments (:func:`input_mismatch`), its node count, or the first node whose kind, operator or
    result shapes differ."""
    differs = input_mismatch(saved, graph)
    if differs is not None:
        return differs
    if len(saved.decisions) != len(graph.nodes):
        return (f"it has {len(saved.decisions)} nodes; this program has {len(graph.nodes)}. It was "
                f"made for another program or other argument shapes")
    decisions = saved.decisions
    # a loaded plan's headers are read without converting its decisions (plan_json.py)
    headers = (decisions.header(i) for i in range(len(decisions))) \
        if isinstance(decisions, LoadedDecisions) else \
        ((d.kind, d.name, d.out_shapes) for d in decisions)
    for node, there in zip(graph.nodes, headers, strict=True):
        shapes = tuple(graph.values[v].shape for v in node.outputs)
        if (node.kind, node.name, shapes) != there:
            kind, name, out_shapes = there
            return (f"at node {node.id}: here {node.kind} {node.name} {list(shapes)} "
                    f"({node.source}), in the file {kind} {name} "
                    f"{[list(s) for s in out_shapes]}")
    return None


def input_mismatch(saved: ShardingPlan, graph: OpGraph) -> str | None:
    """How the arguments ``saved`` was made for differ from ``graph``'s, or ``None``.

    The first difference is named: an argument leaf only one side has, or one whose shape
    differs.
    """
    def leaves(labels: Sequence[str], shapes: Sequence[tuple[int, ...]]) -> dict[str, list]:
        return {label: list(shape) for label, shape in zip(labels, shapes, strict=True)}

    there = leaves([saved.decisions[n].label for n in saved.inputs],
                   [saved.decisions[n].out_shapes[0] for n in saved.inputs])
    here = leaves([graph.nodes[n].label for n in graph.inputs],
                  [graph.values[graph.nodes[n].outputs[0]].shape for n in graph.inputs])
    for label, shape in here.items():
        if label not in there:
            return (f"argument '{label}' (shape {shape}) is not in the file, whose arguments "
                    f"are {', '.join(there) or 'none'}")
        if there[label] != shape:
            return (f"argument '{label}' has shape {shape} here but {there[label]} in the file")
    missing = [label for label in there if label not in here]
    if missing:
        return f"the file has argument(s) {', '.join(missing)} this call does not pass"
    return None
