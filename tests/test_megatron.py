"""Semi-automatic Megatron MLP and sharding propagation: layouts, collectives, numerics."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests import models
from tests.util import assert_tree_close


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((2, 4), ("dp", "mp"))


def test_semi_auto_megatron_mlp_has_one_all_reduce_over_mp(mesh):
    params, x = models.init_mlp(jax.random.key(0))
    step = jaxpar.parallelize(models.mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1)))
    colls = jaxpar.inspect.collectives(step.lower(params, x))
    assert colls.count() == 1
    (ar,) = colls
    assert ar.kind == "all-reduce" and ar.axes == ("mp",) and ar.group_size == 4
    # the reduced tensor is the per-device output block: batch 16 / dp 2, features 16
    assert ar.shapes == ("f32[8,16]",)
    plan = step.plan(params, x)
    assert plan.input_layouts() == {"params.w1": P(None, "mp"), "params.w2": P("mp"),
                                    "x": P("dp")}
    assert plan.output_layouts() == {"out": P("dp")}
    assert_tree_close(step(params, x), models.mlp(params, x))


def test_propagation_from_one_annotated_matmul_row_splits_the_second_weight(mesh):
    params, x = models.init_mlp(jax.random.key(1))

    def two_layer(params, x):
        first = jaxpar.shard(lambda x, w: x @ w, in_strategy=((2, 1), (1, 4)))
        return jax.nn.relu(first(x, params["w1"])) @ params["w2"]

    step = jaxpar.parallelize(two_layer, mesh=mesh, parallel_mode="semi_auto_parallel")
    plan = step.plan(params, x)
    assert plan.input_layouts()["params.w2"] == P("mp")
    assert plan.input_layouts()["params.w1"] == P(None, "mp")
    (second,) = [d for d in plan.ops("dot_general") if d.in_shapes[1] == (64, 16)]
    assert [str(s) for s in second.in_specs] == ["[dp, mp]", "[mp, -]"]
    assert second.origin == "propagated"
    colls = jaxpar.inspect.collectives(step.lower(params, x))
    assert [(c.kind, c.axes) for c in colls] == [("all-reduce", ("mp",))]
    assert_tree_close(step(params, x), models.mlp(params, x))


def test_megatron_train_step_gradients_match_single_device(mesh):
    params, x = models.init_mlp(jax.random.key(2))
    grad_fn = jax.value_and_grad(models.mlp_loss)
    step = jaxpar.parallelize(grad_fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1)))
    assert_tree_close(step(params, x), grad_fn(params, x))
    colls = jaxpar.inspect.collectives(step.lower(params, x))
    # forward: one all-reduce over mp; backward: the weight gradients summed over dp
    assert {c.axes for c in colls.of("all-reduce")} == {("mp",), ("dp",)}
    assert colls.count("all-gather") == 0
    grads = step(params, x)[1]
    assert grads["w1"].sharding.spec == P(None, "mp")
    assert grads["w2"].sharding.spec == P("mp")


def test_context_mode_and_mesh_apply_when_arguments_are_omitted(mesh):
    params, x = models.init_mlp(jax.random.key(3))
    step = jaxpar.parallelize(models.mlp, in_strategy=({"w1": (1, 4), "w2": (4, 1)}, (2, 1)))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh):
        colls = jaxpar.inspect.collectives(step.lower(params, x))
    assert colls.count("all-reduce") == 1
    # outside the block the context is stand_alone again: one device, no collectives
    assert jaxpar.inspect.collectives(step.lower(params, x)).count() == 0
    assert_tree_close(step(params, x), models.mlp(params, x))
