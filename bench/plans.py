"""Plans to compare, for any :class:`bench.zoo.ZooCase`: automatic, data parallel, hand plans
(Megatron, FSDP-like) and deliberately bad ones, all on a ``("dp", "mp")`` mesh.

A hand plan pins the layout of every parameter and of the batch (``semi_auto_parallel``);
everything else (optimizer state, activations) is propagated by jaxpar, and XLA inserts the
collectives.  Also the extra bench models (an MLP, a wide MLP, the GPT of examples/, a conv net)
as zoo cases, so every plan applies to every model.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from bench.zoo import ZooCase, flat, unflat

AUTO_MODES = ("recursive_programming", "dynamic_programming", "optimal")


def plan_options(case: ZooCase, label: str, hardware) -> dict:
    """``jaxpar.parallelize`` keyword arguments of plan ``label`` for ``case``."""
    n_batch = len(case.batch)
    batch = tuple(range(3, 3 + n_batch))  # (params, state, opt_state, *batch)
    if label.startswith("auto "):
        mode = {"auto recursive": "recursive_programming", "auto dp": "dynamic_programming",
                "auto optimal": "optimal"}[label]
        return dict(parallel_mode="auto_parallel", search_mode=mode, hardware=hardware)
    if label == "data parallel":
        return dict(parallel_mode="data_parallel", batch_argnums=batch, hardware=hardware)
    if label in ("Megatron", "Megatron transposed (bad)"):
        specs = case.megatron_specs("mp")
        if label.endswith("(bad)"):
            specs = {k: _transposed(s, case.params[k]) for k, s in specs.items()}
        data = P("dp")
    elif label == "FSDP":
        specs = {k: _fsdp(v) for k, v in case.params.items()}
        data = P(("dp", "mp"))
    elif label == "replicated (bad)":
        specs = {k: P() for k in case.params}
        data = P()
    else:
        raise KeyError(label)
    return dict(parallel_mode="semi_auto_parallel", hardware=hardware,
                in_strategy=(specs, None, None) + tuple(_batch_spec(data, b) for b in case.batch))


def _batch_spec(spec: P, x) -> P:
    return spec if x.ndim and x.shape[0] % 8 == 0 else P()


def _fsdp(value) -> P:
    """Dimension 0 over every device where it divides (ZeRO-3 / FSDP: gathered for use)."""
    if value.ndim >= 2 and value.shape[0] % 8 == 0:
        return P(("dp", "mp"))
    return P()


def _transposed(spec: P, value) -> P:
    """Megatron's split moved to the other matrix dimension: every layer fights the next."""
    if spec == P() or value.ndim < 2:
        return spec
    dims = list(spec) + [None] * (value.ndim - len(spec))
    i = dims.index("mp")
    j = 1 if i == 0 else 0
    if value.shape[j] % 4:
        return spec
    dims[i], dims[j] = None, "mp"
    return P(*dims)


# -- extra models of the clock benchmark ------------------------------------------------------
def _mse(out, y):
    return jnp.mean((out - y) ** 2)


def mlp(batch: int = 256, width: int = 32, depth: int = 6) -> ZooCase:
    """The issue's MLP: small weights, large batch (data parallel is the known answer)."""
    keys = jax.random.split(jax.random.key(10), depth + 2)
    params = {f"w{i}": jax.random.normal(keys[i], (width, width)) / np.sqrt(width)
              for i in range(depth)}
    params.update({f"b{i}": jnp.zeros((width,)) for i in range(depth)})
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.normal(keys[-1], (batch, width))

    def loss(params, state, x, y):
        h = x
        for i in range(depth):
            h = jax.nn.relu(h @ params[f"w{i}"] + params[f"b{i}"])
        return _mse(h, y), state

    megatron = {f"w{i}": (1 if i % 2 == 0 else 0) for i in range(depth)}
    megatron.update({f"b{i}": 0 for i in range(0, depth, 2)})
    return ZooCase(f"mlp {depth}x{width} b{batch}", "bench", loss, params, {}, (x, y), megatron)


def wide_mlp(batch: int = 64, d: int = 256, h: int = 1024) -> ZooCase:
    """Large weights, small batch (Megatron is the known answer)."""
    k = jax.random.split(jax.random.key(11), 4)
    params = {"w1": jax.random.normal(k[0], (d, h)) / d**0.5, "b1": jnp.zeros((h,)),
              "w2": jax.random.normal(k[1], (h, d)) / h**0.5}
    x = jax.random.normal(k[2], (batch, d))
    y = jax.random.normal(k[3], (batch, d))

    def loss(params, state, x, y):
        out = jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"]
        return _mse(out, y), state

    return ZooCase(f"wide mlp {d}-{h} b{batch}", "bench", loss, params, {}, (x, y),
                   {"w1": 1, "b1": 0, "w2": 0})


def gpt(layers: int = 2, batch: int = 16) -> ZooCase:
    """examples/gpt.py without annotations (d_model 128, 8 heads, ff 512, seq 64)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    import gpt as g
    from flax import nnx

    cfg = g.GPTConfig(layers=layers, annotate=False)
    model = g.GPT(cfg, nnx.Rngs(0))
    graphdef, state = nnx.split(model, nnx.Param)
    params = flat(nnx.to_pure_dict(state))
    tokens = jnp.asarray(next(g.batches(g.corpus(), batch, cfg.seq)))

    def loss(params, state_, tokens):
        logits = nnx.merge(graphdef, nnx.State(unflat(params)))(tokens[:, :-1])
        from optax import softmax_cross_entropy_with_integer_labels as xent

        return xent(logits, tokens[:, 1:]).mean(), state_

    return ZooCase(f"gpt {layers}L d128", "examples/gpt.py", loss, params, {}, (tokens,),
                   {"*/attn/q/kernel": 1, "*/attn/k/kernel": 1, "*/attn/v/kernel": 1,
                    "*/attn/out/kernel": 0, "*/mlp/fc1/kernel": 1, "*/mlp/fc1/bias": 0,
                    "*/mlp/fc2/kernel": 0})


def convnet(batch: int = 64, hw: int = 32, c: int = 16) -> ZooCase:
    from tests import models

    params, x = models.init_convnet(jax.random.key(12), batch=batch, hw=hw, c=c)

    def loss(params, state, x):
        return models.convnet_loss(params, x), state

    # channel split: the first conv's output channels, the second's input channels
    return ZooCase(f"convnet c{c} b{batch}", "tests/models.py", loss, params, {}, (x,),
                   {"k1": 3, "k2": 2}, "channel split")


CLOCK_MODELS = {"mlp": mlp, "wide_mlp": wide_mlp, "gpt": gpt, "convnet": convnet}
