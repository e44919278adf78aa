"""Small pure-JAX models the tests plan: an MLP, a transformer block, a conv net, a scan stack."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def init_mlp(key, d_in=32, d_hidden=64, d_out=16, batch=16):
    k = jax.random.split(key, 3)
    params = {"w1": jax.random.normal(k[0], (d_in, d_hidden)) / np.sqrt(d_in),
              "w2": jax.random.normal(k[1], (d_hidden, d_out)) / np.sqrt(d_hidden)}
    x = jax.random.normal(k[2], (batch, d_in))
    return params, x


def mlp(params, x):
    return jax.nn.relu(x @ params["w1"]) @ params["w2"]


def mlp_loss(params, x):
    return jnp.mean(mlp(params, x) ** 2)


def init_block(key, batch=4, seq=8, d=32, heads=4, ff=64):
    k = jax.random.split(key, 8)
    s = 1 / np.sqrt(d)
    params = {
        "ln_g": jnp.ones((d,)), "ln_b": jnp.zeros((d,)),
        "wq": jax.random.normal(k[0], (d, d)) * s, "wk": jax.random.normal(k[1], (d, d)) * s,
        "wv": jax.random.normal(k[2], (d, d)) * s, "wo": jax.random.normal(k[3], (d, d)) * s,
        "w1": jax.random.normal(k[4], (d, ff)) * s, "b1": jnp.zeros((ff,)),
        "w2": jax.random.normal(k[5], (ff, d)) / np.sqrt(ff),
    }
    x = jax.random.normal(k[6], (batch, seq, d))
    return params, x


def _layer_norm(x, g, b):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g + b


def block(params, x, heads=4):
    b, t, d = x.shape
    h = _layer_norm(x, params["ln_g"], params["ln_b"])
    q = (h @ params["wq"]).reshape(b, t, heads, d // heads)
    k = (h @ params["wk"]).reshape(b, t, heads, d // heads)
    v = (h @ params["wv"]).reshape(b, t, heads, d // heads)
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((t, t), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    x = x + o @ params["wo"]
    y = jax.nn.gelu(x @ params["w1"] + params["b1"])
    return x + y @ params["w2"]


def block_loss(params, x):
    return jnp.mean(block(params, x) ** 2)


def init_convnet(key, batch=8, hw=8, c_in=3, c=8, classes=4):
    k = jax.random.split(key, 4)
    params = {"k1": jax.random.normal(k[0], (3, 3, c_in, c)) * 0.3,
              "k2": jax.random.normal(k[1], (3, 3, c, c)) * 0.2,
              "w": jax.random.normal(k[2], (c, classes)) * 0.3}
    x = jax.random.normal(k[3], (batch, hw, hw, c_in))
    return params, x


def convnet(params, x):
    dn = ("NHWC", "HWIO", "NHWC")
    h = jax.lax.conv_general_dilated(x, params["k1"], (1, 1), "SAME", dimension_numbers=dn)
    h = jax.nn.relu(h)
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.lax.conv_general_dilated(h, params["k2"], (1, 1), "SAME", dimension_numbers=dn)
    h = jnp.mean(jax.nn.relu(h), axis=(1, 2))
    return h @ params["w"]


def convnet_loss(params, x):
    return jnp.mean(convnet(params, x) ** 2)


def init_stack(key, layers=3, batch=8, d=16):
    k = jax.random.split(key, 3)
    params = {"w": jax.random.normal(k[0], (layers, d, d)) / np.sqrt(d),
              "b": jnp.zeros((layers, d))}
    x = jax.random.normal(k[1], (batch, d))
    return params, x


def scan_stack(params, x):
    def layer(h, p):
        w, b = p
        return jnp.tanh(h @ w + b), jnp.sum(h)

    h, sums = jax.lax.scan(layer, x, (params["w"], params["b"]))
    return h, sums


def scan_stack_loss(params, x):
    h, sums = scan_stack(params, x)
    return jnp.mean(h ** 2) + 0.01 * jnp.sum(sums)
