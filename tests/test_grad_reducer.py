"""DistributedGradReducer, per_replica and communication fusion: numbers and collectives."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests.util import assert_tree_close


def dense_classifier(key, sizes=(16, 32, 4)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)]


def loss_fn(params, x, y):
    h = x
    for i, layer in enumerate(params):
        h = h @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            h = jax.nn.relu(h)
    logp = jax.nn.log_softmax(h)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def sgd(params, grads, lr=0.5):
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


def data(n=64, d=16, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=n).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def reduced_step(reducer):
    @jaxpar.per_replica
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return sgd(params, reducer(grads)), loss
    return step


def single_device_trajectory(params, batches, steps, lr=0.5):
    @jax.jit
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return sgd(params, grads, lr), loss
    losses = []
    for _ in range(steps):
        for x, y in batches:
            params, loss = step(params, x, y)
            losses.append(float(loss))
    return params, losses


def test_seed_example_matches_single_device_training():
    """The seeds' data-parallel example: SGD through DistributedGradReducer on 8 replicas equals
    single-device training on the same global batches, step by step."""
    params = dense_classifier(jax.random.key(0))
    batches = [data(64, seed=s) for s in range(3)]
    step = reduced_step(jaxpar.DistributedGradReducer(params, mean=True))
    p, losses = params, []
    for _ in range(4):
        for x, y in batches:
            p, loss = step(p, x, y)
            assert loss.shape == (8,)  # one loss per replica
            losses.append(float(jnp.mean(loss)))
    want_params, want_losses = single_device_trajectory(params, batches, 4)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
    assert_tree_close(p, want_params, rtol=1e-4, atol=1e-5)
    assert losses[-1] < losses[0]
    colls = jaxpar.inspect.collectives(step.lower(params, *batches[0]).compile())
    assert colls.count() == colls.count("all-reduce") == 1  # every gradient, one 64 MB bucket
    assert colls[0].group_size == 8


def test_sum_of_gradients_when_gradients_mean_is_false():
    params = dense_classifier(jax.random.key(1))
    x, y = data(64)
    jaxpar.set_auto_parallel_context(gradients_mean=False)
    reducer = jaxpar.DistributedGradReducer(params)  # mean=None: the context decides
    assert reducer.mean is False
    step = reduced_step(reducer)
    got, _ = step(params, x, y)
    grads = jax.grad(loss_fn)(params, x, y)
    assert_tree_close(got, sgd(params, jax.tree.map(lambda g: 8 * g, grads)), rtol=1e-4,
                      atol=1e-5)


def many_tensors(layers=20, width=8):
    keys = jax.random.split(jax.random.key(2), layers)
    return [{"w": jax.random.normal(k, (width, width)) * 0.3, "b": jnp.zeros(width)}
            for k in keys]


def chain_loss(params, x):
    h = x
    for layer in params:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    return jnp.mean(h ** 2)


@pytest.mark.parametrize("fusion, expected", [
    (None, 1),  # auto: 64 MB buckets
    ({"mode": "index", "config": [20, 35]}, 3),
    ([10], 2),
    ({"mode": "size", "config": 1440 / 2**20}, 4),  # 1440 B: five (w, b) pairs of 288 B
    ({"mode": "auto"}, 1),
])
def test_fusion_decides_the_number_of_all_reduces(fusion, expected):
    params = many_tensors()  # 40 gradient tensors
    x = jax.random.normal(jax.random.key(3), (16, 8))
    reducer = jaxpar.DistributedGradReducer(params, fusion=fusion)

    @jaxpar.per_replica(batch_argnums=(1,))
    def step(params, x):
        return sgd(params, reducer(jax.grad(chain_loss)(params, x)), 0.1)

    colls = jaxpar.inspect.collectives(step.lower(params, x).compile())
    assert colls.count() == colls.count("all-reduce") == expected
    want = sgd(params, jax.grad(chain_loss)(params, x), 0.1)
    assert_tree_close(step(params, x), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("context, expected", [
    (dict(all_reduce_fusion_config=[20, 35]), 3),
    (dict(comm_fusion={"allreduce": {"mode": "index", "config": [5, 10, 30]}}), 4),
    (dict(comm_fusion={"allreduce": {"mode": "size", "config": 64}}), 1),
    (dict(comm_fusion={"openstate": False}), 40),  # fusion off: one all-reduce per gradient
])
def test_fusion_from_the_context(context, expected):
    params = many_tensors()
    x = jax.random.normal(jax.random.key(3), (16, 8))
    reducer = jaxpar.DistributedGradReducer(params)

    @jaxpar.per_replica(batch_argnums=(1,))
    def step(params, x):
        return sgd(params, reducer(jax.grad(chain_loss)(params, x)), 0.1)

    with jaxpar.auto_parallel_context(**context):
        colls = jaxpar.inspect.collectives(step.lower(params, x).compile())
    assert colls.count() == colls.count("all-reduce") == expected


def test_global_view_gradients_are_already_the_mean():
    params = dense_classifier(jax.random.key(4))
    x, y = data(64)
    grads = jax.grad(loss_fn)(params, x, y)
    mesh = jaxpar.make_mesh((8,), ("dp",))
    step = jaxpar.parallelize(
        lambda p, x, y: jaxpar.DistributedGradReducer(p, mean=True)(jax.grad(loss_fn)(p, x, y)),
        mesh=mesh, parallel_mode="data_parallel", batch_argnums=(1, 2))
    assert_tree_close(step(params, x, y), grads, rtol=1e-4, atol=1e-6)
    summed = jax.jit(lambda g: jaxpar.DistributedGradReducer(mean=False, degree=8)(g))(grads)
    assert_tree_close(summed, jax.tree.map(lambda g: 8 * g, grads))


@pytest.mark.parametrize("check_vma", [True, False])
def test_reducer_inside_your_own_shard_map(check_vma):
    mesh = jaxpar.make_mesh((8,), ("d",))
    params = dense_classifier(jax.random.key(5))
    x, y = data(64)
    reducer = jaxpar.DistributedGradReducer(params, mean=True)

    def body(p, x, y):
        return reducer(jax.grad(loss_fn)(p, x, y))

    got = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                                out_specs=P(), check_vma=check_vma))(params, x, y)
    assert_tree_close(got, jax.grad(loss_fn)(params, x, y), rtol=1e-4, atol=1e-6)


def test_a_step_that_never_reduces_is_warned_about():
    params = dense_classifier(jax.random.key(6))
    x, y = data(64)

    @jaxpar.per_replica
    def step(params, x, y):
        return sgd(params, jax.grad(loss_fn)(params, x, y)), loss_fn(params, x, y)

    with pytest.warns(jaxpar.JaxparWarning, match="never called a DistributedGradReducer"):
        step(params, x, y)


def test_reducer_checks_the_gradient_structure():
    reducer = jaxpar.DistributedGradReducer({"w": jnp.ones(2)})
    with pytest.raises(jaxpar.ContextError, match="structure"):
        reducer({"v": jnp.ones(2), "w": jnp.ones(2)})


def test_per_replica_batch_must_divide():
    @jaxpar.per_replica(batch_argnums=(0,))
    def f(x):
        return jnp.sum(x)

    with pytest.raises(jaxpar.StrategyError, match="not divisible by 8"):
        f(jnp.ones((12, 2)))


def test_full_batch_gives_every_replica_the_whole_batch():
    @jaxpar.per_replica(batch_argnums=(0,))
    def rows(x):
        return jnp.asarray(x.shape[0])

    assert rows(jnp.ones((16, 2))).tolist() == [2] * 8
    with jaxpar.auto_parallel_context(full_batch=True):
        assert jaxpar.get_auto_parallel_context("dataset_strategy") == "full_batch"
        assert rows(jnp.ones((16, 2))).tolist() == [16] * 8


def test_seeds_and_parameter_broadcast():
    jaxpar.set_seed(7)
    a = np.random.rand()
    jaxpar.set_seed(7)
    assert np.random.rand() == a
    k1 = jax.random.normal(jaxpar.random_key(), (3,))
    k2 = jax.random.normal(jaxpar.random_key(), (3,))
    np.testing.assert_array_equal(k1, k2)
    params = jaxpar.parameter_broadcast(dense_classifier(jaxpar.random_key()))
    for leaf in jax.tree.leaves(params):
        assert leaf.sharding.is_fully_replicated
        assert len(leaf.sharding.device_set) == 8
    with pytest.raises(jaxpar.ContextError, match="seed"):
        jaxpar.set_seed(-1)


@pytest.mark.parametrize("options, match", [
    (dict(dataset_strategy="split"), "dataset_strategy"),
    (dict(all_reduce_fusion_config=[35, 20]), "strictly increasing"),
    (dict(comm_fusion={"allreduce": {"mode": "index"}}), "strictly increasing"),
    (dict(comm_fusion={"allgather": {"mode": "index", "config": [2]}}), "mode must be one of"),
    (dict(comm_fusion={"allreduce": {"mode": "size", "config": -1}}), "size in MB"),
    (dict(comm_fusion={"bcast": {}}), "unknown keys"),
    (dict(full_batch="yes"), "full_batch"),
])
def test_context_rejects_bad_training_options(options, match):
    with pytest.raises(jaxpar.ContextError, match=match):
        jaxpar.set_auto_parallel_context(**options)


def test_no_warning_when_the_reducer_is_used():
    params = dense_classifier(jax.random.key(8))
    x, y = data(64)
    step = reduced_step(jaxpar.DistributedGradReducer(params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(params, x, y)
