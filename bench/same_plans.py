"""Fingerprints of the plans jaxpar makes, to show that a change to the search's speed changed no
plan: run it under the code before and after, and compare the two files.

The plans: the GPT train step of ``bench/first_call.py`` (``auto_parallel`` on a ``(2, 4)`` mesh)
at the sizes given, and 28 plans of ``tests/auto_models.py`` (a transformer block, a BERT stack,
a conv net, a wide MLP, a scan, an embedding with a head and a Flax MLP with Adam, each under
``recursive_programming`` and ``dynamic_programming`` and the default and ``h100`` hardware
profiles).  A plan's fingerprint covers every decision (layouts, origins, collectives, cost
terms, runner-up) and every other field of the plan but the search's wall time.  Each line
holds one plan's name and fingerprint; ``OUT.<name>`` holds the plan's text, for a diff.

``python bench/same_plans.py OUT [--layers 24 96]``, once per code tree, then
``diff OUT_BEFORE OUT_AFTER`` (no output: the same plans).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = ("transformer_block", "bert_stack", "convnet", "wide_mlp", "scan_cumprod",
          "embedding_head", "flax_mlp_adam")
MODES = ("recursive_programming", "dynamic_programming")


def plan_text(plan) -> str:
    """Every decision and every field of ``plan`` but the search's wall time, as text."""
    lines = [repr(d) for d in plan.decisions]
    lines += [f"{f.name} {getattr(plan, f.name)!r}" for f in dataclasses.fields(plan)
              if f.name not in ("decisions", "search_s")]
    return "\n".join(lines)


def plans(layers: list[int]):
    """``(name, plan)`` of every plan compared."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import jaxpar
    from bench import first_call
    from tests import auto_models as am

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    _, gpt, _ = first_call._setup()
    for n in layers:
        step, args = first_call._gpt(gpt, n)
        yield f"gpt{n}", jaxpar.parallelize(step, mesh=mesh,
                                            parallel_mode="auto_parallel").plan(*args)
    for name in MODELS:
        made = getattr(am, name)(*((256, 32) if name == "flax_mlp_adam" else ()))
        fn, args = made[0], made[1]
        for mode in MODES:
            for preset in (None, "h100"):
                hw = {} if preset is None else {"hardware": jaxpar.HardwareProfile(preset=preset)}
                pf = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel",
                                        search_mode=mode, **hw)
                yield f"{name}.{mode}.{preset or 'default'}", pf.plan(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, nargs="*", default=[24, 96])
    args = parser.parse_args()
    with open(args.out, "w") as out:
        for name, plan in plans(args.layers):
            text = plan_text(plan)
            with open(f"{args.out}.{name}", "w") as f:
                f.write(text)
            out.write(f"{name} {hashlib.sha256(text.encode()).hexdigest()}\n")
            out.flush()


if __name__ == "__main__":
    main()
