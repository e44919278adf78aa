"""Device meshes: always ``AxisType.Auto``, which sharding constraints need.

``jax.make_mesh`` defaults to ``Explicit`` axes since JAX 0.7, and ``with_sharding_constraint``
refuses those.  :func:`make_mesh` is the one constructor jaxpar uses and offers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar._src.errors import MeshError


def make_mesh(
    axis_shapes: Sequence[int],
    axis_names: Sequence[str],
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a device mesh whose axes are all ``AxisType.Auto``.

    Args:
      axis_shapes: size of each mesh axis; their product is the number of devices used.
      axis_names: one unique name per axis, e.g. ``("dp", "mp")``.
      devices: the devices to arrange; defaults to the first ``prod(axis_shapes)`` of
        ``jax.devices()``.

    Returns:
      A ``jax.sharding.Mesh``.

    Raises:
      MeshError: names and shapes disagree, or there are not enough devices.

    >>> mesh = make_mesh((2, 4), ("dp", "mp"))
    >>> dict(mesh.shape)
    {'dp': 2, 'mp': 4}
    """
    shapes = tuple(int(s) for s in axis_shapes)
    names = tuple(axis_names)
    if len(shapes) != len(names):
        raise MeshError(
            f"jaxpar.make_mesh: {len(shapes)} axis sizes {shapes} but {len(names)} names "
            f"{names}; give one name per axis.")
    if len(set(names)) != len(names):
        raise MeshError(f"jaxpar.make_mesh: axis names {names} repeat; each must be unique.")
    if any(s < 1 for s in shapes):
        raise MeshError(f"jaxpar.make_mesh: axis sizes {shapes} must all be at least 1.")
    need = math.prod(shapes)
    pool = list(jax.devices()) if devices is None else list(devices)
    if need > len(pool):
        raise MeshError(
            f"jaxpar.make_mesh: the mesh {dict(zip(names, shapes, strict=True))} needs {need} "
            f"devices but only {len(pool)} are available. On CPU, start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} (or set "
            f"jax.config.update('jax_num_cpu_devices', {need}) before JAX starts).")
    chosen = pool[:need]
    axis_types = (AxisType.Auto,) * len(names)
    if devices is None and need == len(pool):
        # jax.make_mesh orders devices for the physical topology on accelerators.
        return jax.make_mesh(shapes, names, axis_types=axis_types)
    return Mesh(np.array(chosen, dtype=object).reshape(shapes), names, axis_types=axis_types)


def describe_mesh(mesh: Mesh) -> str:
    """``"(dp=2, mp=4)"``: the form used in every message."""
    return "(" + ", ".join(f"{n}={s}" for n, s in mesh.shape.items()) + ")"


def check_auto_axes(mesh: Mesh, where: str) -> None:
    """Raises unless every axis of ``mesh`` is ``AxisType.Auto``."""
    types = getattr(mesh, "axis_types", None)
    if types is None:
        return
    bad = [n for n, t in zip(mesh.axis_names, types, strict=True) if t != AxisType.Auto]
    if bad:
        raise MeshError(
            f"{where}: mesh axes {bad} are not AxisType.Auto; jaxpar places shardings with "
            f"sharding constraints, which need Auto axes. Build the mesh with "
            f"jaxpar.make_mesh(...) or pass axis_types=(AxisType.Auto,) * {len(types)}.")


def single_device_mesh() -> Mesh:
    """A one-device mesh for ``stand_alone`` mode."""
    return Mesh(np.array(jax.devices()[:1], dtype=object).reshape(1), ("device",),
                axis_types=(AxisType.Auto,))
