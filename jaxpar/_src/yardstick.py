"""An independent yardstick: the step time of a *compiled* program under a ``HardwareProfile``.

jaxpar's own cost model prices the program it planned; this prices the program XLA made of it,
after the SPMD partitioner and every XLA pass (collective combiners, fusions, CSE).  Nothing of
jaxpar's plan is read:

* communication: each collective parsed from the partitioned HLO
  (:func:`jaxpar.inspect.collectives`: kind, payload, replica groups, loop trip counts) priced
  alpha-beta over the mesh axes its groups span: ``steps * alpha + wire / beta`` per run, with
  the slowest link and largest latency of those axes (ring steps and wire bytes as
  :func:`ring_terms` counts them, the cost model's convention);
* compute: the per-device FLOPs XLA's ``cost_analysis()`` counts, at the profile's FLOP rate
  (XLA counts a loop body once, so a ``scan`` is under-counted here); given a
  ``memory_bandwidth``, the roofline ``max(flops / rate, bytes accessed / bandwidth)`` instead
  (XLA's count of bytes accessed; on CPU most of a small model's time is memory traffic);
* memory: ``memory_analysis()`` (arguments + outputs - aliased + temporaries), beside the
  profile's memory per device.

The step time is compute plus communication, nothing overlapped: an upper bound of what the
devices would do, and the same for every plan, so plans rank by it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.hlo import CollectiveRecord
from jaxpar._src.spec import MeshShape


@dataclasses.dataclass(frozen=True)
class Yardstick:
    """What a compiled program costs under a profile (seconds and bytes are per device).

    >>> y = Yardstick(2e-6, 1e-6, 1e-6, 1e6, 4e6, 1e6, 8e10,
    ...               {"all-reduce": {"count": 1, "bytes": 64, "wire_bytes": 96, "time": 1e-6}})
    >>> y.collective_count, y.fits_memory
    (1, True)
    """

    step_time_s: float  # compute_s + communication_s
    compute_s: float
    communication_s: float
    flops: float  # per device, XLA's count
    bytes_accessed: float  # per device, XLA's count of memory traffic (not priced)
    memory_bytes: float  # arguments + outputs - aliased + temporaries
    memory_budget: float  # the profile's memory_per_device
    collectives: dict[str, dict[str, float]]  # kind -> count, bytes, wire_bytes, time

    @property
    def fits_memory(self) -> bool:
        return self.memory_bytes <= self.memory_budget

    @property
    def collective_count(self) -> int:
        return int(sum(v["count"] for v in self.collectives.values()))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["collective_count"] = self.collective_count
        return out

    def __str__(self) -> str:
        parts = [f"{k} x{v['count']:g} {v['time'] * 1e6:.3g} us"
                 for k, v in sorted(self.collectives.items())]
        return (f"yardstick: {self.step_time_s * 1e6:.4g} us = compute "
                f"{self.compute_s * 1e6:.4g} us + communication {self.communication_s * 1e6:.4g}"
                f" us ({', '.join(parts) or 'no collectives'}); memory "
                f"{self.memory_bytes / 2**20:.3g} MiB per device")


def ring_terms(kind: str, nbytes: float, n: int) -> tuple[float, float]:
    """``(steps, wire bytes per device)`` of one ring collective of payload ``nbytes``."""
    if n <= 1:
        return 0.0, 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes
    if kind in ("collective-permute", "collective-broadcast"):
        return 1.0, float(nbytes)
    return float(n - 1), (n - 1) / n * nbytes


def collective_time(record: CollectiveRecord, hardware: HardwareProfile, mesh: Any) -> float:
    """Seconds one device spends in ``record`` per program call (all its runs)."""
    axes = record.axes if record.axes else _spanned_axes(record, mesh)
    shape = MeshShape.of(mesh)
    if not axes:
        return 0.0
    steps, wire = ring_terms(record.kind, record.nbytes, record.group_size)
    bandwidth = min(hardware.bandwidth(a, shape) for a in axes)
    latency = max(hardware.latency(a, shape) for a in axes)
    return record.count * (steps * latency + wire / bandwidth)


def _spanned_axes(record: CollectiveRecord, mesh: Any) -> tuple[str, ...]:
    """The mesh axes along which the devices of ``record``'s groups differ.

    Used where the groups are not whole mesh axes (a collective-permute's pairs, a subset).
    """
    shape = tuple(int(s) for s in mesh.devices.shape)
    names = tuple(mesh.axis_names)
    spanned: set[int] = set()
    for group in record.replica_groups:
        ids = [i for i in group if 0 <= i < math.prod(shape)]
        if len(ids) < 2:
            continue
        coords = np.array(np.unravel_index(ids, shape)).T
        spanned.update(int(d) for d in np.nonzero((coords != coords[0]).any(axis=0))[0])
    return tuple(names[d] for d in sorted(spanned))


def yardstick(obj: Any, hardware: HardwareProfile, mesh: Any = None, *,
              memory_bandwidth: float | None = None) -> Yardstick:
    """Prices a compiled program with ``hardware``: compute + collectives, and its memory.

    Args:
      obj: a ``jax.stages.Lowered`` (compiled here) or ``jax.stages.Compiled``.
      hardware: the :class:`jaxpar.HardwareProfile` to price with (e.g. a calibrated one).
      mesh: the program's mesh; taken from its input shardings when omitted.
      memory_bandwidth: bytes/s of one device's memory traffic (what :func:`jaxpar.calibrate`
        measures as ``memory_bandwidth``); when given, compute is the roofline
        ``max(flops / flops_per_s, bytes accessed / memory_bandwidth)``.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> import jaxpar
    >>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    >>> f = jaxpar.parallelize(lambda x, w: x @ w, mesh=mesh, parallel_mode="semi_auto_parallel",
    ...                        in_strategy=(P("dp", "mp"), P("mp", None)))
    >>> y = jaxpar.inspect.yardstick(f.lower(jnp.ones((8, 16)), jnp.ones((16, 4))),
    ...                              jaxpar.HardwareProfile(preset="h100"))
    >>> y.collectives["all-reduce"]["count"], y.flops > 0, y.step_time_s > y.compute_s
    (1.0, True, True)
    """
    from jaxpar._src.inspection import _compiled, _mesh_of, collectives, memory

    compiled = _compiled(obj)
    if mesh is None:
        mesh = _mesh_of(compiled)
    if mesh is None:
        raise ValueError("jaxpar.inspect.yardstick: pass mesh=; the program's inputs carry no "
                         "NamedSharding to take it from.")
    table: dict[str, dict[str, float]] = {}
    for rec in collectives(compiled, mesh):
        row = table.setdefault(rec.kind, {"count": 0.0, "bytes": 0.0, "wire_bytes": 0.0,
                                          "time": 0.0})
        row["count"] += rec.count
        row["bytes"] += rec.nbytes * rec.count
        row["wire_bytes"] += rec.wire_bytes * rec.count
        row["time"] += collective_time(rec, hardware, mesh)
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    cost = cost or {}
    flops = float(cost.get("flops", 0.0))
    accessed = float(cost.get("bytes accessed", 0.0))
    # __post_init__ fills every field a profile leaves out from its preset.
    rate, budget = hardware.flops_per_s, hardware.memory_per_device
    assert rate is not None and budget is not None, "HardwareProfile fills fields from its preset"
    compute = flops / rate
    if memory_bandwidth:
        compute = max(compute, accessed / memory_bandwidth)
    comm = sum(r["time"] for r in table.values())
    return Yardstick(compute + comm, compute, comm, flops, accessed,
                     float(memory(compiled)["total"]), float(budget), table)
