"""``jaxpar.init``, ``get_rank``, ``get_group_size`` (MindSpore's ``mindspore.communication``).

``init()`` starts ``jax.distributed`` from the environment, whichever of these set it:

* ``jaxpar run`` and JAX's own variables: ``JAX_COORDINATOR_ADDRESS`` (``host:port``),
  ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` (Kubeflow Trainer v2 sets these too);
* a Kubeflow ``JAXJob`` (Training Operator v1): ``COORDINATOR_ADDRESS``, ``COORDINATOR_PORT``,
  ``NUM_PROCESSES``, ``PROCESS_ID``.

Without them it is a single process and ``init()`` does nothing.  A rank that dies of an
uncaught exception exits at once (status 1) rather than waiting in JAX's shutdown barrier, up
to five minutes, for ranks that will never get there: the launcher sees the failure when it
happens and names the rank that crashed, not one that timed out waiting for it.  On CPU the
collectives go through gloo.  jaxpar's ranks are processes (each may drive several devices:
``jax.device_count()`` is the total), so ``num_shards=get_group_size(), shard_id=get_rank()``
shards a dataset per process, as MindSpore's per-device ranks do.

>>> import jaxpar
>>> jaxpar.init()  # no cluster in the environment: one process
>>> jaxpar.get_rank(), jaxpar.get_group_size()
(0, 1)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import jax

from jaxpar._src.errors import ContextError

INIT_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class ClusterEnv:
    coordinator: str  # host:port
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    source: str = ""  # which variables said so


def cluster_env(environ: Mapping[str, str] | None = None) -> ClusterEnv | None:
    """The multi-process setting the environment describes, or ``None``.

    >>> env = cluster_env({"COORDINATOR_ADDRESS": "job-worker-0", "COORDINATOR_PORT": "6666",
    ...                    "NUM_PROCESSES": "2", "PROCESS_ID": "1"})
    >>> env.coordinator, env.num_processes, env.process_id, env.source
    ('job-worker-0:6666', 2, 1, 'Kubeflow JAXJob')
    """
    env = os.environ if environ is None else environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        source = "jaxpar run / JAX"
        coordinator = env["JAX_COORDINATOR_ADDRESS"]
        num, pid = env.get("JAX_NUM_PROCESSES"), env.get("JAX_PROCESS_ID")
    elif "COORDINATOR_ADDRESS" in env:
        source = "Kubeflow JAXJob"
        port = env.get("COORDINATOR_PORT", "6666")
        coordinator = f"{env['COORDINATOR_ADDRESS']}:{port}"
        num, pid = env.get("NUM_PROCESSES"), env.get("PROCESS_ID")
    else:
        return None
    try:
        num_processes, process_id = int(num), int(pid)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ContextError(
            f"jaxpar.init: the environment names a coordinator ({coordinator}, from {source}) "
            f"but not a valid process count and id (got {num!r} and {pid!r}). Set "
            f"JAX_NUM_PROCESSES and JAX_PROCESS_ID (or NUM_PROCESSES and PROCESS_ID).") from None
    if not 0 <= process_id < num_processes:
        raise ContextError(f"jaxpar.init: process id {process_id} is not in [0, "
                           f"{num_processes}).")
    local = None
    per = env.get("JAXPAR_DEVICES_PER_PROCESS")
    rank = env.get("JAXPAR_LOCAL_RANK")
    if per and rank and env.get("JAX_PLATFORMS", "") != "cpu":  # GPUs: this rank's share
        local = tuple(range(int(rank) * int(per), (int(rank) + 1) * int(per)))
    return ClusterEnv(coordinator, num_processes, process_id, local, source)


def init(backend_name: str | None = None) -> None:
    """Joins the processes of this job (no-op in a single process or when already joined).

    ``backend_name`` is accepted for MindSpore compatibility (``"hccl"``, ``"nccl"``) and
    ignored: XLA picks the collectives of the platform (gloo on CPU).

    >>> import jaxpar
    >>> jaxpar.init()  # in a process started by jaxpar run: joins the job; alone: nothing to do
    >>> jaxpar.get_group_size()
    1
    """
    del backend_name
    env = cluster_env()
    if env is None or _initialized():
        return
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError):  # pragma: no cover - a JAX without the option
        pass
    kwargs: dict[str, Any] = {}
    if env.local_device_ids is not None:
        kwargs["local_device_ids"] = list(env.local_device_ids)
    jax.distributed.initialize(
        coordinator_address=env.coordinator, num_processes=env.num_processes,
        process_id=env.process_id, cluster_detection_method="deactivate",
        initialization_timeout=int(os.environ.get("JAXPAR_INIT_TIMEOUT", INIT_TIMEOUT_S)),
        **kwargs)
    _exit_at_once_on_crash()
    from jaxpar._src.context import set_auto_parallel_context

    set_auto_parallel_context(global_rank=jax.process_index())


def _exit_at_once_on_crash() -> None:
    """After the traceback is printed, leave without the shutdown barrier of ``atexit``."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = hook


def _initialized() -> bool:
    check = getattr(jax.distributed, "is_initialized", None)
    return bool(check()) if check is not None else False


def get_rank() -> int:
    """This process's rank (``jax.process_index()``).

    >>> import jaxpar
    >>> jaxpar.get_rank()  # one process
    0
    """
    return jax.process_index()


def get_group_size() -> int:
    """The number of processes (``jax.process_count()``).

    >>> import jaxpar
    >>> jaxpar.get_group_size()
    1
    """
    return jax.process_count()


def get_local_rank() -> int:
    """This process's index on its host (set by ``jaxpar run``; 0 otherwise).

    >>> import jaxpar
    >>> jaxpar.get_local_rank()
    0
    """
    return int(os.environ.get("JAXPAR_LOCAL_RANK", 0))
