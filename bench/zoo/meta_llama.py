"""A LLaMA-style decoder in plain JAX, laid out as Meta's reference ``llama/model.py``.

Written for this benchmark after the structure of Meta's PyTorch reference implementation
(github.com/meta-llama/llama, ``llama/model.py``): RMSNorm, rotary embeddings applied to
*interleaved* pairs of features (Meta's ``view_as_complex`` over ``(..., -1, 2)``, here a reshape
and ``jnp.stack``), grouped-query attention, a SwiGLU feed-forward block, pre-norm residuals.
No code is copied.  As in large-scale JAX training, every layer is wrapped in
``jax.checkpoint`` (recomputed in the backward pass).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    vocab_size: int = 256
    ffn_dim: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


def init(key: jax.Array, cfg: LlamaConfig) -> dict:
    head_dim = cfg.dim // cfg.n_heads
    keys = iter(jax.random.split(key, 3 + 7 * cfg.n_layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape) * shape[0] ** -0.5

    layers = []
    for _ in range(cfg.n_layers):
        layers.append({
            "attention_norm": jnp.ones((cfg.dim,)),
            "wq": dense((cfg.dim, cfg.n_heads * head_dim)),
            "wk": dense((cfg.dim, cfg.n_kv_heads * head_dim)),
            "wv": dense((cfg.dim, cfg.n_kv_heads * head_dim)),
            "wo": dense((cfg.n_heads * head_dim, cfg.dim)),
            "ffn_norm": jnp.ones((cfg.dim,)),
            "w1": dense((cfg.dim, cfg.ffn_dim)),
            "w3": dense((cfg.dim, cfg.ffn_dim)),
            "w2": dense((cfg.ffn_dim, cfg.dim)),
        })
    return {"tok_embeddings": jax.random.normal(next(keys), (cfg.vocab_size, cfg.dim)) * 0.02,
            "layers": layers, "norm": jnp.ones((cfg.dim,)),
            "output": dense((cfg.dim, cfg.vocab_size))}


def rms_norm(x, weight, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def precompute_freqs(head_dim: int, seq: int, theta: float):
    freqs = 1.0 / (theta ** (jnp.arange(0, head_dim, 2)[: head_dim // 2] / head_dim))
    angles = jnp.outer(jnp.arange(seq), freqs)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rotary_emb(x, cos, sin):
    """Rotates interleaved pairs ``(x[2i], x[2i+1])`` of the head dimension (Meta's layout)."""
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return jnp.stack([re * cos - im * sin, re * sin + im * cos], axis=-1).reshape(x.shape)


def attention(p, x, cos, sin, cfg: LlamaConfig):
    b, t, _ = x.shape
    hd = cfg.dim // cfg.n_heads
    q = (x @ p["wq"]).reshape(b, t, cfg.n_heads, hd)
    k = (x @ p["wk"]).reshape(b, t, cfg.n_kv_heads, hd)
    v = (x @ p["wv"]).reshape(b, t, cfg.n_kv_heads, hd)
    q, k = apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin)
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / jnp.sqrt(hd)
    mask = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, cfg.n_heads * hd)
    return out @ p["wo"]


def feed_forward(p, x):
    return (jax.nn.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def transformer_block(p, x, cos, sin, cfg: LlamaConfig):
    h = x + attention(p, rms_norm(x, p["attention_norm"], cfg.norm_eps), cos, sin, cfg)
    return h + feed_forward(p, rms_norm(h, p["ffn_norm"], cfg.norm_eps))


def forward(params, tokens, cfg: LlamaConfig):
    h = params["tok_embeddings"][tokens]
    cos, sin = precompute_freqs(cfg.dim // cfg.n_heads, tokens.shape[1], cfg.rope_theta)
    block = jax.checkpoint(transformer_block, static_argnums=(4,))
    for layer in params["layers"]:
        h = block(layer, h, cos, sin, cfg)
    return rms_norm(h, params["norm"], cfg.norm_eps) @ params["output"]
