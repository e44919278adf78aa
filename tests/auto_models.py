"""Models with textbook sharding answers, for the automatic searches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from tests import models


class MLP(nnx.Module):
    def __init__(self, hidden: int, layers: int, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(hidden, hidden, rngs=rngs) for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return x


def flax_mlp_adam(batch: int, hidden: int, layers: int = 6):
    """A Flax MLP trained with Adam: ``(train_step, (params, opt_state, x, y))``."""
    model = MLP(hidden, layers, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.random.normal(jax.random.key(1), (batch, hidden))
    y = jax.random.normal(jax.random.key(2), (batch, hidden))
    return train_step, (params, opt_state, x, y)


def sgd_step(loss):
    def step(params, *data):
        value, grads = jax.value_and_grad(loss)(params, *data)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), value

    return step


def embedding_head_loss(params, ids, labels):
    h = jnp.tanh(params["table"][ids])
    logits = h @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def embedding_head(vocab: int = 16384, d: int = 64, batch: int = 4, seq: int = 16):
    k = jax.random.split(jax.random.key(3), 4)
    params = {"table": jax.random.normal(k[0], (vocab, d)) * 0.02,
              "head": jax.random.normal(k[1], (d, vocab)) * 0.02}
    ids = jax.random.randint(k[2], (batch, seq), 0, vocab)
    labels = jax.random.randint(k[3], (batch, seq), 0, vocab)
    return sgd_step(embedding_head_loss), (params, ids, labels)


def transformer_block(batch=4, seq=16, d=512, heads=8, ff=2048):
    params, x = models.init_block(jax.random.key(0), batch=batch, seq=seq, d=d, heads=heads,
                                  ff=ff)
    return sgd_step(models.block_loss), (params, x)


def convnet(batch=64, hw=32, c=16):
    params, x = models.init_convnet(jax.random.key(0), batch=batch, hw=hw, c=c)
    return sgd_step(models.convnet_loss), (params, x)


def wide_mlp(batch=2048, d=512, h=2048):
    k = jax.random.split(jax.random.key(4), 3)
    params = {"w1": jax.random.normal(k[0], (d, h)) / d ** 0.5,
              "w2": jax.random.normal(k[1], (h, d)) / h ** 0.5}
    x = jax.random.normal(k[2], (batch, d))

    def loss(p, x):
        return jnp.mean(jnp.tanh(jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)

    return sgd_step(loss), (params, x)


def scan_cumprod_loss(params, x):
    """A scan over layers of [batch, seq, d] activations, then a ``cumprod`` along the
    sequence, a head and a ``cond``: on a mesh of three axes every operator has 27 to 125
    candidates and the exact searches' integer programs grow past a million variables."""
    def layer(h, p):
        w, b = p
        h = jnp.tanh(jnp.einsum("bsd,de->bse", h, w) + b)
        return h, jnp.sum(h, axis=1)

    h, sums = jax.lax.scan(layer, x, (params["w"], params["b"]))
    c = jnp.cumprod(1 + 0.01 * h, axis=1)
    h2 = jax.nn.relu(jnp.einsum("bsd,de->bse", c, params["head"]))
    h3 = jax.lax.cond(jnp.sum(h2) > 0, lambda a: a * 2, lambda a: a - 1, h2)
    return jnp.mean(h3 ** 2) + 0.01 * jnp.sum(sums ** 2)


def scan_cumprod(layers: int = 4, batch: int = 8, seq: int = 16, d: int = 32):
    """:func:`scan_cumprod_loss` as an SGD step: ``(step, (params, x))`` (171 operators)."""
    k = jax.random.split(jax.random.key(5), 3)
    params = {"w": jax.random.normal(k[0], (layers, d, d)) / d ** 0.5,
              "b": jnp.zeros((layers, d)),
              "head": jax.random.normal(k[1], (d, d)) / d ** 0.5}
    x = jax.random.normal(k[2], (batch, seq, d))
    return sgd_step(scan_cumprod_loss), (params, x)
