"""Normalising user strategies into :class:`Spec`, once, at the API boundary.

Accepted forms, wherever jaxpar takes a strategy for a tensor:

* ``None``: free; propagation or search decides.
* a tuple of ints, MindSpore's slice counts: ``(2, 4)`` cuts dimension 0 in 2 and dimension 1 in 4;
* a ``jax.sharding.PartitionSpec`` over the mesh's axis names (or a ``NamedSharding``);
* a :class:`jaxpar.Layout` called with one entry per dimension.

**The slice-count rule.**  Dimensions are taken from the last to the first.  Each count ``c > 1``
takes, among the mesh axes this tensor does not use yet, the innermost single axis of size ``c``;
failing that, the innermost run of adjacent axes whose sizes multiply to ``c`` (split major to
minor); failing that, it is an error.  Axes left over replicate the tensor; as in MindSpore, the
repeated copies sit on the outermost axes.  On mesh ``(dp=2, mp=4)``: ``(2, 1)`` is
``P('dp', None)``, ``(1, 4)`` is ``P(None, 'mp')``, ``(4, 2)`` is ``P('mp', 'dp')`` and ``(8, 1)``
is ``P(('dp', 'mp'), None)``.

**Without a mesh**, :func:`mesh_for_slice_counts` builds one from the strategies: reading them in
order, each count that the axes created so far cannot form (by the rule above) becomes a new
axis, placed inside the earlier ones; devices left over form an outermost replica axis.  For
``in_strategy=((2, 1), (1, 4))`` on 8 devices this is the mesh ``(a0=2, a1=4)``, the device
matrix MindSpore derives for the same MatMul strategy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar._src.errors import MeshError, StrategyError
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
        if tuple(strategy.mesh.axis_names) != mshape.names or \
                tuple(strategy.mesh.devices.shape) != mshape.sizes:
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
    """
    used: set[str] = set()
    dims: list[tuple[str, ...]] = [()] * len(counts)
    for dim in reversed(range(len(counts))):
        c = counts[dim]
        if c == 1:
            continue
        run = _find_run(c, mesh, used)
        if run is None:
            return None
        used.update(run)
        dims[dim] = run
    return tuple(dims)


def _find_run(count: int, mesh: MeshShape, used: set[str]) -> tuple[str, ...] | None:
    n = len(mesh.names)
    for i in reversed(range(n)):  # innermost single axis first
        if mesh.names[i] not in used and mesh.sizes[i] == count:
            return (mesh.names[i],)
    for length in range(2, n + 1):  # then the innermost run of adjacent axes
        for start in reversed(range(n - length + 1)):
            names = mesh.names[start:start + length]
            if any(a in used for a in names):
                continue
            if math.prod(mesh.sizes[start:start + length]) == count:
                return tuple(names)
    return None


def mesh_for_slice_counts(
    strategies: Sequence[tuple[int, ...]], num_devices: int, *, where: str
) -> Mesh:
    """The mesh jaxpar builds when slice counts are given and no mesh is (module docstring).

    >>> mesh = mesh_for_slice_counts([(2, 1), (1, 4)], 8, where="example")
    >>> dict(mesh.shape)
    {'a0': 2, 'a1': 4}
    """
    sizes: list[int] = []
    for counts in strategies:
        # Reuse the rule itself: grow the mesh until this tensor's counts can be laid out.
        while True:
            names = tuple(f"a{i}" for i in range(len(sizes)))
            probe = MeshShape(names, tuple(sizes))
            missing = _first_unplaceable(counts, probe)
            if missing is None:
                break
            sizes.append(missing)
    used = math.prod(sizes) if sizes else 1
    if used > num_devices or num_devices % used:
        raise MeshError(
            f"{where}: the slice counts {list(strategies)} need a device matrix of "
            f"{used} devices ({' x '.join(map(str, sizes))}), which does not divide the "
            f"{num_devices} devices available. Give a mesh explicitly (mesh=jaxpar.make_mesh(...) "
            f"or set_auto_parallel_context(mesh=...)).")
    names = [f"a{i}" for i in range(len(sizes))]
    if used < num_devices:
        sizes.insert(0, num_devices // used)
        names.insert(0, "rep")
    if not sizes:
        sizes, names = [num_devices], ["a0"]
    return make_mesh(tuple(sizes), tuple(names))


def _first_unplaceable(counts: Sequence[int], mesh: MeshShape) -> int | None:
    used: set[str] = set()
    for dim in reversed(range(len(counts))):
        c = counts[dim]
        if c == 1:
            continue
        run = _find_run(c, mesh, used)
        if run is None:
            return c
        used.update(run)
    return None
