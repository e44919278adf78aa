"""``jaxpar.load_distributed_checkpoint``: a checkpoint of any layout onto the serving layout.

orbax restores every array onto the sharding it is given, and tensorstore reads, in each
process, only the chunks that overlap the shards of that process's devices.  jaxpar decides
the shardings (from the serving strategy), finds the network's arrays in the checkpoint (by
path, under a prefix, or as layers of a stacked array) and checks what it read against the
checksums saved with it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jaxpar._src.checkpoint import digest, store
from jaxpar._src.checkpoint.layouts import ParameterLayouts
from jaxpar._src.checkpoint.paths import MAX_LISTED, Source, flatten, match
from jaxpar._src.checkpoint.strategy import Lookup, resolve
from jaxpar._src.errors import CheckpointError

API = "jaxpar.load_distributed_checkpoint"


def load_distributed_checkpoint(network_or_params: Any, checkpoint_dir: str | os.PathLike,
                                predict_strategy: Any = None,
                                train_strategy_filename: str | os.PathLike | None = None, *,
                                step: int | None = None, subtree: str | None = None,
                                verify: bool = True) -> Any:
    """Loads a checkpoint saved on any layout onto the serving layout (MindSpore's
    ``load_distributed_checkpoint``).

    Each process reads only the chunks of the checkpoint that overlap the shards of its own
    devices, straight into them (orbax restores onto the target shardings); nothing is
    gathered.  The checkpoint may hold more than the network (a train state with the optimizer
    state): the network's arrays are found by their paths, also under a prefix
    (``"params.w"`` for the network's ``"w"``) and as layers of an array stacked for a scan
    (``"blocks.3.w"`` is row 3 of ``"blocks.w"``) or the reverse.

    Args:
      network_or_params: a Flax NNX module (its ``nnx.Param`` arrays are loaded into it), a
        ``(params, apply_fn)`` pair, or a pytree of arrays or ``jax.ShapeDtypeStruct`` giving
        the shapes, dtypes and, when ``predict_strategy`` is ``None``, the shardings.
      checkpoint_dir: a checkpoint (``jaxpar.save_checkpoint``), or a ``ModelCheckpoint``
        directory (its newest step, or ``step``).
      predict_strategy: the serving layouts: what :func:`jaxpar.infer_predict_layout` returns,
        a ``ShardingPlan``, a strategy or plan file, or ``{path: PartitionSpec |
        NamedSharding}``.  ``None``: the leaves' own shardings, else one device.
      train_strategy_filename: the strategy the checkpoint was saved with (a file, plan or
        directory), checked against the checkpoint's names and shapes.  orbax reads any layout,
        so it is only a check.
      step: the step of a ``ModelCheckpoint`` directory.
      subtree: the prefix to read the network under, when the checkpoint holds several
        candidates (``"params"`` or ``"ema_params"``).
      verify: compare what was read against the checksums saved with it.

    Returns:
      The loaded tree, shaped like the network's parameters, each array on its serving layout.

    Raises:
      CheckpointError: the checkpoint does not match the network (every missing array and every
        other shape listed), a shard is missing or damaged, or a strategy belongs to another
        program.

    >>> import tempfile, jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> train = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    >>> w = jax.device_put(jnp.arange(128.0).reshape(8, 16), NamedSharding(train, P("dp", "mp")))
    >>> path = tempfile.mkdtemp() + "/step_1"
    >>> _ = jaxpar.save_checkpoint({"params": {"w": w}}, path)
    >>> serve = jaxpar.make_mesh((4,), ("mp",))
    >>> params = jaxpar.load_distributed_checkpoint(
    ...     {"w": jax.ShapeDtypeStruct((8, 16), jnp.float32)}, path,
    ...     predict_strategy={"w": NamedSharding(serve, P(None, "mp"))})
    >>> params["w"].sharding.spec == P(None, "mp"), np.array_equal(params["w"], w)
    (True, True)
    """
    target, write_back = _target(network_or_params)
    paths, leaves, treedef = flatten(target)
    shapes = {p: tuple(int(d) for d in np.shape(x)) for p, x in zip(paths, leaves, strict=True)}
    saved = store.read(store.locate(checkpoint_dir, step, where=API), where=API)
    if train_strategy_filename is not None:
        train = resolve(train_strategy_filename, where=API)
        assert train is not None, "resolve keeps only None as None"
        check_strategy(train, saved, what="train_strategy_filename", where=API)
    sources = match(shapes, saved.shapes, where=API, subtree=subtree)
    shardings = _shardings(paths, leaves, shapes, resolve(predict_strategy, where=API))
    arrays = read_onto(saved, sources, shardings, shapes, verify=verify, where=API)
    out = []
    for p, x in zip(paths, leaves, strict=True):
        a = arrays[p]
        dtype = getattr(x, "dtype", None)
        dtype = None if dtype is None else jax.dtypes.canonicalize_dtype(dtype)
        out.append(a if dtype is None or a.dtype == dtype else a.astype(dtype))
    result = jax.tree_util.tree_unflatten(treedef, out)
    write_back(result)
    return result


def _target(network_or_params: Any) -> tuple[Any, Any]:
    """The tree to load and how to put it back into the network."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(network_or_params, nnx.Module):
        module = network_or_params
        return nnx.state(module, nnx.Param), lambda state: nnx.update(module, state)
    from jaxpar._src.train.model import Model

    if isinstance(network_or_params, Model):
        raise CheckpointError(f"{API}: pass the Model's network (model.network), not the Model.")
    if (isinstance(network_or_params, tuple) and len(network_or_params) == 2
            and callable(network_or_params[1])):
        return network_or_params[0], lambda _: None
    return network_or_params, lambda _: None


def _shardings(paths: list[str], leaves: list[Any], shapes: Mapping[str, tuple[int, ...]],
               predict: ParameterLayouts | None) -> dict[str, Any]:
    if predict is None:
        local = SingleDeviceSharding(jax.local_devices()[0])
        return {p: getattr(x, "sharding", None) or local
                for p, x in zip(paths, leaves, strict=True)}
    mesh = predict.device_mesh()
    lookup = Lookup(predict)
    out, found, wrong = {}, 0, []
    for p in paths:
        layout = lookup(p, shapes[p], where=API)
        if layout is None and p in predict.arrays:
            wrong.append(f"  {p}: network {list(shapes[p])}, strategy "
                         f"{list(predict.arrays[p].shape or ())}")
        found += layout is not None
        out[p] = NamedSharding(mesh, layout.spec if layout is not None else PartitionSpec())
    if wrong or (paths and not found):
        detail = "\n".join(wrong[:MAX_LISTED]) if wrong else (
            f"  the network has {', '.join(paths[:4])}{', ...' if len(paths) > 4 else ''}; the "
            f"strategy names {', '.join(list(predict)[:4])}{', ...' if len(predict) > 4 else ''}")
        raise CheckpointError(
            f"{API}: predict_strategy ({predict!r}) belongs to another program:\n{detail}\n"
            f"Make it with jaxpar.infer_predict_layout on this network.")
    return out


def check_strategy(strategy: ParameterLayouts, saved: store.Saved, *, what: str,
                   where: str) -> None:
    """Refuses a strategy whose arrays' names or shapes are not the checkpoint's."""
    lookup = Lookup(strategy)
    missing, wrong = [], []
    for path, (shape, _) in saved.arrays.items():
        layout = lookup(path, None, where=where)
        if layout is None:
            missing.append(path)
        elif layout.shape is not None and tuple(layout.shape) != shape:
            wrong.append(f"  {path}: checkpoint {list(shape)}, strategy {list(layout.shape)}")
    matched = len(saved.arrays) - len(missing)
    if wrong or not matched:
        detail = "\n".join(wrong[:MAX_LISTED]) if wrong else (
            f"  none of the checkpoint's {len(saved.arrays)} arrays "
            f"({', '.join(list(saved.arrays)[:3])}, ...) is in it")
        raise CheckpointError(
            f"{where}: {what} ({strategy!r}) belongs to another program than the checkpoint "
            f"{saved.directory}:\n{detail}\nGive the strategy the checkpoint was saved with "
            f"(or leave it out: the checkpoint keeps its own).")


def read_onto(saved: store.Saved, sources: Mapping[str, Source], shardings: Mapping[str, Any],
              shapes: Mapping[str, tuple[int, ...]], *, verify: bool,
              where: str) -> dict[str, jax.Array]:
    """Reads every source onto its target's sharding and assembles the targets."""
    wants: dict[str, jax.ShapeDtypeStruct] = {}
    for path, src in sources.items():
        sharding = shardings[path]
        if src.kind == "slice":
            sharding = _with_leading(sharding, None)
        elif src.kind == "stack":
            sharding = _without_leading(sharding, len(shapes[path]))
        for p in src.paths:
            if p not in wants:
                shape, dtype = saved.arrays[p]
                wants[p] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    restored = store.restore(saved, wants, where=where)
    if verify:
        check_sums(saved, restored, where=where)
    out = {}
    for path, src in sources.items():
        if src.kind == "direct":
            out[path] = restored[src.paths[0]]
        elif src.kind == "slice":
            out[path] = jax.device_put(restored[src.paths[0]][src.index], shardings[path])
        else:
            out[path] = jax.device_put(jnp.stack([restored[p] for p in src.paths]),
                                       shardings[path])
    return out


def check_sums(saved: store.Saved, restored: Mapping[str, Any], *, where: str) -> None:
    if saved.strategy is None:
        return
    # an array read in another dtype (64-bit host values without jax_enable_x64) has other
    # bits: only those read as they were saved can be checked
    expected: dict[str, tuple[int, int]] = {}
    for p, x in restored.items():
        layout = saved.strategy.arrays.get(p)
        if (layout is not None and layout.checksum is not None
                and np.dtype(x.dtype).name == layout.dtype):
            expected[p] = layout.checksum
    sums = digest.tree_sums([restored[p] for p in expected])
    # (a saved checksum means a summable dtype, read as saved: s is not None here)
    bad = [p for p, s in zip(expected, sums, strict=True) if s != expected[p]]
    if bad:
        raise CheckpointError(
            f"{where}: the contents of {len(bad)} arrays of {saved.directory} do not match the "
            f"checksums saved with them ({', '.join(bad[:MAX_LISTED])}): a shard is damaged. "
            f"Restore the checkpoint's files from a good copy or save it again.")


def _with_leading(sharding: Any, axis: Any) -> Any:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(axis, *sharding.spec))
    return sharding


def _without_leading(sharding: Any, ndim: int) -> Any:
    if isinstance(sharding, NamedSharding):
        spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
        return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))
    return sharding
