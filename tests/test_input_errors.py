"""Every input error is a JaxparError naming the fix: the edges a new user hits first."""

import jax.numpy as jnp
import pytest

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
    ({"hardware": "h100"}, "HardwareProfile"),
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
