"""The pipelined plan's memory per device, predicted against ``compiled.memory_analysis()``.

A GPT-style train step with Adam (8 identical blocks, d=16, the shapes of
``tests/test_pipeline.py``), its blocks' weights stacked by stage (``PipelineCell.stack``), runs
as a pipeline on 8 devices ``(dp=8/S, pp=S)`` under GPipe, 1F1B and both interleaved
(``v = 2``), S = 2 and 4, a few micro-batch counts M, ZeRO off, level 1 (the Adam moments split over
dp, the stage gradients reduce-scattered) and level 3 (the stacked weights split too), stored
and recomputed residuals, and row groups on (the default on dp) and off (``(dp=1, pp=S)``: no
data parallelism, S devices).  Per row, from the
compiled program: arguments, outputs, temporaries and total (``jaxpar.inspect.memory``: argument
+ output - alias + temp); from the plan: ``plan.memory_bytes`` (the step's model of
``jaxpar/_src/program_memory.py`` with the loop's memory, ``jaxpar/_src/pipeline/memory.py``, a
temporary of the loop operator), its ratio to the compiled total, and the loop's parts: residual
slots, activation and cotangent slots (the peak activation memory a schedule keeps between
ticks), gradient accumulators beyond the loop's results, one tick's transient, at level 3 the
gathered stage weights' second copy, interleaved the stage's weights copied into the loop.  "without
loop": the same prediction less the loop's parts (the step's model alone, which sees the loop's
operands and results only).

"early": the split's memory check, made before the loop is traced
(``jaxpar/_src/pipeline/early.py``: the stage's weights as the step passes them, gathered at
level 3, their gradients, the batch and the loop, with the row groups' and ZeRO's terms for the
candidate's ``[S, v, k]`` shape), for the chosen split, against the compiled total and the
traced prediction; "early before": the check as it was before those terms
(``memory.split_bytes`` at d8cabe7: the weights and gradients whole, the rest's, and the loop
without the row groups' and ZeRO's accumulators, level 3's copies and the batch).  The check
counts the Adam moments given to ``cell.stack(opt_state=)``, laid out as their gradients:
"without state" leaves them out; "state/planned": the check's moments against the moments per
device as the step's plan lays them out; "probed": the check with the
residual leaves the loop's probe found instead of the check's own estimate (one layer's
``jax.vjp``, ``residuals.layer_stored``; every operator result of the layer before).
Microseconds: CPU time of one check (``time.process_time``, median of 7 rounds of 20, before
and after alternating).

    python bench/pipeline_memory.py [--quick | --rows 3,12 | --table]   (bench/run.py runs it)
"""

from __future__ import annotations

import dataclasses
import json
import os
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
from jaxpar._src.pipeline.early import draft_of, early_memory  # noqa: E402
from jaxpar._src.pipeline.memory import estimate  # noqa: E402
from jaxpar._src.pipeline.view import local_bytes  # noqa: E402
from jaxpar._src.spec import MeshShape  # noqa: E402

# S, M, schedule, interleave, residuals, ZeRO level, row groups (dp > 1)
CASES = (
    (2, 4, "gpipe", False, "store", 0, True),
    (2, 4, "1f1b", False, "store", 0, True),
    (2, 8, "gpipe", False, "store", 0, True),
    (2, 8, "1f1b", False, "store", 0, True),
    (2, 4, "gpipe", True, "store", 0, True),
    (2, 4, "1f1b", False, "recompute", 0, True),
    (2, 4, "1f1b", False, "store", 1, True),
    (2, 4, "1f1b", False, "store", 0, False),
    (2, 4, "gpipe", False, "recompute", 0, False),
    (4, 16, "gpipe", False, "store", 0, True),
    (4, 16, "1f1b", False, "store", 0, True),
    (4, 16, "gpipe", True, "store", 0, True),
    (4, 16, "1f1b", True, "store", 0, True),
    (4, 16, "gpipe", False, "recompute", 0, True),
    (4, 16, "1f1b", False, "recompute", 0, True),
    (4, 16, "1f1b", False, "store", 1, True),
    (4, 8, "1f1b", True, "store", 1, True),
    (4, 8, "1f1b", False, "store", 0, False),
    (2, 4, "1f1b", False, "store", 3, True),
)
QUICK = (0, 1, 6, 10)  # the rows --quick runs


def gpt_case(batch_rows: int = 16):
    """The GPT of ``tests/test_pipeline.py`` (8 blocks) and a batch of ``batch_rows``."""
    cfg = gpt.GPTConfig(layers=8, annotate=False, d_model=16, heads=2, ff=32, seq=8, vocab=64)
    graphdef, params = nnx.split(gpt.GPT(cfg, nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, inputs, targets):
        logits = nnx.merge(graphdef, p)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    batch = np.asarray(next(gpt.batches(gpt.corpus(), batch_rows, cfg.seq)))
    return loss_fn, params, batch


def split_bytes_before(program) -> float:
    """The split's memory check before the early estimate's row-group and ZeRO terms
    (``memory.split_bytes`` at d8cabe7), for the program's own slots."""
    mesh = MeshShape.of(program.mesh)
    sp, s, k = program.split, program.schedule, program.split.slots
    rest = sum(local_bytes(program.graph.values[v], program.spec(v), mesh) for v in program.rest)
    loop = estimate(s, slots=k, layer_bytes=sp.layer_bytes, stored_bytes=sp.residual_bytes,
                    full_bytes=sp.residual_bytes, carried_bytes=program.act_bytes,
                    recompute=program.config.residuals == "recompute", extra_grad_bytes=rest,
                    tick_grad_bytes=rest)
    return 2 * s.repeats * k * sp.layer_bytes + 2 * rest + loop.total


def check_cost(program) -> tuple[float, float]:
    """CPU microseconds of one memory check, before and after (median of 7 alternating rounds
    of 20 calls; ``draft_of`` builds what ``build_program`` builds per candidate)."""
    before, after = [], []
    for _ in range(7):
        t = time.process_time()
        for _ in range(20):
            split_bytes_before(program)
        before.append((time.process_time() - t) / 20 * 1e6)
        t = time.process_time()
        for _ in range(20):
            early_memory(draft_of(program))
        after.append((time.process_time() - t) / 20 * 1e6)
    return float(np.median(before)), float(np.median(after))


def measure(S: int, M: int, schedule: str, interleave: bool, residuals: str, zero: int,
            groups: bool) -> dict:
    """One row: the Adam train step pipelined so, planned and compiled."""
    dp = 8 // S if groups else 1
    loss_fn, params, batch = gpt_case(max(16, M * dp))  # each micro-batch's rows split on dp
    mesh = jaxpar.make_mesh((dp, S), ("dp", "pp"))
    opt = optax.adam(1e-3)
    extra = {"enable_parallel_optimizer": True, "parallel_optimizer_config": {
        "optimizer_level": f"level{zero}", "parallel_optimizer_threshold": 0}} if zero else {}
    with jaxpar.auto_parallel_context(
            parallel_mode="semi_auto_parallel", mesh=mesh, pipeline_stages=S, micro_batches=M,
            pipeline_config={"pipeline_scheduler": schedule, "pipeline_interleave": interleave,
                             "pipeline_residuals": residuals}, **extra):
        cell = jaxpar.PipelineCell(loss_fn)

        def step(p, o, b):
            value, grads = jax.value_and_grad(cell)(p, b[:, :-1], b[:, 1:])
            updates, o = opt.update(grads, o, p)
            return optax.apply_updates(p, updates), o, value

        # the split's memory check counts the Adam moments given here (early.py)
        p = cell.stack(params, batch[:, :-1], batch[:, 1:], opt_state=opt.init(params))
        args = (p, opt.init(p), batch)
        f = jaxpar.parallelize(step, batch_argnums=2)
        t = time.perf_counter()
        plan = f.plan(*args)
        compiled = f.lower(*args).compile()
        seconds = time.perf_counter() - t
    mem = jaxpar.inspect.memory(compiled)
    pipe = plan.pipeline
    loop = pipe.memory
    program = cell.last_program
    early = early_memory(draft_of(program))
    assert early.total == pipe.split.memory_bytes, (early, pipe.split)  # what the check counted
    n_p = len(jax.tree.leaves(args[0]))  # the Adam state's leaves follow the parameters'
    n_o = len(jax.tree.leaves(args[1]))
    mesh_shape = MeshShape.of(mesh)
    state = sum(local_bytes(a, sp, mesh_shape) for a, sp in zip(
        jax.tree.leaves(args[1]), plan.input_specs[n_p:n_p + n_o], strict=True))
    cost_before, cost_after = check_cost(program)
    # the same check with the residual leaves the loop's probe found (the traced program's id)
    probed = early_memory(dataclasses.replace(draft_of(program), id=program.id)).total
    return {"S": S, "M": M, "schedule": schedule + (" v=2" if interleave else ""),
            "residuals": residuals, "zero": zero, "groups": pipe.gradient_reduction is not None
            and pipe.gradient_reduction.once, "dp": dp, "split": list(pipe.split.counts),
            "in_flight": list(pipe.schedule.in_flight()), "rows": int(batch.shape[0]),
            "argument": mem["argument"], "output": mem["output"], "temp": mem["temp"],
            "total": mem["total"], "predicted": float(plan.memory_bytes),
            "without_loop": float(plan.memory_bytes) - loop.total,
            "residual_slots": loop.residual_slots,
            "activation_slots": loop.activation_slots + loop.cotangent_slots,
            "accumulators": loop.accumulators, "tick": loop.tick,
            "weight_copies": loop.weight_copies, "stack_copy": loop.stack_copy,
            "seconds": seconds,
            "early": early.total, "early_before": split_bytes_before(program),
            "early_parts": dataclasses.asdict(early), "early_probed": probed, "state": float(state),
            "early_state": early.state,
            "check_us_before": cost_before, "check_us": cost_after}


def rows(quick: bool = False, only: list[int] | None = None) -> list[dict]:
    """The rows of ``CASES`` (``quick``: those of ``QUICK``; ``only``: those indices), each
    with its index (``"case"``)."""
    out = []
    for i, case in enumerate(CASES):
        if (quick and i not in QUICK) or (only is not None and i not in only):
            continue
        out.append(dict(measure(*case), case=i))
        r = out[-1]
        print(f"pipeline memory {case}: predicted {r['predicted'] / 2**10:.1f} KiB, compiled "
              f"{r['total'] / 2**10:.1f} KiB ({r['predicted'] / r['total']:.3f}), "
              f"{r['seconds']:.0f} s; early {r['early'] / r['total']:.3f} (before "
              f"{r['early_before'] / r['total']:.3f}, without state "
              f"{(r['early'] - r['early_state']) / r['total']:.3f}, state/planned "
              f"{r['early_state'] / r['state']:.3f}, traced {r['predicted'] / r['total']:.3f})",
              flush=True)
    return out


def table(rows: list[dict]) -> list[str]:
    lines = ["## Pipeline memory per device: predicted (`plan.memory_bytes`) vs compiled",
             "",
             "GPT 8 blocks d=16 seq=8, Adam, stacked weights, mesh (dp, pp=S), rows: the "
             "batch. KiB per device. Compiled: `jaxpar.inspect.memory` (arguments + outputs + "
             "temporaries). Loop parts predicted (`plan.pipeline.memory`): residual "
             "slots, activation + cotangent slots, accumulators beyond the loop's results, "
             "one tick, copies (ZeRO level 3: the gathered stage weights' second copy; "
             "interleaved: the stage's weights copied into the loop). "
             "Without loop: the prediction less the loop's parts.",
             "",
             "| S | M | rows | schedule | residuals | ZeRO | groups | split | args | out | "
             "temp | total | predicted | pred/total | without loop/total | res slots | "
             "act+ct slots | acc | tick | copies |",
             "|---:|---:|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
             "---:|---:|---:|"]
    for r in rows:
        def k(key: str, r: dict = r) -> str:
            return f"{r[key] / 2**10:.1f}"

        lines.append(
            f"| {r['S']} | {r['M']} | {r['rows']} | {r['schedule']} | {r['residuals']} | "
            f"{r['zero']} | "
            f"{'on' if r['groups'] else 'off'} | {r['split']} | {k('argument')} | "
            f"{k('output')} | {k('temp')} | {k('total')} | {k('predicted')} | "
            f"{r['predicted'] / r['total']:.3f} | {r['without_loop'] / r['total']:.3f} | "
            f"{k('residual_slots')} | {k('activation_slots')} | {k('accumulators')} | "
            f"{k('tick')} | "
            f"{(r.get('weight_copies', 0.0) + r.get('stack_copy', 0.0)) / 2**10:.1f} |")
    lines += ["", "## The split's memory check before the loop is traced: early estimate vs "
              "compiled", "",
              "KiB per device, the chosen split. Early: `plan.pipeline.split.memory_bytes` "
              "(`pipeline/early.py`); before: the check at d8cabe7 (`memory.split_bytes`); "
              "w/o state: early less its Adam moments; state/planned: the early moments "
              "against the plan's layout of them; "
              "traced: `plan.memory_bytes`; probed: early with the probe's residual leaves instead "
              "of the check's own. us: CPU microseconds of one check.", "",
              "| S | M | schedule | residuals | ZeRO | groups | compiled | traced | "
              "early before | early | before/compiled | early/compiled | "
              "w/o state/compiled | state/planned | early/traced | probed/compiled | "
              "us before | us |",
              "|---:|---:|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
              "---:|"]
    for r in rows:
        if "early" not in r:
            continue
        t = r["total"]
        lines.append(
            f"| {r['S']} | {r['M']} | {r['schedule']} | {r['residuals']} | {r['zero']} | "
            f"{'on' if r['groups'] else 'off'} | {t / 2**10:.1f} | "
            f"{r['predicted'] / 2**10:.1f} | {r['early_before'] / 2**10:.1f} | "
            f"{r['early'] / 2**10:.1f} | {r['early_before'] / t:.3f} | {r['early'] / t:.3f} | "
            f"{(r['early'] - r['early_state']) / t:.3f} | {r['early_state'] / r['state']:.3f} | "
            f"{r['early'] / r['predicted']:.3f} | "
            f"{r['early_probed'] / t:.3f} | "
            f"{r['check_us_before']:.0f} | {r['check_us']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    """``--quick``: the rows of ``QUICK``; ``--rows 3,12``: those rows alone, merged by index
    into ``bench/results/pipeline_memory.json`` (compiles are slow: one row per process keeps
    each one's memory its own); ``--table``: the tables of that file, nothing run."""
    argv = sys.argv[1:] if argv is None else argv
    path = os.path.join(ROOT, "bench", "results", "pipeline_memory.json")
    only = [int(i) for i in argv[argv.index("--rows") + 1].split(",")] if "--rows" in argv \
        else None
    if "--table" in argv:
        with open(path) as f:
            result = json.load(f)
    else:
        result = {"pipeline_memory": rows("--quick" in argv, only)}
    if __name__ == "__main__" and "--table" not in argv:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if only is not None and os.path.exists(path):  # the other rows as they were
            with open(path) as f:
                kept = [r for r in json.load(f)["pipeline_memory"] if r.get("case") not in only]
            result["pipeline_memory"] = sorted(kept + result["pipeline_memory"],
                                               key=lambda r: r.get("case", -1))
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    if __name__ == "__main__":
        print("\n".join(table(result["pipeline_memory"])))
    return result


if __name__ == "__main__":
    main()
