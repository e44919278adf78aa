"""Lowering a plan without evaluating the graph again: the traced jaxpr, annotated once.

:mod:`lower`'s evaluator binds every equation of the graph again inside ``jax.jit`` (JAX traces
the program a second time: abstract evaluation, tracers and name scopes per equation).  Where the
graph is straight-line code (no ``scan``/``while``/``cond``, no checkpoint bodies, no effects),
the same program can be written down directly instead: the traced equations in graph order, each
followed by the ``sharding_constraint`` equations the evaluator would have made (the results'
layouts, and a constrained copy where a reader takes another layout; none inside elementwise
runs, see :func:`lower.loose_values`), every equation under the name scope of its plan node.
That jaxpr becomes one nested, non-inlined ``jit`` call of the jitted function: JAX's trace of
the jitted function then records one equation, and its lowering emits the annotated jaxpr as
a function the program calls, which XLA inlines before partitioning.

The equations are JAX's own (primitive, parameters, source and context as traced); only their
variables are new.  The constraint equations come from tracing ``with_sharding_constraint`` once
per layout and rank, so their parameters are whatever this JAX writes.  ``tests/test_lower.py``
checks that the compiled collectives equal the evaluator's and the plan's.

>>> import jax.numpy as jnp, jaxpar
>>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
>>> f = jaxpar.parallelize(lambda x, w: jnp.tanh(x @ w), mesh=mesh,
...                        parallel_mode="semi_auto_parallel", in_strategy=((2, 1), (1, 4)))
>>> lowered = f.lower(jnp.ones((8, 16)), jnp.ones((16, 32)))
>>> "func.func private" in lowered.as_text()  # the annotated jaxpr, called once
True
>>> "jaxpar#2/dot_general" in lowered.compile().as_text()  # its plan node names it
True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from jaxpar._src.compat import call_closed_jaxpr, scoped_source_info
from jaxpar._src.graph import Const, NodeKind, OpGraph
from jaxpar._src.plan import ShardingPlan
from jaxpar._src.regather import NONE as NO_REGATHER
from jaxpar._src.regather import Regather
from jaxpar._src.scatter import Scatter, scatter_fn
from jaxpar._src.spec import Spec


def can_annotate(graph: OpGraph) -> bool:
    """Whether :func:`annotated_runner` can lower ``graph``: straight-line code without
    checkpoint bodies or effects (the evaluator rebuilds loops, branches and barriers)."""
    if graph.remats:
        return False
    if any(isinstance(graph.nodes[n].inputs[0], Const) for n in graph.outputs):
        return False  # a literal result: the evaluator hands it back as it is
    for node in graph.nodes:
        if node.kind is NodeKind.CONTROL or node.kind is NodeKind.ENTER or \
                node.kind is NodeKind.EXIT:
            return False
        if node.eqn is not None and node.eqn.effects:
            return False
    return True


def annotated_runner(graph: OpGraph, plan: ShardingPlan, mesh: Mesh, loose: frozenset[int],
                     name: str, regather: Regather = NO_REGATHER,
                     scatters: dict[int, Scatter] | None = None) -> Callable[..., list[Any]]:
    """``run(*leaves) -> out_leaves``, like :func:`lower.make_evaluator`'s, that binds the
    annotated jaxpr as one nested call (``graph`` must pass :func:`can_annotate`)."""
    consts = [n for n in graph.nodes if n.kind is NodeKind.CONST]

    def run(*leaves: Any) -> list[Any]:
        values = [jnp.asarray(n.constant) for n in consts]
        avals = [jax.typeof(x) for x in (*leaves, *values)]
        closed = _Annotator(graph, plan, mesh, loose, regather, scatters or {}).build(
            avals, [n.id for n in consts])
        return call_closed_jaxpr(closed, [*leaves, *values], name=name)

    return run


class _Annotator:
    def __init__(self, graph: OpGraph, plan: ShardingPlan, mesh: Mesh, loose: frozenset[int],
                 regather: Regather, scatters: dict[int, Scatter]) -> None:
        self.graph, self.plan, self.mesh, self.loose = graph, plan, mesh, loose
        self.regather = regather
        self.scatters = scatters
        self.eqns: list[jcore.JaxprEqn] = []
        self._templates: dict[tuple[Spec, int], jcore.JaxprEqn] = {}
        self._copies: dict[tuple[int, Spec, bool], jcore.Var] = {}
        # value id -> the layout it is made in (its producer's out spec), noted as it is made:
        # a read compares with it without looking the producer's decision up again
        self._made: dict[int, Spec] = {}
        from jaxpar._src.lower import node_scope  # lower.py imports this module

        self._scope = node_scope

    def build(self, avals: Sequence[Any], const_nodes: Sequence[int]) -> jcore.ClosedJaxpr:
        graph, plan = self.graph, self.plan
        env: dict[int, Any] = {}
        invars = [jcore.Var(a) for a in avals]
        boundary = [*graph.inputs, *const_nodes]
        made = self._made
        for nid, var in zip(boundary, invars, strict=True):
            node = graph.nodes[nid]
            vid = node.outputs[0]
            spec = made[vid] = plan.decisions[nid].out_specs[0]
            if node.kind is NodeKind.CONST:  # constrained as the evaluator does
                var = self._constrain(var, spec, nid)
            env[vid] = var
        nodes, op = graph.nodes, NodeKind.OP
        for nid in graph.order:
            if nodes[nid].kind is op:
                self._op(nid, env)
        outvars = []
        for nid in graph.outputs:
            node = graph.nodes[nid]
            outvars.append(self._read(env, node.inputs[0], plan.decisions[nid].in_specs[0], nid,
                                      None))
        jaxpr = jcore.Jaxpr([], invars, outvars, self.eqns, debug_info=jcore.DebugInfo(
            "jaxpar lowering", "annotated plan", tuple(f"leaf{i}" for i in range(len(invars))),
            tuple(f"out{i}" for i in range(len(outvars)))))
        return jcore.ClosedJaxpr(jaxpr, [])

    # -- equations ----------------------------------------------------------------------------
    def _op(self, nid: int, env: dict[int, Any]) -> None:
        node = self.graph.nodes[nid]
        d = self.plan.decisions[nid]
        eqn = node.eqn
        made = self._made
        invars = [env[o] if o.__class__ is int and (s is made[o] or s == made[o])
                  else self._read(env, o, s, nid, v)  # (the common case inline: as made)
                  for o, s, v in zip(node.inputs, d.in_specs, eqn.invars, strict=True)]
        if node.name == "sharding_constraint":  # a pin: the plan's layout is the user's
            outs = invars[:1]
        elif nid in self.scatters:  # ZeRO 1-3: the split gradient by reduce-scatter
            outs = self._inline(scatter_fn(node, d.in_specs, d.out_specs[0],
                                           self.scatters[nid], self.mesh), invars, nid)
        else:
            outs = [jcore.Var(v.aval) for v in eqn.outvars]
            self.eqns.append(jcore.new_jaxpr_eqn(
                invars, outs, eqn.primitive, eqn.params, eqn.effects,
                scoped_source_info(eqn.source_info, self._scope(nid)), eqn.ctx))
        loose = self.loose
        for vid, var, spec in zip(node.outputs, outs, d.out_specs, strict=True):
            made[vid] = spec
            env[vid] = var if vid in loose else self._constrain(var, spec, nid)

    def _read(self, env: dict[int, Any], operand: Any, spec: Spec | None, nid: int,
              var: Any) -> Any:
        if isinstance(operand, Const):
            return var if isinstance(var, jcore.Literal) else jcore.Literal(
                operand.value, var.aval)
        x = env[operand]
        if spec is None:
            return x
        made = self._made[operand]  # the producer's out spec
        if spec is made or spec == made:
            return x
        again = self.regather.applies(nid, operand)  # level 3: the backward's own gather
        key = (operand, spec, again)
        copy = self._copies.get(key)
        if copy is None:  # a layout change, made once per value and layout (as evaluated)
            if again:  # a new value that waits for the reader's other operands
                x = self._barrier([x, *(env[o] for o in self.regather.ties(self.graph, nid,
                                                                           operand))], nid)
            copy = self._copies[key] = self._constrain(x, spec, nid)
        return copy

    def _inline(self, fn: Callable[..., Any], xs: list[Any], nid: int) -> list[Any]:
        """The equations of ``fn`` traced on ``xs``'s avals, written down on ``xs`` (as the
        evaluator's call of ``fn`` binds them)."""
        closed = jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)
                                      for x in xs))
        assert not closed.consts, "a traced scatter with constants"
        env: dict[Any, Any] = dict(zip(closed.jaxpr.invars, xs, strict=True))

        def get(v: Any) -> Any:
            return v if isinstance(v, jcore.Literal) else env[v]

        for eqn in closed.jaxpr.eqns:
            outs = [jcore.Var(v.aval) for v in eqn.outvars]
            env.update(zip(eqn.outvars, outs, strict=True))
            self.eqns.append(jcore.new_jaxpr_eqn(
                [get(v) for v in eqn.invars], outs, eqn.primitive, eqn.params, eqn.effects,
                scoped_source_info(eqn.source_info, self._scope(nid)), eqn.ctx))
        return [get(v) for v in closed.jaxpr.outvars]

    def _barrier(self, xs: list[Any], nid: int) -> jcore.Var:
        """``optimization_barrier(xs)[0]``, as the evaluator binds it."""
        avals = [x.aval for x in xs]
        template = _barrier_equation(avals)
        outs = [jcore.Var(a) for a in avals]
        self.eqns.append(jcore.new_jaxpr_eqn(
            xs, outs, template.primitive, template.params, template.effects,
            scoped_source_info(template.source_info, self._scope(nid)), template.ctx))
        return outs[0]

    def _constrain(self, var: Any, spec: Spec, nid: int) -> jcore.Var:
        aval = var.aval
        key = (spec, len(aval.shape))
        template = self._templates.get(key)
        if template is None:
            template = self._templates[key] = _constraint_equation(
                NamedSharding(self.mesh, spec.to_partition_spec()), aval)
        out = jcore.Var(aval)
        self.eqns.append(jcore.new_jaxpr_eqn(
            [var], [out], template.primitive, template.params, template.effects,
            scoped_source_info(template.source_info, self._scope(nid)), template.ctx))
        return out


def _barrier_equation(avals: Sequence[Any]) -> jcore.JaxprEqn:
    """The equation ``optimization_barrier(xs)`` makes for ``xs`` of ``avals``."""
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    closed = jax.make_jaxpr(lambda *xs: jax.lax.optimization_barrier(xs))(*shapes)
    (eqn,) = closed.jaxpr.eqns
    return eqn


def _constraint_equation(sharding: NamedSharding, aval: Any) -> jcore.JaxprEqn:
    """The equation ``with_sharding_constraint(x, sharding)`` makes for an ``x`` of ``aval``'s
    rank, as this JAX writes it."""
    shape = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    closed = jax.make_jaxpr(lambda x: jax.lax.with_sharding_constraint(x, sharding))(shape)
    (eqn,) = closed.jaxpr.eqns
    return eqn
