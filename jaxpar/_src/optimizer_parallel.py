"""Optimizer parallel: MindSpore's ``enable_parallel_optimizer``, ZeRO 1/2/3 and FSDP, as layouts.

``set_auto_parallel_context(enable_parallel_optimizer=True, parallel_optimizer_config={...})``
splits dimension 0 of the train step's state over the data-parallel devices, the devices that
otherwise hold identical copies (MindSpore: the parameter's "repeated" devices):

* ``level1`` (ZeRO-1): the optimizer state (Adam's moments and every other state array shaped
  like the parameters);
* ``level2`` (ZeRO-2): also the gradients: ``jaxpar.Model`` constrains them to the same layout
  right where ``jax.grad`` produces them (a function of your own does the same with
  ``jax.lax.with_sharding_constraint``), so no device keeps a whole gradient;
* ``level3`` (ZeRO-3, FSDP): also the parameters, gathered just before each use.

Gradients held across calls, gradient accumulators (optax.MultiSteps's ``acc_grads``, in the
optimizer state; MindSpore's accumulated gradients), are split with the gradients: at level 2
and above, or at level 1 with ``gradient_accumulation_shard`` (MindSpore's switch for them);
level 1 alone keeps them whole, as MindSpore does.  ``Model`` then constrains each micro-step's
gradients split too, so they are reduce-scattered into the accumulator.

Nothing else changes: the layouts are pins like any user strategy, and XLA's SPMD partitioner
inserts the collectives, as MaxText and Levanter do with their ``fsdp`` axis.  The update runs on
each device's slice; at every level the gradient reaches it by reduce-scatter: the lowering
makes it one (:mod:`jaxpar._src.scatter`), since XLA:CPU, unlike XLA:GPU
(``xla/service/gpu/transforms/reduce_scatter_creator.cc``), would keep the all-reduce and a
local slice.  The updated parameters are all-gathered (levels 1-2) or stay split (level 3).
ZeRO's paper (Rajbhandari et al., 2020, section 7) gives the communication per step: ``2Ψ``
for levels 1-2, as data parallel's all-reduce, and ``3Ψ`` for level 3.

Which arrays are split follows MindSpore's ``OptParamMgrImpl::SplitParam`` and
``TensorLayout::GenerateOptShardSliceShape`` (``frontend/parallel/parallel_optimizer/
opt_param_mgr.cc``): arrays smaller than ``parallel_optimizer_threshold`` KB (default 64) stay
whole; dimension 0 of the array's slice must divide by the shard size, else it stays whole; the
shard size ``optimizer_weight_shard_size`` defaults to ``-1``, the whole data-parallel group.

The parameters are told from the optimizer state by structure: state arrays (arguments that come
back as results) form groups of equal pytree structure and shapes, the parameters and their
moments; the first of a group (in argument order: ``step(params, opt_state, batch)``) is the
parameters, the others optimizer state.  State in no group (a step counter, batch statistics)
is left whole, except at level 3, which splits every state array that qualifies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxpar._src.errors import ContextError, NoPlanFits
from jaxpar._src.spec import MeshShape, Spec

LEVELS = {"level1": 1, "level2": 2, "level3": 3, "auto": 0}  # "auto": beyond MindSpore
# Fields of the optimizer state that hold accumulated gradients (split with the gradients).
ACCUMULATORS = ("acc_grads",)
KEYS = ("optimizer_level", "parallel_optimizer_threshold", "optimizer_weight_shard_size",
        "gradient_accumulation_shard")


@dataclasses.dataclass(frozen=True)
class OptimizerParallel:
    """What the parallel optimizer splits (MindSpore's ``parallel_optimizer_config``).

    Attributes:
      level: 1 (optimizer state), 2 (+ gradients), 3 (+ parameters: FSDP); 0 for
        ``"optimizer_level": "auto"`` (jaxpar's, not MindSpore's): the least communication
        whose predicted peak memory fits ``HardwareProfile.memory_per_device`` (see
        :func:`choose_level`).
      threshold_kb: arrays smaller than this many KB stay whole (MindSpore's default 64).
      shard_size: devices one array is split over; ``-1``: the whole data-parallel group.
      accumulation_shard: MindSpore's ``gradient_accumulation_shard``: the gradient
        accumulators (:data:`ACCUMULATORS`) split, and ``Model``'s gradients constrained split
        where ``jax.grad`` makes them, so each micro-step reduce-scatters them into the
        accumulator; as level 2 does.  A step with no accumulators holds no gradient across
        calls: there it changes nothing (level 1 already reduce-scatters the gradients).

    >>> import jaxpar
    >>> jaxpar.set_auto_parallel_context(enable_parallel_optimizer=True,
    ...     parallel_optimizer_config={"optimizer_level": "level3"})
    >>> opt = jaxpar.OptimizerParallel.from_context()
    >>> opt.level, opt.threshold_kb, opt.shards_gradients, opt.shards_parameters
    (3, 64.0, True, True)
    >>> opt.split_axes((1024, 256), "float32", Spec.replicated(2), ("dp",),
    ...                MeshShape(("dp",), (8,)))
    ('dp',)
    >>> jaxpar.reset_auto_parallel_context()
    """

    level: int = 1
    threshold_kb: float = 64.0
    shard_size: int = -1
    accumulation_shard: bool = False

    @classmethod
    def from_options(cls, config: Mapping[str, Any]) -> OptimizerParallel:
        """From a ``parallel_optimizer_config`` dict (validated)."""
        c = check_config(config)
        return cls(LEVELS[c.get("optimizer_level", "level1")],
                   float(c.get("parallel_optimizer_threshold", 64)),
                   int(c.get("optimizer_weight_shard_size", -1)),
                   bool(c.get("gradient_accumulation_shard", False)))

    @classmethod
    def from_context(cls, ctx: Any = None) -> OptimizerParallel | None:
        """The context's setting; ``None`` when ``enable_parallel_optimizer`` is off."""
        from jaxpar._src.context import current_context

        ctx = ctx if ctx is not None else current_context()
        if not ctx.enable_parallel_optimizer:
            return None
        return cls.from_options(dict(ctx.parallel_optimizer_config))

    @property
    def automatic(self) -> bool:
        return self.level == 0

    @property
    def shards_gradients(self) -> bool:
        return self.level >= 2 or self.accumulation_shard

    @property
    def shards_parameters(self) -> bool:
        return self.level >= 3

    def split_axes(self, shape: Sequence[int], dtype: Any, base: Spec, dp_axes: Sequence[str],
                   mesh: MeshShape) -> tuple[str, ...]:
        """The mesh axes dimension 0 of an array of ``shape`` (laid out ``base``) is split over
        in addition; ``()`` when it stays as it is (too small, indivisible, nothing free)."""
        if not shape or math.prod(shape) * np.dtype(dtype).itemsize < self.threshold_kb * 1024:
            return ()
        used = set(base.axes)
        free = tuple(a for a in dp_axes if a not in used)
        group = free if self.shard_size == -1 else _suffix(free, self.shard_size, mesh)
        if not group:
            return ()
        slice0 = shape[0] // mesh.product(base.dims[0])
        return group if slice0 % mesh.product(group) == 0 else ()


def _stacked_leaves(args: Sequence[Any], static: Sequence[int]) -> dict[int, Spec]:
    """The dynamic leaves that are a pipeline's stacked layer weights (``StackedParams``),
    with the layout they were stacked in (dimension 0 over ``"pp"``)."""
    from jaxpar._src.pipeline.stacked import StackedParams

    out: dict[int, Spec] = {}
    n = 0
    for i, a in enumerate(args):
        if i in static:
            continue
        for x in jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, StackedParams)):
            if isinstance(x, StackedParams):
                for j, w in enumerate(x.stacked):
                    out[n + j] = x.layout.specs[j] if x.layout.specs else Spec(
                        (("pp",),) + ((),) * (len(np.shape(w)) - 1))
                n += len(jax.tree.leaves(x))
            else:
                n += 1
    return out


def stacked_dim(opt: OptimizerParallel, value: Any, base: Spec, dp_axes: Sequence[str],
                 mesh: MeshShape) -> tuple[int, tuple[str, ...]]:
    """Where a pipeline's stacked weight (``jaxpar.StackedParams``: ``[S, v, k, ...]`` laid out
    ``base``, dimension 0 over ``"pp"``, one row per stage) is split further: its first later
    dimension that divides."""
    shape = tuple(value.shape)
    for d in range(1, len(shape)):
        rotated = (shape[d],) + shape[:d] + shape[d + 1:]
        turned = Spec((base.dims[d],) + base.dims[:d] + base.dims[d + 1:])
        axes = opt.split_axes(rotated, value.dtype, turned, dp_axes, mesh)
        if axes:
            return d, axes
    return 0, ()


def _suffix(free: tuple[str, ...], k: int, mesh: MeshShape) -> tuple[str, ...]:
    """The innermost free axes whose sizes multiply to ``k`` (MindSpore groups neighbouring
    ranks); raises when no such axes exist."""
    for i in range(len(free)):
        if mesh.product(free[i:]) == k:
            return free[i:]
    if k == 1:
        return ()
    sizes = sorted({mesh.product(free[i:]) for i in range(len(free))})
    raise ContextError(
        f"jaxpar: optimizer_weight_shard_size={k} does not match the data-parallel axes "
        f"{list(free)} of mesh {mesh}: the shard group is made of whole mesh axes, the "
        f"innermost first. Use -1 (all of them) or one of {sizes}.")


def check_config(value: Any) -> dict[str, Any]:
    """``parallel_optimizer_config`` validated (unknown keys and bad values raise).

    >>> check_config({"optimizer_level": "level2", "parallel_optimizer_threshold": 0})
    {'optimizer_level': 'level2', 'parallel_optimizer_threshold': 0}
    """
    if not isinstance(value, Mapping):
        raise ContextError(f"jaxpar: parallel_optimizer_config must be a dict, got {value!r}.")
    for key, v in value.items():
        if key not in KEYS:
            raise ContextError(f"jaxpar: unknown parallel_optimizer_config key {key!r}; known: "
                               f"{', '.join(KEYS)}.")
        if key == "optimizer_level" and v not in LEVELS:
            raise ContextError(f"jaxpar: optimizer_level must be one of {list(LEVELS)}, got "
                               f"{v!r}.")
        if key == "parallel_optimizer_threshold" and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
            raise ContextError(f"jaxpar: parallel_optimizer_threshold is a size in KB (>= 0), "
                               f"got {v!r}.")
        if key == "optimizer_weight_shard_size" and (
                isinstance(v, bool) or not isinstance(v, int) or (v < 1 and v != -1)):
            raise ContextError(f"jaxpar: optimizer_weight_shard_size must be -1 (the whole "
                               f"data-parallel group) or a positive int, got {v!r}.")
        if key == "gradient_accumulation_shard" and not isinstance(v, bool):
            raise ContextError(f"jaxpar: gradient_accumulation_shard must be True or False, "
                               f"got {v!r}.")
    return dict(value)


def state_roles(args: Sequence[Any], state_args: Sequence[int], static: Sequence[int]
                ) -> list[str]:
    """Per array leaf of the dynamic arguments: ``"param"``, ``"optimizer"`` (a state array in a
    group shaped like the parameters, after the first), ``"state"`` (other state) or
    ``"data"``.  See the module docstring.

    >>> import jax.numpy as jnp, optax
    >>> p = {"w": jnp.ones((4, 2))}
    >>> state_roles((p, optax.adam(0.1).init(p), jnp.ones(3)), (0, 1), ())
    ['param', 'state', 'optimizer', 'optimizer', 'data']
    >>> layers = {"l1": {"w": jnp.ones(2)}, "l2": {"w": jnp.ones(2)}}  # equal layers, no moments
    >>> state_roles((layers,), (0,), ())
    ['state', 'state']
    >>> state_roles((layers, optax.sgd(0.1, momentum=0.9).init(layers)), (0, 1), ())
    ['param', 'param', 'optimizer', 'optimizer']
    """
    offsets, n = {}, 0
    for i, a in enumerate(args):
        if i in static:
            continue
        offsets[i] = n
        n += len(jax.tree.leaves(a))
    roles = ["data"] * n
    for i in state_args:
        for j in range(len(jax.tree.leaves(args[i]))):
            roles[offsets[i] + j] = "state"
    # Every subtree of the state, by its structure and shapes, in argument (flatten) order.
    groups: dict[Any, list[tuple[int, int, tuple[int, ...]]]] = {}
    for i in sorted(state_args):
        _subtrees(args[i], offsets[i], (i,), groups)
    # The largest groups first: the parameters and their moments, before the equal layers
    # inside them.  Two equal siblings (layers of one model, both under the same node) are
    # not parameters and a moment: such a group is no evidence.
    for spans in sorted(groups.values(), key=lambda g: -g[0][1]):
        if len(spans) < 2 or (len(spans[0][2]) > 1 and spans[0][2][:-1] == spans[1][2][:-1]):
            continue
        for s, (start, size, _) in enumerate(spans):
            for k in range(start, start + size):
                if roles[k] == "state":
                    roles[k] = "param" if s == 0 else "optimizer"
    return roles


def accumulator_leaves(args: Sequence[Any], static: Sequence[int]) -> set[int]:
    """The array leaves (numbered as :func:`state_roles` numbers them) that are gradient
    accumulators: those under a field named in :data:`ACCUMULATORS`, optax.MultiSteps's
    ``acc_grads`` (MindSpore's ``accu_grads``).  The optimizer state they sit in would split
    them at level 1; MindSpore splits accumulated gradients only with
    ``gradient_accumulation_shard`` (or level 2, which splits the gradients).

    >>> import jax.numpy as jnp, optax
    >>> p = {"w": jnp.ones((4, 2))}
    >>> tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    >>> sorted(accumulator_leaves((p, tx.init(p)), ()))  # p.w, mini_step, gradient_step, acc
    [3]
    """
    out: set[int] = set()
    n = 0
    for i, a in enumerate(args):
        if i in static:
            continue
        paths = jax.tree_util.tree_flatten_with_path(a)[0]
        out.update(n + k for k, (path, _) in enumerate(paths)
                   if any(getattr(e, "name", None) in ACCUMULATORS for e in path))
        n += len(paths)
    return out


def _subtrees(tree: Any, offset: int, path: tuple[int, ...],
              groups: dict[Any, list[tuple[int, int, tuple[int, ...]]]]) -> int:
    """Records every subtree of ``tree`` that holds arrays and is not one bare array under
    its signature, as ``(first leaf, leaves, path)``; returns the number of leaves."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or leaves[0] is tree:
        return len(leaves)
    sig = (treedef, tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x))))
                          for x in leaves))
    spans = groups.setdefault(sig, [])
    if not any(s[0] == offset for s in spans):
        spans.append((offset, len(leaves), path))
    n = offset
    for c, child in enumerate(_children(tree)):
        n += _subtrees(child, n, path + (c,), groups)
    return len(leaves)


def _children(tree: Any) -> list[Any]:
    """The direct children of a pytree node (each child taken whole as a leaf)."""
    return jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)[0]


def optimizer_pins(opt: OptimizerParallel, program: Any, args: Sequence[Any],
                   static: Sequence[int], space: Any, pins: Sequence[Any], *, api: str
                   ) -> list[Any]:
    """``pins`` with the state arrays ``opt`` splits pinned split, argument and result alike
    (a user's layout of such an array is kept and dimension 0 split further over the free
    data-parallel axes).  The data-parallel axes are those dimension 0 of the pinned batch is
    split over, else every mesh axis.  The space learns the inputs pinned so
    (``space.regathered``): at level 3 its prices gather them again for the backward pass."""
    from jaxpar._src.pins import pin
    from jaxpar._src.regather import split_inputs
    from jaxpar._src.state import state_ties, threaded_state

    graph = program.graph
    mesh: MeshShape = space.model.mesh
    state_args = [i for i, _ in threaded_state(args, program.out_shapes, static)]
    roles = state_roles(args, state_args, static)
    for leaf in accumulator_leaves(args, static):  # gradients kept across calls
        if roles[leaf] != "data":
            roles[leaf] = "gradient"
    tied = dict(state_ties(program, args, static))
    out = list(pins)
    index = {(p.node, "in" if p.node in graph.outputs else "out"): k for k, p in enumerate(out)}
    dp: list[str] = []
    for role, nid in zip(roles, graph.inputs, strict=True):
        k = index.get((nid, "out"))
        if role == "data" and k is not None:
            dp += [a for a in out[k].strategy.out_specs[0].dims[0] if a not in dp] \
                if out[k].strategy.out_specs[0].dims else []
    dp_axes = tuple(dp) or mesh.names
    wanted = {"optimizer"} | ({"gradient"} if opt.shards_gradients else set()) | (
        {"param", "state"} if opt.shards_parameters else set())
    stacked = _stacked_leaves(args, static)
    for leaf, (role, nid) in enumerate(zip(roles, graph.inputs, strict=True)):
        value = graph.values[graph.nodes[nid].outputs[0]]
        k = index.get((nid, "out"))
        if role not in wanted:
            if leaf in stacked and k is None and role == "param":
                # a stacked weight stays as the pipeline stacked it (whole over the
                # data-parallel axes below level 3), not as its split moments would pull it
                spec = stacked[leaf]
            else:
                continue
        else:
            base = out[k].strategy.out_specs[0] if k is not None else Spec.replicated(
                len(value.shape))
            dim = 0
            if leaf in stacked and k is None:
                base = stacked[leaf]
                dim, axes = stacked_dim(opt, value, base, dp_axes, mesh)
            else:
                axes = opt.split_axes(value.shape, value.dtype, base, dp_axes, mesh)
            if not axes:
                continue
            dims = list(base.dims)
            dims[dim] = dims[dim] + axes
            spec = Spec(tuple(dims))
        for node, side in ((nid, "out"), (tied.get(nid), "in")):
            if node is None:
                continue
            new = pin(space, node, side, spec, "parallel_optimizer", api=api)
            j = index.get((node, side))
            if j is None:
                index[(node, side)] = len(out)
                out.append(new)
            else:
                out[j] = new
    space.regathered = split_inputs(graph, {p.node: p.origin for p in out})
    return out


def shard_gradients(grads: Any, opt: OptimizerParallel | None) -> Any:
    """``grads`` constrained to level 2's layout (dimension 0 over every axis of the mesh being
    planned, as :func:`optimizer_pins` splits the state they update), so each device keeps
    only its slice of every gradient and XLA reduce-scatters them where they are made.
    Unchanged outside ``parallelize``'s tracing or below level 2; at ``"auto"``, the level the
    trace plans for (``parallelize`` traces a step with gradient accumulators again per
    level tried)."""
    from jaxpar._src.tracing_state import tracing_mesh

    mesh = tracing_mesh()
    if opt is not None and opt.automatic:  # "auto": the level this trace plans for
        from jaxpar._src.pipeline.tracing import current

        traced = current()
        opt = traced.optimizer if traced is not None else None
    if opt is None or not opt.shards_gradients or mesh is None or mesh.size == 1:
        return grads
    shape = MeshShape.of(mesh)

    def constrain(g: Any) -> Any:
        if not hasattr(g, "shape"):
            return g
        axes = opt.split_axes(g.shape, g.dtype, Spec.replicated(g.ndim), shape.names, shape)
        if not axes:
            return g
        return jax.lax.with_sharding_constraint(g, Spec((axes,) + ((),) * (g.ndim - 1))
                                                .to_partition_spec())

    return jax.tree.map(constrain, grads)


def choose_level(plan_for: Any, opt: OptimizerParallel, budget: float,
                 levels: Sequence[int] = (1, 3)) -> Any:
    """``"optimizer_level": "auto"``: the plan of the least-communication setting whose
    predicted peak memory per device (``plan.memory_bytes``) fits ``budget``, trying the
    parallel optimizer off (data parallel's 2Ψ), then level 1 (2Ψ: reduce-scatter and
    all-gather) and level 3 (3Ψ); when none fits, the one with the least memory.  Level 2
    adds nothing to level 1 in a step that holds no gradient across calls (its gradients are
    temporaries the plan already splits where the optimizer state needs them); where it
    does, gradient accumulators (:func:`accumulator_leaves`), the caller passes ``levels``
    ``(1, 2, 3)``: level 2 splits them at level 1's communication, before level 3 gathers
    the parameters too.  The choice is a note of the plan
    and its ``optimizer_level``: a plan made at level 1 makes its split gradients by
    reduce-scatter (``plan.scatters``), as one configured ``"level1"`` does.

    In ``auto_parallel`` the search fits the budget by itself where it can (memory priced in:
    splitting activations and weights at a cost in communication), so an "off" plan that fits
    may be one the budget squeezed (its notes say :data:`~jaxpar._src.search.auto.SQUEEZED`).
    The levels are then planned too, and of the fitting plans within ``NEAR`` (1%) of the least
    predicted step time (``plan.step_time()``) one the budget did not squeeze is taken, then
    the one with the least memory, then the least communication.

    The note names each setting tried, in order, with its predicted memory and step time, or,
    where the search found no plan within the budget, the smallest it found.

    ``plan_for(setting)`` plans with ``setting`` (``None``: off)."""
    from jaxpar._src.errors import PlanError
    from jaxpar._src.search.auto import NEAR, SQUEEZED

    tried: list[tuple[OptimizerParallel | None, Any]] = []
    attempts: list[tuple[OptimizerParallel | None, Any]] = []  # plans and refusals, in order
    for setting in (None, *(dataclasses.replace(opt, level=k) for k in levels)):
        try:  # an automatic search refuses a plan that does not fit by itself
            plan = plan_for(setting)
        except PlanError as e:
            attempts.append((setting, e))
            continue
        tried.append((setting, plan))
        attempts.append((setting, plan))
        if plan.memory_bytes <= budget and SQUEEZED not in plan.notes:
            break
    if not tried:
        raise attempts[-1][1]
    fitting = [t for t in tried if t[1].memory_bytes <= budget]
    if fitting:  # of the fastest (within NEAR), one the budget did not squeeze, least memory
        fastest = min(p.step_time() for _, p in fitting)
        near = [t for t in fitting if t[1].step_time() <= fastest * (1 + NEAR)]
        setting, plan = min(near, key=lambda t: (SQUEEZED in t[1].notes, t[1].memory_bytes))
    else:
        setting, plan = min(tried, key=lambda t: t[1].memory_bytes)
    mib = 2.0**20

    def name(s: OptimizerParallel | None) -> str:
        return "off" if s is None else f"level{s.level}"

    note = (f"parallel optimizer: {name(setting)} chosen ({plan.memory_bytes / mib:.2f} MiB "
            f"predicted per device, budget {budget / mib:.2f} MiB; tried "
            + ", ".join(f"{name(s)}: {_refusal(p)}" if isinstance(p, PlanError) else
                        f"{name(s)} {p.memory_bytes / mib:.2f} MiB {p.step_time() * 1e3:.3g} ms"
                        + (" squeezed by the search" if SQUEEZED in p.notes else "")
                        for s, p in attempts)
            + ("; the fastest that fits" if len(fitting) > 1 else "") + ")")
    return dataclasses.replace(plan, notes=plan.notes + (note,))


def _refusal(error: Exception) -> str:
    """A level's refusal in a few words, for the note of :func:`choose_level`.

    >>> from jaxpar._src.errors import NoPlanFits
    >>> _refusal(NoPlanFits("no plan fits the memory budget ...", 90.1 * 2**20))
    'no plan fits (the smallest the search found needs 90.1 MiB)'
    >>> _refusal(ValueError("something else"))
    'refused (something else)'
    """
    if isinstance(error, NoPlanFits):
        from jaxpar._src.plan import _bytes  # (plan.py's units, as the search's message)

        return f"no plan fits (the smallest the search found needs {_bytes(error.smallest_bytes)})"
    return f"refused ({str(error)[:120]})"
