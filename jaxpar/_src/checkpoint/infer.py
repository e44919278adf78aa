"""``jaxpar.infer_predict_layout``: the layout of every weight in the serving program.

MindSpore compiles the predict network to learn its parameter layouts.  jaxpar needs only its
plan: the plan's input layouts are the ``in_shardings`` XLA compiles with, and planning (trace
and propagation or search) takes a fraction of XLA's compile time.  The program is planned
once; calling or lowering it afterwards reuses the plan.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpar._src.checkpoint.layouts import ArrayLayout, ParameterLayouts
from jaxpar._src.checkpoint.paths import flatten
from jaxpar._src.errors import ContextError, PlanError

API = "jaxpar.infer_predict_layout"


def infer_predict_layout(predict_fn_or_network: Any, *predict_data: Any,
                         params_argnum: int = 0) -> ParameterLayouts:
    """The layout of every parameter in the serving program (MindSpore's
    ``Model.infer_predict_layout``), from jaxpar's plan of it: no XLA compile.

    Args:
      predict_fn_or_network: a :func:`jaxpar.parallelize`'d function (its mesh, mode and
        strategies apply), a plain function (planned under the auto-parallel context), a Flax
        NNX module (called on ``predict_data``; its ``jaxpar.shard`` annotations apply) or a
        ``(params, apply_fn)`` pair.
      *predict_data: the arguments: for a function, all of them, the parameters included; for
        a module or a pair, the inputs only.  Only shapes and dtypes matter.
      params_argnum: which argument of a function holds the parameters.

    Returns:
      A :class:`ParameterLayouts`: ``{path: PartitionSpec}`` for the parameters' arrays (paths
      inside the parameters, ``"blocks.0.attn.q.kernel.value"``), with their shapes and the
      mesh.  Pass it as ``predict_strategy`` to :func:`jaxpar.load_distributed_checkpoint`.

    Raises:
      ContextError: the program runs stand-alone: there is no layout to infer (load with
        ``predict_strategy=None``).

    >>> import jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh((4,), ("mp",))
    >>> def predict(params, x):
    ...     return jnp.maximum(x @ params["w1"], 0) @ params["w2"]
    >>> step = jaxpar.parallelize(predict, mesh=mesh, parallel_mode="semi_auto_parallel",
    ...                           parameter_plan={"params.w1": (1, 4)})
    >>> params = {"w1": jnp.ones((16, 32)), "w2": jnp.ones((32, 8))}
    >>> layouts = jaxpar.infer_predict_layout(step, params, jnp.ones((2, 16)))
    >>> dict(layouts) == {"w1": P(None, "mp"), "w2": P("mp")}
    True
    """
    fn, args, argnum = _program(predict_fn_or_network, predict_data, params_argnum)
    plan = fn.plan(*args)
    if plan.parallel_mode == "stand_alone":
        raise ContextError(
            f"{API}: the program runs stand_alone, so every weight is whole on one device. Set "
            f"parallel_mode='semi_auto_parallel' or 'auto_parallel' (with a mesh), or load with "
            f"predict_strategy=None for one device.")
    if not 0 <= argnum < len(args):
        raise PlanError(f"{API}: params_argnum={argnum}, but the program takes {len(args)} "
                        f"arguments.")
    offset = sum(len(flatten(a)[1]) for a in args[:argnum])
    paths, leaves, _ = flatten(args[argnum])
    labels = [plan.decisions[n].label for n in plan.inputs]
    arrays = {}
    for j, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        k = offset + j
        if k >= len(labels) or not (labels[k] == path or labels[k].endswith("." + path)
                                    or not path):
            raise PlanError(f"{API}: cannot line the plan's inputs up with argument "
                            f"{argnum}'s arrays (at '{path}'). Pass the parameters first, or "
                            f"set params_argnum.")
        d = plan.decisions[plan.inputs[k]]
        arrays[path] = ArrayLayout(d.out_specs[0].to_partition_spec(), d.out_shapes[0],
                                   np.dtype(getattr(leaf, "dtype", None)
                                            or np.asarray(leaf).dtype).name)
    return ParameterLayouts(plan.mesh, arrays, plan.device_ids,
                            f"infer_predict_layout ({plan.parallel_mode})")


def _program(target: Any, data: tuple, argnum: int) -> tuple[Any, tuple, int]:
    """The parallelized program, its arguments, and which one holds the parameters."""
    from jaxpar._src.api import Parallelized, parallelize
    from jaxpar._src.context import ParallelMode, current_context

    if isinstance(target, Parallelized):
        return target, data, argnum
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(target, nnx.Module):
        graphdef, params, rest = nnx.split(target, nnx.Param, ...)

        def predict(params: Any, rest: Any, *inputs: Any) -> Any:
            return nnx.merge(graphdef, params, rest)(*inputs)

        fn: Callable = predict
        args: tuple = (params, rest, *data)
        argnum = 0
    elif isinstance(target, tuple) and len(target) == 2 and callable(target[1]):
        fn, args, argnum = target[1], (target[0], *data), 0
    elif callable(target):
        fn, args = target, data
    else:
        raise ContextError(f"{API}: expected a function, a jaxpar.parallelize'd function, an NNX "
                           f"module or a (params, apply_fn) pair; got {type(target).__name__}.")
    if current_context().parallel_mode is ParallelMode.STAND_ALONE:
        raise ContextError(
            f"{API}: the auto-parallel context is stand_alone, so every weight is whole on one "
            f"device. Set jaxpar.set_auto_parallel_context(parallel_mode='semi_auto_parallel' "
            f"or 'auto_parallel', mesh=...), or pass a jaxpar.parallelize'd function.")
    return parallelize(fn), args, argnum
