"""Where each plan node sits in the user's program: its layer, module path and source line.

A plan records each node's innermost source line; a report also groups nodes by layer and by
module path (``train_step › loss_fn › GPT › Block › Attention``).  Those come from the traced
program when it is at hand (plans made by ``parallelize`` in this process remember it), else
from the compiled program's op metadata (the stack frames of instructions that name a node),
else from the plan alone.

A node's *layer* is the numbered module (``blocks.3``) of the nearest argument leaf whose path
has a number (``params.blocks.3.attn.q.kernel``), nearest along the graph's edges; nodes nearer
to unnumbered leaves (the embedding, the head, the loss) are outside the layers.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
import weakref
from collections.abc import Mapping
from typing import Any

from jaxpar._src.compat import name_stack, source_frames
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.report.hlo_meta import HloIndex, short_path

OUTSIDE = "outside layers"
_NUMBER = re.compile(r"^\d+$")
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]")

_PROGRAMS: dict[int, Any] = {}  # id(plan) -> its OpGraph, while the plan lives


def remember(plan: ShardingPlan, graph: Any) -> None:
    """Keeps ``graph`` (the traced program) for reports on ``plan`` while the plan lives."""
    key = id(plan)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = graph
        weakref.finalize(plan, _PROGRAMS.pop, key, None)


def graph_of(plan: ShardingPlan) -> Any | None:
    """The traced program ``plan`` was made from, if this process made it."""
    graph = _PROGRAMS.get(id(plan))
    if graph is not None and len(graph.nodes) != len(plan.decisions):
        return None
    return graph


@dataclasses.dataclass(frozen=True)
class NodeContext:
    """Layer, module path and source location of one node."""

    layer: str  # "blocks.3", OUTSIDE, or "" when unknown
    module: tuple[str, ...]  # outermost first: ("train_step", "loss_fn", "GPT", "Block")
    location: str  # "examples/gpt.py:59 (Attention.__call__)" or the plan's source
    backward: bool  # part of a transposed (backward) computation


def layer_key(label: str) -> str:
    """The numbered module of an argument path, or ``""``.

    >>> layer_key("params.blocks.3.attn.q.kernel.value"), layer_key("opt_state.0.count")
    ('blocks.3', '')
    """
    parts = label.split(".")
    for i in range(len(parts) - 1, 1, -1):
        if _NUMBER.match(parts[i]) and not _NUMBER.match(parts[i - 1]):
            return f"{parts[i - 1]}.{parts[i]}"
    return ""


def node_contexts(plan: ShardingPlan, graph: Any = None, hlo: HloIndex | None = None
                  ) -> tuple[NodeContext, ...]:
    """A :class:`NodeContext` per plan node, from the best source at hand."""
    graph = graph if graph is not None else graph_of(plan)
    near: dict[int, int] = {}
    if graph is not None:
        frames = {n.id: source_frames(n.eqn) for n in graph.nodes if n.eqn is not None}
        backward = {n.id for n in graph.nodes
                    if n.eqn is not None and "transpose(" in name_stack(n.eqn)}
        adj = _edges(graph)
        layers = _layers(plan, adj)
        near = _nearest_located(frames, adj)
    else:
        frames, backward = {}, set()
        if hlo is not None:
            for node, meta in hlo.node_metadata().items():
                frames[node] = tuple((f.file, f.line, f.function) for f in meta.frames)
                if "transpose(" in meta.op_name:
                    backward.add(node)
        layers = {n: layer_key(plan.decisions[n].label) or OUTSIDE for n in plan.inputs} \
            if _has_layers(plan) else {}
    out = []
    for d in plan.decisions:
        f = frames.get(d.node, ())
        location = _location(f)
        if not location and d.node in near:  # JAX's own code (a transpose): say where it is
            f = frames[near[d.node]]
            location = f"near {_location(f)}"
        out.append(NodeContext(layers.get(d.node, ""), module_path(f) or _fallback_module(d),
                               location or d.source, d.node in backward))
    return tuple(out)


def _nearest_located(frames: Mapping[int, tuple], adj: Mapping[int, list[int]],
                     hops: int = 4) -> dict[int, int]:
    """For operators without a user frame, the nearest node (within ``hops`` edges) with one."""
    out = {}
    for n, f in frames.items():
        if f:
            continue
        seen, layer = {n}, [n]
        for _ in range(hops):
            layer = [m for x in layer for m in adj.get(x, ()) if m not in seen]
            seen.update(layer)
            hit = next((m for m in sorted(layer) if frames.get(m)), None)
            if hit is not None:
                out[n] = hit
                break
    return out


@functools.lru_cache(maxsize=1 << 14)
def module_path(frames: tuple[tuple[str, int, str], ...]) -> tuple[str, ...]:
    """Frames (innermost first) as a module path, outermost first.

    >>> module_path((("linear.py", 1, "Linear.__call__"), ("gpt.py", 9, "Block.__call__"),
    ...              ("gpt.py", 2, "make.<locals>.train_step"), ("run.py", 1, "<module>")))
    ('train_step', 'Block', 'Linear')
    """
    out: list[str] = []
    for _, _, function in reversed(frames):
        parts = [p for p in function.split(".") if p != "<locals>"]
        if not parts or parts[-1] == "<module>":
            continue
        if parts[-1] == "__call__" and len(parts) > 1:
            name = parts[-2]
        elif len(parts) > 1 and parts[-2][:1].isupper():
            name = f"{parts[-2]}.{parts[-1]}"
        else:
            name = parts[-1]
        if not out or out[-1] != name:
            out.append(name)
    return tuple(out)


def _fallback_module(d: Any) -> tuple[str, ...]:
    m = re.search(r"\((.*)\)$", d.source)
    return (m.group(1),) if m else ()


@functools.lru_cache(maxsize=1 << 14)
def _location(frames: tuple[tuple[str, int, str], ...]) -> str:
    if not frames:
        return ""
    own = [f for f in frames if not _LIBRARY.search(f[0])]
    file, line, function = (own or frames)[0]
    if "<locals>" in function:  # make_train_step.<locals>.train_step -> train_step
        function = function.rsplit(".", 1)[-1]
    return f"{short_path(file)}:{line} ({function})"


def _has_layers(plan: ShardingPlan) -> bool:
    return any(layer_key(plan.decisions[n].label) for n in plan.inputs)


def _edges(graph: Any) -> dict[int, list[int]]:
    """Undirected adjacency of the graph's nodes."""
    producer = [v.producer for v in graph.values]
    adj: dict[int, list[int]] = {n.id: [] for n in graph.nodes}
    for node in graph.nodes:
        mine = adj[node.id]
        for operand in node.inputs:
            if type(operand) is int:  # a value (literals are Const)
                p = producer[operand]
                mine.append(p)
                adj[p].append(node.id)
    return adj


def _layers(plan: ShardingPlan, adj: Mapping[int, list[int]]) -> dict[int, str]:
    """Each node's layer: that of the nearest labelled argument (numbered ones win ties)."""
    if not _has_layers(plan):
        return {}
    keys = {n: layer_key(plan.decisions[n].label) for n in plan.inputs}
    order = [n for n in plan.inputs if keys[n]] + [n for n in plan.inputs if not keys[n]]
    found = {n: keys[n] or OUTSIDE for n in order}
    queue = collections.deque(order)
    while queue:
        n = queue.popleft()
        for m in adj.get(n, ()):
            if m not in found:
                found[m] = found[n]
                queue.append(m)
    return found
