"""A zoo of models written by others, as a new user would bring them to jaxpar.

Every case is a train step (Adam) of a tiny configuration (2 layers, width 64) of:

* ``lm1b``: flax's lm1b ``TransformerLM`` (Linen), examples/lm1b/models.py;
* ``resnet``: flax's ImageNet ``ResNet`` (Linen, BatchNorm statistics as mutable state);
* ``gemma``: flax's NNX Gemma, trimmed (grouped-query attention, RoPE, gated MLP);
* ``gpt2``: keras-hub's ``GPT2CausalLM`` on the JAX backend through ``stateless_call``;
* ``vit``: equinox's documentation ViT;
* ``llama``: a LLaMA-style decoder with ``jax.checkpoint`` per layer and Meta's interleaved RoPE.

Each file beside this one names its source and licence.  A case gives the loss, the trainable
parameters (a dict by path), a mutable state, the batch, and the hand Megatron layout: for each
parameter path (a glob) the dimension that is split over the model axis.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

NAMES = ("lm1b", "resnet", "gemma", "gpt2", "vit", "llama")


@dataclasses.dataclass(frozen=True)
class ZooCase:
    """``loss(params, state, *batch) -> (loss, new_state)``; params a flat dict by path."""

    name: str
    source: str
    loss: Callable[..., tuple[jax.Array, Any]]
    params: dict[str, jax.Array]
    state: Any
    batch: tuple[jax.Array, ...]
    megatron: Mapping[str, int]  # path glob -> dimension split over the model axis
    megatron_label: str = "Megatron"

    def grad_fn(self) -> Callable:
        """``(params, state, *batch) -> (loss, grads)``: for the numerics check."""
        loss = self.loss

        def grad_fn(params, state, *batch):
            (value, _), grads = jax.value_and_grad(loss, has_aux=True)(params, state, *batch)
            return value, grads

        return grad_fn

    def train_step(self, learning_rate: float = 1e-3) -> tuple[Callable, tuple]:
        """``(step, args)``: ``step(params, state, opt_state, *batch)`` with Adam."""
        tx = optax.adam(learning_rate)
        loss = self.loss

        def train_step(params, state, opt_state, *batch):
            (value, new_state), grads = jax.value_and_grad(loss, has_aux=True)(
                params, state, *batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_state, opt_state, value

        return train_step, (self.params, self.state, tx.init(self.params), *self.batch)

    def megatron_specs(self, axis: str = "mp") -> dict[str, P]:
        """The hand layout of every parameter: split as :attr:`megatron` says, else whole."""
        out = {}
        for path, value in self.params.items():
            spec = P()
            for pattern, dim in self.megatron.items():
                if fnmatch.fnmatchcase(path, pattern):
                    spec = P(*([None] * dim + [axis] + [None] * (value.ndim - dim - 1)))
                    break
            out[path] = spec
        return out


def flat(tree: Any, sep: str = "/") -> dict[str, jax.Array]:
    """A nested dict of arrays as ``{"a/b/c": array}``."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {sep.join(_key(k) for k in path): v for path, v in leaves}


def unflat(d: Mapping[str, Any], sep: str = "/") -> dict:
    out: dict = {}
    for path, v in d.items():
        node = out
        *head, last = path.split(sep)
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return out


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _tokens(key: jax.Array, batch: int, seq: int, vocab: int) -> jax.Array:
    return jax.random.randint(key, (batch, seq), 1, vocab)


def _lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


# -- the cases ----------------------------------------------------------------------------------
def lm1b(batch: int = 16, seq: int = 32) -> ZooCase:
    from bench.zoo import flax_lm1b as m

    cfg = m.TransformerConfig(vocab_size=256, output_vocab_size=256, emb_dim=64, num_heads=4,
                              num_layers=2, qkv_dim=64, mlp_dim=128, max_len=seq,
                              dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True)
    model = m.TransformerLM(cfg)
    tokens = _tokens(jax.random.key(0), batch, seq, 256)
    from flax import linen

    # the example boxes its parameters with logical-axis metadata; a user unboxes them
    params = flat(linen.unbox(model.init(jax.random.key(1), tokens))["params"])

    def loss(params, state, tokens):
        logits = model.apply({"params": unflat(params)}, tokens)
        return _lm_loss(logits, tokens), state

    return ZooCase("lm1b", "flax examples/lm1b/models.py (Linen TransformerLM)", loss, params,
                   {}, (tokens,), {"*/query/kernel": 1, "*/key/kernel": 1, "*/value/kernel": 1,
                                   "*/out/kernel": 0, "*/MlpBlock_0/Dense_0/kernel": 1,
                                   "*/MlpBlock_0/Dense_0/bias": 0,
                                   "*/MlpBlock_0/Dense_1/kernel": 0})


def resnet(batch: int = 16, hw: int = 32) -> ZooCase:
    from functools import partial

    from bench.zoo import flax_resnet as m

    model = partial(m.ResNet, stage_sizes=[1, 1], block_cls=m.ResNetBlock)(num_classes=10,
                                                                          num_filters=16)
    k = jax.random.split(jax.random.key(2), 3)
    images = jax.random.normal(k[0], (batch, hw, hw, 3))
    labels = jax.random.randint(k[1], (batch,), 0, 10)
    variables = model.init(k[2], images, train=True)
    params = flat(variables["params"])

    def loss(params, batch_stats, images, labels):
        logits, new = model.apply({"params": unflat(params), "batch_stats": batch_stats},
                                  images, train=True, mutable=["batch_stats"])
        return _lm_loss(logits, labels), new["batch_stats"]

    # Conv kernels are HWIO: the hand plan splits output channels (and the BatchNorm that
    # follows) over the model axis.
    return ZooCase("resnet", "flax examples/imagenet/models.py (Linen ResNet, 2 stages)", loss,
                   params, variables["batch_stats"], (images, labels),
                   {"*conv*/kernel": 3, "*Conv_*/kernel": 3}, "channel split")


def gemma(batch: int = 16, seq: int = 32, layers: int = 2) -> ZooCase:
    from flax import nnx

    from bench.zoo import nnx_gemma as m

    cfg = m.GemmaConfig(num_embed=256, embed_dim=64, hidden_dim=128, num_heads=8,
                        num_kv_heads=4, head_dim=8, num_layers=layers)
    model = m.Transformer(cfg, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(model, nnx.Param)
    params = flat(nnx.to_pure_dict(state))
    tokens = _tokens(jax.random.key(4), batch, seq, 256)
    positions = jnp.broadcast_to(jnp.arange(seq), (batch, seq))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), (batch, seq, seq))

    def loss(params, state_, tokens, positions, mask):
        st = nnx.State(unflat(params))
        logits = nnx.merge(graphdef, st)(tokens, positions, mask)
        return _lm_loss(logits, tokens), state_

    return ZooCase("gemma", "flax examples/gemma (NNX Gemma, trimmed)", loss, params, {},
                   (tokens, positions, mask),
                   {"*/q_einsum/kernel": 0, "*/kv_einsum/kernel": 1,
                    "*/attn_vec_einsum/kernel": 0, "*/gate_proj/kernel": 1,
                    "*/up_proj/kernel": 1, "*/down_proj/kernel": 0})


def gpt2(batch: int = 16, seq: int = 16) -> ZooCase:
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=256, num_layers=2, num_heads=4,
                                             hidden_dim=64, intermediate_dim=128,
                                             max_sequence_length=seq, dropout=0.0)
    lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    paths = [v.path for v in lm.trainable_variables]
    params = {p: jnp.asarray(v.value) for p, v in zip(paths, lm.trainable_variables,
                                                      strict=True)}
    non_trainable = [jnp.asarray(v.value) for v in lm.non_trainable_variables]
    tokens = _tokens(jax.random.key(5), batch, seq, 256)
    padding = jnp.ones((batch, seq), bool)

    def loss(params, state, tokens, padding):
        logits, _ = lm.stateless_call([params[p] for p in paths], non_trainable,
                                      {"token_ids": tokens, "padding_mask": padding})
        return _lm_loss(logits, tokens), state

    return ZooCase("gpt2", "keras-hub GPT2CausalLM (JAX backend, stateless_call)", loss, params,
                   {}, (tokens, padding),
                   {"*/query/kernel": 1, "*/key/kernel": 1, "*/value/kernel": 1,
                    "*/query/bias": 0, "*/key/bias": 0, "*/value/bias": 0,
                    "*/attention_output/kernel": 0, "*/feedforward_intermediate_dense/kernel": 1,
                    "*/feedforward_intermediate_dense/bias": 0,
                    "*/feedforward_output_dense/kernel": 0})


def vit(batch: int = 16, hw: int = 16) -> ZooCase:
    import equinox as eqx

    from bench.zoo import eqx_vit as m

    model = m.VisionTransformer(embedding_dim=64, hidden_dim=128, num_heads=4, num_layers=2,
                                dropout_rate=0.0, patch_size=4, num_patches=(hw // 4) ** 2,
                                num_classes=10, channels=3, key=jax.random.key(6))
    arrays, static = eqx.partition(model, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(arrays)
    paths = [".".join(_key(k) for k in path) for path, _ in leaves]
    params = dict(zip(paths, [v for _, v in leaves], strict=True))
    k = jax.random.split(jax.random.key(7), 2)
    images = jax.random.normal(k[0], (batch, 3, hw, hw))
    labels = jax.random.randint(k[1], (batch,), 0, 10)

    def loss(params, state, images, labels):
        arrays = jax.tree_util.tree_unflatten(treedef, [params[p] for p in paths])
        net = eqx.combine(arrays, static)
        keys = jax.random.split(jax.random.key(0), images.shape[0])
        logits = jax.vmap(net, in_axes=(0, None, 0))(images, False, keys)
        return _lm_loss(logits, labels), state

    # eqx.nn.Linear weights are (out, in): column-parallel splits dim 0, row-parallel dim 1.
    return ZooCase("vit", "equinox docs examples/vision_transformer.ipynb (ViT)", loss, params,
                   {}, (images, labels),
                   {"*query_proj.weight": 0, "*key_proj.weight": 0, "*value_proj.weight": 0,
                    "*output_proj.weight": 1, "*linear1.weight": 0, "*linear1.bias": 0,
                    "*linear2.weight": 1})


def llama(batch: int = 16, seq: int = 32) -> ZooCase:
    from bench.zoo import meta_llama as m

    cfg = m.LlamaConfig(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256,
                        ffn_dim=128)
    tree = m.init(jax.random.key(8), cfg)
    params = flat(tree)
    tokens = _tokens(jax.random.key(9), batch, seq + 1, 256)

    def loss(params, state, tokens):
        tree = unflat(params)
        tree["layers"] = [tree["layers"][str(i)] for i in range(cfg.n_layers)]
        logits = m.forward(tree, tokens[:, :-1], cfg)
        return _lm_loss(logits, tokens[:, 1:]), state

    return ZooCase("llama", "LLaMA-style (Meta layout), jax.checkpoint per layer", loss,
                   params, {}, (tokens,),
                   {"*/wq": 1, "*/wk": 1, "*/wv": 1, "*/wo": 0, "*/w1": 1, "*/w3": 1,
                    "*/w2": 0})


BUILDERS: dict[str, Callable[[], ZooCase]] = {
    "lm1b": lm1b, "resnet": resnet, "gemma": gemma, "gpt2": gpt2, "vit": vit, "llama": llama}


def available() -> dict[str, str]:
    """``{name: why not}`` for the cases whose packages are missing."""
    missing = {}
    for name, module in (("gpt2", "keras_hub"), ("vit", "equinox")):
        try:
            __import__(module)
        except ImportError as e:
            missing[name] = f"{module} is not installed ({e})"
    return missing
