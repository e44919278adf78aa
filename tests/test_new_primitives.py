"""Primitives JAX 0.10 emits that once had no rule (issue 10): ``remat2`` (``jax.checkpoint``),
``empty2`` (the gradient of ``lax.cond``) and ``stack``/``unstack`` (``jnp.stack``, as in
Meta-style rotary embeddings).  Each is planned like any operator and matches one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar._src.rules import registered_primitives
from jaxpar._src.trace import trace
from tests.util import assert_tree_close


@pytest.fixture(scope="module")
def mesh8():
    return jaxpar.make_mesh((8,), ("dp",))


def _all_have_rules(fn, args):
    graph = trace(fn, args).graph
    names = {n.name for n in graph.nodes if n.kind == "op"}
    assert names <= registered_primitives() | {"sharding_constraint"}, \
        names - registered_primitives()
    return graph


def _mlp_block(p, h):
    return jnp.tanh(jax.nn.gelu(h @ p["w1"]) @ p["w2"]) + h


def _checkpointed_loss(params, x):
    h = x
    for p in params:
        h = jax.checkpoint(_mlp_block)(p, h)
    return jnp.mean(h ** 2)


def test_checkpoint_bodies_are_inlined_planned_and_keep_their_recomputation(mesh8):
    k = jax.random.split(jax.random.key(0), 5)
    params = [{"w1": jax.random.normal(k[i], (32, 64)) / 6,
               "w2": jax.random.normal(k[i + 1], (64, 32)) / 8} for i in (0, 2)]
    x = jax.random.normal(k[4], (64, 32))
    grad = jax.grad(_checkpointed_loss)
    graph = _all_have_rules(grad, (params, x))
    assert "remat2" not in {n.name for n in graph.nodes}
    assert len(graph.remats) == 2 and all(any(b.barrier) for b in graph.remats)
    step = jaxpar.parallelize(grad, mesh=mesh8, parallel_mode="data_parallel",
                              batch_argnums=(1,))
    assert_tree_close(step(params, x), jax.jit(grad)(params, x), rtol=2e-5, atol=2e-6)
    # The recomputed forward pass is ordinary operators, split with the batch like the rest:
    # per device a little over an eighth of one device's work (it was 3.4x, replicated).
    inside = [d for d in step.plan(params, x).ops("dot_general")
              if graph.nodes[d.node].remat is not None]
    assert inside and all(any(not s.is_replicated for s in d.in_specs) for d in inside)
    lowered = step.lower(params, x)
    reference = jax.jit(grad).lower(params, x)
    flops = jaxpar.inspect.flops(lowered.compile())
    assert flops <= 1.25 * jaxpar.inspect.flops(reference.compile()) / 8
    # ...and XLA still recomputes it: the optimization barriers of jax.checkpoint are kept.
    assert lowered.as_text().count("optimization_barrier") == \
        reference.as_text().count("optimization_barrier") > 0


def test_gradient_of_cond_plans_empty2_and_matches(mesh8):
    def loss(w, x):
        h = x @ w
        h = jax.lax.cond(jnp.sum(h) > 0, jnp.sin, lambda a: a * 2, h)
        return jnp.mean(h ** 2)

    w = jax.random.normal(jax.random.key(1), (16, 16)) / 4
    x = jax.random.normal(jax.random.key(2), (32, 16))
    grad = jax.grad(loss)
    graph = _all_have_rules(grad, (w, x))
    assert "empty2" in {n.name for n in graph.nodes}
    step = jaxpar.parallelize(grad, mesh=mesh8, parallel_mode="data_parallel",
                              batch_argnums=(1,))
    assert_tree_close(step(w, x), jax.jit(grad)(w, x), rtol=2e-5, atol=2e-6)


def _rope(x, cos, sin):
    """Meta's rotary embedding: pairs of features rotated, interleaved back with stack."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out.reshape(x.shape)


def test_rotary_embedding_with_stack_splits_the_batch_and_matches(mesh8):
    b, t, h, d = 16, 8, 4, 16
    x = jax.random.normal(jax.random.key(3), (b, t, h, d))
    angles = jnp.arange(t)[:, None, None] * jnp.arange(d // 2)[None, None, :] / d
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    def loss(x, cos, sin):
        return jnp.mean(_rope(x, cos, sin) ** 2)

    fn = jax.grad(loss)  # the forward pass stacks, the backward pass unstacks
    graph = _all_have_rules(fn, (x, cos, sin))
    assert {"stack", "unstack"} <= {n.name for n in graph.nodes}
    step = jaxpar.parallelize(fn, mesh=mesh8, parallel_mode="data_parallel", batch_argnums=(0,))
    assert_tree_close(step(x, cos, sin), jax.jit(fn)(x, cos, sin), rtol=1e-5, atol=1e-6)
    for op in ("stack", "unstack"):
        (d,) = step.plan(x, cos, sin).ops(op)
        assert all(spec.dims[0] == ("dp",) for spec in d.out_specs), d.strategy_str()


def test_stack_and_unstack_rules_keep_the_stacked_axis_whole():
    from jaxpar._src.rules import enumerate_strategies
    from jaxpar._src.rules.registry import OpView, rule_of
    from jaxpar._src.spec import MeshShape

    f32 = np.dtype("float32")
    stack = rule_of(OpView("stack", ((4, 6), (4, 6)), (f32, f32), ((4, 2, 6),), (f32,),
                           {"axis": 1}))
    unstack = rule_of(OpView("unstack", ((4, 2, 6),), (f32,), ((4, 6), (4, 6)), (f32, f32),
                             {"axis": 1}))
    mesh = MeshShape(("x",), (2,))
    for rule in (stack, unstack):
        for s in enumerate_strategies(rule, mesh):
            stacked = s.out_specs[0] if rule is stack else s.in_specs[0]
            assert stacked.dims[1] == ()
        assert len(enumerate_strategies(rule, mesh)) == 3  # whole, rows split, columns split
