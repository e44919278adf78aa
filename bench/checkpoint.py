"""``make bench``'s checkpoint tables: what a distributed load reads and holds, and how long
``infer_predict_layout`` takes beside XLA's compile.

1. **loads**: a train state of 576 MiB saved on a (dp=2, mp=4) mesh, loaded by 1 process (8
   devices) and by 4 processes (2 devices each, ``jaxpar run``) onto an 8-device layout: one
   that lines up with the saved shards and one that does not (saved with orbax's default
   chunks, one per shard, and with 1 MiB chunks), and after ``transform_checkpoints`` to the
   second layout.  Per process: bytes read from files (``/proc/self/io``) and the growth of
   peak RSS during the load (``getrusage``), against the checkpoint's size on disk; also with
   glibc's mmap threshold fixed (``MALLOC_MMAP_THRESHOLD_``), which keeps it from holding on
   to orbax's freed staging buffers.
2. **infer_predict_layout**: its time beside XLA's compile time of the same program.

    python bench/checkpoint.py [--quick]                  (bench/run.py runs it too)
    python bench/checkpoint.py load DIR LAYOUT SCALE OUT  (one loading process)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

LOADING = __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "load"
if LOADING:  # a process of a `jaxpar run` job: join it before JAX starts
    import jaxpar

    jaxpar.init()
else:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if __name__ == "__main__" and not LOADING:
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpar  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = {"w1": P("dp", "mp"), "w2": P("mp", "dp")}
SERVING = {"columns": {"w1": P(None, "x"), "w2": P("x")},  # lines up with the saved shards
           "rows": {"w1": P("x"), "w2": P(None, "x")}}  # cuts across them


def shapes(scale: int) -> dict:
    return {"w1": (2048 * scale, 4096), "w2": (4096, 2048 * scale)}


def abstract(scale: int) -> dict:
    s = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in shapes(scale).items()}
    return {"params": s, "opt_state": ({"mu": s, "nu": s},)}


# -- one loading process ----------------------------------------------------------------------
def _io() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_main(directory: str, layout: str, scale: int, out: str) -> None:
    mesh = jaxpar.make_mesh((jax.device_count(),), ("x",))
    strategy = {k: NamedSharding(mesh, s) for k, s in SERVING[layout].items()}
    jaxpar.load_distributed_checkpoint({"x": jnp.zeros(8)}, directory + "_warm")  # first use
    rss0, read0, t0 = _rss(), _io(), time.perf_counter()
    state = jaxpar.load_distributed_checkpoint(abstract(scale), directory,
                                               predict_strategy=strategy)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    share = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards)
    with open(os.path.join(out, f"rank_{jax.process_index()}.json"), "w") as f:
        json.dump({"read": _io() - read0, "rss_growth": peak - rss0, "share": share,
                   "seconds": seconds}, f)


# -- the bench --------------------------------------------------------------------------------
def _save(path: str, scale: int, chunk_bytes: int | None) -> int:
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    rng = np.random.default_rng(0)

    def placed(key: str) -> jax.Array:
        x = rng.standard_normal(shapes(scale)[key], dtype=np.float32)
        return jax.device_put(x, NamedSharding(mesh, SAVED[key]))

    state = {"params": {k: placed(k) for k in SAVED},
             "opt_state": ({"mu": {k: placed(k) for k in SAVED},
                            "nu": {k: placed(k) for k in SAVED}},)}
    jaxpar.save_checkpoint(state, path, chunk_bytes=chunk_bytes)
    jaxpar.save_checkpoint({"x": jnp.zeros(8)}, path + "_warm")
    return _size(path)


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _launch(n: int, path: str, layout: str, scale: int, malloc_fixed: bool) -> list[dict]:
    out = tempfile.mkdtemp(prefix="ckpt_load_")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    if malloc_fixed:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    jaxpar_cli = os.path.join(os.path.dirname(sys.executable), "jaxpar")
    subprocess.run([jaxpar_cli, "run", "-n", str(n), "--devices-per-process", str(8 // n),
                    "--log-dir", os.path.join(out, "logs"), "--timeout", "600", __file__,
                    "load", path, layout, str(scale), out], env=env, check=True,
                   capture_output=True, timeout=700)
    return [json.load(open(os.path.join(out, f"rank_{r}.json"))) for r in range(n)]


def load_rows(quick: bool) -> list[dict]:
    scale = 1 if quick else 3
    root = tempfile.mkdtemp(prefix="ckpt_bench_")
    default = os.path.join(root, "default_chunks")
    small = os.path.join(root, "chunks_1MiB")
    sizes = {default: _save(default, scale, None)}
    cases = [(default, "columns", 1, False), (default, "columns", 4, False),
             (default, "columns", 4, True), (default, "rows", 4, False)]
    if not quick:
        sizes[small] = _save(small, scale, 1 << 20)
        cases.append((small, "rows", 4, False))
        moved = os.path.join(root, "transformed_rows")
        mesh = jaxpar.make_mesh((8,), ("x",))
        t = time.perf_counter()
        jaxpar.transform_checkpoints(default, moved, dst_strategy={
            k: NamedSharding(mesh, s) for k, s in SERVING["rows"].items()})
        transform_s = time.perf_counter() - t
        jaxpar.save_checkpoint({"x": jnp.zeros(8)}, moved + "_warm")
        sizes[moved] = _size(moved)
        cases.append((moved, "rows", 4, False))
    rows = []
    for path, layout, n, malloc_fixed in cases:
        ranks = _launch(n, path, layout, scale, malloc_fixed)
        size = sizes[path]
        row = {"checkpoint": os.path.basename(path), "size_mib": size / 2**20,
               "layout": layout, "processes": n, "malloc_fixed": malloc_fixed,
               "share": max(r["share"] for r in ranks) / size,
               "read": max(r["read"] for r in ranks) / size,
               "rss_growth": max(r["rss_growth"] for r in ranks) / size,
               "seconds": max(r["seconds"] for r in ranks)}
        if path.endswith("transformed_rows"):
            row["transform_s"] = transform_s
        rows.append(row)
        print("checkpoint load", row, flush=True)
    return rows


def load_table(rows: list[dict]) -> list[str]:
    lines = ["## Distributed checkpoint loads", "",
             "A train state saved on (dp=2, mp=4), loaded onto 8 devices by 1 process or 4 "
             "processes (`jaxpar run`). Per process, the largest of: its share of the arrays, "
             "bytes read from files, growth of peak RSS during the load; all as fractions of "
             "the checkpoint's size on disk. `columns` lines up with the saved shards, `rows` "
             "cuts across them. glibc fixed: `MALLOC_MMAP_THRESHOLD_=1MiB`.", "",
             "| checkpoint | MiB | serving layout | processes | glibc fixed | share | read | "
             "peak RSS growth | load s |", "|---|---:|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {r['size_mib']:.0f} | {r['layout']} | "
                     f"{r['processes']} | {'yes' if r['malloc_fixed'] else 'no'} | "
                     f"{r['share']:.3f} | {r['read']:.3f} | {r['rss_growth']:.3f} | "
                     f"{r['seconds']:.2f} |")
    moved = [r for r in rows if "transform_s" in r]
    if moved:
        lines += ["", f"transform_checkpoints to the `rows` layout (offline, host): "
                  f"{moved[0]['transform_s']:.1f} s."]
    return lines


def infer_rows(quick: bool) -> list[dict]:
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt
    import serve_gpt
    from flax import nnx

    rows = []
    for layers in (2,) if quick else (2, 12):
        cfg = gpt.GPTConfig(layers=layers)
        abstract_params = nnx.state(nnx.eval_shape(lambda cfg=cfg: gpt.GPT(cfg, nnx.Rngs(0))),
                                    nnx.Param)
        step = serve_gpt.decode_step_fn(cfg)
        example = (abstract_params, serve_gpt.empty_cache(cfg, 2), jnp.zeros((2, 1), jnp.int32),
                   jnp.int32(0))
        mesh4 = jaxpar.make_mesh((4,), ("mp",))
        train_step, params, opt_state = gpt.make_train_step(gpt.GPTConfig(layers=layers,
                                                                          annotate=False))
        batch = next(gpt.batches(gpt.corpus(), 16, cfg.seq))
        programs = [
            ("GPT decode step (KV cache)", "semi_auto_parallel", jaxpar.parallelize(
                step, mesh=mesh4, parallel_mode="semi_auto_parallel",
                parameter_plan=serve_gpt.SERVING_PLAN), example),
            ("GPT decode step (KV cache)", "auto_parallel", jaxpar.parallelize(
                step, mesh=mesh4, parallel_mode="auto_parallel"), example),
            ("GPT train step (Adam)", "auto_parallel", jaxpar.parallelize(
                train_step, mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")),
                parallel_mode="auto_parallel"), (params, opt_state, batch))]
        for name, mode, fn, args in programs:
            t0 = time.perf_counter()
            layouts = jaxpar.infer_predict_layout(fn, *args)
            t1 = time.perf_counter()
            fn.lower(*args).compile()
            t2 = time.perf_counter()
            row = {"program": name, "layers": layers, "mode": mode, "params": len(layouts),
                   "split": sum(any(e is not None for e in s) for s in layouts.values()),
                   "infer_s": t1 - t0, "xla_compile_s": t2 - t1}
            rows.append(row)
            print("infer_predict_layout", row, flush=True)
    return rows


def infer_table(rows: list[dict]) -> list[str]:
    lines = ["## infer_predict_layout", "",
             "Seconds to trace and plan the program and return every parameter's layout, beside "
             "XLA's compile of the same program afterwards (lowering included).", "",
             "| program | layers | mode | parameters | split | infer_predict_layout s | "
             "XLA compile s | ratio |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['program']} | {r['layers']} | {r['mode']} | {r['params']} | "
                     f"{r['split']} | {r['infer_s']:.3f} | {r['xla_compile_s']:.2f} | "
                     f"{r['infer_s'] / r['xla_compile_s']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = {"checkpoint_loads": load_rows(args.quick), "infer": infer_rows(args.quick)}
    print("\n".join(load_table(result["checkpoint_loads"]) + [""]
                    + infer_table(result["infer"])))
    return result


if __name__ == "__main__":
    if LOADING:
        load_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()
