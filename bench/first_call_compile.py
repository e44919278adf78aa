"""XLA's compile of jaxpar's program against ``jax.jit``'s with the same in/out shardings:
section 4 of ``bench/first_call.py`` (``python bench/first_call.py --compile [--layers 6 24]
[--repeats 3]``, or this file with the same options), which writes
``first_call_compile.json`` / ``.md``.  Each size in a fresh process: jaxpar's program as
lowered, the same plan lowered with a constraint on every value, and ``jax.jit``'s program,
compiled in turn without caches; CPU seconds and constraint counts.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.first_call import ROOT, _gpt, _setup  # noqa: E402 - after the path

_PROGRAMS = ("jit", "jaxpar", "every constraint")


def _compile_child(layers: int, rounds: int) -> dict:
    """XLA's compile of jaxpar's program (as lowered, and with a constraint on every value)
    against ``jax.jit``'s with the same in/out shardings, on the GPT step of ``layers`` layers:
    the three compiled in turn ``rounds`` times (the order reversed every other round), each
    lowered anew after ``jax.clear_caches()``; this process's CPU seconds of ``compile()``."""
    jax, gpt, jaxpar = _setup()
    from jax.sharding import NamedSharding

    from jaxpar._src import api, lower

    step, args = _gpt(gpt, layers)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    pf = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel")
    plan = pf.compiled_entry(*args).plan

    def shardings(tree, specs):
        return jax.tree.unflatten(jax.tree.structure(tree), [
            NamedSharding(mesh, s.to_partition_spec()) for s in specs])

    jitted = jax.jit(step, in_shardings=shardings(args, plan.input_specs),
                     out_shardings=shardings(jax.eval_shape(step, *args), plan.output_specs))

    def lowered(program: str):
        if program == "jit":
            return jitted.lower(*args)
        loose = program == "jaxpar"
        api.make_evaluator = functools.partial(lower.make_evaluator, loose=loose)
        try:  # a new Parallelized: its jit is built with this evaluator (the plan is cached)
            return jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel").lower(*args)
        finally:
            api.make_evaluator = lower.make_evaluator

    lowered("jit").compile()  # untimed: what a process's first compile pays once
    row: dict = {"layers": layers, "load": [os.getloadavg()[0]]}
    collectives = {}
    for k in range(rounds):
        for program in _PROGRAMS if k % 2 == 0 else _PROGRAMS[::-1]:
            jax.clear_caches()
            lo = lowered(program)
            c0, t0 = time.process_time(), time.perf_counter()
            compiled = lo.compile()
            cell = row.setdefault(program, {"cpu_s": [], "wall_s": []})
            cell["cpu_s"].append(time.process_time() - c0)
            cell["wall_s"].append(time.perf_counter() - t0)
            cell["constraints"] = lo.as_text().count("sdy.sharding_constraint")
            if k == 0:
                collectives[program] = sorted(
                    (c.kind, c.count, c.shapes) for c in jaxpar.inspect.collectives(compiled))
    row["load"].append(os.getloadavg()[0])
    row["same_collectives"] = len({repr(c) for c in collectives.values()}) == 1
    return row


def compile_table(rows: list[dict]) -> list[str]:
    lines = ["## XLA's compile: jaxpar's program against jax.jit's (same in/out shardings)", "",
             "One process per size; the three programs compiled in turn, lowered anew each "
             "round; median CPU seconds of compile() (process time, all threads), ratio to "
             "jit's; constraints: sdy.sharding_constraint in the lowered StableHLO.", "",
             "| layers | load | jit | jaxpar (constraints) | ratio | every constraint "
             "(constraints) | ratio | same collectives |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        med = {p: statistics.median(r[p]["cpu_s"]) for p in _PROGRAMS}
        lines.append(
            f"| {r['layers']} | {r['load'][0]:.1f}-{r['load'][1]:.1f} | {med['jit']:.2f} | "
            f"{med['jaxpar']:.2f} ({r['jaxpar']['constraints']}) | "
            f"{med['jaxpar'] / med['jit']:.2f} | {med['every constraint']:.2f} "
            f"({r['every constraint']['constraints']}) | "
            f"{med['every constraint'] / med['jit']:.2f} | {r['same_collectives']} |")
    return lines


def run_compile(out_dir: str, sizes: list[int] | None = None, rounds: int = 3) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxpar-compile-") as tmp:
        for layers in sizes or [6, 24]:
            out = os.path.join(tmp, f"{layers}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--layers", str(layers),
                            "--repeats", str(rounds), "--row", out],
                           check=True, env=dict(os.environ, PYTHONPATH=ROOT))
            with open(out) as f:
                rows.append(json.load(f))
    result = {"cpus": os.cpu_count(), "compile": rows}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "first_call_compile.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = compile_table(rows) + [""]
    with open(os.path.join(out_dir, "first_call_compile.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--layers", type=int, nargs="*", help="sizes (6 24)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per size (3)")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # one size, in a process of its own
    args = parser.parse_args(argv)
    if args.row:
        row = _compile_child(args.layers[0], args.repeats)
        with open(args.row, "w") as f:
            json.dump(row, f)
        return row
    return run_compile(args.out, args.layers, args.repeats)


if __name__ == "__main__":
    main()
