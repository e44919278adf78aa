"""MindSpore's device matrix: which devices hold which slice, and the mesh that hosts them.

MindSpore lays every operator on a **device matrix**, the operator's split counts outermost
first: a tensor layout's own slice counts (``mindspore.shard`` puts an identity with the input's
strategy on every input, ``frontend/parallel/shard/shard.cc``), a MatMul's ``[i, k, j]``
(``ops_info/matmul_info.cc``; ``tests/ut/cpp/parallel/ops_info/matmul_info_test.cc``,
``InferDevMatrixShape1``: strategy ``((2, 4, 8, 16), (2, 4, 16, 1))`` gives ``[2, 4, 8, 16, 1]``).
When the strategy uses fewer devices than there are, the number of copies is appended as the
last, innermost axis (``ops_info/operator_info.cc``, ``SetRepeatedCalcDevMatrix``: "set the
repeated_calc_num as the last dimension of dev-matrix in default").  Rank ``r`` sits at ``r``'s
row-major coordinates, the last axis fastest (``device_matrix.cc``;
``tests/ut/cpp/parallel/device_matrix_test.cc``), so a collective over the innermost axis runs
among neighbouring ranks: the same node, the fast links.

jaxpar runs a whole program on one mesh, a device matrix whose axes have names.  Slice counts go
onto a mesh by :func:`lay_counts`: the counts of a device matrix, first to last, each take the
outermost run of adjacent unused mesh axes whose sizes multiply to the count; the axes left over
(the innermost) hold the copies.  Without a mesh, :func:`mesh_axes_for` builds one on which every
strategy of the program lands where its own device matrix puts it.

>>> group_list((2, 1, 4, 2), rank=5)   # device_matrix_test.cc, Test4DGetAlongDim
[(5, 13), (5,), (1, 3, 5, 7), (4, 5)]
>>> lay_counts((2, 4), MeshShape(("a0", "a1"), (2, 4)))
(('a0',), ('a1',))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jaxpar._src.errors import MeshError
from jaxpar._src.spec import MeshShape


def coordinates(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """``rank``'s row-major position in a device matrix of ``shape`` (the last axis fastest).

    >>> coordinates(1, (2, 4))
    (0, 1)
    """
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def groups_along(shape: Sequence[int], axis: int) -> tuple[tuple[int, ...], ...]:
    """Every group of ranks that differ only in their coordinate on ``axis``: the devices a
    collective over that device-matrix axis joins (MindSpore's ``CreateGroupByDim``).

    >>> groups_along((2, 4), 1)
    ((0, 1, 2, 3), (4, 5, 6, 7))
    >>> groups_along((2, 4), 0)
    ((0, 4), (1, 5), (2, 6), (3, 7))
    """
    n = math.prod(shape)
    stride = math.prod(shape[axis + 1:])
    seen: set[int] = set()
    groups = []
    for r in range(n):
        if r in seen:
            continue
        base = r - coordinates(r, shape)[axis] * stride
        group = tuple(base + k * stride for k in range(shape[axis]))
        seen.update(group)
        groups.append(group)
    return tuple(groups)


def group_list(shape: Sequence[int], rank: int) -> list[tuple[int, ...]]:
    """For each device-matrix axis, the group along it that holds ``rank``
    (MindSpore's ``DeviceMatrix::CreateGroupList``)."""
    return [next(g for g in groups_along(shape, axis) if rank in g)
            for axis in range(len(shape))]


def lay_counts(counts: Sequence[int], mesh: MeshShape,
               used: frozenset[str] = frozenset()) -> tuple[tuple[str, ...], ...] | None:
    """The mesh axes of each count of a device matrix, or ``None`` if it cannot be laid out.

    Counts are taken first to last; each count ``c > 1`` takes the outermost run of adjacent
    mesh axes, not used yet, whose sizes multiply to ``c``.  What is left over, innermost, holds
    the copies, as MindSpore appends the repeat count last.

    >>> m = MeshShape(("dp", "mp"), (2, 4))
    >>> lay_counts((4, 2), m), lay_counts((1, 8), m), lay_counts((2, 2), m)
    ((('mp',), ('dp',)), ((), ('dp', 'mp')), None)
    """
    taken = set(used)
    out: list[tuple[str, ...]] = []
    for c in counts:
        if c == 1:
            out.append(())
            continue
        run = _outermost_run(c, mesh, taken)
        if run is None:
            return None
        taken.update(run)
        out.append(run)
    return tuple(out)


def _outermost_run(count: int, mesh: MeshShape, taken: set[str]) -> tuple[str, ...] | None:
    n = len(mesh.names)
    for start in range(n):
        product = 1
        for end in range(start, n):
            if mesh.names[end] in taken:
                break
            product *= mesh.sizes[end]
            if product == count:
                return tuple(mesh.names[start:end + 1])
            if product > count or count % product:
                break
    return None


@dataclasses.dataclass(frozen=True)
class Request:
    """One device matrix the program asks for: split counts, outermost first, and who asks."""

    counts: tuple[int, ...]
    where: str  # e.g. "jaxpar.shard(matmul): operator dot_general"
    exact: bool = False  # an operator's: must land where its own device matrix puts it

    def describe(self) -> str:
        return f"{self.where} strategy {self.counts}"


def mesh_axes_for(requests: Sequence[Request], num_devices: int
                  ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Axis sizes and names of a mesh that hosts every request, outermost first.

    The first request's device matrix (copies innermost) is the starting mesh.  A later request
    that :func:`lay_counts` cannot place on the mesh so far, or an operator's request
    (``exact``) that it would place elsewhere than its own device matrix does, refines it: the
    mesh's axes are cut where the request's device matrix is cut, so the request lands where
    MindSpore puts it.  A tensor's request that fits the mesh so far reuses its axes (its
    operator's, usually), as MindSpore's redistribution would bring it there anyway.
    Cuts must nest (each block size divides the next); when they do not, the two requests cannot
    share one mesh and the error names both.  Axes that no request splits are named ``rep``
    (``rep1``, ... if several), the others ``a0``, ``a1``, ...

    >>> mesh_axes_for([Request((2, 4), "x"), Request((4, 1), "w")], 8)
    ((2, 4), ('a0', 'a1'))
    >>> mesh_axes_for([Request((2, 1), "x")], 8)
    ((2, 4), ('a0', 'rep'))
    """
    cuts: dict[int, Request | None] = {1: None, num_devices: None}  # block size -> who cut it
    for req in requests:
        product = math.prod(req.counts)
        if product > num_devices or num_devices % product:
            raise MeshError(
                f"{req.describe()} asks for {product} slices, which does not divide the "
                f"{num_devices} devices available. Use slice counts whose product divides "
                f"{num_devices}, or give a mesh (mesh=jaxpar.make_mesh(...) or "
                f"set_auto_parallel_context(mesh=...)).")
        sizes = _sizes(cuts)
        names = tuple(map(str, range(len(sizes))))
        axes = lay_counts(req.counts, MeshShape(names, sizes))
        if axes is not None and (not req.exact or _top_aligned(axes, names)):
            continue  # the mesh so far already hosts it
        for block in _blocks(req.counts, num_devices):
            if block in cuts:
                continue
            for other, owner in cuts.items():
                if block % other and other % block:
                    who = owner.describe() if owner is not None else "the device count"
                    raise MeshError(
                        f"{req.describe()} and {who} cannot share one mesh: on {num_devices} "
                        f"devices the first puts blocks of {block} neighbouring devices "
                        f"together, the second blocks of {other}, and neither divides the "
                        f"other. Give one of them counts that nest with the other's, or give "
                        f"a mesh and PartitionSpecs naming its axes.")
            cuts[block] = req
    sizes = _sizes(cuts)
    probe = MeshShape(tuple(f"_{i}" for i in range(len(sizes))), sizes)
    used: set[str] = set()
    for req in requests:
        axes = lay_counts(req.counts, probe)
        used.update(a for run in axes or () for a in run)
    final: list[str] = []
    n_used, n_rep = 0, 0
    for name in probe.names:
        if name in used:
            final.append(f"a{n_used}")
            n_used += 1
        else:
            final.append("rep" if n_rep == 0 else f"rep{n_rep}")
            n_rep += 1
    return sizes, tuple(final)


def _top_aligned(axes: Sequence[tuple[str, ...]], names: Sequence[str]) -> bool:
    """Whether the runs fill the mesh from the outermost axis in, without gaps: the device
    matrix's own placement."""
    flat = [a for run in axes for a in run]
    return flat == list(names[:len(flat)])


def _blocks(counts: Sequence[int], num_devices: int) -> list[int]:
    """Block sizes (ranks per slice) at each cut of ``counts``'s device matrix, copies last."""
    block = num_devices // math.prod(counts)  # the copies, innermost
    out = [block]
    for c in reversed(counts):
        block *= c
        out.append(block)
    return out


def _sizes(cuts: dict[int, Request | None]) -> tuple[int, ...]:
    blocks = sorted(cuts)
    return tuple(blocks[i + 1] // blocks[i] for i in reversed(range(len(blocks) - 1)))
