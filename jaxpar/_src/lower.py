"""Lowering a plan: re-evaluate the graph with a sharding constraint on every chosen value.

The traced graph is evaluated equation by equation (as ``jax.core.eval_jaxpr`` would) inside
``jax.jit``.  Every result is constrained to the layout its operator's strategy gives
(``with_sharding_constraint(NamedSharding)``); where a consumer reads a value in another layout,
a constrained copy is made for it (that is the layout change the plan priced).  Loops are rebuilt
with ``lax.scan``/``lax.while_loop``/``lax.switch`` around the constrained bodies, their carries
pinned to one layout on both ends.  XLA's SPMD partitioner then inserts the collectives.

Not every constraint is needed, and each costs XLA compile time (Shardy's propagation visits them
all: at 24 layers of a GPT train step 5.6k constraints made XLA's compile 1.4x ``jax.jit``'s, for
the very same partitioned program).  :func:`loose_values` finds the results whose layout XLA would
derive anyway and leaves them unconstrained (nineteen in twenty of a transformer's train step's:
573 of 10,481 kept at 24 layers): results of elementwise operators whose operands are in the
result's layout or broadcast from size 1 (the forward image of constrained values) read in that
layout, results of reshapes, transposes, broadcasts, contractions and reductions whose layout
follows from their operands' and whose only collective is the all-reduce of partial sums, and
values only returned (``jit``'s out_shardings say it).  Contractions and reductions with other
collectives, broadcasts of scalars, iotas, layout changes and parameters stay constrained, so
there is no other layout for XLA to pick; ``tests/test_lower.py``
checks that the compiled program, collectives and instructions, is the fully constrained one's.

::

    ShardingPlan ──► in/out NamedShardings ──► jax.jit(run, in_shardings, out_shardings)
                     └─► run(*leaves): for node in graph.order:
                             op      → bind(eqn, read(operands, in_specs)) → constrain(out_specs)
                             control → lax.scan / while_loop / switch over the body nodes
                             checkpoint body → optimization barrier on its inputs, then its nodes
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxpar._src.annotate import annotated_runner, can_annotate
from jaxpar._src.compat import bind_equation
from jaxpar._src.graph import CondRegion, Const, Node, NodeKind, OpGraph, ScanRegion, WhileRegion
from jaxpar._src.masked_gather import masked_gather, needs_masked_gather
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.regather import NONE as NO_REGATHER
from jaxpar._src.regather import Regather
from jaxpar._src.rules.elementwise import BINARY, UNARY
from jaxpar._src.scatter import Scatter, restacked, scatter_fn
from jaxpar._src.spec import Spec


def node_scope(node_id: int) -> str:
    """The name scope around a node's lowering: the compiled program's op metadata
    (``op_name``) then names the plan node every instruction, and every collective XLA inserts
    for it, comes from (``jaxpar#12``); reports and profiles map instructions back to plans by it.
    """
    return f"jaxpar#{node_id}"


def named_sharding(mesh: Mesh, spec: Spec) -> NamedSharding:
    return NamedSharding(mesh, spec.to_partition_spec())


def make_evaluator(graph: OpGraph, plan: ShardingPlan, mesh: Mesh, *,
                   constrain: bool = True, loose: bool = True, annotate: bool = True,
                   name: str = "jaxpar", regather: Regather | None = None
                   ) -> Callable[..., list[Any]]:
    """``run(*leaves) -> out_leaves`` evaluating ``graph`` with ``plan``'s constraints
    (``loose=False``: on every result, :func:`loose_values` too).  Straight-line graphs are
    not evaluated again but written down once, annotated (``annotate.py``; ``annotate=False``:
    always evaluate).  Level 3's parameters are gathered again for the backward pass
    (:mod:`regather`; ``regather``: what the caller found already); at ZeRO levels 1-3 the
    contractions in ``plan.scatters`` make their split gradients by reduce-scatter
    (:mod:`scatter`; the plan's layouts are already the scattered ones)."""
    if regather is None:
        regather = Regather.of(graph, plan) if constrain else NO_REGATHER
    scatters: dict[int, Scatter] = dict(plan.scatters) if constrain else {}
    if scatters:  # partial sums stacked, one per device, as the lowering holds them
        plan = restacked(plan)
    if annotate and constrain and can_annotate(graph):
        return annotated_runner(graph, plan, mesh, loose_values(graph, plan) if loose
                                else frozenset(), name, regather, scatters)
    return _Evaluator(graph, plan, mesh, constrain, loose, regather, scatters).run


# Primitives that lower to one elementwise HLO operation: a result in the layout of its
# same-shaped operands is what XLA's propagation gives it anyway.
_ELEMENTWISE = (frozenset(UNARY) | frozenset(BINARY) | {"select_n", "clamp"}) - {
    "reshard", "mesh_cast"}


def loose_values(graph: OpGraph, plan: ShardingPlan) -> frozenset[int]:
    """Results that need no constraint, because every reader takes them in the layout they are
    made in (no layout change) and XLA's propagation derives that layout anyway:

    - made by an elementwise operator whose operands have the result's shape and layout, or
      size 1 (broadcast, whole) where the result's dimension is larger, every split
      dimension of the result split alike on some operand (scalar literals aside), with no
      layout change on the way: the forward image of already constrained operands (scalar
      operands have none; a layer norm's scale of shape (1, 1, d) times a batch-split
      activation gives the activation's layout).  Inside an elementwise run and at its end,
      read by at most one operator that is not a sum, maximum, reshape, squeeze, transpose,
      broadcast or such an elementwise operator (all reading it in that layout): a value
      read by two contractions keeps its constraint, without which XLA scheduled them the
      other way round (the same instructions, 64 KiB more live on
      ``tests/test_recompute.py``'s step; two convolutions, 8 KiB more on a convnet);
    - made by a reshape, squeeze, transpose, broadcast (of an array), contraction or
      reduction from operands read in their own layout, split only on mesh axes its operands
      are split on, and read in that layout: the layout follows from the operands' (more
      than half of what was left constrained on a transformer's train step).  Its only
      collectives may be the all-reduce of a contraction's or a sum's partial sums (the
      gradient of a weight in data parallelism, a row-parallel layer): what XLA does with a
      split contracted dimension whose result is read whole.  Broadcasts of scalars stay
      constrained (without theirs XLA's simplifier folded a constant through one: one
      multiply fewer in an MLP's gradient, a different program);
    - read only as results of the program, in the layout ``jit``'s out_shardings give them.

    Checkpoint bodies keep every constraint.  ``tests/test_lower.py`` checks that the compiled
    program (collectives, instructions, memory) is the fully constrained one's."""
    nodes, values, decisions = graph.nodes, graph.values, plan.decisions

    def keeps_layout(node: Node) -> bool:
        if node.kind is not NodeKind.OP or node.name not in _ELEMENTWISE or \
                len(node.outputs) != 1 or node.remat is not None:
            return False
        d = decisions[node.id]
        spec, shape = d.out_specs[0], values[node.outputs[0]].shape
        dims, rank = spec.dims, len(shape)
        covered: set[int] = set()  # the result's split dimensions some operand is split on
        whole = False  # an operand of the result's shape read in its layout covers them all
        for operand, read in zip(node.inputs, d.in_specs, strict=True):
            if isinstance(operand, Const):
                if operand.shape:
                    return False
                continue
            v = values[operand]
            vshape = v.shape
            if not vshape and shape:  # a scalar operand (Adam's bias correction) has no layout
                continue
            made = decisions[v.producer].out_specs[v.index]
            if read is not made and read != made or not \
                    len(vshape) == rank == len(read.dims) == len(dims):
                return False  # (ZeRO's restacked partial sums carry one more dimension)
            if vshape == shape and read.dims == dims:  # the common case, dimension by dimension
                whole = True  # below: every k covered
                continue
            for k, (n, want, got) in enumerate(zip(vshape, dims, read.dims, strict=True)):
                if n == shape[k] and got == want:
                    covered.add(k)
                elif got or n != 1:
                    return False  # a size-1 dimension (broadcast) stays whole
        return whole or all(k in covered for k, axes in enumerate(dims) if axes)

    def readers_as_made(vid: int, spec: Spec) -> frozenset[NodeKind] | None:
        """The kinds of node that read ``vid`` (of :data:`_READERS`), if every reader is an
        operator or a result outside checkpoint bodies and takes it in ``spec``; else ``None``.
        (A loop's or branch's crossing has its own layouts: its kind is checked first.)"""
        uses = graph.consumers[vid]
        if not uses:
            return None
        kinds = set()
        for u in uses:
            reader = nodes[u.consumer]
            if reader.kind not in _READERS or reader.remat is not None:
                return None
            read = decisions[u.consumer].in_specs[u.in_index]
            if read is not spec and read != spec:
                return None
            kinds.add(reader.kind)
        return frozenset(kinds)

    def follows_operands(node: Node) -> bool:
        d = plan.decisions[node.id]
        if node.name not in _FOLLOWERS or len(node.outputs) != 1 or node.id in scattered:
            return False
        if d.collectives and (node.name not in _SUMMING or
                              any(c.kind != "all-reduce" for c in d.collectives)):
            return False  # partial sums all-reduced are what XLA makes of split operands
        for operand, read in zip(node.inputs, d.in_specs, strict=True):
            if isinstance(operand, Const):
                if node.name == "broadcast_in_dim":
                    return False
                continue
            v = graph.values[operand]
            if plan.decisions[v.producer].out_specs[v.index] != read or \
                    node.name == "broadcast_in_dim" and not v.shape:
                return False
        split = {a for read in d.in_specs for a in read.axes}
        return set(d.out_specs[0].axes) <= split

    def one_heavy_reader(vid: int) -> bool:
        # the cheap tests first: keeps_layout only of readers that are heavy operators, and
        # none after the second (all pure: the order changes no answer)
        heavy = 0
        for u in graph.consumers[vid]:
            reader = nodes[u.consumer]
            if reader.kind is NodeKind.OP and reader.name not in _LIGHT and \
                    not inner(u.consumer):
                heavy += 1
                if heavy > 1:
                    return False
        return True

    kept: dict[int, bool] = {}

    def inner(nid: int) -> bool:
        """:func:`keeps_layout` of node ``nid``, worked out when first asked (most nodes
        never are: their results are read in another layout)."""
        found = kept.get(nid)
        if found is None:
            found = kept[nid] = keeps_layout(nodes[nid])
        return found

    scattered = {nid for nid, _ in plan.scatters}  # ZeRO's reduce-scatters: written by hand
    loose = set()
    for node in nodes:
        if node.kind is not NodeKind.OP or node.remat is not None:
            continue
        for vid, spec in zip(node.outputs, decisions[node.id].out_specs, strict=True):
            kinds = readers_as_made(vid, spec)
            if kinds is None:
                continue  # read in another layout, in a checkpoint body or by a loop
            if kinds <= _RESULTS or inner(node.id) and one_heavy_reader(vid) or \
                    follows_operands(node):
                loose.add(vid)
    return frozenset(loose)


# Operators whose result layout follows from their operands' where they need no collective
# (``loose_values``).
_FOLLOWERS = frozenset({"reshape", "squeeze", "transpose", "broadcast_in_dim", "dot_general",
                        "reduce_sum", "reduce_max"})
# Of those, the ones whose partial sums (a split contracted or reduced dimension) XLA
# all-reduces where the result is read whole.
_SUMMING = frozenset({"dot_general", "reduce_sum"})

# Readers besides which an elementwise result may have one more (a contraction, a convolution,
# a gather, ...) and still go unconstrained: a value two contractions read keeps its constraint.
_LIGHT = frozenset({"reduce_sum", "reduce_max", "reshape", "squeeze", "transpose",
                    "broadcast_in_dim"})

# Readers that take a value by its plain layout (a loop's or branch's crossing has its own).
_READERS = frozenset({NodeKind.OP, NodeKind.OUTPUT})
_RESULTS = frozenset({NodeKind.OUTPUT})


def evaluate_nodes(graph: OpGraph, plan: ShardingPlan, mesh: Any, seq: Sequence[int],
                   env: dict, *, constrain: bool = True) -> None:
    """Evaluates the top-level nodes ``seq`` of ``graph`` into ``env`` (value id -> array) with
    ``plan``'s constraints on ``mesh`` (a ``Mesh`` or an ``AbstractMesh``): a piece of a
    program, such as one pipeline stage's layer inside ``shard_map`` (so the equations bind
    under the abstract mesh in force, not the one they were traced under)."""
    evaluator = _Evaluator(graph, plan, mesh, constrain, loose=False)
    evaluator.here = True
    evaluator.eval_seq(seq, env)


class _Evaluator:
    def __init__(self, graph: OpGraph, plan: ShardingPlan, mesh: Mesh, constrain: bool,
                 loose: bool = True, regather: Regather = NO_REGATHER,
                 scatters: dict[int, Scatter] | None = None) -> None:
        self.graph = graph
        self.regather = regather
        self.scatters = scatters or {}
        self.plan = plan
        self.mesh = mesh
        self.constrain_all = constrain
        self.here = False  # bind under the abstract mesh in force (evaluate_nodes)
        self.loose = loose_values(graph, plan) if constrain and loose else frozenset()
        self._shardings: dict[Spec, NamedSharding] = {}

    # -- values -------------------------------------------------------------------------------
    def _sharding(self, spec: Spec) -> NamedSharding:
        s = self._shardings.get(spec)
        if s is None:
            s = self._shardings[spec] = named_sharding(self.mesh, spec)
        return s

    def constrain(self, x: Any, spec: Spec) -> Any:
        if not self.constrain_all:
            return x
        return jax.lax.with_sharding_constraint(x, self._sharding(spec))

    def out_spec(self, vid: int) -> Spec:
        v = self.graph.values[vid]
        return self.plan.decisions[v.producer].out_specs[v.index]

    def read(self, env: dict, operand: Any, spec: Spec | None, reader: int | None = None
             ) -> Any:
        if isinstance(operand, Const):
            return operand.value
        x = env[operand]
        if spec is None or spec == self.out_spec(operand):
            return x
        again = self.regather.applies(reader, operand)  # level 3: the backward's own gather
        key = (operand, spec, "backward") if again else (operand, spec)
        copy = env.get(key)
        if copy is None:
            if again:  # a new value that waits for the reader's other operands
                assert reader is not None
                ties = [env[o] for o in self.regather.ties(self.graph, reader, operand)]
                x = jax.lax.optimization_barrier([x, *ties])[0]
            copy = env[key] = jax.lax.with_sharding_constraint(x, self._sharding(spec))
        return copy

    # -- evaluation ---------------------------------------------------------------------------
    def run(self, *leaves: Any) -> list[Any]:
        env: dict = {}
        for nid, leaf in zip(self.graph.inputs, leaves, strict=True):
            env[self.graph.nodes[nid].outputs[0]] = leaf
        self.eval_seq(self.graph.order, env)
        outs = []
        for nid in self.graph.outputs:
            d = self.plan.decisions[nid]
            with jax.named_scope(node_scope(nid)):
                outs.append(self.read(env, self.graph.nodes[nid].inputs[0], d.in_specs[0]))
        return outs

    def eval_seq(self, seq: Sequence[int], env: dict, entered: frozenset[int] = frozenset()
                 ) -> None:
        """Evaluates ``seq`` into ``env``; ``entered``: the checkpoint blocks already open."""
        i = 0
        while i < len(seq):
            block = self._next_block(self.graph.nodes[seq[i]].remat, entered)
            if block is not None:  # a checkpoint body: its contiguous run of nodes
                end = i
                while end < len(seq) and block in self._blocks(self.graph.nodes[seq[end]].remat):
                    end += 1
                self.eval_remat(block, seq[i:end], env, entered)
                i = end
                continue
            self.eval_node(self.graph.nodes[seq[i]], env)
            i += 1

    def _blocks(self, block: int | None) -> list[int]:
        """The checkpoint blocks around a node, innermost first."""
        out = []
        while block is not None:
            out.append(block)
            block = self.graph.remats[block].parent
        return out

    def _next_block(self, block: int | None, entered: frozenset[int]) -> int | None:
        """The outermost block around a node that is not open yet."""
        pending = [b for b in self._blocks(block) if b not in entered]
        return pending[-1] if pending else None

    def eval_remat(self, block: int, seq: Sequence[int], env: dict, entered: frozenset[int]
                   ) -> None:
        """A checkpoint body, lowered as JAX lowers a differentiated ``remat2``: the inputs
        that prevent common-subexpression elimination pass one optimization barrier, so XLA
        recomputes the body instead of reusing the forward pass's values."""
        info = self.graph.remats[block]
        shielded = [o for o, b in zip(info.inputs, info.barrier, strict=True)
                    if b and isinstance(o, int) and o in env]
        inner = dict(zip(shielded, jax.lax.optimization_barrier([env[v] for v in shielded]),
                         strict=True))
        scope = collections.ChainMap(inner, env)
        self.eval_seq(seq, scope, entered | {block})  # type: ignore[arg-type]
        for key, value in inner.items():
            if key not in shielded:  # what the body made (the inputs stay unshielded outside)
                env[key] = value

    def eval_node(self, node: Node, env: dict) -> None:
        if node.kind is NodeKind.OP:
            self.eval_op(node, env)
        elif node.kind is NodeKind.CONST:
            d = self.plan.decisions[node.id]
            env[node.outputs[0]] = self.constrain(jnp.asarray(node.constant), d.out_specs[0])
        elif node.kind is NodeKind.CONTROL:
            match node.structure:
                case ScanRegion() as scan:
                    self.eval_scan(node, scan, env)
                case WhileRegion() as loop:
                    self.eval_while(loop, env)
                case CondRegion() as cond:
                    self.eval_cond(node, cond, env)
        # input, output, enter, exit: filled by run() / the control node

    def eval_op(self, node: Node, env: dict) -> None:
        with jax.named_scope(node_scope(node.id)):
            self._eval_op(node, env)

    def _eval_op(self, node: Node, env: dict) -> None:
        d = self.plan.decisions[node.id]
        invals = [self.read(env, o, s, node.id)
                  for o, s in zip(node.inputs, d.in_specs, strict=True)]
        if node.name == "sharding_constraint":  # a pin: the plan's layout is the user's
            outs = invals[:1]
        elif node.id in self.scatters:  # ZeRO 1-3: the split gradient by reduce-scatter
            outs = [scatter_fn(node, d.in_specs, d.out_specs[0], self.scatters[node.id],
                               self.mesh)(*invals)]
        elif self.here and node.name == "gather" and needs_masked_gather(
                node.eqn.params, d.in_specs[0], len(node.eqn.invars[1].aval.shape),
                node.eqn.invars[0].aval.dtype):  # XLA aborts on it inside shard_map
            outs = [masked_gather(node.eqn.params, *invals)]
        else:
            outs = bind_equation(node.eqn, invals, here=self.here)
        for vid, val, spec in zip(node.outputs, outs, d.out_specs, strict=True):
            env[vid] = val if vid in self.loose else self.constrain(val, spec)

    def _enter(self, nid: int, env: dict, x: Any) -> None:
        node = self.graph.nodes[nid]
        with jax.named_scope(node_scope(nid)):
            env[node.outputs[0]] = self.constrain(x, self.plan.decisions[nid].out_specs[0])

    def _outer(self, nid: int, env: dict, operand_index: int = 0) -> Any:
        node = self.graph.nodes[nid]
        with jax.named_scope(node_scope(nid)):
            return self.read(env, node.inputs[operand_index],
                             self.plan.decisions[nid].in_specs[operand_index])

    def _exits(self, exits: Sequence[int], env: dict, results: Sequence[Any]) -> None:
        for eid, value in zip(exits, results, strict=True):
            env[self.graph.nodes[eid].outputs[0]] = self.constrain(
                value, self.plan.decisions[eid].out_specs[0])

    def _bind(self, env: dict, enters: Sequence[int], values: Sequence[Any]) -> dict:
        for nid, value in zip(enters, values, strict=True):
            self._enter(nid, env, value)
        return env

    def eval_scan(self, node: Node, scan: ScanRegion, env: dict) -> None:
        p = node.eqn.params
        consts = [self._outer(n, env) for n in scan.consts]
        init = [self._outer(n, env) for n in scan.carries]
        xs = [self._outer(n, env) for n in scan.xs]
        ys_exits = scan.exits[len(scan.carries):]

        def step(carry: list, x: list) -> tuple[list, list]:
            benv = self._bind({}, scan.consts + scan.carries + scan.xs, consts + carry + x)
            self.eval_seq(scan.body, benv)
            new = [self._outer(n, benv, 1) for n in scan.carries]
            ys = [self._outer(e, benv) for e in ys_exits]
            return new, ys

        carry, ys = jax.lax.scan(step, init, xs, length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        self._exits(scan.exits, env, list(carry) + list(ys))

    def eval_while(self, loop: WhileRegion, env: dict) -> None:
        cconsts = [self._outer(n, env) for n in loop.cond_consts]
        bconsts = [self._outer(n, env) for n in loop.body_consts]
        init = [self._outer(n, env) for n in loop.carries]

        def cond_fn(carry: list) -> Any:
            cenv = self._bind({}, loop.carries + loop.cond_consts, list(carry) + cconsts)
            self.eval_seq(loop.cond, cenv)
            return self.read(cenv, loop.predicate, None)

        def body_fn(carry: list) -> list:
            benv = self._bind({}, loop.carries + loop.body_consts, list(carry) + bconsts)
            self.eval_seq(loop.body, benv)
            return [self._outer(n, benv, 1) for n in loop.carries]

        final = jax.lax.while_loop(cond_fn, body_fn, init)
        self._exits(loop.exits, env, final)

    def eval_cond(self, node: Node, cond: CondRegion, env: dict) -> None:
        operands = [self._outer(n, env) for n in cond.operands]
        index = self.read(env, node.inputs[0], None)

        def branch(k: int) -> Callable:
            def f(*ops: Any) -> list:
                benv = self._bind({}, cond.operands, ops)
                self.eval_seq(cond.branches[k], benv)
                return [self._outer(e, benv, k) for e in cond.exits]
            return f

        results = jax.lax.switch(index, [branch(k) for k in range(len(cond.branches))], *operands)
        self._exits(cond.exits, env, results)
