# Trimmed from flax's NNX Gemma example, examples/gemma/{layers,positional_embeddings,modules,
# transformer}.py at https://github.com/google/flax/tree/18f8f311c275d57f46d95e41b15aa97b454754c0
# (Copyright 2024 The Flax Authors, Apache License 2.0,
# http://www.apache.org/licenses/LICENSE-2.0).  What is kept is the training forward pass, as
# written there: RMSNorm, apply_rope, grouped-query Attention with nnx.Einsum projections,
# the gated FeedForward, the pre/post-norm Block and the Transformer with tied embeddings.  Cut:
# the KV cache, sliding windows, soft caps, qk-norm, dropout, the `sow` hooks and the sharding
# metadata (jaxpar chooses the layouts).
"""Gemma-style decoder in Flax NNX (trimmed from flax's examples/gemma)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), dim))

    def __call__(self, x):
        x = jnp.asarray(x, jnp.float32)
        mean2 = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        normed_inputs = jnp.asarray(x * jax.lax.rsqrt(mean2 + 1e-06), dtype=jnp.float32)
        return normed_inputs * (1.0 + self.scale[...])


def apply_rope(inputs, positions, head_dim: int, max_wavelength: int = 10_000):
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    num_embed: int = 256
    embed_dim: int = 64
    hidden_dim: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2


class Attention(nnx.Module):
    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_heads, cfg.num_kv_heads,
                                                            cfg.head_dim)
        self.query_pre_attn_scalar = cfg.head_dim**-0.5
        self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (cfg.num_heads, cfg.embed_dim, cfg.head_dim),
                                   rngs=rngs)
        self.kv_einsum = nnx.Einsum("BTD,CKDH->CBTKH",
                                    (2, cfg.num_kv_heads, cfg.embed_dim, cfg.head_dim), rngs=rngs)
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD",
                                          (cfg.num_heads, cfg.head_dim, cfg.embed_dim), rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask):
        query_proj = self.q_einsum(x)
        key_proj, value_proj = self.kv_einsum(x)
        query_proj = apply_rope(query_proj, segment_pos, head_dim=self.head_dim)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos, head_dim=self.head_dim)
        num_groups = self.num_heads // self.num_kv_heads
        batch_size, seq_size, _, head_dim = query_scaled.shape
        query_scaled = query_scaled.reshape(
            (batch_size, seq_size, self.num_kv_heads, num_groups, head_dim))
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
        logits = logits.reshape((batch_size, seq_size, self.num_heads, -1))
        padded_logits = jnp.where((jnp.expand_dims(attn_mask, -2)), logits, K_MASK)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)
        probs = probs.reshape((batch_size, seq_size, self.num_kv_heads, num_groups, -1))
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
        encoded = encoded.reshape((batch_size, seq_size, self.num_heads, head_dim))
        return self.attn_vec_einsum(encoded)


class FeedForward(nnx.Module):
    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.normal()
        self.gate_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init,
                                    rngs=rngs)
        self.up_proj = nnx.Linear(features, hidden_dim, use_bias=False, kernel_init=init,
                                  rngs=rngs)
        self.down_proj = nnx.Linear(hidden_dim, features, use_bias=False, kernel_init=init,
                                    rngs=rngs)

    def __call__(self, x):
        activations = nnx.gelu(self.gate_proj(x)) * self.up_proj(x)
        return self.down_proj(activations)


class Block(nnx.Module):
    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.pre_attention_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attention_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
        self.pre_ffw_norm = RMSNorm(cfg.embed_dim, rngs=rngs)
        self.mlp = FeedForward(cfg.embed_dim, cfg.hidden_dim, rngs=rngs)
        self.post_ffw_norm = RMSNorm(cfg.embed_dim, rngs=rngs)

    def __call__(self, x, segment_pos, attn_mask):
        attn_output = self.attn(self.pre_attention_norm(x), segment_pos, attn_mask)
        x += self.post_attention_norm(attn_output)
        x += self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))
        return x


class Transformer(nnx.Module):
    def __init__(self, cfg: GemmaConfig, *, rngs: nnx.Rngs):
        self.embedder = nnx.Embed(cfg.num_embed, cfg.embed_dim, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, rngs=rngs)

    def __call__(self, last_tokens, positions, attention_mask):
        x = self.embedder(last_tokens)
        x *= jnp.sqrt(x.shape[-1])  # ScaledEmbed
        for layer in self.layers:
            x = layer(x, positions, attention_mask)
        return self.embedder.attend(self.final_norm(x))
