"""``HardwareProfile``: what the cost model prices, for the machine we have or one we do not.

A profile gives per-device compute throughput and memory, and per mesh axis the link bandwidth
and latency of collectives (the alpha-beta model).  Axes can differ: inner axes that stay inside a
node ride NVLink-class links, outer axes cross the network.  Unless an axis is named in
``axis_bandwidth``/``axis_latency``, its link is chosen by position: the innermost axes whose
device counts multiply to at most ``devices_per_node`` are inside a node, the rest cross nodes.

Two more fields describe what XLA makes of the collectives on that backend (see ``combine.py``):
``combine_threshold_bytes`` (per collective kind, the size up to which XLA's combiner passes merge
independent collectives into one; a kind left out is never combined) and
``overlap_collectives`` (whether collectives run asynchronously beside compute, as XLA:GPU's
latency-hiding scheduler runs them, or block it, as on XLA:CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpar._src.spec import MeshShape

_GB = 1e9
_MIB = 1 << 20
# XLA:CPU combines only all-reduces, with no size limit (cpu_compiler.cc: CpuAllReduceCombiner,
# kCombineBytes = int64 max, kCombineCount = 256).
_CPU_COMBINE = (("all-reduce", float(2**63 - 1)),)
# XLA:GPU's default thresholds (collective_utils.h: kDefault{AllReduce,AllGather,ReduceScatter}
# CombineThreshold = 30 MiB + 7), 256 operands per combined collective (gpu_compiler.cc).
# Paid once per collective call (kernel launch, handshake): NCCL's base latency of its Ring/LL
# algorithm (src/graph/tuning.cc: baseLat 6.6 us), beside each preset's per-step latencies.
_LAUNCH = 6.6e-6
_GPU_COMBINE = (("all-gather", 30.0 * _MIB + 7), ("all-reduce", 30.0 * _MIB + 7),
                ("reduce-scatter", 30.0 * _MIB + 7))

# name -> field values.  Figures are vendor peak numbers derated to what training sees
# (about 40% of dense bf16 peak; unidirectional link bandwidth).
PRESETS: dict[str, dict[str, Any]] = {
    # 8 emulated devices on one host: memory copies through shared RAM.  A collective is a
    # rendezvous of the devices' threads: small all-reduces and all-gathers take about the same
    # time, growing with the group (25-30 us per peer measured with 8 devices on 2 cores).
    "cpu": dict(flops_per_s=5e10, memory_per_device=8 * _GB, devices_per_node=1 << 30,
                intra_node_bandwidth=10 * _GB, inter_node_bandwidth=10 * _GB,
                intra_node_latency=1e-5, inter_node_latency=1e-5, collective_latency=2e-5,
                combine_threshold_bytes=_CPU_COMBINE, overlap_collectives=False),
    # DGX A100: NVLink3 300 GB/s per direction inside 8 GPUs, 8x HDR 200 Gb/s IB across nodes.
    "a100": dict(flops_per_s=125e12, memory_per_device=80 * _GB, devices_per_node=8,
                 intra_node_bandwidth=300 * _GB, inter_node_bandwidth=25 * _GB,
                 intra_node_latency=5e-6, inter_node_latency=1.5e-5, collective_latency=_LAUNCH,
                 combine_threshold_bytes=_GPU_COMBINE, overlap_collectives=True),
    # DGX H100: NVLink4 450 GB/s per direction, 8x NDR 400 Gb/s IB across nodes.
    "h100": dict(flops_per_s=400e12, memory_per_device=80 * _GB, devices_per_node=8,
                 intra_node_bandwidth=450 * _GB, inter_node_bandwidth=50 * _GB,
                 intra_node_latency=4e-6, inter_node_latency=1.2e-5, collective_latency=_LAUNCH,
                 combine_threshold_bytes=_GPU_COMBINE, overlap_collectives=True),
    # H200: H100 compute with 141 GB HBM3e.
    "h200": dict(flops_per_s=400e12, memory_per_device=141 * _GB, devices_per_node=8,
                 intra_node_bandwidth=450 * _GB, inter_node_bandwidth=50 * _GB,
                 intra_node_latency=4e-6, inter_node_latency=1.2e-5, collective_latency=_LAUNCH,
                 combine_threshold_bytes=_GPU_COMBINE, overlap_collectives=True),
    # Ascend 910 (MindSpore's home): HCCS inside 8 NPUs, 100 GbE RoCE across servers.
    "ascend910": dict(flops_per_s=100e12, memory_per_device=32 * _GB, devices_per_node=8,
                      intra_node_bandwidth=30 * _GB, inter_node_bandwidth=12.5 * _GB,
                      intra_node_latency=1e-5, inter_node_latency=2e-5,
                      collective_latency=_LAUNCH,
                      # Not an XLA backend: priced as XLA:GPU would combine and overlap.
                      combine_threshold_bytes=_GPU_COMBINE, overlap_collectives=True),
}


def _items(x: Mapping[str, float] | tuple | None) -> tuple[tuple[str, float], ...]:
    if x is None:
        return ()
    pairs = x.items() if isinstance(x, Mapping) else x
    return tuple(sorted((str(k), float(v)) for k, v in pairs))


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Compute, memory and per-axis links of the target machine.

    Any field left out takes the value of ``preset`` (default ``"cpu"``).

    Args:
      preset: one of ``HardwareProfile.PRESETS`` (``cpu``, ``a100``, ``h100``, ``h200``,
        ``ascend910``).
      flops_per_s: sustained FLOP/s of one device.
      memory_per_device: bytes of device memory available to one program.
      axis_bandwidth: bytes/s of the links along named mesh axes (overrides position).
      axis_latency: seconds of latency per collective step along named mesh axes.
      devices_per_node: devices that share the fast intra-node links.
      intra_node_bandwidth / inter_node_bandwidth: bytes/s of links inside / across nodes.
      intra_node_latency / inter_node_latency: seconds per collective step inside / across.
      collective_latency: seconds every collective pays once, whatever its steps (launch and
        handshake; NCCL's base latency).  20 us for ``cpu``, 6.6 us for the GPU presets.
      combine_threshold_bytes: per collective kind (``"all-reduce"``, ``"all-gather"``,
        ``"reduce-scatter"``), the largest combined collective XLA's combiner builds; kinds left
        out are not combined.  ``cpu``: all-reduces without limit; GPU presets: 30 MiB each.
      combine_threshold_count: the most collectives one combined collective holds (256).
      overlap_collectives: collectives run beside compute (XLA:GPU's asynchronous collectives)
        rather than blocking it (XLA:CPU).  ``False`` for ``cpu``, ``True`` otherwise.

    >>> hw = HardwareProfile(preset="h100", axis_bandwidth={"dp": 25e9})
    >>> mesh = MeshShape(("dp", "mp"), (4, 8))
    >>> hw.bandwidth("dp", mesh), hw.bandwidth("mp", mesh)
    (25000000000.0, 450000000000.0)
    """

    preset: str = "cpu"
    flops_per_s: float | None = None
    memory_per_device: float | None = None
    axis_bandwidth: Mapping[str, float] | tuple | None = None
    axis_latency: Mapping[str, float] | tuple | None = None
    devices_per_node: int | None = None
    intra_node_bandwidth: float | None = None
    inter_node_bandwidth: float | None = None
    intra_node_latency: float | None = None
    inter_node_latency: float | None = None
    collective_latency: float | None = None
    combine_threshold_bytes: Mapping[str, float] | tuple | None = None
    combine_threshold_count: int = 256
    overlap_collectives: bool | None = None

    PRESETS = PRESETS

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            from jaxpar._src.errors import ContextError

            raise ContextError(
                f"jaxpar.HardwareProfile: unknown preset {self.preset!r}; choose one of "
                f"{sorted(PRESETS)}.")
        base = PRESETS[self.preset]
        for name, value in base.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        object.__setattr__(self, "axis_bandwidth", _items(self.axis_bandwidth))
        object.__setattr__(self, "axis_latency", _items(self.axis_latency))
        object.__setattr__(self, "combine_threshold_bytes",
                           _items(self.combine_threshold_bytes))

    @classmethod
    def named(cls, preset: str) -> HardwareProfile:
        """The preset profile ``preset``."""
        return cls(preset=preset)

    def _inside_node(self, axis: str, mesh: MeshShape) -> bool:
        inner = 1
        for name, size in reversed(tuple(zip(mesh.names, mesh.sizes, strict=True))):
            inner *= size
            if name == axis:
                return inner <= self.devices_per_node
        return True

    def bandwidth(self, axis: str, mesh: MeshShape) -> float:
        """Bytes/s one device moves along ``axis`` of ``mesh``."""
        explicit = dict(self.axis_bandwidth)
        if axis in explicit:
            return explicit[axis]
        inside = self._inside_node(axis, mesh)
        return self.intra_node_bandwidth if inside else self.inter_node_bandwidth

    def latency(self, axis: str, mesh: MeshShape) -> float:
        """Seconds per collective step along ``axis`` of ``mesh``."""
        explicit = dict(self.axis_latency)
        if axis in explicit:
            return explicit[axis]
        inside = self._inside_node(axis, mesh)
        return self.intra_node_latency if inside else self.inter_node_latency

    def combine_threshold(self, kind: str) -> float:
        """Bytes up to which XLA combines independent collectives of ``kind`` (0: never)."""
        return dict(self.combine_threshold_bytes).get(kind, 0.0)

    def describe(self) -> str:
        return (f"{self.preset}: {self.flops_per_s / 1e12:.3g} TFLOP/s, "
                f"{self.memory_per_device / _GB:.3g} GB/device, "
                f"{self.intra_node_bandwidth / _GB:.3g} GB/s inside {self.devices_per_node}-device"
                f" nodes, {self.inter_node_bandwidth / _GB:.3g} GB/s across")
