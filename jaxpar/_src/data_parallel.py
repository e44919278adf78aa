"""``data_parallel`` mode: which arguments carry the batch, and their layouts.

A JAX program sees the global batch, so a loss that averages over it already has gradients equal
to the mean of the per-device gradients: MindSpore's ``gradients_mean=True``, jaxpar's default.
XLA inserts that all-reduce itself.  MindSpore's ``gradients_mean=False`` (the per-device sum) has
no meaning for a program that never sees per-device losses, so ``parallelize`` refuses it (in
``data_parallel``, ``semi_auto_parallel`` and ``auto_parallel`` alike) rather than compute
something else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from jaxpar._src.errors import PlanError, StrategyError
from jaxpar._src.spec import MeshShape, Spec
from jaxpar._src.state import threaded_state
from jaxpar._src.trace import TracedProgram


def infer_batch_argnums(args: Sequence[Any], out_shapes: Any, static: Sequence[int],
                        names: Sequence[str], *, api: str) -> tuple[int, ...]:
    """Arguments that do not come back as results: the data of a state-threading step.

    Raises:
      PlanError: when the function threads no state (or only state), or the arguments left
        over do not share a leading (batch) dimension, so the batch cannot be told apart;
        pass ``batch_argnums``.
    """
    dyn = [i for i in range(len(args)) if i not in static]
    state = {i for i, _ in threaded_state(args, out_shapes, static)}
    data = tuple(i for i in dyn if i not in state)
    leading = sorted({tuple(leaf.shape)[0] for i in data for leaf in jax.tree.leaves(args[i])
                      if getattr(leaf, "ndim", 0) >= 1})
    if state and data and len(leading) > 1:
        taken = ", ".join(f"'{names[i]}'" for i in data)
        raise PlanError(
            f"{api}: cannot tell which arguments carry the batch. The arguments that do not "
            f"come back as results ({taken}) would be the batch, but their arrays do not share "
            f"a batch dimension (leading sizes {', '.join(map(str, leading))}), so they look "
            f"like weights. Pass batch_argnums=..., e.g. batch_argnums=({dyn[0]},) for "
            f"'{names[dyn[0]]}'.")
    if not state or not data:
        raise PlanError(
            f"{api}: cannot tell which arguments carry the batch. jaxpar infers it for a train "
            f"step that returns its state (arguments returned unchanged in structure are "
            f"state, the rest data), but here "
            f"{'no argument comes back as a result' if not state else 'every argument does'}. "
            f"Pass batch_argnums=..., e.g. batch_argnums=({dyn[-1] if dyn else 0},) for "
            f"'{names[dyn[-1]] if dyn else 'x'}'.")
    return data


def batch_specs(program: TracedProgram, batch: Sequence[int], mesh: MeshShape,
                in_shapes: Sequence[tuple[int, ...]], *, api: str) -> list[Spec]:
    """Dimension 0 of every batch array split over all mesh axes; everything else replicated."""
    specs = []
    n = mesh.num_devices
    for path, arg, shape in zip(program.in_paths, program.arg_index, in_shapes, strict=True):
        if arg in batch and shape:
            if shape[0] % n:
                raise StrategyError(
                    f"{api}: data_parallel splits the batch dimension of '{path}' "
                    f"(shape {list(shape)}) over all {n} devices of mesh {mesh}, but {shape[0]} "
                    f"is not divisible by {n}. Use a global batch size that is a multiple of "
                    f"{n}, or drop the remainder.")
            specs.append(Spec((mesh.names,) + ((),) * (len(shape) - 1)))
        else:
            specs.append(Spec.replicated(len(shape)))
    return specs


def dataset_specs(program: TracedProgram, batch: Sequence[int], strategy: tuple,
                  mesh: Any, in_shapes: Sequence[tuple[int, ...]], in_dtypes: Sequence[Any], *,
                  api: str) -> list[Spec | None]:
    """Layouts of the batch arrays from a tuple ``dataset_strategy`` (one slice-count tuple or
    ``jaxpar.Layout`` per batch array, in argument order); ``None`` for every other leaf."""
    from jaxpar._src.strategy import normalize

    slots = [k for k, arg in enumerate(program.arg_index) if arg in batch]
    if len(strategy) != len(slots):
        names = [program.in_paths[k] for k in slots]
        raise StrategyError(
            f"{api}: dataset_strategy gives {len(strategy)} layouts, but the batch has "
            f"{len(slots)} arrays ({', '.join(names) or 'none'}). Give one slice-count tuple per "
            f"batch array, e.g. dataset_strategy=({', '.join('(8, 1)' for _ in slots)}).")
    out: list[Spec | None] = [None] * len(in_shapes)
    for k, counts in zip(slots, strategy, strict=True):
        out[k] = normalize(counts, in_shapes[k], mesh, dtype=in_dtypes[k],
                           where=f"{api}: dataset_strategy for '{program.in_paths[k]}'")
    return out


def arrival_specs(program: TracedProgram, batch: Sequence[int] | None, strategy: Any,
                  in_shapes: Sequence[tuple[int, ...]]) -> list[Spec | None]:
    """How each argument leaf arrives when that differs from its planned layout:
    ``dataset_strategy="full_batch"`` hands every device the whole batch (replicated), and the
    program slices what each device computes on, without communication."""
    out: list[Spec | None] = [None] * len(in_shapes)
    if strategy != "full_batch" or not batch:
        return out
    for k, arg in enumerate(program.arg_index):
        if arg in batch:
            out[k] = Spec.replicated(len(in_shapes[k]))
    return out
