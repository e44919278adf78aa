"""jaxpar.Model: train / eval / predict in every parallel mode, callbacks, checkpoints,
mixed precision, and graph against PyNative execution."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from sklearn.datasets import load_digits

import jaxpar
from jaxpar import dataset as ds
from tests.util import assert_tree_close


def dense_params(sizes=(64, 32, 10), seed=0):
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def dense_apply(params, x):
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return x


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def digits(n=512):
    d = load_digits()
    x = (d.data[:n] / 16.0).astype(np.float32)
    y = d.target[:n].astype(np.int32)
    return x, y


def digits_dataset(batch=64, n=512):
    x, y = digits(n)
    return ds.NumpySlicesDataset((x, y), ["image", "label"]).batch(batch, drop_remainder=True)


def train_losses(mode, epochs=2, n=512, **context):
    model = jaxpar.Model((dense_params(), dense_apply), cross_entropy, optax.sgd(0.5),
                         metrics={"accuracy": jaxpar.metrics.Accuracy()})
    with jaxpar.auto_parallel_context(parallel_mode=mode, **context):
        model.train(epochs, digits_dataset(n=n))
    return model


def test_model_train_data_parallel_equals_single_device():
    """The seeds' example through Model.train: 8 replicas with a DistributedGradReducer equal
    one device on the same global batches."""
    single = train_losses("stand_alone")
    parallel = train_losses("data_parallel")
    assert len(parallel.history) == 16
    np.testing.assert_allclose(parallel.history, single.history, rtol=1e-5, atol=1e-6)
    assert_tree_close(parallel.params, single.params, rtol=1e-4, atol=1e-5)
    assert parallel.history[-1] < parallel.history[0]
    x, y = digits(64)
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel"):
        colls = jaxpar.inspect.collectives(parallel.lower(x, y).compile())
        assert colls.count("all-reduce") == 1 and colls[0].group_size == 8
        result = parallel.eval(digits_dataset())
    assert result["accuracy"] > 0.6 and set(result) == {"accuracy", "loss"}


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_model_train_through_parallelize(mode):
    single = train_losses("stand_alone", epochs=1)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    if mode == "semi_auto_parallel":
        context = dict(mesh=mesh, dataset_strategy=((2, 1), (2,)))
    else:
        context = dict(mesh=mesh)
    model = train_losses(mode, epochs=1, **context)
    np.testing.assert_allclose(model.history, single.history, rtol=1e-4, atol=1e-5)


def test_nnx_module_is_trained_in_place():
    module = nnx.Sequential(nnx.Linear(64, 32, rngs=nnx.Rngs(0)), nnx.relu,
                            nnx.Linear(32, 10, rngs=nnx.Rngs(1)))
    before = np.asarray(module.layers[0].kernel[...]).copy()
    model = jaxpar.Model(module, cross_entropy, optax.adam(1e-2), metrics={"accuracy"})
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel"):
        model.train(3, digits_dataset())
        acc = model.eval(digits_dataset())["accuracy"]
        logits = model.predict(digits(16)[0])
    assert not np.allclose(before, module.layers[0].kernel[...])
    assert acc > 0.8
    assert logits.shape == (16, 10)
    np.testing.assert_allclose(np.asarray(module(jnp.asarray(digits(16)[0]))),
                               np.asarray(logits), rtol=1e-5, atol=1e-5)


def test_callbacks_print_on_rank_zero_and_checkpoints_round_trip(tmp_path, capsys):
    model = jaxpar.Model((dense_params(), dense_apply), cross_entropy, optax.sgd(0.5))
    losses = jaxpar.LossMonitor(per_print_times=4)
    timer = jaxpar.TimeMonitor()
    ckpt = jaxpar.ModelCheckpoint("digits", tmp_path,
                                  jaxpar.CheckpointConfig(save_checkpoint_steps=4,
                                                          keep_checkpoint_max=2))
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel"):
        model.train(2, digits_dataset(), callbacks=[losses, timer, ckpt])
    out = capsys.readouterr().out
    assert out.count("loss is") == 4  # steps 4, 8, 12, 16
    assert "epoch: 2 step: 8, loss is" in out and out.count("epoch time:") == 2
    assert losses.losses == model.history
    assert ckpt.saved_steps == [4, 8, 12, 16]
    restored = jaxpar.load_checkpoint(tmp_path / "digits")
    assert_tree_close(restored["params"], model.params)
    older = jaxpar.load_checkpoint(tmp_path / "digits", step=12)
    assert not np.allclose(older["params"][0]["w"], model.params[0]["w"])


def test_a_callback_can_stop_training():
    class StopAfter(jaxpar.Callback):
        def step_end(self, run_context):  # MindSpore 1.x hook name
            if run_context.original_args().cur_step_num == 3:
                run_context.request_stop()

    model = jaxpar.Model((dense_params(), dense_apply), cross_entropy, optax.sgd(0.5))
    model.train(5, digits_dataset(), callbacks=[StopAfter()])
    assert len(model.history) == 3


def test_a_nan_loss_stops_training_with_a_message():
    model = jaxpar.Model((dense_params(), dense_apply), lambda o, y: jnp.nan * jnp.sum(o),
                         optax.sgd(0.5))
    with pytest.raises(ValueError, match="Invalid loss"):
        model.train(1, digits_dataset(), callbacks=[jaxpar.LossMonitor()])


def test_mixed_precision_and_loss_scaling_through_model():
    manager = jaxpar.DynamicLossScaleManager(init_loss_scale=2.0**8, scale_window=4)
    model = jaxpar.Model((dense_params(), dense_apply), cross_entropy, optax.adam(1e-2),
                         metrics={"accuracy"}, amp_level="O2", loss_scale_manager=manager)
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel"):
        model.train(4, digits_dataset())
        text = model.lower(*digits(64)).as_text()
        acc = model.eval(digits_dataset())["accuracy"]
    assert "bf16" in text
    assert model.history[-1] < model.history[0] and acc > 0.85
    assert float(model._ls_state.scale) == 2.0**8 * 2 ** (32 // 4)  # no overflow: 8 rises
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(model.params))


@pytest.mark.parametrize("mode", ["stand_alone", "data_parallel", "semi_auto_parallel"])
def test_pynative_gives_the_graph_mode_losses(mode):
    context = {"mesh": jaxpar.make_mesh((8,), ("dp",)),
               "dataset_strategy": ((8, 1), (8,))} if mode == "semi_auto_parallel" else {}
    # 2 steps: the first loss, then one that starts from the parameters the eager step
    # updated (an eager data-parallel step compiles each of its ~140 operators inside the
    # eager shard_map anew, every step: 10 CPU s a step; the graph-mode losses of all 16 steps
    # are checked against one device in the first test)
    graph = train_losses(mode, epochs=1, n=128, **context)
    jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE)
    eager = train_losses(mode, epochs=1, n=128, **context)
    assert len(eager.history) == 2
    np.testing.assert_allclose(eager.history, graph.history, rtol=1e-5, atol=1e-6)


def test_pynative_runs_the_python_body_on_concrete_sharded_arrays():
    seen = []

    def step(w, x):
        seen.append(type(x).__name__)  # a breakpoint here sees real arrays in PyNative
        return w - 0.1 * jnp.mean(x) * w, jnp.sum(x)

    mesh = jaxpar.make_mesh((8,), ("dp",))
    f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel", batch_argnums=(1,))
    x = jnp.arange(16.0).reshape(16, 1)
    want = f(jnp.ones(3), x)
    jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE)
    seen.clear()
    got = f(jnp.ones(3), x)
    assert seen == ["ArrayImpl"]
    assert_tree_close(got, want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(metrics={"top5"}), "unknown metrics"),
    (dict(metrics={"a": 1}), "not jaxpar.metrics.Metric"),
    (dict(amp_level="O5"), "amp_level"),
])
def test_model_rejects_bad_arguments(kwargs, match):
    with pytest.raises(jaxpar.ContextError, match=match):
        jaxpar.Model((dense_params(), dense_apply), cross_entropy, optax.sgd(0.1), **kwargs)


def test_set_context_rejects_unknown_options():
    with pytest.raises(jaxpar.ContextError, match="mode must be"):
        jaxpar.set_context(mode=3)
    with pytest.raises(jaxpar.ContextError, match="unknown option"):
        jaxpar.set_context(device_target="Ascend")
