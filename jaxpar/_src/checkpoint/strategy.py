"""Strategies in every form users hold them, turned into :class:`ParameterLayouts` once.

A strategy argument (``predict_strategy``, ``train_strategy_filename``, ``src_strategy``,
``dst_strategy``) may be a :class:`ParameterLayouts` (what :func:`jaxpar.infer_predict_layout`
returns), a :class:`jaxpar.ShardingPlan`, a file (a strategy saved with
``ParameterLayouts.save``, or a plan saved with ``plan.save`` / ``strategy_ckpt_save_file``), a
checkpoint directory (the layouts it was saved with), or a dict ``{path: PartitionSpec |
NamedSharding | jaxpar.Layout}``.  :func:`lookup` then finds an array's layout by its path, also
when the strategy names it under another prefix: ``"w"`` of a network is ``"params.w"`` of a
train step's plan, and the optimizer's ``"opt_state.0.mu.w"`` takes the layout of ``"w"``.
"""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar._src.checkpoint.layouts import FORMAT, ArrayLayout, ParameterLayouts
from jaxpar._src.checkpoint.paths import components, flatten, join
from jaxpar._src.errors import CheckpointError
from jaxpar._src.layout import Layout
from jaxpar._src.spec import MeshShape


def load_strategy(path: str | os.PathLike, *, where: str) -> ParameterLayouts:
    """A strategy file, a plan file, or a checkpoint directory's strategy."""
    p = Path(path)
    if p.is_dir() or not p.exists() and p.parent.is_dir() and any(
            p.parent.glob(p.name + ".orbax-checkpoint-tmp*")):
        from jaxpar._src.checkpoint import store

        saved = store.read(store.locate(p, where=where), where=where)
        if saved.strategy is None:
            raise CheckpointError(f"{where}: the checkpoint {p} has no strategy file.")
        return saved.strategy
    if not p.exists():
        raise CheckpointError(f"{where}: the strategy file {p} does not exist.")
    try:
        data = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: {p} is not a strategy file (not JSON: {e}).") from None
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt == FORMAT:
        return ParameterLayouts.from_dict(data, where=f"{where}: {p}")
    if isinstance(fmt, str) and fmt.startswith("jaxpar.plan/"):
        from jaxpar._src.plan import ShardingPlan

        return ParameterLayouts.from_plan(ShardingPlan.from_json(json.dumps(data)))
    raise CheckpointError(
        f"{where}: {p} is not a strategy file (format {fmt!r}). Give a strategy saved with "
        f"ParameterLayouts.save, a plan saved with ShardingPlan.save or strategy_ckpt_save_file, "
        f"or a checkpoint directory.")


def resolve(strategy: Any, *, where: str, mesh: Mesh | None = None) -> ParameterLayouts | None:
    """Any strategy form as :class:`ParameterLayouts` (``None`` stays ``None``)."""
    from jaxpar._src.plan import ShardingPlan

    if strategy is None or isinstance(strategy, ParameterLayouts):
        return strategy
    if isinstance(strategy, ShardingPlan):
        return ParameterLayouts.from_plan(strategy)
    if isinstance(strategy, (str, os.PathLike)):
        return load_strategy(strategy, where=where)
    if isinstance(strategy, Mapping):
        return _from_mapping(strategy, where=where, mesh=mesh)
    raise CheckpointError(
        f"{where}: a strategy must be a ParameterLayouts (jaxpar.infer_predict_layout), a "
        f"ShardingPlan, a strategy or plan file, a checkpoint directory, or a dict of "
        f"PartitionSpecs; got {type(strategy).__name__}.")


def _from_mapping(strategy: Mapping, *, where: str, mesh: Mesh | None) -> ParameterLayouts:
    arrays: dict[str, ArrayLayout] = {}
    meshes: list[Mesh] = []
    for path, value in strategy.items():
        if isinstance(value, ArrayLayout):
            arrays[path] = value
            continue
        if isinstance(value, NamedSharding):
            if not isinstance(value.mesh, Mesh):
                raise CheckpointError(
                    f"{where}: the strategy of '{path}' is a NamedSharding on an AbstractMesh, "
                    f"which has no devices; give it a jax.sharding.Mesh (jaxpar.make_mesh).")
            meshes.append(value.mesh)
            value = value.spec
        elif isinstance(value, Layout):
            meshes.append(value.mesh())
            value = value.partition_spec()
        if value is None:
            value = PartitionSpec()
        if not isinstance(value, PartitionSpec):
            raise CheckpointError(
                f"{where}: the strategy of '{path}' is {value!r}; give a PartitionSpec, a "
                f"NamedSharding or a jaxpar.Layout.")
        arrays[path] = ArrayLayout(value)
    if meshes:
        mesh = meshes[0]
    if mesh is None:
        from jaxpar._src.context import current_context

        mesh = current_context().mesh
    if mesh is None:
        raise CheckpointError(
            f"{where}: a dict of PartitionSpecs needs a mesh: give NamedShardings, set the "
            f"context's mesh (jaxpar.set_auto_parallel_context(mesh=...)), or pass the "
            f"ParameterLayouts jaxpar.infer_predict_layout returned.")
    return ParameterLayouts(MeshShape.of(mesh), arrays, tuple(d.id for d in mesh.devices.flat),
                            "dict")


def of_arrays(tree: Any, *, where: str) -> ParameterLayouts:
    """The layouts ``tree``'s arrays have now (replicated for host values)."""
    paths, leaves, _ = flatten(tree)
    mesh = None
    arrays = {}
    for path, x in zip(paths, leaves, strict=True):
        shape = tuple(np.shape(x))
        dtype = np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype).name
        spec = PartitionSpec()
        sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated:
            if mesh is None:
                mesh = sharding.mesh
            elif (sharding.mesh.axis_names != mesh.axis_names
                  or sharding.mesh.devices.shape != mesh.devices.shape):
                raise CheckpointError(
                    f"{where}: '{path}' is split on mesh {MeshShape.of(sharding.mesh)}, other "
                    f"arrays on {MeshShape.of(mesh)}; a checkpoint has one mesh. Save the two "
                    f"groups separately.")
            spec = sharding.spec
        elif sharding is not None and not sharding.is_fully_replicated:
            raise CheckpointError(
                f"{where}: '{path}' has a {type(sharding).__name__}, whose layout cannot be "
                f"recorded; place it with a NamedSharding (jax.device_put).")
        arrays[path] = ArrayLayout(spec, shape, dtype)
    if mesh is None:
        return ParameterLayouts(MeshShape((), ()), arrays, (), "checkpoint")
    return ParameterLayouts(MeshShape.of(mesh), arrays, tuple(d.id for d in mesh.devices.flat),
                            "checkpoint")


class Lookup:
    """Finds the layout of an array by path in a strategy (see the module docstring)."""

    def __init__(self, layouts: ParameterLayouts) -> None:
        self.layouts = layouts
        self._index: dict[str, list[str]] = collections.defaultdict(list)
        for key in layouts.arrays:
            parts = components(key)
            for k in range(len(parts)):
                self._index[join(*parts[k:])].append(key)

    def __call__(self, path: str, shape: tuple[int, ...] | None, *,
                 where: str) -> ArrayLayout | None:
        found = self.scored(path, shape, where=where)
        return found[0] if found is not None else None

    def scored(self, path: str, shape: tuple[int, ...] | None, *,
               where: str) -> tuple[ArrayLayout, int] | None:
        """The layout and how many trailing path components matched (exact: one more)."""
        arrays = self.layouts.arrays
        parts = components(path)
        if path in arrays and _fits(arrays[path], shape):
            return arrays[path], len(parts) + 1
        for k in range(len(parts)):
            suffix = join(*parts[k:])
            keys = [key for key in self._index.get(suffix, ())
                    if (k == 0 or suffix == key or suffix == join(*components(key)[1:]))
                    and _fits(arrays[key], shape)]
            if keys and k == 0:  # "w" in "params.w" rather than in "opt_state.0.mu.w"
                fewest = min(len(components(key)) for key in keys)
                keys = [key for key in keys if len(components(key)) == fewest]
            if keys:
                specs = {arrays[key].spec for key in keys}
                if len(specs) > 1:
                    raise CheckpointError(
                        f"{where}: the strategy gives '{path}' different layouts under "
                        f"{', '.join(repr(k) for k in keys[:4])}; name it exactly in the "
                        f"strategy.")
                return arrays[keys[0]], len(parts) - k
        return None


def _fits(a: ArrayLayout, shape: tuple[int, ...] | None) -> bool:
    return a.shape is None or shape is None or tuple(a.shape) == tuple(shape)
