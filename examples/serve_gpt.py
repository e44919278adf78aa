"""Serve the demo GPT: trained on 8 devices (semi-automatic), served on 4 with a key/value cache.

1. Train ``gpt.GPT`` on a (dp=2, mp=4) mesh as ``make demo`` does and save the parameters and
   the optimizer state with ``jaxpar.save_checkpoint`` (each device's shards, the strategy and
   the plan beside them).
2. Plan the serving program, one greedy decoding step with a key/value cache, on 4 devices
   (Megatron attention and MLP over ``mp``), and ask ``jaxpar.infer_predict_layout`` for the
   weights' layouts: no XLA compile needed.
3. ``jaxpar.load_distributed_checkpoint`` reads the training checkpoint onto those layouts;
   decode greedily, and check the tokens against one device (the same checkpoint loaded whole)
   and against the model's own forward pass without a cache.

    python examples/serve_gpt.py [--steps N] [--layers L] [--new-tokens T] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import jaxpar  # noqa: E402

# Megatron serving: q/k/v and fc1 split by columns over mp (heads and hidden units), out and fc2
# by rows; everything else (embeddings, norms, head, the cache) is propagated.
SERVING_PLAN = {
    "params.blocks.*.attn.q.kernel.value": (1, 4),
    "params.blocks.*.attn.k.kernel.value": (1, 4),
    "params.blocks.*.attn.v.kernel.value": (1, 4),
    "params.blocks.*.attn.out.kernel.value": (4, 1),
    "params.blocks.*.mlp.fc1.kernel.value": (1, 4),
    "params.blocks.*.mlp.fc1.bias.value": (4,),
    "params.blocks.*.mlp.fc2.kernel.value": (4, 1),
}


def train(cfg: gpt.GPTConfig, steps: int, batch: int, directory: str) -> str:
    """Trains on (dp=2, mp=4), semi-automatic, and saves a checkpoint; returns its path."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    train_step, params, opt_state = gpt.make_train_step(cfg)
    step = jaxpar.parallelize(train_step, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=(None, None, (2, 1)), donate_argnums=(0, 1))
    stream = gpt.batches(gpt.corpus(), batch, cfg.seq)
    data = next(stream)
    plan = step.plan(params, opt_state, data)
    losses = []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, data)
        losses.append(float(loss))
        data = next(stream)
    path = os.path.join(directory, f"step_{steps}")
    jaxpar.save_checkpoint({"params": params, "opt_state": opt_state}, path, plan=plan,
                           overwrite=True)
    print(f"trained {steps} steps on mesh {dict(mesh.shape)}: loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}; saved {path} (each device's shards, strategy and plan)")
    return path


def decode_step_fn(cfg: gpt.GPTConfig):
    """``step(params, cache, tokens, pos) -> (logits, cache)``: one token per sequence, the
    model's own layers with attention over a key/value cache of ``cfg.seq`` positions."""
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(cfg, nnx.Rngs(0))), nnx.Param)
    heads, dh = cfg.heads, cfg.d_model // cfg.heads

    def step(params, cache, tokens, pos):
        model = nnx.merge(graphdef, params)
        b = tokens.shape[0]
        x = model.embed(tokens) + jax.lax.dynamic_slice_in_dim(model.pos[...], pos, 1)[None]
        ks, vs = [], []
        for i, block in enumerate(model.blocks):
            h = block.ln1(x)
            q = block.attn.q(h).reshape(b, 1, heads, dh)
            k = jax.lax.dynamic_update_slice(
                cache["k"][i], block.attn.k(h).reshape(b, 1, heads, dh), (0, pos, 0, 0))
            v = jax.lax.dynamic_update_slice(
                cache["v"][i], block.attn.v(h).reshape(b, 1, heads, dh), (0, pos, 0, 0))
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
            seen = jnp.arange(cfg.seq) <= pos  # the causal mask of the full forward, row pos
            att = jax.nn.softmax(jnp.where(seen, att, -1e9), axis=-1)
            x = x + block.attn.out(jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, 1, -1))
            x = x + block.mlp(block.ln2(x))
            ks.append(k)
            vs.append(v)
        return model.head(model.ln(x))[:, 0], {"k": ks, "v": vs}

    return step


def empty_cache(cfg: gpt.GPTConfig, batch: int) -> dict:
    shape = (batch, cfg.seq, cfg.heads, cfg.d_model // cfg.heads)
    return {"k": [jnp.zeros(shape) for _ in range(cfg.layers)],
            "v": [jnp.zeros(shape) for _ in range(cfg.layers)]}


def greedy(step, params, prompt: np.ndarray, new_tokens: int, cfg: gpt.GPTConfig) -> np.ndarray:
    """Feeds the prompt token by token, then appends the arg-max ``new_tokens`` times."""
    cache = empty_cache(cfg, prompt.shape[0])
    tokens = [prompt[:, i] for i in range(prompt.shape[1])]
    for pos in range(prompt.shape[1] + new_tokens - 1):
        logits, cache = step(params, cache, jnp.asarray(tokens[pos])[:, None], jnp.int32(pos))
        if pos + 1 >= prompt.shape[1]:
            tokens.append(np.asarray(jnp.argmax(logits, axis=-1)).astype(np.int32))
    return np.stack(tokens, axis=1)


def greedy_without_cache(cfg: gpt.GPTConfig, params, prompt: np.ndarray,
                         new_tokens: int) -> np.ndarray:
    """The reference: the GPT's own forward pass over the whole (padded) sequence each time."""
    plain = gpt.GPTConfig(**{**cfg.__dict__, "annotate": False})
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: gpt.GPT(plain, nnx.Rngs(0))), nnx.Param)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    seq = np.zeros((prompt.shape[0], cfg.seq), np.int32)
    seq[:, :prompt.shape[1]] = prompt
    for t in range(prompt.shape[1], prompt.shape[1] + new_tokens):
        seq[:, t] = np.asarray(jnp.argmax(forward(params, seq)[:, t - 1], axis=-1))
    return seq[:, :prompt.shape[1] + new_tokens]


def _alphabet() -> list[str]:
    """The characters behind ``gpt.corpus()``'s ids (the Zen of Python's)."""
    import codecs
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return sorted(set(codecs.decode(this.s, "rot13")))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--ckpt-dir", default=None, help="default: a temporary directory")
    parser.add_argument("--smoke", action="store_true", help="a tiny run for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.layers, args.new_tokens = 8, 1, 12
    cfg = gpt.GPTConfig(layers=args.layers)
    directory = args.ckpt_dir or tempfile.mkdtemp(prefix="serve_gpt_")
    ckpt = train(cfg, args.steps, args.batch, directory)

    # -- serving on 4 devices ----------------------------------------------------------------
    mesh = jaxpar.make_mesh((4,), ("mp",), devices=jax.devices()[:4])
    step = decode_step_fn(cfg)
    serve = jaxpar.parallelize(step, mesh=mesh, parallel_mode="semi_auto_parallel",
                               parameter_plan=SERVING_PLAN)
    abstract = nnx.state(nnx.eval_shape(lambda: gpt.GPT(cfg, nnx.Rngs(0))), nnx.Param)
    prompt = gpt.corpus()[None, 100:108].repeat(2, axis=0)
    prompt[1] = gpt.corpus()[300:308]
    example = (abstract, empty_cache(cfg, 2), jnp.zeros((2, 1), jnp.int32), jnp.int32(0))
    t0 = time.perf_counter()
    layouts = jaxpar.infer_predict_layout(serve, *example)
    t1 = time.perf_counter()
    params = jaxpar.load_distributed_checkpoint(abstract, ckpt, predict_strategy=layouts)
    t2 = time.perf_counter()
    compiled = serve.lower(params, *example[1:]).compile()
    t3 = time.perf_counter()
    print(f"\nServing layouts on mesh {dict(mesh.shape)} (jaxpar.infer_predict_layout):")
    print("\n".join("  " + line for line in layouts.table().splitlines()[1:]))
    print(f"infer_predict_layout: {t1 - t0:.3f} s; XLA compile of the serving step: "
          f"{t3 - t2:.3f} s; load_distributed_checkpoint: {t2 - t1:.3f} s")
    colls = jaxpar.inspect.collectives(compiled)
    print("\nCollectives of the serving step (per token):")
    print(colls.table())

    tokens = greedy(serve, params, prompt, args.new_tokens, cfg)
    one = jaxpar.load_distributed_checkpoint(abstract, ckpt)  # whole, on one device
    single = greedy(jax.jit(step), one, prompt, args.new_tokens, cfg)
    reference = greedy_without_cache(cfg, one, prompt, args.new_tokens)
    chars = _alphabet()
    for row in tokens:
        print("  " + repr("".join(chars[t] for t in row)))
    equal = bool(np.array_equal(tokens, single) and np.array_equal(single, reference))
    print(f"tokens on 4 devices equal one device's, and the uncached forward pass's: {equal}")
    if not equal:
        raise SystemExit(f"tokens differ:\n{tokens}\n{single}\n{reference}")
    return {"tokens": tokens, "single": single, "layouts": layouts, "collectives": colls,
            "infer_s": t1 - t0, "compile_s": t3 - t2}


if __name__ == "__main__":
    main()
