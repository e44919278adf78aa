"""MindSpore's own examples, run as written: device matrix, meshes from nested strategies,
operator-level shard, defaults.

Expected device matrices, tensor maps and device groups are MindSpore's, from
mindspore-ai/mindspore (file and test named at each case).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.device_matrix import coordinates, group_list, groups_along
from jaxpar._src.operator_shard import device_matrix, operator_specs, single_operator
from jaxpar._src.spec import MeshShape, Spec
from tests.util import assert_tree_close

RNG = np.random.RandomState(0)
X = jnp.asarray(RNG.randn(16, 64), jnp.float32)
W = jnp.asarray(RNG.randn(64, 32), jnp.float32)


def matmul(a, b):
    return a @ b


@pytest.fixture(autouse=True)
def _fresh_context():
    jaxpar.reset_auto_parallel_context()
    yield
    jaxpar.reset_auto_parallel_context()


def _all_reduce_groups(compiled):
    return sorted(c.replica_groups for c in jaxpar.inspect.collectives(compiled)
                  if c.kind == "all-reduce")


# -- the device matrix itself ----------------------------------------------------------------
@pytest.mark.parametrize(("shape", "rank", "expect"), [
    # tests/ut/cpp/parallel/device_matrix_test.cc: Test2Dgroup_list, Test3Dgroup_list,
    # Test4DGetAlongDim, Test5DGetAlongDim
    ((2, 3), 0, [(0, 3), (0, 1, 2)]),
    ((2, 2, 3), 5, [(5, 11), (2, 5), (3, 4, 5)]),
    ((2, 1, 4, 2), 5, [(5, 13), (5,), (1, 3, 5, 7), (4, 5)]),
    ((3, 4, 2, 3, 2), 5, [(5, 53, 101), (5, 17, 29, 41), (5, 11), (1, 3, 5), (4, 5)]),
])
def test_device_groups_are_mindspores(shape, rank, expect):
    assert group_list(shape, rank) == expect


@pytest.mark.parametrize(("lhs", "rhs", "dims", "strategy", "expect"), [
    # tests/ut/cpp/parallel/ops_info/matmul_info_test.cc: InferDevMatrixShape1, 2 (batch
    # matmul), 3, 4 (transpose_b: b is [j, k])
    ((2, 4, 8, 16), (2, 4, 16, 32), None, ((2, 4, 8, 16), (2, 4, 16, 1)), (2, 4, 8, 16, 1)),
    ((2, 4, 8, 16), (2, 4, 16, 32), None, ((2, 4, 8, 8), (2, 4, 8, 2)), (2, 4, 8, 8, 2)),
    ((2, 4, 8, 16), (32, 16), (((3,), (1,)), ((), ())), ((2, 4, 8, 16), (1, 16)),
     (2, 4, 8, 16, 1)),
    ((2, 4, 8, 16), (32, 16), (((3,), (1,)), ((), ())), ((2, 4, 8, 8), (2, 8)),
     (2, 4, 8, 8, 2)),
])
def test_operator_device_matrix_is_mindspores(lhs, rhs, dims, strategy, expect):
    fn = jnp.matmul if dims is None else (lambda a, b: lax.dot_general(a, b, dims))
    op = single_operator(fn, (jax.ShapeDtypeStruct(lhs, jnp.float32),
                              jax.ShapeDtypeStruct(rhs, jnp.float32)))
    assert op is not None and op.name == "dot_general"
    assert device_matrix(op, strategy, where="t")[1] == expect


def test_operator_tensor_maps_are_mindspores():
    # matmul_info_test.cc, InferTensorMap1: device matrix [2, 4, 8, 16, 1], A's tensor map
    # [4, 3, 2, 1] and B's [4, 3, 1, 0] (counted from the right; axis 0 is the 1)
    op = single_operator(jnp.matmul, (jax.ShapeDtypeStruct((2, 4, 8, 16), jnp.float32),
                                      jax.ShapeDtypeStruct((2, 4, 16, 32), jnp.float32)))
    mesh = MeshShape(("d4", "d3", "d2", "d1"), (2, 4, 8, 16))  # the matrix, 1 dropped
    a, b = operator_specs(op, ((2, 4, 8, 16), (2, 4, 16, 1)), mesh, where="t")
    assert a == Spec((("d4",), ("d3",), ("d2",), ("d1",)))
    assert b == Spec((("d4",), ("d3",), ("d1",), ()))
    with pytest.raises(jaxpar.StrategyError, match="cut one shared dimension differently"):
        device_matrix(op, ((2, 4, 8, 16), (2, 4, 8, 1)), where="t")  # k: 16 vs 8


# -- item 2: placement follows the device matrix ---------------------------------------------
def test_shard_places_slices_on_mindspores_devices():
    # MindSpore MatMul ((2, 4), (4, 1)) on 8 devices: device matrix [2, 4, 1]
    # (matmul_info.cc); rank r holds x block coordinates(r) and reduces over its row of 4
    f = jaxpar.shard(matmul, in_strategy=((2, 4), (4, 1)))
    y = f(X, W)
    assert dict(y.sharding.mesh.shape) == {"a0": 2, "a1": 4}
    compiled = f.lower(X, W).compile()
    x_map = compiled.input_shardings[0][0].devices_indices_map(X.shape)
    w_map = compiled.input_shardings[0][1].devices_indices_map(W.shape)
    for device, (rows, cols) in x_map.items():
        i, k = coordinates(device.id, (2, 4))
        assert (rows.start or 0, cols.start or 0) == (8 * i, 16 * k)
        assert (w_map[device][0].start or 0) == 16 * k  # w cut by k only, copies over i
    one = {d.id: idx for d, idx in x_map.items()}[1]
    assert (one[0], one[1]) == (slice(0, 8), slice(16, 32))  # the device 1
    assert _all_reduce_groups(compiled) == [groups_along((2, 4), 1)]  # {0-3}, {4-7}
    assert_tree_close(y, X @ W, rtol=1e-4, atol=1e-4)


# -- item 1: the article's example, no mesh written ------------------------------------------
class _Dense:
    """MindSpore's nn.Dense: a MatMul primitive one may shard (``dense.matmul.shard(...)``)."""

    def __init__(self):
        self.matmul = matmul

    def __call__(self, x, w):
        return jnp.tanh(self.matmul(x, w))


def test_article_semi_auto_example_builds_its_mesh_from_the_nested_shard():
    # seeds: "MindSpore开发之路（二十）", section 5: semi_auto_parallel, device_num=8,
    # net.dense_layer.matmul.shard(((2, 4), (4, 1)))
    jaxpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    dense_layer = _Dense()
    dense_layer.matmul = jaxpar.shard(dense_layer.matmul, in_strategy=((2, 4), (4, 1)))
    net = jaxpar.parallelize(lambda x, w: dense_layer(x, w))
    assert_tree_close(net(X, W), jnp.tanh(X @ W), rtol=1e-4, atol=1e-4)
    plan = net.plan(X, W)
    assert plan.mesh == MeshShape(("a0", "a1"), (2, 4))
    dots = [d for d in plan.decisions if d.name == "dot_general"]
    assert [d.origin for d in dots] == ["shard"]
    assert _all_reduce_groups(net.lower(X, W).compile()) == [groups_along((2, 4), 1)]


def test_strategies_that_cannot_share_a_mesh_are_named():
    a = jaxpar.Layout((2, 4), ("dp", "mp"))
    b = jaxpar.Layout((4, 2), ("dp", "mp"))

    def net(x, w):
        h = jaxpar.shard(matmul, in_strategy=(a("dp", "mp"), a("mp", "None")))(x, w)
        return jaxpar.shard(jnp.tanh, in_strategy=(b("dp", "mp"),))(h)

    with pytest.raises(jaxpar.MeshError) as e:
        jaxpar.parallelize(net, parallel_mode="semi_auto_parallel")(X, W)
    msg = str(e.value)
    assert "jaxpar.shard(matmul)" in msg and "jaxpar.shard(tanh)" in msg
    assert "(dp=2, mp=4)" in msg and "(dp=4, mp=2)" in msg
    # a nested shard's own mesh= is the program's mesh (its PartitionSpecs need it)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(
        lambda x, w: jaxpar.shard(matmul, in_strategy=(P("dp", "mp"), P("mp")), mesh=mesh)(x, w),
        parallel_mode="semi_auto_parallel")
    assert f.plan(X, W).mesh == MeshShape(("dp", "mp"), (2, 4))
    # on 6 devices, MatMul device matrices [2, 3, 1] and [3, 2, 1] cut the ranks into blocks
    # of 3 and of 2: no one mesh holds both where MindSpore puts them
    jaxpar.set_auto_parallel_context(device_num=6)
    x, w = jnp.ones((12, 12)), jnp.ones((12, 12))
    m1 = jaxpar.shard(matmul, in_strategy=((2, 3), (3, 1)))
    m2 = jaxpar.shard(matmul, in_strategy=((3, 2), (2, 1)))
    with pytest.raises(jaxpar.MeshError, match=r"\(3, 2, 1\) and .*\(2, 3, 1\) cannot share"):
        jaxpar.parallelize(lambda x, w: m2(m1(x, w), w), parallel_mode="semi_auto_parallel")(x, w)
    jaxpar.set_auto_parallel_context(device_num=8)
    m3 = jaxpar.shard(matmul, in_strategy=((3, 1), (1, 1)))
    with pytest.raises(jaxpar.MeshError, match=r"\(3, 1, 1\) asks for 3 slices.*8 devices"):
        m3(x, w)


# -- item 4: operator-level shard keeps the operator's strategy ------------------------------
@pytest.mark.parametrize("mesh_shape", [None, ((2, 4), ("dp", "mp"))])
def test_two_matmul_runs_each_matmul_on_its_strategy(mesh_shape):
    # tests/ut/python/parallel/test_two_matmul.py, test_two_matmul: m2(m1(x, y), b) with
    # m1 = ((4, 2), (2, 1)), m2 = ((2, 4), (4, 1)) on 8 devices
    x = jnp.asarray(RNG.randn(128, 32), jnp.float32)
    y = jnp.asarray(RNG.randn(32, 64), jnp.float32)
    b = jnp.asarray(RNG.randn(64, 64), jnp.float32)
    m1 = jaxpar.shard(matmul, in_strategy=((4, 2), (2, 1)))
    m2 = jaxpar.shard(matmul, in_strategy=((2, 4), (4, 1)))
    mesh = jaxpar.make_mesh(*mesh_shape) if mesh_shape else None
    net = jaxpar.parallelize(lambda x, y, b: m2(m1(x, y), b), mesh=mesh,
                             parallel_mode="semi_auto_parallel")
    assert_tree_close(net(x, y, b), (x @ y) @ b, rtol=1e-3, atol=1e-3)
    plan = net.plan(x, y, b)
    dots = [d for d in plan.decisions if d.name == "dot_general"]
    assert [d.origin for d in dots] == ["shard", "shard"]
    counts = [[s.split_counts(plan.mesh) for s in d.in_specs] for d in dots]
    assert counts == [[(4, 2), (2, 1)], [(2, 4), (4, 1)]]  # each runs its own strategy
    groups = _all_reduce_groups(net.lower(x, y, b).compile())
    if mesh is None:
        # MindSpore's groups: m1 sums over k of its matrix [4, 2, 1], m2 over k of [2, 4, 1]
        assert groups == sorted([groups_along((4, 2), 1), groups_along((2, 4), 1)])
    else:  # on (dp=2, mp=4): m1 sums over dp, m2 over mp; never over all 8 devices
        assert groups == sorted([groups_along((2, 4), 0), groups_along((2, 4), 1)])
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(net(*a))), argnums=(0, 1, 2)))
    want = jax.grad(lambda x, y, b: jnp.sum(jnp.sin((x @ y) @ b)), argnums=(0, 1, 2))
    assert_tree_close(grads(x, y, b), want(x, y, b), rtol=1e-3, atol=1e-3)


# -- item 3: no stale trace ------------------------------------------------------------------
def test_nested_shard_in_a_cached_trace_follows_each_mesh():
    inner = jax.jit(lambda x, w: jaxpar.shard(matmul, in_strategy=((2, 1), (1, 4)))(x, w))

    def net(x, w):
        return inner(x, w) * 2.0

    want = X @ W * 2.0
    assert_tree_close(jax.jit(net)(X, W), want, rtol=1e-4, atol=1e-4)  # plain jit first
    for shape, names in [((2, 4), ("dp", "mp")), ((2, 4), ("a", "b")), ((4, 2), ("dp", "mp"))]:
        mesh = jaxpar.make_mesh(shape, names)
        f = jaxpar.parallelize(net, mesh=mesh, parallel_mode="semi_auto_parallel")
        assert_tree_close(f(X, W), want, rtol=1e-4, atol=1e-4)
        layouts = f.plan(X, W).input_layouts()
        x_axes = Spec.from_partition_spec(layouts["x"], 2).split_counts(MeshShape.of(mesh))
        assert x_axes == (2, 1)


# -- item 5: a module's parameter_plan outside parallelize -----------------------------------
class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.relu(self.fc1(x)))


def test_module_parameter_plan_on_concrete_arrays():
    mlp = _MLP(nnx.Rngs(0))
    x = jnp.asarray(RNG.randn(8, 16), jnp.float32)
    want = mlp(x)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.shard(mlp, in_strategy=((2, 1),), mesh=mesh,
                     parameter_plan={"fc1.kernel": (1, 4), "fc2.kernel": (4, 1)})
    y = f(x)
    assert_tree_close(y, want, rtol=1e-5, atol=1e-5)
    assert y.sharding.spec == P("dp")
    # the module now holds its parameters in the planned layouts (Cell.shard's parameter_plan)
    assert mlp.fc1.kernel[...].sharding.spec == P(None, "mp")
    assert mlp.fc2.kernel[...].sharding.spec == P("mp")
    assert_tree_close(f(x), want, rtol=1e-5, atol=1e-5)


# -- item 6: semi-automatic with no strategy is data parallel --------------------------------
def test_semi_auto_without_any_strategy_splits_the_batch():
    jaxpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8)
    mlp = _MLP(nnx.Rngs(1))
    model = jaxpar.Model(mlp, loss_fn=lambda o, y: jnp.mean((o - y) ** 2),
                         optimizer=optax.sgd(0.1))
    x = RNG.randn(32, 16).astype(np.float32)
    y = RNG.randn(32, 8).astype(np.float32)
    model.train(3, [(x, y)], dataset_sink_mode=True)
    assert model.history[-1] < model.history[0]
    compiled = model.lower(x, y).compile()
    batch_sharding = compiled.input_shardings[0][1]
    assert batch_sharding.shard_shape(x.shape) == (4, 16)  # rows over all 8 devices
    colls = jaxpar.inspect.collectives(compiled)
    assert {c.kind for c in colls} == {"all-reduce"}
    assert all(c.group_size == 8 for c in colls)  # the gradients, data parallel
    with pytest.raises(jaxpar.PlanError, match="needs at least one fixed strategy.*batch_argnums"):
        jaxpar.parallelize(lambda a, b: a @ b)(X, W)


# -- item 7: dataset_strategy Layouts, dataset_sink_mode -------------------------------------
def test_dataset_strategy_takes_layouts():
    layout = jaxpar.Layout((2, 4), ("dp", "mp"))
    jaxpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                     dataset_strategy=(layout("dp", "mp"), layout("dp", "None")))
    x = RNG.randn(16, 8).astype(np.float32)
    y = RNG.randn(16, 4).astype(np.float32)
    gx, gy = jaxpar.dataset.to_global((x, y))
    assert gx.sharding.spec == P("dp", "mp") and gy.sharding.spec == P("dp")
    assert dict(gx.sharding.mesh.shape) == {"dp": 2, "mp": 4}
    params = {"w": jnp.asarray(RNG.randn(8, 4), jnp.float32)}
    model = jaxpar.Model((params, lambda p, a: a @ p["w"]),
                         loss_fn=lambda o, t: jnp.mean((o - t) ** 2), optimizer=optax.sgd(0.1))
    model.train(2, [(x, y)] * 3, dataset_sink_mode=True, sink_size=2)
    assert len(model.history) == 4  # two epochs of sink_size steps
    compiled = model.lower(gx, gy).compile()
    assert compiled.input_shardings[0][1].spec == P("dp", "mp")
    with pytest.raises(jaxpar.ContextError, match="sink_size"):
        model.train(1, [(x, y)], dataset_sink_mode=True, sink_size=0)
