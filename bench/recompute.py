"""``make bench``'s recompute table: memory per device against the recompute policy.

The GPT-style train step of ``examples/gpt.py`` (Adam, batch 128, no annotations) with every
block marked ``jaxpar.recompute(block, policy=p)`` for ``p`` in none / dots / full, planned by
``auto_parallel`` on meshes ``(8,)`` and ``(dp=2, mp=4)``, and (on ``(8,)``) with
``policy="auto"`` under a budget between the extremes and one just above the smallest.  Per
row: jaxpar's predicted peak (``plan.memory_bytes``, ``search/memory.py``) beside the compiled
program's (``memory_analysis()``: arguments + outputs - aliased + temporaries, per device),
their ratio, the temporaries, XLA's FLOPs per device, and the policies the plan chose.

    python bench/recompute.py [--quick]      (bench/run.py runs it too)
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import gpt  # noqa: E402

import jaxpar  # noqa: E402

BATCH = 128  # sequences per step: enough that activations, not weights, fill the memory


def gpt_step(layers: int, policy: str):
    """``(train_step, args)``: ``examples/gpt.py``'s step with its blocks recomputed."""
    cfg = gpt.GPTConfig(layers=layers, annotate=False)  # the search decides every layout
    train_step, params, opt_state = gpt.make_train_step(cfg, recompute=policy)
    batch = next(gpt.batches(gpt.corpus(), BATCH, cfg.seq))
    return train_step, (params, opt_state, batch)


def measure(layers: int, policy: str, budget: float | None, mesh) -> dict:
    step, args = gpt_step(layers, policy)
    hw = jaxpar.HardwareProfile(memory_per_device=budget) if budget else None
    t0 = time.perf_counter()
    f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel", hardware=hw)
    plan = f.plan(*args)
    compiled = f.lower(*args).compile()
    seconds = time.perf_counter() - t0
    mem = jaxpar.inspect.memory(compiled)
    chosen = [n.rsplit(": ", 1)[1] for n in plan.notes if n.startswith("recompute block")]
    return {"layers": layers, "mesh": str(mesh.shape_tuple), "policy": policy, "budget": budget,
            "predicted": plan.memory_bytes, "compiled": mem["total"], "temp": mem["temp"],
            "ratio": plan.memory_bytes / mem["total"], "flops": jaxpar.inspect.flops(compiled),
            "chosen": chosen, "seconds": seconds}


def main(argv: list[str] | None = None) -> dict:
    quick = "--quick" in (argv if argv is not None else sys.argv[1:])
    layers = 2 if quick else 4
    rows = []
    for shape, names in (((8,), ("dp",)), ((2, 4), ("dp", "mp"))):
        mesh = jaxpar.make_mesh(shape, names)
        rows += [measure(layers, p, None, mesh) for p in ("none", "dots", "full")]
        print(f"recompute bench: mesh {shape} done", flush=True)
    mesh = jaxpar.make_mesh((8,), ("dp",))
    top, low = rows[0]["compiled"], min(r["compiled"] for r in rows[:3])
    for budget in (0.5 * (top + low), 1.02 * low):  # between the extremes, and the smallest
        rows.append(measure(layers, "auto", budget, mesh))
    return {"recompute_policies": rows}


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def table(rows: list[dict]) -> list[str]:
    lines = ["## Memory per device against the recompute policy (GPT train step)", "",
             "| layers | mesh | policy | budget MiB | predicted MiB | compiled MiB "
             "| predicted/compiled | temp MiB | GFLOPs/device | chosen | plan+compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        budget = _mib(r["budget"]) if r["budget"] else "-"
        lines.append(
            f"| {r['layers']} | {r['mesh']} | {r['policy']} | {budget} | {_mib(r['predicted'])} | "
            f"{_mib(r['compiled'])} | {r['ratio']:.2f} | {_mib(r['temp'])} | "
            f"{r['flops'] / 1e9:.3f} | {' '.join(r['chosen']) or '-'} | {r['seconds']:.1f} |")
    return lines


if __name__ == "__main__":
    out = main()
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "recompute.json"), "w") as f:
        json.dump(out, f, indent=1, default=float)
    print("\n".join(table(out["recompute_policies"])))
