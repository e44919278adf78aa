"""The main job: auto-parallelise a GPT-style Flax model on 8 emulated CPU devices.

Semi-automatic mode on a (dp=2, mp=4) mesh: the model carries two ``jaxpar.shard`` annotations
per block (see ``gpt.py``), the batch is pinned to ``dp``, and jaxpar propagates the rest.  The
script prints the plan, the collectives XLA inserted, jaxpar's own time beside XLA's compile
time, then trains a few steps.

    python examples/gpt_semi_auto.py [--steps N] [--layers L] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import jaxpar  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="a tiny run for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.layers = 8, 1

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    cfg = gpt.GPTConfig(layers=args.layers)
    train_step, params, opt_state = gpt.make_train_step(cfg)
    step = jaxpar.parallelize(train_step, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=(None, None, (2, 1)), donate_argnums=(0, 1))
    data = gpt.corpus()
    stream = gpt.batches(data, args.batch, cfg.seq)
    batch = next(stream)

    t0 = time.perf_counter()
    plan = step.plan(params, opt_state, batch)
    lowered = step.lower(params, opt_state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params))
    print(f"GPT: {cfg.layers} layers, d_model {cfg.d_model}, {n_params:,} parameters; "
          f"mesh {dict(mesh.shape)} on {len(jax.devices())} {jax.devices()[0].platform} devices")
    print("\nParameter layouts (propagated from the jaxpar.shard annotations):")
    for name, spec in plan.input_layouts().items():
        if name.startswith("params."):
            print(f"  {name:<40} {spec}")
    print()
    print(plan.explain())
    colls = jaxpar.inspect.collectives(compiled)
    print("\nCollectives XLA inserted (per training step):")
    print(colls.table())
    mem = jaxpar.inspect.memory(compiled)
    print(f"\nper-device memory: {mem['total'] / 2**20:.2f} MiB "
          f"(arguments {mem['argument'] / 2**20:.2f} MiB)")
    print(f"jaxpar trace + plan + lower: {t1 - t0:.2f} s; XLA compile: {t2 - t1:.2f} s "
          f"(ratio {(t1 - t0) / (t2 - t1):.2f})")

    losses = []
    bar = tqdm(range(args.steps), desc="training", unit="step")
    for _ in bar:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        batch = next(stream)
    print(f"loss: first {losses[0]:.3f} -> last {losses[-1]:.3f}")
    return {"losses": losses, "collectives": colls, "plan": plan}


if __name__ == "__main__":
    main()
