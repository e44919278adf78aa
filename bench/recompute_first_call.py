"""The first call of a step with ``jaxpar.recompute(policy="auto")`` blocks: time and compiles.

``tests/test_recompute.py``'s 3-layer MLP train step (batch 1024, width 32/128, mesh ``(8,)``,
``auto_parallel``) under a budget of 80% of its unrecomputed compiled peak, where the ladder
tries three rungs (none; dots on block 0; dots on blocks 0-1) and takes the third.  Each first
call runs in a fresh process: once with no plan cache, then twice with one plan cache directory
(the first run fills it, the second loads the choice and its plan).  Per run: wall and CPU
seconds of the first call, the XLA compiles of the step (``jax.monitoring``'s
``/jax/core/compile/backend_compile_duration`` events) and their seconds.

    python bench/recompute_first_call.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK0 = 831_648.0  # bytes per device: the step's compiled peak with nothing recomputed


def first_call(cache_dir: str | None) -> dict:
    """One first call in this process."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    import jax

    import jaxpar
    from tests.test_recompute import BATCH, LAYERS, D, F, block, make_step

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(seconds)
        if event == "/jax/core/compile/backend_compile_duration"
        and "step" in kw.get("fun_name", "") else None)
    if cache_dir:
        jaxpar.config.update("plan_cache_dir", cache_dir)
    k = jax.random.split(jax.random.key(0), 2 * LAYERS + 1)
    params = [{"w1": jax.random.normal(k[2 * i], (D, F)) * 0.1,
               "w2": jax.random.normal(k[2 * i + 1], (F, D)) * 0.1} for i in range(LAYERS)]
    x = jax.block_until_ready(jax.random.normal(k[-1], (BATCH, D)))
    f = jaxpar.parallelize(make_step(jaxpar.recompute(block, policy="auto")),
                           mesh=jaxpar.make_mesh((8,), ("dp",)), parallel_mode="auto_parallel")
    with jaxpar.auto_parallel_context(
            hardware=jaxpar.HardwareProfile(memory_per_device=0.8 * PEAK0)):
        wall, cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(f(params, x))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        plan = f.plan(params, x)
    return {"wall_s": wall, "cpu_s": cpu, "compiles": len(compiles),
            "compile_s": sum(compiles),
            "cache_hit": plan.notes[-1].startswith("loaded from the plan cache"),
            "choice": [n.rsplit(": ", 1)[1] for n in plan.notes
                       if n.startswith("recompute block")]}


def _run(cache_dir: str | None) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", cache_dir or ""], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(first_call(args.child or None)))
        return
    print("run                 wall s   CPU s  compiles (s)  hit   choice")
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            for name, where in (("no cache", None), ("cache, empty", cache),
                                ("cache, filled", cache)):
                r = _run(where)
                print(f"{name:18s} {r['wall_s']:7.2f} {r['cpu_s']:7.2f} {r['compiles']:5d} "
                      f"({r['compile_s']:5.2f})  {r['cache_hit']!s:5s} {' '.join(r['choice'])}")


if __name__ == "__main__":
    main()
