"""The coarse search problem (search/problem.py): candidates, followers, costs."""

import jax
import jax.numpy as jnp

import jaxpar
from jaxpar._src.cost import CostModel
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.rules import enumerate_strategies
from jaxpar._src.search.common import SearchSpace
from jaxpar._src.search.problem import build_problem
from jaxpar._src.spec import MeshShape
from jaxpar._src.trace import trace
from tests import models


class _FreshCandidates(SearchSpace):
    """Hands out a new tuple of candidates on every call, as the rule cache does after an
    eviction: a freed tuple's id() is soon another tuple's."""

    def candidates(self, nid):
        return tuple(list(super().candidates(nid)))


def test_candidates_are_keyed_by_rule_not_by_the_identity_of_a_tuple():
    params, x = models.init_block(jax.random.key(0))
    graph = trace(jax.grad(models.block_loss), (params, x)).graph
    mesh = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))
    space = _FreshCandidates(graph, CostModel(mesh, HardwareProfile()))
    problem = build_problem(space, [])
    for nid, cands in problem.cands.items():
        allowed = set(enumerate_strategies(space.rule(nid), mesh))
        assert set(cands) <= allowed, (nid, graph.nodes[nid])
    # and the answer is the one an unhurried cache gives
    plain = build_problem(SearchSpace(graph, CostModel(mesh, HardwareProfile())), [])
    assert problem.cands == plain.cands
    assert all((problem.cost[r] == plain.cost[r]).all() for r in plain.reps)


def test_repeated_layers_share_their_candidate_lists():
    def f(w, x):
        for _ in range(4):
            x = jnp.tanh(x @ w)
        return x

    graph = trace(f, (jnp.ones((16, 16)), jnp.ones((8, 16)))).graph
    mesh = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))
    problem = build_problem(SearchSpace(graph, CostModel(mesh, HardwareProfile())), [])
    dots = [n.id for n in graph.nodes if n.name == "dot_general"]
    assert len({id(problem.cands[d]) for d in dots}) == 1  # one list for one rule
