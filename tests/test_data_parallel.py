"""data_parallel mode on a Flax (NNX) train step with optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
from tests.util import assert_tree_close


class Classifier(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _setup():
    model = Classifier(nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    k1, k2 = jax.random.split(jax.random.key(0))
    x = jax.random.normal(k1, (32, 16))
    y = jax.random.randint(k2, (32,), 0, 4)
    return train_step, params, opt_state, x, y


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((8,), ("dp",))


def test_data_parallel_flax_train_step(mesh):
    train_step, params, opt_state, x, y = _setup()
    step = jaxpar.parallelize(train_step, mesh=mesh, parallel_mode="data_parallel")
    plan = step.plan(params, opt_state, x, y)
    layouts = plan.input_layouts()
    assert layouts["x"] == P("dp") and layouts["y"] == P("dp")  # batch inferred and split
    assert all(spec == P() for name, spec in layouts.items() if name.startswith("params"))
    colls = jaxpar.inspect.collectives(step.lower(params, opt_state, x, y))
    grads = [c for c in colls.of("all-reduce") if c.group_size == 8]
    # every gradient is all-reduced over dp (XLA may reduce a kernel's gradient transposed)
    param_sizes = sorted(v.size for v in jax.tree.leaves(params))
    reduced = sorted(int(np.prod([int(d) for d in s[4:-1].split(",") if d]))
                     for c in grads for s in c.shapes if s != "f32[]")
    assert param_sizes == reduced, colls.table()
    assert colls.count("all-gather") == 0

    want_p, want_o = params, opt_state
    got_p, got_o = params, opt_state
    single = jax.jit(train_step)
    for _ in range(3):
        want_p, want_o, want_loss = single(want_p, want_o, x, y)
        got_p, got_o, got_loss = step(got_p, got_o, x, y)
        np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_tree_close(got_p, want_p, rtol=1e-4, atol=1e-6)
    assert all(v.sharding.spec == P() for v in jax.tree.leaves(got_p))


def test_gradients_mean_default_is_single_device_and_false_is_refused(mesh):
    def grads(w, x):
        return jax.grad(lambda w: jnp.mean((x @ w) ** 2))(w)

    w = jax.random.normal(jax.random.key(1), (16, 4))
    x = jax.random.normal(jax.random.key(2), (32, 16))
    mean = jaxpar.parallelize(grads, mesh=mesh, parallel_mode="data_parallel", batch_argnums=1)
    assert_tree_close(mean(w, x), grads(w, x), rtol=1e-5, atol=1e-6)
    with jaxpar.auto_parallel_context(gradients_mean=False):
        summed = jaxpar.parallelize(grads, mesh=mesh, parallel_mode="data_parallel",
                                    batch_argnums=1)
        with pytest.raises(jaxpar.ContextError, match="Scale the loss"):
            summed(w, x)


def test_batch_inference_asks_for_batch_argnums_when_it_cannot_tell(mesh):
    f = jaxpar.parallelize(lambda w, x: jnp.sum(x @ w), mesh=mesh, parallel_mode="data_parallel")
    with pytest.raises(jaxpar.PlanError, match="batch_argnums"):
        f(jnp.ones((16, 4)), jnp.ones((32, 16)))


def test_batch_inference_does_not_take_weights_for_the_batch(mesh):
    # mlp's result has x's shape, so x looks like threaded state and w1, w2 like the batch; their
    # leading sizes differ, so they cannot be one: ask rather than split the weights' rows
    f = jaxpar.parallelize(lambda x, w1, w2: jnp.maximum(x @ w1, 0) @ w2, mesh=mesh,
                           parallel_mode="data_parallel")
    with pytest.raises(jaxpar.PlanError, match=r"leading sizes 32, 64.*batch_argnums=\(0,\)"):
        f(jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))


def test_batch_must_divide_over_devices(mesh):
    f = jaxpar.parallelize(lambda w, x: jnp.sum(x @ w), mesh=mesh, parallel_mode="data_parallel",
                           batch_argnums=1)
    with pytest.raises(jaxpar.StrategyError, match="not divisible by 8"):
        f(jnp.ones((16, 4)), jnp.ones((12, 16)))
