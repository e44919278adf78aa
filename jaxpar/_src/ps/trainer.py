"""``ParameterServerTrainer``: parameter-server training on Ray Core (MindSpore's PS mode).

The calling process is the scheduler.  It starts ``server_num`` server actors, each holding the
parameter tensors :func:`assign_by_size` gives it with their optax state, and ``worker_num``
worker actors that compute gradients with JAX.  ``ray.init()`` is called if Ray is not up yet
(a local Ray); connect to a cluster first (``ray.init(address=...)``) and nothing else changes.

* ``mode="sync"``: each step's global batch is split across the workers of that step (by
  sample count, so the result does not depend on how many there are); servers apply the
  sample-weighted mean of the parts once all are in.  The numbers are those of data-parallel
  training on the same batches, and each server applies ``workers x steps`` gradients.
* ``mode="async"``: parts are handed to workers as they become free and every server applies a
  gradient as it arrives, scaled by the part's share of its batch (so a batch's parts move the
  parameters as far as one synchronous step would, were they fresh); with ``max_staleness`` a
  server refuses gradients computed on parameters more than that many of its updates old, and
  the worker recomputes.  Servers ignore a part they have already applied.

The scheduler ships each worker its part of the batch, or the
workers read their parts themselves (``jaxpar.ps.read_on_workers``).

Elastic: :meth:`~ParameterServerTrainer.add_worker` and
:meth:`~ParameterServerTrainer.remove_worker` (any time, from any thread) take effect at the
next step (sync) or the next hand-out (async).  Faults: a dead worker is restarted (or dropped,
``on_worker_failure="drop"``) and its part is computed again; servers ignore a part they already
have, so nothing is lost or applied twice.  A dead server is restarted from its last orbax
checkpoint (``checkpoint_every``, ``checkpoint_dir``); in sync mode every server goes back to
that same step and the steps since are computed again (the result is still exactly
data-parallel; :attr:`PSReport.redone_steps` counts them), in async mode only the dead server
goes back and the updates it loses are counted (:attr:`PSReport.lost_updates`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar._src.errors import PSError
from jaxpar._src.launch.launcher import without_device_count
from jaxpar._src.ps.context import ROLE_ENV, ps_config
from jaxpar._src.ps.partition import assign_by_size
from jaxpar._src.ps.reader import ReadPart, WorkerReader, part_slice
from jaxpar._src.ps.server import ServerCore
from jaxpar._src.ps.worker import WorkerCore

PING_S = 30.0
DRAIN_S = 60.0

Batch = Sequence[np.ndarray]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What callbacks get after each step (sync) or each applied part (async).

    >>> from jaxpar import ps
    >>> info = ps.StepInfo(step=3, loss=0.25, workers=(0, 1), samples=64)
    >>> f"step {info.step}: loss {info.loss} from {len(info.workers)} workers"
    'step 3: loss 0.25 from 2 workers'
    """

    step: int  # sync: the server step; async: the index of the part, in hand-out order
    loss: float  # sync: the global batch's mean loss; async: the part's
    workers: tuple[int, ...]  # the workers of this step (sync) / the one that computed it
    samples: int  # in the step (sync) / the part (async)


@dataclasses.dataclass(frozen=True)
class PSReport:
    """What happened, for logs and tests.

    >>> from jaxpar import ps
    >>> report = ps.PSReport(steps=(10, 10), applied=(30, 30), duplicates_ignored=0,
    ...                      stale_rejections=0, worker_restarts=1, workers_dropped=(),
    ...                      server_restores=0, redone_steps=0, lost_updates=0)
    >>> report.applied[0] // report.steps[0]  # workers per step (trainer.report() gives one)
    3
    """

    steps: tuple[int, ...]  # optimizer steps applied, per server
    applied: tuple[int, ...]  # worker gradients that went into them, per server
    duplicates_ignored: int  # parts pushed again after a worker restart
    stale_rejections: int
    worker_restarts: int
    workers_dropped: tuple[int, ...]
    server_restores: int
    redone_steps: int  # sync: steps computed again after servers went back to a checkpoint
    lost_updates: int  # async: finished parts a restored server no longer has


class _ServersLost(Exception):
    def __init__(self, dead: list[int]) -> None:
        super().__init__(dead)
        self.dead = dead


class ParameterServerTrainer:
    """Trains ``params`` to minimise ``loss_fn(params, *batch)`` with servers and workers.

    Options default to :func:`jaxpar.ps.set_ps_context`'s; ``actor_options`` go to Ray's
    ``.options()`` of every actor (``num_cpus``, ``resources``, ``runtime_env``, ...).

    >>> import numpy as np, optax, jax.numpy as jnp
    >>> from jaxpar import ps
    >>> def loss(p, x, y):
    ...     return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
    >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    >>> y = x @ np.array([1.0, -2.0, 0.5], np.float32) + 3
    >>> params = {"w": np.zeros(3, np.float32), "b": np.zeros((), np.float32)}
    >>> with ps.ParameterServerTrainer(loss, params, optax.sgd(0.1), server_num=2,
    ...                                worker_num=2) as trainer:  # doctest: +SKIP
    ...     history = trainer.train([(x, y)] * 50)
    ...     trainer.params["b"]
    array(2.99..., dtype=float32)
    """

    def __init__(self, loss_fn: Callable[..., Any], params: Any, optimizer: Any, *,
                 server_num: int | None = None, worker_num: int | None = None,
                 mode: str | None = None, max_staleness: int | None = None,
                 checkpoint_every: int | None = None, checkpoint_dir: str | None = None,
                 on_worker_failure: str | None = None, max_worker_restarts: int | None = None,
                 actor_options: dict[str, Any] | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise PSError("parameter-server mode runs on Ray: pip install 'jaxpar[ps]'.") \
                from None
        self.config = ps_config(
            server_num=server_num, worker_num=worker_num, mode=mode,
            max_staleness=max_staleness, checkpoint_every=checkpoint_every,
            checkpoint_dir=checkpoint_dir, on_worker_failure=on_worker_failure,
            max_worker_restarts=max_worker_restarts)
        leaves, self._treedef = jax.tree.flatten(params)
        arrays = [np.asarray(leaf) for leaf in leaves]
        # checked before Ray starts: a configuration that cannot run starts nothing
        self._owner = assign_by_size([a.nbytes for a in arrays], self.config.server_num)
        if not ray.is_initialized():
            ray.init()
        self._ray = ray
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        self._actor_options = dict(actor_options or {})
        self._initial = [{i: a for i, a in enumerate(arrays) if self._owner[i] == s}
                         for s in range(self.config.server_num)]
        self._server_cls = ray.remote(ServerCore)
        self._worker_cls = ray.remote(WorkerCore)
        self.servers = [self._new_server(s) for s in range(self.config.server_num)]
        self.workers: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._joining: dict[int, Any] = {}
        self._leaving: set[int] = set()
        self._next_id = 0
        self._restarts: collections.Counter[int] = collections.Counter()
        self._dropped: list[int] = []
        self._server_restores = 0
        self._redone = 0
        self._done_parts: set[int] = set()  # async parts every server has applied
        self._next_part = 0
        self._generation = 0  # server replacements so far
        self.history: list[StepInfo] = []
        for _ in range(self.config.worker_num):
            self.add_worker()
        self._apply_membership(busy=set())

    # -- actors ------------------------------------------------------------------------------
    def _options(self, role: str) -> dict[str, Any]:
        options = dict(self._actor_options)
        runtime_env = dict(options.pop("runtime_env", None) or {})
        env = {ROLE_ENV: role, "XLA_FLAGS": without_device_count(os.environ.get("XLA_FLAGS",
                                                                                  ""))}
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), **env}
        options["runtime_env"] = runtime_env
        return options

    def _new_server(self, index: int, restore: bool = False) -> Any:
        c = self.config
        return self._server_cls.options(**self._options("MS_PSERVER")).remote(
            index, self._initial[index], self._optimizer, max_staleness=c.max_staleness,
            checkpoint_every=c.checkpoint_every, checkpoint_dir=c.checkpoint_dir,
            restore=restore)

    def _new_worker(self, worker_id: int) -> Any:
        return self._worker_cls.options(**self._options("MS_WORKER")).remote(
            worker_id, self._loss_fn, self._treedef, self._owner)

    def _dead(self, actors: Sequence[Any]) -> list[int]:
        """Indices of the actors that do not answer a ping within ``PING_S`` (all pinged at
        once)."""
        refs = [actor.ping.remote() for actor in actors]
        answered, _ = self._ray.wait(refs, num_returns=len(refs), timeout=PING_S)
        dead = []
        for i, ref in enumerate(refs):
            try:
                if ref not in answered:
                    raise TimeoutError
                self._ray.get(ref)
            except (self._ray.exceptions.RayError, TimeoutError):
                dead.append(i)
        return dead

    def _alive(self, actor: Any) -> bool:
        return not self._dead([actor])

    def _dead_servers(self) -> list[int]:
        return self._dead(self.servers)

    # -- membership --------------------------------------------------------------------------
    def add_worker(self) -> int:
        """Starts a worker; it joins at the next step.  Returns its id."""
        with self._lock:
            worker_id = self._next_id
            self._next_id += 1
            self._joining[worker_id] = self._new_worker(worker_id)
        return worker_id

    def remove_worker(self, worker_id: int) -> None:
        """Stops a worker after its current task; the next step runs without it."""
        with self._lock:
            if worker_id not in self.workers and worker_id not in self._joining:
                raise PSError(f"remove_worker: no worker {worker_id}; the workers are "
                              f"{sorted({*self.workers, *self._joining})}.")
            self._leaving.add(worker_id)

    def _apply_membership(self, busy: set[int]) -> None:
        with self._lock:
            self.workers.update(self._joining)
            self._joining.clear()
            for worker_id in sorted(self._leaving - busy):
                self._leaving.discard(worker_id)
                actor = self.workers.pop(worker_id, None)
                if actor is not None:
                    self._ray.kill(actor)
        if not self.workers:
            raise PSError("ParameterServerTrainer: no workers left; add_worker() first.")

    def _replace(self, worker_id: int, actor: Any, error: Exception) -> int:
        """The worker that takes over from a failed task of ``actor`` (worker ``worker_id``):
        the worker restarted, or another one."""
        if self.workers.get(worker_id) is not actor:  # already replaced or dropped
            if not self.workers:
                raise PSError("ParameterServerTrainer: no worker is left.") from error
            return worker_id if worker_id in self.workers else min(self.workers)
        if self._alive(actor):
            raise error  # the worker is fine: the task itself failed (the loss, the data)
        if self.config.on_worker_failure == "restart" and \
                self._restarts[worker_id] < self.config.max_worker_restarts:
            self._restarts[worker_id] += 1
            self.workers[worker_id] = self._new_worker(worker_id)
            return worker_id
        del self.workers[worker_id]
        with self._lock:
            self._leaving.discard(worker_id)
        self._dropped.append(worker_id)
        if not self.workers:
            raise PSError(f"ParameterServerTrainer: worker {worker_id} died and no worker is "
                          f"left.") from error
        return min(self.workers)

    # -- training ----------------------------------------------------------------------------
    def train(self, batches: Sequence[Batch] | Callable[[int], Batch] | WorkerReader,
              steps: int | None = None,
              callbacks: Sequence[Callable[[ParameterServerTrainer, StepInfo], None]] = ()
              ) -> list[StepInfo]:
        """Runs ``steps`` steps (default ``len(batches)``) on global batches: a sequence, a
        function of the step index within this call, or :func:`read_on_workers` (the workers
        read their parts themselves).  Returns the history of this call."""
        if steps is None:
            if callable(batches) or isinstance(batches, WorkerReader):
                raise PSError("train: give steps= when the batches come from a function.")
            steps = len(batches)
        get: Callable[[int], Batch | WorkerReader]
        if isinstance(batches, WorkerReader):
            get = functools.partial(_same, batches)
        else:
            get = batches if callable(batches) else batches.__getitem__
        start = len(self.history)
        if self.config.mode == "sync":
            self._train_sync(get, steps, callbacks)
        else:
            self._train_async(get, steps, callbacks)
        return self.history[start:]

    def _step0(self) -> int:
        return self._ray.get(self.servers[0].stats.remote())["step"]

    def _train_sync(self, get: Callable[[int], Batch | WorkerReader], steps: int,
                    callbacks: Sequence) -> None:
        base = self._step0()
        i = 0
        while i < steps:
            self._apply_membership(busy=set())
            ids = tuple(sorted(self.workers))
            parts = self._split(get(i), i, len(ids))
            try:
                loss = self._sync_step(base + i, ids, parts)
            except _ServersLost as lost:
                back = self._recover(lost.dead, rollback=True)
                if back < base:
                    raise PSError(f"ParameterServerTrainer: servers went back to step {back}, "
                                  f"before this train() call began (step {base}); checkpoint "
                                  f"more often.") from None
                self._redone += base + i - back
                i = back - base
                continue
            info = StepInfo(base + i, loss, ids, sum(size for _, _, size in parts))
            self.history.append(info)
            for callback in callbacks:
                callback(self, info)
            i += 1

    def _split(self, batch: Batch | WorkerReader, i: int, n: int
               ) -> list[tuple[float, Any, int]]:
        """Batch ``i`` cut into ``n`` parts: ``(weight, data or ReadPart, samples)`` each."""
        size = batch.batch_size if isinstance(batch, WorkerReader) else len(batch[0])
        if size < n:
            raise PSError(f"ParameterServerTrainer: a batch of {size} samples cannot be split "
                          f"across {n} workers.")
        out = []
        for p in range(n):
            cut = part_slice(size, p, n)
            rows = cut.stop - cut.start
            data = ReadPart(batch.fn, i, p, n) if isinstance(batch, WorkerReader) else \
                tuple(np.asarray(column)[cut] for column in batch)
            out.append((rows / size, data, rows))
        return out

    def _sync_step(self, step: int, ids: tuple[int, ...], parts: list) -> float:
        def submit(worker_id: int, part: int) -> tuple[Any, tuple[int, int, Any]]:
            weight, data, _ = parts[part]
            actor = self.workers[worker_id]
            ref = actor.sync_step.remote(self.servers, step, part, len(parts), weight, data)
            return ref, (part, worker_id, actor)

        tasks = dict(submit(w, part) for part, w in enumerate(ids))
        losses: dict[int, float] = {}
        while tasks:
            (ref,), _ = self._ray.wait(list(tasks), num_returns=1)
            part, worker_id, actor = tasks.pop(ref)
            try:
                losses[part] = self._ray.get(ref)
            except self._ray.exceptions.RayError as error:
                dead = self._dead_servers()
                if dead:
                    self._ray.wait(list(tasks), num_returns=len(tasks), timeout=DRAIN_S)
                    raise _ServersLost(dead) from error
                ref, task = submit(self._replace(worker_id, actor, error), part)
                tasks[ref] = task
        return float(sum(parts[p][0] * losses[p] for p in losses))

    def _train_async(self, get: Callable[[int], Batch | WorkerReader], steps: int,
                     callbacks: Sequence) -> None:
        queue: collections.deque[tuple[int, float, Any, int]] = collections.deque()
        next_batch = 0
        in_flight: dict[Any, tuple[int, tuple[int, float, Any, int], int, Any]] = {}
        index = len(self.history)
        while True:
            busy = {w for w, _, _, _ in in_flight.values()}
            self._apply_membership(busy)
            for worker_id in sorted(set(self.workers) - busy - self._leaving):
                if not queue and next_batch < steps:
                    for weight, data, size in self._split(get(next_batch), next_batch,
                                                          len(self.workers)):
                        queue.append((self._next_part, weight, data, size))
                        self._next_part += 1
                    next_batch += 1
                if not queue:
                    break
                part = queue.popleft()
                actor = self.workers[worker_id]
                ref = actor.async_step.remote(self.servers, *part[:3])
                in_flight[ref] = (worker_id, part, self._generation, actor)
            if not in_flight:
                return
            (ref,), _ = self._ray.wait(list(in_flight), num_returns=1)
            worker_id, part, generation, actor = in_flight.pop(ref)
            try:
                loss = self._ray.get(ref)
            except self._ray.exceptions.RayError as error:
                queue.appendleft(part)
                if generation != self._generation:
                    continue  # it was given a server that has been replaced since
                dead = self._dead_servers()
                if dead:
                    self._recover(dead, rollback=False)
                else:
                    self._replace(worker_id, actor, error)
                continue
            self._done_parts.add(part[0])
            info = StepInfo(index, loss, (worker_id,), part[3])
            index += 1
            self.history.append(info)
            for callback in callbacks:
                callback(self, info)

    def _recover(self, dead: list[int], rollback: bool) -> int:
        """Restarts dead servers from their last checkpoint; with ``rollback`` every server
        goes back to the newest step all of them have.  Returns the step."""
        if not self.config.checkpoint_every:
            raise PSError(f"ParameterServerTrainer: parameter server(s) {dead} died and "
                          f"nothing was checkpointed; set checkpoint_every and checkpoint_dir "
                          f"to survive that.")
        for i in dead:
            self._ray.kill(self.servers[i])  # it may only be slow: never two writers
            self.servers[i] = self._new_server(i, restore=True)
        self._server_restores += len(dead)
        self._generation += 1
        ray = self._ray
        if not rollback:
            return min(ray.get(self.servers[i].stats.remote())["step"] for i in dead)
        common = set.intersection(*(set(ray.get(s.checkpoints.remote()))
                                    for s in self.servers))
        if not common:
            raise PSError("ParameterServerTrainer: the servers have no checkpoint step in "
                          "common to go back to.")
        back = max(common)
        ray.get([s.restore.remote(back) for s in self.servers])
        return back

    # -- results -----------------------------------------------------------------------------
    @property
    def params(self) -> Any:
        """The current parameters, gathered from the servers (numpy leaves)."""
        leaves: dict[int, np.ndarray] = {}
        for _, shard in self._ray.get([s.pull.remote() for s in self.servers]):
            leaves.update(shard)
        return jax.tree.unflatten(self._treedef, [leaves[i] for i in range(len(self._owner))])

    def report(self) -> PSReport:
        stats = self._ray.get([s.stats.remote() for s in self.servers])
        return PSReport(
            steps=tuple(s["step"] for s in stats), applied=tuple(s["applied"] for s in stats),
            duplicates_ignored=sum(s["duplicates"] for s in stats),
            stale_rejections=sum(s["rejected"] for s in stats),
            worker_restarts=sum(self._restarts.values()), workers_dropped=tuple(self._dropped),
            server_restores=self._server_restores, redone_steps=self._redone,
            lost_updates=sum(len(self._done_parts - set(parts)) for parts in
                             self._ray.get([s.applied_parts.remote() for s in self.servers])))

    def shutdown(self) -> None:
        """Stops every actor (Ray itself stays up)."""
        for actor in [*self.servers, *self.workers.values(), *self._joining.values()]:
            self._ray.kill(actor)
        self.workers.clear()
        self._joining.clear()

    def __enter__(self) -> ParameterServerTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _same(value: WorkerReader, step: int) -> WorkerReader:
    """Every step's batch when the workers read their own: the one reader."""
    return value
