"""A parameter-server worker: pull the parameters, compute the gradient of its part of the
batch with JAX, push each server its shard of the gradient.

Plain Python; the trainer runs it as a Ray actor and hands it the server actors with every
task (a restarted server is a new actor).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxpar._src.ps.reader import resolve

STALE_RETRIES = 20


class WorkerCore:
    def __init__(self, worker_id: int, loss_fn: Callable[..., Any], treedef: Any,
                 owner: Sequence[int]) -> None:
        import jax

        self.worker_id = worker_id
        self.treedef = treedef
        self.owner = tuple(owner)  # server of each parameter leaf
        self._grad = jax.jit(jax.value_and_grad(loss_fn))
        self._fault: tuple[int, int] | None = None
        self.retries = 0

    def _pull(self, servers: Sequence[Any], at_step: int | None) -> tuple[list[int], Any]:
        import jax
        import ray

        replies = ray.get([s.pull.remote(at_step) for s in servers])
        leaves: dict[int, np.ndarray] = {}
        for _, shard in replies:
            leaves.update(shard)
        params = jax.tree.unflatten(self.treedef, [leaves[i] for i in range(len(self.owner))])
        return [version for version, _ in replies], params

    def _grads(self, params: Any, batch: Sequence[np.ndarray]) -> tuple[float, list[dict]]:
        import jax

        loss, grads = self._grad(params, *batch)
        shards: list[dict[int, np.ndarray]] = [{} for _ in range(max(self.owner) + 1)]
        for i, g in enumerate(jax.tree.leaves(grads)):
            shards[self.owner[i]][i] = np.asarray(g)
        return float(loss), shards

    def sync_step(self, servers: Sequence[Any], step: int, part: int, n_parts: int,
                  weight: float, batch: Sequence[np.ndarray]) -> float:
        """One part of synchronous step ``step``; returns its loss."""
        import ray

        batch = resolve(batch)
        _, params = self._pull(servers, step)
        loss, shards = self._grads(params, batch)
        for i, server in enumerate(servers):
            ray.get(server.push_sync.remote(step, part, n_parts, weight, shards[i]))
            if self._fault == (step, i + 1):
                os._exit(1)  # the injected crash: some servers have the part, some not
        return loss

    def async_step(self, servers: Sequence[Any], part: int, weight: float,
                   batch: Sequence[np.ndarray]) -> float:
        """Pull, compute, push as soon as done; servers that refuse a stale gradient get one
        computed on fresher parameters."""
        import ray

        batch = resolve(batch)
        todo = list(range(len(servers)))
        for _ in range(STALE_RETRIES):
            versions, params = self._pull(servers, None)
            loss, shards = self._grads(params, batch)
            accepted = ray.get([servers[i].push_async.remote(part, versions[i], weight,
                                                                shards[i])
                                for i in todo])
            todo = [i for i, ok in zip(todo, accepted, strict=True) if not ok]
            if not todo:
                return loss
            self.retries += 1
        raise RuntimeError(f"worker {self.worker_id}: servers {todo} refused "
                           f"{STALE_RETRIES} gradients in a row as too stale; raise "
                           f"max_staleness.")

    def inject_fault(self, step: int, after_pushes: int) -> None:
        """For fault-tolerance tests: exit the process in ``sync_step(step)`` right after its
        ``after_pushes``-th push (so some servers have this worker's part and some do not)."""
        self._fault = (step, after_pushes)

    def ping(self) -> int:
        return self.worker_id
