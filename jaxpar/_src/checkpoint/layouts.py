"""``ParameterLayouts``: where every array of a program or a checkpoint lives (a strategy file).

MindSpore keeps the layouts of a distributed program in a *strategy file*: per parameter, the
device matrix, the tensor map and the shape.  jaxpar's is a :class:`ParameterLayouts`: the mesh
(axis names, sizes, device ids) and, per array path (``"params.blocks.0.attn.q.kernel"``), its
``PartitionSpec``, global shape and dtype.  It reads as a mapping ``{path: PartitionSpec}``,
saves as JSON (with MindSpore's ``dev_matrix``/``tensor_map`` beside the ``PartitionSpec``), and
is what :func:`jaxpar.infer_predict_layout` returns and every checkpoint keeps beside its arrays.

>>> from jax.sharding import PartitionSpec as P
>>> from jaxpar._src.spec import MeshShape
>>> layouts = ParameterLayouts(MeshShape(("dp", "mp"), (2, 4)), {
...     "w1": ArrayLayout(P(None, "mp"), (16, 32), "float32"),
...     "w2": ArrayLayout(P("mp"), (32, 16), "float32")})
>>> layouts["w1"] == P(None, "mp"), len(layouts), layouts.shard_shape("w2")
(True, 2, (8, 16))
>>> ParameterLayouts.from_json(layouts.to_json()) == layouts
True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar._src.errors import CheckpointError
from jaxpar._src.mesh import make_mesh
from jaxpar._src.spec import MeshShape, Spec

FORMAT = "jaxpar.layouts/1"


@dataclasses.dataclass(frozen=True)
class ArrayLayout:
    """One array's layout: its ``PartitionSpec`` over the mesh, global shape and dtype (``None``
    when unknown), and, in a checkpoint's strategy, a checksum of its contents.

    >>> ArrayLayout(P(None, "mp", None), (16, 32, 8), "float32").spec == P(None, "mp")
    True
    """

    spec: PartitionSpec
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    checksum: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        spec = self.spec if isinstance(self.spec, PartitionSpec) else PartitionSpec(*self.spec)
        if self.shape is not None:
            object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
            spec = Spec.from_partition_spec(spec, len(self.shape)).to_partition_spec()
        object.__setattr__(self, "spec", spec)
        if self.dtype is not None:
            object.__setattr__(self, "dtype", np.dtype(self.dtype).name)
        if self.checksum is not None:
            object.__setattr__(self, "checksum", tuple(int(c) for c in self.checksum))


@dataclasses.dataclass(frozen=True)
class ParameterLayouts(Mapping[str, PartitionSpec]):
    """The layout of every array of a tree on one mesh: ``{path: PartitionSpec}`` plus shapes.

    Attributes:
      mesh: the mesh's axis names and sizes (``MeshShape``).
      arrays: ``{path: ArrayLayout}``, paths dotted as ``ShardingPlan.input_layouts()`` names
        them.
      device_ids: the mesh's devices, row-major (empty: the first devices of the process).
      origin: what made it ("checkpoint", "plan (semi_auto_parallel)", ...).

    >>> layouts = ParameterLayouts(MeshShape(("mp",), (4,)), {"w": ArrayLayout(P("mp"), (8, 2))})
    >>> dict(layouts) == {"w": P("mp")}, layouts.sharding("w").spec == P("mp")
    (True, True)
    """

    mesh: MeshShape
    arrays: Mapping[str, ArrayLayout]
    device_ids: tuple[int, ...] = ()
    origin: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "arrays", dict(self.arrays))
        object.__setattr__(self, "device_ids", tuple(int(i) for i in self.device_ids))
        for path, a in self.arrays.items():
            for axis in Spec.from_partition_spec(a.spec, len(a.spec)).axes:
                if axis not in self.mesh.names:
                    raise CheckpointError(
                        f"jaxpar.ParameterLayouts: the layout {a.spec} of '{path}' names mesh "
                        f"axis {axis!r}, but the mesh is {self.mesh}.")

    # -- the mapping ----------------------------------------------------------------------------
    def __getitem__(self, path: str) -> PartitionSpec:
        return self.arrays[path].spec

    def __iter__(self) -> Iterator[str]:
        return iter(self.arrays)

    def __len__(self) -> int:
        return len(self.arrays)

    def __repr__(self) -> str:
        origin = f", from {self.origin}" if self.origin else ""
        return f"ParameterLayouts(mesh {self.mesh}, {len(self)} arrays{origin})"

    # -- views ----------------------------------------------------------------------------------
    def shard_shape(self, path: str) -> tuple[int, ...]:
        """The shape one device holds of the array at ``path``."""
        a = self.arrays[path]
        if a.shape is None:
            raise CheckpointError(f"jaxpar.ParameterLayouts: the shape of '{path}' is unknown.")
        return Spec.from_partition_spec(a.spec, len(a.shape)).shard_shape(a.shape, self.mesh)

    def device_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The ``Mesh`` on this process's devices: the recorded device ids when they all exist
        here, else the first ``mesh.num_devices`` devices (or ``devices``)."""
        if devices is None and self.device_ids:
            by_id = {d.id: d for d in jax.devices()}
            if all(i in by_id for i in self.device_ids):
                devices = [by_id[i] for i in self.device_ids]
        if not self.mesh.names:  # one device, nothing split
            return make_mesh((1,), ("_",), devices=devices)
        return make_mesh(self.mesh.sizes, self.mesh.names, devices=devices)

    def sharding(self, path: str, mesh: Mesh | None = None) -> NamedSharding:
        """The ``NamedSharding`` of the array at ``path`` (on :meth:`device_mesh` by default)."""
        return NamedSharding(mesh if mesh is not None else self.device_mesh(), self[path])

    def table(self) -> str:
        """One line per array: path, shape, dtype, layout."""
        rows = [("array", "shape", "dtype", "layout")]
        for path, a in self.arrays.items():
            shape = "?" if a.shape is None else str(list(a.shape))
            rows.append((path, shape, a.dtype or "?", _spec_str(a.spec)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [f"layouts on mesh {self.mesh}" + (f" ({self.origin})" if self.origin else "")]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in rows]
        return "\n".join(lines)

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_plan(cls, plan: Any, arguments: Sequence[str] | None = None) -> ParameterLayouts:
        """The input layouts of a :class:`jaxpar.ShardingPlan`, named as ``input_layouts()``
        names them (``"params.w1"``); ``arguments`` keeps only those arguments' arrays."""
        arrays = {}
        for n in plan.inputs:
            d = plan.decisions[n]
            if arguments is not None and d.label.split(".")[0] not in arguments:
                continue
            arrays[d.label] = ArrayLayout(d.out_specs[0].to_partition_spec(), d.out_shapes[0])
        return cls(plan.mesh, arrays, plan.device_ids, f"plan ({plan.parallel_mode})")

    # -- persistence ----------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_dict(self) -> dict:
        items = {}
        for path, a in self.arrays.items():
            item: dict[str, Any] = {"spec": _spec_to_json(a.spec)}
            if a.shape is not None:
                item["tensor_shape"] = list(a.shape)
            if a.dtype is not None:
                item["dtype"] = a.dtype
            # MindSpore's strategy-file fields: the device matrix and the tensor map
            item["dev_matrix"] = list(self.mesh.sizes)
            item["tensor_map"] = _tensor_map(a.spec, self.mesh, a.shape)
            if a.checksum is not None:
                item["checksum"] = list(a.checksum)
            items[path] = item
        return {"format": FORMAT, "origin": self.origin,
                "mesh": {"names": list(self.mesh.names), "sizes": list(self.mesh.sizes)},
                "device_ids": list(self.device_ids), "parallel_layout_item": items}

    @classmethod
    def from_json(cls, text: str) -> ParameterLayouts:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "jaxpar") -> ParameterLayouts:
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a strategy of format {FORMAT!r} (found "
                                  f"{data.get('format')!r}).")
        mesh = MeshShape(tuple(data["mesh"]["names"]), tuple(data["mesh"]["sizes"]))
        arrays = {path: ArrayLayout(_spec_from_json(item["spec"]), item.get("tensor_shape"),
                                    item.get("dtype"), item.get("checksum"))
                  for path, item in data["parallel_layout_item"].items()}
        return cls(mesh, arrays, tuple(data.get("device_ids", ())), data.get("origin", ""))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the strategy as JSON (``ParameterLayouts.load`` reads it back)."""
        with open(path, "w") as f:
            f.write(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ParameterLayouts:
        """Reads a strategy: a file :meth:`save` wrote, a ``ShardingPlan`` file
        (``plan.save``, ``strategy_ckpt_save_file``), or a checkpoint directory (its strategy)."""
        from jaxpar._src.checkpoint.strategy import load_strategy

        return load_strategy(path, where="jaxpar.ParameterLayouts.load")


def _spec_to_json(spec: PartitionSpec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _spec_from_json(data: Sequence[Any]) -> PartitionSpec:
    return PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in data])


def _spec_str(spec: PartitionSpec) -> str:
    return "replicated" if not any(e is not None for e in spec) else str(tuple(spec))


def _tensor_map(spec: PartitionSpec, mesh: MeshShape, shape: Sequence[int] | None) -> list:
    """MindSpore's tensor map: per dimension the device-matrix axis, counted from the right
    (-1: not split)."""
    n = len(mesh.names)
    entries = list(spec) + [None] * ((len(shape) if shape is not None else 0) - len(spec))
    out: list = []
    for e in entries:
        if e is None:
            out.append(-1)
        elif isinstance(e, str):
            out.append(n - 1 - mesh.names.index(e))
        else:
            out.append([n - 1 - mesh.names.index(a) for a in e])
    return out


def num_bytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize
