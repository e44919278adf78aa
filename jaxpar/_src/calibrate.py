"""``jaxpar.calibrate``: measure the devices at hand and fit the :class:`HardwareProfile`.

What is measured, with every device of the mesh busy at once (as in a training step):

* per mesh axis and per collective kind (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute), a few message sizes: ``jax.shard_map`` over the whole mesh, the
  collective over that one axis (a ``psum`` over ``"mp"`` of a ``(2, 4)`` mesh runs two groups
  of four at once);
* an all-reduce over all mesh axes at once (the combined gradient all-reduce of data
  parallelism), kept beside the per-axis fits: the profile prices such a collective with its
  slowest axis, and this says how far that is from the truth;
* the matmul FLOP rate of one device while all devices multiply, and the memory bandwidth of
  one device while all devices stream a buffer (``Calibration.memory_bandwidth``, for the
  roofline of :func:`jaxpar.inspect.yardstick`);
* the memory of one device (the allocator's limit on accelerators; RAM over the devices that
  share it on CPU);
* the fixed cost of one operator (``HardwareProfile.operator_latency``, what the pipeline's
  stage split charges each traced operator beside its FLOPs): the forward and backward of a
  small residual block (layer norm, two ``16 x 32`` matmuls, gelu) per loop trip, its FLOPs'
  time at the measured rate taken off, divided by its forward's operators (the nodes of
  jaxpar's graph, as the split counts them) times ``1 + BACKWARD_FACTOR`` (the split's own
  accounting of a backward).

Each time is the *slope* of a ``fori_loop`` that repeats the operation: the program is called
with ``lo`` and ``hi`` trips (one compile: the trip count is an argument), and
``(t_hi - t_lo) / (hi - lo)`` cancels dispatch and launch overhead.  Each of ``t_lo`` and
``t_hi`` is the minimum of several interleaved calls, robust to a machine loaded by others.
A loop of all-gathers feeds the next trip the first shard of the gathered buffer, and a loop of
reduce-scatters tiles its result back to the full size, so those two pay one local copy per
trip on top of the collective.  The compiled HLO of every program is checked to hold the
collective it means to measure.

The fit is the cost model's own form (:mod:`jaxpar._src.cost`): a collective of payload ``S``
bytes over ``n`` devices takes ``steps * alpha + wire / beta``, with ``steps = 2 (n - 1)`` and
``wire = 2 (n - 1) / n * S`` for an all-reduce, ``n - 1`` and ``(n - 1) / n * S`` for
all-gather, reduce-scatter and all-to-all, ``1`` and ``S`` for a collective-permute.  Per mesh
axis, ``alpha`` (seconds per step) and ``1 / beta`` (seconds per byte) are the non-negative
least-squares solution over every kind and size measured on that axis, each point weighted by
``1 / t`` so that small and large messages count alike (relative error).  The per-kind fits of
the same form are kept in the saved file (``"calibration"``), beside the raw measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar._src.errors import ContextError
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.pipeline.split import BACKWARD_FACTOR
from jaxpar._src.trace import trace
from jaxpar._src.yardstick import ring_terms

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DEFAULT_SIZES = (16 * 2**10, 256 * 2**10, 2 * 2**20)  # payload bytes per device


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured collective: ``seconds`` per run of ``kind`` with ``nbytes`` payload per
    device over ``axis`` (``group`` devices)."""

    axis: str
    kind: str
    group: int
    nbytes: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class Fit:
    """``alpha`` seconds per ring step and ``beta`` bytes/s, with the fit's relative error."""

    alpha: float
    beta: float
    rms_rel_error: float
    points: int


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What :func:`measure` found: the profile and how it was fitted."""

    profile: HardwareProfile
    measurements: tuple[Measurement, ...]
    axis_fits: tuple[tuple[str, Fit], ...]
    kind_fits: tuple[tuple[str, str, Fit], ...]  # (axis, kind, fit)
    flops_per_s: float
    memory_per_device: float
    memory_bandwidth: float  # bytes/s one device reads + writes while all devices stream
    operator_latency: float  # seconds one traced operator costs beyond its FLOPs
    seconds: float  # wall time of the calibration
    mesh: tuple[tuple[str, int], ...]
    device_kind: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.to_dict(),
            "calibration": {
                "mesh": dict(self.mesh), "device_kind": self.device_kind,
                "seconds": self.seconds, "jax": jax.__version__,
                "memory_bandwidth": self.memory_bandwidth,
                "operator_latency": self.operator_latency,
                "axis_fits": {a: dataclasses.asdict(f) for a, f in self.axis_fits},
                "kind_fits": [{"axis": a, "kind": k, **dataclasses.asdict(f)}
                              for a, k, f in self.kind_fits],
                "measurements": [dataclasses.asdict(m) for m in self.measurements],
            },
        }

    def save(self, path: str | os.PathLike) -> None:
        """Writes the profile (loadable by :meth:`HardwareProfile.load`) and the measurements."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    def table(self) -> str:
        """A readable summary: the fit per axis and per kind."""
        lines = [f"calibrated in {self.seconds:.1f} s on {self.device_kind}, mesh "
                 f"{dict(self.mesh)}: {self.flops_per_s / 1e9:.3g} GFLOP/s per device, "
                 f"{self.memory_per_device / 2**30:.3g} GiB and "
                 f"{self.memory_bandwidth / 1e9:.3g} GB/s of memory traffic per device, "
                 f"{self.operator_latency * 1e6:.3g} us per operator"]
        for axis, fit in self.axis_fits:
            lines.append(f"axis {axis}: alpha {fit.alpha * 1e6:.3g} us/step, beta "
                         f"{fit.beta / 1e9:.3g} GB/s (rms rel. error {fit.rms_rel_error:.0%}, "
                         f"{fit.points} points)")
        for axis, kind, fit in self.kind_fits:
            lines.append(f"  {axis} {kind:<19} alpha {fit.alpha * 1e6:8.3g} us/step  beta "
                         f"{fit.beta / 1e9:8.3g} GB/s  rms rel. error {fit.rms_rel_error:.0%}")
        return "\n".join(lines)


def calibrate(mesh: Mesh | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES,
              kinds: Sequence[str] = KINDS, rounds: int = 5, progress: bool = True,
              save: str | os.PathLike | None = None) -> HardwareProfile:
    """Measures collectives per mesh axis, the FLOP rate and memory; returns the fitted profile.

    See the module docstring for what is measured and how the fit is made (non-negative
    least squares of the cost model's alpha-beta form, per axis, relative error).

    Args:
      mesh: the mesh whose axes to measure; default: all devices on one axis ``"devices"``.
      sizes: payload bytes per device to measure each collective at.
      kinds: collective kinds to measure (a subset of :data:`KINDS`).
      rounds: interleaved calls per timing; the minimum is kept.
      progress: show a progress bar (tqdm when installed, else a plain line on stderr).
      save: a path to write the profile and the measurements to (JSON, see
        :meth:`HardwareProfile.load`).

    Returns:
      A :class:`HardwareProfile` with ``flops_per_s``, ``memory_per_device`` and, for every mesh
      axis, ``axis_latency`` and ``axis_bandwidth``.

    >>> import jaxpar
    >>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    >>> hw = jaxpar.calibrate(mesh, sizes=(2**14,), kinds=("all-reduce",), rounds=2,
    ...                       progress=False)
    >>> sorted(dict(hw.axis_bandwidth)), hw.flops_per_s > 0
    (['dp', 'mp'], True)
    """
    result = measure(mesh, sizes=sizes, kinds=kinds, rounds=rounds, progress=progress)
    if save is not None:
        result.save(save)
    return result.profile


def measure(mesh: Mesh | None = None, *, sizes: Sequence[int] = DEFAULT_SIZES,
            kinds: Sequence[str] = KINDS, rounds: int = 5, progress: bool = True
            ) -> Calibration:
    """:func:`calibrate`, returning the measurements and fits beside the profile."""
    t0 = time.perf_counter()
    if mesh is None:
        mesh = Mesh(np.array(jax.devices()), ("devices",))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ContextError(f"jaxpar.calibrate: kinds {unknown or list(kinds)} are not among "
                           f"{list(KINDS)}; pass a non-empty subset.")
    if not sizes or any(int(s) < 64 for s in sizes):
        raise ContextError(f"jaxpar.calibrate: sizes {list(sizes)} must be payload bytes per "
                           f"device, each at least 64.")
    axes = [(str(a), int(n)) for a, n in mesh.shape.items() if n > 1]
    jobs: list[tuple[tuple[str, ...], int, str, int]] = [
        ((a,), n, k, int(s)) for a, n in axes for k in kinds for s in sizes]
    if len(axes) > 1 and "all-reduce" in kinds:
        joint = tuple(a for a, _ in axes)
        jobs += [(joint, mesh.size, "all-reduce", int(s)) for s in sizes]
    bar = _Progress(len(jobs) + 3, progress)
    measurements = []
    for group, n, kind, size in jobs:
        label = "+".join(group)
        bar.update(f"{kind} over {label} ({n}), {size // 1024} KiB")
        seconds = _time_collective(mesh, group, kind, size, rounds)
        measurements.append(Measurement(label, kind, n, float(_payload(kind, size, n)),
                                        seconds))
    bar.update("matmul")
    flops = _flop_rate(mesh, rounds)
    bar.update("memory bandwidth")
    bandwidth = _memory_bandwidth(mesh, rounds)
    bar.update("operator latency")
    per_op = _operator_latency(mesh, rounds, flops)
    bar.close()
    memory = _memory_per_device(mesh)
    axis_fits = tuple((a, _fit([m for m in measurements if m.axis == a])) for a, _ in axes)
    labels = list(dict.fromkeys(m.axis for m in measurements))
    kind_fits = tuple((a, k, _fit(pts)) for a in labels for k in kinds
                      if (pts := [m for m in measurements if m.axis == a and m.kind == k]))
    profile = _profile(mesh, axis_fits, flops, memory, per_op)
    kind = mesh.devices.flat[0].device_kind
    return Calibration(profile, tuple(measurements), axis_fits, kind_fits, flops, memory,
                       bandwidth, per_op, time.perf_counter() - t0, tuple((str(a), int(n))
                                                      for a, n in mesh.shape.items()), kind)


# -- the fit ------------------------------------------------------------------------------------
def model_terms(kind: str, nbytes: float, n: int) -> tuple[float, float]:
    """``(steps, wire bytes)`` of one ring collective, as the cost model counts them."""
    return ring_terms(kind, nbytes, n)


def _fit(points: Sequence[Measurement]) -> Fit:
    """Non-negative weighted least squares of ``t = alpha * steps + wire / beta``."""
    if not points:
        return Fit(0.0, math.inf, 0.0, 0)
    a = np.array([model_terms(m.kind, m.nbytes, m.group) for m in points])
    t = np.array([max(m.seconds, 1e-7) for m in points])  # weights 1 / t stay bounded
    w = 1.0 / t
    aw, tw = a * w[:, None], t * w
    best: tuple[np.ndarray, float] | None = None
    # The two-variable NNLS: the unconstrained solution if both coefficients are >= 0, else the
    # better of the two one-variable fits (each clamped at 0).
    candidates = [np.linalg.lstsq(aw, tw, rcond=None)[0]]
    for j in range(2):
        col = aw[:, j]
        c = max(float(col @ tw) / float(col @ col), 0.0) if col @ col > 0 else 0.0
        one = np.zeros(2)
        one[j] = c
        candidates.append(one)
    for x in candidates:
        if (x < 0).any():
            continue
        err = float(np.sqrt(np.mean((aw @ x - tw) ** 2)))
        if best is None or err < best[1]:
            best = (x, err)
    assert best is not None, "the one-variable fits are clamped at 0, so one always counts"
    x, err = best
    inv_beta = float(x[1])
    return Fit(float(x[0]), 1.0 / inv_beta if inv_beta > 0 else math.inf, err, len(points))


def _profile(mesh: Mesh, axis_fits: Iterable[tuple[str, Fit]], flops: float, memory: float,
             operator_latency: float) -> HardwareProfile:
    fits = dict(axis_fits)
    finite = [f.beta for f in fits.values() if math.isfinite(f.beta)]
    fallback = min(finite) if finite else 1e12
    bandwidth = {a: (f.beta if math.isfinite(f.beta) else fallback) for a, f in fits.items()}
    latency = {a: f.alpha for a, f in fits.items()}
    # Axes of size 1 move nothing; give them the slowest link so that any mesh over the same
    # devices still prices.
    slow_bw = min(bandwidth.values(), default=fallback)
    slow_lat = max(latency.values(), default=0.0)
    fast_bw = max(bandwidth.values(), default=fallback)
    fast_lat = min(latency.values(), default=0.0)
    platform = mesh.devices.flat[0].platform
    kind = mesh.devices.flat[0].device_kind.lower()
    preset = "cpu"
    if platform != "cpu":
        preset = next((p for p in ("h200", "h100", "a100") if p in kind), "h100")
    return HardwareProfile(
        preset=preset, flops_per_s=flops, memory_per_device=memory,
        axis_bandwidth=bandwidth, axis_latency=latency,
        devices_per_node=max(jax.local_device_count(), 1),
        intra_node_bandwidth=fast_bw, inter_node_bandwidth=slow_bw,
        intra_node_latency=fast_lat, inter_node_latency=slow_lat,
        operator_latency=operator_latency)


# -- the measurements ---------------------------------------------------------------------------
def _payload(kind: str, size: int, n: int) -> int:
    """Payload bytes per device (the :class:`CollectiveRecord` convention) for ``size``."""
    del kind, n
    return size


def _elements(kind: str, size: int, n: int) -> int:
    """f32 elements per device of the loop carry (a multiple of ``n``) for payload ``size``.

    The payload of an all-gather is its gathered result, ``n`` times the carry."""
    m = max(size // 4 // (n if kind == "all-gather" else 1), n)
    return m - m % n


def _collective_body(kind: str, axis: str | tuple[str, ...], n: int
                     ) -> Callable[[jax.Array], jax.Array]:
    perm = [(i, (i + 1) % n) for i in range(n)]
    scale = 1.0 / n

    def body(x: jax.Array) -> jax.Array:
        m = x.shape[0]
        if kind == "all-reduce":
            return jax.lax.psum(x, axis) * scale
        if kind == "all-gather":
            # the first shard, not this device's own: XLA cannot fold gather-then-slice away
            return jax.lax.all_gather(x, axis, tiled=True)[:m] * 0.5
        if kind == "reduce-scatter":
            y = jax.lax.psum_scatter(x, axis, tiled=True) * scale
            return jnp.tile(y, n)
        if kind == "all-to-all":
            return jax.lax.all_to_all(x.reshape(n, m // n), axis, 0, 0, tiled=True
                                      ).reshape(m) * 0.5
        return jax.lax.ppermute(x, axis, perm) * 0.5

    return body


def _time_collective(mesh: Mesh, group: tuple[str, ...], kind: str, size: int, rounds: int
                     ) -> float:
    n = math.prod(int(mesh.shape[a]) for a in group)
    m = _elements(kind, size, n)
    names = tuple(mesh.axis_names)
    axis = group[0] if len(group) == 1 else group
    body = _collective_body(kind, axis, n)

    def local(x: jax.Array, trips: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, trips[0], lambda _, v: body(v), x)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(names), P()), out_specs=P(names),
                                 check_vma=False))
    x = jax.device_put(jnp.ones((m * mesh.size,), jnp.float32), NamedSharding(mesh, P(names)))
    _check_compiled(fn, x, kind, axis)
    return _slope(fn, x, rounds, target=0.02)


def _check_compiled(fn: Any, x: jax.Array, kind: str, axis: str | tuple[str, ...]) -> None:
    from jaxpar._src.hlo import parse_collectives

    text = fn.lower(x, jnp.ones((1,), jnp.int32)).compile().as_text()
    found = {r.kind for r in parse_collectives(text)}
    if kind not in found:
        raise RuntimeError(f"jaxpar.calibrate: the program meant to time {kind} over {axis!r} "
                           f"compiled to {sorted(found) or 'no collectives'}; XLA rewrote it.")


def _slope(fn: Any, x: jax.Array, rounds: int, target: float) -> float:
    """Seconds per loop trip: the difference of the fastest calls at two trip counts."""

    def call(k: int) -> float:
        trips = jnp.full((1,), k, jnp.int32)
        t = time.perf_counter()
        jax.block_until_ready(fn(x, trips))
        return time.perf_counter() - t

    call(1)
    call(1)  # warm: the first calls allocate
    one = max(min(call(2) for _ in range(2)) - min(call(1) for _ in range(2)), 1e-6)
    hi = int(min(max(target / one, 4), 256)) + 1
    for _ in range(4):
        lo_t, hi_t = math.inf, math.inf
        for _ in range(max(rounds, 1)):
            lo_t = min(lo_t, call(1))
            hi_t = min(hi_t, call(hi))
        if hi_t > lo_t:
            return (hi_t - lo_t) / (hi - 1)
        hi = 4 * hi - 3  # noise swamped the difference (a loaded machine): a longer loop
    return 1e-7  # below what this clock resolves


def _flop_rate(mesh: Mesh, rounds: int, dim: int = 256) -> float:
    """FLOP/s of one device multiplying ``dim x dim`` matrices while every device does."""
    names = tuple(mesh.axis_names)

    def local(a: jax.Array, trips: jax.Array) -> jax.Array:
        def step(_: Any, v: jax.Array) -> jax.Array:
            return jnp.tanh(v @ a[0])

        return jax.lax.fori_loop(0, trips[0], step, a)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(names), P()), out_specs=P(names),
                                 check_vma=False))
    a = jax.device_put(jax.random.normal(jax.random.key(0), (mesh.size, dim, dim)) / dim ** 0.5,
                       NamedSharding(mesh, P(names)))
    seconds = _slope(fn, a, rounds, target=0.05)
    return 2.0 * dim ** 3 / max(seconds, 1e-12)


def _memory_bandwidth(mesh: Mesh, rounds: int, nbytes: int = 8 * 2**20) -> float:
    """Bytes/s one device reads and writes while every device streams ``nbytes`` buffers."""
    names = tuple(mesh.axis_names)

    def local(x: jax.Array, trips: jax.Array) -> jax.Array:
        return jax.lax.fori_loop(0, trips[0], lambda _, v: v * 0.999 + 1e-3, x)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(names), P()), out_specs=P(names),
                               check_vma=False))
    x = jax.device_put(jnp.ones((mesh.size * nbytes // 4,), jnp.float32),
                       NamedSharding(mesh, P(names)))
    seconds = _slope(fn, x, rounds, target=0.05)
    return 2.0 * nbytes / max(seconds, 1e-12)  # one read and one write per trip


def _block(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
    """A small residual block, as a pipeline's layers are: layer norm, matmul, gelu, matmul."""
    mu = jnp.mean(x, -1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(jnp.var(x, -1, keepdims=True) + 1e-5)
    return x + jax.nn.gelu(h @ w1) @ w2


def _operator_latency(mesh: Mesh, rounds: int, flops_per_s: float, rows: int = 8,
                      d: int = 16, ff: int = 32) -> float:
    """Seconds per traced operator beyond its FLOPs, as the stage split prices a layer: one
    trip of the loop is the forward and backward of :func:`_block` on ``rows x d``."""
    names = tuple(mesh.axis_names)
    x0 = jnp.ones((rows, d), jnp.float32) * 0.1
    w1 = jnp.full((d, ff), 0.05, jnp.float32)
    w2 = jnp.full((ff, d), 0.05, jnp.float32)

    def local(x: jax.Array, trips: jax.Array) -> jax.Array:
        def step(_: Any, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            v, a1, a2 = carry
            y, pull = jax.vjp(_block, v[0], a1, a2)
            gx, g1, g2 = pull(y)
            # every cotangent feeds the next trip: none of the backward is dead code
            return (v - 1e-3 * gx[None], a1 - 1e-3 * g1, a2 - 1e-3 * g2)

        return jax.lax.fori_loop(0, trips[0], step, (x, w1, w2))[0]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(names), P()), out_specs=P(names),
                               check_vma=False))
    x = jax.device_put(jnp.broadcast_to(x0, (mesh.size, rows, d)), NamedSharding(mesh, P(names)))
    seconds = _slope(fn, x, rounds, target=0.02)
    forward_flops = 2.0 * rows * d * ff * 2  # the two matmuls
    # the operators as the split counts them: the nodes of jaxpar's graph of the block
    ops = trace(_block, [x0, w1, w2]).graph.count("op")
    fixed = seconds / (1.0 + BACKWARD_FACTOR) - forward_flops / max(flops_per_s, 1.0)
    return max(fixed, 0.0) / ops


def _memory_per_device(mesh: Mesh) -> float:
    device = mesh.devices.flat[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - CPU devices have no allocator statistics
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        fallback = HardwareProfile().memory_per_device
        assert fallback is not None, "HardwareProfile fills fields from its preset"
        return float(fallback)
    local = [d for d in jax.local_devices() if d.platform == device.platform]
    return float(ram) / max(len(local), 1)


class _Progress:
    """tqdm when it is installed and wanted, else one plain line per step on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.enabled, self.total, self.done = enabled, total, 0
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc="jaxpar.calibrate", file=sys.stderr,
                                leave=False)

    def update(self, what: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(1)
        else:
            self.done += 1
            print(f"jaxpar.calibrate [{self.done}/{self.total}] {what}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
