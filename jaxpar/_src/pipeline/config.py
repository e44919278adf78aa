"""``PipelineConfig``: how many stages, micro-batches, which schedule.

MindSpore sets these in the auto-parallel context (``pipeline_stages``, ``pipeline_config``) and
on ``PipelineCell(network, micro_size)``; jaxpar also takes ``micro_batches`` in the context and
as an argument of ``parallelize`` (explicit arguments win).  The stage axis is the mesh axis
named ``"pp"``; its size must be ``pipeline_stages``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jaxpar._src.errors import ContextError

SCHEDULES = ("gpipe", "1f1b")
AXIS = "pp"  # the mesh axis the stages run on
DEFAULT_REPEATS = 2  # chunks per stage with pipeline_interleave=True (Megatron's "virtual" v)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A pipeline's shape.

    Attributes:
      stages: pipeline stages ``S`` (the size of the ``"pp"`` mesh axis).
      micro_batches: micro-batches ``M`` per step; the batch splits into ``M`` equal parts.
      schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (one forward and
        one backward per tick once the pipeline is full: at most ``O(S)`` micro-batches in
        flight instead of ``M``).
      repeats: chunks of layers per stage, ``v`` (``pipeline_interleave=True``: ``v = 2`` unless
        ``pipeline_config`` gives ``"pipeline_repeats"``); chunk ``c`` runs on stage ``c % S``,
        so a micro-batch goes round the stages ``v`` times (the circular pipeline).
      residuals: ``"store"`` keeps each stage's backward residuals from its forward;
        ``"recompute"`` keeps only the stage's input and runs its forward again in the
        backward (less memory, one more forward); ``"auto"``: ``parallelize`` stores them
        where the step fits ``HardwareProfile.memory_per_device``, else recomputes them
        (``residual_choice.py``); a cell run or stacked outside ``parallelize`` stores.
      reduction: how micro-batch losses combine: ``"mean"`` (equals the unpipelined step for
        a mean loss) or ``"sum"`` (MindSpore's ``PipelineCell``).

    >>> c = PipelineConfig.from_options(2, {"pipeline_scheduler": "1f1b"}, micro_batches=4)
    >>> c.stages, c.micro_batches, c.schedule, c.repeats
    (2, 4, '1f1b', 1)
    """

    stages: int = 1
    micro_batches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    residuals: str = "store"
    reduction: str = "mean"

    @property
    def chunks(self) -> int:
        """Layer chunks ``S * v``."""
        return self.stages * self.repeats

    @property
    def enabled(self) -> bool:
        return self.stages > 1

    @classmethod
    def from_options(cls, stages: int, pipeline_config: Mapping[str, Any] | None, *,
                     micro_batches: int | None, where: str = "jaxpar") -> PipelineConfig:
        """From MindSpore's options: ``pipeline_stages``, ``pipeline_config`` and a micro-batch
        count (default: ``stages``, the fewest that fill the pipeline)."""
        cfg = check_pipeline_config(pipeline_config, where)
        stages = check_stages(stages, where)
        m = stages if micro_batches is None else check_micro_batches(micro_batches, where)
        interleave = cfg.get("pipeline_interleave", False)
        repeats = int(cfg.get("pipeline_repeats", DEFAULT_REPEATS)) if interleave else 1
        return cls(stages, m, cfg.get("pipeline_scheduler", "gpipe"), repeats,
                   cfg.get("pipeline_residuals", "store"),
                   cfg.get("pipeline_reduction", "mean"))


_CONFIG_KEYS: dict[str, tuple[Any, ...] | None] = {
    "pipeline_scheduler": SCHEDULES,
    "pipeline_interleave": (True, False),
    "pipeline_repeats": None,
    "pipeline_residuals": ("store", "recompute", "auto"),
    "pipeline_reduction": ("mean", "sum"),
}


def check_pipeline_config(value: Any, where: str = "jaxpar") -> dict[str, Any]:
    """``pipeline_config`` validated: a dict of the keys in ``_CONFIG_KEYS``.

    >>> check_pipeline_config({"pipeline_interleave": True})
    {'pipeline_interleave': True}
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ContextError(f"{where}: pipeline_config must be a dict such as "
                           f"{{'pipeline_scheduler': '1f1b', 'pipeline_interleave': False}}, "
                           f"got {value!r}.")
    out = {}
    for key, v in value.items():
        if key not in _CONFIG_KEYS:
            raise ContextError(f"{where}: unknown pipeline_config key {key!r}; known keys: "
                               f"{sorted(_CONFIG_KEYS)}.")
        allowed = _CONFIG_KEYS[key]
        if key == "pipeline_repeats":
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ContextError(f"{where}: pipeline_config['pipeline_repeats'] must be a "
                                   f"positive int, got {v!r}.")
        elif key == "pipeline_scheduler" and v not in SCHEDULES:
            extra = (" MindSpore's seqpipe/seqvpp/zero_bubble_v schedules need an MPMD "
                     "runtime; jaxpar runs one SPMD program." if isinstance(v, str) else "")
            raise ContextError(f"{where}: pipeline_scheduler {v!r} is not one of "
                               f"{list(SCHEDULES)}.{extra}")
        elif allowed is None:
            pass  # free-form (checked above)
        elif v not in allowed or (key == "pipeline_interleave" and not isinstance(v, bool)):
            raise ContextError(f"{where}: pipeline_config[{key!r}] must be one of "
                               f"{list(allowed)}, got {v!r}.")
        out[key] = v
    return out


def check_stages(value: Any, where: str = "jaxpar") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ContextError(f"{where}: pipeline_stages must be a positive int, got {value!r}.")
    return value


def check_micro_batches(value: Any, where: str = "jaxpar") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ContextError(f"{where}: micro_batches must be a positive int, got {value!r}.")
    return value
