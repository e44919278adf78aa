"""User strategies for whole arguments and results: trees of strategies, names, and pins.

``in_strategy`` has one entry per positional argument; an entry is one strategy (applied to every
array of that argument) or a tree of strategies that is a prefix of the argument's pytree.
``parameter_plan`` maps parameter names (``"w1"``, ``"params.layers.0.kernel"``, or glob
patterns such as ``"*.kernel"``) to strategies.  Both are normalised into one :class:`Spec` (or
``None``) per flattened array.

:func:`gather_pins` collects every pin of one traced program (the mode's, ``dataset_strategy``'s,
the user's strategies, ``with_sharding_constraint`` in the function) as a pure function of the
validated :class:`ParallelizeInfo` and the program; :func:`baseline_pins` gives pure data
parallel's, the yardstick of the automatic searches.
"""

from __future__ import annotations

import difflib
import fnmatch
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jaxpar._src.arguments import ParallelizeInfo
from jaxpar._src.context import ParallelMode
from jaxpar._src.data_parallel import batch_specs, dataset_specs
from jaxpar._src.errors import PlanError, StrategyError
from jaxpar._src.operator_shard import operator_pins
from jaxpar._src.pipeline.outer import pipeline_pins
from jaxpar._src.rules import strategy_for_specs
from jaxpar._src.search import Pin, SearchSpace
from jaxpar._src.spec import MeshShape, Spec
from jaxpar._src.strategy import is_strategy_leaf, normalize
from jaxpar._src.trace import TracedProgram, dotted


def leaf_names(args: Sequence[Any], arg_names: Sequence[str]) -> list[tuple[int, str]]:
    """``(argument index, dotted name)`` of every array leaf of ``args``, in flatten order."""
    out = []
    for i, a in enumerate(args):
        for path, _ in jax.tree_util.tree_flatten_with_path(a)[0]:
            name = dotted(path)
            out.append((i, f"{arg_names[i]}.{name}" if name else arg_names[i]))
    return out


def check_slice_counts(strategy: Any, *, where: str) -> None:
    """Raises on a tuple of numbers that are not all ints anywhere in a strategy tree: ``(2.0,
    1)`` would otherwise be read as a tree of two leaves and fail as a structure mismatch.

    >>> check_slice_counts({"w": (2.0, 1)}, where="f")
    Traceback (most recent call last):
    ...
    jaxpar._src.errors.StrategyError: f: slice counts are ints, but (2.0, 1) has 2.0 (a \
float). Use (2, 1).
    """
    if is_strategy_leaf(strategy):
        return
    if isinstance(strategy, tuple) and strategy and all(
            isinstance(v, numbers.Number) for v in strategy):
        bad = next(v for v in strategy if isinstance(v, bool) or not isinstance(v, int))
        fixed = tuple(int(float(v)) if isinstance(v, numbers.Real) and float(v).is_integer() else v
                      for v in strategy)
        hint = f" Use {fixed}." if is_strategy_leaf(fixed) and not any(
            isinstance(v, bool) for v in strategy) else ""
        raise StrategyError(f"{where}: slice counts are ints, but {strategy!r} has {bad!r} (a "
                            f"{type(bad).__name__}).{hint}")
    children = (strategy.values() if isinstance(strategy, Mapping) else
                strategy if isinstance(strategy, (tuple, list)) else ())
    for child in children:
        check_slice_counts(child, where=where)


def expand_tree(strategy: Any, tree: Any, *, where: str) -> list[Any]:
    """One strategy per leaf of ``tree``, from a strategy or a prefix tree of strategies."""
    check_slice_counts(strategy, where=where)
    n = len(jax.tree.leaves(tree))
    if is_strategy_leaf(strategy):
        return [strategy] * n
    try:
        per_subtree = jax.tree.map(lambda s, sub: _Group(s, len(jax.tree.leaves(sub))),
                                   strategy, tree, is_leaf=is_strategy_leaf)
    except (ValueError, TypeError) as e:
        raise StrategyError(
            f"{where}: the strategy tree does not match the structure of the value "
            f"({jax.tree.structure(tree)}): {e}. Give one strategy for the whole value or a "
            f"tree with the same containers and keys.") from None
    groups = jax.tree.leaves(per_subtree, is_leaf=lambda x: isinstance(x, _Group))
    return [g.strategy for g in groups for _ in range(g.count)]


class _Group:
    """A strategy standing for ``count`` leaves (an opaque leaf while flattening)."""

    def __init__(self, strategy: Any, count: int) -> None:
        self.strategy = strategy
        self.count = count


def argument_strategies(in_strategy: Any, args: Sequence[Any], arg_names: Sequence[str], *,
                        api: str) -> list[Any]:
    """Raw (unnormalised) strategy per flattened leaf of ``args``, from ``in_strategy``."""
    n_leaves = len(jax.tree.leaves(list(args)))
    if in_strategy is None:
        return [None] * n_leaves
    check_slice_counts(in_strategy, where=f"{api}: in_strategy")
    entries = in_strategy
    if is_strategy_leaf(in_strategy):
        if len(args) != 1:
            raise StrategyError(
                f"{api}: in_strategy={in_strategy!r} is one strategy, but the function takes "
                f"{len(args)} arguments ({', '.join(arg_names)}). Give a tuple with one "
                f"strategy per argument, e.g. in_strategy=({in_strategy!r}, None).")
        entries = (in_strategy,)
    if not isinstance(entries, (tuple, list)) or len(entries) != len(args):
        raise StrategyError(
            f"{api}: in_strategy has {len(entries) if isinstance(entries, (tuple, list)) else 1} "
            f"entries but the function takes {len(args)} arguments ({', '.join(arg_names)}). "
            f"Give one strategy (or None) per argument.")
    out = []
    for i, (entry, arg) in enumerate(zip(entries, args, strict=True)):
        out.extend(expand_tree(entry, arg, where=f"{api}: in_strategy[{i}] (argument "
                                                 f"'{arg_names[i]}')"))
    return out


def output_strategies(out_strategy: Any, out_shapes: Any, *, api: str) -> list[Any]:
    """Raw strategy per flattened output leaf."""
    n = len(jax.tree.leaves(out_shapes))
    if out_strategy is None:
        return [None] * n
    if not is_strategy_leaf(out_strategy) and isinstance(out_strategy, (tuple, list)) and \
            len(out_strategy) == 1 and is_strategy_leaf(out_strategy[0]) and \
            not isinstance(out_shapes, (tuple, list)):
        out_strategy = out_strategy[0]  # MindSpore style: one strategy per output, one output
    return expand_tree(out_strategy, out_shapes, where=f"{api}: out_strategy")


def parameter_plan_strategies(parameter_plan: Mapping[str, Any] | None,
                              names: Sequence[str], *, api: str) -> list[Any]:
    """Raw strategy per leaf named in ``names`` from name patterns; unmatched keys raise.

    A key matches a leaf by any of the names a user writes for it (see :func:`name_forms`),
    case-sensitively, else case-insensitively; a key that matches nothing lists the closest
    names.
    """
    out: list[Any] = [None] * len(names)
    if not parameter_plan:
        return out
    forms = [name_forms(name) for name in names]
    for pattern, strategy in parameter_plan.items():
        check_slice_counts(strategy, where=f"{api}: parameter_plan[{pattern!r}]")
        hits = [k for k, f in enumerate(forms) if any(fnmatch.fnmatchcase(n, pattern) for n in f)]
        if not hits:
            lower = pattern.lower()
            hits = [k for k, f in enumerate(forms)
                    if any(fnmatch.fnmatchcase(n.lower(), lower) for n in f)]
        if not hits:
            raise StrategyError(_unmatched(pattern, names, forms, api))
        for k in hits:
            out[k] = strategy
    return out


def name_forms(name: str) -> list[str]:
    """The names a user may write for the array at dotted path ``name``: the path, the path
    without its argument's name, and each of these without NNX's trailing ``.value`` (an
    ``nnx.split`` state) and without Linen's ``params`` collection.

    >>> name_forms("state.fc1.kernel.value")
    ['state.fc1.kernel.value', 'fc1.kernel.value', 'state.fc1.kernel', 'fc1.kernel']
    >>> name_forms("variables.params.Dense_0.kernel")[-1]
    'Dense_0.kernel'
    """
    out = [name]
    if "." in name:
        out.append(name.split(".", 1)[1])
    out += [n[: -len(".value")] for n in out if n.endswith(".value")]
    out += [n[len("params."):] for n in out if n.startswith("params.")]
    return list(dict.fromkeys(out))


def _unmatched(pattern: str, names: Sequence[str], forms: Sequence[list[str]], api: str) -> str:
    short = {f[-1]: name for name, f in zip(names, forms, strict=True)}
    close = difflib.get_close_matches(pattern, list(short), n=5, cutoff=0.5)
    close_text = f" Closest: {', '.join(repr(c) for c in close)}." if close else ""
    limit = 40
    listed = ", ".join(list(short)[:limit])
    more = f", ... ({len(short)} in all)" if len(short) > limit else ""
    return (f"{api}: parameter_plan key {pattern!r} names no parameter.{close_text} Parameters "
            f"are: {listed}{more}. Use one of these names (the argument's name, NNX's '.value' "
            f"and Linen's 'params.' may be left out) or a glob pattern such as '*.kernel'.")


def normalize_all(raw: Sequence[Any], shapes: Sequence[tuple[int, ...]],
                  dtypes: Sequence[Any], mesh: Mesh, wheres: Sequence[str]) -> list[Spec | None]:
    return [normalize(s, shape, mesh, where=w, dtype=dt)
            for s, shape, dt, w in zip(raw, shapes, dtypes, wheres, strict=True)]


def merge(first: list[Any], second: list[Any], names: Sequence[str], *, api: str) -> list[Any]:
    """Combines two per-leaf strategy lists; a leaf given in both must agree."""
    out = []
    for a, b, name in zip(first, second, names, strict=True):
        if a is not None and b is not None and a != b:
            raise StrategyError(
                f"{api}: '{name}' has a strategy in both in_strategy ({a!r}) and parameter_plan "
                f"({b!r}); give it in one place.")
        out.append(a if a is not None else b)
    return out


def gather_pins(info: ParallelizeInfo, args: Sequence[Any], program: TracedProgram,
                space: SearchSpace, mesh: Mesh, *, mode: ParallelMode, dataset_strategy: Any,
                batch: Sequence[int] | None) -> list[Pin]:
    """Every fixed strategy of ``program``: the mode's batch layouts, ``dataset_strategy``'s
    tiles, ``in_strategy``/``parameter_plan``, ``out_strategy`` and the sharding constraints in
    the function.  A leaf fixed twice is an error naming both sources."""
    graph = program.graph
    api = info.api
    mshape = MeshShape.of(mesh)
    in_shapes = [graph.values[graph.nodes[n].outputs[0]].shape for n in graph.inputs]
    in_dtypes = [graph.values[graph.nodes[n].outputs[0]].dtype for n in graph.inputs]
    pins: list[Pin] = []
    if mode is ParallelMode.STAND_ALONE:
        return pins
    if mode is ParallelMode.DATA_PARALLEL:
        assert batch is not None  # the caller infers it in this mode
        batch_layouts = batch_specs(program, batch, mshape, in_shapes, api=api)
        for nid, layout in zip(graph.inputs, batch_layouts, strict=True):
            pins.append(pin(space, nid, "out", layout, "data_parallel", api=api))
    if isinstance(dataset_strategy, tuple):
        assert batch is not None
        tiles = dataset_specs(program, batch, dataset_strategy, mesh, in_shapes, in_dtypes,
                              api=api)
        by_node = {p.node: k for k, p in enumerate(pins)}
        for nid, tile_spec in zip(graph.inputs, tiles, strict=True):
            if tile_spec is None:
                continue
            tile = pin(space, nid, "out", tile_spec, "dataset_strategy", api=api)
            if nid in by_node:
                pins[by_node[nid]] = tile
            else:
                pins.append(tile)
    static = info.static_argnums
    dyn_args = [a for i, a in enumerate(args) if i not in static]
    dyn_names = [n for i, n in enumerate(info.arg_names(len(args))) if i not in static]
    names = [name for _, name in leaf_names(dyn_args, dyn_names)]
    raw = argument_strategies(info.in_strategy, dyn_args, dyn_names, api=api)
    by_name = parameter_plan_strategies(info.parameter_plan, names, api=api)
    raw = merge(raw, by_name, names, api=api)
    wheres = [f"{api}: strategy of argument '{nm}'" for nm in names]
    specs = normalize_all(raw, in_shapes, in_dtypes, mesh, wheres)
    pinned_inputs = {p.node for p in pins}
    for nid, spec in zip(graph.inputs, specs, strict=True):
        if spec is None:
            continue
        if nid in pinned_inputs and mode is ParallelMode.DATA_PARALLEL:
            raise StrategyError(
                f"{api}: in data_parallel mode the layouts of the arguments are fixed by the "
                f"mode; drop in_strategy/parameter_plan or use "
                f"parallel_mode='semi_auto_parallel'.")
        if nid in pinned_inputs:
            raise StrategyError(
                f"{api}: argument leaf '{names[graph.inputs.index(nid)]}' has its layout from "
                f"dataset_strategy and from in_strategy/parameter_plan; give it one.")
        pins.append(pin(space, nid, "out", spec, "in_strategy", api=api))
    out_raw = output_strategies(info.out_strategy, program.out_shapes, api=api)
    out_nodes = graph.outputs
    out_shapes = [graph.operand_shape(graph.nodes[n].inputs[0]) for n in out_nodes]
    out_dtypes = [graph.operand_dtype(graph.nodes[n].inputs[0]) for n in out_nodes]
    out_specs = normalize_all(out_raw, out_shapes, out_dtypes, mesh,
                              [f"{api}: out_strategy for {p}" for p in program.out_paths])
    for nid, out_spec in zip(out_nodes, out_specs, strict=True):
        if out_spec is not None:
            pins.append(pin(space, nid, "in", out_spec, "out_strategy", api=api))
    pins.extend(constraint_pins(space, mshape, api))
    pins.extend(operator_pins(space, mshape))
    pins.extend(pipeline_pins(space, mshape))
    return pins


def batch_pins(program: TracedProgram, space: SearchSpace, batch: Sequence[int], *,
               api: str) -> list[Pin]:
    """Pins of the arrays of ``batch``: dimension 0 split over every mesh axis (MindSpore's
    ``dataset_strategy="data_parallel"``); the other arguments stay free."""
    graph = program.graph
    in_shapes = [graph.values[graph.nodes[n].outputs[0]].shape for n in graph.inputs]
    specs = batch_specs(program, batch, space.model.mesh, in_shapes, api=api)
    return [pin(space, nid, "out", spec, "data_parallel", api=api)
            for nid, spec in zip(graph.inputs, specs, strict=True) if not spec.is_replicated]


def baseline_pins(program: TracedProgram, space: SearchSpace, batch: Sequence[int],
                  pins: Sequence[Pin], *, api: str) -> list[Pin]:
    """Pins of pure data parallel over ``batch`` plus ``pins`` (which win where both pin)."""
    graph = program.graph
    in_shapes = [graph.values[graph.nodes[n].outputs[0]].shape for n in graph.inputs]
    specs = batch_specs(program, batch, space.model.mesh, in_shapes, api=api)
    pinned = {p.node for p in pins}
    base = [pin(space, nid, "out", spec, "data_parallel", api=api)
            for nid, spec in zip(graph.inputs, specs, strict=True) if nid not in pinned]
    return base + list(pins)


def pin(space: SearchSpace, nid: int, side: str, spec: Spec, origin: str, *, api: str) -> Pin:
    """Node ``nid`` fixed to the strategy whose operand or result 0 (``side``) is ``spec``.

    A dimension of size 0 holds nothing to split (the rules never split one): its mesh axes
    are dropped, as ``jax.jit`` returns the same empty array whatever its layout.
    """
    graph = space.graph
    node = graph.nodes[nid]
    shape = (graph.values[node.outputs[0]].shape if side == "out"
             else graph.operand_shape(node.inputs[0]))
    if 0 in shape:
        spec = Spec(tuple(() if n == 0 else axes for n, axes in zip(shape, spec.dims,
                                                                       strict=True)))
    strategy = strategy_for_specs(space.rule(nid), {(side, 0): spec}, space.model.mesh)
    if strategy is None:  # normalisation checked divisibility; this is a jaxpar bug
        raise PlanError(f"{api}: internal error pinning node {nid} to {spec}.")
    return Pin(nid, strategy, origin)


def constraint_pins(space: SearchSpace, mesh: MeshShape, api: str) -> list[Pin]:
    """``with_sharding_constraint`` in the user's function (or from ``jaxpar.shard``) pins."""
    pins = []
    graph = space.graph
    for node in graph.nodes:
        if node.kind != "op" or node.name != "sharding_constraint":
            continue
        sharding = node.eqn.params["sharding"]
        smesh = getattr(sharding, "mesh", None)  # a Mesh, or an AbstractMesh for a bare P
        shape = None if smesh is None else MeshShape(
            tuple(smesh.axis_names), tuple(int(s) for s in smesh.axis_sizes))
        if shape != mesh:
            raise StrategyError(
                f"{api}: the sharding constraint at {node.source} uses mesh "
                f"{shape if shape is not None else sharding}, but the program runs on mesh "
                f"{mesh}. Give it a PartitionSpec over this mesh's axes (a bare PartitionSpec "
                f"refers to the plan's mesh) or a NamedSharding on the same mesh, or use "
                f"jaxpar.shard inside the function.")
        if node.eqn.params.get("unconstrained_dims"):
            continue
        pinned = Spec.from_partition_spec(sharding.spec,
                                          len(graph.values[node.outputs[0]].shape))
        strategy = strategy_for_specs(space.rule(node.id),
                                      {("in", 0): pinned, ("out", 0): pinned}, mesh)
        if strategy is not None:
            pins.append(Pin(node.id, strategy, "shard"))
    return pins
