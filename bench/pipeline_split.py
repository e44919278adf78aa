"""The stage split against the clock: step time of a pipelined train step per split.

For each model, the pipelined Adam train step is compiled once per candidate split (the layer
counts per stage forced in place of the search's, every other choice unchanged), its inputs
placed first, and timed in rounds interleaved between the splits (each round runs every split
``steps`` times, blocking on each step): median CPU seconds (``time.process_time``, the
emulated devices' threads together) and wall seconds per step.  Beside them: the split the
search chooses, the cost model's prices (one layer, prologue, epilogue per micro-batch) and
the compiled per-device FLOPs (``cost_analysis``) of each split.

Models: the 8-block d=16 GPT of ``tests/test_pipeline.py`` (S=2, dp=4, M=4), the same GPT
with a heavy head (vocabulary 2048), and the model of ``examples/gpt_3d.py`` (4 blocks,
d=512, on (dp, tp, pp) = (2, 2, 2)).

    python bench/pipeline_split.py [--rounds R] [--steps N] [--models a,b]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import gpt  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402
from jaxpar._src.pipeline import program as pipeline_program  # noqa: E402

# name: (GPT config, batch rows, mesh shape, mesh axes, S, M, parallel mode)
MODELS = {
    "test GPT": (dict(layers=8, d_model=16, heads=2, ff=32, seq=8, vocab=64), 16,
                 (4, 2), ("dp", "pp"), 2, 4, "semi_auto_parallel"),
    "heavy head": (dict(layers=8, d_model=16, heads=2, ff=32, seq=8, vocab=2048), 16,
                   (4, 2), ("dp", "pp"), 2, 4, "semi_auto_parallel"),
    "gpt_3d": (dict(layers=4, d_model=512, heads=4, ff=2048, seq=32), 16,
               (2, 2, 2), ("dp", "tp", "pp"), 2, 4, "auto_parallel"),
}


@contextlib.contextmanager
def forced(counts: tuple[int, ...] | None):
    """``choose_split`` answers ``counts`` (``None``: the search's own split)."""
    orig = pipeline_program.choose_split

    def choose(layers, **kw):
        s = orig(layers, **kw)
        return s if counts is None else dataclasses.replace(s, counts=tuple(counts))

    pipeline_program.choose_split = choose
    try:
        yield
    finally:
        pipeline_program.choose_split = orig


def build(name: str, counts: tuple[int, ...] | None) -> dict:
    cfg_kw, rows, shape, axes, S, M, mode = MODELS[name]
    cfg = gpt.GPTConfig(annotate=False, **cfg_kw)
    graphdef, params = nnx.split(gpt.GPT(cfg, nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, inputs, targets):
        logits = nnx.merge(graphdef, p)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    batch = np.asarray(next(gpt.batches(gpt.corpus(), rows, cfg.seq)))
    mesh = jaxpar.make_mesh(shape, axes)
    opt = optax.adam(1e-3)
    with forced(counts), jaxpar.auto_parallel_context(
            parallel_mode=mode, mesh=mesh, pipeline_stages=S, micro_batches=M,
            pipeline_config={"pipeline_scheduler": "gpipe"}):
        cell = jaxpar.PipelineCell(loss_fn)

        def step(p, o, b):
            value, grads = jax.value_and_grad(cell)(p, b[:, :-1], b[:, 1:])
            updates, o = opt.update(grads, o, p)
            return optax.apply_updates(p, updates), o, value

        p = cell.stack(params, batch[:, :-1], batch[:, 1:])
        args = (p, opt.init(p), batch)
        f = jaxpar.parallelize(step, batch_argnums=2)
        entry = f.compiled_entry(*args)
        plan = entry.plan
        compiled = f.lower(*args).compile()
        leaves, tree = jax.tree.flatten(args)
        placed = jax.tree.unflatten(tree, [jax.device_put(x, s) for x, s in
                                           zip(leaves, entry.in_shardings, strict=True)])
        out = compiled(*placed)
        jax.block_until_ready(out)
    sp = plan.pipeline.split
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {"model": name, "counts": list(sp.counts), "run": compiled, "args": placed,
            "layer_s": sp.layer_s, "prologue_s": sp.prologue_s, "epilogue_s": sp.epilogue_s,
            "priced_s": [sp.chunk_cost_s(c) for c in range(sp.chunks)],
            "predicted_step_s": plan.pipeline.timeline.total_s,
            "flops": float(cost.get("flops", 0.0)), "loss": float(out[2])}


def candidates(name: str) -> list[tuple[int, ...]]:
    n = MODELS[name][0]["layers"]
    return [(k, n - k) for k in range(n // 2 - 1, n)]


def time_rounds(builds: list[dict], rounds: int, steps: int) -> None:
    for b in builds:
        b["cpu"], b["wall"] = [], []
    for _ in range(rounds):
        for b in builds:
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(steps):
                jax.block_until_ready(b["run"](*b["args"]))
            b["cpu"].append((time.process_time() - c0) / steps)
            b["wall"].append((time.perf_counter() - w0) / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="")
    ap.add_argument("--choose-only", action="store_true",
                    help="print the search's split and prices, time nothing")
    args = ap.parse_args()
    rows = []
    for name in args.models.split(","):
        chosen = build(name, None)
        print(f"{name}: the search's split {chosen['counts']} (layer "
              f"{chosen['layer_s'] * 1e6:.3g} us, prologue {chosen['prologue_s'] * 1e6:.3g} "
              f"us, epilogue fwd+bwd {chosen['epilogue_s'] * 1e6:.3g} us per micro-batch)",
              flush=True)
        if args.choose_only:
            continue
        builds = [build(name, c) for c in candidates(name)]
        time_rounds(builds, args.rounds, args.steps)
        for b in builds:
            r = {k: v for k, v in b.items() if k not in ("run", "args")}
            r["chosen"] = b["counts"] == chosen["counts"]
            r["cpu_ms"] = statistics.median(b["cpu"]) * 1e3
            r["wall_ms"] = statistics.median(b["wall"]) * 1e3
            rows.append(r)
            print(f"  split {b['counts']}{' (chosen)' if r['chosen'] else ''}: cpu "
                  f"{r['cpu_ms']:.2f} ms, wall {r['wall_ms']:.2f} ms per step; priced chunks "
                  f"{[round(x * 1e6, 1) for x in b['priced_s']]} us, predicted step "
                  f"{b['predicted_step_s'] * 1e6:.0f} us; HLO FLOPs {b['flops']:.3g}; loss "
                  f"{b['loss']:.6f}", flush=True)
    print(f"load average {os.getloadavg()}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
