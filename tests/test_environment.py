"""The installed JAX is one the pins in pyproject.toml admit: known miscompiles are absent."""

import jax
import jax.numpy as jnp
import numpy as np


def test_jitted_vmapped_matvec_then_sum_is_right():
    """The reproducer of jax-ml/jax#39103 (float32 case, from the issue): jaxlib 0.10.2 on CPU
    returns 1071645696 for the last row instead of 32768**2 = 1073741824; 0.10.1 and 0.11 are
    right. pyproject.toml excludes 0.10.2 for it."""
    n = 32_769
    i = jnp.arange(n, dtype=jnp.float32)
    x = jnp.stack((i, jnp.zeros_like(i), jnp.zeros_like(i)), axis=1)
    matrix = jnp.eye(3, dtype=jnp.float32)

    def f(x):
        return jax.vmap(lambda row: jnp.sum((matrix @ row) ** 2))(x)

    got = np.asarray(jax.jit(f)(x))
    assert got[-1] == 2.0**30  # (n - 1)**2, exact in float32
    np.testing.assert_array_equal(got, np.asarray(f(x)))  # op by op, as the issue compares
