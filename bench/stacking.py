"""Stacked against per-layer weights of a pipelined train step: what crosses ``pp``, and memory.

The train step of ``examples/gpt_3d.py`` (Adam, 1F1B, 4 micro-batches, ``auto_parallel``) on
the demo GPT at width 64 (4 blocks, d=64, ff=256, seq 16, vocab 64, batch 16), compiled (not
run) once per row: the mesh ((dp, tp, pp) = (2, 2, 2) or (dp, pp) = (2, 4)), the parallel
optimizer (ZeRO level 1 or off) and the blocks' weights per layer (laid out by the step's plan)
or stacked by stage (``PipelineCell.stack``).  Per row, per device: the stage split the search
chose, the weight-moving collectives whose groups span ``pp`` (all-gathers, all-to-alls,
reduce-scatters; count and bytes a step, loop trip counts included), the all-reduces over
``pp`` beside them, the collective-permutes (the loop's rotation), the all-gathers whose groups
stay off ``pp`` (the update's, gathering parameters over ``dp`` / ``tp``), and the arguments and
temporaries of ``compiled.memory_analysis()``.

    python bench/stacking.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

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
import gpt_3d  # noqa: E402

import jaxpar  # noqa: E402

MESHES = {"(dp, tp, pp) = (2, 2, 2)": ((2, 2, 2), ("dp", "tp", "pp")),
          "(dp, pp) = (2, 4)": ((2, 4), ("dp", "pp"))}
MOVES = ("all-gather", "all-to-all", "reduce-scatter")


def measure(mesh_name: str, zero: bool, stacked: bool) -> dict:
    shape, axes = MESHES[mesh_name]
    cfg = gpt.GPTConfig(layers=4, annotate=False, d_model=64, heads=4, ff=256, seq=16)
    batch = np.asarray(next(gpt.batches(gpt.corpus(), 16, cfg.seq)))
    x, y = batch[:, :-1], batch[:, 1:]
    mesh = jaxpar.make_mesh(shape, axes)
    level = {"enable_parallel_optimizer": True,
             "parallel_optimizer_config": {"optimizer_level": "level1"}} if zero else {}
    with jaxpar.auto_parallel_context(parallel_mode="auto_parallel", mesh=mesh,
                                      pipeline_stages=shape[-1], micro_batches=4,
                                      pipeline_config={"pipeline_scheduler": "1f1b"}, **level):
        step_fn, params, opt_state = gpt_3d.make_step(cfg, optax.adam(3e-4), pipelined=True,
                                                      example=(x, y) if stacked else None)
        step = jaxpar.parallelize(step_fn, batch_argnums=(2, 3))
        plan = step.plan(params, opt_state, x, y)
        compiled = step.lower(params, opt_state, x, y).compile()
    colls = jaxpar.inspect.collectives(compiled)
    mem = compiled.memory_analysis()

    def over_pp(kinds: tuple[str, ...]) -> tuple[int, float]:
        rows = [r for r in colls if r.kind in kinds and r.axes and "pp" in r.axes]
        return sum(r.count for r in rows), sum(r.nbytes * r.count for r in rows) / 2**10

    moved, moved_kib = over_pp(MOVES)
    reduced, reduced_kib = over_pp(("all-reduce",))
    permutes, permute_kib = over_pp(("collective-permute",))
    # the update's: all-gathers whose groups stay off pp (the parameters gathered over dp, tp)
    gathers = [r for r in colls if r.kind == "all-gather" and r.axes and "pp" not in r.axes]
    return {"mesh": mesh_name, "zero": "level1" if zero else "off",
            "weights": "stacked" if stacked else "per layer",
            "split": list(plan.pipeline.split.counts),
            "moves_over_pp": moved, "moves_over_pp_kib": moved_kib,
            "all_reduces_over_pp": reduced, "all_reduce_over_pp_kib": reduced_kib,
            "permutes": permutes, "permute_kib": permute_kib,
            "gathers_off_pp": sum(r.count for r in gathers),
            "gathers_off_pp_kib": sum(r.nbytes * r.count for r in gathers) / 2**10,
            "arguments_mib": mem.argument_size_in_bytes / 2**20,
            "temporaries_mib": mem.temp_size_in_bytes / 2**20}


def table(rows: list[dict]) -> str:
    lines = ["| mesh | ZeRO | weights | split | all-gathers / all-to-alls / reduce-scatters "
             "over `pp` | all-reduces over `pp` | all-gathers off `pp` | arguments | temporaries |",
             "|---|---|---|---|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mesh']} | {r['zero']} | {r['weights']} | {r['split']} | "
                     f"{r['moves_over_pp']} ({r['moves_over_pp_kib']:.0f} KiB) | "
                     f"{r['all_reduces_over_pp']} ({r['all_reduce_over_pp_kib']:.1f} KiB) | "
                     f"{r['gathers_off_pp']} ({r['gathers_off_pp_kib']:.0f} KiB) | "
                     f"{r['arguments_mib']:.2f} MiB | {r['temporaries_mib']:.2f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    rows = []
    for mesh_name in MESHES:
        for stacked in (False, True):
            rows.append(measure(mesh_name, True, stacked))
    for stacked in (False, True):
        rows.append(measure("(dp, pp) = (2, 4)", False, stacked))
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
