"""``jaxpar plan``: plan a function from a user's file, print the table, write the report.

::

    jaxpar plan model.py:train_step --mesh 2x4 --mode auto_parallel \\
        --builder model.py:make_args --html plan.html
    jaxpar plan mypkg.layers:mlp --mesh 8 --args 'f32[64,256],{w1:f32[256,1024]}'

The target is ``module:function`` (imported with the working directory on ``sys.path``) or
``path/to/file.py:function``; shapes come from ``--args`` (see :mod:`argspec`) or from a builder
function returning the positional arguments.  The program is compiled, unless ``--no-compile``,
so the report shows each collective XLA inserted and its cause.  Input errors exit with status 2
and a message that says what to change.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
import time
from typing import Any

from jaxpar._src.errors import JaxparError, MeshError, PlanError

DEFAULT_AXES = {1: ("dp",), 2: ("dp", "mp"), 3: ("dp", "mp", "sp")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``jaxpar plan``."""
    p.add_argument("target", help="the function: module:function or path/to/file.py:function")
    p.add_argument("--mesh", default=None,
                   help="device mesh shape, e.g. 8 or 2x4 (default: every device, one axis)")
    p.add_argument("--axes", default=None,
                   help="mesh axis names, comma-separated (default: dp / dp,mp / dp,mp,sp)")
    p.add_argument("--mode", default="auto_parallel",
                   help="parallel mode: data_parallel, semi_auto_parallel, auto_parallel, "
                        "stand_alone (default: auto_parallel)")
    p.add_argument("--search", default=None, help="search mode of auto_parallel "
                   "(recursive_programming, dynamic_programming, sharding_propagation, optimal)")
    shapes = p.add_mutually_exclusive_group(required=True)
    shapes.add_argument("--args", dest="args_spec", metavar="SPEC",
                        help="argument shapes, e.g. 'f32[8,16],{w:f32[16,4]}'")
    shapes.add_argument("--builder", metavar="TARGET",
                        help="module:function returning the positional arguments (a tuple)")
    p.add_argument("--batch-argnums", default=None,
                   help="arguments that carry the batch, comma-separated (data_parallel)")
    p.add_argument("--hardware", default=None,
                   help="HardwareProfile preset the cost model prices (cpu, a100, h100, ...)")
    p.add_argument("--html", default=None, help="write the report to this file")
    p.add_argument("--json", default=None, help="save the plan (ShardingPlan JSON) here")
    p.add_argument("--no-compile", action="store_true",
                   help="do not compile: the report shows predictions only")
    p.add_argument("--cpu-devices", type=int, default=None,
                   help="CPU devices to emulate (default: the mesh's size, when XLA_FLAGS does "
                        "not set a count)")
    p.add_argument("--verbose", action="store_true", help="list every node in the table")


def command(args: argparse.Namespace, out: Any = None) -> int:
    """Runs ``jaxpar plan``; returns the exit status (2 for input errors)."""
    out = out or sys.stdout
    try:
        return _run(args, out)
    except JaxparError as e:
        message = str(e).removeprefix("jaxpar plan: ").removeprefix("jaxpar plan ")
        print(f"jaxpar plan: error: {message}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, out: Any) -> int:
    shape, names = _mesh_shape(args.mesh, args.axes)
    _emulate_cpu_devices(args.cpu_devices or (math.prod(shape) if shape else None))
    import jaxpar

    fn = load_target(args.target, "the function to plan")
    if not callable(fn):
        raise PlanError(f"jaxpar plan: {args.target} is a {type(fn).__name__}, not a function.")
    if args.builder:
        builder = load_target(args.builder, "--builder")
        built = builder()
        fn_args = tuple(built) if isinstance(built, (tuple, list)) else (built,)
    else:
        from jaxpar._src.report.argspec import parse_args_spec

        fn_args = parse_args_spec(args.args_spec)
    if shape is None or names is None:  # both or neither: no --mesh
        import jax

        shape, names = (len(jax.devices()),), ("dp",)
    mesh = jaxpar.make_mesh(shape, names)
    hardware = jaxpar.HardwareProfile(preset=args.hardware) if args.hardware else None
    step = jaxpar.parallelize(fn, mesh=mesh, parallel_mode=args.mode, search_mode=args.search,
                              hardware=hardware, batch_argnums=_ints(args.batch_argnums))
    try:
        plan = step.plan(*fn_args)
    except TypeError as e:  # the function does not take these arguments
        raise PlanError(f"jaxpar plan: calling {args.target} with the given arguments failed: "
                        f"{e}. Check --args / --builder against its signature.") from None
    print(plan.explain(verbose=args.verbose), file=out)
    if args.json:
        plan.save(args.json)
        print(f"plan saved to {args.json}", file=out)
    compiled = None
    if not args.no_compile:
        t = time.perf_counter()
        compiled = step.lower(*fn_args).compile()
        print(f"compiled in {time.perf_counter() - t:.1f} s", file=out)
    report = plan.report(compiled=compiled, title=f"jaxpar plan {args.target}")
    if report.analysis is not None:
        print(report.analysis.table(), file=out)
    if args.html:
        report.save(args.html)
        size = os.path.getsize(args.html)
        print(f"report written to {args.html} ({size / 1024:.0f} KiB, built in "
              f"{report.build_s:.2f} s)", file=out)
    return 0


def load_target(target: str, what: str) -> Any:
    """The object ``module:attr`` or ``file.py:attr`` names (``attr`` may be dotted)."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise PlanError(f"jaxpar plan: {what} {target!r} is not module:function or "
                        f"path/to/file.py:function.")
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        module = _load_file(module_part, what)
    else:
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # as `python -m` does
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            raise PlanError(f"jaxpar plan: cannot import module {module_part!r} for {what} "
                            f"({e}); run from the directory that holds it, or give a file path "
                            f"such as path/to/{module_part.replace('.', '/')}.py:{attr}.") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_")
                           and callable(getattr(module, n, None)))[:12]
            raise PlanError(f"jaxpar plan: {module_part} has no {attr!r} ({what}); it has "
                            f"{', '.join(names) or 'no public callables'}.")
        obj = getattr(obj, part)
    return obj


def _load_file(path: str, what: str) -> Any:
    if not os.path.isfile(path):
        raise PlanError(f"jaxpar plan: {what}: no file {path!r}.")
    full = os.path.abspath(path)
    name = "_jaxpar_plan_" + os.path.splitext(os.path.basename(full))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == full:
        return sys.modules[name]
    folder = os.path.dirname(full)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # so the file's own imports of its neighbours work
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise PlanError(f"jaxpar plan: {what}: cannot load {path!r} as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _mesh_shape(mesh: str | None, axes: str | None
                ) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    if mesh is None:
        if axes is not None:
            raise MeshError("jaxpar plan: --axes needs --mesh (e.g. --mesh 2x4 --axes dp,mp).")
        return None, None
    try:
        shape = tuple(int(x) for x in mesh.lower().replace("*", "x").split("x"))
    except ValueError:
        raise MeshError(f"jaxpar plan: --mesh {mesh!r} is not a shape such as 8 or 2x4.") \
            from None
    if any(s < 1 for s in shape):
        raise MeshError(f"jaxpar plan: --mesh {mesh!r} has an axis smaller than 1.")
    if axes is None:
        names = DEFAULT_AXES.get(len(shape), tuple(f"a{i}" for i in range(len(shape))))
    else:
        names = tuple(a.strip() for a in axes.split(","))
        if len(names) != len(shape) or len(set(names)) != len(names) or not all(names):
            raise MeshError(f"jaxpar plan: --axes {axes!r} must name the {len(shape)} axes of "
                            f"--mesh {mesh} once each, e.g. --axes "
                            f"{','.join(DEFAULT_AXES.get(len(shape), ('a', 'b')))}.")
    return shape, names


def _emulate_cpu_devices(n: int | None) -> None:
    """Asks JAX for ``n`` CPU devices unless XLA_FLAGS already sets a count (or JAX started)."""
    if not n or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:  # noqa: BLE001 - backends already started: keep what they have
        pass


def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"jaxpar plan: --batch-argnums {text!r} is not a list of "
                        f"argument positions such as 0 or 0,2.") from None
