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


def bert_layer(p, x, heads):
    """One post-LN BERT layer (Alpa's ``FlaxBertLayer``: attention, dense + LayerNorm, an MLP
    four times as wide, dense + LayerNorm), with separate query, key and value kernels."""
    b, t, d = x.shape

    def dense(h, name):
        return h @ p[name]["kernel"] + p[name]["bias"]

    def norm(h, name):
        mu = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean((h - mu) ** 2, axis=-1, keepdims=True)
        return (h - mu) * jax.lax.rsqrt(var + 1e-12) * p[name]["scale"] + p[name]["bias"]

    q, k, v = (dense(x, n).reshape(b, t, heads, d // heads) for n in ("query", "key", "value"))
    att = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (d // heads) ** 0.5, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    x = norm(x + dense(o, "attention_out"), "attention_norm")
    y = dense(jax.nn.gelu(dense(x, "intermediate")), "output")
    return norm(x + y, "output_norm")


def bert_stack(layers: int = 2, batch: int = 8, seq: int = 8, hidden: int = 128,
               heads: int = 8):
    """Alpa's ``test_bert_layer_*`` train step: ``layers`` BERT layers, a squared-error loss
    against a label, Adam: ``(train_step, (params, opt_state, x, label))``."""
    keys = iter(jax.random.split(jax.random.key(5), 8 * layers + 2))

    def dense(n_in, n_out):
        return {"kernel": jax.random.normal(next(keys), (n_in, n_out)) / n_in ** 0.5,
                "bias": jnp.zeros((n_out,))}

    def norm():
        return {"scale": jnp.ones((hidden,)), "bias": jnp.zeros((hidden,))}

    params = [{"query": dense(hidden, hidden), "key": dense(hidden, hidden),
               "value": dense(hidden, hidden), "attention_out": dense(hidden, hidden),
               "attention_norm": norm(), "intermediate": dense(hidden, 4 * hidden),
               "output": dense(4 * hidden, hidden), "output_norm": norm()}
              for _ in range(layers)]
    tx = optax.adam(1e-2)

    def train_step(params, opt_state, x, label):
        def loss_fn(ps):
            h = x
            for p in ps:
                h = bert_layer(p, h, heads)
            return jnp.mean((h - label) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    x = jax.random.normal(next(keys), (batch, seq, hidden))
    label = jax.random.normal(next(keys), (batch, seq, hidden))
    return train_step, (params, tx.init(params), x, label)


def residual_gelu_step(widths):
    """An SGD step (rate 0.1) of GELU layers of the given widths, the last back to the first:
    ``(step, (params, x))``, all weights ones, the batch 16 rows of ones."""
    def loss(ps, x):
        for p in ps:
            x = jax.nn.gelu(x @ p["w"] + p["b"])
        return jnp.mean(x ** 2)

    def step(ps, x):
        return jax.tree.map(lambda p, g: p - 0.1 * g, ps, jax.grad(loss)(ps, x))

    ps = [{"w": jnp.ones((a, b)), "b": jnp.zeros((b,))}
          for a, b in zip(widths, widths[1:] + [widths[0]], strict=True)]
    return step, (ps, jnp.ones((16, widths[0])))
