"""Tracing to an operator graph: inlining, control flow as units, sources, dead code."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.trace import trace
from tests import models
from tests.util import assert_tree_close


def _names(graph, kind="op"):
    return [n.name for n in graph.nodes if n.kind == kind]


def test_nested_jit_custom_jvp_and_custom_vjp_bodies_are_inlined():
    @jax.custom_vjp
    def clip_grad(x):
        return x

    clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1, 1),))

    @jax.jit
    def inner(x, w):
        return jax.nn.relu(x @ w)  # relu is a custom_jvp

    def f(x, w):
        return clip_grad(inner(x, w)).sum()

    args = (jnp.ones((4, 8)), jnp.ones((8, 2)))
    graph = trace(f, args).graph
    ops = _names(graph)
    assert "dot_general" in ops and "max" in ops and "reduce_sum" in ops
    for call in ("jit", "pjit", "custom_jvp_call", "custom_vjp_call"):
        assert call not in ops
    grad_graph = trace(jax.grad(f, argnums=1), args).graph
    assert "clamp" in _names(grad_graph) or "max" in _names(grad_graph)


def test_source_locations_point_at_user_code():
    def f(x, w):
        return x @ w

    graph = trace(f, (jnp.ones((4, 8)), jnp.ones((8, 2)))).graph
    (dot,) = [n for n in graph.nodes if n.name == "dot_general"]
    assert dot.source.startswith("test_trace.py:") and dot.source.endswith("(f)")


def test_call_sites_tell_callers_apart_and_are_the_frames_own_lines():
    """A helper called from two lines is two operators; called from one line in a loop, one
    kind repeated.  The call sites (remembered per traceback: issue 14) are the user frames'
    ``(file, line)``, innermost first."""
    from jaxpar._src.compat import call_sites, source_frames

    def dense(x, w):
        return x @ w

    def f(x, w):
        for _ in range(3):
            x = dense(x, w)  # one line, three layers
        return dense(x, w)  # another line

    graph = trace(f, (jnp.ones((4, 4)), jnp.ones((4, 4)))).graph
    dots = [n.eqn for n in graph.nodes if n.name == "dot_general"]
    sites = [call_sites(e) for e in dots]
    assert len(dots) == 4 and sites[0] == sites[1] == sites[2] != sites[3]
    for eqn, got in zip(dots, sites, strict=True):
        assert got == tuple((name, line) for name, line, _ in source_frames(eqn))
        assert got[0][0].endswith("test_trace.py") and call_sites(eqn) == got


def test_dead_equations_are_dropped():
    def f(x):
        _unused = jnp.exp(x) * 3
        return x + 1

    graph = trace(f, (jnp.ones(4),)).graph
    assert _names(graph) == ["add"]


def test_scan_body_joins_the_graph_behind_enter_and_exit_nodes():
    params, x = models.init_stack(jax.random.key(0))
    graph = trace(models.scan_stack, (params, x)).graph
    (control,) = [n for n in graph.nodes if n.kind == "control"]
    assert control.name == "scan"
    enters = sorted(n.name for n in graph.nodes if n.kind == "enter")
    assert enters == ["carry", "xs", "xs"]
    exits = sorted(n.name for n in graph.nodes if n.kind == "exit")
    assert exits == ["carry_out", "ys"]
    (dot,) = [n for n in graph.nodes if n.name == "dot_general"]
    assert dot.region == control.id and dot.weight == 3  # runs once per layer
    (carry,) = [n for n in graph.nodes if n.kind == "enter" and n.name == "carry"]
    assert len(carry.inputs) == 2  # the initial value and the back edge from the body


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((2, 4), ("dp", "mp"))


def test_scan_layer_stack_is_planned_consistently(mesh):
    """A stack of layers in lax.scan: the stacked weights' layout reaches the body."""
    params, x = models.init_stack(jax.random.key(1), layers=4, d=16)
    grad_fn = jax.value_and_grad(models.scan_stack_loss)
    step = jaxpar.parallelize(grad_fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=({"w": P(None, None, "mp"), "b": P(None, "mp")},
                                           P("dp")))
    plan = step.plan(params, x)
    body_dots = [d for d in plan.ops("dot_general") if d.weight == 4]
    forward = [d for d in body_dots if d.in_shapes == ((8, 16), (16, 16))]
    assert forward and [str(s) for s in forward[0].in_specs] == ["[dp, -]", "[-, mp]"]
    carries = [d for d in plan.decisions if d.kind == "enter" and d.name == "carry"]
    for c in carries:  # a carry has one layout on both ends of the loop
        assert c.in_specs[0] == c.in_specs[1] == c.out_specs[0]
    assert_tree_close(step(params, x), grad_fn(params, x), rtol=1e-4, atol=1e-5)
    colls = jaxpar.inspect.collectives(step.lower(params, x))
    in_loop = [c for c in colls if c.count == 4]
    assert in_loop, colls.table()  # collectives inside the body run once per layer


def test_while_and_cond_are_planned_and_match(mesh):
    def f(x, w):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        _, h = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))
        return jax.lax.cond(h.sum() > 0, lambda h: h * 2, lambda h: h - 1, h)

    x = jax.random.normal(jax.random.key(2), (8, 16))
    w = jax.random.normal(jax.random.key(3), (16, 16)) / 4
    step = jaxpar.parallelize(f, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=(P("dp"), P(None, "mp")))
    assert_tree_close(step(x, w), f(x, w), rtol=1e-5, atol=1e-6)
    kinds = {d.kind for d in step.plan(x, w).decisions}
    assert {"enter", "exit", "control"} <= kinds
    np.testing.assert_equal(step(x, w).shape, (8, 16))
