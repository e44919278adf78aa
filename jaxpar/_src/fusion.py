"""Communication fusion settings: MindSpore's ``comm_fusion`` and ``all_reduce_fusion_config``.

This module only parses and holds the configuration (the auto-parallel context stores it); the
training stack applies it (``jaxpar/_src/train/buckets.py``: which gradients share one
all-reduce).  Three modes, as MindSpore defines them, over the gradients in parameter order:

* ``"auto"``: buckets of up to 64 MB, filled in order;
* ``"size"``: buckets of up to ``config`` MB;
* ``"index"``: split points by gradient index; ``[20, 35]`` gives ``[0, 20)``, ``[20, 35)`` and
  the rest (``all_reduce_fusion_config=[20, 35]`` is the same thing).

``openstate=False`` turns fusion off: one all-reduce per gradient.  A gradient larger than a
bucket gets a bucket of its own.

>>> fusion = CommFusion.parse({"allreduce": {"mode": "index", "config": [2, 3]}})
>>> fusion.allreduce
FusionConfig(mode='index', config=(2, 3))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpar._src.errors import ContextError

AUTO_BUCKET_MB = 64  # MindSpore's default fusion threshold
KINDS = ("allreduce", "allgather", "reducescatter")


@dataclasses.dataclass(frozen=True)
class FusionConfig:
    """How one kind of collective is fused: ``mode`` and its ``config``."""

    mode: str = "auto"  # "auto" | "size" | "index" | "off"
    config: Any = None  # size: MB per bucket; index: split points

    @property
    def threshold_bytes(self) -> float:
        if self.mode == "auto":
            return AUTO_BUCKET_MB * 2**20
        if self.mode == "size":
            return float(self.config) * 2**20
        return float("inf")


@dataclasses.dataclass(frozen=True)
class CommFusion:
    """The ``comm_fusion`` context option, parsed (MindSpore's dictionary form)."""

    openstate: bool = True
    allreduce: FusionConfig = FusionConfig()
    allgather: FusionConfig = FusionConfig()
    reducescatter: FusionConfig = FusionConfig()

    @classmethod
    def parse(cls, value: Any) -> CommFusion:
        if isinstance(value, CommFusion):
            return value
        if not isinstance(value, Mapping):
            raise ContextError(
                f"jaxpar: comm_fusion must be a dict such as {{'allreduce': {{'mode': 'size', "
                f"'config': 32}}}}, got {value!r}.")
        unknown = set(value) - {"openstate", *KINDS}
        if unknown:
            raise ContextError(
                f"jaxpar: comm_fusion has unknown keys {sorted(unknown)}; known: 'openstate', "
                f"{', '.join(repr(k) for k in KINDS)}.")
        openstate = value.get("openstate", True)
        if not isinstance(openstate, bool):
            raise ContextError(f"jaxpar: comm_fusion openstate must be a bool, got {openstate!r}.")
        kinds = {k: parse_kind(k, value[k]) for k in KINDS if k in value}
        return cls(openstate, **kinds)


def parse_kind(kind: str, entry: Any) -> FusionConfig:
    if not isinstance(entry, Mapping) or "mode" not in entry:
        raise ContextError(
            f"jaxpar: comm_fusion[{kind!r}] must be a dict with a 'mode' ('auto', 'size' or "
            f"'index') and a 'config', got {entry!r}.")
    mode, config = entry["mode"], entry.get("config")
    modes = ("auto", "size", "index") if kind == "allreduce" else ("auto", "size")
    if mode not in modes:
        raise ContextError(
            f"jaxpar: comm_fusion[{kind!r}] mode must be one of {list(modes)}, got {mode!r}.")
    if mode == "auto":
        return FusionConfig("auto")
    if mode == "size":
        if isinstance(config, bool) or not isinstance(config, (int, float)) or config <= 0:
            raise ContextError(
                f"jaxpar: comm_fusion[{kind!r}] mode 'size' needs config = the bucket size in MB "
                f"(a positive number), got {config!r}.")
        return FusionConfig("size", config)
    return FusionConfig("index", check_split_indices(config, f"comm_fusion[{kind!r}] config"))


def check_split_indices(value: Any, what: str) -> tuple[int, ...]:
    """Strictly increasing non-negative gradient indices."""
    ok = isinstance(value, (list, tuple)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    if not ok or list(value) != sorted(set(value)):
        raise ContextError(
            f"jaxpar: {what} must be strictly increasing gradient indices such as [20, 35], "
            f"got {value!r}.")
    return tuple(value)
