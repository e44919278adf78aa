"""The zoo: models written by others (bench/zoo) through jaxpar, as a new user would.

For every model (a tiny configuration: 2 layers, width 64) on the mesh ``(dp=2, mp=4)``:

* numerics: the loss and gradients of every plan against ``jax.jit`` on one device (max abs
  difference);
* jaxpar's own time (trace + plan + lower) of the Adam train step beside XLA's compile time of
  the same program;
* the automatic plan (each search mode) beside data parallel and the hand Megatron plan, both in
  jaxpar's cost model (``plan.step_time()``) and in the yardstick of the compiled HLO
  (:func:`jaxpar.inspect.yardstick`), under the H100 preset (a GPU-like machine: what the plans
  are for) and, when given, a calibrated profile of this machine;
* the compiled program's collective count beside the plan's, after XLA:CPU's combiner (the
  plan priced under the ``cpu`` preset: comparable with a program compiled here) and after
  XLA:GPU's (the H100 profile, which also combines all-gathers and reduce-scatters);
* whether jaxpar warned about primitives it has no rule for.

Run: ``python bench/zoo_bench.py [--quick] [--models lm1b,gemma]``; writes
``bench/results/zoo.json`` and ``zoo.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402

import jaxpar  # noqa: E402
from bench import plans as bp  # noqa: E402
from bench import zoo  # noqa: E402

PLANS = ("data parallel", "Megatron", "auto recursive", "auto dp", "auto optimal")
QUICK_PLANS = ("data parallel", "Megatron", "auto recursive")


def _grad_options(case, label: str, hw) -> dict:
    """The plan ``label`` for ``grad_fn(params, state, *batch)`` (no optimizer state)."""
    options = bp.plan_options(case, label, hw)
    if "in_strategy" in options:
        specs, state, _opt, *batch = options["in_strategy"]
        options["in_strategy"] = (specs, state, *batch)
    if "batch_argnums" in options:
        options["batch_argnums"] = tuple(i - 1 for i in options["batch_argnums"])
    return options


def numerics(case, label: str, mesh, reference) -> dict:
    fn = case.grad_fn()
    args = (case.params, case.state, *case.batch)
    step = jaxpar.parallelize(fn, mesh=mesh, **_grad_options(case, label, None))
    loss, grads = step(*args)
    ref_loss, ref_grads = reference
    diff = max(float(jnp.max(jnp.abs(grads[k] - ref_grads[k]))) for k in ref_grads)
    return {"loss_diff": abs(float(loss) - float(ref_loss)), "grad_diff": diff,
            "grad_scale": max(float(jnp.max(jnp.abs(g))) for g in ref_grads.values())}


def train_step_plan(case, label: str, mesh, profiles: dict) -> dict:
    step, args = case.train_step()
    first = next(iter(profiles.values()))
    p = jaxpar.parallelize(step, mesh=mesh, **bp.plan_options(case, label, first))
    t0 = time.perf_counter()
    entry = p.compiled_entry(*args)
    lowered = p.lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    out = {"jaxpar_s": t1 - t0, "trace_s": entry.timings["trace"],
           "search_s": entry.timings["search"], "xla_compile_s": t2 - t1,
           "ops": entry.program.graph.count("op"),
           "collectives": jaxpar.inspect.collectives(compiled).count(),
           "predicted": _count(entry.plan),
           "predicted_cpu": _count(_repriced(step, args, mesh, label, case, entry.plan))}
    for name, hw in profiles.items():
        # the plan priced under each profile: the search ran under the first; the others
        # re-plan with the same options, so that jaxpar's prediction is its own under `hw`
        plan = entry.plan if hw is first else jaxpar.parallelize(
            step, mesh=mesh, **bp.plan_options(case, label, hw)).plan(*args)
        y = jaxpar.inspect.yardstick(compiled, hw, mesh)
        out[name] = {"model_s": plan.step_time(), "yardstick_s": y.step_time_s,
                     "yardstick_comm_s": y.communication_s,
                     "memory_mib": y.memory_bytes / 2**20}
    return out


def _count(plan) -> int:
    """Collectives the plan predicts, after the combiners of its profile."""
    return int(sum(v["count"] for v in plan.communication_summary().values()))


def _repriced(step, args, mesh, label: str, case, plan):
    """The same plan (its strategies, from a strategy file) priced under the ``cpu`` preset:
    combined as XLA:CPU combines (all-reduces only), so that its collective count compares
    with the program compiled here; the H100 profile combines as XLA:GPU does (all-gathers and
    reduce-scatters too)."""
    cpu = jaxpar.HardwareProfile(preset="cpu")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "plan.json")
        plan.save(path)
        with jaxpar.auto_parallel_context(strategy_ckpt_load_file=path):
            return jaxpar.parallelize(step, mesh=mesh,
                                      **bp.plan_options(case, label, cpu)).plan(*args)


def run(names, quick: bool, out_dir: str, calibrated: str | None) -> dict:
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    profiles = {"h100": jaxpar.HardwareProfile(preset="h100")}
    if calibrated:
        profiles["calibrated"] = jaxpar.HardwareProfile.load(calibrated)
    missing = zoo.available()
    labels = QUICK_PLANS if quick else PLANS
    results: list[dict] = []
    lines: list[str] = []
    for name in names:
        if name in missing:
            results.append({"model": name, "skipped": missing[name]})
            print(f"zoo {name}: not run, {missing[name]}", flush=True)
            lines = write(results, labels, list(profiles), quick, out_dir)
            continue
        case = zoo.BUILDERS[name]()
        reference = jax.jit(case.grad_fn())(case.params, case.state, *case.batch)
        row = {"model": name, "source": case.source, "hand": case.megatron_label, "plans": {}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", jaxpar.JaxparWarning)
            for label in labels:
                t = time.perf_counter()
                entry = train_step_plan(case, label, mesh, profiles)
                entry["numerics"] = numerics(case, label, mesh, reference)
                row["plans"][label] = entry
                print(f"zoo {name} / {label}: {time.perf_counter() - t:.1f}s "
                      f"{ {k: v for k, v in entry.items() if k != 'numerics'} } "
                      f"{entry['numerics']}", flush=True)
        row["warnings"] = sorted({str(w.message).split(";")[0] for w in caught
                                  if issubclass(w.category, jaxpar.JaxparWarning)})
        results.append(row)
        lines = write(results, labels, list(profiles), quick, out_dir)  # after every model
    print("\n".join(lines), flush=True)
    return {"models": results}


def write(results: list[dict], labels, profiles: list[str], quick: bool, out_dir: str
          ) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    meta = {"jax": jax.__version__, "cpus": os.cpu_count(), "quick": quick,
            "load": f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"}
    with open(os.path.join(out_dir, "zoo.json"), "w") as f:
        json.dump({"meta": meta, "models": results}, f, indent=1)
    lines = table(results, labels, profiles)
    with open(os.path.join(out_dir, "zoo.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def table(results: list[dict], labels, profiles: list[str]) -> list[str]:
    lines = ["## Models written by others (the zoo)", "",
             "Mesh (dp=2, mp=4), Adam train step. numerics: max abs difference of the loss / of "
             "the gradients against `jax.jit` on one device; jaxpar = trace + plan + lower (s), "
             "XLA = compile (s); model and yardstick: simulated us per step under each profile "
             "(jaxpar's `plan.step_time()`; the compiled HLO priced, "
             "`jaxpar.inspect.yardstick`); auto / best hand = the yardstick of the plan over the"
             " better of data parallel and the hand plan. HLO collectives: of the program "
             "compiled here (XLA:CPU); predicted: the plan's count after XLA:CPU's combiner "
             "(the same plan priced under the `cpu` preset: comparable with the HLO count) and "
             "after XLA:GPU's (the H100 profile the plan was made for).", "",
             "| model | plan | loss diff | grad diff | jaxpar s | XLA s | HLO collectives | "
             "predicted (cpu / h100 combiner) | "
             + " | ".join(f"{p} model us | {p} yardstick us" for p in profiles)
             + " | auto / best hand |",
             "|---|---|---:|---:|---:|---:|---:|---:|" + "---:|---:|" * len(profiles) + "---:|"]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['model']} | not run: {r['skipped']} |")
            continue
        plans = r["plans"]
        hand = [plans[k][profiles[0]]["yardstick_s"] for k in ("data parallel", "Megatron")
                if k in plans]
        best = min(hand) if hand else float("nan")
        for label in labels:
            if label not in plans:
                continue
            e = plans[label]
            n = e["numerics"]
            name = r["hand"] if label == "Megatron" else label
            cells = " | ".join(f"{e[p]['model_s'] * 1e6:.4g} | {e[p]['yardstick_s'] * 1e6:.4g}"
                               for p in profiles)
            ratio = (f"{e[profiles[0]]['yardstick_s'] / best:.2f}"
                     if label.startswith("auto") else "")
            lines.append(f"| {r['model']} | {name} | {n['loss_diff']:.1e} | {n['grad_diff']:.1e}"
                         f" | {e['jaxpar_s']:.2f} | {e['xla_compile_s']:.2f} | "
                         f"{e['collectives']} | {e['predicted_cpu']} / {e['predicted']} | "
                         f"{cells} | {ratio} |")
        if r["warnings"]:
            lines.append(f"| {r['model']} | warnings: {'; '.join(r['warnings'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="data parallel, hand, recursive")
    parser.add_argument("--models", default=",".join(zoo.NAMES))
    parser.add_argument("--calibrated", default=None,
                        help="a profile saved by jaxpar.calibrate (e.g. bench/results/hw.json)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    run(args.models.split(","), args.quick, args.out, args.calibrated)


if __name__ == "__main__":
    main()
