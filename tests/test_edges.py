"""The edges a new user hits first: every input error a JaxparError naming the fix, empty
arrays, bare PartitionSpecs in sharding constraints."""

import contextlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar


def _f(x, w):
    return x @ w


@pytest.mark.parametrize(("options", "message"), [
    ({"batch_argnums": 2}, r"batch_argnums=\(2,\) names argument 2.*takes 2 positional"),
    ({"donate_argnums": (0, 5)}, r"donate_argnums=\(0, 5\) names argument 5.*\(x, w\)"),
    ({"static_argnums": -3}, r"static_argnums=\(-3,\).*from 0 to 1 \(or -2 to -1\)"),
    ({"batch_argnums": "x"}, "must be an int or a sequence of ints"),
    ({"static_argnums": 1, "donate_argnums": 1}, r"\[1\] are in both static_argnums and donate"),
    ({"parallel_mode": "auto"}, "is not one of"),
    ({"search_mode": "fast"}, "is not one of"),
    ({"hardware": 42}, "HardwareProfile"),
    ({"parameter_plan": [("w", (1, 4))]}, "parameter_plan must be a dict"),
])
def test_parallelize_arguments_are_checked_when_given(options, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        jaxpar.parallelize(_f, **options)


def test_argnums_of_a_function_with_varargs_are_checked_at_the_call():
    def g(*xs):
        return xs[0]

    f = jaxpar.parallelize(g, parallel_mode="stand_alone", donate_argnums=3)
    with pytest.raises(jaxpar.JaxparError, match=r"donate_argnums=\(3,\).*called with 1"):
        f(jnp.ones(2))
    with pytest.raises(jaxpar.JaxparError, match="counts from the end"):
        jaxpar.parallelize(g, static_argnums=-1)


def test_negative_static_argnums_count_from_the_end():
    f = jaxpar.parallelize(lambda x, n: x * n, parallel_mode="stand_alone", static_argnums=-1)
    assert f(jnp.ones(2), 3).tolist() == [3.0, 3.0]


# -- with_sharding_constraint(x, P(...)) in the function pins, with or without a mesh context --
def _constrained(x, w):
    h = jax.lax.with_sharding_constraint(x @ w, P("dp", "mp"))
    return jnp.tanh(h)


@pytest.mark.parametrize("context", ["none", "set_mesh"])
def test_bare_partition_spec_constraint_is_a_pin(context):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(_constrained, mesh=mesh, parallel_mode="semi_auto_parallel")
    x, w = jnp.arange(128.0).reshape(8, 16) / 100, jnp.ones((16, 32)) / 16
    with jax.set_mesh(mesh) if context == "set_mesh" else contextlib.nullcontext():
        out = f(x, w)
        plan = f.plan(x, w)
    np.testing.assert_allclose(out, jnp.tanh(x @ w), rtol=1e-6)
    assert out.sharding.spec == P("dp", "mp")  # propagated from the only pin
    assert [d.origin for d in plan.decisions if d.name == "sharding_constraint"] == ["shard"]


def test_bare_partition_spec_constraint_in_stand_alone_and_pynative():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    with jaxpar.auto_parallel_context(mesh=mesh):
        assert jaxpar.parallelize(_constrained, parallel_mode="stand_alone")(x, w).shape == (8, 32)
    jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE)
    f = jaxpar.parallelize(_constrained, mesh=mesh, parallel_mode="semi_auto_parallel")
    np.testing.assert_allclose(f(x, w), jnp.tanh(x @ w), rtol=1e-6)


def test_constraint_on_axes_the_plan_mesh_lacks_is_a_jaxpar_error():
    mesh = jaxpar.make_mesh((8,), ("d",))
    f = jaxpar.parallelize(_constrained, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((8, 1), None))
    with pytest.raises(jaxpar.JaxparError, match="names a mesh axis.*bare PartitionSpec"):
        f(jnp.ones((8, 16)), jnp.ones((16, 32)))


# -- empty arrays: the plan of an empty batch is the plan, and the result jax.jit's -----------
def _loss(w, x):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


@pytest.mark.parametrize(("mode", "options"), [
    ("semi_auto_parallel", {"in_strategy": ((1, 4), (2, 1))}),
    ("data_parallel", {"batch_argnums": 1}),
    ("auto_parallel", {}),
])
@pytest.mark.parametrize("x_shape", [(0, 16), (8, 0)])
def test_empty_arrays_give_jits_result(mode, options, x_shape):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    step = jax.value_and_grad(_loss)
    f = jaxpar.parallelize(step, mesh=mesh, parallel_mode=mode, **options)
    w, x = jnp.ones((x_shape[1], 32)), jnp.ones(x_shape)
    (loss, grad), (want_loss, want_grad) = f(w, x), jax.jit(step)(w, x)
    assert loss == want_loss and grad.shape == want_grad.shape
    np.testing.assert_array_equal(grad, want_grad)


# -- HardwareProfile: numbers checked when made, axis names when the profile meets a mesh -----
@pytest.mark.parametrize(("fields", "message"), [
    ({"flops_per_s": -1.0}, "flops_per_s must be a positive number, got -1.0.*FLOP/s"),
    ({"flops_per_s": "fast"}, "flops_per_s must be a positive number, got 'fast'"),
    ({"memory_per_device": float("nan")}, "memory_per_device must be a positive number"),
    ({"inter_node_bandwidth": 0}, "inter_node_bandwidth must be a positive number.*bytes/s"),
    ({"axis_bandwidth": {"dp": 0.0}}, r"axis_bandwidth\['dp'\] must be a positive number"),
    ({"axis_bandwidth": {"dp": "fast"}}, r"axis_bandwidth\['dp'\] must be a positive"),
    ({"axis_latency": {"dp": -1e-6}}, r"axis_latency\['dp'\] must be a non-negative number"),
    ({"axis_latency": [1, 2]}, "axis_latency must be a dict from mesh axis names"),
    ({"intra_node_latency": float("nan")}, "intra_node_latency must be a non-negative"),
    ({"devices_per_node": 0}, "devices_per_node must be a positive int"),
    ({"devices_per_node": 2.5}, "devices_per_node must be a positive int"),
    ({"preset": ["h100"]}, "unknown preset"),
])
def test_hardware_profile_numbers_are_checked(fields, message):
    with pytest.raises(jaxpar.JaxparError, match=message):
        jaxpar.HardwareProfile(**fields)


def test_hardware_profile_axis_names_are_checked_against_the_mesh():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    hw = jaxpar.HardwareProfile(preset="h100", axis_bandwidth={"mpp": 1e9}, axis_latency={})
    f = jaxpar.parallelize(_f, mesh=mesh, parallel_mode="auto_parallel", hardware=hw)
    with pytest.raises(jaxpar.JaxparError, match="names mesh axis 'mpp'.*did you mean 'mp'"):
        f(jnp.ones((8, 16)), jnp.ones((16, 8)))
    assert jaxpar.HardwareProfile(axis_latency={"dp": 0.0}).axis_latency == (("dp", 0.0),)


@pytest.mark.parametrize(("options", "message"), [
    ({"enable_ps": "yes"}, "enable_ps='yes' must be True or False"),
    ({"checkpoint_dir": 123}, "checkpoint_dir=123 must be a directory path"),
    ({"checkpoint_every": True, "checkpoint_dir": "/tmp/x"}, "must be an int >= 0"),
])
def test_ps_context_options_are_checked(options, message):
    from jaxpar import ps

    with pytest.raises(jaxpar.JaxparError, match=message):
        ps.set_ps_context(**options)
    ps.set_ps_context(checkpoint_dir=Path("/tmp/ps"))
    assert ps.get_ps_context("checkpoint_dir") == "/tmp/ps"
    ps.reset_ps_context()


# -- plan files ----------------------------------------------------------------------------------
def test_plan_file_errors_name_the_file_and_the_fix(tmp_path):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    traced = []

    def g(x, w):
        traced.append(1)
        return _f(x, w)

    f = jaxpar.parallelize(g, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((2, 1), (1, 4)))
    x, w = jnp.ones((8, 16)), jnp.ones((16, 8))
    with jaxpar.auto_parallel_context(strategy_ckpt_save_file=str(tmp_path / "no" / "p.json")):
        with pytest.raises(jaxpar.PlanError, match="strategy_ckpt_save_file: cannot save.*'"
                           + str(tmp_path / "no") + "' does not exist"):
            f(x, w)
    assert not traced  # refused before tracing and planning
    path = tmp_path / "plan.json"
    with jaxpar.auto_parallel_context(strategy_ckpt_save_file=str(path)):
        f(x, w)
    with jaxpar.auto_parallel_context(strategy_ckpt_load_file=str(path)):
        with pytest.raises(jaxpar.PlanError, match=r"does not match this program: argument 'x' "
                           r"has shape \[16, 16\] here but \[8, 16\] in the file.*afresh"):
            f(jnp.ones((16, 16)), w)
    path.write_text(path.read_text()[:100])
    with jaxpar.auto_parallel_context(strategy_ckpt_load_file=str(path)):
        with pytest.raises(jaxpar.PlanError, match=f"plan file '{path}' is not a plan file: it "
                           "is not JSON"):
            f(x, w)


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "holds a JSON list"),
    ('{"format": "jaxpar.plan/2"}', "not a well-formed jaxpar.plan/2 plan .missing key 'mesh'"),
    ('{"format": "jaxpar.plan/2", "mesh": {"names": 3, "sizes": []}}', "TypeError"),
    ('{"format": "other"}', "not a plan file of format"),
])
def test_plan_from_json_of_another_structure(text, message):
    with pytest.raises(jaxpar.PlanError, match=message):
        jaxpar.ShardingPlan.from_json(text)


@pytest.mark.parametrize(("options", "message"), [
    ({"in_strategy": ((2.0, 1), None)}, r"in_strategy: slice counts are ints, but \(2.0, 1\) "
                                        r"has 2.0 \(a float\). Use \(2, 1\)."),
    ({"in_strategy": ((np.int64(2), 1), None)}, r"has np.int64\(2\) \(a int64\). Use \(2, 1\)"),
    ({"in_strategy": ((2, 1), None), "out_strategy": (True, 1)}, r"out_strategy: .*\(a bool\)\.$"),
    ({"parameter_plan": {"w": (1, 4.0)}}, r"parameter_plan\['w'\]: slice counts are ints"),
])
def test_float_slice_counts_say_slice_counts_are_ints(options, message):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(_f, mesh=mesh, parallel_mode="semi_auto_parallel", **options)
    with pytest.raises(jaxpar.StrategyError, match=message):
        f(jnp.ones((8, 16)), jnp.ones((16, 8)))


def test_model_train_on_data_without_a_label_column_says_so():
    import optax

    params = {"w": jnp.zeros((4, 2))}
    model = jaxpar.Model((params, lambda p, x: x @ p["w"]),
                         loss_fn=lambda out, y: jnp.mean((out - y) ** 2), optimizer=optax.sgd(0.1))
    data = jaxpar.dataset.NumpySlicesDataset(np.ones((8, 4), np.float32),
                                             column_names=["image"]).batch(4)
    with pytest.raises(jaxpar.DatasetError, match=r"Model.train: .*column \['image'\].*label"):
        model.train(1, data)
    with pytest.raises(jaxpar.DatasetError, match=r"Model.train: .*column \['image'\].*label"):
        model.train(1, data, dataset_sink_mode=True, sink_size=2)  # (said "1 column")
    with pytest.raises(jaxpar.DatasetError, match="Model.eval: .*1 column"):
        model.eval([(np.ones((4, 4), np.float32),)])


@pytest.mark.parametrize("mode", ["data_parallel", "semi_auto_parallel", "auto_parallel"])
def test_gradients_mean_false_is_refused_in_every_parallel_mode(mode):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(_f, mesh=mesh, parallel_mode=mode, batch_argnums=0,
                           in_strategy=None if mode == "data_parallel" else ((2, 1), None))
    with jaxpar.auto_parallel_context(gradients_mean=False):
        with pytest.raises(jaxpar.ContextError, match="gradients_mean=False.*Scale the loss"):
            f(jnp.ones((8, 16)), jnp.ones((16, 8)))
        stand_alone = jaxpar.parallelize(_f, parallel_mode="stand_alone")
        assert stand_alone(jnp.ones((8, 16)), jnp.ones((16, 8))).shape == (8, 8)


# -- parameter_plan names: what users write for NNX and Linen ----------------------------------
@pytest.fixture(scope="module")
def nnx_state():
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = nnx.Linear(16, 32, rngs=rngs)
            self.fc2 = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.fc2(jax.nn.relu(self.fc1(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    return graphdef, state


@pytest.mark.parametrize(("plan", "pinned"), [
    ({"*.kernel": (1, 4)}, {"fc1.kernel", "fc2.kernel"}),
    ({"fc1.kernel": (1, 4)}, {"fc1.kernel"}),
    ({"state.fc1.kernel.value": (1, 4)}, {"fc1.kernel"}),
    ({"*kernel.value": (1, 4)}, {"fc1.kernel", "fc2.kernel"}),
    ({"FC2.Kernel": (4, 1)}, {"fc2.kernel"}),  # case-insensitive when nothing matches exactly
])
def test_parameter_plan_accepts_nnx_names_with_and_without_value(nnx_state, plan, pinned):
    from flax import nnx

    graphdef, state = nnx_state

    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(apply, mesh=mesh, parallel_mode="semi_auto_parallel",
                           parameter_plan=plan)
    assert _pinned(f.plan(state, jnp.ones((8, 16)))) == {f"state.{n}.value" for n in pinned}


def _pinned(plan):
    """The argument leaves the user's strategies fixed."""
    return {plan.decisions[n].label for n in plan.inputs
            if plan.decisions[n].origin == "in_strategy"}


def test_parameter_plan_accepts_linen_names_and_lists_close_matches():
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(16)])
    variables = model.init(jax.random.key(0), jnp.ones((8, 16)))
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(model.apply, mesh=mesh, parallel_mode="semi_auto_parallel",
                           parameter_plan={"layers_0.kernel": (1, 4)})
    assert _pinned(f.plan(variables, jnp.ones((8, 16)))) == {"variables.params.layers_0.kernel"}
    f = jaxpar.parallelize(model.apply, mesh=mesh, parallel_mode="semi_auto_parallel",
                           parameter_plan={"layers_0.kernal": (1, 4)})
    with pytest.raises(jaxpar.StrategyError, match="names no parameter. Closest: "
                       "'layers_0.kernel'.*Parameters are: layers_0.bias"):
        f(variables, jnp.ones((8, 16)))


def test_a_metric_evaluated_before_any_batch_is_a_jaxpar_error():
    with pytest.raises(jaxpar.DatasetError, match="no batch was seen"):
        jaxpar.metrics.Accuracy().eval()


def test_per_replica_argnums_are_checked_as_parallelize_checks_them():
    with pytest.raises(jaxpar.JaxparError, match=r"per_replica\(_f\): batch_argnums=\(3,\)"):
        jaxpar.per_replica(_f, batch_argnums=3)
