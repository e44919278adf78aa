"""A small GPT in Flax NNX, annotated MindSpore-style with ``jaxpar.shard``.

Written for one device.  The only parallel code is two ``jaxpar.shard`` calls, the analogue of
MindSpore's ``Cell.shard``: attention and MLP blocks pin their input (batch on ``dp``) and their
weights (Megatron: the first projection split by columns over ``mp``, the second by rows).
Everything else is propagated by jaxpar.  With ``annotate=False`` the model has no annotations
at all (for data parallel and the fully automatic searches).

The training text ships with Python itself (``import this``), so nothing is downloaded.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64  # the corpus has fewer characters; padded so it divides over devices
    seq: int = 64
    d_model: int = 128
    heads: int = 8
    layers: int = 2
    ff: int = 512
    annotate: bool = True  # add the jaxpar.shard annotations (semi-automatic mode)
    dp: int = 2  # slice counts of the annotations
    mp: int = 4


class Attention(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.cfg = cfg
        self.q = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.k = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        h = self.cfg.heads
        q = self.q(x).reshape(b, t, h, d // h)
        k = self.k(x).reshape(b, t, h, d // h)
        v = self.v(x).reshape(b, t, h, d // h)
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        att = jax.nn.softmax(jnp.where(causal, att, -1e9), axis=-1)
        return self.out(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(cfg.d_model, cfg.ff, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.ff, cfg.d_model, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = Attention(cfg, rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x):
        attn, mlp = self.attn, self.mlp
        if self.cfg.annotate:
            dp, mp = self.cfg.dp, self.cfg.mp
            column, row = (1, mp), (mp, 1)
            attn = jaxpar.shard(attn, in_strategy=((dp, 1, 1),), parameter_plan={
                "q.kernel": column, "k.kernel": column, "v.kernel": column, "out.kernel": row})
            mlp = jaxpar.shard(mlp, in_strategy=((dp, 1, 1),), parameter_plan={
                "fc1.kernel": column, "fc1.bias": (mp,), "fc2.kernel": row})
        x = x + attn(self.ln1(x))
        return x + mlp(self.ln2(x))


class GPT(nnx.Module):
    def __init__(self, cfg: GPTConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq, cfg.d_model)) * 0.02)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def corpus() -> np.ndarray:
    """The Zen of Python as character ids (it ships with Python: nothing is downloaded)."""
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    text = codecs.decode(this.s, "rot13")
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    return np.array([lookup[c] for c in text], dtype=np.int32)


def batches(data: np.ndarray, batch: int, seq: int, seed: int = 0):
    """An endless stream of (batch, seq + 1) windows of ``data``."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield np.stack([data[s:s + seq + 1] for s in starts])


def make_train_step(cfg: GPTConfig, learning_rate: float = 3e-3, seed: int = 0,
                    recompute: str | None = None):
    """``(train_step, params, opt_state)`` for a pure ``train_step(params, opt_state, batch)``;
    ``recompute``: every block marked ``jaxpar.recompute(block, policy=recompute)``."""
    model = GPT(cfg, nnx.Rngs(seed))
    if recompute is not None:
        for block in model.blocks:
            jaxpar.recompute(block, policy=recompute)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(learning_rate)
    opt_state = tx.init(params)

    def train_step(params, opt_state, batch):
        inputs, targets = batch[:, :-1], batch[:, 1:]

        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(inputs)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step, params, opt_state
