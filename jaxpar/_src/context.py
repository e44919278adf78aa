"""The MindSpore-style auto-parallel context: a global setting that is also a ``with`` block.

``set_auto_parallel_context(...)`` changes the process-wide defaults, ``auto_parallel_context(...)``
overrides them for a block (per thread) and restores them on exit, and explicit arguments to
``parallelize``/``shard`` always win over both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

from jax.sharding import Mesh

from jaxpar._src.errors import ContextError
from jaxpar._src.fusion import CommFusion, check_split_indices
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.search import search_modes


class ParallelMode(enum.StrEnum):
    """How ``parallelize`` decides shardings (MindSpore's ``ParallelMode``).

    >>> ParallelMode("semi_auto_parallel") is ParallelMode.SEMI_AUTO_PARALLEL
    True
    """

    STAND_ALONE = "stand_alone"  # one device, nothing sharded
    DATA_PARALLEL = "data_parallel"  # batch arguments split over all devices, the rest replicated
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"  # user strategies, the rest propagated
    AUTO_PARALLEL = "auto_parallel"  # searched with search_mode




@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """The options of the auto-parallel context; see :func:`set_auto_parallel_context`."""

    parallel_mode: ParallelMode = ParallelMode.STAND_ALONE  # how shardings are decided
    search_mode: str = "recursive_programming"  # the search used by auto_parallel
    device_num: int | None = None  # devices to use; None = all of jax.devices()
    global_rank: int = 0  # this process's rank (set by jaxpar.init in multi-process runs)
    gradients_mean: bool = True  # gradients are the device mean (a JAX program's own meaning)
    mesh: Mesh | None = None  # the device mesh; None = derived from strategies or device_num
    hardware: HardwareProfile | None = None  # what the cost model prices; None = CPU preset
    strategy_ckpt_save_file: str = ""  # write the plan (JSON) here after planning
    strategy_ckpt_load_file: str = ""  # read the plan from here instead of searching
    # How batches reach the devices: "data_parallel" (split), "full_batch" (whole on every
    # device), or per batch input a tuple of slice counts (e.g. ((1, 2, 4, 1),): H and W split)
    # or a jaxpar.Layout called on the input's dimensions.
    dataset_strategy: str | tuple = "data_parallel"
    all_reduce_fusion_config: tuple[int, ...] | None = None  # gradient index split points
    comm_fusion: CommFusion | None = None  # per collective kind: "auto" | "size" | "index"
    parameter_broadcast: bool = False  # training starts from rank 0's parameters everywhere
    pipeline_stages: int = 1  # stages on the mesh axis "pp" (see jaxpar.PipelineCell)
    # {"pipeline_scheduler": "gpipe" | "1f1b", "pipeline_interleave": bool, ...}, kept as
    # sorted (key, value) pairs so the context stays hashable; read back as a dict.
    pipeline_config: tuple = ()
    micro_batches: int | None = None  # micro-batches per step; None = pipeline_stages
    enable_parallel_optimizer: bool = False  # ZeRO: optimizer state (and more) split over dp
    # {"optimizer_level": "level1" | "level2" | "level3", "parallel_optimizer_threshold": KB,
    #  "optimizer_weight_shard_size": k, "gradient_accumulation_shard": bool}, sorted pairs
    # as pipeline_config (see jaxpar/_src/optimizer_parallel.py).
    parallel_optimizer_config: tuple = ()


_FIELDS = {f.name for f in dataclasses.fields(ParallelContext)}
_ALIASES = {"full_batch"}  # MindSpore's older spelling of dataset_strategy="full_batch"


def _normalize(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Validated options, with MindSpore's ``full_batch`` turned into ``dataset_strategy``."""
    kwargs = dict(kwargs)
    if "full_batch" in kwargs:
        full = kwargs.pop("full_batch")
        if not isinstance(full, bool):
            raise ContextError(f"jaxpar: full_batch must be True or False, got {full!r}.")
        kwargs.setdefault("dataset_strategy", "full_batch" if full else "data_parallel")
    return {k: _validate(k, v) for k, v in kwargs.items()}


def _validate(key: str, value: Any) -> Any:
    if key not in _FIELDS:
        raise ContextError(
            f"jaxpar: unknown auto-parallel context option {key!r}. Known options: "
            f"{', '.join(sorted(_FIELDS))}.")
    if key == "parallel_mode":
        try:
            return ParallelMode(str(value))
        except ValueError:
            raise ContextError(
                f"jaxpar: parallel_mode {value!r} is not one of "
                f"{[m.value for m in ParallelMode]}.") from None
    if key == "search_mode":
        if value not in search_modes():  # the registered modes (search/registry.py)
            raise ContextError(
                f"jaxpar: search_mode {value!r} is not one of {list(search_modes())}.")
        return value
    if key == "device_num" and value is not None:
        if not isinstance(value, int) or value < 1:
            raise ContextError(f"jaxpar: device_num must be a positive int, got {value!r}.")
    if key == "global_rank" and (not isinstance(value, int) or value < 0):
        raise ContextError(f"jaxpar: global_rank must be a non-negative int, got {value!r}.")
    if key == "gradients_mean" and not isinstance(value, bool):
        raise ContextError(f"jaxpar: gradients_mean must be True or False, got {value!r}.")
    if key == "mesh" and value is not None and not isinstance(value, Mesh):
        raise ContextError(
            f"jaxpar: mesh must be a jax.sharding.Mesh (see jaxpar.make_mesh), got {value!r}.")
    if key in ("strategy_ckpt_save_file", "strategy_ckpt_load_file") and \
            not isinstance(value, (str, os.PathLike)):
        raise ContextError(f"jaxpar: {key} must be a path, got {value!r}.")
    if key == "hardware" and value is not None and not isinstance(value, HardwareProfile) \
            and value != "calibrated" and value not in HardwareProfile.PRESETS:
        raise ContextError(
            f"jaxpar: hardware must be a jaxpar.HardwareProfile, a preset name or "
            f"'calibrated', got {value!r}.")
    if key == "dataset_strategy":
        return check_dataset_strategy(value)
    if key == "all_reduce_fusion_config":
        return None if value is None else check_split_indices(value, "all_reduce_fusion_config")
    if key == "comm_fusion":
        return None if value is None else CommFusion.parse(value)
    if key == "parameter_broadcast" and not isinstance(value, bool):
        raise ContextError(f"jaxpar: parameter_broadcast must be True or False, got {value!r}.")
    if key in ("pipeline_stages", "pipeline_config", "micro_batches"):
        return _pipeline_option(key, value)
    if key == "enable_parallel_optimizer" and not isinstance(value, bool):
        raise ContextError(
            f"jaxpar: enable_parallel_optimizer must be True or False, got {value!r}.")
    if key == "parallel_optimizer_config":
        from jaxpar._src.optimizer_parallel import check_config

        return tuple(sorted(check_config(dict(value) if isinstance(value, tuple) else value)
                            .items()))
    return value


def _pipeline_option(key: str, value: Any) -> Any:
    from jaxpar._src.pipeline import config

    if key == "pipeline_stages":
        return config.check_stages(value)
    if key == "micro_batches":
        return None if value is None else config.check_micro_batches(value)
    if isinstance(value, tuple):  # already normal (a context copied from another)
        value = dict(value)
    return tuple(sorted(config.check_pipeline_config(value).items()))


class _Local(threading.local):
    """This thread's ``with``-block contexts: ``stack`` is ``None`` until the thread opens one
    (a class default, so that reading it never raises and catches ``AttributeError``: a
    parallelized call reads it, and the per-call fast path's budget is microseconds)."""

    stack: list[ParallelContext] | None = None


class Changes:
    """A number that changes whenever jaxpar's context, algorithm parameters or execution mode
    may have changed, in any thread (``set_auto_parallel_context``, a ``with`` block entered or
    left, ``set_algo_parameters``, ``set_context``, their resets): the per-call fast path
    (``dispatch.py``) compares it, and the thread, with what it was at the last full call
    instead of comparing the contexts themselves.  ``next`` of an ``itertools.count`` is
    atomic, so every change stores a number never seen before, even where threads race.

    >>> n = CHANGES.count
    >>> set_algo_parameters(fully_use_devices=True)
    >>> CHANGES.count != n
    True
    """

    __slots__ = ("count", "_numbers")

    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self.count = 0

    def bump(self) -> None:
        """Called after a change is made (a reader that saw the old number saw the old
        state, or a state at least that old)."""
        self.count = next(self._numbers)


CHANGES = Changes()
_base = ParallelContext()
_local = _Local()


def current_context() -> ParallelContext:
    """The context in force here: the innermost ``with`` block, else the global settings."""
    stack = _local.stack
    return stack[-1] if stack else _base


def set_auto_parallel_context(**kwargs: Any) -> None:
    """Sets auto-parallel options for the whole process (MindSpore's function of that name).

    Options: ``parallel_mode`` (a :class:`ParallelMode` or its string), ``search_mode``,
    ``device_num``, ``global_rank``, ``gradients_mean``, ``mesh``, ``hardware``,
    ``strategy_ckpt_save_file``, ``strategy_ckpt_load_file``, ``dataset_strategy`` (or
    MindSpore's ``full_batch``), ``all_reduce_fusion_config``, ``comm_fusion``,
    ``parameter_broadcast``, ``pipeline_stages``, ``pipeline_config`` (``{"pipeline_scheduler":
    "gpipe" | "1f1b", "pipeline_interleave": bool}``) and ``micro_batches`` (see
    :class:`jaxpar.PipelineCell`), ``enable_parallel_optimizer`` and
    ``parallel_optimizer_config`` (``{"optimizer_level": "level1" | "level2" | "level3",
    "parallel_optimizer_threshold": 64, "optimizer_weight_shard_size": -1,
    "gradient_accumulation_shard": False}``: ZeRO-style sharding over the data-parallel devices;
    see :class:`jaxpar.OptimizerParallel`).

    ``gradients_mean`` defaults to ``True`` here, unlike MindSpore: a JAX program sees the global
    batch, so its gradients are the mean over devices, as single-device training computes them;
    ``parallelize`` refuses ``False`` (a sum of per-device gradients it never sees).

    >>> set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    >>> get_auto_parallel_context("parallel_mode")
    <ParallelMode.SEMI_AUTO_PARALLEL: 'semi_auto_parallel'>
    >>> reset_auto_parallel_context()
    """
    global _base
    updates = _normalize(kwargs)
    _base = dataclasses.replace(_base, **updates)
    stack = _local.stack
    if stack:  # inside a with-block the block's values shadow the globals; update both
        stack[-1] = dataclasses.replace(stack[-1], **updates)
    CHANGES.bump()


def get_auto_parallel_context(attr_key: str) -> Any:
    """One option's current value; raises ``ContextError`` for an unknown key.

    >>> import jaxpar
    >>> jaxpar.get_auto_parallel_context("parallel_mode") is jaxpar.ParallelMode.STAND_ALONE
    True
    """
    if attr_key == "full_batch":
        return current_context().dataset_strategy == "full_batch"
    if attr_key in ("pipeline_config", "parallel_optimizer_config"):
        return dict(getattr(current_context(), attr_key))
    if attr_key not in _FIELDS:
        _validate(attr_key, None)
    return getattr(current_context(), attr_key)


def reset_auto_parallel_context() -> None:
    """Restores every option to its default.

    >>> import jaxpar
    >>> jaxpar.set_auto_parallel_context(parallel_mode="data_parallel")
    >>> jaxpar.reset_auto_parallel_context()
    >>> jaxpar.get_auto_parallel_context("parallel_mode").value
    'stand_alone'
    """
    global _base
    _base = ParallelContext()
    CHANGES.bump()


@contextlib.contextmanager
def auto_parallel_context(**kwargs: Any) -> Iterator[ParallelContext]:
    """Overrides options inside a ``with`` block (this thread only) and restores them after.

    >>> with auto_parallel_context(parallel_mode="data_parallel") as ctx:
    ...     ctx.parallel_mode.value
    'data_parallel'
    >>> get_auto_parallel_context("parallel_mode").value
    'stand_alone'
    """
    updates = _normalize(kwargs)
    ctx = dataclasses.replace(current_context(), **updates)
    stack = _local.stack
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)
    CHANGES.bump()
    try:
        yield ctx
    finally:
        stack.pop()
        CHANGES.bump()


@dataclasses.dataclass(frozen=True)
class AlgoParameters:
    """Search parameters (MindSpore's ``set_algo_parameters``)."""

    fully_use_devices: bool = True  # auto search: only strategies that use every device
    elementwise_op_strategy_follow: bool = False  # elementwise ops copy their neighbour


_algo = AlgoParameters()
_ALGO_FIELDS = {f.name for f in dataclasses.fields(AlgoParameters)}


def set_algo_parameters(**kwargs: Any) -> None:
    """Sets search parameters; unknown names raise ``ContextError``.

    >>> set_algo_parameters(fully_use_devices=False)
    >>> get_algo_parameters("fully_use_devices")
    False
    >>> reset_algo_parameters()
    """
    global _algo
    for key, value in kwargs.items():
        if key not in _ALGO_FIELDS:
            raise ContextError(
                f"jaxpar: unknown algorithm parameter {key!r}. Known: "
                f"{', '.join(sorted(_ALGO_FIELDS))}.")
        if not isinstance(value, bool):
            raise ContextError(f"jaxpar: algorithm parameter {key} must be a bool, got {value!r}.")
    _algo = dataclasses.replace(_algo, **kwargs)
    CHANGES.bump()


def get_algo_parameters(attr_key: str) -> Any:
    """The value of one algorithm parameter (see :func:`set_algo_parameters`).

    >>> import jaxpar
    >>> jaxpar.set_algo_parameters(fully_use_devices=False)
    >>> jaxpar.get_algo_parameters("fully_use_devices")
    False
    >>> jaxpar.reset_algo_parameters()
    """
    if attr_key not in _ALGO_FIELDS:
        raise ContextError(
            f"jaxpar: unknown algorithm parameter {attr_key!r}. Known: "
            f"{', '.join(sorted(_ALGO_FIELDS))}.")
    return getattr(_algo, attr_key)


def reset_algo_parameters() -> None:
    """Restores every algorithm parameter to its default.

    >>> import jaxpar
    >>> jaxpar.set_algo_parameters(fully_use_devices=False)
    >>> jaxpar.reset_algo_parameters()
    >>> jaxpar.get_algo_parameters("fully_use_devices")
    True
    """
    global _algo
    _algo = AlgoParameters()
    CHANGES.bump()


def algo_parameters() -> AlgoParameters:
    return _algo


def check_dataset_strategy(value: Any) -> str | tuple:
    """``"data_parallel"``, ``"full_batch"``, or a tuple with one layout per batch input, each a
    tuple of slice counts or a ``jaxpar.Layout`` called on the input's dimensions (MindSpore's
    ``dataset_strategy=(layout("dp", "mp"), ...)``); returned in that normal form."""
    from jaxpar._src.layout import Layout

    if value in ("data_parallel", "full_batch"):
        return value

    def entry(s: Any) -> Any:
        if isinstance(s, Layout) and s.tensor_map is not None:
            return s
        if isinstance(s, (tuple, list)) and s and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in s):
            return tuple(s)
        return None

    if isinstance(value, (tuple, list)) and value:
        entries = [entry(s) for s in value]
        if all(e is not None for e in entries):
            return tuple(entries)
    raise ContextError(
        f"jaxpar: dataset_strategy must be 'data_parallel', 'full_batch', or one layout per "
        f"batch input: slice counts such as ((8, 1),) or ((1, 2, 4, 1), (8,)), or Layouts "
        f"such as (layout('dp', 'mp'), layout('dp')) with layout = jaxpar.Layout((2, 4), "
        f"('dp', 'mp')); got {value!r}.")
