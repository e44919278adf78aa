"""Search modes are registered objects: one protocol, one registry, run by name."""

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar._src.search import SearchResult, get_search, register_search, search_modes
from jaxpar._src.search.common import Assignment
from jaxpar._src.search.registry import unregister_search
from tests.util import assert_tree_close


def test_built_in_modes_are_registered():
    assert set(search_modes()) >= {"sharding_propagation", "recursive_programming",
                                   "dynamic_programming", "optimal"}


def test_a_registered_search_runs_by_name_and_can_be_replaced():
    calls = []

    def replicate(request):
        calls.append(request.where)
        space = request.space
        chosen = {n.id: space.candidates(n.id)[0] for n in space.graph.searchable()}
        chosen.update({p.node: p.strategy for p in request.pins})
        return SearchResult(Assignment(chosen, dict.fromkeys(chosen, "test")), "test_replicate")

    register_search("test_replicate")(replicate)
    try:
        register_search("test_replicate")(replicate)  # a re-run notebook cell: replaced
        mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))

        def f(x, w):
            return jnp.tanh(x @ w)

        x, w = jnp.ones((8, 16)), jnp.ones((16, 4))
        step = jaxpar.parallelize(f, mesh=mesh, parallel_mode="auto_parallel",
                                  search_mode="test_replicate")
        assert_tree_close(step(x, w), f(x, w))
        plan = step.plan(x, w)
        assert plan.search_mode == "test_replicate" and calls == ["jaxpar.parallelize(f)"]
        assert all(s.is_replicated for s in plan.input_specs)
    finally:
        unregister_search("test_replicate")
    with pytest.raises(jaxpar.JaxparError, match="search_mode 'test_replicate' is not one of"):
        get_search("test_replicate")
    with pytest.raises(jaxpar.JaxparError, match="is not one of"):
        jaxpar.parallelize(jax.numpy.sin, mesh=mesh, parallel_mode="auto_parallel",
                           search_mode="test_replicate")
