"""The cost model shared by every search: compute, communication and memory per device.

Collectives are priced with the alpha-beta model per mesh axis (``HardwareProfile``): a launch
latency paid once per collective (``collective_latency``), ``alpha`` seconds per algorithm step
over the slowest-latency axis of the group, and the bytes one device sends over the slowest link
of the group.  The algorithm follows the message size, as NCCL
chooses between its Tree and Ring algorithms for all-reduce (and uses Ring for the rest):

* all-reduce of ``S`` bytes over ``n`` devices: the cheaper of the ring
  (``2 (n - 1)`` steps, ``2 (n - 1) / n * S`` bytes sent: bandwidth-optimal, for large
  messages) and a latency-bound tree (recursive doubling: ``ceil(log2 n)`` steps, each sending
  the whole buffer: for small messages);
* all-gather to ``S`` bytes, reduce-scatter from ``S`` bytes: ring, ``n - 1`` steps,
  ``(n - 1) / n * S`` bytes;
* all-to-all of ``S`` bytes: ``n - 1`` pairwise steps, ``(n - 1) / n * S`` bytes.

Wire bytes (what :mod:`jaxpar.inspect` reports for the compiled program) are always the ring's.
At ZeRO levels 1-3 a weight gradient's contraction is lowered as a local contraction and a
reduce-scatter (``scatter.py``): :meth:`CostModel.scatter_collectives` prices it.
Which collectives XLA merges into one, and which can run beside compute, is a property of the
whole program, not of one operator: ``combine.py`` prices that; here a collective is priced on
its own unless the caller says it travels in a combined collective of ``bucket`` bytes (the
searches' gradient all-reduces, see ``SearchSpace.bucket_bytes``): then it pays its bytes' share
of that collective's time, latency included.

A layout change (an edge whose two ends disagree) is decomposed per mesh axis, as MindSpore's
redistribution does: axes only the target has are local slices (free), axes that move to another
dimension are an all-to-all, axes only the source has are gathered.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpar._src.graph import itemsize
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.rules.factors import FactorRule, OpStrategy
from jaxpar._src.spec import MeshShape, Spec


@dataclasses.dataclass(frozen=True, slots=True)
class Cost:
    """Per-device cost terms of one operator or edge (already multiplied by loop trips)."""

    flops: float = 0.0  # floating-point operations on one device
    comm_bytes: float = 0.0  # bytes one device sends over links
    comm_time: float = 0.0  # seconds of collectives (alpha-beta)
    memory: float = 0.0  # bytes of the operands and results one device holds

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.comm_bytes + other.comm_bytes,
                    self.comm_time + other.comm_time, self.memory + other.memory)

    def scaled(self, w: float) -> Cost:
        return Cost(self.flops * w, self.comm_bytes * w, self.comm_time * w, self.memory)

    def time(self, hw: HardwareProfile) -> float:
        """Simulated seconds: compute at the device's FLOP rate plus collectives."""
        return self.flops / hw.flops_per_s + self.comm_time


ZERO = Cost()


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One predicted collective."""

    kind: str  # "all-reduce" | "all-gather" | "reduce-scatter" | "all-to-all"
    axes: tuple[str, ...]
    nbytes: float  # payload: all-reduce size, gathered size, scattered input size
    wire_bytes: float  # what one device sends
    time: float
    reduction: str = ""  # all-reduce: "sum", "max", ...; XLA combines only equal reductions
    dtype: str = ""  # element type; XLA combines only equal element types


class CostModel:
    """Prices strategies and layout changes on one mesh with one hardware profile."""

    def __init__(self, mesh: MeshShape, hardware: HardwareProfile) -> None:
        self.mesh = mesh
        self.hw = hardware
        self._redistributions: dict[tuple, tuple[Collective, ...]] = {}
        self._splits: dict[OpStrategy, int] = {}  # devices each strategy splits its work over
        # seconds of each collective priced, by kind, bytes and axes: repeated layers move
        # the same bytes over the same axes (issue 14)
        self._times: dict[tuple, float] = {}

    # -- collectives --------------------------------------------------------------------------
    def collective(self, kind: str, nbytes: float, axes: Sequence[str], *,
                   bucket: float = 0.0, reduction: str = "", dtype: str = ""
                   ) -> Collective:
        """One collective, its algorithm chosen by size; one XLA combines into a collective of
        ``bucket`` bytes pays its bytes' share of that one's time."""
        axes = tuple(a for a in axes if self.mesh.size(a) > 1)
        n = self.mesh.product(axes)
        if n <= 1 or nbytes <= 0:
            return Collective(kind, axes, 0.0, 0.0, 0.0, reduction, dtype)
        factor = 2.0 * (n - 1) / n if kind == "all-reduce" else (n - 1) / n
        wire = factor * nbytes
        if bucket > nbytes:
            time = nbytes / bucket * self.collective_time(kind, bucket, axes)
        else:
            time = self.collective_time(kind, nbytes, axes)
        return Collective(kind, axes, float(nbytes), wire, time, reduction, dtype)

    def collective_time(self, kind: str, nbytes: float, axes: Sequence[str]) -> float:
        """Seconds of one collective of ``nbytes`` over ``axes`` (see the module docstring)."""
        key = (kind, nbytes, tuple(axes))
        found = self._times.get(key)
        if found is None:
            found = self._times[key] = self._collective_time(kind, nbytes, key[2])
        return found

    def _collective_time(self, kind: str, nbytes: float, axes: tuple[str, ...]) -> float:
        n = self.mesh.product(axes)
        if n <= 1 or nbytes <= 0:
            return 0.0
        bandwidth = min(self.hw.bandwidth(a, self.mesh) for a in axes)
        alpha = max(self.hw.latency(a, self.mesh) for a in axes)
        launch = self.hw.collective_latency
        if kind == "all-reduce":
            ring = 2 * (n - 1) * alpha + 2.0 * (n - 1) / n * nbytes / bandwidth
            rounds = math.ceil(math.log2(n))
            tree = rounds * (alpha + nbytes / bandwidth)
            return launch + min(ring, tree)
        return launch + (n - 1) * alpha + (n - 1) / n * nbytes / bandwidth

    # -- edges --------------------------------------------------------------------------------
    def redistribution(self, src: Spec, dst: Spec, shape: tuple[int, ...], dtype: Any
                       ) -> tuple[Collective, ...]:
        """The collectives that turn layout ``src`` into ``dst``; empty when nothing moves."""
        if src == dst:
            return ()
        key = (src, dst, shape, dtype)
        found = self._redistributions.get(key)
        if found is None:
            found = self._redistributions[key] = _redistribution(self, src, dst, shape,
                                                                 itemsize(dtype))
        return found

    def edge_cost(self, src: Spec, dst: Spec, shape: tuple[int, ...], dtype: Any,
                  weight: float = 1.0) -> Cost:
        colls = self.redistribution(src, dst, shape, dtype)
        if not colls:
            return ZERO
        return Cost(comm_bytes=weight * sum(c.wire_bytes for c in colls),
                    comm_time=weight * sum(c.time for c in colls))

    # -- operators ----------------------------------------------------------------------------
    def op_collectives(self, strategy: OpStrategy, out_shapes: Sequence[tuple[int, ...]],
                       out_dtypes: Sequence[Any], *, bucket: float = 0.0
                       ) -> tuple[Collective, ...]:
        """The all-reduces that combine partial results of split reduction factors, one per
        result and factor: XLA's partitioner reduces each split contracting (or reduced)
        dimension over its own mesh axes, one after the other (a weight gradient contracted
        over a batch split on ``dp`` and a sequence split on ``mp`` is all-reduced over ``dp``,
        then over ``mp``; the combiner then merges each with the others over the same axes).

        ``bucket``: the size of the combined all-reduce each travels in (gradients on their way
        to the optimizer, which XLA's combiner merges), 0 when it runs alone.
        """
        if not strategy.partial:
            return ()
        reduction = dict(strategy.partial)
        groups = [axes for axes in strategy.factor_axes if axes and axes[0] in reduction]
        out = []
        for spec, shape, dtype in zip(strategy.out_specs, out_shapes, out_dtypes, strict=True):
            nbytes = math.prod(shape) * itemsize(dtype) * spec.shard_fraction(self.mesh)
            for axes in groups:
                c = self.collective("all-reduce", nbytes, axes, bucket=bucket,
                                    reduction=reduction[axes[0]], dtype=_dtype_name(dtype))
                if c.wire_bytes > 0:
                    out.append(c)
        return tuple(out)

    def scatter_collectives(self, axes: Sequence[str], summed: Sequence[str], out_spec: Spec,
                            out_shape: tuple[int, ...], out_dtype: Any
                            ) -> tuple[Collective, ...]:
        """A contraction lowered by reduce-scatter (ZeRO levels 1-3, ``scatter.py``): its
        local result, of ``out_shape`` laid out ``out_spec`` once scattered, reduce-scattered
        over ``axes`` (``(n - 1) / n`` of its bytes sent: half an all-reduce's), then the
        scattered result all-reduced over ``summed``, the other axes its contraction is split
        over.  In place of :meth:`op_collectives`'s all-reduces."""
        scattered = math.prod(out_shape) * itemsize(out_dtype) * out_spec.shard_fraction(
            self.mesh)
        dtype = _dtype_name(out_dtype)
        out = [self.collective("reduce-scatter", scattered * self.mesh.product(axes), axes,
                               dtype=dtype)]
        if summed:
            out.append(self.collective("all-reduce", scattered, summed, reduction="sum",
                                       dtype=dtype))
        return tuple(c for c in out if c.wire_bytes > 0)

    def op_cost(self, rule: FactorRule, strategy: OpStrategy,
                in_shapes: Sequence[tuple[int, ...]], in_dtypes: Sequence[Any],
                out_shapes: Sequence[tuple[int, ...]], out_dtypes: Sequence[Any],
                weight: float = 1.0, bucket: float = 0.0) -> Cost:
        colls = self.op_collectives(strategy, out_shapes, out_dtypes, bucket=bucket)
        memory = 0.0
        for spec, shape, dtype in zip(strategy.in_specs, in_shapes, in_dtypes, strict=True):
            memory += math.prod(shape) * itemsize(dtype) * spec.shard_fraction(self.mesh)
        for spec, shape, dtype in zip(strategy.out_specs, out_shapes, out_dtypes, strict=True):
            memory += math.prod(shape) * itemsize(dtype) * spec.shard_fraction(self.mesh)
        return Cost(self.op_flops(rule, strategy, weight),
                    weight * sum(c.wire_bytes for c in colls),
                    weight * sum(c.time for c in colls), memory)

    def op_flops(self, rule: FactorRule, strategy: OpStrategy, weight: float = 1.0) -> float:
        """:meth:`op_cost`'s FLOPs alone: what a whole plan's price needs of every node, without
        the collectives and bytes (issue 14: pricing a plan asks it of every operator)."""
        return rule.flops / self.split(strategy) * weight

    def split(self, strategy: OpStrategy) -> int:
        """Over how many devices ``strategy`` splits its operator's work (the product of the
        mesh axes its factors take), found once per strategy: the plans a search prices share
        a few hundred strategies over thousands of operators (issue 14)."""
        found = self._splits.get(strategy)
        if found is None:
            found = self._splits[strategy] = math.prod(
                self.mesh.product(a) for a in strategy.factor_axes)
        return found


def _dtype_name(dtype: Any) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def _redistribution(model: CostModel, src: Spec, dst: Spec, shape: tuple[int, ...],
                    item: int) -> tuple[Collective, ...]:
    mesh = model.mesh
    sliced, moved, gathered = [], [], []
    for axis in mesh.names:
        s, d = src.dim_of(axis), dst.dim_of(axis)
        if s is None and d is None:
            continue
        if s is not None and s == d:
            ps, pd = src.dims[s], dst.dims[d]
            if ps[: ps.index(axis) + 1] == pd[: pd.index(axis) + 1]:
                continue
            moved.append(axis)
        elif s is None:
            sliced.append(axis)
        elif d is None:
            gathered.append(axis)
        else:
            moved.append(axis)
    shard = math.prod(shape) * item / mesh.product(src.axes)
    shard /= mesh.product(sliced)
    out: list[Collective] = []
    if moved:
        out.append(model.collective("all-to-all", shard, moved))
    if gathered:
        out.append(model.collective("all-gather", shard * mesh.product(gathered), gathered))
    return tuple(c for c in out if c.wire_bytes > 0)
