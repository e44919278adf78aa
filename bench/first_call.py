"""What a user waits for: the first call of a parallelized train step against the first call of
``jax.jit`` with the same shardings, the same again with both caches warm, and every later call.

Three tables, in ``first_call.json`` / ``first_call.md``:

1. **per call**: a step whose inputs are already where the plan wants them, called through
   ``jaxpar.parallelize`` and through the very ``jax.jit`` object jaxpar built for it (the same
   executable): microseconds per call (best of interleaved rounds, and the median of the
   rounds' ratios) and the Python jaxpar adds, beside what that measure reads for its probe
   called with no jaxpar around it.  On a cheap step over the 2-layer GPT's arguments (89 Flax
   NNX leaves: flattening them is most of ``jax.jit``'s own cost) and over a plain dict of
   arrays, then the 2-layer GPT train step itself;
2. **first call**, each in a fresh process (``subprocess``), on a GPT train step (d=128, batch
   16 x 16, mesh ``(dp=2, mp=4)``, ``auto_parallel``) of 6 and 24 layers (and 96 without
   ``--quick``): ``parallelize(step)(*args)`` against ``jax.jit(step, in_shardings=...,
   out_shardings=...)(*args)`` given the shardings jaxpar chose; the first run with empty caches,
   the second with jaxpar's plan cache (``jaxpar.config.plan_cache_dir``) and JAX's persistent
   compilation cache (``jax_compilation_cache_dir``) filled by the first; jaxpar's phases
   (trace = make_jaxpr + graph build, the plan cache's key, plan, loading the executable kept
   in the plan cache, lower = JAX's trace of the jitted function and its StableHLO, XLA
   compile (JAX's backend-compile event less the persistent-cache write JAX makes inside it:
   ``jax.jit``'s first call writes its executable there, jaxpar's does not, so that write is
   counted in the rest of the call, and shown beside), the call and of it placing the
   arguments and the rest: dispatch and the step's run;
   the executable's background write and what the process waited for it after the call) from
   ``jax.monitoring``'s compile events and the plan's own timings.

3. **phases** (``--phases``), each size in a fresh process: jaxpar's own time per phase on the
   same GPT step at 24, 96 and 192 layers (``--layers``), and each phase's seconds per layer
   against the smallest size's (1.00: growing linearly): trace (JAX's ``make_jaxpr``, then
   jaxpar's graph build), the search (problem build, the rest of the search), the plan in all
   (pins, search, pricing every node and edge) and the lowering (``pf.lower``: JAX's trace of
   the jitted function and its StableHLO).

4. **compile** (``--compile``, in ``bench/first_call_compile.py``), each size in a fresh
   process: XLA's compile of jaxpar's program, of the same plan lowered with a constraint on
   every value, and of ``jax.jit``'s with the same in/out shardings, interleaved; CPU seconds
   and constraint counts.

``python bench/first_call.py [--quick] [--out DIR]``; ``python bench/first_call.py --phases
[--layers 24 96 192]`` writes ``first_call_phases.json`` / ``.md`` instead, ``--compile
[--layers 6 24] [--repeats 3]`` ``first_call_compile.json`` / ``.md``; ``make bench`` runs
the first two after the other sections.  Times on a shared 2-core machine are noisy: the ratios
mean more than the seconds.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)


def _setup():
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import gpt

    import jaxpar

    return jax, gpt, jaxpar


def _gpt(gpt, layers: int, seq: int = 16, batch: int = 16):
    cfg = gpt.GPTConfig(layers=layers, seq=seq, annotate=False)
    step, params, opt_state = gpt.make_train_step(cfg)
    data = next(gpt.batches(gpt.corpus(), batch, cfg.seq))
    return step, (params, opt_state, data)


# -- 1. per call ----------------------------------------------------------------------------
class _Probe:
    """A jitted function that notes when it is entered and left: what a call of the
    parallelized function spends before and after it is jaxpar's own Python."""

    def __init__(self, fn):
        self.fn, self.entered, self.left = fn, 0.0, 0.0

    def __call__(self, *args):
        self.entered = time.perf_counter()
        out = self.fn(*args)
        self.left = time.perf_counter()
        return out


def _rounds(jax, pf, probe, args, rounds: int, calls: int, reference=None) -> dict:
    """Per-call seconds, best of interleaved rounds, each call waited for: through jaxpar and
    through the jitted function alone, and the median of the rounds' ratios; jaxpar's own
    Python per call (before and after the jitted function: it does not depend on how long XLA
    runs), the best and the median call; and the same measure with the probe called directly,
    no jaxpar around it (``floor``: what the measure reads for the probe itself and the first
    instructions after the last step was waited for, which run on cold caches)."""
    best: dict[str, list[float]] = {"jaxpar": [], "jit": []}
    own, floor = [], []
    for _ in range(rounds):
        for _ in range(calls):
            for into, call in ((own, pf), (floor, probe)):
                t0 = time.perf_counter()
                out = call(*args)
                t1 = time.perf_counter()
                into.append((probe.entered - t0) + (t1 - probe.left))
                jax.block_until_ready(out)
                del out  # freed here, not inside the next timed call
        for name, fn in (("jaxpar", pf), ("jit", reference or probe.fn)):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
            best[name].append((time.perf_counter() - t0) / calls)
    ratios = [a / b for a, b in zip(best["jaxpar"], best["jit"], strict=True)]
    return {k: min(v) for k, v in best.items()} | {
        "own": min(own), "own_median": statistics.median(own), "floor": min(floor),
        "floor_median": statistics.median(floor), "ratio_median": statistics.median(ratios)}


_LOADED = "GPT-2L train step, executable loaded from the plan cache"


def per_call_rows(quick: bool) -> list[dict]:
    jax, gpt, jaxpar = _setup()
    import jax.numpy as jnp

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step, args = _gpt(gpt, 2)

    def touch(params, opt_state, batch):  # every leaf read and written, nothing to communicate
        bump = jax.tree.map(lambda v: v + 1, (params, opt_state))
        return bump[0], bump[1], jnp.sum(batch)

    def touch_dict(params, batch):
        return jax.tree.map(lambda v: v + 1, params), jnp.sum(batch)

    keys = jax.random.split(jax.random.key(0), 44)
    plain = {f"w{i}": jax.random.normal(k, (16, 16)) for i, k in enumerate(keys)}
    cases = [
        ("cheap step, GPT-2L arguments (NNX)", touch, args, "data_parallel", 15, 100),
        ("cheap step, dict of 44 arrays", touch_dict, (plain, args[2]), "data_parallel", 15,
         100),
        ("GPT-2L train step", step, args, "auto_parallel", 5, 10),
        (_LOADED, step, args, "auto_parallel", 5, 10),
    ]
    rows = []
    for name, fn, fn_args, mode, rounds, calls in cases:
        if quick:
            rounds, calls = max(3, rounds // 3), max(3, calls // 4)
        if name == _LOADED:  # a first callable stores the executable, a second loads it
            with tempfile.TemporaryDirectory(prefix="jaxpar-per-call-") as tmp:
                jaxpar.config.update("plan_cache_dir", tmp)
                jax.block_until_ready(jaxpar.parallelize(fn, mesh=mesh, parallel_mode=mode)(
                    *fn_args))
                pf = jaxpar.parallelize(fn, mesh=mesh, parallel_mode=mode)
                entry = pf.compiled_entry(*fn_args)
                jaxpar.config.update("plan_cache_dir", None)
            assert entry.loaded is not None, entry.plan.notes[-1]
            probe = _Probe(entry.loaded.run)  # the executable, through JAX's C++ dispatch
            entry.loaded.run = probe
            reference = entry.jitted  # jax.jit of the same plan, compiled in this process
        else:
            pf = jaxpar.parallelize(fn, mesh=mesh, parallel_mode=mode)
            entry = pf.compiled_entry(*fn_args)
            probe = reference = _Probe(entry.jitted)
            object.__setattr__(entry, "build_jit", lambda p=probe: p)  # jitted, watched
        placed = pf._placed(fn_args, entry)  # the inputs where the plan wants them
        jax.block_until_ready(pf(*placed))  # compiles; later calls reuse it
        jax.block_until_ready(pf(*placed))
        jax.block_until_ready(reference(*placed))
        got = _rounds(jax, pf, probe, placed, rounds, calls, reference)
        rows.append({"case": name, "leaves": len(jax.tree.leaves(placed)), "mode": mode,
                     "jaxpar_us": got["jaxpar"] * 1e6, "jit_us": got["jit"] * 1e6,
                     "own_us": got["own"] * 1e6, "own_median_us": got["own_median"] * 1e6,
                     "floor_us": got["floor"] * 1e6,
                     "floor_median_us": got["floor_median"] * 1e6,
                     "ratio": got["jaxpar"] / got["jit"], "ratio_median": got["ratio_median"],
                     "rounds": rounds, "calls": calls})
        print(f"per call {name}: jaxpar {got['jaxpar'] * 1e6:.0f} us, jax.jit "
              f"{got['jit'] * 1e6:.0f} us, jaxpar's own Python {got['own'] * 1e6:.1f} us "
              f"(the probe alone {got['floor'] * 1e6:.1f} us)", flush=True)
    return rows


def per_call_table(rows: list[dict]) -> list[str]:
    lines = ["## Per call, inputs placed", "",
             "The same executable called through jaxpar and through the jax.jit object jaxpar "
             "built (for the executable loaded from the plan cache: against the jax.jit of the "
             "same plan compiled in the process); per-call time waited for, best of interleaved "
             "rounds, and the median of the rounds' ratios; jaxpar's own = its Python before "
             "and after the jitted function (for the loaded executable: before and after JAX's "
             "C++ dispatch of the loaded executable, which flattens and checks the arguments as "
             "jax.jit's does), per call (best and median call); the probe alone = the same "
             "measure with the jitted function's probe called directly, no jaxpar around it "
             "(the probe's own Python, and the first instructions after a step was waited for "
             "run on cold caches: that much of jaxpar's own is the measure's).",
             "",
             "| step | leaves | jaxpar us | jax.jit us | ratio (best) | (median) | "
             "jaxpar's own us (best) | (median) | probe alone us (best) | (median) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['leaves']} | {r['jaxpar_us']:.0f} | "
                     f"{r['jit_us']:.0f} | {r['ratio']:.3f} | {r['ratio_median']:.3f} | "
                     f"{r['own_us']:.1f} | {r['own_median_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['floor_median_us']:.1f} |")
    return lines


# -- 2. first call, fresh processes ---------------------------------------------------------
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "jax_trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "to_mlir_s",
           "/jax/core/compile/backend_compile_duration": "xla_compile_s"}


def _child(kind: str, layers: int, plan_dir: str, xla_dir: str, specs_path: str) -> dict:
    """One first call in this (fresh) process: ``kind`` is ``jaxpar`` or ``jit``."""
    jax, gpt, jaxpar = _setup()
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    jax.config.update("jax_compilation_cache_dir", xla_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # keep every program
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    events: dict[str, float] = {}

    def listen(event: str, seconds: float, **_: object) -> None:
        if event in _EVENTS:
            events[_EVENTS[event]] = events.get(_EVENTS[event], 0.0) + seconds

    step, args = _gpt(gpt, layers)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    jax.block_until_ready(args)
    jax.monitoring.register_event_duration_secs_listener(listen)  # the first call's events
    counts: dict[str, int] = {}

    def count(event: str, **_: object) -> None:
        if event.startswith("/jax/compilation_cache/cache_"):  # cache_hits, cache_misses
            key = event.rsplit("/", 1)[-1]
            counts[key] = counts.get(key, 0) + 1

    jax.monitoring.register_event_listener(count)
    row: dict = {"kind": kind, "layers": layers}
    spent: dict[str, float] = {}  # where the trace, the plan cache and the call's time goes
    # Moving arguments to their shardings: jax.device_put's and a jitted call's alike (JAX's
    # private module, read by the bench only: jax.jit's transfers happen inside its call).
    _timed(importlib.import_module("jax._src.interpreters.pxla"), "shard_args", spent, "shard")
    # JAX's persistent-cache write (serializing the executable), which JAX times inside its
    # backend-compile event: jax.jit's first call makes it, jaxpar's does not (its executable
    # goes to the plan cache, after the call); taken out of "XLA compile" (into "rest")
    _timed(importlib.import_module("jax._src.compilation_cache"), "put_executable_and_time",
           spent, "jax_cache_write")
    collecting = _gc_clock()  # Python's cyclic collector, in both kinds
    if kind == "jaxpar":
        from jaxpar._src import api, executable_cache, placing, trace

        _timed(trace._Builder, "build", spent, "graph")
        _timed(api, "trace", spent, "trace")
        _timed(api, "plan_cache_key", spent, "key")
        _timed(placing, "place_all", spent, "place")  # the arguments moved to the plan's layouts
        _timed(executable_cache, "store_executable", spent, "store")  # a background thread
        jaxpar.config.update("plan_cache_dir", plan_dir)
        t0 = time.perf_counter()
        pf = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel")
        entry = pf.compiled_entry(*args)  # trace and plan (what pf(*args) does first)
        t1 = time.perf_counter()
        events.clear()  # what JAX records from here on is the lowering and compile
        jax.block_until_ready(pf(*args))  # lower, compile, run
        t2 = time.perf_counter()
        row["gc_s"] = collecting()
        row.update(events, xla_cache=dict(counts))  # the first call's, not the run alone's
        executable_cache.flush()  # what the process waits for at exit: the background write
        write_wait = time.perf_counter() - t2
        spent = dict(spent)  # the first call's (the run alone below adds to the timers)
        placed = pf._placed(args, entry)
        row["run_s"] = _run_alone(jax, lambda: pf(*placed))
        plan = entry.plan
        row.update(first_call_s=t2 - t0, trace_s=entry.timings["trace"],
                   plan_s=entry.timings["search"], call_s=t2 - t1,
                   place_s=spent.get("place", 0.0), store_s=spent.get("store", 0.0),
                   write_wait_s=write_wait, shard_s=spent.get("shard", 0.0),
                   exec_s=entry.timings.get("executable", 0.0),
                   make_jaxpr_s=spent.get("trace", 0.0) - spent.get("graph", 0.0),
                   graph_s=spent.get("graph", 0.0), key_s=spent.get("key", 0.0),
                   plan_cache_hit=bool(plan.notes) and plan.notes[-1].startswith(
                       "loaded from the plan cache"),
                   exec_loaded=getattr(entry, "loaded", None) is not None,
                   ops=entry.program.graph.count("op"))
        if not os.path.exists(specs_path):
            with open(specs_path, "w") as f:
                json.dump({"in": [list(s.to_partition_spec()) for s in plan.input_specs],
                           "out": [list(s.to_partition_spec()) for s in plan.output_specs],
                           "out_tree": str(entry.program.out_tree)}, f)
    else:
        with open(specs_path) as f:
            specs = json.load(f)

        def shardings(tree, flat):
            return jax.tree.unflatten(jax.tree.structure(tree), [
                NamedSharding(mesh, P(*(tuple(a) if isinstance(a, list) else a for a in s)))
                for s in flat])

        # The step returns (params, opt_state, loss): its output tree without tracing it
        # (jax.eval_shape(step) would fill jax.jit's trace cache, and the first call would not
        # trace: 2.5 s of the 24-layer call missing from jax.jit's side).
        out_tree = (args[0], args[1], 0.0)
        assert str(jax.tree.structure(out_tree)) == specs["out_tree"], "another output tree"
        in_shardings = shardings(args, specs["in"])
        t0 = time.perf_counter()
        jitted = jax.jit(step, in_shardings=in_shardings,
                         out_shardings=shardings(out_tree, specs["out"]))
        jax.block_until_ready(jitted(*args))
        row.update(first_call_s=time.perf_counter() - t0, gc_s=collecting(),
                   place_s=spent.get("shard", 0.0))  # inside the call: shard_args
        row.update(events, xla_cache=dict(counts))  # the first call's, not the run alone's
        placed = jax.device_put(args, in_shardings)
        row["run_s"] = _run_alone(jax, lambda: jitted(*placed))
    row["jax_cache_write_s"] = spent.get("jax_cache_write", 0.0)
    row["xla_compile_s"] = row.get("xla_compile_s", 0.0) - row["jax_cache_write_s"]
    # the call less placing, lowering and XLA's compile (and, for jax.jit, its trace of the
    # step, which jaxpar does before the call): JAX's dispatch, its cache write and the step's
    # first run
    call = row["call_s"] if kind == "jaxpar" else row["first_call_s"]
    row["rest_s"] = call - row["place_s"] - sum(row.get(k, 0.0) for k in (
        "jax_trace_s", "to_mlir_s", "xla_compile_s"))
    return row


def _gc_clock():
    """Starts timing Python's cyclic collections; the function returned stops it and gives the
    seconds they took (a collection's pause lands in whatever phase allocates)."""
    import gc

    spent, started = [0.0], [0.0]

    def clock(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]

    gc.callbacks.append(clock)

    def stop() -> float:
        gc.callbacks.remove(clock)
        return spent[0]

    return stop


def _run_alone(jax, call) -> float:
    """Seconds of a call whose program is compiled and whose inputs are in place: the step's
    run (and the dispatch of a warm call), the median of three after one untimed call (the
    first with inputs placed by hand may trace and compile again: other argument shardings
    than the first call's, for jax.jit's C++ cache)."""
    jax.block_until_ready(call())
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- 3. phases, fresh processes -------------------------------------------------------------
def _timed(owner: object, name: str, into: dict[str, float], key: str) -> None:
    """Wraps ``owner.name`` so that its calls add their seconds to ``into[key]`` (wall clock)
    and to ``into[key + "_cpu"]`` (this process's CPU time: what a loaded machine blurs less)."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0
            into[key + "_cpu"] = into.get(key + "_cpu", 0.0) + time.process_time() - c0
            into[key + "_calls"] = into.get(key + "_calls", 0) + 1

    setattr(owner, name, wrapper)


def _phases_child(layers: int) -> dict:
    """jaxpar's phases on the GPT step of ``layers`` layers, in this (fresh) process: the
    functions each phase runs are wrapped with timers, nothing else changes."""
    jax, gpt, jaxpar = _setup()
    from jaxpar._src import api, trace
    from jaxpar._src.search import auto

    spent: dict[str, float] = {}
    _timed(trace._Builder, "build", spent, "graph")
    _timed(api, "trace", spent, "trace")
    _timed(auto, "build_problem", spent, "problem")
    _timed(api, "decide", spent, "search")
    _timed(api, "make_plan", spent, "make_plan")
    _timed(api.Parallelized, "_plan", spent, "plan")
    _timed(api.Parallelized, "lower", spent, "lower")
    step, args = _gpt(gpt, layers)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    jax.block_until_ready(args)
    pf = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel")
    entry = pf.compiled_entry(*args)
    pf.lower(*args)  # the plan is cached: this is the lowering alone
    for suffix in ("", "_cpu"):
        spent["make_jaxpr" + suffix] = spent["trace" + suffix] - spent["graph" + suffix]
    del spent["trace_calls"], spent["graph_calls"], spent["lower_calls"]
    return {"layers": layers, "ops": entry.program.graph.count("op"),
            "nodes": len(entry.program.graph.nodes), "load": os.getloadavg()[0],
            **{k if k.endswith("_calls") else k + "_s": v for k, v in spent.items()}}


_PHASES = (("make_jaxpr_s", "make_jaxpr"), ("graph_s", "graph build"), ("trace_s", "trace"),
           ("problem_s", "problem build"), ("search_s", "search"), ("make_plan_s", "make_plan"),
           ("plan_s", "plan"), ("lower_s", "lower"))


def phases_rows(sizes: list[int]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxpar-phases-") as tmp:
        for layers in sizes:
            out = os.path.join(tmp, f"{layers}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "phases",
                            "--layers", str(layers), "--row", out], check=True,
                           env=dict(os.environ, PYTHONPATH=ROOT))
            with open(out) as f:
                rows.append(json.load(f))
            print("phases", {k: round(v, 2) if isinstance(v, float) else v
                             for k, v in rows[-1].items()}, flush=True)
    return rows


def phases_table(rows: list[dict]) -> list[str]:
    """Seconds per phase, and per layer against the smallest size (1.00: linear)."""
    lines = ["## jaxpar's phases, fresh processes", "",
             "GPT train step (d=128, batch 16 x 16), mesh (dp=2, mp=4), auto_parallel. CPU "
             "seconds of the process per phase (the wall clock is in the JSON; the load average "
             "at the end of each run beside it); in "
             "brackets the added milliseconds per added layer since the size above (the same "
             "at every size: the phase grows linearly). make_jaxpr + graph build = trace; the "
             "search's problem build is inside search, search and make_plan inside plan; "
             "lower: pf.lower with the plan cached. builds: problems the search built (2 when "
             "it searched again with gradient all-reduces priced alone).", "",
             "| layers | ops | load | builds | " + " | ".join(t for _, t in _PHASES) + " |",
             "|---:|---:|---:|---:|" + "---:|" * len(_PHASES)]
    for before, r in zip([None, *rows], rows, strict=False):
        cells = []
        for key, _ in _PHASES:
            cpu = key[:-2] + "_cpu_s"
            if before is None:
                cells.append(f"{r[cpu]:.2f}")
            else:
                slope = (r[cpu] - before[cpu]) / (r["layers"] - before["layers"])
                cells.append(f"{r[cpu]:.2f} ({slope * 1e3:+.0f})")
        lines.append(f"| {r['layers']} | {r['ops']} | {r['load']:.1f} | "
                     f"{r.get('problem_calls', '')} | " + " | ".join(cells) + " |")
    return lines


def run_phases(out_dir: str, sizes: list[int] | None = None) -> dict:
    sizes = sizes or [24, 96, 192]
    result = {"cpus": os.cpu_count(), "phases": phases_rows(sizes)}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "first_call_phases.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["# jaxpar's own time per phase", "",
             f"{result['cpus']} CPUs; the seconds are noisy on a shared machine.", ""]
    lines += phases_table(result["phases"]) + [""]
    with open(os.path.join(out_dir, "first_call_phases.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return result


def _spawn(kind: str, layers: int, plan_dir: str, xla_dir: str, specs: str) -> dict:
    out = specs + f".{kind}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--layers", str(layers),
           "--plan-dir", plan_dir, "--xla-dir", xla_dir, "--specs", specs, "--row", out]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONPATH=ROOT))
    with open(out) as f:
        return json.load(f)


def _pair(layers: int, run: int, ours: dict, jit: dict, repeat: int, jit_first: bool) -> dict:
    return {"layers": layers, "run": run, "repeat": repeat, "jit_first": jit_first,
            "ops": ours["ops"], "jaxpar_s": ours["first_call_s"], "jit_s": jit["first_call_s"],
            "ratio": ours["first_call_s"] / jit["first_call_s"],
            "plan_cache_hit": ours["plan_cache_hit"],
            "exec_loaded": ours.get("exec_loaded", False),
            "xla_cache": ours.get("xla_cache", {}), "jit_xla_cache": jit.get("xla_cache", {}),
            "phases": {k: ours.get(k, 0.0) for k in (
                "trace_s", "make_jaxpr_s", "graph_s", "key_s", "plan_s", "exec_s", "call_s",
                "jax_trace_s", "to_mlir_s", "xla_compile_s", "place_s", "rest_s", "store_s",
                "write_wait_s", "run_s", "gc_s", "jax_cache_write_s")},
            "jit_phases": {k: jit.get(k, 0.0) for k in (
                "jax_trace_s", "to_mlir_s", "xla_compile_s", "place_s", "rest_s", "run_s",
                "gc_s", "jax_cache_write_s")}}


def first_call_rows(sizes: list[int], repeats: int = 3) -> list[dict]:
    """Per size and repeat, fresh processes and fresh caches: jaxpar and jax.jit with empty
    caches, then both again with the caches the first processes filled.  The order alternates
    between repeats (jaxpar first, then jax.jit first): on a shared machine whichever process
    runs second meets warmer files and a different load, and a fixed order biased the ratio.
    jax.jit is given the shardings of the first repeat's plan (the search is deterministic)."""
    rows = []
    for layers in sizes:
        with tempfile.TemporaryDirectory(prefix="jaxpar-first-call-") as keep:
            specs = os.path.join(keep, "specs.json")
            for repeat in range(repeats):
                jit_first = repeat % 2 == 1 and os.path.exists(specs)
                with tempfile.TemporaryDirectory(prefix="jaxpar-first-call-") as tmp:
                    dirs = {k: os.path.join(tmp, k) for k in ("plans", "xla-jaxpar", "xla-jit")}
                    for run in (1, 2):
                        got = {}
                        for kind in (("jit", "jaxpar") if jit_first else ("jaxpar", "jit")):
                            xla = dirs["xla-jaxpar" if kind == "jaxpar" else "xla-jit"]
                            got[kind] = _spawn(kind, layers, dirs["plans"], xla, specs)
                        row = _pair(layers, run, got["jaxpar"], got["jit"], repeat, jit_first)
                        rows.append(row)
                        print(f"first call, {layers} layers, repeat {repeat}, run {run}"
                              f"{' (jax.jit first)' if jit_first else ''}: jaxpar "
                              f"{row['jaxpar_s']:.1f}s, jax.jit {row['jit_s']:.1f}s, XLA "
                              f"compile {row['phases']['xla_compile_s']:.2f}s against "
                              f"{row['jit_phases']['xla_compile_s']:.2f}s", flush=True)
    return rows


def _median_rows(rows: list[dict]) -> list[dict]:
    """One row per size and run: the median over repeats of each time and of each ratio."""
    out = []
    for key in dict.fromkeys((r["layers"], r["run"]) for r in rows):
        group = [r for r in rows if (r["layers"], r["run"]) == key]
        med = statistics.median
        first = [r for r in rows if (r["layers"], r["run"]) == (key[0], 1)]
        again = [r["jaxpar_s"] / f["jaxpar_s"] for r, f in zip(group, first, strict=True)]
        out.append(group[0] | {
            "repeats": len(group), "jaxpar_s": med(r["jaxpar_s"] for r in group),
            "jit_s": med(r["jit_s"] for r in group), "ratio": med(r["ratio"] for r in group),
            "ratio_min": min(r["ratio"] for r in group),
            "ratio_max": max(r["ratio"] for r in group),
            "again": med(again) if key[1] == 2 else None,
            "compile_ratio": med(r["phases"]["xla_compile_s"]
                                 / max(r["jit_phases"]["xla_compile_s"], 1e-9) for r in group),
            "plan_cache_hit": all(r["plan_cache_hit"] for r in group),
            "exec_loaded": all(r["exec_loaded"] for r in group),
            "phases": {k: med(r["phases"][k] for r in group) for k in group[0]["phases"]},
            "jit_phases": {k: med(r["jit_phases"][k] for r in group)
                           for k in group[0]["jit_phases"]}})
    return out


def _hits(counts: dict) -> str:
    return f"{counts.get('cache_hits', 0)}/{counts.get('cache_misses', 0)}"


def first_call_table(rows: list[dict]) -> list[str]:
    lines = ["## First call, fresh processes", "",
             "GPT train step (d=128, batch 16 x 16), mesh (dp=2, mp=4), auto_parallel; jax.jit "
             "given the shardings jaxpar chose. Run 1: empty caches; run 2: jaxpar's plan cache "
             "and JAX's compilation cache (a directory each) as run 1 left them. Each repeat "
             "uses fresh caches and alternates which of the two runs first; medians over the "
             "repeats (the ratio's range beside it). jaxpar's phases: trace (its jaxpr and "
             "graph: make_jaxpr + graph build), key (the plan cache's key: hashing the graph), "
             "plan (search, or plan cache, key included), executable (loading the executable "
             "kept in the plan cache), lower (JAX's trace of the jitted function + StableHLO), "
             "XLA compile (JAX's backend-compile event less JAX's persistent-cache write, "
             "which jax.jit's first call makes inside it: in jit's rest), call (from the plan "
             "to the result: placing the arguments, lowering, compiling and running) and of "
             "it: place (the arguments moved to the plan's layouts), rest (the call less place, "
             "lower and XLA compile: JAX's dispatch and the step's run); jit's cache write: "
             "what JAX's persistent-cache write took in jax.jit's first call; write: "
             "serializing and writing the executable into the plan cache, in a background "
             "thread once the step's outputs are ready (the serialization holds the GIL: the "
             "call's return may wait for it; in brackets: what the process "
             "still waited for at the end); seconds. compile ratio: jaxpar's XLA compile over "
             "jax.jit's, median of the repeats' ratios.", "",
             "| layers | ops | run | repeats | jaxpar s | jax.jit s | ratio (range) | "
             "run 2 / run 1 | plan cache | trace (jaxpr + graph) | key | plan | executable | "
             "lower | XLA compile | call | place | rest | write (waited after) | "
             "jit's XLA compile | jit's cache write | compile ratio | XLA cache hit/miss | "
             "jit's hit/miss |",
             "|---:|---:|---:|---:|---:|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|"
             "---:|---:|---|---:|---:|---:|---|---|"]
    for r in _median_rows(rows):
        p, j = r["phases"], r["jit_phases"]
        again = f"{r['again']:.2f}" if r["again"] is not None else ""
        lines.append(
            f"| {r['layers']} | {r['ops']} | {r['run']} | {r['repeats']} | {r['jaxpar_s']:.1f} "
            f"| {r['jit_s']:.1f} | {r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})"
            f" | {again} | {'hit' if r['plan_cache_hit'] else 'miss'}"
            f"{' + executable' if r['exec_loaded'] else ''} | {p['trace_s']:.1f} "
            f"({p['make_jaxpr_s']:.1f} + {p['graph_s']:.1f}) | {p['key_s']:.2f} | "
            f"{p['plan_s']:.1f} | {p['exec_s']:.2f} | {p['jax_trace_s'] + p['to_mlir_s']:.1f} | "
            f"{p['xla_compile_s']:.2f} | {p['call_s']:.1f} | {p['place_s']:.2f} | "
            f"{p['rest_s']:.2f} | {p['store_s']:.2f} ({p['write_wait_s']:.2f}) | "
            f"{j['xla_compile_s']:.2f} | {j.get('jax_cache_write_s', 0.0):.2f} | "
            f"{r['compile_ratio']:.2f} | "
            f"{_hits(r['xla_cache'])} | {_hits(r['jit_xla_cache'])} |")
    return lines


def side_by_side_table(rows: list[dict]) -> list[str]:
    """The first call phase by phase, jaxpar's seconds beside jax.jit's equivalent."""
    lines = ["## First call, phase by phase: jaxpar against jax.jit", "",
             "The medians of the table above, phase by phase (seconds; run 1: empty caches, "
             "run 2: warm). trace: JAX's trace of the step (jaxpar: make_jaxpr before the "
             "call; jax.jit: inside its first call); graph, key, plan, executable: jaxpar's "
             "own; lower: JAX's trace of the jitted function (jaxpar's: of its evaluator) and "
             "its StableHLO; place: the arguments moved to their shardings (jaxpar: before "
             "its jitted function; jax.jit: inside its call, its shard_args); rest: the first "
             "call less the phases above: JAX's dispatch, its lowering outside StableHLO, the "
             "first run of the step, the compilation cache's write, and for jaxpar its own "
             "Python (settings, the jitted function built, the executable handed to the "
             "background writer); run alone: a later call with the inputs in place (the "
             "step's run, median of 3); gc: Python's cyclic collections during the first "
             "call, wherever they fell.", "",
             "| layers | run | | trace | graph | key | plan | executable | lower | XLA compile "
             "| place | rest | first call | run alone | gc |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in _median_rows(rows):
        p, j = r["phases"], r["jit_phases"]
        ours = [p["make_jaxpr_s"], p["graph_s"], p["key_s"], p["plan_s"] - p["key_s"],
                p["exec_s"], p["jax_trace_s"] + p["to_mlir_s"], p["xla_compile_s"],
                p["place_s"], p["rest_s"], r["jaxpar_s"], p["run_s"], p["gc_s"]]
        jit = [j["jax_trace_s"], None, None, None, None, j["to_mlir_s"], j["xla_compile_s"],
               j["place_s"], j["rest_s"], r["jit_s"], j["run_s"], j["gc_s"]]
        for name, cells in (("jaxpar", ours), ("jax.jit", jit),
                            ("difference", [a - (b or 0.0) for a, b in zip(ours, jit,
                                                                           strict=True)])):
            lines.append(f"| {r['layers']} | {r['run']} | {name} | " + " | ".join(
                "" if c is None else f"{c:.2f}" for c in cells) + " |")
    return lines


def run(quick: bool, out_dir: str, sizes: list[int] | None = None,
        per_call: bool = True, repeats: int | None = None) -> dict:
    """Both tables; writes ``first_call.json`` and ``first_call.md`` to ``out_dir``."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    sizes = sizes or ([6, 24] if quick else [6, 24, 96])
    result = {"load_average": load, "cpus": os.cpu_count(),
              "per_call": per_call_rows(quick) if per_call else [],
              "first_call": first_call_rows(sizes, repeats or (2 if quick else 3))}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "first_call.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["# First call and per call: jaxpar against jax.jit", "",
             f"{result['cpus']} CPUs, load average {load:.1f} at the start: the seconds are "
             f"noisy, the ratios less so.", ""]
    if result["per_call"]:
        lines += per_call_table(result["per_call"]) + [""]
    lines += first_call_table(result["first_call"]) + [""]
    lines += side_by_side_table(result["first_call"]) + [""]
    with open(os.path.join(out_dir, "first_call.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, 6 and 24 layers")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    parser.add_argument("--layers", type=int, nargs="*", help="first-call sizes (6 24 96)")
    parser.add_argument("--skip-per-call", action="store_true")
    parser.add_argument("--repeats", type=int, help="fresh-cache repeats per size (3; 2 quick)")
    parser.add_argument("--phases", action="store_true",
                        help="jaxpar's own time per phase instead (24 96 192 layers)")
    parser.add_argument("--compile", action="store_true",
                        help="XLA's compile of jaxpar's program against jit's instead (6 24)")
    for name in ("--child", "--plan-dir", "--xla-dir", "--specs", "--row"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child == "phases":  # one size's phases, in a process of its own
        row = _phases_child(args.layers[0])
        with open(args.row, "w") as f:
            json.dump(row, f)
        return row
    if args.phases:
        return run_phases(args.out, args.layers)
    if args.compile:  # section 4, a module of its own
        from bench.first_call_compile import run_compile

        return run_compile(args.out, args.layers, args.repeats or 3)
    if args.child:  # one first call, in a process of its own (see _spawn)
        row = _child(args.child, args.layers[0], args.plan_dir, args.xla_dir, args.specs)
        with open(args.row, "w") as f:
            json.dump(row, f)
        return row
    return run(args.quick, args.out, args.layers, not args.skip_per_call, args.repeats)


if __name__ == "__main__":
    main()
