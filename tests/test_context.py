"""The auto-parallel context: setter, getter, reset, with-block, explicit arguments win."""

import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar import ParallelMode


def test_set_get_reset():
    jaxpar.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=8,
                                     search_mode="sharding_propagation", gradients_mean=True)
    assert jaxpar.get_auto_parallel_context("parallel_mode") is ParallelMode.SEMI_AUTO_PARALLEL
    assert jaxpar.get_auto_parallel_context("device_num") == 8
    jaxpar.reset_auto_parallel_context()
    assert jaxpar.get_auto_parallel_context("parallel_mode") is ParallelMode.STAND_ALONE
    assert jaxpar.get_auto_parallel_context("device_num") is None


def test_with_block_restores_on_exit_even_after_an_error():
    jaxpar.set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL)
    with pytest.raises(RuntimeError):
        with jaxpar.auto_parallel_context(parallel_mode="auto_parallel") as ctx:
            assert ctx.parallel_mode is ParallelMode.AUTO_PARALLEL
            assert jaxpar.get_auto_parallel_context("parallel_mode") is ParallelMode.AUTO_PARALLEL
            raise RuntimeError
    assert jaxpar.get_auto_parallel_context("parallel_mode") is ParallelMode.DATA_PARALLEL


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"paralel_mode": "x"}, "unknown auto-parallel context option 'paralel_mode'"),
     ({"parallel_mode": "hybrid"}, "not one of"),
     ({"search_mode": "greedy"}, "not one of"),
     ({"device_num": 0}, "positive int"),
     ({"gradients_mean": 1}, "True or False"),
     ({"mesh": (2, 4)}, "jax.sharding.Mesh")],
)
def test_invalid_options_are_rejected(kwargs, match):
    with pytest.raises(jaxpar.ContextError, match=match):
        jaxpar.set_auto_parallel_context(**kwargs)
    with pytest.raises(jaxpar.ContextError, match=match):
        with jaxpar.auto_parallel_context(**kwargs):
            pass


def test_unknown_key_in_get():
    with pytest.raises(jaxpar.ContextError, match="Known options"):
        jaxpar.get_auto_parallel_context("nope")


def test_explicit_arguments_win_over_the_context():
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    jaxpar.set_auto_parallel_context(parallel_mode="data_parallel")
    f = jaxpar.parallelize(lambda x, w: x @ w, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((1, 1), (1, 4)))
    plan = f.plan(jnp.ones((8, 16)), jnp.ones((16, 8)))
    assert plan.parallel_mode == "semi_auto_parallel"


def test_algo_parameters():
    jaxpar.set_algo_parameters(fully_use_devices=False)
    assert jaxpar.get_algo_parameters("fully_use_devices") is False
    with pytest.raises(jaxpar.ContextError, match="unknown algorithm parameter"):
        jaxpar.set_algo_parameters(fully_use=True)
    jaxpar.reset_algo_parameters()
    assert jaxpar.get_algo_parameters("fully_use_devices") is True
