"""The orbax side: one checkpoint directory, written atomically, read in parts onto shardings.

A jaxpar checkpoint is an orbax composite checkpoint with up to three items::

    step_100/state/                   the arrays (orbax PyTree, OCDBT: each process its shards)
    step_100/strategy/strategy.json   their layouts and checksums (ParameterLayouts)
    step_100/plan/plan.json           the ShardingPlan of the program, when one was given

orbax writes everything under ``step_100.orbax-checkpoint-tmp-*`` and renames it when every
process has finished, so a crash leaves no ``step_100`` at all.  Reads name the arrays they
want (the others are orbax placeholders) and give each a target sharding: tensorstore then
reads, in every process, the chunks that overlap the shards of that process's devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpar._src.checkpoint.layouts import ParameterLayouts
from jaxpar._src.checkpoint.paths import flatten
from jaxpar._src.errors import CheckpointError

STATE, STRATEGY, PLAN = "state", "strategy", "plan"
FILES = {STRATEGY: "strategy.json", PLAN: "plan.json"}
ORBAX_TMP = ".orbax-checkpoint-tmp"
REPLACING = ".jaxpar-replacing"


def _ocp() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ModuleNotFoundError:
        raise CheckpointError("jaxpar checkpoints are written with orbax, which is not "
                              "installed: pip install 'jaxpar[checkpoint]'.") from None
    return ocp


def checkpointer() -> Any:
    """An orbax ``Checkpointer`` for jaxpar's three items."""
    ocp = _ocp()
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(handler_registry=registry()))


def registry() -> Any:
    """orbax handlers for jaxpar's three items (the JSON items under readable file names); a
    ``CheckpointManager`` takes it too."""
    ocp = _ocp()
    registry = ocp.DefaultCheckpointHandlerRegistry()
    tree = ocp.PyTreeCheckpointHandler()
    registry.add(STATE, ocp.args.PyTreeSave, tree)
    registry.add(STATE, ocp.args.PyTreeRestore, tree)
    for item, filename in FILES.items():
        handler = ocp.JsonCheckpointHandler(filename=filename)
        registry.add(item, ocp.args.JsonSave, handler)
        registry.add(item, ocp.args.JsonRestore, handler)
    return registry


def save_items(tree: Any, strategy: ParameterLayouts, plan: Mapping | None,
               chunk_bytes: int | Mapping[str, int | None] | None) -> Any:
    """The orbax ``Composite`` arguments that save ``tree`` with its strategy (and plan)."""
    ocp = _ocp()
    if jax.process_count() > 1:  # an array on this process's devices only is a host value
        tree = jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array)
                            and x.is_fully_addressable else x, tree)
    from jaxpar._src.trace import dotted

    def args(path: Any, _: Any) -> Any:
        size = chunk_bytes.get(dotted(path)) if isinstance(chunk_bytes, Mapping) else chunk_bytes
        return ocp.SaveArgs(chunk_byte_size=size)

    save_args = jax.tree_util.tree_map_with_path(args, tree)
    items = {STATE: ocp.args.PyTreeSave(tree, save_args=save_args),
             STRATEGY: ocp.args.JsonSave(strategy.to_dict())}
    if plan is not None:
        items[PLAN] = ocp.args.JsonSave(dict(plan))
    return ocp.args.Composite(**items)


def write(directory: str | os.PathLike, tree: Any, strategy: ParameterLayouts,
          plan: Mapping | None = None, *, overwrite: bool = False,
          chunk_bytes: int | Mapping[str, int | None] | None = None, where: str) -> Path:
    """Saves ``tree`` at ``directory``, all or nothing; every process must call it."""
    path = Path(directory).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(f"{where}: {path} already exists; pass overwrite=True to replace "
                              f"it, or save under a new name.")
    target = path.with_name(path.name + REPLACING) if path.exists() else path
    if jax.process_index() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_unfinished(path)  # a save that crashed
    _barrier("jaxpar_checkpoint_prepare")
    try:
        checkpointer().save(target, args=save_items(tree, strategy, plan, chunk_bytes))
    except BaseException:
        if jax.process_index() == 0:
            _remove_unfinished(path)
        raise
    if target != path:
        if jax.process_index() == 0:
            old = path.with_name(path.name + ".jaxpar-old")
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
            os.rename(target, path)
            shutil.rmtree(old, ignore_errors=True)
        _barrier("jaxpar_checkpoint_replace")
    return path


def _remove_unfinished(path: Path) -> None:
    for pattern in (path.name + ORBAX_TMP + "*", path.name + REPLACING + "*"):
        for stale in path.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def locate(path: str | os.PathLike, step: int | None = None, *, where: str) -> Path:
    """The checkpoint directory ``path`` names: itself, or a step of a ``ModelCheckpoint``
    directory (``step``, default the newest)."""
    p = Path(path).absolute()
    if (p / STATE).is_dir():
        if step is not None:
            raise CheckpointError(f"{where}: {p} is one checkpoint; step={step} applies to a "
                                  f"directory of steps (jaxpar.ModelCheckpoint's).")
        return p
    if p.is_dir():
        steps = sorted(int(c.name) for c in p.iterdir()
                       if c.name.isdigit() and (c / STATE).is_dir())
        if steps:
            if step is None:
                return p / str(steps[-1])
            if step in steps:
                return p / str(step)
            raise CheckpointError(f"{where}: {p} has no step {step}; it has steps {steps}.")
        raise CheckpointError(
            f"{where}: {p} is not a jaxpar checkpoint: it has no '{STATE}' directory and no "
            f"numbered steps. Save with jaxpar.save_checkpoint or jaxpar.ModelCheckpoint.")
    unfinished = sorted(p.parent.glob(p.name + ORBAX_TMP + "*")) if p.parent.is_dir() else []
    if unfinished:
        raise CheckpointError(
            f"{where}: there is no checkpoint at {p}: the save did not finish (it left "
            f"{unfinished[0].name}, which is never read). Save it again.")
    raise CheckpointError(f"{where}: there is no checkpoint at {p}.")


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a checkpoint directory holds, read from its metadata (no array is read)."""

    directory: Path
    arrays: Mapping[str, tuple[tuple[int, ...], str]]  # path -> (shape, dtype)
    tree: Any  # orbax's metadata tree: the structure reads fill in
    strategy: ParameterLayouts | None
    plan: dict | None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {p: shape for p, (shape, _) in self.arrays.items()}


def _is_meta(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def read(directory: Path, *, where: str) -> Saved:
    try:
        meta = checkpointer().metadata(directory).item_metadata[STATE]
        tree = meta.tree
    except Exception as e:  # noqa: BLE001 - orbax and tensorstore raise many kinds
        raise CheckpointError(f"{where}: cannot read the metadata of {directory / STATE}: "
                              f"{_first_line(e)}. The checkpoint is damaged; save it "
                              f"again.") from e
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_meta)[0]
    from jaxpar._src.trace import dotted

    arrays = {dotted(p): (tuple(int(d) for d in m.shape), np.dtype(m.dtype).name)
              for p, m in flat if _is_meta(m)}
    strategy = None
    text = _read_json(directory, STRATEGY)
    if text is not None:
        strategy = ParameterLayouts.from_dict(text, where=f"{where}: {directory}")
    return Saved(directory, arrays, tree, strategy, _read_json(directory, PLAN))


def _read_json(directory: Path, item: str) -> dict | None:
    f = directory / item / FILES[item]
    if not f.exists():
        return None
    return json.loads(f.read_text())


def restore(saved: Saved, wants: Mapping[str, Any], *, where: str) -> dict[str, Any]:
    """Reads the arrays named in ``wants``: each onto the sharding of its
    ``jax.ShapeDtypeStruct``, or into host memory (``np.ndarray`` as the value)."""
    paths, leaves, _ = flatten(restore_tree(saved, wants, where=where))
    return {p: x for p, x in zip(paths, leaves, strict=True) if p in wants}


def restore_tree(saved: Saved, wants: Mapping[str, Any], *, where: str) -> Any:
    """Like :func:`restore`, as the tree orbax saved (``...`` where nothing was wanted)."""
    ocp = _ocp()

    def item(path: Any, m: Any) -> Any:
        from jaxpar._src.trace import dotted

        want = wants.get(dotted(path), ocp.PLACEHOLDER)
        return want if want is not np.ndarray else m

    def restore_args(path: Any, m: Any) -> Any:
        from jaxpar._src.trace import dotted

        want = wants.get(dotted(path), ocp.PLACEHOLDER)
        if want is ocp.PLACEHOLDER:
            return ocp.PLACEHOLDER
        if want is np.ndarray:
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(sharding=want.sharding, global_shape=want.shape,
                                    dtype=want.dtype)

    target = jax.tree_util.tree_map_with_path(item, saved.tree, is_leaf=_is_meta)
    args = jax.tree_util.tree_map_with_path(restore_args, saved.tree, is_leaf=_is_meta)
    try:
        return checkpointer().restore(saved.directory, args=ocp.args.Composite(
            **{STATE: ocp.args.PyTreeRestore(item=target, restore_args=args)}))[STATE]
    except Exception as e:  # noqa: BLE001 - tensorstore's errors name the array's files
        raise CheckpointError(
            f"{where}: reading {saved.directory} failed{_array_named(e, wants)}: a shard is "
            f"missing or damaged ({_first_line(e)}). Restore the checkpoint's files (every "
            f"process's ocdbt.process_* directory must be there) or save it again.") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _array_named(e: BaseException, wants: Mapping[str, Any]) -> str:
    text = str(e)
    named = [p for p in wants if f"'{p}/" in text or f'"{p}/' in text or f"{p}/." in text]
    return f" at array '{named[0]}'" if named else ""
