"""The plan cache keys on what jax.jit keys on: weak types, static values by type, config."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar


def _scale(x, s):
    return x * s


@pytest.mark.parametrize("order", [(1.001, "f32"), ("f32", 1.001)])
@pytest.mark.parametrize("mode", ["stand_alone", "semi_auto_parallel"])
def test_python_scalar_and_float32_scalar_are_different_programs(order, mode):
    mesh = jaxpar.make_mesh((8,), ("d",))
    pf = jaxpar.parallelize(_scale, mesh=mesh, parallel_mode=mode, in_strategy=((8,), None))
    x = jnp.ones((8,), jnp.bfloat16)
    for s in order:
        s = jnp.float32(1.001) if s == "f32" else s
        got, want = pf(x, s), jax.jit(_scale)(x, s)
        assert got.dtype == want.dtype  # weak 1.001 keeps bfloat16; a float32 scalar promotes
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _full(n):
    return jnp.full((2,), n[0] if isinstance(n, tuple) else n)


def test_static_arguments_are_keyed_by_type_and_value():
    pg = jaxpar.parallelize(_full, parallel_mode="stand_alone", static_argnums=0)
    for n in (1, 1.0, True, (1,), (1.0,)):
        # eager evaluation is the answer: jax.jit's trace cache takes (1.0,) for the equal,
        # equally hashed (1,) met before and returns int32
        assert pg(n).dtype == _full(n).dtype
    assert [pg(n).dtype for n in (1, 1.0, True)] == [jnp.int32, jnp.float32, jnp.bool_]


def test_unhashable_static_argument_is_a_jaxpar_error():
    pg = jaxpar.parallelize(lambda n: jnp.zeros(len(n)), static_argnums=0)
    with pytest.raises(jaxpar.JaxparError, match=r"static argument 0 \('n'\) is a list.*tuple"):
        pg([1, 2])
    assert pg((1, 2)).shape == (2,)


def test_non_array_argument_names_static_argnums():
    pf = jaxpar.parallelize(lambda x, mode: x, parallel_mode="stand_alone")
    with pytest.raises(jaxpar.JaxparError, match="argument 1 .'mode'.*static_argnums"):
        pf(jnp.ones(2), "fast")


def test_x64_flag_is_part_of_the_key():
    pf = jaxpar.parallelize(lambda x: x + jnp.arange(2), parallel_mode="stand_alone")
    x = np.ones(2, np.int32)
    assert pf(x).dtype == jnp.int32
    with jax.enable_x64(True):
        assert pf(np.ones(2, np.int32)).dtype == jax.jit(lambda x: x + jnp.arange(2))(
            np.ones(2, np.int32)).dtype == jnp.int64
    assert pf(x).dtype == jnp.int32


def test_per_replica_keys_weak_types_too():
    @jaxpar.per_replica(batch_argnums=(0,))
    def scaled(x, s):
        return jnp.sum(x * s, keepdims=True)

    x = jnp.ones((8,), jnp.bfloat16)
    assert scaled(x, 1.001).dtype == jnp.bfloat16
    assert scaled(x, jnp.float32(1.001)).dtype == jnp.float32
    assert scaled(x, 1.001).dtype == jnp.bfloat16


def test_pytree_structure_is_part_of_the_key_and_dict_order_is_not():
    mesh = jaxpar.make_mesh((8,), ("d",))

    def f(tree):
        return jax.tree.map(lambda v: v * 2 if v is not None else v, tree)

    pf = jaxpar.parallelize(f, mesh=mesh, parallel_mode="semi_auto_parallel",
                            in_strategy=((8,),))
    a, b = jnp.arange(8.0), jnp.ones(8)
    one, other = pf({"a": a, "b": b}), pf({"b": b, "a": a})  # jit: one treedef, sorted keys
    assert pf.compiled_entry({"a": a, "b": b}) is pf.compiled_entry({"b": b, "a": a})
    assert one["a"].tolist() == other["a"].tolist() == (a * 2).tolist()
    with_none = pf({"a": a, "b": None})  # None is an empty subtree: another structure
    assert with_none["b"] is None and with_none["a"].tolist() == (a * 2).tolist()
    assert pf.compiled_entry({"a": a, "b": None}) is not pf.compiled_entry({"a": a, "b": b})


def test_input_layout_is_not_part_of_the_key_the_plan_places_inputs():
    mesh = jaxpar.make_mesh((8,), ("d",))
    pf = jaxpar.parallelize(lambda x: x + 1, mesh=mesh, parallel_mode="semi_auto_parallel",
                            in_strategy=((8,),))
    x = jnp.arange(8.0)
    elsewhere = jax.device_put(x, jax.devices()[3])  # committed to one device
    assert pf.compiled_entry(x) is pf.compiled_entry(elsewhere)
    out = pf(elsewhere)
    assert out.tolist() == (x + 1).tolist() and out.sharding.spec == jax.sharding.PartitionSpec("d")
