"""Data, tensor and pipeline parallel together: the demo GPT on a (dp, tp, pp) = (2, 2, 2) mesh.

The model is the unannotated GPT of ``gpt.py``, written for one device, trained with Adam whose
moments the parallel optimizer (MindSpore's ``enable_parallel_optimizer``, ZeRO level 1 by
default) splits over the devices that hold copies.  ``auto_parallel`` with
``pipeline_stages=2`` finds the repeated blocks, cuts them into two stages on ``pp`` where only
the residual stream crosses, runs them under a 1F1B schedule of micro-batches, and plans each
stage's layers on the rest of the mesh (``dp`` x ``tp``) with the cost model's search.  The
script prints the plan's explanation (layers, split, schedule, the stage's layouts), the
collectives XLA inserted per mesh axis, and trains a few steps beside the same steps on one
device.  The blocks' weights (and so their Adam moments) are stacked by stage and split over
``pp`` (``PipelineCell.stack``): each stage holds and updates its own blocks, and no weight
crosses ``pp``; ``--per-layer`` keeps them per layer, laid out by the step's plan, which moves
them over ``pp`` every step.

    python examples/gpt_3d.py [--steps N] [--layers L] [--width D] [--smoke]

At the default width (512) the search splits the MLP's first projection over ``tp`` (with
``dp``) and keeps the batch on ``dp``; at width 64 (``--smoke``) it chooses data parallel
over ``dp`` and ``tp`` together, the cheaper plan for so small a model.
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


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--zero", default="level1", choices=["off", "level1", "level3"],
                        help="the parallel optimizer's level (MindSpore's optimizer_level)")
    parser.add_argument("--per-layer", action="store_true",
                        help="keep the per-layer parameters (not stacked by stage): the step "
                             "then moves the block weights over pp every step")
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
    with jaxpar.auto_parallel_context(parallel_mode="auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=args.micro_batches,
                                      pipeline_config={"pipeline_scheduler": "1f1b"}, **zero):
        x, y = data[0][:, :-1], data[0][:, 1:]
        step_fn, params, opt_state = make_step(cfg, optimizer, pipelined=True,
                                               example=None if args.per_layer else (x, y))
        step = jaxpar.parallelize(step_fn, batch_argnums=(2, 3), donate_argnums=(0, 1))
        plan = step.plan(params, opt_state, x, y)
        compiled = step.lower(params, opt_state, x, y).compile()
        colls = jaxpar.inspect.collectives(compiled)
        argument_bytes = compiled.memory_analysis().argument_size_in_bytes
        losses = []
        for batch in data:
            params, opt_state, loss = step(params, opt_state, batch[:, :-1], batch[:, 1:])
            losses.append(float(loss))

    print(f"GPT: {cfg.layers} blocks, d_model {cfg.d_model}, mesh {dict(mesh.shape)}, "
          f"parallel optimizer {args.zero}")
    print(plan.pipeline.explain())
    layouts = plan.input_layouts()
    moments = {k: v for k, v in layouts.items() if ".mu." in k or ".nu." in k}
    axes = sorted({a for spec in moments.values() for a in _axes(spec)})
    print(f"\noptimizer state: {sum(1 for v in moments.values() if any(v))} of {len(moments)} "
          f"Adam moments split, over {axes or 'no axis'}")
    split = {name: spec for name, spec in plan.pipeline.sub_plan.input_layouts().items()
             if any(spec)}
    print("\nthe stage's split arguments on (dp, tp), chosen by the search "
          "(plan.pipeline.sub_plan.input_layouts()):")
    for name, spec in split.items():
        print(f"  {name}: {spec}")
    per_axis = Counter()
    for row in colls:
        per_axis[(row.kind, row.axes)] += row.count
    print("\ncollectives in the compiled step (kind, mesh axes: count, MiB per device):")
    for (kind, axes), n in sorted(per_axis.items(), key=str):
        mib = sum(r.nbytes * r.count for r in colls if (r.kind, r.axes) == (kind, axes)) / 2**20
        print(f"  {kind:20s} {axes}: {n}, {mib:.2f}")
    print(f"per-device arguments (parameters, optimizer state, batch): "
          f"{argument_bytes / 2**20:.2f} MiB")

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
            "argument_bytes": argument_bytes,
            "stage_layouts": split, "moment_axes": axes}


if __name__ == "__main__":
    main()
