"""``make bench``: what jaxpar's plans make XLA do, how good the searches are, and what jaxpar
itself costs.  Ten groups of tables, all in one run:

1. **programs**: for an MLP and GPT-style train steps in data-parallel, semi-automatic and
   automatic modes: jaxpar's own time (trace + plan + lower) beside XLA's compile time of the
   same program (their ratio), the collectives of the compiled program beside the cost model's
   prediction, per-device memory and FLOPs;
2. **search gap**: recursive and dynamic programming against the exact optimum (the ILP) on
   small models, and against pure data parallel;
3. **hand plans**: on GPT-style models of 12 and 24 layers and meshes (8,), (2,4), (4,2), priced
   for H100 nodes, the simulated step time of the automatic plan beside pure data parallel,
   Megatron tensor parallel and data x tensor parallel written by hand;
4. **search speed**: search time against depth (6, 12, 24, 48 layers) per search mode;
5. **a mesh of three axes**: every search's time and plan on a (2, 2, 2) mesh.
6. **plan reports**: size and build time of the HTML report of 2- and 24-layer GPTs, and how
   many compiled collectives it traced to their cause;
7. **checkpoints** (``bench/checkpoint.py``): bytes read and peak RSS of distributed loads by
   1 and 4 processes against the checkpoint's size, and ``infer_predict_layout`` beside XLA's
   compile.
8. **pipeline schedules** (``bench/pipeline.py``): for S=4 stages and M=16 micro-batches, each
   schedule's compiled temporaries, ticks, bubble fraction and collective-permutes, and the
   gradient bytes all-reduced over dp inside the loop and after it, beside the plan's predicted
   after-loop bytes (stacked stage weights + embedding/head/final norm) and whether they match;
   and (``bench/pipeline_memory.py``) a pipelined train step's memory per device, predicted
   (``plan.memory_bytes`` with the loop's slots, accumulators and tick) beside
   ``memory_analysis()``, per schedule, S, M, ZeRO level, residuals and row groups.
9. **recompute** (``bench/recompute.py``): a GPT train step's memory per device, predicted
   beside ``memory_analysis()``, against the recompute policy (none, dots, full, auto).
10. **parallel optimizer** (``bench/zero.py``): memory per device (compiled and predicted) and
    collectives of a GPT train step at each ZeRO level, beside ``jax.jit`` with level 3's
    shardings.

Results go to ``bench/results/results.json`` and ``bench/results/results.md``.  Then the
measurement sections, each its own script and files: ``bench/clock.py`` (the calibrated
prediction against the clock: ``clock.json``/``clock.md``, the profile in ``hw.json``),
``bench/zoo_bench.py`` (models written by others: ``zoo.json``/``zoo.md``) and
``bench/first_call.py`` (first calls in fresh processes, with and without the caches, and the
per-call cost, against ``jax.jit``: ``first_call.json``/``first_call.md``).
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
sys.path.insert(0, ROOT)
import gpt  # noqa: E402

import jaxpar  # noqa: E402

H100 = jaxpar.HardwareProfile(preset="h100")
MODES = ("recursive_programming", "dynamic_programming", "optimal")


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _gpt(layers: int, annotate: bool = False, dp: int = 2, mp: int = 4):
    cfg = gpt.GPTConfig(layers=layers, annotate=annotate, dp=dp, mp=mp)
    step, params, opt_state = gpt.make_train_step(cfg)
    batch = next(gpt.batches(gpt.corpus(), 16, cfg.seq))
    return step, (params, opt_state, batch)


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

    return step, (params, x, y)


# -- 1. programs ----------------------------------------------------------------------------------
def program_cases(quick: bool):
    mesh8 = jaxpar.make_mesh((8,), ("dp",))
    mesh24 = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step, args = mlp_case(512, 4, 64)
    megatron = [(1, 4), (4, 1), (1, 4), (4, 1)]
    yield ("mlp-4x512", "8", "data_parallel", step, args,
           dict(mesh=mesh8, parallel_mode="data_parallel"))
    yield ("mlp-4x512", "2x4", "semi_auto megatron", step, args,
           dict(mesh=mesh24, parallel_mode="semi_auto_parallel",
                in_strategy=(megatron, (2, 1), (2, 1))))
    yield ("mlp-4x512", "2x4", "auto recursive", step, args,
           dict(mesh=mesh24, parallel_mode="auto_parallel", hardware=H100))
    for layers in (2,) if quick else (2, 12):
        step, args = _gpt(layers, annotate=True)
        yield (f"gpt-{layers}L", "2x4", "semi_auto shard", step, args,
               dict(mesh=mesh24, parallel_mode="semi_auto_parallel",
                    in_strategy=(None, None, (2, 1))))
        step, args = _gpt(layers)
        yield (f"gpt-{layers}L", "8", "data_parallel", step, args,
               dict(mesh=mesh8, parallel_mode="data_parallel"))
        yield (f"gpt-{layers}L", "2x4", "auto recursive", step, args,
               dict(mesh=mesh24, parallel_mode="auto_parallel", hardware=H100))


def measure_program(step_fn, args, options) -> dict:
    step = jaxpar.parallelize(step_fn, **options)
    t0 = time.perf_counter()
    entry = step.compiled_entry(*args)
    t1 = time.perf_counter()
    lowered = step.lower(*args)
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    colls = jaxpar.inspect.collectives(compiled)
    summary = entry.plan.summary()
    mem = jaxpar.inspect.memory(compiled)
    predicted = summary["collective_wire_bytes"]
    measured = colls.wire_bytes()
    return {
        "ops": entry.program.graph.count("op"),
        "trace_s": entry.timings["trace"], "search_s": entry.timings["search"],
        "lower_s": t2 - t1, "jaxpar_s": (t1 - t0) + (t2 - t1), "xla_compile_s": t3 - t2,
        "ratio": ((t1 - t0) + (t2 - t1)) / (t3 - t2),
        "collectives": colls.count(), "collective_bytes": colls.total_bytes(),
        "collectives_by_kind": colls.by_kind(),
        "predicted_wire_bytes": predicted, "measured_wire_bytes": measured,
        "prediction_error": (predicted - measured) / measured if measured else 0.0,
        "memory_bytes": mem["total"], "flops": jaxpar.inspect.flops(compiled),
    }


def programs_table(rows: list[dict]) -> list[str]:
    lines = ["## Programs", "",
             "jaxpar = trace + plan + lower (s); XLA = compile of the same program (s); "
             "collectives per call and payload MiB per device, from the compiled HLO; predicted "
             "vs measured wire MiB per device (ring formulas).", "",
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
    return lines


# -- 2. search gap --------------------------------------------------------------------------------
def gap_rows() -> list[dict]:
    from tests import auto_models as am
    from tests import models

    mesh4 = jaxpar.make_mesh((4,), ("x",))
    mesh24 = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    bytes_only = jaxpar.HardwareProfile(preset="h100", intra_node_latency=0.0,
                                        inter_node_latency=0.0, collective_latency=0.0)
    two_links = jaxpar.HardwareProfile(preset="a100", axis_bandwidth={"dp": 25e9, "mp": 300e9})
    suite = {
        "mlp 6x256, batch 32": (*am.flax_mlp_adam(32, 256), mesh4, bytes_only),
        "mlp 6x32, batch 256": (*am.flax_mlp_adam(256, 32), mesh4, bytes_only),
        "transformer layer": (*am.transformer_block(), mesh4, bytes_only),
        "conv net": (*am.convnet(), mesh4, H100),
        "embedding + head": (*am.embedding_head(), mesh4, bytes_only),
        "transformer layer 2-D": (*am.transformer_block(batch=8, seq=32), mesh24, two_links),
        "mlp 2-D": (*am.wide_mlp(), mesh24, two_links),
        "scan stack 2-D": (am.sgd_step(models.scan_stack_loss),
                           models.init_stack(jax.random.key(0), layers=4, batch=32, d=64),
                           mesh24, H100),
    }
    rows = []
    for name, (fn, args, mesh, hw) in suite.items():
        row = {"case": name, "mesh": "x".join(map(str, mesh.devices.shape)), "hardware": hw.preset}
        for mode in MODES:
            p = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel",
                                   search_mode=mode, hardware=hw)
            entry = p.compiled_entry(*args)
            row[mode] = entry.plan.objective_s
            row[mode + "_search_s"] = entry.timings["search"]
            row["data_parallel"] = entry.plan.baseline_s
        rows.append(row)
        print("gap", name, {m: f"{row[m]:.3e}" for m in MODES}, flush=True)
    return rows


def gap_table(rows: list[dict]) -> list[str]:
    lines = ["## Search gap", "",
             "Simulated step time (cost model) of each search's plan; gap to the exact optimum "
             "(`optimal`, the ILP) in %.", "",
             "| case | mesh | optimal | recursive | gap | dynamic prog. | gap | data parallel |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        best = r["optimal"]

        def gap(mode: str, r: dict = r, best: float = best) -> str:
            return f"{(r[mode] / best - 1) * 100:+.1f}%"

        dp = f"{r['data_parallel']:.3g}" if r["data_parallel"] else "-"
        lines.append(f"| {r['case']} | {r['mesh']} | {best:.3g} | "
                     f"{r['recursive_programming']:.3g} | {gap('recursive_programming')} | "
                     f"{r['dynamic_programming']:.3g} | {gap('dynamic_programming')} | {dp} |")
    return lines


# -- 3. hand plans --------------------------------------------------------------------------------
def hand_rows(quick: bool) -> list[dict]:
    rows = []
    meshes = {"8": ((8,), ("dp",)), "2x4": ((2, 4), ("dp", "mp")), "4x2": ((4, 2), ("dp", "mp"))}
    for layers in (12,) if quick else (12, 24):
        for name, (shape, names) in meshes.items():
            mesh = jaxpar.make_mesh(shape, names)
            n = int(np.prod(shape))
            plans = {}
            step, args = _gpt(layers)
            plans["data parallel"] = jaxpar.parallelize(
                step, mesh=mesh, parallel_mode="data_parallel", hardware=H100)
            tp_step, tp_args = _gpt(layers, annotate=True, dp=1, mp=n)
            plans["Megatron TP"] = jaxpar.parallelize(
                tp_step, mesh=mesh, parallel_mode="semi_auto_parallel", hardware=H100,
                in_strategy=(None, None, (1, 1)))
            if len(shape) == 2:
                hy_step, hy_args = _gpt(layers, annotate=True, dp=shape[0], mp=shape[1])
                plans["DP x TP"] = jaxpar.parallelize(
                    hy_step, mesh=mesh, parallel_mode="semi_auto_parallel", hardware=H100,
                    in_strategy=(None, None, (shape[0], 1)))
            plans["auto (recursive)"] = jaxpar.parallelize(
                step, mesh=mesh, parallel_mode="auto_parallel", hardware=H100)
            row = {"model": f"gpt-{layers}L", "mesh": name}
            for label, p in plans.items():
                a = tp_args if label == "Megatron TP" else (
                    hy_args if label == "DP x TP" else args)
                row[label] = p.plan(*a).step_time()
            rows.append(row)
            print("hand", row, flush=True)
    return rows


def hand_table(rows: list[dict]) -> list[str]:
    labels = ["data parallel", "Megatron TP", "DP x TP", "auto (recursive)"]
    lines = ["## Automatic plans against hand plans", "",
             "Simulated step time per train step (Adam) on H100 nodes (NVLink inside a node), "
             "from the same cost model; the best hand plan in bold.", "",
             "| model | mesh | " + " | ".join(labels) + " | auto / best hand |",
             "|---|---|" + "---:|" * (len(labels) + 1)]
    for r in rows:
        hand = [r[k] for k in labels[:3] if k in r]
        best = min(hand)
        cells = []
        for k in labels:
            if k not in r:
                cells.append("-")
                continue
            cell = f"{r[k] * 1e6:.0f} us"
            cells.append(f"**{cell}**" if r[k] == best and k != labels[-1] else cell)
        lines.append(f"| {r['model']} | {r['mesh']} | " + " | ".join(cells) +
                     f" | {r['auto (recursive)'] / best:.3f} |")
    return lines


# -- 4. search speed ------------------------------------------------------------------------------
def speed_rows(quick: bool) -> list[dict]:
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    rows = []
    for layers in (6, 12) if quick else (6, 12, 24, 48):
        step, args = _gpt(layers)
        row = {"layers": layers}
        for mode in MODES:
            p = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                                   search_mode=mode, hardware=H100)
            entry = p.compiled_entry(*args)
            row["ops"] = entry.program.graph.count("op")
            row["trace_s"] = entry.timings["trace"]
            row[mode] = entry.timings["search"]
            row[mode + "_objective"] = entry.plan.objective_s
        t = time.perf_counter()
        lowered = p.lower(*args)
        row["lower_s"] = time.perf_counter() - t
        if layers <= 24:
            t = time.perf_counter()
            lowered.compile()
            row["xla_compile_s"] = time.perf_counter() - t
        rows.append(row)
        print("speed", row, flush=True)
    return rows


def speed_table(rows: list[dict]) -> list[str]:
    lines = ["## Search speed", "",
             "GPT-style train step (Adam) on mesh (2, 4), H100 profile. Search = building the "
             "cost graph, searching and assembling the plan (s); trace and lower are jaxpar's "
             "other stages; ratio = (trace + recursive search + lower) / XLA compile.", "",
             "| layers | ops | trace s | recursive s | dynamic prog. s | optimal s | lower s | "
             "XLA compile s | ratio |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        xla = r.get("xla_compile_s")
        ours = r["trace_s"] + r["recursive_programming"] + r["lower_s"]
        lines.append(
            f"| {r['layers']} | {r['ops']} | {r['trace_s']:.2f} | "
            f"{r['recursive_programming']:.2f} | {r['dynamic_programming']:.2f} | "
            f"{r['optimal']:.2f} | {r['lower_s']:.2f} | "
            f"{f'{xla:.2f}' if xla else '-'} | {f'{ours / xla:.2f}' if xla else '-'} |")
    return lines


# -- 5. a mesh of three axes -----------------------------------------------------------------------
def mesh3_rows() -> list[dict]:
    """Every search on a (2, 2, 2) mesh, where operators have 27 to 125 candidates and the
    exact searches' integer programs would have hundreds of thousands of variables."""
    from tests import auto_models as am

    mesh = jaxpar.make_mesh((2, 2, 2), ("a", "b", "c"))
    rows = []
    for name, (step, args) in {"scan + cumprod (4 layers)": am.scan_cumprod(),
                               "transformer layer": am.transformer_block(batch=8, seq=8,
                                                                         d=32, ff=64)}.items():
        row = {"case": name}
        for mode in MODES:
            p = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                                   search_mode=mode)
            entry = p.compiled_entry(*args)
            row["ops"] = entry.program.graph.count("op")
            row[mode] = entry.timings["search"]
            row[mode + "_objective"] = entry.plan.objective_s
            row[mode + "_notes"] = list(entry.plan.notes)
        rows.append(row)
        print("mesh3", row, flush=True)
    return rows


def mesh3_table(rows: list[dict]) -> list[str]:
    lines = ["## A mesh of three axes", "",
             "Search seconds (building the cost graph, searching, assembling the plan) and the "
             "plan's simulated step time on mesh (2, 2, 2), CPU profile.", "",
             "| case | ops | recursive s | dynamic prog. s | optimal s | recursive | "
             "dynamic prog. | optimal |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['ops']} | "
            + " | ".join(f"{r[m]:.2f}" for m in MODES) + " | "
            + " | ".join(f"{r[m + '_objective'] * 1e6:.1f} us" for m in MODES) + " |")


# -- 6. plan reports ------------------------------------------------------------------------------
def report_rows(quick: bool) -> list[dict]:
    """The HTML report of GPT train steps: its size, how long it takes to build (the compiled
    program given; wall and CPU seconds), and how many compiled collectives it traced to a plan
    operator."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    rows = []
    for layers in (2,) if quick else (2, 24):
        for mode, annotate in (("semi_auto shard", True), ("auto recursive", False)):
            step, args = _gpt(layers, annotate=annotate)
            options = dict(parallel_mode="semi_auto_parallel", in_strategy=(None, None, (2, 1))) \
                if annotate else dict(parallel_mode="auto_parallel", hardware=H100)
            p = jaxpar.parallelize(step, mesh=mesh, **options)
            plan = p.plan(*args)
            compiled = p.lower(*args).compile()
            t, c = time.perf_counter(), time.process_time()
            report = plan.report(compiled=compiled)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            found = report.analysis.collectives
            rows.append({"model": f"gpt-{layers}L", "mode": mode, "nodes": len(plan.decisions),
                         "bytes": len(report.html.encode()), "build_s": wall, "build_cpu_s": cpu,
                         "collectives": len(found),
                         "with_cause": sum(1 for x in found if x.causes),
                         "predicted": report.analysis.count("predicted")})
            print("report", rows[-1], flush=True)
    return rows


def report_table(rows: list[dict]) -> list[str]:
    lines = ["## Plan reports", "",
             "`plan.report(compiled=...)` of GPT train steps on mesh (2, 4): page size, build "
             "time (wall and CPU seconds; the program already compiled), and compiled collective "
             "instructions traced to the plan operator that caused them (of which the plan "
             "predicted that kind on those axes).", "",
             "| model | mode | nodes | report KiB | build s | build CPU s | collectives | "
             "with a cause | predicted |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['nodes']} | {r['bytes'] / 1024:.0f} | "
                     f"{r['build_s']:.2f} | {r['build_cpu_s']:.2f} | {r['collectives']} | "
                     f"{r['with_cause']} | {r['predicted']} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models (a smoke run)")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = parser.parse_args()
    programs = []
    for model, mesh, mode, fn, fn_args, options in program_cases(args.quick):
        result = measure_program(fn, fn_args, options)
        result.update(model=model, mesh=mesh, mode=mode)
        programs.append(result)
        print(f"program {model} {mesh} {mode}: jaxpar {result['jaxpar_s']:.2f}s XLA "
              f"{result['xla_compile_s']:.2f}s", flush=True)
    gaps = gap_rows()
    hands = hand_rows(args.quick)
    speeds = speed_rows(args.quick)
    reports = report_rows(args.quick)
    import checkpoint  # bench/checkpoint.py: distributed loads, infer_predict_layout

    ckpt = checkpoint.main(["--quick"] if args.quick else [])
    import pipeline  # bench/pipeline.py: the pipeline schedules side by side

    pipe = pipeline.main(["--quick"] if args.quick else [])
    import pipeline_memory  # bench/pipeline_memory.py: the pipeline's memory, predicted

    pipe_memory = pipeline_memory.main(["--quick"] if args.quick else [])
    import recompute  # bench/recompute.py: memory per device against the recompute policy

    remat = recompute.main(["--quick"] if args.quick else [])
    import zero  # bench/zero.py: memory and communication vs ZeRO level

    zero_levels = zero.main(["--quick"] if args.quick else [])
    mesh3 = mesh3_rows()
    os.makedirs(args.out, exist_ok=True)
    meta = {"jax": jax.__version__, "jaxpar": jaxpar.__version__, "python":
            platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "devices": f"{len(jax.devices())} x "
            f"{jax.devices()[0].platform}"}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"meta": meta, "programs": programs, "search_gap": gaps, "hand_plans": hands,
                   "search_speed": speeds, "reports": reports, "mesh3": mesh3, **ckpt, **pipe,
                   **pipe_memory, **remat, **zero_levels},
                  f, indent=1)
    lines = [f"# jaxpar benchmark ({meta['devices']}, jax {meta['jax']}, {meta['cpus']} CPUs)",
             ""]
    for table in (programs_table(programs), gap_table(gaps), hand_table(hands),
                  speed_table(speeds), mesh3_table(mesh3), report_table(reports),
                  checkpoint.load_table(ckpt["checkpoint_loads"]),
                  checkpoint.infer_table(ckpt["infer"]),
                  pipeline.table(pipe["pipeline_schedules"]),
                  pipeline.stacking_table(pipe["pipeline_stacking"]),
                  pipeline_memory.table(pipe_memory["pipeline_memory"]),
                  recompute.table(remat["recompute_policies"]),
                  zero.table(zero_levels["zero_levels"])):
        lines += table + [""]
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    from bench import clock, first_call, zoo, zoo_bench  # the measurement sections

    clock.run(args.quick, args.out)
    zoo_bench.run(zoo.NAMES, args.quick, args.out, os.path.join(args.out, "hw.json"))
    first_call.run(args.quick, args.out)  # first calls and per-call cost against jax.jit


if __name__ == "__main__":
    main()
