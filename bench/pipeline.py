"""``make bench``'s pipeline table: what each schedule holds in memory and how much it idles.

A GPT-style train step (8 identical blocks) runs as a pipeline of ``S = 4`` stages over
``M = 16`` micro-batches on a ``(dp=2, pp=4)`` mesh of 8 devices, under every schedule jaxpar
has: GPipe, 1F1B, both interleaved (``v = 2`` chunks per stage), and GPipe and 1F1B keeping only
each stage's input for the backward (``pipeline_residuals="recompute"``).  Per schedule, from the
compiled program: per-device temporaries (``compiled.memory_analysis().temp_size_in_bytes``: the
activations, residual slots and buffers of the step; arguments and results are the weights and
gradients, the same for every schedule), the collective-permutes over ``pp``, and from the plan:
ticks, the simulated timeline's bubble fraction (unit costs: forward 1, backward 2 per stage) and
the micro-batch chunks in flight per stage, and the gradient bytes reduced over ``dp`` a step
(loop trip counts included) inside the loop and after it, beside the plan's prediction
(``plan.pipeline.gradient_reduction``): ``after_loop_bytes``, split into the stacked stage
weights' gradients (when reduced once, after the loop) and the ends' (embedding, head, final
norm: summed per row group in the loop, ``ends.py``), and "matches" where the compiled step's
after-loop all-reduces total exactly the prediction.  Columns over dp: "all" every all-reduce and
reduce-scatter over dp; "in loop" the gradients' inside the loop's code (the loss's scalar
all-reduces aside), in brackets the plan's prediction (the stage weights' when reduced per chunk
backward, else 0); "after" the gradients' all-reduces in the step's entry computation.  The
unpipelined step on the same mesh (the batch on all 8 devices) is the reference line.

A second table trains the same GPT with Adam under 1F1B, the blocks' weights per layer (laid
out by the step's plan) against stacked by stage (``PipelineCell.stack``): per-device argument
bytes (parameters and Adam moments) and temporaries, and the bytes the step moves over ``pp``
other than the loop's rotations (all-gathers, all-to-alls), at ZeRO level 0 and 1.

    python bench/pipeline.py [--quick]      (bench/run.py runs it too)
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

import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import gpt  # noqa: E402
from flax import nnx  # noqa: E402

import jaxpar  # noqa: E402

SCHEDULES = (  # name, pipeline_config
    ("gpipe", {"pipeline_scheduler": "gpipe"}),
    ("1f1b", {"pipeline_scheduler": "1f1b"}),
    ("gpipe interleaved v=2", {"pipeline_scheduler": "gpipe", "pipeline_interleave": True}),
    ("1f1b interleaved v=2", {"pipeline_scheduler": "1f1b", "pipeline_interleave": True}),
    ("gpipe, recompute", {"pipeline_scheduler": "gpipe", "pipeline_residuals": "recompute"}),
    ("1f1b, recompute", {"pipeline_scheduler": "1f1b", "pipeline_residuals": "recompute"}),
)


def _case(quick: bool):
    cfg = gpt.GPTConfig(layers=8, annotate=False, d_model=32 if quick else 64, heads=4,
                        ff=64 if quick else 256, seq=16 if quick else 32, vocab=64)
    model = gpt.GPT(cfg, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(p, inputs, targets):
        logits = nnx.merge(graphdef, p)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    batch = np.asarray(next(gpt.batches(gpt.corpus(), 32, cfg.seq)))
    return cfg, loss_fn, params, batch


def _measure(step, params, batch) -> dict:
    t = time.perf_counter()
    compiled = step.lower(params, batch).compile()
    compile_s = time.perf_counter() - t
    mem = compiled.memory_analysis()
    colls = jaxpar.inspect.collectives(compiled)
    permutes = [c for c in colls if c.kind == "collective-permute"]
    over_dp = [c for c in colls if c.kind in ("all-reduce", "reduce-scatter") and c.axes
               and "dp" in c.axes]
    # after the loop: the step's entry computation (a phase of one tick also runs once a step,
    # but inside the loop's code); the loss's scalar all-reduces are no gradient's
    after = [c for c in over_dp if c.computation.startswith("main")]
    grads = [c for c in over_dp if not all(sh.endswith("[]") for sh in c.shapes)]
    return {"dp_reduce_bytes": sum(c.nbytes * c.count for c in over_dp),
            "dp_reduce_in_loop_bytes": sum(c.nbytes * c.count for c in grads
                                           if c not in after),
            "dp_reduce_after_loop_bytes": sum(c.nbytes * c.count for c in grads
                                              if c in after and c.kind == "all-reduce"),
            "temp_bytes": int(mem.temp_size_in_bytes),
            "argument_bytes": int(mem.argument_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes),
            "permutes": sum(c.count for c in permutes),
            "permute_axes": sorted({"+".join(c.axes or ("?",)) for c in permutes}),
            "compile_s": compile_s}


def rows(quick: bool = False) -> list[dict]:
    cfg, loss_fn, params, batch = _case(quick)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "pp"))
    out = []
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh):
        def plain(p, b):
            return jax.value_and_grad(loss_fn)(p, b[:, :-1], b[:, 1:])

        ref = _measure(jaxpar.parallelize(plain, batch_argnums=1), params, batch)
        out.append({"schedule": "unpipelined (batch over 8)", **ref})
        for name, config in SCHEDULES:
            cell = jaxpar.PipelineCell(loss_fn)

            def step(p, b, cell=cell):
                return jax.value_and_grad(cell)(p, b[:, :-1], b[:, 1:])

            with jaxpar.auto_parallel_context(pipeline_stages=4, micro_batches=16,
                                              pipeline_config=config):
                pstep = jaxpar.parallelize(step, batch_argnums=1)
                row = _measure(pstep, params, batch)
                pipe = pstep.plan(params, batch).pipeline
            red = pipe.gradient_reduction
            row.update(schedule=name, ticks=pipe.schedule.num_ticks,
                       bubble_unit=pipe.unit_timeline.bubble_fraction,
                       bubble_model=pipe.timeline.bubble_fraction,
                       in_flight=list(pipe.schedule.in_flight()),
                       split=list(pipe.split.counts),
                       grad_reduce_once=red.once,
                       grad_reduce_predicted=red.step_bytes,
                       predicted_after_loop_bytes=red.after_loop_bytes,
                       predicted_stacked_bytes=red.after_loop_bytes - red.ends_bytes
                       + red.ends_scattered_bytes,  # all-reduced (ZeRO: not scattered)
                       predicted_ends_bytes=red.ends_bytes - red.ends_scattered_bytes,
                       predicted_in_loop_bytes=0.0 if red.once else red.step_bytes,
                       matches=red.after_loop_bytes == row["dp_reduce_after_loop_bytes"])
            out.append(row)
            print(f"pipeline {name}: temp {row['temp_bytes'] / 2**20:.2f} MiB, "
                  f"compile {row['compile_s']:.1f}s", flush=True)
    for r in out:
        r.update(layers=cfg.layers, d_model=cfg.d_model, seq=cfg.seq, batch=int(batch.shape[0]))
    return out


def stacking_rows(quick: bool = False) -> list[dict]:
    """Per-layer against stacked layer weights, in a train step with Adam (see the docstring)."""
    cfg, loss_fn, params, batch = _case(quick)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "pp"))
    opt = optax.adam(1e-3)
    out = []
    for zero in (0, 1):
        extra = {"enable_parallel_optimizer": True,
                 "parallel_optimizer_config": {"optimizer_level": "level1"}} if zero else {}
        for stacked in (False, True):
            with jaxpar.auto_parallel_context(
                    parallel_mode="semi_auto_parallel", mesh=mesh, pipeline_stages=4,
                    micro_batches=16, pipeline_config={"pipeline_scheduler": "1f1b"}, **extra):
                cell = jaxpar.PipelineCell(loss_fn)

                def step(p, o, b, cell=cell):
                    value, grads = jax.value_and_grad(cell)(p, b[:, :-1], b[:, 1:])
                    updates, o = opt.update(grads, o, p)
                    return optax.apply_updates(p, updates), o, value

                p = cell.stack(params, batch[:, :-1], batch[:, 1:]) if stacked else params
                compiled = jaxpar.parallelize(step, batch_argnums=2).lower(
                    p, opt.init(p), batch).compile()
            mem = compiled.memory_analysis()
            over_pp = [c for c in jaxpar.inspect.collectives(compiled)
                       if c.axes and "pp" in c.axes and c.kind in ("all-gather", "all-to-all")
                       and all(sh.startswith("f") for sh in c.shapes)]  # not the int tokens
            out.append({"weights": "stacked" if stacked else "per layer", "zero": zero,
                        "argument_bytes": int(mem.argument_size_in_bytes),
                        "temp_bytes": int(mem.temp_size_in_bytes),
                        "over_pp": sum(c.count for c in over_pp),
                        "over_pp_bytes": sum(c.nbytes * c.count for c in over_pp)})
            print(f"stacking {out[-1]}", flush=True)
    return out


def stacking_table(rows: list[dict]) -> list[str]:
    lines = ["", "## Layer weights per layer or stacked by stage: GPT train step with Adam, "
             "1F1B, S=4, M=16, mesh (dp=2, pp=4)", "",
             "Per device, from `compiled.memory_analysis()` and the compiled HLO; over pp: "
             "floating-point all-gathers and all-to-alls, with loop trip counts (the loop's "
             "collective-permutes, its psum of the embedding's and head's gradients and the "
             "token batch's re-layout aside).", "",
             "| weights | ZeRO level | arguments MiB | temp MiB | over pp: collectives | "
             "over pp: KiB |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['weights']} | {r['zero']} | {r['argument_bytes'] / 2**20:.2f} | "
                     f"{r['temp_bytes'] / 2**20:.2f} | {r['over_pp']} | "
                     f"{r['over_pp_bytes'] / 2**10:.1f} |")
    return lines


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    lines = [f"## Pipeline schedules: S=4 stages x M=16 micro-batches, GPT {r0['layers']} "
             f"layers d={r0['d_model']} seq={r0['seq']} batch={r0['batch']}, mesh (dp=2, pp=4)",
             "",
             "Temporaries are per device, from `compiled.memory_analysis()` (activations, "
             "residual slots, buffers); bubble: the simulated timeline with a stage's forward "
             "1 and backward 2; in flight: micro-batch chunks a stage holds residuals of.",
             "",
             "Over dp, KiB per device a step (loop trip counts included), from the compiled HLO: "
             "all: every all-reduce and reduce-scatter; in loop: the gradients' (not the "
             "loss's scalars) inside the loop's code; after: the gradients' all-reduces in the "
             "step's entry computation.  Predicted after: the plan's "
             "`gradient_reduction.after_loop_bytes` = stacked (the stage weights', when "
             "reduced once) + ends (embedding, head, final norm, summed per row group); "
             "predicted in loop: the stage weights' when reduced per chunk backward. "
             "Matches: measured after == predicted after.",
             "",
             "| schedule | temp MiB | ticks | bubble | (S-1)/(vM+S-1) | in flight per stage | "
             "collective-permutes | over dp: all | in loop (predicted) | after | "
             "predicted after (stacked + ends) | matches | compile s |",
             "|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        def kib(key: str, r: dict = r) -> str:
            return f"{r[key] / 2**10:.1f}"

        dp = (f"{kib('dp_reduce_bytes')} | {kib('dp_reduce_in_loop_bytes')}"
              + (f" ({kib('predicted_in_loop_bytes')})" if "ticks" in r else "")
              + f" | {kib('dp_reduce_after_loop_bytes')}")
        if "ticks" not in r:
            lines.append(f"| {r['schedule']} | {r['temp_bytes'] / 2**20:.2f} | - | - | - | - | "
                         f"{r['permutes']} | {dp} | - | - | {r['compile_s']:.1f} |")
            continue
        predicted = (f"{kib('predicted_after_loop_bytes')} ({kib('predicted_stacked_bytes')} + "
                     f"{kib('predicted_ends_bytes')})")
        v = 2 if "v=2" in r["schedule"] else 1
        formula = 3 / (v * 16 + 3)
        axes = "+".join(r["permute_axes"])
        lines.append(f"| {r['schedule']} | {r['temp_bytes'] / 2**20:.2f} | {r['ticks']} | "
                     f"{r['bubble_unit']:.3f} | {formula:.3f} | {r['in_flight']} | "
                     f"{r['permutes']} over {axes} | {dp} | {predicted} | "
                     f"{'yes' if r['matches'] else 'NO'} | {r['compile_s']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    result = {"pipeline_schedules": rows("--quick" in argv),
              "pipeline_stacking": stacking_rows("--quick" in argv)}
    if __name__ == "__main__":
        out = os.path.join(ROOT, "bench", "results")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "pipeline.json"), "w") as f:
            json.dump(result, f, indent=1)
        print("\n".join(table(result["pipeline_schedules"]) +
                         stacking_table(result["pipeline_stacking"])))
    return result


if __name__ == "__main__":
    main()
