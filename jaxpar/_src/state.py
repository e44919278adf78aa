"""State threading: which arguments a function returns, updated, as results.

A train step ``(params, opt_state, batch) -> (params, opt_state, loss)`` threads its state:
an argument and a top-level result with the same structure, shapes and dtypes are the same state
before and after the step.  jaxpar uses this twice: ``data_parallel`` infers the batch as the
arguments that are *not* state, and every plan gives a state result the layout of its argument,
so the next step needs no resharding and donated buffers can be reused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar._src.trace import TracedProgram


def _sig(tree: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_aval(x) for x in leaves)


def _aval(x: Any) -> tuple[tuple[int, ...], str]:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return tuple(x.shape), str(x.dtype)
    return tuple(jnp.shape(x)), str(jnp.result_type(x))


def _results(out_shapes: Any) -> tuple[Any, ...]:
    return tuple(out_shapes) if isinstance(out_shapes, (tuple, list)) else (out_shapes,)


def threaded_state(args: Sequence[Any], out_shapes: Any, static: Sequence[int]
                   ) -> list[tuple[int, int]]:
    """``(argument index, result index)`` pairs of state; each result pairs at most once."""
    results = _results(out_shapes)
    sigs = [_sig(r) for r in results]
    taken: set[int] = set()
    pairs = []
    for i, arg in enumerate(args):
        if i in static or not jax.tree.leaves(arg):
            continue
        sig = _sig(arg)
        for k, s in enumerate(sigs):
            if k not in taken and s == sig:
                taken.add(k)
                pairs.append((i, k))
                break
    return pairs


def state_ties(program: TracedProgram, args: Sequence[Any], static: Sequence[int]
               ) -> list[tuple[int, int]]:
    """``(input node, output node)`` for every array of the threaded state."""
    graph = program.graph
    results = _results(program.out_shapes)
    if not isinstance(program.out_shapes, (tuple, list)):
        out_offsets = [0]
    else:
        out_offsets, n = [], 0
        for r in results:
            out_offsets.append(n)
            n += len(jax.tree.leaves(r))
    in_offsets: dict[int, int] = {}
    n = 0
    for i, arg in enumerate(args):
        if i in static:
            continue
        in_offsets[i] = n
        n += len(jax.tree.leaves(arg))
    ties = []
    for i, k in threaded_state(args, program.out_shapes, static):
        for j in range(len(jax.tree.leaves(args[i]))):
            ties.append((graph.inputs[in_offsets[i] + j], graph.outputs[out_offsets[k] + j]))
    return ties
