"""``masked_gather``: the batched gather as a compare-select-sum (the pipeline loop's lowering of
``take_along_axis`` over a split vocabulary), against ``lax.gather`` in every mode, indices out
of bounds included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxpar._src.masked_gather import looked_up_dim, masked_gather, needs_masked_gather
from jaxpar._src.spec import Spec


def _gather_eqn(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    while True:  # through take_along_axis's jit
        eqn = jaxpr.eqns[-1]
        if eqn.primitive.name == "gather":
            return eqn
        jaxpr = eqn.params["jaxpr"].jaxpr


X = jnp.arange(2 * 3 * 5, dtype=jnp.float32).reshape(2, 3, 5) - 7.0
# in bounds, negative (take_along_axis wraps them before its gather), past the end
IDX = jnp.array([[0, 4, -1], [5, 2, -6]], jnp.int32)
MODES = ["clip", "fill", "promise_in_bounds"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [2, 1, 0])
def test_take_along_axis_gather_in_every_mode(mode, axis):
    x = jnp.moveaxis(X, 2, axis)
    idx = jnp.expand_dims(IDX, axis)

    def take(x, i):
        return jnp.take_along_axis(x, i, axis=axis, mode=mode)

    eqn = _gather_eqn(take, x, idx)
    operand, indices = eqn.invars
    assert looked_up_dim(eqn.params, operand.aval.ndim, indices.aval.ndim) == axis
    # the gather's own indices: what take_along_axis made of idx (negative ones wrapped)
    raw = jnp.expand_dims(jnp.where(idx < 0, idx + x.shape[axis], idx), -1)
    want = lax.gather(x, raw, eqn.params["dimension_numbers"], eqn.params["slice_sizes"],
                      mode=eqn.params["mode"], fill_value=eqn.params["fill_value"])
    got = masked_gather(eqn.params, x, raw)
    np.testing.assert_array_equal(got, want)  # bit for bit, NaN fills included
    if mode != "promise_in_bounds":  # (where it breaks its promise it wraps no index)
        np.testing.assert_array_equal(got, take(x, idx))


def test_integer_operand_fills_with_the_lowest_value():
    x, idx = X.astype(jnp.int32), jnp.array([[[7], [1], [2]], [[0], [9], [4]]], jnp.int32)
    eqn = _gather_eqn(lambda x, i: jnp.take_along_axis(x, i, axis=2, mode="fill"), x, idx)
    got = masked_gather(eqn.params, x, jnp.expand_dims(idx, -1))
    np.testing.assert_array_equal(got, jnp.take_along_axis(x, idx, axis=2, mode="fill"))
    assert got[0, 0, 0] == jnp.iinfo(jnp.int32).min


@pytest.mark.parametrize("spec, dtype, masked", [
    (Spec((("dp",), (), ("tp",))), jnp.float32, True),  # the vocabulary split: masked
    (Spec((("dp",), (), ())), jnp.float32, False),  # whole: the gather itself
    (Spec((("dp",), (), ("tp",))), jnp.bool_, False),  # booleans do not sum
    (None, jnp.float32, False),
])
def test_which_gathers_are_masked(spec, dtype, masked):
    eqn = _gather_eqn(lambda x, i: jnp.take_along_axis(x, i, axis=2), X.astype(dtype),
                      jnp.zeros((2, 3, 1), jnp.int32))
    assert needs_masked_gather(eqn.params, spec, 4, dtype) is masked


def test_an_embedding_lookup_is_not_masked():
    """``table[ids]`` (no batching dimensions) partitions inside ``shard_map``: left alone."""
    eqn = _gather_eqn(lambda t, i: t[i], jnp.zeros((64, 16)), jnp.zeros((4, 8), jnp.int32))
    assert looked_up_dim(eqn.params, 2, 3) is None
    assert not needs_masked_gather(eqn.params, Spec((("tp",), ())), 3, jnp.float32)
