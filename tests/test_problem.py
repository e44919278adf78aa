"""The coarse search problem (search/problem.py): candidates, followers, costs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def _stack_graph(layers):
    """An SGD step of ``layers`` identical layers (dense, bias, GELU, residual)."""
    def loss(ps, x):
        for p in ps:
            x = x + jax.nn.gelu(x @ p["w"] + p["b"])
        return jnp.mean(x ** 2)

    def step(ps, x):
        grads = jax.grad(loss)(ps, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, ps, grads)

    ps = [{"w": jnp.ones((32, 32)), "b": jnp.zeros((32,))} for _ in range(layers)]
    return trace(step, (ps, jnp.ones((16, 32)))).graph


def _problem(graph, share=True):
    mesh = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))
    return build_problem(SearchSpace(graph, CostModel(mesh, HardwareProfile())), [],
                         share=share)


def test_repeated_layers_are_priced_once():
    """A stack of identical layers is priced per kind of node and edge: what is priced does
    not grow with the depth, and the problem (so the plan any solver picks) is exactly the one
    of pricing every operator on its own."""
    from jaxpar._src.search.modes import recursive_plan

    deep = _stack_graph(6)
    three, six = _problem(_stack_graph(3)), _problem(deep)
    assert six.priced["of_nodes"] > 1.8 * three.priced["of_nodes"]
    assert six.priced["nodes"] == three.priced["nodes"] < three.priced["of_nodes"] / 2
    assert six.priced["edges"] == three.priced["edges"] < three.priced["of_edges"] / 2
    alone = _problem(deep, share=False)
    assert alone.priced["nodes"] == six.priced["of_nodes"]
    assert alone.reps == six.reps and alone.cands == six.cands
    assert alone.edges.keys() == six.edges.keys()
    assert all((alone.cost[r] == six.cost[r]).all() and (alone.mem[r] == six.mem[r]).all()
               for r in six.reps)
    assert all((alone.edges[k] == six.edges[k]).all() for k in six.edges)
    assert recursive_plan(alone, 0.0) == recursive_plan(six, 0.0)


def _mixed_stack_graph():
    """An SGD step of layers of two widths (32 and 48, alternating, then 32 again): the
    same layouts meet on edges of different shapes."""
    from tests.auto_models import residual_gelu_step

    return trace(*residual_gelu_step([32, 48, 32, 48, 32])).graph


def _pinned_weight(problem):
    """A pin on the first layer's weight, split over ``mp`` on its rows: that layer's
    neighbours then differ from the other layers' (the graph's first two-dimensional input)."""
    from jaxpar._src.search.common import Pin
    from jaxpar._src.spec import Spec

    graph = problem.space.graph
    node = next(n.id for n in graph.nodes
                if n.kind == "input" and len(graph.values[n.outputs[0]].shape) == 2)
    (strategy,) = [c for c in problem.space.candidates(node)
                   if c.out_specs[0] == Spec((("mp",), ()))]
    return [Pin(node, strategy, "test")]


@pytest.mark.parametrize("case", ["repeated", "two widths", "one layer pinned"])
def test_a_build_sharing_prices_is_the_build_pricing_each_node_and_edge_alone(case):
    """Nodes and edges alike share one price, and layout changes one price per pair of
    layouts of one shape and dtype (issue 14): the problem is exactly the one of pricing each
    node and edge on its own, whatever the layers' shapes and pins."""
    graph = _mixed_stack_graph() if case == "two widths" else _stack_graph(4)
    pins = _pinned_weight(_problem(graph)) if case == "one layer pinned" else []
    mesh = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))

    def build(share):
        space = SearchSpace(graph, CostModel(mesh, HardwareProfile()))
        return build_problem(space, pins, share=share)

    shared, alone = build(True), build(False)
    assert shared.priced["edges"] < alone.priced["edges"]  # something was shared
    assert shared.reps == alone.reps and shared.cands == alone.cands
    assert shared.forced == alone.forced and len(shared.forced) == len(pins)
    assert shared.follow.keys() == alone.follow.keys()
    assert all((shared.follow[f][1] == alone.follow[f][1]).all() for f in shared.follow)
    assert all((shared.cost[r] == alone.cost[r]).all() and (shared.mem[r] == alone.mem[r]).all()
               for r in shared.reps)
    assert shared.edges.keys() == alone.edges.keys()
    assert all((shared.edges[k] == alone.edges[k]).all() for k in shared.edges)


def _residual_stack(layers: int):
    """The traced SGD step of ``layers`` identical residual GELU layers (d=32, batch 16)."""
    def loss(ps, x):
        for p in ps:
            x = x + jax.nn.gelu(x @ p["w"] + p["b"])
        return jnp.mean(x ** 2)

    def step(ps, x):
        return jax.tree.map(lambda p, g: p - 0.1 * g, ps, jax.grad(loss)(ps, x))

    ps = [{"w": jnp.ones((32, 32)), "b": jnp.zeros((32,))} for _ in range(layers)]
    return trace(step, (ps, jnp.ones((16, 32))))


def test_calibration_keeps_only_prices_the_bucket_does_not_change():
    """After calibrating the bucket on the data-parallel baseline (as auto_parallel does), the
    space still caches the prices that do not depend on the bucket; every operator and
    candidate is priced exactly as a space built fresh with that bucket prices it, and so is
    the space of gradient all-reduces priced alone (issue 14: the caches make the first call
    cheaper, never a different plan)."""
    from jaxpar._src.pins import baseline_pins
    from jaxpar._src.search.propagation import propagate

    program = _residual_stack(3)
    mesh = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))
    model = CostModel(mesh, HardwareProfile())
    space = SearchSpace(program.graph, model)
    ops = [n.id for n in program.graph.searchable()]
    before = {(n, c): space.op_cost(n, c) for n in ops for c in space.candidates(n)}
    base = propagate(space, baseline_pins(program, space, [1], [], api="test")).strategies
    old = space.bucket_bytes
    space.calibrate(base)
    assert space.bucket_bytes != old and space.deferred  # the bucket moved: prices must too
    fresh = SearchSpace(program.graph, model)
    fresh._bucket = space.bucket_bytes
    alone, fresh_alone = space.alone(), SearchSpace(program.graph, model)
    fresh_alone._bucket = 0.0
    changed = 0
    for (n, c), was in before.items():
        assert space.op_cost(n, c) == fresh.op_cost(n, c), (n, c)
        assert alone.op_cost(n, c) == fresh_alone.op_cost(n, c), (n, c)
        changed += space.op_cost(n, c) != was
    assert changed  # some deferred operator's all-reduce is priced in the new bucket


def test_layer_groups_are_found_only_when_asked_and_are_the_eager_ones(monkeypatch):
    """A search of a graph too small to share strategies across layers never pays for the
    layer groups; asked for, they are the groups found at build time (issue 14)."""
    from jaxpar._src.search import problem as problem_mod

    graph = _stack_graph(3)
    built = _problem(graph)
    assert not built.groups.found
    space = built.space
    eager = problem_mod._layer_groups(space, built.reps, built.cands, built.forced)
    assert eager and list(built.groups) == eager and built.groups.found

    calls = []
    find = problem_mod._layer_groups
    monkeypatch.setattr(problem_mod, "_layer_groups", lambda *a: calls.append(1) or find(*a))
    params, x = models.init_block(jax.random.key(0))
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(jax.grad(models.block_loss), mesh=mesh, parallel_mode="auto_parallel")
    assert f.plan(params, x).decisions and not calls


def test_a_search_again_with_all_reduces_alone_shares_what_no_price_changes(monkeypatch):
    """The build on ``space.alone()`` (gradient all-reduces priced on their own) reuses the
    first build's useless factors and layer groups, which no price changes, and finds the same
    candidates; other pins build their own (issue 14: a deep model's first call searched
    twice)."""
    from jaxpar._src.search import problem as problem_mod
    from jaxpar._src.search.common import Pin

    calls = []
    useless = problem_mod.useless_factors
    monkeypatch.setattr(problem_mod, "useless_factors",
                        lambda *a: calls.append(1) or useless(*a))
    first = _problem(_stack_graph(3))
    list(first.groups)
    again = build_problem(first.space.alone(), [])
    assert again.groups is first.groups and len(calls) == 1
    assert again.cands == first.cands and again.follow.keys() == first.follow.keys()
    node = first.reps[0]
    pinned = build_problem(first.space, [Pin(node, first.cands[node][0], "test")])
    assert pinned.groups is not first.groups and len(calls) == 2


def test_a_build_on_the_alone_space_prices_only_its_nodes_and_is_a_fresh_build(monkeypatch):
    """The build on ``space.alone()`` reuses the first build's candidates, followers and edge
    matrices, which no node price changes, and prices its nodes anew: the problem is exactly
    the one a fresh space with gradient all-reduces priced alone builds (issue 14)."""
    from jaxpar._src.search import problem as problem_mod

    graph = _stack_graph(3)
    first = _problem(graph)
    space = first.space
    assert space.bucket_bytes > 0  # the deferred all-reduces are priced combined
    edge_matrices = []
    matrix = problem_mod._edge_matrix
    monkeypatch.setattr(problem_mod, "_edge_matrix",
                        lambda *a: edge_matrices.append(1) or matrix(*a))
    again = build_problem(space.alone(), [])
    assert not edge_matrices  # nothing but the nodes was priced again
    fresh = SearchSpace(graph, space.model)
    fresh._bucket = 0.0
    plain = build_problem(fresh, [])
    assert edge_matrices  # (the fresh build priced its edges)
    assert again.reps == plain.reps and again.cands == plain.cands
    assert again.follow.keys() == plain.follow.keys()
    assert all((again.follow[f][1] == plain.follow[f][1]).all() for f in plain.follow)
    assert all((again.cost[r] == plain.cost[r]).all() and (again.mem[r] == plain.mem[r]).all()
               for r in plain.reps)
    assert again.edges.keys() == plain.edges.keys()
    assert all((again.edges[k] == plain.edges[k]).all() for k in plain.edges)
    assert again.priced == plain.priced
    # and the bucket did change some node's price
    assert any((again.cost[r] != first.cost[r]).any() for r in first.reps)


def _improve_every_time(problem, choice, sweeps):
    """The local search looking at every node and pair in every sweep (the reference)."""
    from jaxpar._src.search.polish import better, edge_rows

    adjacency = problem.neighbours()
    choice = dict(choice)

    def context(r, skip=-1):
        total = problem.cost[r].copy()
        for u in adjacency[r]:
            if u != skip:
                total += edge_rows(problem, r, u)[:, choice[u]]
        return total

    for _ in range(sweeps):
        changed = False
        for r in problem.reps:
            if r not in problem.forced:
                total = context(r)
                best = int(np.argmin(total))
                if better(total[best], total[choice[r]]):
                    choice[r], changed = best, True
        for u, v in problem.edges:
            if u in problem.forced and v in problem.forced:
                continue
            joint = context(u, v)[:, None] + context(v, u)[None, :] + problem.edges[(u, v)]
            if u in problem.forced:
                joint[np.arange(len(joint)) != choice[u], :] = np.inf
            if v in problem.forced:
                joint[:, np.arange(joint.shape[1]) != choice[v]] = np.inf
            ku, kv = np.unravel_index(int(np.argmin(joint)), joint.shape)
            if better(joint[ku, kv], joint[choice[u], choice[v]]):
                choice[u], choice[v], changed = int(ku), int(kv), True
        if not changed:
            break
    return choice


def test_the_local_search_skipping_unchanged_neighbourhoods_finds_what_looking_everywhere_does():
    """``polish.improve`` looks again only where a neighbour's choice changed (issue 14); on
    random problems with many ties (small integer costs) it ends where the search that looks
    at every node and pair in every sweep ends."""
    from jaxpar._src.search.polish import improve
    from jaxpar._src.search.problem import Problem

    rng = np.random.default_rng(0)
    for trial in range(150):
        n = int(rng.integers(2, 25))
        sizes = [int(rng.integers(1, 6)) for _ in range(n)]
        cost = {i: rng.integers(0, 5, sizes[i]).astype(float) for i in range(n)}
        edges = {}
        for _ in range(int(rng.integers(1, 3 * n))):
            u, v = sorted(int(x) for x in rng.choice(n, 2, replace=False))
            edges[(u, v)] = rng.integers(0, 4, (sizes[u], sizes[v])).astype(float)
        problem = Problem.from_tables(cost, edges)
        if trial % 3 == 0:
            problem.forced = {0: 0}
        start = {i: 0 if i in problem.forced else int(rng.integers(0, sizes[i]))
                 for i in range(n)}
        for sweeps in (1, 2, 3, 5):
            assert improve(problem, start, sweeps=sweeps) == \
                _improve_every_time(problem, start, sweeps)


def _remembered_and_fresh(space, pins, monkeypatch):
    """The propagation's strategies on ``space`` with its answers remembered, the same
    answered afresh on a new space (the memory bypassed), the questions answered the first
    time and the second."""
    from jaxpar._src.search import propagation

    answered = []
    answer = propagation._best_response
    monkeypatch.setattr(propagation, "_best_response",
                        lambda *a: answered.append(a[1]) or answer(*a))
    remembered = propagation.propagate(space, pins).strategies
    once = len(answered)
    ask = propagation.best_response
    monkeypatch.setattr(propagation, "best_response", lambda s, v, d, _=None: ask(s, v, d))
    answered.clear()
    fresh = propagation.propagate(SearchSpace(space.graph, space.model), pins).strategies
    return remembered, fresh, once, len(answered)


def test_propagation_answers_each_repeated_question_once(monkeypatch):
    """The baseline propagation remembers its answers by all that they depend on (issue 14):
    on a stack of identical layers most questions repeat, and every node still gets the
    strategy that answering each question afresh gives (the layers' weights pinned split by
    columns and by rows in turn, so alike nodes' neighbours differ in their layouts)."""
    from jaxpar._src.graph import NodeKind
    from jaxpar._src.pins import baseline_pins
    from jaxpar._src.rules import strategy_for_specs
    from jaxpar._src.search.common import Pin
    from jaxpar._src.spec import Spec

    program = _residual_stack(6)
    model = CostModel(MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp"))), HardwareProfile())
    space = SearchSpace(program.graph, model)
    pins = list(baseline_pins(program, space, [1], [], api="test"))
    for n in program.graph.nodes:
        if n.kind is NodeKind.INPUT and n.label.endswith(".w"):
            spec = Spec(((), ("mp",))) if int(n.label.split(".")[1]) % 2 else Spec((("mp",), ()))
            pins.append(Pin(n.id, strategy_for_specs(space.rule(n.id), {("out", 0): spec},
                                                     model.mesh), "test"))
    remembered, fresh, once, asked = _remembered_and_fresh(space, pins, monkeypatch)
    assert fresh == remembered
    assert once < asked / 2, (once, asked)


@pytest.mark.parametrize("model", ["scan_cumprod", "bert_stack"])
def test_propagation_answers_remembered_are_the_fresh_ones_in_loops_and_stacks(model, monkeypatch):
    """The remembered answers (issue 14) are keyed by all that an answer reads: in a scan's body
    an operator alike one outside runs once per trip (its edges weigh more), and a BERT stack's
    operators of one kind meet neighbours of other dtypes and layouts; every node still gets the
    strategy that answering its question afresh gives, the memory answering fewer questions."""
    from jaxpar._src.pins import baseline_pins
    from jaxpar._src.search import propagation
    from tests import auto_models

    fn, args = getattr(auto_models, model)()[:2]
    program = trace(fn, args)
    model_ = CostModel(MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp"))), HardwareProfile())
    space = SearchSpace(program.graph, model_)
    pins = list(baseline_pins(program, space, [1], [], api="test"))
    remembered, fresh, once, asked = _remembered_and_fresh(space, pins, monkeypatch)
    assert fresh == remembered
    assert once < asked, (once, asked)
    weights = {program.graph.nodes[n].weight for n in fresh}
    assert model != "scan_cumprod" or len(weights) > 1  # the loop's body was propagated into
    # nodes asking one question read the same rule, weights, shapes and element types (the
    # question names the node's kind, not its shapes and dtypes: issue 14)
    graph, read = program.graph, {}
    for n in fresh:
        edges = [(e, fresh[o]) for e in graph.neighbours(n)
                 for o in [e.consumer if e.producer == n else e.producer]
                 if o != n and o in fresh]
        node = graph.nodes[n]
        reads = (node.weight, [space.edge_weight(e.producer, e.consumer) for e, _ in edges],
                 [(v.shape, v.dtype) for e, _ in edges
                  for v in [graph.values[graph.nodes[e.producer].outputs[e.out_index]]]],
                 space.rule(n), space.bucket_of(n),
                 [(graph.operand_shape(o), graph.operand_dtype(o)) for o in node.inputs],
                 [(graph.values[o].shape, graph.values[o].dtype) for o in node.outputs])
        assert read.setdefault(propagation._question(space, n, edges), reads) == reads, n


def test_equal_rules_are_one_object_and_layouts_compare_as_dataclasses():
    """The nodes of repeated layers derive equal rules; the search space keeps one object per
    distinct rule (issue 14: the caches keyed by rules then hit by identity), and layouts and
    strategies compare equal exactly when their fields do (identity and kept hash first)."""
    from jaxpar._src.rules import OpStrategy
    from jaxpar._src.spec import Spec

    program = _residual_stack(4)
    model = CostModel(MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp"))), HardwareProfile())
    space = SearchSpace(program.graph, model)
    rules = [space.rule(n.id) for n in program.graph.searchable()]
    assert len({id(r) for r in rules}) == len(set(rules)) < len(rules)
    assert [space.rule(n.id) for n in program.graph.searchable()] == rules
    # a node's kind names its rule, and its operands' and results' shapes and dtypes
    graph, seen = program.graph, {}
    for n in graph.searchable():
        what = (space.rule(n.id), n.kind, n.name,
                [(graph.operand_shape(o), graph.operand_dtype(o)) for o in n.inputs],
                [(graph.values[o].shape, graph.values[o].dtype) for o in n.outputs])
        assert seen.setdefault(space.kind(n.id), what) == what, n
    assert len(set(rules)) <= len(seen) < len(rules)

    a, b, c = Spec((("dp",), ())), Spec((("dp",), ())), Spec(((), ("dp",)))
    assert a == b and a is not b and not a != b and a != c and a != (("dp",), ())
    s = OpStrategy(((), ("dp",)), (a,), (a,))
    assert s == OpStrategy(((), ("dp",)), (b,), (b,))
    for other in (OpStrategy(((), ("dp",)), (c,), (a,)), OpStrategy(((), ("dp",)), (a,), (c,)),
                  OpStrategy((("dp",), ()), (a,), (a,)),
                  OpStrategy(((), ("dp",)), (a,), (a,), (("dp", "sum"),))):
        assert s != other and not s == other


def test_a_conv_nets_spatial_factors_are_useless_until_a_pin_splits_one():
    """search/useful.py: no convolution splits a height or width, so every operator of a conv
    net's gradient is offered no split of its spatial factors (kernels: their first two, the
    NHWC activations: dimensions 1 and 2), and of nothing else.  A pin splitting the first
    ReLU's height over ``mp`` makes that height's class useful: the ReLU's neighbours in it
    keep their height factor, nothing else changes (each factor's class is asked once: its
    dimensions are one class)."""
    from jaxpar._src.search.common import Pin
    from jaxpar._src.search.useful import useless_factors
    from jaxpar._src.spec import Spec

    shapes = jax.eval_shape(models.init_convnet, jax.random.key(0))  # (nothing to compile)
    graph = trace(jax.grad(models.convnet_loss), shapes).graph
    space = _problem(graph).space
    plain = useless_factors(space, [])
    assert len(plain) == 15
    for nid, dead in plain.items():
        kernel = space.rule(nid).sizes[:2] == (3, 3)
        assert dead == ({0, 1} if kernel else {1, 2}), (graph.nodes[nid], dead)
    relu = next(n.id for n in graph.nodes
                if n.name == "max" and graph.values[n.outputs[0]].shape == (8, 8, 8, 8))
    (split_h,) = [c for c in space.candidates(relu)
                  if c.out_specs[0] == Spec(((), ("mp",), (), ()))]
    pinned = useless_factors(space, [Pin(relu, split_h, "test")])
    assert pinned.keys() == plain.keys() - {relu}
    changed = {n for n in pinned if pinned[n] != plain[n]}
    assert len(changed) == 3 and all(pinned[n] == {2} for n in changed)
    assert all(graph.values[graph.nodes[n].outputs[0]].shape == (8, 8, 8, 8) for n in changed)
