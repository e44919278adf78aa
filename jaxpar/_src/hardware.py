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
import difflib
import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from jaxpar._src.errors import ContextError
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
# Paid once per traced operator, whatever its size (dispatch, kernel launch): what a layer of small
# matrices costs beyond its FLOPs.  CPU: XLA:CPU's thunks on the emulated mesh, about 1 us per
# operator of a GPT block's forward and backward (bench/pipeline_split.py).  GPUs: an estimate,
# not measured here (a kernel launch is a few us and XLA fuses several operators into one).
_OPERATOR = 1e-6
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
                operator_latency=_OPERATOR, combine_threshold_bytes=_CPU_COMBINE,
                overlap_collectives=False),
    # DGX A100: NVLink3 300 GB/s per direction inside 8 GPUs, 8x HDR 200 Gb/s IB across nodes.
    "a100": dict(flops_per_s=125e12, memory_per_device=80 * _GB, devices_per_node=8,
                 intra_node_bandwidth=300 * _GB, inter_node_bandwidth=25 * _GB,
                 intra_node_latency=5e-6, inter_node_latency=1.5e-5, collective_latency=_LAUNCH,
                 operator_latency=_OPERATOR, combine_threshold_bytes=_GPU_COMBINE,
                 overlap_collectives=True),
    # DGX H100: NVLink4 450 GB/s per direction, 8x NDR 400 Gb/s IB across nodes.
    "h100": dict(flops_per_s=400e12, memory_per_device=80 * _GB, devices_per_node=8,
                 intra_node_bandwidth=450 * _GB, inter_node_bandwidth=50 * _GB,
                 intra_node_latency=4e-6, inter_node_latency=1.2e-5, collective_latency=_LAUNCH,
                 operator_latency=_OPERATOR, combine_threshold_bytes=_GPU_COMBINE,
                 overlap_collectives=True),
    # H200: H100 compute with 141 GB HBM3e.
    "h200": dict(flops_per_s=400e12, memory_per_device=141 * _GB, devices_per_node=8,
                 intra_node_bandwidth=450 * _GB, inter_node_bandwidth=50 * _GB,
                 intra_node_latency=4e-6, inter_node_latency=1.2e-5, collective_latency=_LAUNCH,
                 operator_latency=_OPERATOR, combine_threshold_bytes=_GPU_COMBINE,
                 overlap_collectives=True),
    # Ascend 910 (MindSpore's home): HCCS inside 8 NPUs, 100 GbE RoCE across servers.
    "ascend910": dict(flops_per_s=100e12, memory_per_device=32 * _GB, devices_per_node=8,
                      intra_node_bandwidth=30 * _GB, inter_node_bandwidth=12.5 * _GB,
                      intra_node_latency=1e-5, inter_node_latency=2e-5,
                      collective_latency=_LAUNCH, operator_latency=_OPERATOR,
                      # Not an XLA backend: priced as XLA:GPU would combine and overlap.
                      combine_threshold_bytes=_GPU_COMBINE, overlap_collectives=True),
}


def _items(x: Mapping[str, float] | tuple | None) -> tuple[tuple[str, float], ...]:
    if x is None:
        return ()
    pairs = x.items() if isinstance(x, Mapping) else x
    return tuple(sorted((str(k), float(v)) for k, v in pairs))


_POSITIVE = ("flops_per_s", "memory_per_device", "intra_node_bandwidth", "inter_node_bandwidth")
_LATENCIES = ("intra_node_latency", "inter_node_latency", "collective_latency",
              "operator_latency")


def _check_number(name: str, value: Any, *, positive: bool) -> None:
    """A real number, not NaN, > 0 (rates, sizes) or >= 0 (latencies); inf is allowed."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(
        value) and (float(value) > 0 if positive else float(value) >= 0)
    if not ok:
        unit = next((u for key, u in _UNITS.items() if key in name), "")
        raise ContextError(
            f"jaxpar.HardwareProfile: {name} must be a "
            f"{'positive' if positive else 'non-negative'} number, got {value!r}. Give it in "
            f"{unit}.")


_UNITS = {"flops": "FLOP/s, e.g. 400e12", "memory": "bytes, e.g. 80e9",
          "bandwidth": "bytes/s, e.g. 50e9", "latency": "seconds, e.g. 1e-5"}


def _pairs(name: str, x: Any) -> tuple[tuple[str, Any], ...]:
    if x is None:
        return ()
    try:
        pairs = tuple(x.items() if isinstance(x, Mapping) else x)
        if all(isinstance(k, str) for k, _ in pairs):
            return pairs
    except (TypeError, ValueError):
        pass
    raise ContextError(f"jaxpar.HardwareProfile: {name} must be a dict from mesh axis names to "
                       f"numbers, e.g. {{'dp': 25e9}}, got {x!r}.")


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
      operator_latency: seconds every traced operator pays once, whatever its FLOPs (dispatch,
        launch).  1 us for every preset (measured for ``cpu``; an estimate for the others);
        :func:`jaxpar.calibrate` measures it on the devices at hand.
        Only the pipeline's stage split prices it: a layer of small matrices costs its
        operators' count more than its FLOPs, and without it a scalar collective in the
        epilogue outweighed dozens of such layers.
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
    operator_latency: float | None = None
    combine_threshold_bytes: Mapping[str, float] | tuple | None = None
    combine_threshold_count: int = 256
    overlap_collectives: bool | None = None

    PRESETS = PRESETS

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str) or self.preset not in PRESETS:
            raise ContextError(
                f"jaxpar.HardwareProfile: unknown preset {self.preset!r}; choose one of "
                f"{sorted(PRESETS)}.")
        base = PRESETS[self.preset]
        for name, value in base.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in _POSITIVE:
            _check_number(name, getattr(self, name), positive=True)
        for name in _LATENCIES:
            _check_number(name, getattr(self, name), positive=False)
        dpn = self.devices_per_node
        if isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
            raise ContextError(f"jaxpar.HardwareProfile: devices_per_node must be a positive int "
                               f"(devices sharing the fast links), got {dpn!r}.")
        for name, positive in (("axis_bandwidth", True), ("axis_latency", False)):
            pairs = _pairs(name, getattr(self, name))
            for axis, value in pairs:
                _check_number(f"{name}[{axis!r}]", value, positive=positive)
            object.__setattr__(self, name, _items(pairs))
        pairs = _pairs("combine_threshold_bytes", self.combine_threshold_bytes)
        for kind, value in pairs:
            _check_number(f"combine_threshold_bytes[{kind!r}]", value, positive=False)
        object.__setattr__(self, "combine_threshold_bytes", _items(pairs))

    def check_mesh(self, mesh: MeshShape, where: str) -> None:
        """Raises when ``axis_bandwidth``/``axis_latency`` name an axis ``mesh`` lacks (a typo
        would otherwise price that axis by position, silently).

        >>> mesh = MeshShape(("data", "model"), (2, 4))
        >>> HardwareProfile(axis_bandwidth={"modle": 1e9}).check_mesh(mesh, "f")
        Traceback (most recent call last):
        ...
        jaxpar._src.errors.ContextError: f: HardwareProfile axis_bandwidth names mesh axis \
'modle', but the mesh has axes ('data', 'model') (did you mean 'model'?). Name the mesh's axes, \
or leave the axis out to price it by position.
        """
        for name in ("axis_bandwidth", "axis_latency"):
            for axis, _ in getattr(self, name):
                if axis not in mesh.names:
                    close = difflib.get_close_matches(axis, mesh.names, n=1)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ContextError(
                        f"{where}: HardwareProfile {name} names mesh axis {axis!r}, but the mesh "
                        f"has axes {mesh.names}{hint}. Name the mesh's axes, or leave the axis "
                        f"out to price it by position.")

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

    # -- persistence (a calibrated profile is kept as JSON) -------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The profile's fields as plain JSON values (axis maps as dicts)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = dict(value) if isinstance(value, tuple) else value
        return out

    def save(self, path: str | os.PathLike) -> None:
        """Writes the profile as JSON (``{"profile": {...}}``); :meth:`load` reads it back.

        >>> import tempfile, os
        >>> hw = HardwareProfile(preset="a100", axis_bandwidth={"dp": 25e9})
        >>> path = os.path.join(tempfile.mkdtemp(), "hw.json")
        >>> hw.save(path)
        >>> HardwareProfile.load(path) == hw
        True
        """
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"profile": self.to_dict()}, f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HardwareProfile:
        """The profile saved at ``path`` by :meth:`save` or :func:`jaxpar.calibrate`."""
        from jaxpar._src.errors import ContextError

        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ContextError(f"jaxpar.HardwareProfile.load: cannot read {str(path)!r} ({e}); "
                               f"pass a file written by HardwareProfile.save or "
                               f"jaxpar.calibrate(save=...).") from e
        fields = data.get("profile", data) if isinstance(data, dict) else None
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) - names:
            extra = sorted(set(fields) - names) if isinstance(fields, dict) else fields
            raise ContextError(f"jaxpar.HardwareProfile.load: {str(path)!r} has fields "
                               f"{extra} that a HardwareProfile does not have; it was written "
                               f"by another version of jaxpar: calibrate again.")
        return cls(**fields)

    def describe(self) -> str:
        return (f"{self.preset}: {self.flops_per_s / 1e12:.3g} TFLOP/s, "
                f"{self.memory_per_device / _GB:.3g} GB/device, "
                f"{self.intra_node_bandwidth / _GB:.3g} GB/s inside {self.devices_per_node}-device"
                f" nodes, {self.inter_node_bandwidth / _GB:.3g} GB/s across")


def resolve_hardware(value: HardwareProfile | str | None, mesh: Any) -> HardwareProfile:
    """The profile a ``hardware=`` argument names, on ``mesh`` (a ``jax.sharding.Mesh``).

    ``None``: the CPU preset.  A preset name (``"h100"``, ...): that preset.  ``"calibrated"``:
    the profile :func:`jaxpar.calibrate` measured for these devices and this mesh, kept in
    :func:`calibration_path` (``$JAXPAR_CACHE_DIR``, default ``~/.cache/jaxpar``); when that file
    is missing, jaxpar calibrates now (tens of seconds) and saves it there.  Loaded once per
    process.  Delete the file to measure again.
    """
    if value is None:
        return HardwareProfile()
    if isinstance(value, HardwareProfile):
        return value
    if value == "calibrated":
        path = calibration_path(mesh)
        found = _CALIBRATED.get(path)
        if found is None:
            if not os.path.exists(path):
                from jaxpar._src.calibrate import calibrate

                calibrate(mesh, save=path)
            found = _CALIBRATED[path] = HardwareProfile.load(path)
        return found
    if isinstance(value, str) and value in PRESETS:
        return HardwareProfile(preset=value)
    from jaxpar._src.errors import ContextError

    raise ContextError(f"jaxpar: hardware={value!r} is not a jaxpar.HardwareProfile, a preset "
                       f"name ({sorted(PRESETS)}) or 'calibrated'.")


_CALIBRATED: dict[str, HardwareProfile] = {}


def calibration_path(mesh: Any) -> str:
    """Where ``hardware="calibrated"`` keeps the profile of ``mesh``'s devices and axes.

    The file name holds the platform, device kind, device count and the mesh's axes and sizes:
    a profile is only reused for the same devices arranged the same way.

    >>> import os, jaxpar
    >>> path = jaxpar.calibration_path(jaxpar.make_mesh((2, 4), ("dp", "mp")))
    >>> os.path.basename(path)
    'cpu-cpu-8dev-dp2-mp4.json'
    """
    device = mesh.devices.flat[0]
    axes = "-".join(f"{a}{n}" for a, n in mesh.shape.items())
    kind = "".join(c if c.isalnum() else "_" for c in device.device_kind.lower())
    root = os.environ.get("JAXPAR_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxpar")
    return os.path.join(root, "hardware", f"{device.platform}-{kind}-{mesh.size}dev-{axes}.json")
