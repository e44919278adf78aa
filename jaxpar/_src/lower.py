"""Lowering a plan: re-evaluate the graph with a sharding constraint on every chosen value.

The traced graph is evaluated equation by equation (as ``jax.core.eval_jaxpr`` would) inside
``jax.jit``.  Every result is constrained to the layout its operator's strategy gives
(``with_sharding_constraint(NamedSharding)``); where a consumer reads a value in another layout,
a constrained copy is made for it (that is the layout change the plan priced).  Loops are rebuilt
with ``lax.scan``/``lax.while_loop``/``lax.switch`` around the constrained bodies, their carries
pinned to one layout on both ends.  XLA's SPMD partitioner then inserts the collectives.

::

    ShardingPlan ──► in/out NamedShardings ──► jax.jit(run, in_shardings, out_shardings)
                     └─► run(*leaves): for node in graph.order:
                             op      → bind(eqn, read(operands, in_specs)) → constrain(out_specs)
                             control → lax.scan / while_loop / switch over the body nodes
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxpar._src.compat import bind_equation, scan_counts
from jaxpar._src.graph import Const, Node, OpGraph
from jaxpar._src.plan import ShardingPlan
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
                   constrain: bool = True) -> Callable[..., list[Any]]:
    """``run(*leaves) -> out_leaves`` evaluating ``graph`` with ``plan``'s constraints."""
    return _Evaluator(graph, plan, mesh, constrain).run


def evaluate_nodes(graph: OpGraph, plan: ShardingPlan, mesh: Any, seq: Sequence[int],
                   env: dict, *, constrain: bool = True) -> None:
    """Evaluates the top-level nodes ``seq`` of ``graph`` into ``env`` (value id -> array) with
    ``plan``'s constraints on ``mesh`` (a ``Mesh`` or an ``AbstractMesh``): a piece of a
    program, such as one pipeline stage's layer inside ``shard_map`` (so the equations bind
    under the abstract mesh in force, not the one they were traced under)."""
    evaluator = _Evaluator(graph, plan, mesh, constrain)
    evaluator.here = True
    evaluator.eval_seq(seq, env)


class _Evaluator:
    def __init__(self, graph: OpGraph, plan: ShardingPlan, mesh: Mesh, constrain: bool) -> None:
        self.graph = graph
        self.plan = plan
        self.mesh = mesh
        self.constrain_all = constrain
        self.here = False  # bind under the abstract mesh in force (evaluate_nodes)
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

    def read(self, env: dict, operand: Any, spec: Spec | None) -> Any:
        if isinstance(operand, Const):
            return operand.value
        x = env[operand]
        if spec is None or spec == self.out_spec(operand):
            return x
        key = (operand, spec)
        copy = env.get(key)
        if copy is None:
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

    def eval_seq(self, seq: Sequence[int], env: dict) -> None:
        for nid in seq:
            node = self.graph.nodes[nid]
            if node.kind == "op":
                self.eval_op(node, env)
            elif node.kind == "const":
                d = self.plan.decisions[nid]
                env[node.outputs[0]] = self.constrain(jnp.asarray(node.params["value"]),
                                                      d.out_specs[0])
            elif node.kind == "control":
                {"scan": self.eval_scan, "while": self.eval_while,
                 "cond": self.eval_cond}[node.name](node, env)
            # input, output, enter, exit: filled by run() / the control node

    def eval_op(self, node: Node, env: dict) -> None:
        with jax.named_scope(node_scope(node.id)):
            self._eval_op(node, env)

    def _eval_op(self, node: Node, env: dict) -> None:
        d = self.plan.decisions[node.id]
        invals = [self.read(env, o, s) for o, s in zip(node.inputs, d.in_specs, strict=True)]
        if node.name == "sharding_constraint":  # a pin: the plan's layout is the user's
            outs = invals[:1]
        else:
            outs = bind_equation(node.eqn, invals, here=self.here)
        for vid, val, spec in zip(node.outputs, outs, d.out_specs, strict=True):
            env[vid] = self.constrain(val, spec)

    def _enter(self, nid: int, env: dict, x: Any) -> None:
        node = self.graph.nodes[nid]
        with jax.named_scope(node_scope(nid)):
            env[node.outputs[0]] = self.constrain(x, self.plan.decisions[nid].out_specs[0])

    def _outer(self, nid: int, env: dict, operand_index: int = 0) -> Any:
        node = self.graph.nodes[nid]
        with jax.named_scope(node_scope(nid)):
            return self.read(env, node.inputs[operand_index],
                             self.plan.decisions[nid].in_specs[operand_index])

    def _exits(self, node: Node, env: dict, results: Sequence[Any]) -> None:
        for eid in node.params.get("exits", ()):
            e = self.graph.nodes[eid]
            env[e.outputs[0]] = self.constrain(results[e.params["index"]],
                                               self.plan.decisions[eid].out_specs[0])

    def _by_role(self, seq: Sequence[int]) -> dict[str, list[int]]:
        roles: dict[str, list[int]] = {}
        for nid in seq:
            n = self.graph.nodes[nid]
            if n.kind == "enter":
                roles.setdefault(n.name, []).append(nid)
        for ids in roles.values():
            ids.sort(key=lambda i: self.graph.nodes[i].params["index"])
        return roles

    def eval_scan(self, node: Node, env: dict) -> None:
        p = node.eqn.params
        body = node.params["body"]
        roles = self._by_role(body)
        consts = [self._outer(n, env) for n in roles.get("const", [])]
        init = [self._outer(n, env) for n in roles.get("carry", [])]
        xs = [self._outer(n, env) for n in roles.get("xs", [])]

        def step(carry: list, x: list) -> tuple[list, list]:
            benv: dict = {}
            for nid, c in zip(roles.get("const", []), consts, strict=True):
                self._enter(nid, benv, c)
            for nid, c in zip(roles.get("carry", []), carry, strict=True):
                self._enter(nid, benv, c)
            for nid, xi in zip(roles.get("xs", []), x, strict=True):
                self._enter(nid, benv, xi)
            self.eval_seq(body, benv)
            new = [self._outer(n, benv, 1) for n in roles.get("carry", [])]
            ys = [self._exit_value(e, benv) for e in self._ys_exits(node)]
            return new, ys

        carry, ys = jax.lax.scan(step, init, xs, length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        self._exits(node, env, list(carry) + list(ys))

    def _ys_exits(self, node: Node) -> list[int]:
        _, nk = scan_counts(node.eqn.params)
        exits = {self.graph.nodes[e].params["index"]: e for e in node.params.get("exits", ())}
        n_out = len(node.eqn.outvars)
        # every stacked output must be produced, even if dead outside (keep positions aligned)
        return [exits.get(j) for j in range(nk, n_out)]

    def _exit_value(self, eid: int | None, benv: dict) -> Any:
        if eid is None:
            raise AssertionError("a scan output without an exit node")
        e = self.graph.nodes[eid]
        return self.read(benv, e.inputs[0], self.plan.decisions[eid].in_specs[0])

    def eval_while(self, node: Node, env: dict) -> None:
        carries = node.params["carry_nodes"]
        cond_roles = self._by_role(node.params["cond"])
        body_roles = self._by_role(node.params["body"])
        cconsts = [self._outer(n, env) for n in cond_roles.get("const", [])]
        bconsts = [self._outer(n, env) for n in body_roles.get("const", [])]
        init = [self._outer(n, env) for n in carries]

        def bind(carry: Sequence[Any], consts: Sequence[Any], roles: dict) -> dict:
            e: dict = {}
            for nid, c in zip(carries, carry, strict=True):
                self._enter(nid, e, c)
            for nid, c in zip(roles.get("const", []), consts, strict=True):
                self._enter(nid, e, c)
            return e

        def cond_fn(carry: list) -> Any:
            cenv = bind(carry, cconsts, cond_roles)
            self.eval_seq(node.params["cond"], cenv)
            return self.read(cenv, node.params["predicate"], None)

        def body_fn(carry: list) -> list:
            benv = bind(carry, bconsts, body_roles)
            self.eval_seq(node.params["body"], benv)
            return [self._outer(n, benv, 1) for n in carries]

        final = jax.lax.while_loop(cond_fn, body_fn, init)
        self._exits(node, env, final)

    def eval_cond(self, node: Node, env: dict) -> None:
        enters = sorted(node.params["enter"], key=lambda i: self.graph.nodes[i].params["index"])
        operands = [self._outer(n, env) for n in enters]
        index = self.read(env, node.inputs[0], None)
        exits = sorted(node.params.get("exits", ()),
                       key=lambda i: self.graph.nodes[i].params["index"])
        n_out = len(node.eqn.outvars)

        def branch(k: int) -> Callable:
            def f(*ops: Any) -> list:
                benv: dict = {}
                for nid, o in zip(enters, ops, strict=True):
                    self._enter(nid, benv, o)
                self.eval_seq(node.params["branches"][k], benv)
                outs = [self.read(benv, self.graph.nodes[e].inputs[k],
                                  self.plan.decisions[e].in_specs[k]) for e in exits]
                if len(outs) != n_out:
                    raise AssertionError("a cond output without an exit node")
                return outs
            return f

        results = jax.lax.switch(index, [branch(k) for k in range(len(node.params["branches"]))],
                                 *operands)
        self._exits(node, env, results)
