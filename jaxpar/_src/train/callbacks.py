"""Training callbacks (MindSpore's ``Callback`` protocol), printed by rank 0 only.

A callback overrides any of ``on_train_begin``, ``on_train_epoch_begin``,
``on_train_step_begin``, ``on_train_step_end``, ``on_train_epoch_end``, ``on_train_end`` (or
MindSpore 1.x's ``begin``, ``epoch_begin``, ``step_begin``, ``step_end``, ``epoch_end``,
``end``); each receives a :class:`RunContext` whose ``original_args()`` are the run's
:class:`CallbackParams` (epoch and step numbers, the step's loss, ...).

>>> cb = LossMonitor(per_print_times=2)
>>> params = CallbackParams(epoch_num=1, batch_num=4, cur_epoch_num=1, cur_step_num=2,
...                         net_outputs=0.5)
>>> cb.on_train_step_end(RunContext(params))
epoch: 1 step: 2, loss is 0.5
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxpar._src.errors import ContextError


@dataclasses.dataclass
class CallbackParams:
    """What a callback can read about the run (MindSpore's ``cb_params``).

    >>> import jaxpar
    >>> p = jaxpar.CallbackParams(epoch_num=2, batch_num=10)
    >>> p.cur_epoch_num, p.cur_step_num
    (0, 0)
    """

    epoch_num: int  # epochs in this run
    batch_num: int  # steps per epoch
    cur_epoch_num: int = 0  # 1-based
    cur_step_num: int = 0  # 1-based, counted over the whole run
    net_outputs: Any = None  # the step's loss
    train_state: Any = None  # (params, rest, opt_state, loss scale state); stacked by stage
    # when the context pipelines (jaxpar.StackedParams: .unstack() gives the per-layer ones)
    model: Any = None


class RunContext:
    """Handed to every callback; ``request_stop()`` ends training after this step.

    >>> import jaxpar
    >>> run = jaxpar.RunContext(jaxpar.CallbackParams(epoch_num=1, batch_num=4))
    >>> run.request_stop()
    >>> run.stop_requested, run.original_args().batch_num
    (True, 4)
    """

    def __init__(self, params: CallbackParams) -> None:
        self._params = params
        self.stop_requested = False

    def original_args(self) -> CallbackParams:
        return self._params

    def request_stop(self) -> None:
        self.stop_requested = True


def is_rank_zero() -> bool:
    return jax.process_index() == 0


_bars: list[Any] = []  # progress bars on screen: messages go above them


def emit(message: str) -> None:
    """Prints ``message`` on rank 0 (above a progress bar, if one is showing)."""
    if not is_rank_zero():
        return
    if _bars:
        _bars[-1].write(message)
    else:
        print(message, flush=True)


class Callback:
    """Base class; override the hooks you need.

    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> class StopAfter(jaxpar.Callback):
    ...     def on_train_step_end(self, run_context):
    ...         if run_context.original_args().cur_step_num == 2:
    ...             run_context.request_stop()
    >>> model = jaxpar.Model(({"w": jnp.zeros((4, 1))}, lambda p, x: x @ p["w"]),
    ...                      loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
    ...                      optimizer=optax.sgd(0.1))
    >>> model.train(5, [(np.ones((8, 4), np.float32), np.ones((8, 1), np.float32))] * 3,
    ...             callbacks=[StopAfter()])
    >>> len(model.history)
    2
    """

    def on_train_begin(self, run_context: RunContext) -> None:
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self.epoch_begin(run_context)

    def on_train_step_begin(self, run_context: RunContext) -> None:
        self.step_begin(run_context)

    def on_train_step_end(self, run_context: RunContext) -> None:
        self.step_end(run_context)

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        self.epoch_end(run_context)

    def on_train_end(self, run_context: RunContext) -> None:
        self.end(run_context)

    # MindSpore 1.x names
    def begin(self, run_context: RunContext) -> None: ...
    def epoch_begin(self, run_context: RunContext) -> None: ...
    def step_begin(self, run_context: RunContext) -> None: ...
    def step_end(self, run_context: RunContext) -> None: ...
    def epoch_end(self, run_context: RunContext) -> None: ...
    def end(self, run_context: RunContext) -> None: ...


class LossMonitor(Callback):
    """Prints the loss every ``per_print_times`` steps; a NaN or infinite loss stops training
    with an error (MindSpore's behaviour).

    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> model = jaxpar.Model(({"w": jnp.zeros((4, 1))}, lambda p, x: x @ p["w"]),
    ...                      loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
    ...                      optimizer=optax.sgd(0.1))
    >>> model.train(1, [(np.ones((8, 4), np.float32), np.ones((8, 1), np.float32))] * 2,
    ...             callbacks=[jaxpar.LossMonitor(per_print_times=2)])
    epoch: 1 step: 2, loss is 0.04
    """

    def __init__(self, per_print_times: int = 1) -> None:
        if not isinstance(per_print_times, int) or per_print_times < 0:
            raise ContextError(f"LossMonitor: per_print_times must be an int >= 0, got "
                               f"{per_print_times!r}.")
        self.per_print_times = per_print_times
        self.losses: list[float] = []  # every step's loss, for plots

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        loss = float(np.mean(np.asarray(p.net_outputs)))
        self.losses.append(loss)
        step_in_epoch = (p.cur_step_num - 1) % max(p.batch_num, 1) + 1
        if not math.isfinite(loss):
            raise ValueError(f"epoch: {p.cur_epoch_num} step: {step_in_epoch}. Invalid loss "
                             f"{loss}, terminating training.")
        if self.per_print_times and p.cur_step_num % self.per_print_times == 0:
            emit(f"epoch: {p.cur_epoch_num} step: {step_in_epoch}, loss is {loss:.6g}")


class TimeMonitor(Callback):
    """Prints each epoch's wall time and time per step.

    >>> import jaxpar
    >>> jaxpar.TimeMonitor().data_size is None  # steps per epoch: from the dataset
    True
    """

    def __init__(self, data_size: int | None = None) -> None:
        self.data_size = data_size
        self.epoch_seconds: list[float] = []

    def on_train_epoch_begin(self, run_context: RunContext) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_end(self, run_context: RunContext) -> None:
        seconds = time.perf_counter() - self._start
        self.epoch_seconds.append(seconds)
        steps = self.data_size or run_context.original_args().batch_num
        emit(f"epoch time: {seconds * 1e3:.1f} ms, per step time: "
             f"{seconds * 1e3 / max(steps, 1):.3f} ms")


class ProgressBar(Callback):
    """A tqdm progress bar over the run's steps, with the loss; rank 0 only.

    >>> import jaxpar
    >>> bar = jaxpar.ProgressBar(leave=False)  # Model.train(..., callbacks=[bar]), or progress=True
    >>> isinstance(bar, jaxpar.Callback)
    True
    """

    def __init__(self, leave: bool = True) -> None:
        self.leave = leave
        self._bar = None

    def on_train_begin(self, run_context: RunContext) -> None:
        if not is_rank_zero():
            return
        from tqdm.auto import tqdm

        p = run_context.original_args()
        self._bar = tqdm(total=p.epoch_num * p.batch_num, leave=self.leave, file=sys.stderr,
                         desc="train")
        _bars.append(self._bar)

    def on_train_step_end(self, run_context: RunContext) -> None:
        if self._bar is not None:
            p = run_context.original_args()
            self._bar.update(1)
            self._bar.set_postfix(epoch=p.cur_epoch_num,
                                  loss=f"{float(np.mean(np.asarray(p.net_outputs))):.4f}")

    def on_train_end(self, run_context: RunContext) -> None:
        if self._bar is not None:
            self._bar.close()
            _bars.remove(self._bar)
            self._bar = None


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When :class:`ModelCheckpoint` saves: every ``save_checkpoint_steps`` steps (and at the
    end), keeping the newest ``keep_checkpoint_max``.

    >>> import jaxpar
    >>> config = jaxpar.CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=2)
    >>> callback = jaxpar.ModelCheckpoint("digits", "/tmp/ckpt", config=config)
    """

    save_checkpoint_steps: int = 1
    keep_checkpoint_max: int = 5


class ModelCheckpoint(Callback):
    """Saves the training state with orbax under ``directory/prefix/<step>``: every process
    writes the shards its devices hold, and the strategy (each array's layout, shape and
    checksum) goes beside them, as :func:`jaxpar.save_checkpoint` writes it.  Read it back with
    :func:`jaxpar.load_checkpoint` (as saved) or :func:`jaxpar.load_distributed_checkpoint`
    (onto another layout); the state is ``{"params", "rest", "opt_state"}``.

    >>> import tempfile, jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> model = jaxpar.Model(({"w": jnp.zeros((4, 1))}, lambda p, x: x @ p["w"]),
    ...                      loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
    ...                      optimizer=optax.sgd(0.1))
    >>> folder = tempfile.mkdtemp()
    >>> model.train(1, [(np.ones((8, 4), np.float32), np.ones((8, 1), np.float32))],
    ...             callbacks=[jaxpar.ModelCheckpoint("run", folder)])
    >>> sorted(jaxpar.load_checkpoint(f"{folder}/run"))
    ['opt_state', 'params', 'rest']
    """

    def __init__(self, prefix: str = "ckpt", directory: str | os.PathLike | None = None,
                 config: CheckpointConfig | None = None) -> None:
        self.config = config or CheckpointConfig()
        if self.config.save_checkpoint_steps < 1 or self.config.keep_checkpoint_max < 1:
            raise ContextError("ModelCheckpoint: save_checkpoint_steps and keep_checkpoint_max "
                               "must be positive.")
        self.path = os.path.abspath(os.path.join(directory or os.getcwd(), prefix))
        self._manager = None
        self.saved_steps: list[int] = []

    def _open(self) -> Any:
        if self._manager is None:
            import orbax.checkpoint as ocp

            from jaxpar._src.checkpoint import store

            options = ocp.CheckpointManagerOptions(max_to_keep=self.config.keep_checkpoint_max)
            self._manager = ocp.CheckpointManager(self.path, options=options,
                                                  handler_registry=store.registry())
        return self._manager

    def _save(self, p: CallbackParams, force: bool = False) -> None:
        from jaxpar._src.checkpoint import store
        from jaxpar._src.checkpoint.save import strategy_with_sums

        if p.cur_step_num in self.saved_steps:
            return
        from jaxpar._src.pipeline.stacked import unstacked

        params, rest, opt_state, _ = unstacked(p.train_state)  # per layer, as the network
        state = {"params": params, "rest": rest, "opt_state": opt_state}
        strategy = strategy_with_sums(state, where="jaxpar.ModelCheckpoint")
        self._open().save(p.cur_step_num, args=store.save_items(state, strategy, None, None),
                          force=force)
        self.saved_steps.append(p.cur_step_num)

    def on_train_step_end(self, run_context: RunContext) -> None:
        p = run_context.original_args()
        if p.cur_step_num % self.config.save_checkpoint_steps == 0:
            self._save(p)

    def on_train_end(self, run_context: RunContext) -> None:
        self._save(run_context.original_args(), force=True)
        self._open().wait_until_finished()


def load_checkpoint(path: str | os.PathLike, step: int | None = None, target: Any = None) -> Any:
    """The state :class:`ModelCheckpoint` (or :func:`jaxpar.save_checkpoint`) saved at ``step``
    (default: the newest), as saved: a dict with ``params``, ``rest`` and ``opt_state``, each
    array on the layout it was saved with (when those devices exist here, else on one device).
    With ``target`` (a matching pytree of arrays) the arrays come back with its shardings.

    >>> import tempfile, jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> model = jaxpar.Model(({"w": jnp.zeros((4, 1))}, lambda p, x: x @ p["w"]),
    ...                      loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
    ...                      optimizer=optax.sgd(0.1))
    >>> folder = tempfile.mkdtemp()
    >>> model.train(1, [(np.ones((8, 4), np.float32), np.ones((8, 1), np.float32))],
    ...             callbacks=[jaxpar.ModelCheckpoint("run", folder)])
    >>> jaxpar.load_checkpoint(f"{folder}/run")["params"]["w"].shape
    (4, 1)
    """
    import jax.numpy as jnp

    from jaxpar._src.checkpoint import store
    from jaxpar._src.checkpoint.load import load_distributed_checkpoint

    where = "jaxpar.load_checkpoint"
    if target is not None:
        return load_distributed_checkpoint(target, path, step=step)
    saved = store.read(store.locate(path, step, where=where), where=where)
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    strategy, mesh = saved.strategy, None
    if strategy is not None and strategy.mesh.num_devices <= jax.device_count():
        mesh = strategy.device_mesh()
    wants = {}
    for name, (shape, dtype) in saved.arrays.items():
        s: jax.sharding.Sharding = sharding
        if mesh is not None and strategy is not None and name in strategy.arrays:
            s = jax.sharding.NamedSharding(mesh, strategy[name])
        wants[name] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=s)
    return store.restore_tree(saved, wants, where=where)
