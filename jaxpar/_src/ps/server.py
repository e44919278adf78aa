"""A parameter server: one shard of the parameters, its optax state, and the update rule.

The class is plain Python (the trainer runs it as a Ray actor).  Parameters are keyed by their
leaf index in the model's pytree.  Synchronous pushes carry ``(step, part)``: the server adds
each part's gradient, weighted by its share of the global batch, and applies the optimizer
once every part of the step is in; a part it already has is ignored (a restarted worker may
push again), so no gradient is lost or applied twice.  Asynchronous pushes are applied as they
come, unless the parameters they were computed on are more than ``max_staleness`` updates old.
Checkpoints are orbax, every ``checkpoint_every`` optimizer steps.

>>> import numpy as np, optax
>>> s = ServerCore(0, {0: np.ones(2, np.float32)}, optax.sgd(0.5))
>>> s.push_sync(0, part=0, n_parts=2, weight=0.5, grads={0: np.full(2, 2.0, np.float32)})
True
>>> s.pull(0)[1][0]  # waits for the other part
array([1., 1.], dtype=float32)
>>> s.push_sync(0, part=1, n_parts=2, weight=0.5, grads={0: np.zeros(2, np.float32)})
True
>>> s.pull(1)[1][0], s.stats()["applied"]  # 1 - 0.5 * (0.5 * 2 + 0.5 * 0)
(array([0.5, 0.5], dtype=float32), 2)
>>> s.push_sync(0, part=1, n_parts=2, weight=0.5, grads={0: np.zeros(2, np.float32)})
False
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxpar._src.errors import PSError

KEEP_CHECKPOINTS = 3


class ServerCore:
    def __init__(self, index: int, params: dict[int, np.ndarray], optimizer: Any, *,
                 max_staleness: int | None = None, checkpoint_every: int = 0,
                 checkpoint_dir: str | None = None, restore: bool = False) -> None:
        import jax
        import optax

        self.index = index
        self.optimizer = optimizer
        self.max_staleness = max_staleness
        self.checkpoint_every = checkpoint_every
        self.params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        self.opt_state = optimizer.init(self.params)
        self.step = 0  # optimizer updates applied
        self.applied = 0  # worker gradients that went into them
        self.duplicates = 0
        self.rejected = 0
        self._pending: dict[int, dict[int, tuple[float, dict[int, np.ndarray]]]] = {}
        self._parts: set[int] = set()  # asynchronous parts applied
        self._previous: tuple[int, dict[int, Any]] | None = None  # the step before, for pulls

        def update(params, state, grads):
            updates, state = optimizer.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        self._update = jax.jit(update)
        self._manager: Any = None  # an orbax CheckpointManager when checkpointing
        if checkpoint_dir:
            import orbax.checkpoint as ocp

            path = os.path.abspath(os.path.join(checkpoint_dir, f"server_{index}"))
            options = ocp.CheckpointManagerOptions(max_to_keep=KEEP_CHECKPOINTS,
                                                   enable_async_checkpointing=False)
            self._manager = ocp.CheckpointManager(path, options=options)
            if restore:
                latest = self._manager.latest_step()
                if latest is None:
                    raise PSError(f"parameter server {index}: no checkpoint in {path} to "
                                  f"restore from.")
                self.restore(latest)
            elif self._manager.all_steps():
                raise PSError(f"parameter server {index}: {path} already holds checkpoints "
                              f"(steps {sorted(self._manager.all_steps())}) from another run; "
                              f"give checkpoint_dir an empty directory.")
            elif self.checkpoint_every:
                self._save()

    # -- what workers call -------------------------------------------------------------------
    def pull(self, at_step: int | None = None) -> tuple[int, dict[int, np.ndarray]]:
        """``(step, parameters)``; with ``at_step`` the parameters as they were after that many
        updates (the current ones or the step before: a worker redoing a part may pull after
        the step was applied)."""
        params = self.params
        if at_step is not None and at_step != self.step:
            if self._previous is None or self._previous[0] != at_step:
                raise PSError(f"parameter server {self.index}: parameters of step {at_step} "
                              f"asked for at step {self.step}.")
            params = self._previous[1]
        return self.step if at_step is None else at_step, \
            {k: np.asarray(v) for k, v in params.items()}

    def push_sync(self, step: int, part: int, n_parts: int, weight: float,
                  grads: dict[int, np.ndarray]) -> bool:
        """Adds one part of step ``step``; ``False`` if that part was already in."""
        if step < self.step or part in self._pending.get(step, {}):
            self.duplicates += 1
            return False
        if step > self.step:
            raise PSError(f"parameter server {self.index}: a gradient for step {step} arrived "
                          f"at step {self.step}.")
        pending = self._pending.setdefault(step, {})
        pending[part] = (weight, grads)
        if len(pending) == n_parts:
            total: dict[int, np.ndarray] = {}
            for p in sorted(pending):
                w, g = pending[p]
                scaled = {k: np.float32(w) * v for k, v in g.items()}
                total = {k: total[k] + scaled[k] for k in total} if total else scaled
            del self._pending[step]
            self._apply(total, n_parts)
        return True

    def push_async(self, part: int, version: int, weight: float,
                   grads: dict[int, np.ndarray]) -> bool:
        """Applies ``weight`` times part ``part``'s gradient, computed on the parameters of
        update ``version``; ``False`` if they are too old.  A part already applied is
        ignored (it was handed out again after a failure)."""
        if part in self._parts:
            self.duplicates += 1
            return True
        if self.max_staleness is not None and self.step - version > self.max_staleness:
            self.rejected += 1
            return False
        self._parts.add(part)
        self._apply({k: np.float32(weight) * v for k, v in grads.items()}, 1)
        return True

    def applied_parts(self) -> list[int]:
        """The asynchronous parts this server has applied."""
        return sorted(self._parts)

    def _apply(self, grads: dict[int, np.ndarray], count: int) -> None:
        self._previous = (self.step, self.params)
        self.params, self.opt_state = self._update(self.params, self.opt_state, grads)
        self.step += 1
        self.applied += count
        if self.checkpoint_every and self.step % self.checkpoint_every == 0:
            self._save()

    # -- checkpoints -------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"params": {str(k): v for k, v in self.params.items()},
                "opt_state": self.opt_state,
                "counts": np.asarray([self.step, self.applied], np.int64)}

    def _save(self) -> None:
        import orbax.checkpoint as ocp

        self._manager.save(self.step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(self._state()),
            parts=ocp.args.JsonSave(sorted(self._parts))))
        self._manager.wait_until_finished()

    def checkpoints(self) -> list[int]:
        return sorted(self._manager.all_steps()) if self._manager is not None else []

    def restore(self, step: int) -> int:
        """Back to checkpoint ``step``; pending parts and newer checkpoints are dropped (the
        steps after it will be saved again)."""
        import orbax.checkpoint as ocp

        for newer in [s for s in self._manager.all_steps() if s > step]:
            self._manager.delete(newer)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(self._state()), parts=ocp.args.JsonRestore()))
        state = restored["state"]
        self._parts = set(restored["parts"])
        self.params = {int(k): v for k, v in state["params"].items()}
        self.opt_state = state["opt_state"]
        self.step, self.applied = (int(c) for c in state["counts"])
        self._pending.clear()
        self._previous = None
        return self.step

    # -- the trainer's view ------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {"step": self.step, "applied": self.applied, "duplicates": self.duplicates,
                "rejected": self.rejected}

    def ping(self) -> int:
        return self.index
