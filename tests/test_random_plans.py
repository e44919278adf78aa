"""Any combination of rule-valid strategies must compute what one device computes.

Every node gets a random candidate of its own rule; the plan pays whatever layout changes that
implies.  This checks the rules (every strategy they offer is realisable) and the lowering
(constraints, layout copies, rebuilt loops) together, on many primitives at once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxpar
from jaxpar._src.cost import CostModel
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.lower import make_evaluator, named_sharding
from jaxpar._src.planner import make_plan
from jaxpar._src.search import Assignment, SearchSpace
from jaxpar._src.spec import MeshShape
from jaxpar._src.trace import trace
from tests import models
from tests.util import assert_tree_close

MESHES = {"2x4": ((2, 4), ("dp", "mp")), "8": ((8,), ("x",)), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}


def run_random_plan(fn, args, mesh, seed):
    program = trace(fn, args)
    graph = program.graph
    space = SearchSpace(graph, CostModel(MeshShape.of(mesh), HardwareProfile()))
    rng = np.random.default_rng(seed)
    chosen = {}
    for node in graph.searchable():
        cands = space.candidates(node.id)
        chosen[node.id] = cands[rng.integers(len(cands))]
    plan = make_plan(graph, Assignment(chosen, {}), space, device_ids=range(mesh.size),
                     parallel_mode="test", search_mode="random")
    run = make_evaluator(graph, plan, mesh)
    flat_in = [named_sharding(mesh, s) for s in plan.input_specs]
    out = jax.jit(lambda *leaves: run(*leaves), in_shardings=flat_in)(*jax.tree.leaves(args))
    return jax.tree.unflatten(program.out_tree, out), plan


def _mixed_loss(params, x):
    """The operator mix of issue 10: a scan over layers whose body is a jax.checkpoint
    (remat2), a cond, and a cumprod (differentiated, JAX computes it as an associative scan:
    strided slices, pads and concatenations)."""
    def layer(h, p):
        h = jax.checkpoint(lambda h, p: jnp.tanh(h @ p[0] + p[1]))(h, p)
        return h, jnp.sum(h, axis=1)

    h, sums = jax.lax.scan(layer, x, (params["w"], params["b"]))
    h = jax.lax.cond(jnp.sum(sums) > 0, lambda a: a * 0.5, lambda a: a + 1.0, h)
    return jnp.mean(jnp.cumprod(1 + 0.1 * h, axis=1) ** 2)


def _cases():
    key = jax.random.key(0)
    p_mlp, x_mlp = models.init_mlp(key)
    p_blk, x_blk = models.init_block(key)
    p_cnn, x_cnn = models.init_convnet(key)
    p_stk, x_stk = models.init_stack(key)
    p_mix, x_mix = models.init_stack(key, layers=3, batch=8, d=16)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (p_mix, x_mix))
    return {
        "mlp_grad": (jax.value_and_grad(models.mlp_loss), (p_mlp, x_mlp)),
        "block_grad": (jax.value_and_grad(models.block_loss), (p_blk, x_blk)),
        "convnet_grad": (jax.value_and_grad(models.convnet_loss), (p_cnn, x_cnn)),
        "scan_grad": (jax.value_and_grad(models.scan_stack_loss), (p_stk, x_stk)),
        "mixed_grad": (jax.value_and_grad(_mixed_loss), (p_mix, x_mix)),
        "mixed_grad_bf16": (jax.value_and_grad(_mixed_loss), bf16),
    }


CASES = _cases()


# (case, mesh, examples): a random plan of a transformer block compiles slowly (every edge may
# change layout), so it gets fewer examples.
RUNS = [("mlp_grad", "2x4", 4), ("mlp_grad", "2x2x2", 3), ("convnet_grad", "2x4", 3),
        ("convnet_grad", "8", 2), ("scan_grad", "2x4", 3), ("scan_grad", "2x2x2", 2),
        ("block_grad", "2x4", 2), ("block_grad", "8", 1), ("mixed_grad", "2x2x2", 1),
        ("mixed_grad_bf16", "2x4", 2)]


def _tolerances(want) -> dict:
    """float32: a few ulps of reassociated sums.  bfloat16 (8 bits of mantissa): a split sum
    rounds its partial sums to bfloat16 before adding them, so allow several bfloat16 ulps of
    the largest value in the result, relative and absolute."""
    if any(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(want)):
        eps = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7
        return {"rtol": 4 * eps, "atol": 4 * eps * max(
            float(jnp.max(jnp.abs(leaf.astype(jnp.float32)))) for leaf in jax.tree.leaves(want))}
    return {"rtol": 2e-4, "atol": 2e-5}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "mesh_name", "examples"), RUNS)
def test_random_plans_match_single_device(case, mesh_name, examples):
    fn, args = CASES[case]
    shape, names = MESHES[mesh_name]
    mesh = jaxpar.make_mesh(shape, names)
    want = jax.jit(fn)(*args)

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(seed=st.integers(0, 2**31 - 1))
    def check(seed):
        got, _ = run_random_plan(fn, args, mesh, seed)
        assert_tree_close(jax.tree.map(lambda a: a.astype(jnp.float32), got),
                          jax.tree.map(lambda a: a.astype(jnp.float32), want),
                          **_tolerances(want))

    check()


def _primitive_zoo(x, w, idx, table, key):
    """Many primitives in one function; x: [8, 12], w: [12, 16], idx: [8], table: [32, 12]."""
    h = x @ w                                            # dot_general
    h = h.reshape(8, 4, 4).transpose(0, 2, 1).reshape(8, 16)   # reshape split/merge, transpose
    emb = table[idx]                                     # gather (vocabulary lookup)
    s = jnp.concatenate([h[:, :8], emb[:, :8]], axis=1)  # slice, concatenate
    s = s + jnp.cumsum(s, axis=0) * 0.1                  # cumsum
    s = jnp.pad(s, ((0, 0), (1, 1)))[:, 1:-1]            # pad
    top = jax.lax.top_k(s, 3)[0]                         # top_k
    r = jax.random.normal(key, (8, 16))                  # RNG
    upd = table.at[idx].add(emb * 0.5)                   # scatter-add
    iot = jnp.arange(16, dtype=jnp.float32)[None, :]     # iota, broadcast
    dyn = jax.lax.dynamic_slice(s, (2, 0), (4, 16))      # dynamic_slice
    s = jax.lax.dynamic_update_slice(s, dyn * 2, (0, 0)) # dynamic_update_slice
    m = jnp.argmax(s, axis=1)                            # argmax
    srt = jnp.sort(s, axis=1)                            # sort
    red = jnp.max(s, axis=0) + jnp.min(s, axis=1).sum()  # reductions
    sel = jnp.where(s > 0, s, iot * 0.01)                # select_n
    f16 = sel.astype(jnp.bfloat16).astype(jnp.float32)   # convert_element_type
    return (f16.sum() + top.sum() + r.sum() + upd.sum() + m.sum() + srt[:, -1].sum()
            + red.sum(), sel)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["2x4", "8"])
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1))
def test_random_plans_over_many_primitives(mesh_name, seed):
    k = jax.random.split(jax.random.key(1), 4)
    args = (jax.random.normal(k[0], (8, 12)), jax.random.normal(k[1], (12, 16)),
            jax.random.randint(k[2], (8,), 0, 32), jax.random.normal(k[3], (32, 12)),
            jax.random.key(7))
    shape, names = MESHES[mesh_name]
    mesh = jaxpar.make_mesh(shape, names)
    got, _ = run_random_plan(_primitive_zoo, args, mesh, seed)
    assert_tree_close(got, jax.jit(_primitive_zoo)(*args), rtol=2e-4, atol=2e-4)
