"""What the pipeline's memory model reads of a program, shared by the program and the drafts
the split's memory check makes before it exists: the representative layer, a value's layout
in the micro-batch plan, and an array's bytes per device.

``program.PipelineProgram`` and ``early.Draft`` both have ``graph``, ``sub_plan``, ``layers``
and ``rep``; :class:`LayerView` gives them :attr:`~LayerView.rep_layer` and
:meth:`~LayerView.spec`, which ``memory.loop_memory`` reads of either.

>>> import jax, numpy as np
>>> from jaxpar._src.spec import MeshShape, Spec
>>> mesh = MeshShape(("dp",), (4,))
>>> local_bytes(jax.ShapeDtypeStruct((8, 16), np.float32), Spec((("dp",), ())), mesh)
128.0
>>> format_bytes(1536.0)
'1.5 KiB'
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from jaxpar._src.spec import MeshShape, Spec

if TYPE_CHECKING:
    from jaxpar._src.pipeline.layers import Layer


class LayerView:
    """``rep_layer`` and ``spec`` over a dataclass with ``graph``, ``sub_plan`` (the
    micro-batch plan), ``layers`` (a ``LayerSequence``) and ``rep`` (the layer whose nodes
    every layer runs)."""

    graph: Any
    sub_plan: Any
    layers: Any
    rep: int

    @property
    def rep_layer(self) -> Layer:
        """The layer whose nodes every layer runs."""
        return self.layers.layers[self.rep]

    def spec(self, vid: int) -> Spec:
        """The micro-batch plan's layout of value ``vid``."""
        v = self.graph.values[vid]
        return self.sub_plan.decisions[v.producer].out_specs[v.index]


def local_bytes(aval: Any, spec: Spec | None, mesh: MeshShape) -> float:
    """Bytes per device of an array of ``aval``'s shape and dtype laid out ``spec``
    (``None``, or a spec of another rank: whole)."""
    shape = tuple(aval.shape)
    size = jnp.dtype(aval.dtype).itemsize
    if spec is not None and spec.ndim == len(shape):
        shape = spec.shard_shape(shape, mesh)
    return float(math.prod(shape) * size)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest unit it reaches, three digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
