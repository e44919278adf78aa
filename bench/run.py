"""``make bench``: what jaxpar's plans make XLA do, and what jaxpar itself costs.

For a few models, meshes and modes it records, in one run:

* jaxpar's own time: trace + plan (search) + lower, in seconds, and XLA's compile time of the
  same program, with their ratio;
* the collectives of the compiled program (count per call, payload bytes per device) beside the
  cost model's prediction;
* per-device memory and FLOPs of the compiled program.

Wall-clock step time of 8 emulated CPU devices is not reported: it does not rank strategies.
Results go to ``bench/results/results.json`` and ``bench/results/results.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import gpt  # noqa: E402

import jaxpar  # noqa: E402


def mlp_case(width: int, depth: int, batch: int):
    keys = jax.random.split(jax.random.key(0), depth + 2)
    params = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:depth]]
    x = jax.random.normal(keys[-2], (batch, width))
    y = jax.random.normal(keys[-1], (batch, width))

    def step(params, x, y):
        def loss_fn(ps):
            h = x
            for w in ps:
                h = jax.nn.relu(h @ w)
            return jnp.mean((h - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        return [p - 0.01 * g for p, g in zip(params, grads, strict=True)], loss

    megatron = [(1, -1) if i % 2 == 0 else (-1, 1) for i in range(depth)]
    return step, (params, x, y), megatron


def _counts(pattern, mp):
    return tuple(mp if c == -1 else c for c in pattern)


def cases(quick: bool):
    mesh8 = jaxpar.make_mesh((8,), ("dp",))
    mesh24 = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    mesh42 = jaxpar.make_mesh((4, 2), ("dp", "mp"))
    out = []
    mlp_step, mlp_args, pattern = mlp_case(512, 4, 64)
    for mesh_name, mesh, dp, mp in (("8", mesh8, 8, 1), ("2x4", mesh24, 2, 4),
                                    ("4x2", mesh42, 4, 2)):
        out.append(("mlp-4x512", mesh_name, "data_parallel", mlp_step, mlp_args,
                    dict(mesh=mesh, parallel_mode="data_parallel")))
        if mp > 1:
            ws = [_counts(p, mp) for p in pattern]
            out.append(("mlp-4x512", mesh_name, "semi_auto megatron", mlp_step, mlp_args,
                        dict(mesh=mesh, parallel_mode="semi_auto_parallel",
                             in_strategy=(ws, (dp, 1), (dp, 1)))))
    layer_counts = (2,) if quick else (2, 6, 12)
    for layers in layer_counts:
        for mesh_name, mesh, dp, mp in (("2x4", mesh24, 2, 4), ("4x2", mesh42, 4, 2)):
            cfg = gpt.GPTConfig(layers=layers, dp=dp, mp=mp)
            step, params, opt_state = gpt.make_train_step(cfg)
            batch = next(gpt.batches(gpt.corpus(), 16, cfg.seq))
            out.append((f"gpt-{layers}L", mesh_name, "semi_auto shard", step,
                        (params, opt_state, batch),
                        dict(mesh=mesh, parallel_mode="semi_auto_parallel",
                             in_strategy=(None, None, (dp, 1)))))
        cfg = gpt.GPTConfig(layers=layers, annotate=False)
        step, params, opt_state = gpt.make_train_step(cfg)
        batch = next(gpt.batches(gpt.corpus(), 16, cfg.seq))
        out.append((f"gpt-{layers}L", "8", "data_parallel", step, (params, opt_state, batch),
                    dict(mesh=mesh8, parallel_mode="data_parallel")))
    return out


def measure(step_fn, args, options) -> dict:
    step = jaxpar.parallelize(step_fn, **options)
    t0 = time.perf_counter()
    entry = step.compiled_entry(*args)
    t1 = time.perf_counter()
    lowered = step.lower(*args)
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    colls = jaxpar.inspect.collectives(compiled)
    plan = entry.plan
    predicted = plan.communication_summary()
    mem = jaxpar.inspect.memory(compiled)
    return {
        "ops": entry.program.graph.count("op"),
        "trace_s": entry.timings["trace"], "search_s": entry.timings["search"],
        "lower_s": t2 - t1, "jaxpar_s": (t1 - t0) + (t2 - t1), "xla_compile_s": t3 - t2,
        "ratio": ((t1 - t0) + (t2 - t1)) / (t3 - t2),
        "collectives": colls.count(), "collective_bytes": colls.total_bytes(),
        "collectives_by_kind": colls.by_kind(),
        "predicted_count": sum(v["count"] for v in predicted.values()),
        "predicted_wire_bytes": sum(v["wire_bytes"] for v in predicted.values()),
        "measured_wire_bytes": colls.wire_bytes(),
        "memory_bytes": mem["total"], "flops": jaxpar.inspect.flops(compiled),
    }


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer models (CI smoke)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    rows = []
    for model, mesh, mode, fn, fn_args, options in cases(args.quick):
        result = measure(fn, fn_args, options)
        result.update(model=model, mesh=mesh, mode=mode)
        rows.append(result)
        print(f"{model:<12}{mesh:<6}{mode:<22} jaxpar {result['jaxpar_s']:.2f}s  XLA "
              f"{result['xla_compile_s']:.2f}s  ratio {result['ratio']:.2f}  collectives "
              f"{result['collectives']} ({_mib(result['collective_bytes'])} MiB)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"jax": jax.__version__, "jaxpar": jaxpar.__version__, "python":
            platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "devices": f"{len(jax.devices())} x "
            f"{jax.devices()[0].platform}"}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    lines = [f"# jaxpar benchmark ({meta['devices']}, jax {meta['jax']}, {meta['cpus']} CPUs)",
             "", "jaxpar = trace + plan + lower (s); XLA = compile of the same program (s); "
             "collectives per call and payload MiB per device from the compiled HLO; predicted "
             "= cost-model wire MiB per device vs measured wire MiB.", "",
             "| model | mesh | mode | ops | jaxpar s | XLA s | ratio | collectives | MiB | "
             "predicted wire MiB | measured wire MiB | memory MiB/device | GFLOP/device |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['mode']} | {r['ops']} | {r['jaxpar_s']:.2f} | "
            f"{r['xla_compile_s']:.2f} | {r['ratio']:.2f} | {r['collectives']} | "
            f"{_mib(r['collective_bytes'])} | {_mib(r['predicted_wire_bytes'])} | "
            f"{_mib(r['measured_wire_bytes'])} | {_mib(r['memory_bytes'])} | "
            f"{r['flops'] / 1e9:.3f} |")
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
