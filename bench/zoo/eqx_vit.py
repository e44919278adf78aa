# The Vision Transformer of equinox's documentation, examples/vision_transformer.ipynb in
# https://github.com/patrick-kidger/equinox (Apache License 2.0), as written there, with one
# change: the einops.rearrange of the patch embedding is spelled as reshape + transpose (the
# same permutation, "c (h ph) (w pw) -> (h w) (c ph pw)") so that the bench needs no einops.
"""Equinox ViT (from equinox's documentation examples)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import PRNGKeyArray


class PatchEmbedding(eqx.Module):
    linear: eqx.nn.Linear
    patch_size: int

    def __init__(self, input_channels: int, output_shape: int, patch_size: int,
                 key: PRNGKeyArray):
        self.patch_size = patch_size
        self.linear = eqx.nn.Linear(self.patch_size**2 * input_channels, output_shape, key=key)

    def __call__(self, x):
        c, h, w = x.shape
        ph = pw = self.patch_size
        x = x.reshape(c, h // ph, ph, w // pw, pw).transpose(1, 3, 0, 2, 4)
        x = x.reshape((h // ph) * (w // pw), c * ph * pw)
        x = jax.vmap(self.linear)(x)
        return x


class AttentionBlock(eqx.Module):
    layer_norm1: eqx.nn.LayerNorm
    layer_norm2: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear
    dropout1: eqx.nn.Dropout
    dropout2: eqx.nn.Dropout

    def __init__(self, input_shape: int, hidden_dim: int, num_heads: int, dropout_rate: float,
                 key: PRNGKeyArray):
        key1, key2, key3 = jr.split(key, 3)
        self.layer_norm1 = eqx.nn.LayerNorm(input_shape)
        self.layer_norm2 = eqx.nn.LayerNorm(input_shape)
        self.attention = eqx.nn.MultiheadAttention(num_heads, input_shape, key=key1)
        self.linear1 = eqx.nn.Linear(input_shape, hidden_dim, key=key2)
        self.linear2 = eqx.nn.Linear(hidden_dim, input_shape, key=key3)
        self.dropout1 = eqx.nn.Dropout(dropout_rate)
        self.dropout2 = eqx.nn.Dropout(dropout_rate)

    def __call__(self, x, enable_dropout: bool, key: PRNGKeyArray):
        input_x = jax.vmap(self.layer_norm1)(x)
        x = x + self.attention(input_x, input_x, input_x)
        input_x = jax.vmap(self.layer_norm2)(x)
        input_x = jax.vmap(self.linear1)(input_x)
        input_x = jax.nn.gelu(input_x)
        key1, key2 = jr.split(key, num=2)
        input_x = self.dropout1(input_x, inference=not enable_dropout, key=key1)
        input_x = jax.vmap(self.linear2)(input_x)
        input_x = self.dropout2(input_x, inference=not enable_dropout, key=key2)
        return x + input_x


class VisionTransformer(eqx.Module):
    patch_embedding: PatchEmbedding
    positional_embedding: jnp.ndarray
    cls_token: jnp.ndarray
    attention_blocks: list[AttentionBlock]
    dropout: eqx.nn.Dropout
    mlp: eqx.nn.Sequential
    num_layers: int

    def __init__(self, embedding_dim: int, hidden_dim: int, num_heads: int, num_layers: int,
                 dropout_rate: float, patch_size: int, num_patches: int, num_classes: int,
                 channels: int, key: PRNGKeyArray):
        key1, key2, key3, key4, key5 = jr.split(key, 5)
        self.patch_embedding = PatchEmbedding(channels, embedding_dim, patch_size, key1)
        self.positional_embedding = jr.normal(key2, (num_patches + 1, embedding_dim))
        self.cls_token = jr.normal(key3, (1, embedding_dim))
        self.num_layers = num_layers
        self.attention_blocks = [
            AttentionBlock(embedding_dim, hidden_dim, num_heads, dropout_rate, key4)
            for _ in range(self.num_layers)
        ]
        self.dropout = eqx.nn.Dropout(dropout_rate)
        self.mlp = eqx.nn.Sequential([eqx.nn.LayerNorm(embedding_dim),
                                      eqx.nn.Linear(embedding_dim, num_classes, key=key5)])

    def __call__(self, x, enable_dropout: bool, key: PRNGKeyArray):
        x = self.patch_embedding(x)
        x = jnp.concatenate((self.cls_token, x), axis=0)
        x += self.positional_embedding[: x.shape[0]]
        dropout_key, *attention_keys = jr.split(key, num=self.num_layers + 1)
        x = self.dropout(x, inference=not enable_dropout, key=dropout_key)
        for block, attention_key in zip(self.attention_blocks, attention_keys, strict=True):
            x = block(x, enable_dropout, key=attention_key)
        x = x[0]  # Select the CLS token.
        return self.mlp(x)
