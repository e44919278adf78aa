"""Errors are for people: they name the argument or operator, the shape, the mesh and the fix."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.errors import _warned


@pytest.fixture(scope="module")
def mesh():
    return jaxpar.make_mesh((2, 4), ("dp", "mp"))


def _f(x, w):
    return x @ w


X, W = jnp.ones((6, 16)), jnp.ones((16, 8))


@pytest.mark.parametrize(
    ("in_strategy", "expected"),
    [
        (((4, 1), None), ["argument 'x'", "f32[6,16]", "(dp=2, mp=4)", "not divisible by 4",
                          "such as 2"]),
        (((1, 16), None), ["asks for 16 slices", "only 8 devices"]),
        (((2, 1, 1), None), ["3 entries", "rank 2", "(1, 1)"]),
        ((P("tp"), None), ["mesh axis 'tp'", "('dp', 'mp')"]),
        ((P("dp", "dp"), None), ["uses mesh axis 'dp' twice"]),
        (((2, 2), None), ["cannot be laid onto the mesh", "PartitionSpec"]),
        ((jaxpar.Layout((4, 2), ("a", "b"))("a", "None"), None), ["does not match the mesh"]),
        (("oops", None), ["is not a strategy", "PartitionSpec"]),
        (((2, 1),), ["in_strategy has 1 entries", "2 arguments"]),
    ],
)
def test_invalid_strategies_raise_clear_errors(mesh, in_strategy, expected):
    f = jaxpar.parallelize(_f, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=in_strategy)
    with pytest.raises(jaxpar.JaxparError) as e:
        f(X, W)
    assert isinstance(e.value, ValueError)
    for part in expected:
        assert part in str(e.value), str(e.value)


def test_propagation_without_any_pin_says_what_to_fix(mesh):
    f = jaxpar.parallelize(_f, mesh=mesh, parallel_mode="semi_auto_parallel")
    with pytest.raises(jaxpar.PlanError, match="needs at least one fixed strategy"):
        f(X, W)


def test_out_strategy_errors_name_the_output(mesh):
    f = jaxpar.parallelize(_f, mesh=mesh, parallel_mode="semi_auto_parallel",
                           out_strategy=(4, 1))
    with pytest.raises(jaxpar.StrategyError, match="out_strategy for out.*not divisible by 4"):
        f(X, W)


def test_constraint_on_another_mesh_names_the_source_line(mesh):
    other = jaxpar.make_mesh((8,), ("x",))

    def g(x, w):
        return jax.lax.with_sharding_constraint(x @ w, NamedSharding(other, P("x")))

    f = jaxpar.parallelize(g, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((2, 1), None))
    with pytest.raises(jaxpar.StrategyError, match=r"test_errors.py:\d+ \(g\).*\(x=8\)"):
        f(jnp.ones((8, 16)), W)


def test_unsupported_primitive_is_replicated_with_one_warning(mesh):
    prim = jax.extend.core.Primitive("jaxpar_test_unknown")
    prim.def_impl(lambda x: x * 2)
    prim.def_abstract_eval(lambda x: x)
    jax.interpreters.mlir.register_lowering(
        prim, jax.interpreters.mlir.lower_fun(lambda x: x * 2, multiple_results=False))

    def g(x, w):
        return prim.bind(x @ w) + 1

    _warned.discard("unsupported:jaxpar_test_unknown")
    f = jaxpar.parallelize(g, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((2, 1), (1, 4)))
    with pytest.warns(jaxpar.JaxparWarning, match="no sharding rule for primitive "
                                                  "'jaxpar_test_unknown'"):
        out = f(jnp.ones((8, 16)), W)
    assert jnp.allclose(out, 2 * (jnp.ones((8, 16)) @ W) + 1)
    (d,) = [d for d in f.plan(jnp.ones((8, 16)), W).ops() if d.name == "jaxpar_test_unknown"]
    assert d.out_specs[0].is_replicated
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpar.parallelize(g, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((2, 1), (1, 4))).plan(jnp.ones((8, 16)), W)  # once only


def test_mesh_errors(mesh):
    with pytest.raises(jaxpar.MeshError, match="needs 16 devices but only 8"):
        jaxpar.make_mesh((4, 4), ("a", "b"))
    explicit = jax.make_mesh((2, 4), ("dp", "mp"),
                             axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    with pytest.raises(jaxpar.MeshError, match="AxisType.Auto"):
        jaxpar.parallelize(_f, mesh=explicit)
