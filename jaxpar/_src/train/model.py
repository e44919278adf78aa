"""``Model``: MindSpore's high-level ``train`` / ``eval`` / ``predict`` on jaxpar's modes.

The parallel mode comes from the auto-parallel context:

* ``stand_alone``: the step is ``jax.jit``-compiled on one device;
* ``data_parallel``: the step runs per replica (:func:`jaxpar.per_replica`) and a
  :class:`~jaxpar.DistributedGradReducer` averages the gradients in the buckets the
  communication-fusion configuration chooses; with ``enable_parallel_optimizer`` (ZeRO) the
  whole step goes through :func:`jaxpar.parallelize` instead, its state split over the devices;
* ``semi_auto_parallel`` / ``auto_parallel``: the whole train step goes through
  :func:`jaxpar.parallelize` (``jaxpar.shard`` annotations inside the network are honoured,
  the rest propagated or searched).

Batches come from a ``jaxpar.dataset`` (laid out by ``dataset_strategy``) or any iterable of
tuples; every column but the last is a network input, the last is the label.  ``amp_level`` and
``loss_scale_manager`` add mixed precision and loss scaling; ``set_context(mode=PYNATIVE_MODE)``
runs the steps eagerly.

>>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpar
>>> params = {"w": jnp.zeros((4, 2))}
>>> model = jaxpar.Model((params, lambda p, x: x @ p["w"]),
...                      loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
...                      optimizer=optax.sgd(0.1), metrics={"mse": jaxpar.metrics.MSE()})
>>> x, y = np.ones((16, 4), np.float32), np.ones((16, 2), np.float32)
>>> model.train(3, [(x, y)])
>>> round(model.eval([(x, y)])["mse"], 4)
0.0467
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._src.amp.precision import LEVELS, Policy, mixed_precision_fn
from jaxpar._src.context import ParallelMode, current_context
from jaxpar._src.data.dataset import Dataset
from jaxpar._src.data.placement import to_global
from jaxpar._src.errors import ContextError, DatasetError, MeshError, PlanError
from jaxpar._src.execution import pynative
from jaxpar._src.optimizer_parallel import OptimizerParallel, shard_gradients
from jaxpar._src.pipeline.stacked import StackedParams, stack, unstacked
from jaxpar._src.train import metrics as metric_lib
from jaxpar._src.train.callbacks import Callback, CallbackParams, ProgressBar, RunContext
from jaxpar._src.train.network import Network
from jaxpar._src.train.reducer import DistributedGradReducer
from jaxpar._src.train.replicas import per_replica
from jaxpar._src.train.seed import parameter_broadcast

AUTO_PROGRESS_STEPS = 200  # runs at least this long get a progress bar by default
METRIC_NAMES = {"accuracy": metric_lib.Accuracy, "acc": metric_lib.Accuracy,
                "loss": metric_lib.Loss, "mae": metric_lib.MAE, "mse": metric_lib.MSE}


class Model:
    """Trains, evaluates and runs a network.

    Args:
      network: a Flax NNX module, or a ``(params, apply_fn)`` pair with
        ``apply_fn(params, *inputs) -> outputs``.
      loss_fn: ``loss_fn(outputs, labels) -> scalar``.
      optimizer: an optax ``GradientTransformation``.
      metrics: ``{"name": jaxpar.metrics.Metric()}``, or names (``"accuracy"``, ``"loss"``,
        ``"mae"``, ``"mse"``).
      amp_level: ``"O0"`` to ``"O3"`` (see :func:`jaxpar.auto_mixed_precision`).
      amp_dtype: the low-precision dtype.
      loss_scale_manager: a :class:`~jaxpar.FixedLossScaleManager` or
        :class:`~jaxpar.DynamicLossScaleManager`.

    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> model = jaxpar.Model(({"w": jnp.zeros((4, 1))}, lambda p, x: x @ p["w"]),
    ...                      loss_fn=lambda out, y: jnp.mean((out - y) ** 2),
    ...                      optimizer=optax.sgd(0.1), metrics={"mae": jaxpar.metrics.MAE()})
    >>> x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    >>> model.train(2, [(x, y)])
    >>> model.predict(x).shape, round(model.eval([(x, y)])["mae"], 3)
    ((8, 1), 0.04)
    """

    def __init__(self, network: Any, loss_fn: Any = None, optimizer: Any = None,
                 metrics: Any = None, *, amp_level: str = "O0", amp_dtype: Any = jnp.bfloat16,
                 loss_scale_manager: Any = None) -> None:
        if amp_level not in LEVELS:
            raise ContextError(f"jaxpar.Model: amp_level must be one of {list(LEVELS)}, got "
                               f"{amp_level!r}.")
        self.network = network
        self._net = Network.of(network)
        self._apply = mixed_precision_fn(self._net.apply, Policy(amp_level, jnp.dtype(amp_dtype)))
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.metrics = _metrics(metrics)
        self.loss_scale_manager = loss_scale_manager
        self._opt_state = None
        self._ls_state: Any = None
        self._steps: dict[Any, Any] = {}
        self.history: list[float] = []  # every training step's loss

    @property
    def params(self) -> Any:
        """The current (trained) parameters."""
        return self._net.params

    # -- training -----------------------------------------------------------------------------
    def train(self, epoch: int, train_dataset: Iterable, callbacks: Sequence[Callback] = (),
              dataset_sink_mode: bool = False, sink_size: int = -1,
              progress: bool | None = None) -> None:
        """Trains for ``epoch`` passes over ``train_dataset``.

        Args:
          epoch: number of epochs.
          train_dataset: a ``jaxpar.dataset`` dataset or an iterable of batch tuples.
          callbacks: e.g. ``[jaxpar.LossMonitor(10), jaxpar.ModelCheckpoint(...)]``.
          dataset_sink_mode: MindSpore's switch for feeding batches through a device-side queue.
            Accepted so MindSpore scripts run unchanged; the steps are the same either way:
            every step is one compiled program whose batch is placed on the devices by
            ``dataset_strategy``, and XLA's asynchronous dispatch already overlaps the next
            batch's transfer with the running step.
          sink_size: with ``dataset_sink_mode``, the steps per epoch (MindSpore's meaning: the
            data is read on across epochs, from where the last one stopped, starting over at
            its end); ``-1``: one pass over the dataset per epoch.
          progress: a progress bar (rank 0); default: for runs of 200 steps or more.
        """
        if not isinstance(sink_size, int) or sink_size == 0 or sink_size < -1:
            raise ContextError(f"jaxpar.Model.train: sink_size must be -1 or a positive int, "
                               f"got {sink_size!r}.")
        data: Iterable | _SinkEpochs = train_dataset
        if dataset_sink_mode and sink_size > 0:
            data = _SinkEpochs(self._batches, train_dataset, sink_size)
        if self.loss_fn is None or self.optimizer is None:
            raise ContextError("jaxpar.Model.train needs loss_fn and optimizer.")
        if not isinstance(epoch, int) or epoch < 1:
            raise ContextError(f"jaxpar.Model.train: epoch must be a positive int, got {epoch!r}.")
        params, rest = self._net.params, self._net.rest
        if current_context().parameter_broadcast:
            params = parameter_broadcast(params)
        if self._opt_state is None:
            self._opt_state = self.optimizer.init(params)
        if self._ls_state is None and self.loss_scale_manager is not None:
            self._ls_state = self.loss_scale_manager.init()
        state = (params, rest, self._opt_state, self._ls_state or ())
        batch_num = _length(data)
        callbacks = list(callbacks)
        if progress or (progress is None and batch_num and
                        epoch * batch_num >= AUTO_PROGRESS_STEPS):
            callbacks.append(ProgressBar())
        cb = CallbackParams(epoch_num=epoch, batch_num=batch_num or 0, model=self,
                            train_state=state)
        run = RunContext(cb)
        for c in callbacks:
            c.on_train_begin(run)
        try:
            for e in range(1, epoch + 1):
                cb.cur_epoch_num = e
                for c in callbacks:
                    c.on_train_epoch_begin(run)
                batches = data.epoch() if isinstance(data, _SinkEpochs) else self._batches(data)
                for batch in batches:
                    # the user's dataset, whose column names the error shows
                    _check_label(batch, train_dataset, "jaxpar.Model.train")
                    state = self._stacked(state, batch)
                    for c in callbacks:
                        c.on_train_step_begin(run)
                    step = self._train_step(state, batch)
                    state, loss = step(state, *batch)
                    cb.cur_step_num += 1
                    loss = float(np.mean(to_numpy(loss)))
                    cb.net_outputs, cb.train_state = loss, state
                    self.history.append(loss)
                    for c in callbacks:
                        c.on_train_step_end(run)
                    if run.stop_requested:
                        break
                for c in callbacks:
                    c.on_train_epoch_end(run)
                if run.stop_requested:
                    break
            for c in callbacks:
                c.on_train_end(run)
        finally:
            params, rest, self._opt_state, ls = unstacked(state)
            self._ls_state = ls if self.loss_scale_manager is not None else None
            self._net.write_back(params, rest)

    def _train_step(self, state: Any, batch: tuple) -> Any:
        ctx = current_context()
        mode = ctx.parallel_mode
        key = ("train", mode, ctx.search_mode, ctx.mesh, ctx.dataset_strategy, len(batch),
               ctx.pipeline_stages, ctx.pipeline_config, ctx.micro_batches,
               ctx.enable_parallel_optimizer, ctx.parallel_optimizer_config)
        step = self._steps.get(key)
        if step is not None:
            return step
        apply, loss_fn, optimizer = self._apply, self.loss_fn, self.optimizer
        manager = self.loss_scale_manager
        # The parallel optimizer (ZeRO) is layouts of the whole step: data parallel then runs
        # through parallelize, like the other modes, instead of per replica.
        zero = OptimizerParallel.from_context(ctx) if mode is not ParallelMode.STAND_ALONE \
            else None
        reducer = DistributedGradReducer(state[0]) if mode is ParallelMode.DATA_PARALLEL \
            and zero is None else None
        pipe = self._pipeline(len(batch), state[1])

        def train_step(state: Any, *batch: Any) -> Any:
            import optax

            params, rest, opt_state, ls = state
            *inputs, labels = batch

            def loss_of(p: Any) -> Any:
                if pipe is not None:  # the network's only state is its parameters
                    loss, new_rest = pipe(p, rest, *inputs, labels), rest
                else:
                    out, new_rest = apply(p, rest, *inputs)
                    loss = loss_fn(out, labels)
                return (manager.scale(loss, ls) if manager else loss), (loss, new_rest)

            grads, (loss, new_rest) = jax.grad(loss_of, has_aux=True)(params)
            grads = shard_gradients(grads, zero)  # level 2: kept split where they are made
            if reducer is not None:
                grads = reducer(grads)
            if manager is not None:
                grads, finite, ls = manager.apply(grads, ls)
            updates, new_opt = optimizer.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            if manager is not None:
                new_params = manager.select(finite, new_params, params)
                new_opt = manager.select(finite, new_opt, opt_state)
            return (new_params, new_rest, new_opt, ls), loss

        batch_argnums = tuple(range(1, 1 + len(batch)))
        if mode is ParallelMode.STAND_ALONE:
            step = _eager_or_jit(train_step)
        elif mode is ParallelMode.DATA_PARALLEL and zero is None:
            step = per_replica(train_step, batch_argnums=batch_argnums)
        else:
            from jaxpar._src.api import parallelize

            step = parallelize(train_step, parallel_mode=mode, batch_argnums=batch_argnums)
        self._steps[key] = step
        return step

    def lower(self, *batch: Any) -> jax.stages.Lowered:
        """The train step this context would run on ``batch``, lowered (``.compile()`` it and
        read its collectives with ``jaxpar.inspect``)."""
        params, rest = self._net.params, self._net.rest
        opt_state = self._opt_state if self._opt_state is not None else \
            self.optimizer.init(params)
        ls = self._ls_state if self._ls_state is not None else (
            self.loss_scale_manager.init() if self.loss_scale_manager is not None else ())
        placed = self._place(tuple(batch))
        state = self._stacked((params, rest, opt_state, ls), placed)
        return self._train_step(state, placed).lower(state, *placed)

    def _pipeline(self, n_batch: int, rest: Any) -> Any:
        """The loss as a :class:`jaxpar.PipelineCell` when the context pipelines, else
        ``None`` (one cell per context and batch arity, so its stacking is planned once)."""
        ctx = current_context()
        key = ("pipeline", ctx.parallel_mode, ctx.search_mode, ctx.mesh, n_batch,
               ctx.pipeline_stages, ctx.pipeline_config, ctx.micro_batches)
        if key not in self._steps:
            self._steps[key] = _pipeline_loss(self._apply, self.loss_fn, n_batch, rest, ctx)
        return self._steps[key]

    def _stacked(self, state: Any, batch: tuple) -> Any:
        """``state`` with the pipeline's layer weights, and the optimizer state's copies of
        them (Adam's moments), stacked by stage and split over ``"pp"``
        (:meth:`jaxpar.PipelineCell.stack`): each stage then holds and updates its own layers
        and no weight moves over ``"pp"``.  Unchanged when the context does not pipeline, when
        the state is stacked already, or when no layer weight is a parameter leaf as it is."""
        params, rest, opt_state, ls = state
        pipe = self._pipeline(len(batch), rest)
        if pipe is None or isinstance(params, StackedParams):
            return state
        try:
            stacked = pipe.stack(params, rest, *batch, opt_state=opt_state)
        except (PlanError, MeshError):  # nothing to stack (every layer's weights derived in
            return state  # the network), or no mesh outside the step: the step says why
        treedef: Any = jax.tree.structure(params)
        shapes = [np.shape(p) for p in jax.tree.leaves(params)]
        shardings = [a.sharding for a in stacked.stacked]

        def like_params(x: Any) -> bool:  # a copy of the parameters (a moment), not a count
            return bool(treedef == jax.tree.structure(x)) and \
                [np.shape(p) for p in jax.tree.leaves(x)] == shapes

        opt_state = jax.tree.map(
            lambda x: stack(stacked.layout, x, shardings) if like_params(x) else x,
            opt_state, is_leaf=like_params)
        return stacked, rest, opt_state, ls

    # -- evaluation ---------------------------------------------------------------------------
    def eval(self, valid_dataset: Iterable, callbacks: Sequence[Callback] = (),
             dataset_sink_mode: bool = False) -> dict[str, float]:
        """The metrics (and the loss, when there is a ``loss_fn``) over ``valid_dataset``.

        ``callbacks`` and ``dataset_sink_mode`` are MindSpore's arguments, accepted so its
        scripts run; evaluation calls no callbacks and feeds batches as :meth:`train` does."""
        for m in self.metrics.values():
            m.clear()
        loss_metric = metric_lib.Loss() if self.loss_fn is not None else None
        for batch in self._batches(valid_dataset):
            _check_label(batch, valid_dataset, "jaxpar.Model.eval")
            *inputs, labels = batch
            out, loss = self._forward(len(inputs), with_loss=True)(
                self._net.params, self._net.rest, *inputs, labels)
            out, labels_np, loss = to_numpy(out), to_numpy(labels), to_numpy(loss)
            for m in self.metrics.values():
                m.update(out, labels_np, loss)
            if loss_metric is not None:
                loss_metric.update(out, labels_np, loss)
        results = {name: m.eval() for name, m in self.metrics.items()}
        if loss_metric is not None and "loss" not in results:
            results["loss"] = loss_metric.eval()
        return results

    def predict(self, *inputs: Any) -> Any:
        """The network's outputs for ``inputs`` (global arrays or NumPy)."""
        placed = self._place(tuple(inputs))
        return self._forward(len(inputs), with_loss=False)(self._net.params, self._net.rest,
                                                           *placed)

    def _forward(self, n_inputs: int, *, with_loss: bool) -> Any:
        ctx = current_context()
        key = ("forward", with_loss, ctx.parallel_mode, ctx.search_mode, ctx.mesh,
               ctx.dataset_strategy, n_inputs)
        fn = self._steps.get(key)
        if fn is not None:
            return fn
        apply, loss_fn = self._apply, self.loss_fn

        def forward(params: Any, rest: Any, *batch: Any) -> Any:
            if not with_loss:
                return apply(params, rest, *batch)[0]
            *inputs, labels = batch
            out = apply(params, rest, *inputs)[0]
            return out, (loss_fn(out, labels) if loss_fn is not None else jnp.zeros(()))

        mode = ctx.parallel_mode
        batch_argnums = tuple(range(2, 2 + n_inputs + int(with_loss)))
        if mode is ParallelMode.STAND_ALONE:
            fn = _eager_or_jit(forward)
        else:
            from jaxpar._src.api import parallelize

            fn = parallelize(forward, parallel_mode=mode, batch_argnums=batch_argnums)
        self._steps[key] = fn
        return fn

    # -- data ---------------------------------------------------------------------------------
    def _batches(self, data: Iterable) -> Iterable[tuple]:
        if current_context().parallel_mode is ParallelMode.STAND_ALONE:
            for batch in data:
                yield tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
            return
        if isinstance(data, Dataset):
            yield from data.global_batches()
            return
        for batch in data:
            yield self._place(tuple(batch) if isinstance(batch, (tuple, list)) else (batch,))

    def _place(self, batch: tuple) -> tuple:
        if current_context().parallel_mode is ParallelMode.STAND_ALONE:
            return batch
        return tuple(to_global(tuple(np.asarray(b) for b in batch)))


def _check_label(batch: tuple, data: Iterable, where: str) -> None:
    """A batch is the network's inputs then the label; one column would make the data the label
    and call the network with no input, failing inside the user's code."""
    if len(batch) >= 2:
        return
    names = getattr(data, "column_names", None)
    shown = f"column {list(names)}" if names else f"{len(batch)} column"
    raise DatasetError(
        f"{where}: each batch must hold the network's inputs followed by the label column (the "
        f"last column is the label), but this data has {shown}. Add the labels, e.g. "
        f"NumpySlicesDataset((x, y), column_names=['data', 'label']) or batches of (x, y) "
        f"tuples; use Model.predict for inputs alone.")


def _pipeline_loss(apply: Any, loss_fn: Any, n_batch: int, rest: Any, ctx: Any) -> Any:
    """The loss as a :class:`jaxpar.PipelineCell` when the context pipelines
    (``pipeline_stages > 1`` in a semi-automatic or automatic mode), else ``None``."""
    if ctx.pipeline_stages <= 1 or ctx.parallel_mode not in (
            ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
        return None
    if jax.tree.leaves(rest):
        raise ContextError(
            "jaxpar.Model.train: pipeline_stages > 1 pipelines networks whose only state is "
            "their parameters; this one also keeps other state (batch statistics, RNG "
            "counters), which a pipeline would have to thread through every micro-batch.")
    from jaxpar._src.pipeline.cell import PipelineCell

    def network_loss(params: Any, rest: Any, *batch: Any) -> Any:
        *inputs, labels = batch
        return loss_fn(apply(params, rest, *inputs)[0], labels)

    return PipelineCell(network_loss, batch_argnums=tuple(range(2, 2 + n_batch)))


def to_numpy(x: Any) -> np.ndarray:
    """A global array's value on the host, also when it spans other processes' devices."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _eager_or_jit(fn: Any) -> Any:
    jitted = jax.jit(fn)

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        if pynative():
            with jax.disable_jit():
                return fn(*args)
        return jitted(*args)

    run.lower = jitted.lower  # type: ignore[attr-defined]
    return run


def _metrics(metrics: Any) -> dict[str, metric_lib.Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        bad = [k for k, v in metrics.items() if not isinstance(v, metric_lib.Metric)]
        if bad:
            raise ContextError(f"jaxpar.Model: metrics {bad} are not jaxpar.metrics.Metric "
                               f"objects.")
        return dict(metrics)
    names = [metrics] if isinstance(metrics, str) else list(metrics)
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise ContextError(f"jaxpar.Model: unknown metrics {unknown}; known names: "
                           f"{sorted(METRIC_NAMES)}.")
    return {n: METRIC_NAMES[n]() for n in names}


class _SinkEpochs:
    """MindSpore's sink-mode epochs: ``sink_size`` steps each, reading on through the data."""

    def __init__(self, batches: Any, data: Iterable, sink_size: int) -> None:
        self._batches, self._data, self._size = batches, data, sink_size
        self._it: Any = None

    def __len__(self) -> int:
        return self._size

    def epoch(self) -> Iterable[tuple]:
        for _ in range(self._size):
            batch = next(self._it, None) if self._it is not None else None
            if batch is None:
                self._it = iter(self._batches(self._data))
                batch = next(self._it, None)
                if batch is None:
                    raise ContextError("jaxpar.Model.train: the dataset yields no batches.")
            yield batch


def _length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None
