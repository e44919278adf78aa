"""Applying communication fusion: which gradients share one all-reduce.

The configuration (``comm_fusion``, ``all_reduce_fusion_config``) is parsed in
``jaxpar/_src/fusion.py`` and held by the auto-parallel context; here it becomes buckets of
consecutive gradients, each reduced by one all-reduce (:class:`DistributedGradReducer`).

>>> [list(b) for b in buckets([4, 4, 4, 4, 4], FusionConfig("index", (2, 3)))]
[[0, 1], [2], [3, 4]]
>>> [list(b) for b in buckets([3 << 20, 2 << 20, 2 << 20], FusionConfig("size", 4))]
[[0], [1, 2]]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from jaxpar._src.context import current_context
from jaxpar._src.fusion import FusionConfig, check_split_indices, parse_kind


def allreduce_fusion(override: Any = None) -> FusionConfig:
    """The all-reduce fusion in force: ``override`` (a dict, or split indices), else the
    context's ``comm_fusion``, else its ``all_reduce_fusion_config``, else ``"auto"``."""
    if override is not None:
        if isinstance(override, FusionConfig):
            return override
        if isinstance(override, Mapping):
            return parse_kind("allreduce", override)
        return FusionConfig("index", check_split_indices(override, "fusion"))
    ctx = current_context()
    if ctx.comm_fusion is not None:
        if not ctx.comm_fusion.openstate:
            return FusionConfig("off")
        if ctx.comm_fusion.allreduce != FusionConfig() or ctx.all_reduce_fusion_config is None:
            return ctx.comm_fusion.allreduce
    if ctx.all_reduce_fusion_config is not None:
        return FusionConfig("index", ctx.all_reduce_fusion_config)
    return FusionConfig()


def buckets(nbytes: Sequence[float], config: FusionConfig) -> list[range]:
    """Consecutive index ranges of the tensors fused together, in order."""
    n = len(nbytes)
    if n == 0:
        return []
    if config.mode == "off":
        return [range(i, i + 1) for i in range(n)]
    if config.mode == "index":
        points = [0] + [i for i in config.config if 0 < i < n] + [n]
        return [range(a, b) for a, b in zip(points, points[1:], strict=False) if b > a]
    limit = config.threshold_bytes
    out, start, filled = [], 0, 0.0
    for i, size in enumerate(nbytes):
        if i > start and filled + size > limit:
            out.append(range(start, i))
            start, filled = i, 0.0
        filled += size
    out.append(range(start, n))
    return out
