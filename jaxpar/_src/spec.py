"""jaxpar's one internal layout form: the mesh axes that split each tensor dimension.

User strategies (MindSpore slice-count tuples, ``PartitionSpec``, :class:`jaxpar.Layout`) are
normalised into a :class:`Spec` once, at the API boundary (see ``strategy.py``); everything after
that (rules, costs, search, lowering) speaks ``Spec`` and :class:`MeshShape` only.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence

from jax.sharding import AbstractMesh, Mesh, PartitionSpec


@dataclasses.dataclass(frozen=True, slots=True)
class MeshShape:
    """Axis names and sizes of a mesh, without devices: what the cost model and plans need.

    >>> m = MeshShape(("dp", "mp"), (2, 4))
    >>> m.size("mp"), m.num_devices, str(m)
    (4, 8, '(dp=2, mp=4)')
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, mesh: Mesh | AbstractMesh) -> MeshShape:
        """Names and sizes of a ``Mesh`` or a device-free ``AbstractMesh``."""
        return cls(tuple(mesh.axis_names), tuple(int(s) for s in mesh.axis_sizes))

    def size(self, axis: str) -> int:
        return self.sizes[self.names.index(axis)]

    def product(self, axes: Iterable[str]) -> int:
        return _product(self, tuple(axes))

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes, strict=True))

    def __str__(self) -> str:
        pairs = zip(self.names, self.sizes, strict=True)
        return "(" + ", ".join(f"{n}={s}" for n, s in pairs) + ")"


@functools.lru_cache(maxsize=4096)
def _product(mesh: MeshShape, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.sizes[mesh.names.index(a)] for a in axes)


_FRACTIONS: dict[tuple[Spec, MeshShape], float] = {}  # Spec.shard_fraction's answers


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    """Mesh axes per tensor dimension, major to minor within a dimension.

    ``Spec((("dp",), ()))`` splits dimension 0 over ``dp`` and keeps dimension 1 whole; it is
    ``PartitionSpec("dp", None)``.

    >>> s = Spec.from_partition_spec(PartitionSpec(("dp", "mp"), None), ndim=2)
    >>> s
    Spec([dp+mp, -])
    >>> s.to_partition_spec() == PartitionSpec(("dp", "mp"))
    True
    >>> s.shard_shape((16, 3), MeshShape(("dp", "mp"), (2, 4)))
    (2, 3)
    """

    dims: tuple[tuple[str, ...], ...]
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Specs key the search's caches by the million: hash them once.
        object.__setattr__(self, "_hash", hash(self.dims))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        # The dataclass's comparison, faster: the same object is equal, and unequal layouts
        # almost always differ in their kept hash (plans compare layouts by the hundred
        # thousand, mostly one object or two unequal ones: issue 14).
        if self is other:
            return True
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._hash == other._hash and self.dims == other.dims

    @classmethod
    def replicated(cls, ndim: int) -> Spec:
        return cls(((),) * ndim)

    @classmethod
    def from_partition_spec(cls, pspec: PartitionSpec | Sequence, ndim: int) -> Spec:
        """Reads a PartitionSpec already checked against the mesh (see ``strategy.py``)."""
        entries = list(pspec) + [None] * (ndim - len(pspec))
        dims: list[tuple[str, ...]] = []
        for e in entries:
            if e is None:
                dims.append(())
            elif isinstance(e, str):
                dims.append((e,))
            else:
                dims.append(tuple(e))
        return cls(tuple(dims))

    def to_partition_spec(self) -> PartitionSpec:
        entries: list = []
        for axes in self.dims:
            entries.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this layout splits on, in dimension order."""
        return tuple(a for d in self.dims for a in d)

    @property
    def is_replicated(self) -> bool:
        return not any(self.dims)

    def dim_of(self, axis: str) -> int | None:
        for i, d in enumerate(self.dims):
            if axis in d:
                return i
        return None

    def split_counts(self, mesh: MeshShape) -> tuple[int, ...]:
        """MindSpore slice counts: how many pieces each dimension is cut into."""
        return tuple(mesh.product(d) for d in self.dims)

    def shard_shape(self, shape: Sequence[int], mesh: MeshShape) -> tuple[int, ...]:
        return tuple(n // mesh.product(d) for n, d in zip(shape, self.dims, strict=True))

    def shard_fraction(self, mesh: MeshShape) -> float:
        """The fraction of the tensor one device holds."""
        key = (self, mesh)
        found = _FRACTIONS.get(key)
        if found is None:  # (asked per value and layout by every pass: issue 14)
            if len(_FRACTIONS) > 65536:
                _FRACTIONS.clear()
            found = _FRACTIONS[key] = 1.0 / mesh.product(self.axes)
        return found

    def to_json(self) -> list[list[str]]:
        return [list(d) for d in self.dims]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[str]]) -> Spec:
        return cls(tuple(tuple(d) for d in data))

    def __repr__(self) -> str:
        return f"Spec({self})"

    def __str__(self) -> str:
        return "[" + ", ".join("+".join(d) if d else "-" for d in self.dims) + "]"


def spec_from_mapping(ndim: int, axes_of_dim: Mapping[int, Sequence[str]]) -> Spec:
    """A Spec with the given axes on the given dimensions and nothing elsewhere."""
    return Spec(tuple(tuple(axes_of_dim.get(i, ())) for i in range(ndim)))
