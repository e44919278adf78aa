"""``set_ps_context``: the parameter-server settings (MindSpore's ``mindspore.set_ps_context``).

MindSpore starts its roles from the environment (``MS_ROLE=MS_WORKER|MS_PSERVER|MS_SCHED``,
``MS_SERVER_NUM``, ``MS_WORKER_NUM``).  On Ray the roles are actors: the process that calls
:class:`jaxpar.ps.ParameterServerTrainer` is the scheduler, and it starts ``server_num`` server
actors and ``worker_num`` worker actors; inside them :func:`current_role` says which one runs.

>>> from jaxpar import ps
>>> ps.set_ps_context(enable_ps=True, server_num=2, worker_num=3, mode="async",
...                   max_staleness=4)
>>> ps.get_ps_context("mode"), ps.get_ps_context("max_staleness")
('async', 4)
>>> ps.reset_ps_context()
>>> ps.get_ps_context("mode")
'sync'
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from jaxpar._src.errors import ContextError

MODES = ("sync", "async")
FAILURE_POLICIES = ("restart", "drop")
ROLE_ENV = "JAXPAR_PS_ROLE"


@dataclasses.dataclass(frozen=True)
class PSConfig:
    """The parameter-server settings; every field is a ``set_ps_context`` key.

    >>> from jaxpar import ps
    >>> ps.PSConfig(server_num=2, worker_num=3).mode
    'sync'
    """

    enable_ps: bool = False
    server_num: int = 1  # server actors; parameters are split across them by size
    worker_num: int = 1  # worker actors at the start (add and remove while training runs)
    mode: str = "sync"  # "sync": every step waits for all workers; "async": as they arrive
    max_staleness: int | None = None  # async: refuse gradients older than this many updates
    checkpoint_every: int = 0  # server steps between checkpoints (0: none)
    checkpoint_dir: str | None = None  # where servers write their orbax checkpoints
    on_worker_failure: str = "restart"  # "restart" the dead worker, or "drop" it
    max_worker_restarts: int = 3  # per worker, then it is dropped

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ContextError:
            return ContextError(f"set_ps_context: {key}={getattr(self, key)!r} {why}.")

        def is_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not isinstance(self.enable_ps, bool):
            raise bad("enable_ps", "must be True or False")
        if self.checkpoint_dir is not None:
            if not isinstance(self.checkpoint_dir, (str, os.PathLike)):
                raise bad("checkpoint_dir", "must be a directory path (a str), or None")
            object.__setattr__(self, "checkpoint_dir", os.fspath(self.checkpoint_dir))
        for key in ("server_num", "worker_num"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(key, "must be a positive int")
        if self.mode not in MODES:
            raise bad("mode", f"is not one of {list(MODES)}")
        if self.on_worker_failure not in FAILURE_POLICIES:
            raise bad("on_worker_failure", f"is not one of {list(FAILURE_POLICIES)}")
        if self.max_staleness is not None and (not is_int(self.max_staleness)
                                               or self.max_staleness < 0):
            raise bad("max_staleness", "must be None or an int >= 0")
        if not is_int(self.checkpoint_every) or self.checkpoint_every < 0:
            raise bad("checkpoint_every", "must be an int >= 0")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise bad("checkpoint_every", "needs checkpoint_dir: where the servers write")
        if not is_int(self.max_worker_restarts) or self.max_worker_restarts < 0:
            raise bad("max_worker_restarts", "must be an int >= 0")


_config = PSConfig()


def set_ps_context(**kwargs: Any) -> None:
    """Sets parameter-server options (see :class:`PSConfig` for the keys).

    >>> from jaxpar import ps
    >>> ps.set_ps_context(enable_ps=True, server_num=2, mode="async", max_staleness=2)
    >>> ps.get_ps_context("mode")
    'async'
    >>> ps.reset_ps_context()
    """
    global _config
    known = {f.name for f in dataclasses.fields(PSConfig)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ContextError(f"set_ps_context: unknown option(s) {unknown}; the options are "
                           f"{sorted(known)}.")
    _config = dataclasses.replace(_config, **kwargs)


def get_ps_context(key: str) -> Any:
    """One parameter-server option's value (a :class:`PSConfig` field).

    >>> from jaxpar import ps
    >>> ps.get_ps_context("server_num")
    1
    """
    if not hasattr(_config, key):
        raise ContextError(f"get_ps_context: unknown option {key!r}.")
    return getattr(_config, key)


def reset_ps_context() -> None:
    """Restores every parameter-server option to its default.

    >>> from jaxpar import ps
    >>> ps.set_ps_context(worker_num=4)
    >>> ps.reset_ps_context()
    >>> ps.get_ps_context("worker_num")
    1
    """
    global _config
    _config = PSConfig()


def ps_config(**overrides: Any) -> PSConfig:
    """The context's settings with ``overrides`` (``None`` values ignored)."""
    return dataclasses.replace(_config, **{k: v for k, v in overrides.items() if v is not None})


def current_role() -> str:
    """``"MS_WORKER"`` or ``"MS_PSERVER"`` inside the actors, ``"MS_SCHED"`` elsewhere.

    >>> current_role()
    'MS_SCHED'
    """
    return os.environ.get(ROLE_ENV, "MS_SCHED")
