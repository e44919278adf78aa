"""``jaxpar.Layout``: MindSpore's ``Layout(device_matrix, alias_name)`` on top of a JAX mesh.

A MindSpore layout is a device matrix with a name per axis, called with one entry per tensor
dimension: an alias, ``"None"``, or a tuple of aliases (one dimension split over several axes,
major to minor).  In JAX terms the device matrix is a ``Mesh`` and the call is a
``PartitionSpec``; :meth:`Layout.partition_spec` and :meth:`Layout.mesh` give exactly those.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from jaxpar._src.errors import StrategyError


@dataclasses.dataclass(frozen=True)
class Layout:
    """A device matrix with axis aliases, optionally applied to a tensor.

    Args:
      device_matrix: the size of each device axis; the product is the number of devices.
      alias_name: one unique name per axis.
      rank_list: optional device order (ranks laid out row-major over ``device_matrix``).

    Calling a layout with one entry per tensor dimension gives the layout of that tensor:

    >>> layout = Layout((2, 4), ("dp", "mp"))
    >>> x_layout = layout("dp", "None")
    >>> x_layout.partition_spec() == PartitionSpec("dp", None)
    True
    >>> layout(("dp", "mp"), "None").to_dict()["tensor_map"]
    ((1, 0), -1)
    """

    device_matrix: tuple[int, ...]
    alias_name: tuple[str, ...]
    rank_list: tuple[int, ...] | None = None
    tensor_map: tuple[str | tuple[str, ...] | None, ...] | None = None

    def __post_init__(self) -> None:
        dm = tuple(int(d) for d in self.device_matrix)
        names = tuple(self.alias_name)
        object.__setattr__(self, "device_matrix", dm)
        object.__setattr__(self, "alias_name", names)
        if len(dm) != len(names):
            raise StrategyError(
                f"jaxpar.Layout: device_matrix {dm} has {len(dm)} axes but alias_name {names} "
                f"has {len(names)}; give one alias per axis.")
        if len(set(names)) != len(names) or any(not n or n == "None" for n in names):
            raise StrategyError(
                f"jaxpar.Layout: aliases {names} must be unique, non-empty and not 'None'.")
        if self.rank_list is not None:
            ranks = tuple(int(r) for r in self.rank_list)
            if sorted(ranks) != list(range(math.prod(dm))):
                raise StrategyError(
                    f"jaxpar.Layout: rank_list {ranks} must be a permutation of "
                    f"0..{math.prod(dm) - 1} for device_matrix {dm}.")
            object.__setattr__(self, "rank_list", ranks)

    def __call__(self, *tensor_map: str | Sequence[str] | None) -> Layout:
        entries: list[str | tuple[str, ...] | None] = []
        used: list[str] = []
        for entry in tensor_map:
            if entry is None or entry == "None":
                entries.append(None)
                continue
            group = (entry,) if isinstance(entry, str) else tuple(entry)
            for alias in group:
                if alias not in self.alias_name:
                    raise StrategyError(
                        f"jaxpar.Layout: alias {alias!r} is not one of {self.alias_name}.")
                if alias in used:
                    raise StrategyError(
                        f"jaxpar.Layout: alias {alias!r} is used twice in {tensor_map}; each "
                        f"device axis may split at most one tensor dimension.")
                used.append(alias)
            entries.append(group[0] if len(group) == 1 else group)
        return dataclasses.replace(self, tensor_map=tuple(entries))

    def partition_spec(self) -> PartitionSpec:
        if self.tensor_map is None:
            raise StrategyError(
                "jaxpar.Layout: this layout has no tensor map yet; call it with one entry per "
                "tensor dimension, e.g. layout('dp', 'None').")
        return PartitionSpec(*self.tensor_map)

    def mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """The ``Mesh`` this device matrix describes (Auto axes)."""
        pool = list(jax.devices()) if devices is None else list(devices)
        need = math.prod(self.device_matrix)
        if need > len(pool):
            raise StrategyError(
                f"jaxpar.Layout: device_matrix {self.device_matrix} needs {need} devices, "
                f"{len(pool)} are available.")
        order = self.rank_list if self.rank_list is not None else range(need)
        devs = np.array([pool[r] for r in order], dtype=object).reshape(self.device_matrix)
        return Mesh(devs, self.alias_name, axis_types=(AxisType.Auto,) * len(self.alias_name))

    def to_dict(self) -> dict:
        """MindSpore's dictionary form; ``tensor_map`` counts device axes from the right."""
        n = len(self.alias_name)

        def index(alias: str) -> int:
            return n - 1 - self.alias_name.index(alias)

        tmap: list = []
        for entry in self.tensor_map or ():
            if entry is None:
                tmap.append(-1)
            elif isinstance(entry, str):
                tmap.append(index(entry))
            else:
                tmap.append(tuple(index(a) for a in entry))
        return {
            "device_matrix": self.device_matrix,
            "tensor_map": tuple(tmap),
            "interleaved_parallel": False,
            "alias_name": self.alias_name,
            "rank_list": list(self.rank_list or range(math.prod(self.device_matrix))),
        }
