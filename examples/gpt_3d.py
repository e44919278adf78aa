"""Data, tensor and pipeline parallel together: the demo GPT on a (dp, tp, pp) = (2, 2, 2) mesh.

The model is the unannotated GPT of ``gpt.py``, written for one device, trained with Adam.
``auto_parallel`` with ``pipeline_stages=2`` finds the repeated blocks, cuts them into two
stages on ``pp`` where only the residual stream crosses, runs them under a 1F1B schedule of
micro-batches, and plans each stage's layers on the rest of the mesh (``dp`` x ``tp``) with the
cost model's search.  The parallel optimizer (MindSpore's ``enable_parallel_optimizer``) runs
at ``"optimizer_level": "auto"``: the search plans with it off, at level 1 and at level 3, and
keeps the least communication whose predicted peak fits ``HardwareProfile.memory_per_device``
(85 MiB here: a budget that binds).  The blocks' weights (and so their Adam moments) are
stacked by stage and split over ``pp`` (``PipelineCell.stack``): each stage holds and updates
its own blocks; ``--per-layer`` keeps them per layer, which moves them over ``pp`` every step.

The script prints what the search chose for each kind of parallelism, the plan's explanation,
the collectives XLA inserted per mesh axis and the compiled memory, then trains a few steps
beside the same steps on one device and stops with an error if the losses differ by more than
1e-4.  ``--plan-only`` stops after the choices (no compile, no training).

    python examples/gpt_3d.py [--steps N] [--layers L] [--width D] [--micro-batches M]
                              [--zero auto|off|level1|level3] [--memory-mib B] [--smoke]

At the defaults (4 blocks of width 512, batch 16 in 8 micro-batches of 2 rows) it prints::

    what the search chose, kind by kind:
      pipeline (pp): 4 layers cut [2, 2] into 2 stages (balanced: by the cost model's time),
        schedule 1f1b, 8 micro-batches of 2 rows, bubble 12.1%
      operator (tp): 2 of 12 stage weights split over tp (stacked [stage, slot, layer, ...]):
        mlp.fc1.kernel: P('pp', None, None, None, ('dp', 'tp'))
        mlp.fc2.kernel: P('pp', None, None, ('dp', 'tp'))
      data (dp): inputs and targets P('dp', 'tp') (rows over dp, positions over tp)
      optimizer: level1
        parallel optimizer: level1 chosen (79.52 MiB predicted per device, budget 85.00 MiB;
        tried off: no plan fits (the smallest the search found needs 91.6 MiB), level1
        79.52 MiB 1.91 ms)

Two rows a micro-batch fill ``dp``; the search gives ``tp`` the positions in the attention and
splits the MLP Megatron's way (first projection by columns, second by rows) over all four
devices of the stage, ``dp`` and ``tp``, with an all-reduce of its output.  A weight split over
the rows' axis ``dp`` means the stage's gradients are reduced per micro-batch inside the loop,
not once a step (the explanation says so).  The compiled step peaks at 82.5 MiB per device.
``--smoke`` (2 blocks of width 64) fits the budget with the optimizer off and splits the
attention's q, k and v projections over ``tp`` by columns instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import jaxpar  # noqa: E402


def make_step(cfg: gpt.GPTConfig, optimizer: optax.GradientTransformation, pipelined: bool,
              example: tuple | None = None):
    """``step(params, opt_state, inputs, targets) -> (params, opt_state, loss)`` and the
    initial parameters and optimizer state; given an ``example`` batch, the pipelined blocks'
    weights are stacked by stage and split over ``pp`` (``PipelineCell.stack``)."""
    graphdef, params = nnx.split(gpt.GPT(cfg, nnx.Rngs(0)), nnx.Param)

    def loss_fn(p, inputs, targets):
        logits = nnx.merge(graphdef, p)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss = jaxpar.PipelineCell(loss_fn) if pipelined else loss_fn
    if pipelined and example is not None:
        params = loss.stack(params, *example)  # each stage holds and updates its own blocks

    def step(p, opt_state, inputs, targets):
        value, grads = jax.value_and_grad(loss)(p, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, value

    return step, params, optimizer.init(params)


def _axes(spec) -> set[str]:
    """The mesh axes a PartitionSpec splits over."""
    return {a for entry in spec if entry for a in (entry if isinstance(entry, tuple) else (entry,))}


def stage_weight_names(params: jaxpar.StackedParams) -> list[str]:
    """Per stacked array of ``params``, the layer weight it stacks (``attn.q.kernel``...)."""
    paths = [jax.tree_util.keystr(path, simple=True, separator=".")
             for path, _ in jax.tree_util.tree_flatten_with_path(params.abstract())[0]]
    return [".".join(paths[group[0]].split(".")[2:]).removesuffix(".value")
            for group in params.layout.groups]


def choices(plan: jaxpar.ShardingPlan, weights: list[str]) -> list[str]:
    """What the search chose, kind by kind, from the plan's public fields: the pipeline split
    and schedule (``plan.pipeline``), the stage weights split over ``tp`` (the stacked weights'
    layouts, ``plan.input_layouts()``; ``weights``: their names), the batch's layout and the
    parallel optimizer's level with the note that says why (``plan.notes``)."""
    pipe, layouts = plan.pipeline, plan.input_layouts()
    c, split = pipe.config, pipe.split
    lines = [f"  pipeline (pp): {pipe.layers} layers cut {list(split.counts)} into {c.stages} "
             f"stages ({split.how}: by the cost model's time), schedule {c.schedule}, "
             f"{c.micro_batches} micro-batches of {pipe.micro_rows} rows, bubble "
             f"{pipe.bubble_fraction:.1%}"]
    stage = {name: layouts[f"p.0.{j}"] for j, name in enumerate(weights)}
    on_tp = {name: spec for name, spec in stage.items() if "tp" in _axes(spec)}
    lines.append(f"  operator (tp): {len(on_tp)} of {len(stage)} stage weights split over tp "
                 f"(stacked [stage, slot, layer, ...]):")
    lines += [f"    {name}: {spec}" for name, spec in on_tp.items()]
    batch = layouts["inputs"]
    lines.append(f"  data (dp): inputs and targets {batch} (rows over {batch[0]}"
                 + (f", positions over {batch[1]}" if len(batch) > 1 and batch[1] else "")
                 + ")")
    level = [n for n in plan.notes if n.startswith("parallel optimizer:")]
    lines.append(f"  optimizer: level{plan.optimizer_level}" if plan.optimizer_level else
                 "  optimizer: off")
    lines += [f"    {n}" for n in level]
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--zero", default="auto", choices=["off", "level1", "level3", "auto"],
                        help="the parallel optimizer's level (MindSpore's optimizer_level); "
                             "auto: the least communication that fits --memory-mib")
    parser.add_argument("--memory-mib", type=float, default=85.0,
                        help="HardwareProfile.memory_per_device in MiB, the budget the search "
                             "and the level must fit (0: the cpu preset's 8 GiB)")
    parser.add_argument("--per-layer", action="store_true",
                        help="keep the per-layer parameters (not stacked by stage): the step "
                             "then moves the block weights over pp every step")
    parser.add_argument("--plan-only", action="store_true",
                        help="print what the search chose and stop (no compile, no training)")
    parser.add_argument("--smoke", action="store_true", help="a tiny run for CI")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.layers, args.width = 2, 2, 64
    cfg = gpt.GPTConfig(layers=args.layers, annotate=False, d_model=args.width, heads=4,
                        ff=4 * args.width, seq=32)
    optimizer = optax.adam(3e-4)
    stream = gpt.batches(gpt.corpus(), 16, cfg.seq)
    data = [np.asarray(next(stream)) for _ in range(args.steps)]

    mesh = jaxpar.make_mesh((2, 2, 2), ("dp", "tp", "pp"))
    zero = {} if args.zero == "off" else {
        "enable_parallel_optimizer": True,
        "parallel_optimizer_config": {"optimizer_level": args.zero}}
    budget = args.memory_mib * 2**20 if args.memory_mib > 0 else None
    hardware = jaxpar.HardwareProfile(preset="cpu", memory_per_device=budget)
    with jaxpar.auto_parallel_context(parallel_mode="auto_parallel", mesh=mesh, hardware=hardware,
                                      pipeline_stages=2, micro_batches=args.micro_batches,
                                      pipeline_config={"pipeline_scheduler": "1f1b"}, **zero):
        x, y = data[0][:, :-1], data[0][:, 1:]
        step_fn, params, opt_state = make_step(cfg, optimizer, pipelined=True,
                                               example=None if args.per_layer else (x, y))
        step = jaxpar.parallelize(step_fn, batch_argnums=(2, 3), donate_argnums=(0, 1))
        plan = step.plan(params, opt_state, x, y)
        print(f"GPT: {cfg.layers} blocks, d_model {cfg.d_model}, mesh {dict(mesh.shape)}, "
              f"parallel optimizer {args.zero}, memory budget "
              f"{(hardware.memory_per_device or 0) / 2**20:.0f} MiB per device")
        if not args.per_layer:
            print("\nwhat the search chose, kind by kind:")
            print("\n".join(choices(plan, stage_weight_names(params))))
        if args.plan_only:
            return {"plan": plan}
        compiled = step.lower(params, opt_state, x, y).compile()
        colls = jaxpar.inspect.collectives(compiled)
        memory = jaxpar.inspect.memory(compiled)
        losses = []
        for batch in data:
            params, opt_state, loss = step(params, opt_state, batch[:, :-1], batch[:, 1:])
            losses.append(float(loss))

    print()
    print(plan.pipeline.explain())
    layouts = plan.input_layouts()
    moments = {k: v for k, v in layouts.items() if ".mu." in k or ".nu." in k}
    axes = sorted({a for spec in moments.values() for a in _axes(spec)})
    print(f"\noptimizer state: {sum(1 for v in moments.values() if any(v))} of {len(moments)} "
          f"Adam moments split, over {axes or 'no axis'}")
    split = {name: spec for name, spec in plan.pipeline.sub_plan.input_layouts().items()
             if any(spec)}
    per_axis: Counter = Counter()
    for row in colls:
        per_axis[(row.kind, row.axes)] += row.count
    print("\ncollectives in the compiled step (kind, mesh axes: count, MiB per device):")
    for (kind, axes_), n in sorted(per_axis.items(), key=str):
        mib = sum(r.nbytes * r.count for r in colls if (r.kind, r.axes) == (kind, axes_)) / 2**20
        print(f"  {kind:20s} {axes_}: {n}, {mib:.2f}")
    print(f"per device: arguments (parameters, optimizer state, batch) "
          f"{memory['argument'] / 2**20:.2f} MiB, compiled total {memory['total'] / 2**20:.2f} "
          f"MiB; the plan predicted {plan.memory_bytes / 2**20:.2f} MiB")

    ref_fn, ref_params, ref_opt = make_step(cfg, optimizer, pipelined=False)
    ref_step = jax.jit(ref_fn)
    reference = []
    for batch in data:
        ref_params, ref_opt, loss = ref_step(ref_params, ref_opt, batch[:, :-1], batch[:, 1:])
        reference.append(float(loss))
    gap = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
    print(f"\nloss {losses[0]:.4f} -> {losses[-1]:.4f} in {len(losses)} steps; one device: "
          f"{reference[0]:.4f} -> {reference[-1]:.4f} (largest difference {gap:.1e})")
    if gap > 1e-4:
        raise SystemExit(f"the pipelined losses differ from one device's by {gap:.1e}")
    return {"plan": plan, "collectives": colls, "losses": losses, "reference": reference,
            "argument_bytes": memory["argument"],
            "stage_layouts": split, "moment_axes": axes}


if __name__ == "__main__":
    main()
