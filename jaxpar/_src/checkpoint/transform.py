"""``jaxpar.transform_checkpoints``: a checkpoint rewritten for another layout, offline.

orbax checkpoints hold global arrays, so any layout can read any checkpoint; what a transform
changes is what the destination program needs: the arrays' names and shapes when it unrolls a
scan's stacked layers (or stacks unrolled ones), the chunks they are stored in (at most one
destination shard each, so every destination device reads about its own bytes), and the
strategy kept beside them.  It runs in one process on the host: no device of the destination
layout is needed, so 8 devices can be turned into 1 on a laptop, or 1 into 8.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from jaxpar._src.checkpoint import digest, store
from jaxpar._src.checkpoint.layouts import ArrayLayout, ParameterLayouts, num_bytes
from jaxpar._src.checkpoint.load import check_strategy, check_sums
from jaxpar._src.checkpoint.paths import MAX_LISTED, components, join, match, nest
from jaxpar._src.checkpoint.strategy import Lookup, resolve
from jaxpar._src.errors import CheckpointError

API = "jaxpar.transform_checkpoints"
MIN_CHUNK = 1 << 20  # orbax: smaller chunks cost more than they save


def transform_checkpoints(src_checkpoints_dir: str | os.PathLike,
                          dst_checkpoints_dir: str | os.PathLike, src_strategy: Any = None,
                          dst_strategy: Any = None, *, step: int | None = None,
                          overwrite: bool = False, chunk_bytes: int | None = None,
                          verify: bool = True) -> ParameterLayouts:
    """Rewrites a checkpoint for another layout, offline (MindSpore's ``transform_checkpoints``).

    Any device count to any other, optimizer state included: every array of the source keeps
    its name and takes the layout the destination strategy gives it, found by name as
    :func:`jaxpar.load_distributed_checkpoint` finds it (``"opt_state.0.mu.w"`` takes the layout
    of ``"w"``).  When the destination names layers one by one (``"blocks.0.w"``, ...) and the
    source stacked them for a scan (``"blocks.w"``), the stack is unrolled, and the reverse;
    the optimizer's moments follow.  Arrays are read into host memory (the whole checkpoint,
    once) and written in chunks of at most one destination shard, with the destination
    strategy and checksums beside them.

    Args:
      src_checkpoints_dir: the checkpoint to read (or a ``ModelCheckpoint`` directory: its
        newest step, or ``step``).
      dst_checkpoints_dir: where to write the new checkpoint.
      src_strategy: the strategy the source was saved with, only checked against it (the
        checkpoint keeps its own).
      dst_strategy: the destination layouts: a :class:`ParameterLayouts`, a ``ShardingPlan``, a
        strategy or plan file, or a checkpoint directory.  Its mesh need not exist here.
      step: the step of a ``ModelCheckpoint`` directory.
      overwrite: replace an existing destination.
      chunk_bytes: the chunk size to store (default: one destination shard, at least 1 MiB).
      verify: check what was read against the source's checksums.

    Returns:
      The :class:`ParameterLayouts` written beside the new checkpoint.

    Raises:
      CheckpointError: a strategy belongs to another program, the destination strategy has no
        layout for some array (all listed), or a source shard is missing or damaged.

    Layers stacked for a scan on 8 devices, unrolled for 16 (more than this process has):

    >>> import tempfile, numpy as np, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar._src.spec import MeshShape
    >>> src, dst = tempfile.mkdtemp() + "/scan", tempfile.mkdtemp() + "/unrolled"
    >>> _ = jaxpar.save_checkpoint({"blocks": {"w": np.ones((3, 16, 16), np.float32)}}, src)
    >>> sixteen = jaxpar.ParameterLayouts(MeshShape(("dp", "mp"), (4, 4)), {
    ...     f"blocks.{i}.w": jaxpar.ArrayLayout(P("dp", "mp"), (16, 16)) for i in range(3)})
    >>> written = jaxpar.transform_checkpoints(src, dst, dst_strategy=sixteen)
    >>> list(written), written.shard_shape("blocks.2.w")
    (['blocks.0.w', 'blocks.1.w', 'blocks.2.w'], (4, 4))
    """
    saved = store.read(store.locate(src_checkpoints_dir, step, where=API), where=API)
    if src_strategy is not None:
        given = resolve(src_strategy, where=API)
        assert given is not None, "resolve keeps only None as None"
        check_strategy(given, saved, what="src_strategy", where=API)
    dst = resolve(dst_strategy, where=API)
    if dst is None:
        raise CheckpointError(f"{API}: dst_strategy is required: the layouts to write for "
                              f"(jaxpar.infer_predict_layout, a plan, or a strategy file).")
    layouts = destination(saved, dst)
    sources = match({p: a.shape for p, a in layouts.items()}, saved.shapes, where=API,
                    subtree="")
    needed = sorted({p for s in sources.values() for p in s.paths})
    host = store.restore(saved, dict.fromkeys(needed, np.ndarray), where=API)
    if verify:
        check_sums(saved, host, where=API)
    arrays = {}
    for path, src in sources.items():
        if src.kind == "direct":
            arrays[path] = host[src.paths[0]]
        elif src.kind == "slice":
            arrays[path] = np.ascontiguousarray(host[src.paths[0]][src.index])
        else:
            arrays[path] = np.stack([host[p] for p in src.paths])
    sums = digest.tree_sums(list(arrays.values()))
    written = ParameterLayouts(dst.mesh, {
        p: ArrayLayout(layouts[p].spec, layouts[p].shape, layouts[p].dtype, s)
        for p, s in zip(arrays, sums, strict=True)}, dst.device_ids,
        f"transform_checkpoints ({dst.origin})" if dst.origin else "transform_checkpoints")
    chunks: int | dict[str, int | None]
    if chunk_bytes is not None:
        chunks = chunk_bytes
    else:
        chunks = {}
        for p, a in written.arrays.items():
            assert a.shape is not None and a.dtype is not None, \
                "destination() gives every array the checkpoint's shape and dtype"
            chunks[p] = _chunk_bytes(a.shape, a.dtype, written.shard_shape(p))
    absl = logging.getLogger("absl")  # chunks under 1 MiB are chosen on purpose: no warning
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        store.write(dst_checkpoints_dir, nest(arrays), written, overwrite=overwrite,
                    chunk_bytes=chunks, where=API)
    finally:
        absl.setLevel(level)
    return written


def _chunk_bytes(shape: tuple[int, ...], dtype: str, shard: tuple[int, ...]) -> int | None:
    """A chunk size for which orbax cuts the array into chunks that tile one destination
    shard, so that each destination device reads its own bytes; ``None`` (one chunk) for
    arrays under ``MIN_CHUNK``.  orbax picks the chunk shape from a byte size (halving the
    largest dimension first); its own function predicts the shape, from the shard's size down
    to a quarter of ``MIN_CHUNK``."""
    whole = num_bytes(shape, dtype)
    if whole <= MIN_CHUNK:
        return None
    target = max(MIN_CHUNK, num_bytes(shard, dtype))
    try:
        from orbax.checkpoint._src.arrays.subchunking import choose_chunk_shape
    except ImportError:  # another orbax: chunks of about one shard
        return target
    size = target
    while size >= MIN_CHUNK // 4:  # a little under orbax's advice beats reading twice
        try:
            chunk = choose_chunk_shape(shape, shape, np.dtype(dtype), size)
        except Exception:  # noqa: BLE001 - its signature changed: chunks of about one shard
            return target
        if all(s % c == 0 for s, c in zip(shard, chunk, strict=True)):
            return size
        size //= 2
    return target


def destination(saved: store.Saved, dst: ParameterLayouts) -> dict[str, ArrayLayout]:
    """Every array the destination holds, with its layout: the source's arrays by name,
    unrolled or stacked where the destination names layers differently."""
    lookup = Lookup(dst)
    out: dict[str, ArrayLayout] = {}
    unmatched = []
    for path, (shape, dtype) in saved.arrays.items():
        best = _best(path, shape, saved, lookup)
        if best is None:
            if shape:
                unmatched.append(f"  {path}: {list(shape)} {dtype}")
            else:  # counters and other scalars: whole everywhere
                out[path] = ArrayLayout(PartitionSpec(), shape, dtype)
            continue
        for p, (s, spec) in best.items():
            out[p] = ArrayLayout(spec, s, dtype)
    if unmatched:
        raise CheckpointError(
            f"{API}: dst_strategy ({dst!r}) has no layout for {len(unmatched)} arrays of the "
            f"checkpoint:\n" + "\n".join(unmatched[:MAX_LISTED])
            + (f"\n  ... and {len(unmatched) - MAX_LISTED} more" if len(unmatched) > MAX_LISTED
               else "") + "\nGive the strategy of the program that will read them (a train "
            "step's plan covers the optimizer state too).")
    used = set(out)
    if not dst.origin.startswith("plan"):  # a plan also names its data arguments
        _check_covered(dst, used, saved)
    return out


def _best(path: str, shape: tuple[int, ...], saved: store.Saved,
          lookup: Lookup) -> dict[str, tuple[tuple[int, ...], PartitionSpec]] | None:
    """The destination array(s) ``path`` becomes: itself, its layers, or a stack it is one
    layer of; the candidate whose name matches the strategy furthest wins."""
    where = API
    parts = components(path)
    options: list[tuple[int, dict]] = []
    direct = lookup.scored(path, shape, where=where)
    if direct is not None:
        options.append((direct[1], {path: (shape, direct[0].spec)}))
    if shape:
        for k in range(len(parts), 0, -1):  # unroll: layers named path[:k].i.path[k:]
            names = [join(*(parts[:k] + [str(i)] + parts[k:])) for i in range(shape[0])]
            if any(n in saved.arrays for n in names):
                continue
            found = [lookup.scored(n, shape[1:], where=where) for n in names]
            hits = [f for f in found if f is not None]
            if len(hits) == len(found):
                options.append((min(f[1] for f in hits),
                                {n: (shape[1:], f[0].spec) for n, f in zip(names, hits,
                                                                           strict=True)}))
    for k, c in enumerate(parts):  # stack: path is layer c of path-without-c
        if not c.isdigit():
            continue
        layers = 0
        while join(*(parts[:k] + [str(layers)] + parts[k + 1:])) in saved.arrays:
            layers += 1
        if int(c) >= layers:
            continue
        base = join(*(parts[:k] + parts[k + 1:]))
        if base in saved.arrays:
            continue
        stacked = (layers, *shape)
        hit = lookup.scored(base, stacked, where=where)
        if hit is not None:
            options.append((hit[1], {base: (stacked, hit[0].spec)}))
    if not options:
        return None
    return max(options, key=lambda o: o[0])[1]


def _check_covered(dst: ParameterLayouts, used: set[str], saved: store.Saved) -> None:
    lookup = Lookup(ParameterLayouts(dst.mesh, {p: ArrayLayout(PartitionSpec()) for p in used}))
    lacking = [p for p, a in dst.arrays.items() if lookup(p, None, where=API) is None]
    if lacking:
        raise CheckpointError(
            f"{API}: the checkpoint {saved.directory} has no array for {len(lacking)} of "
            f"dst_strategy's ({', '.join(lacking[:MAX_LISTED])}): the strategy belongs to "
            f"another program.")

