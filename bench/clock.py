"""The clock against the cost model: measured step time of many plans beside their predictions.

On the emulated 8-device CPU mesh ``(dp=2, mp=4)``:

1. ``jaxpar.calibrate`` measures this machine (collectives per axis and kind, FLOP rate);
2. every plan of every model (automatic in each search mode, data parallel, hand Megatron,
   FSDP-like, deliberately bad ones) is compiled, its inputs placed on the devices first;
3. the steps are timed in rounds, interleaved between plans (each round runs every plan
   ``steps`` times), best and median per plan;
4. beside them: jaxpar's prediction (``plan.step_time()`` under the calibrated profile), the
   yardstick (the compiled HLO priced with the same profile, :func:`jaxpar.inspect.yardstick`),
   and the yardstick's roofline variant (compute = max(FLOPs / rate, XLA's bytes accessed /
   the calibrated memory bandwidth));
5. Spearman rank correlation (all plans pooled, and within each model) and the median relative
   error of each predictor; plus, to explain disagreements, what XLA's compiled program does:
   bytes accessed, fusions, collectives.

Run: ``python bench/clock.py [--quick]``; writes ``bench/results/clock.json`` and ``clock.md``.
Timings need a quiet machine: other processes on the cores distort them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from scipy import stats  # noqa: E402

import jaxpar  # noqa: E402
from bench import plans as bp  # noqa: E402
from jaxpar._src.calibrate import measure  # noqa: E402

PREDICTORS = {"predicted_s": "jaxpar plan.step_time", "yardstick_s": "yardstick",
              "roofline_s": "yardstick, roofline"}
QUICK_PLANS = ("auto recursive", "data parallel", "Megatron", "FSDP", "replicated (bad)")
ALL_PLANS = ("auto recursive", "auto dp", "auto optimal", "data parallel", "Megatron", "FSDP",
             "Megatron transposed (bad)", "replicated (bad)")


def build(case, label: str, hardware, mesh, memory_bandwidth: float) -> dict:
    """Compiles plan ``label`` of ``case``; returns the callable with placed inputs and the
    predictions."""
    step, args = case.train_step()
    options = bp.plan_options(case, label, hardware)
    p = jaxpar.parallelize(step, mesh=mesh, **options)
    t0 = time.perf_counter()
    entry = p.compiled_entry(*args)
    lowered = p.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    leaves, tree = jax.tree.flatten(args)
    placed = jax.tree.unflatten(tree, [jax.device_put(x, s) for x, s in
                                       zip(leaves, entry.in_shardings, strict=True)])
    y = jaxpar.inspect.yardstick(compiled, hardware, mesh)
    roof = jaxpar.inspect.yardstick(compiled, hardware, mesh, memory_bandwidth=memory_bandwidth)
    text = compiled.as_text()
    return {
        "model": case.name, "plan": label, "run": compiled, "args": placed,
        "predicted_s": entry.plan.step_time(), "yardstick_s": y.step_time_s,
        "roofline_s": roof.step_time_s,
        "yardstick": y.to_dict(), "jaxpar_s": t1 - t0, "xla_compile_s": t2 - t1,
        "predicted_collectives": {k: v["count"] for k, v in
                                  entry.plan.communication_summary().items()},
        "fusions": len(re.findall(r"^\s*(?:ROOT\s+)?%?[\w.\-]+ = [^=]*\bfusion\(", text,
                                  re.M)),
        "hlo_instructions": len(re.findall(r"^\s+(?:ROOT\s+)?%?[\w.\-]+ = ", text, re.M)),
    }


def time_plans(rows: list[dict], rounds: int, steps: int) -> None:
    """Best and median seconds per step, rounds interleaved between plans."""
    for r in rows:  # warm up: first calls allocate
        jax.block_until_ready(r["run"](*r["args"]))
        r["samples"] = []
    for k in range(rounds):
        order = rows if k % 2 == 0 else rows[::-1]
        for r in order:
            t = time.perf_counter()
            for _ in range(steps):
                out = r["run"](*r["args"])
            jax.block_until_ready(out)
            r["samples"].append((time.perf_counter() - t) / steps)
    for r in rows:
        r["best_s"] = min(r["samples"])
        r["median_s"] = statistics.median(r["samples"])


def summarize(rows: list[dict]) -> dict:
    measured = np.array([r["median_s"] for r in rows])
    out = {}
    for key in PREDICTORS:
        pred = np.array([r[key] for r in rows])
        rel = np.abs(pred / measured - 1.0)
        per_model = []
        for model in dict.fromkeys(r["model"] for r in rows):
            idx = [i for i, r in enumerate(rows) if r["model"] == model]
            if len(idx) >= 3:
                rho = stats.spearmanr(pred[idx], measured[idx]).statistic
                per_model.append((model, float(rho)))
        out[key] = {"spearman_all": float(stats.spearmanr(pred, measured).statistic),
                    "spearman_per_model": dict(per_model),
                    "spearman_per_model_mean": float(np.mean([v for _, v in per_model]))
                    if per_model else float("nan"),
                    "median_relative_error": float(np.median(rel))}
    return out


def table(rows: list[dict], summary: dict, calib, meta: dict) -> list[str]:
    lines = ["## Calibrated prediction against the clock", "",
             f"Mesh (dp=2, mp=4) of 8 emulated CPU devices, {meta['cpus']} CPUs, load average "
             f"{meta['load']} at the start (timings need a quiet machine). Profile from "
             f"`jaxpar.calibrate` ({calib.seconds:.1f} s): {calib.flops_per_s / 1e9:.3g} GFLOP/s"
             f" and {calib.memory_bandwidth / 1e9:.3g} GB/s of memory traffic per device; "
             + "; ".join(
                 f"{a}: alpha {f.alpha * 1e6:.3g} us/step, beta {f.beta / 1e9:.3g} GB/s"
                 for a, f in calib.axis_fits) + ".", "",
             "measured = median (best) of the rounds, ms per train step; jaxpar = "
             "`plan.step_time()` under the calibrated profile; yardstick = the compiled HLO "
             "priced with the same profile (compute + collectives); roofline = the same with "
             "compute max(FLOPs / rate, bytes / memory bandwidth); MiB = XLA's bytes accessed "
             "per device; fusions / instructions of the partitioned HLO.", "",
             "| model | plan | measured ms | jaxpar ms | yardstick ms | roofline ms | "
             "collectives (HLO) | predicted collectives | MiB accessed | fusions | instr. | "
             "jaxpar s | XLA s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        pred = sum(r["predicted_collectives"].values())
        lines.append(
            f"| {r['model']} | {r['plan']} | {r['median_s'] * 1e3:.3g} ({r['best_s'] * 1e3:.3g})"
            f" | {r['predicted_s'] * 1e3:.3g} | {r['yardstick_s'] * 1e3:.3g} | "
            f"{r['roofline_s'] * 1e3:.3g} | "
            f"{r['yardstick']['collective_count']} | {pred:g} | "
            f"{r['yardstick']['bytes_accessed'] / 2**20:.3g} | {r['fusions']} | "
            f"{r['hlo_instructions']} | {r['jaxpar_s']:.2f} | {r['xla_compile_s']:.2f} |")
    lines += ["", "| predictor | Spearman (all plans) | Spearman within a model (mean) | "
              "median relative error |", "|---|---:|---:|---:|"]
    for key, name in PREDICTORS.items():
        s = summary[key]
        lines.append(f"| {name} | {s['spearman_all']:.2f} | {s['spearman_per_model_mean']:.2f}"
                     f" | {s['median_relative_error']:.0%} |")
    lines.append("")
    for key, name in PREDICTORS.items():
        per = ", ".join(f"{m} {v:.2f}" for m, v in summary[key]["spearman_per_model"].items())
        lines.append(f"Spearman within each model, {name}: {per}.")
    return lines


def run(quick: bool, out_dir: str, rounds: int | None = None, steps: int | None = None) -> dict:
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print("calibrating ...", flush=True)
    calib = measure(mesh, progress=False)
    print(calib.table(), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    calib.save(os.path.join(out_dir, "hw.json"))
    hw = calib.profile
    models = ("mlp", "wide_mlp", "gpt", "convnet")
    labels = QUICK_PLANS if quick else ALL_PLANS
    rows = []
    for name in models:
        case = bp.CLOCK_MODELS[name]()
        for label in labels:
            t = time.perf_counter()
            rows.append(build(case, label, hw, mesh, calib.memory_bandwidth))
            print(f"built {case.name} / {label} in {time.perf_counter() - t:.1f}s", flush=True)
    time_plans(rows, rounds or (3 if quick else 7), steps or (5 if quick else 20))
    summary = summarize(rows)
    meta = {"jax": jax.__version__, "cpus": os.cpu_count(), "load": f"{load:.1f}",
            "quick": quick}
    keep = [{k: v for k, v in r.items() if k not in ("run", "args")} for r in rows]
    result = {"meta": meta, "calibration": calib.to_dict(), "plans": keep, "summary": summary}
    with open(os.path.join(out_dir, "clock.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = table(rows, summary, calib, meta)
    with open(os.path.join(out_dir, "clock.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 plans per model, fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    run(args.quick, args.out, args.rounds, args.steps)


if __name__ == "__main__":
    main()
