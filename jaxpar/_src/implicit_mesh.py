"""The mesh of a program that names none, built from every strategy in it.

MindSpore users never write a mesh: ``set_auto_parallel_context(device_num=8)`` and the
strategies are all there is.  When ``parallelize`` has no mesh (none given, none in the
context), jaxpar gathers the strategies of the whole program, in this order:

1. every ``jaxpar.shard`` met while tracing the function, in program order (found by a
   *discovery trace*: the function traced once with the shards only recording their strategies);
   a shard around one operator contributes the operator's device matrix, any other shard one
   device matrix per tensor;
2. ``in_strategy``, ``parameter_plan``, ``out_strategy`` and a tuple ``dataset_strategy`` of the
   ``parallelize`` call, one device matrix per tensor.

A ``jaxpar.Layout`` among them, or the ``mesh=`` of a nested shard, is a mesh already: all of
them must be the same mesh, and every slice count must fit on it.  Otherwise the mesh is built by
:func:`jaxpar._src.device_matrix.mesh_axes_for`.  Strategies that cannot share one mesh raise a
:class:`MeshError` naming both.  PartitionSpecs name the axes of a mesh and give none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from jaxpar._src.device_matrix import Request, lay_counts, mesh_axes_for
from jaxpar._src.errors import MeshError
from jaxpar._src.layout import Layout
from jaxpar._src.mesh import make_mesh
from jaxpar._src.spec import MeshShape
from jaxpar._src.strategy import is_slice_counts, is_strategy_leaf
from jaxpar._src.trace import abstract_value
from jaxpar._src.tracing_state import discovering


@dataclasses.dataclass(frozen=True)
class LayoutUse:
    """A ``jaxpar.Layout`` strategy and who gave it."""

    layout: Layout
    where: str


@dataclasses.dataclass(frozen=True)
class MeshUse:
    """The mesh a nested ``jaxpar.shard(..., mesh=...)`` was given, and who gave it."""

    mesh: Mesh
    where: str


Found = Request | LayoutUse | MeshUse


def strategy_requests(strategy: Any, where: str) -> list[Found]:
    """The device matrices one strategy (or a tree of them) asks for, one per tensor strategy."""
    if strategy is None:
        return []
    leaves = jax.tree.leaves(strategy, is_leaf=is_strategy_leaf)
    out: list[Found] = []
    for leaf in leaves:
        if isinstance(leaf, Layout):
            out.append(LayoutUse(leaf, where))
        elif is_slice_counts(leaf):
            out.append(Request(tuple(leaf), where))
    return out


def outer_requests(*, in_strategy: Any, out_strategy: Any,
                   parameter_plan: Mapping[str, Any] | None, dataset_strategy: Any,
                   api: str) -> list[Found]:
    """What the arguments of ``parallelize`` ask for, in the documented order."""
    out = strategy_requests(in_strategy, f"{api}: in_strategy")
    for key, strategy in (parameter_plan or {}).items():
        out += strategy_requests(strategy, f"{api}: parameter_plan[{key!r}]")
    out += strategy_requests(out_strategy, f"{api}: out_strategy")
    if isinstance(dataset_strategy, tuple):
        for i, entry in enumerate(dataset_strategy):
            out += strategy_requests(entry, f"{api}: dataset_strategy[{i}]")
    return out


def discover(fn: Any, args: Sequence[Any], static_argnums: Sequence[int]) -> list[Found]:
    """The strategies of the ``jaxpar.shard`` calls in ``fn(*args)``, in program order."""
    static = set(static_argnums)
    abstract = [a if i in static else jax.tree.map(_abstract, a) for i, a in enumerate(args)]
    with discovering() as found:
        jax.make_jaxpr(fn, static_argnums=tuple(static_argnums))(*abstract)
    return list(found)


def implicit_mesh(found: Sequence[Found], num_devices: int) -> Mesh | None:
    """The mesh that hosts every strategy found, or ``None`` when none gives a device matrix."""
    given = [(f.where, f.layout.mesh()) if isinstance(f, LayoutUse) else (f.where, f.mesh)
             for f in found if isinstance(f, (LayoutUse, MeshUse))]
    requests = [f for f in found if isinstance(f, Request)]
    if given:
        (where, mesh), key = given[0], _mesh_key(given[0][1])
        for other_where, other in given[1:]:
            if _mesh_key(other) != key:
                raise MeshError(
                    f"{where} and {other_where} cannot share one mesh: they give the meshes "
                    f"{MeshShape.of(mesh)} and {MeshShape.of(other)} (or other device orders). "
                    f"Build every Layout of a program from one Layout(device_matrix, "
                    f"alias_name), and give shards one mesh.")
        shape = MeshShape.of(mesh)
        for req in requests:
            if lay_counts(req.counts, shape) is None:
                raise MeshError(
                    f"{req.describe()} cannot be laid on the mesh {shape} given by {where}: "
                    f"each slice count must be the size of a run of its axes. Give it as a "
                    f"Layout too, or with counts that match the device matrix {shape.sizes}.")
        return mesh
    if not requests:
        return None
    sizes, names = mesh_axes_for(requests, num_devices)
    return make_mesh(sizes, names)


def _mesh_key(mesh: Mesh) -> tuple:
    return MeshShape.of(mesh), tuple(d.id for d in mesh.devices.flat)


def _abstract(x: Any) -> Any:
    if isinstance(x, (jax.ShapeDtypeStruct, PartitionSpec)):
        return x
    return abstract_value(x)  # as jax.jit sees it (a float64 jax.Array stays float64)
