"""Normalising user strategies into :class:`Spec`, once, at the API boundary.

Accepted forms, wherever jaxpar takes a strategy for a tensor:

* ``None``: free; propagation or search decides.
* a tuple of ints, MindSpore's slice counts: ``(2, 4)`` cuts dimension 0 in 2 and dimension 1 in 4;
* a ``jax.sharding.PartitionSpec`` over the mesh's axis names (or a ``NamedSharding``);
* a :class:`jaxpar.Layout` called with one entry per dimension.

**The slice-count rule** follows MindSpore's device matrix (see ``device_matrix.py``): a
strategy's counts, first to last, are the axes of its device matrix from the outermost in, and
the copies, when the strategy uses fewer devices than the mesh has, sit innermost (MindSpore
appends the repeat count as the last device-matrix axis).  On a mesh, each count ``c > 1`` takes
the outermost run of adjacent mesh axes, not used yet by this tensor, whose sizes multiply to
``c``; failing that, it is an error.  On mesh ``(dp=2, mp=4)``: ``(2, 1)`` is ``P('dp', None)``,
``(1, 4)`` is ``P(None, 'mp')``, ``(4, 2)`` is ``P('mp', 'dp')`` and ``(8, 1)`` is
``P(('dp', 'mp'), None)``; on ``(a=2, b=2, c=2)``, ``(2, 1)`` is ``P('a')`` (the copies on
``b`` and ``c``, neighbouring devices).  A ``jaxpar.shard`` around a single operator lays the
operator's own device matrix instead (a MatMul's ``[i, k, j]``), so all its tensors agree.

**Without a mesh**, jaxpar builds one from the strategies (:func:`mesh_for_slice_counts` for a
list of tensor strategies, ``implicit_mesh.py`` for a whole program): the first strategy's device
matrix, refined where a later one needs cuts of its own, so that every strategy lands where its
MindSpore device matrix puts it.  ``shard(matmul, in_strategy=((2, 4), (4, 1)))`` on 8 devices
runs on the mesh ``(a0=2, a1=4)``, MindSpore's device matrix ``[2, 4, 1]``: device 1 holds
``x[0:8, 16:32]`` of a ``16 x 64`` ``x`` and the partial sums are all-reduced within ``{0-3}`` and
``{4-7}``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar._src.device_matrix import Request, lay_counts, mesh_axes_for
from jaxpar._src.errors import StrategyError
from jaxpar._src.layout import Layout
from jaxpar._src.mesh import make_mesh
from jaxpar._src.spec import MeshShape, Spec

StrategyLike = Any  # None | tuple[int, ...] | PartitionSpec | NamedSharding | Layout


def is_strategy_leaf(x: Any) -> bool:
    """True for a value that is one tensor's strategy (not a tree of them)."""
    if x is None or isinstance(x, (PartitionSpec, NamedSharding, Layout)):
        return True
    return isinstance(x, tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in x)


def is_slice_counts(x: Any) -> bool:
    return isinstance(x, tuple) and not isinstance(x, PartitionSpec) and is_strategy_leaf(x)


def _shape_str(shape: Sequence[int], dtype: Any = None) -> str:
    name = jax.numpy.dtype(dtype).name if dtype is not None else ""
    short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
             "float64": "f64", "int64": "i64", "bool": "bool", "uint32": "u32"}.get(name, name)
    return f"{short}[{','.join(str(int(d)) for d in shape)}]"


def normalize(
    strategy: StrategyLike,
    shape: Sequence[int],
    mesh: Mesh,
    *,
    where: str,
    dtype: Any = None,
) -> Spec | None:
    """Turns one tensor's strategy into a :class:`Spec` on ``mesh``, checking it fully.

    Args:
      strategy: any accepted strategy form, or ``None``.
      shape: the tensor's global shape.
      mesh: the mesh the strategy refers to.
      where: who asks, for messages, e.g. ``"jaxpar.shard(ffn): in_strategy[1] (argument 'w')"``.
      dtype: the tensor's dtype, for messages.

    Returns:
      The Spec, or ``None`` for a free strategy.

    Raises:
      StrategyError: the strategy does not fit the tensor or the mesh; the message says why and
        how to fix it.

    >>> from jaxpar._src.mesh import make_mesh
    >>> mesh = make_mesh((2, 4), ("dp", "mp"))
    >>> normalize((4, 2), (8, 8), mesh, where="x")
    Spec([mp, dp])
    """
    if strategy is None:
        return None
    shape = tuple(int(d) for d in shape)
    shape_str = _shape_str(shape, dtype)
    mshape = MeshShape.of(mesh)
    mesh_str = str(mshape)
    if isinstance(strategy, NamedSharding):
        if MeshShape.of(strategy.mesh) != mshape:
            raise StrategyError(
                f"{where}: the NamedSharding is on mesh "
                f"{MeshShape.of(strategy.mesh)} but this program runs on mesh {mesh_str}. "
                f"Pass a PartitionSpec instead, or build the sharding on the same mesh.")
        strategy = strategy.spec
    if isinstance(strategy, Layout):
        if strategy.tensor_map is None:
            raise StrategyError(
                f"{where}: the Layout has no tensor map; call it with one entry per dimension "
                f"of the {shape_str} tensor, e.g. layout({', '.join(['None'] * len(shape))}).")
        if strategy.alias_name != mshape.names or strategy.device_matrix != mshape.sizes:
            raise StrategyError(
                f"{where}: Layout device_matrix {strategy.device_matrix} with aliases "
                f"{strategy.alias_name} does not match the mesh {mesh_str}. Build the Layout "
                f"with Layout({mshape.sizes}, {mshape.names}), or run on its mesh "
                f"(layout.mesh()).")
        if len(strategy.tensor_map) != len(shape):
            raise StrategyError(
                f"{where}: the Layout has {len(strategy.tensor_map)} entries but the tensor is "
                f"{shape_str} (rank {len(shape)}); give one entry per dimension.")
        strategy = strategy.partition_spec()
    if isinstance(strategy, PartitionSpec):
        return _check_partition_spec(strategy, shape, mshape, where, shape_str)
    if is_slice_counts(strategy):
        return _from_slice_counts(strategy, shape, mshape, where, shape_str)
    raise StrategyError(
        f"{where}: {strategy!r} is not a strategy. Use a tuple of slice counts such as "
        f"{tuple([1] * len(shape))}, a PartitionSpec such as P({', '.join(['None'] * len(shape))})"
        f", a jaxpar.Layout, or None to let jaxpar decide.")


def _check_partition_spec(pspec: PartitionSpec, shape: tuple[int, ...], mesh: MeshShape,
                          where: str, shape_str: str) -> Spec:
    if len(pspec) > len(shape):
        raise StrategyError(
            f"{where}: {pspec} has {len(pspec)} entries but the tensor is {shape_str} (rank "
            f"{len(shape)}); give at most one entry per dimension.")
    spec = Spec.from_partition_spec(pspec, len(shape))
    seen: list[str] = []
    for dim, axes in enumerate(spec.dims):
        for axis in axes:
            if axis not in mesh.names:
                raise StrategyError(
                    f"{where}: {pspec} names mesh axis {axis!r}, but the mesh {mesh} has axes "
                    f"{mesh.names}. Use one of those names.")
            if axis in seen:
                raise StrategyError(
                    f"{where}: {pspec} uses mesh axis {axis!r} twice; a mesh axis can split "
                    f"only one dimension of a tensor.")
            seen.append(axis)
        count = mesh.product(axes)
        if shape[dim] % count:
            raise StrategyError(
                f"{where}: {pspec} splits dimension {dim} of the {shape_str} tensor into {count} "
                f"(axes {'+'.join(axes)} of mesh {mesh}), but {shape[dim]} is not divisible by "
                f"{count}. Split that dimension over axes whose sizes divide {shape[dim]}, or "
                f"leave it whole (None).")
    return spec


def _from_slice_counts(counts: tuple[int, ...], shape: tuple[int, ...], mesh: MeshShape,
                       where: str, shape_str: str) -> Spec:
    if len(counts) != len(shape):
        raise StrategyError(
            f"{where}: strategy {counts} has {len(counts)} entries but the tensor is {shape_str} "
            f"(rank {len(shape)}); give one slice count per dimension, e.g. "
            f"{tuple([1] * len(shape))}.")
    for dim, (c, n) in enumerate(zip(counts, shape, strict=True)):
        if c < 1:
            raise StrategyError(f"{where}: slice count {c} for dimension {dim} must be >= 1.")
        if n % c:
            raise StrategyError(
                f"{where}: strategy {counts} cuts dimension {dim} of the {shape_str} tensor into "
                f"{c} slices, but {n} is not divisible by {c} (mesh {mesh}). Use a slice count "
                f"that divides {n}, such as {_divisors_hint(n, mesh.num_devices)}.")
    total = math.prod(counts)
    if total > mesh.num_devices:
        raise StrategyError(
            f"{where}: strategy {counts} asks for {total} slices of the {shape_str} tensor but "
            f"the mesh {mesh} has only {mesh.num_devices} devices. The product of the slice "
            f"counts must not exceed the number of devices.")
    axes = assign_axes(counts, mesh)
    if axes is None:
        raise StrategyError(
            f"{where}: strategy {counts} for the {shape_str} tensor cannot be laid onto the mesh "
            f"{mesh}: each slice count must be the size of a mesh axis or a product of adjacent "
            f"axes, each axis used once. Use a mesh whose axes match these counts, or give a "
            f"PartitionSpec naming the axes.")
    return Spec(axes)


def _divisors_hint(n: int, limit: int) -> str:
    divs = [d for d in range(2, limit + 1) if n % d == 0]
    return " or ".join(str(d) for d in divs[:3]) if divs else "1"


def assign_axes(counts: Sequence[int], mesh: MeshShape) -> tuple[tuple[str, ...], ...] | None:
    """The slice-count rule: mesh axes per dimension, or ``None`` if it cannot be laid out.

    >>> assign_axes((4, 2), MeshShape(("dp", "mp"), (2, 4)))
    (('mp',), ('dp',))
    >>> assign_axes((1, 8), MeshShape(("dp", "mp"), (2, 4)))
    ((), ('dp', 'mp'))
    >>> assign_axes((2, 1), MeshShape(("a", "b", "c"), (2, 2, 2)))
    (('a',), ())
    """
    return lay_counts(counts, mesh)


def mesh_for_slice_counts(
    strategies: Sequence[tuple[int, ...]], num_devices: int, *, where: str
) -> Mesh:
    """The mesh jaxpar builds for tensor strategies when no mesh is given (module docstring).

    >>> mesh = mesh_for_slice_counts([(2, 1), (1, 4)], 8, where="example")
    >>> dict(mesh.shape)
    {'a0': 2, 'a1': 4}
    """
    requests = [Request(tuple(c), f"{where}: tensor {i}") for i, c in enumerate(strategies)]
    sizes, names = mesh_axes_for(requests, num_devices)
    return make_mesh(sizes, names)
