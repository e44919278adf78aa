"""jaxpar.shard: standalone, as a decorator, nested inside parallelize, and its errors."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests.util import assert_tree_close, shard_shape


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((2, 4), ("dp", "mp"))


def _dense(x, w):
    return jnp.tanh(x @ w)


X = jax.random.normal(jax.random.key(0), (16, 32))
W = jax.random.normal(jax.random.key(1), (32, 64))


@pytest.mark.parametrize(
    ("in_strategy", "out_strategy", "x_block", "w_block", "out_block"),
    [
        # MindSpore slice counts on mesh (dp=2, mp=4)
        (((2, 1), (1, 4)), None, (8, 32), (32, 16), (8, 16)),
        (((8, 1), (1, 1)), None, (2, 32), (32, 64), (2, 64)),
        (((2, 4), (4, 1)), ((2, 1),), (8, 8), (8, 64), (8, 64)),
        # PartitionSpecs
        ((P("dp", None), P(None, "mp")), None, (8, 32), (32, 16), (8, 16)),
        ((P(("dp", "mp")), P()), P(("dp", "mp")), (2, 32), (32, 64), (2, 64)),
        ((P("dp", "mp"), P("mp")), P(None, "mp"), (8, 8), (8, 64), (16, 16)),
    ],
)
def test_shard_gives_requested_per_device_shapes(mesh, in_strategy, out_strategy, x_block,
                                                 w_block, out_block):
    f = jaxpar.shard(_dense, in_strategy=in_strategy, out_strategy=out_strategy, mesh=mesh)
    compiled = f.lower(X, W).compile()
    x_s, w_s = compiled.input_shardings[0]
    assert x_s.shard_shape(X.shape) == x_block
    assert w_s.shard_shape(W.shape) == w_block
    assert compiled.output_shardings.shard_shape((16, 64)) == out_block
    y = f(X, W)
    assert shard_shape(y) == out_block
    assert_tree_close(y, _dense(X, W), rtol=1e-5, atol=1e-5)


def test_shard_as_decorator_builds_its_mesh_from_slice_counts():
    @jaxpar.shard(in_strategy=((2, 1), (1, 4)))
    def dense(x, w):
        return x @ w

    y = dense(X, W)
    mesh = y.sharding.mesh
    assert dict(mesh.shape) == {"a0": 2, "a1": 4}
    assert shard_shape(y) == (8, 16)
    # MindSpore's device placement for ((2, 1), (1, 4)): devices 0-3 hold the first rows
    x_sharding = dense.lower(X, W).compile().input_shardings[0][0]
    rows = {d.id: idx[0] for d, idx in x_sharding.devices_indices_map(X.shape).items()}
    assert {rows[i].start for i in range(4)} == {0} and {rows[i].start for i in range(4, 8)} == {8}
    assert_tree_close(y, X @ W, rtol=1e-5, atol=1e-5)


def test_nested_shard_pins_only_its_sub_computation(mesh):
    def model(x, w1, w2):
        h = jaxpar.shard(_dense, in_strategy=(P("dp", None), P(None, "mp")),
                         out_strategy=P("dp", "mp"))(x, w1)
        return h @ w2

    w2 = jax.random.normal(jax.random.key(2), (64, 8))
    step = jaxpar.parallelize(model, mesh=mesh, parallel_mode="semi_auto_parallel")
    plan = step.plan(X, W, w2)
    pins = [d for d in plan.decisions if d.origin == "shard"]
    assert len(pins) == 3  # two inputs and one output of the sub-computation
    assert plan.input_layouts() == {"x": P("dp"), "w1": P(None, "mp"), "w2": P("mp")}
    assert_tree_close(step(X, W, w2), _dense(X, W) @ w2, rtol=1e-5, atol=1e-5)


def test_nested_shard_parameter_plan_by_argument_name(mesh):
    def model(x, w):
        return jaxpar.shard(_dense, in_strategy=((2, 1), None),
                            parameter_plan={"w": (1, 4)})(x, w)

    step = jaxpar.parallelize(model, mesh=mesh, parallel_mode="semi_auto_parallel")
    assert step.plan(X, W).input_layouts() == {"x": P("dp"), "w": P(None, "mp")}


def test_shard_errors_name_the_function_argument_and_fix(mesh):
    f = jaxpar.shard(_dense, in_strategy=((3, 1), (1, 4)), mesh=mesh)
    with pytest.raises(jaxpar.StrategyError) as e:
        f(X, W)
    msg = str(e.value)
    assert "_dense" in msg and "'x'" in msg and "f32[16,32]" in msg and "(dp=2, mp=4)" in msg
    assert "not divisible by 3" in msg
    with pytest.raises(jaxpar.StrategyError, match="parameter_plan key 'v' names no parameter"):
        jaxpar.shard(_dense, parameter_plan={"v": (1, 4)}, mesh=mesh)(X, W)
