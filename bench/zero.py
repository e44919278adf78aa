"""``make bench``'s parallel-optimizer table: memory per device and communication vs ZeRO level.

The GPT train step of ``examples/gpt.py`` (Adam) in ``data_parallel`` mode on 8 devices, with
``enable_parallel_optimizer`` off (level 0: plain data parallel) and at ``level1`` to
``level3`` (threshold 0: every array whose dimension 0 divides by 8 is split).  Per level, from
the compiled program: per-device argument, temporary and total bytes
(``compiled.memory_analysis()``), the optimizer state's per-device bytes (from the input
shardings), jaxpar's prediction of the total (``plan.memory_bytes``,
``jaxpar/_src/program_memory.py``) and its ratio to the compiled total, the collectives of the
partitioned HLO by kind (count and payload bytes per device) with their ring wire bytes in units
of Ψ (the parameters' bytes), and the plan's predicted collectives (``plan.collectives``: wire
Ψ, and whether every one, kind, axes, bytes and count, is the compiled program's).  The last
row is ``jax.jit`` given level 3's input and output shardings (XLA's own propagation of the
same FSDP layout).  Known answer (ZeRO, Rajbhandari et
al. 2020, section 7): levels 1-2 move 2Ψ per device and step, as data parallel; level 3 3Ψ.
At levels 1-3 jaxpar's lowering reduce-scatters the gradients, the embedding's scatter-add
gradient too (``jaxpar/_src/scatter.py``; XLA:CPU would keep an all-reduce and a slice, 3Ψ):
2Ψ, as data parallel, is (n-1)/n * 2Ψ = 1.75Ψ on the wire here, 3Ψ at level 3 2.625Ψ; only
the loss is all-reduced.  Level 3 all-gathers each parameter before its forward use and again
before its backward use (``jaxpar/_src/regather.py``), ZeRO-3's second all-gather: its total
is below level 1's.  Compare totals, not temporaries: XLA also
places temporaries in the output buffers (whole parameters at levels 0-2; "off" shows none).

    python bench/zero.py [--quick]      (bench/run.py runs it too)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import gpt  # noqa: E402

import jaxpar  # noqa: E402

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all")


def _case(quick: bool):
    cfg = gpt.GPTConfig(layers=2 if quick else 4, annotate=False)
    step, params, opt_state = gpt.make_train_step(cfg)
    batch = np.asarray(next(gpt.batches(gpt.corpus(), 16, cfg.seq)))
    return cfg, step, (params, opt_state, batch)


def _shard_bytes(tree, shardings) -> int:
    return sum(math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
               for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True))


def _multiset(items) -> dict:
    """{(kind, axes, payload bytes per device): count} of a program's collectives."""
    out: dict = {}
    for kind, axes, nbytes, count in items:
        key = (kind, tuple(sorted(axes or ())), float(nbytes))
        out[key] = out.get(key, 0) + count
    return out


def _predicted(plan, colls) -> dict:
    """The plan's predicted collectives per kind, and how they differ from ``colls``."""
    predicted = plan.predicted_collectives()
    by_kind: dict = {}
    for c in predicted:
        row = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0.0})
        row["count"] += c.count
        row["bytes"] += c.nbytes * c.count
    ours = _multiset((c.kind, c.axes, c.nbytes, c.count) for c in predicted)
    theirs = _multiset((r.kind, r.axes, r.nbytes, r.count) for r in colls)
    differ = sorted({k[0] for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k)})
    return {"predicted_collectives": by_kind,
            "predicted_wire_bytes": sum(c.wire_bytes for c in predicted),
            "predicted_differs": differ}


def _row(label: str, compiled, args, psi: int, result, reference, plan=None) -> dict:
    mem = compiled.memory_analysis()
    colls = jaxpar.inspect.collectives(compiled)
    by_kind = colls.by_kind()
    diff = 0.0 if reference is None else max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True))
    return ({} if plan is None else _predicted(plan, colls)) | {
        "level": label,
        "argument_bytes": int(mem.argument_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "total_bytes": int(mem.argument_size_in_bytes + mem.output_size_in_bytes
                           - mem.alias_size_in_bytes + mem.temp_size_in_bytes),
        "opt_state_bytes": _shard_bytes(args[1], compiled.input_shardings[0][1]),
        "params_bytes": _shard_bytes(args[0], compiled.input_shardings[0][0]),
        "predicted_bytes": None if plan is None else float(plan.memory_bytes),
        "collectives": {k: {"count": int(by_kind[k]["count"]), "bytes": by_kind[k]["bytes"]}
                        for k in KINDS if k in by_kind},
        "wire_psi": colls.wire_bytes() / psi,
        "max_abs_diff_vs_level0": diff,
    }


def rows(quick: bool) -> list[dict]:
    cfg, step, args = _case(quick)
    mesh = jaxpar.make_mesh((8,), ("dp",))
    psi = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0]))
    out, reference, level3 = [], None, None
    for level in (0, 1, 2, 3):
        options = {} if level == 0 else dict(
            enable_parallel_optimizer=True,
            parallel_optimizer_config={"optimizer_level": f"level{level}",
                                       "parallel_optimizer_threshold": 0})
        with jaxpar.auto_parallel_context(**options):
            f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
            t0 = time.perf_counter()
            compiled = f.lower(*args).compile()
            seconds = time.perf_counter() - t0
            result = f(*args)
            plan = f.plan(*args)
        reference = result if level == 0 else reference
        row = _row(f"level{level}" if level else "off (data parallel)", compiled, args, psi,
                   result, reference, plan)
        row.update(compile_s=seconds, layers=cfg.layers, psi_bytes=psi)
        out.append(row)
        level3 = compiled if level == 3 else level3
    # XLA's own propagation of level 3's layouts, for comparison
    jitted = jax.jit(step, in_shardings=level3.input_shardings[0],
                     out_shardings=level3.output_shardings)
    t0 = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    seconds = time.perf_counter() - t0
    row = _row("jax.jit, level3's shardings", compiled, args, psi, jitted(*args), reference)
    row.update(compile_s=seconds, layers=cfg.layers, psi_bytes=psi)
    out.append(row)
    return out


def table(rows: list[dict]) -> list[str]:
    r0 = rows[0]
    mib = 2.0**20
    lines = [f"## Parallel optimizer (ZeRO) levels: GPT {r0['layers']} layers (examples/gpt.py, "
             f"Adam), data_parallel on 8 devices, Ψ = {r0['psi_bytes'] / mib:.2f} MiB",
             "",
             "Per device: bytes from `compiled.memory_analysis()` (arguments, temporaries, "
             "total = arguments + outputs - aliased + temporaries), the parameters' and the "
             "optimizer state's bytes from the input shardings, jaxpar's predicted total "
             "(`plan.memory_bytes`: jaxpar/_src/program_memory.py) and its ratio to the "
             "compiled total; "
             "collectives of the partitioned HLO: count / MiB payload per device; wire bytes "
             "(ring) in Ψ; 2Ψ in ZeRO's units is 1.75Ψ on 8 devices.  ZeRO's paper: 2Ψ for "
             "levels 1-2 (reduce-scatter, all-gather), 3Ψ for level 3.  Level 3 gathers each "
             "parameter for the forward pass and again for the backward pass.  XLA also keeps "
             "temporaries in the output buffers: compare totals.  Predicted: the plan's "
             "collectives (`plan.collectives`), their wire bytes in Ψ, and `=` where every one "
             "(kind, axes, bytes, count) is the compiled program's, else the kinds that differ.",
             "",
             "| level | params MiB | opt state MiB | arguments MiB | temp MiB | total MiB | "
             "predicted MiB | predicted / total | " + " | ".join(KINDS)
             + " | wire Ψ | predicted wire Ψ | predicted vs compiled | max abs diff | "
             "compile s |",
             "|---|" + "---:|" * (12 + len(KINDS))]
    for r in rows:
        colls = " | ".join(
            f"{r['collectives'][k]['count']} / {r['collectives'][k]['bytes'] / mib:.2f}"
            if k in r["collectives"] else "-" for k in KINDS)
        pred = "- | -" if r["predicted_bytes"] is None else \
            f"{r['predicted_bytes'] / mib:.2f} | {r['predicted_bytes'] / r['total_bytes']:.3f}"
        plan_colls = "- | -" if "predicted_differs" not in r else \
            f"{r['predicted_wire_bytes'] / r['psi_bytes']:.2f} | " \
            f"{', '.join(r['predicted_differs']) or '='}"
        lines.append(
            f"| {r['level']} | {r['params_bytes'] / mib:.2f} | {r['opt_state_bytes'] / mib:.2f} "
            f"| {r['argument_bytes'] / mib:.2f} | {r['temp_bytes'] / mib:.2f} | "
            f"{r['total_bytes'] / mib:.2f} | {pred} | {colls} | {r['wire_psi']:.2f} | "
            f"{plan_colls} | {r['max_abs_diff_vs_level0']:.1e} | {r['compile_s']:.1f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    result = {"zero_levels": rows("--quick" in argv)}
    if __name__ == "__main__":
        out = os.path.join(ROOT, "bench", "results")
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "zero.json"), "w") as f:
            json.dump(result, f, indent=1)
        print("\n".join(table(result["zero_levels"])))
    return result


if __name__ == "__main__":
    main()
