"""What the plan phase works out once per kind of node and shares (issue 14) is what working
it out per node gives: the coarse nodes' summed prices, the plan's decisions, the layer
groups' refinement.  Each test builds cases where sharing must NOT happen (another bucket,
another shape, a pin) next to ones where it does."""

import jax
import jax.numpy as jnp
import numpy as np

import jaxpar
from jaxpar._src.combine import layout_changes
from jaxpar._src.cost import CostModel
from jaxpar._src.graph import NodeKind
from jaxpar._src.hardware import HardwareProfile
from jaxpar._src.pins import baseline_pins
from jaxpar._src.plan import OpDecision, PredictedCollective, Redistribution
from jaxpar._src.planner import _decisions
from jaxpar._src.search import SearchSpace
from jaxpar._src.search.common import Pin
from jaxpar._src.search.problem import _refine, _row_classes, build_problem
from jaxpar._src.search.propagation import propagate
from jaxpar._src.spec import MeshShape
from jaxpar._src.trace import trace
from tests.auto_models import residual_gelu_step

MESH = MeshShape.of(jaxpar.make_mesh((2, 4), ("dp", "mp")))


def _step(widths):
    """An SGD step of residual GELU layers of the given widths (then back to the first)."""
    return trace(*residual_gelu_step(widths))


def test_coarse_nodes_alike_share_their_sums_but_not_their_arrays_nor_another_buckets():
    """With the gradient bucket calibrated (deferred operators priced in it, the others not),
    layers of two widths and one layer's weight pinned: the shared build's prices are the
    ones of pricing every node alone, and every coarse node has arrays of its own (the
    layout changes inside one are added to it alone)."""
    program = _step([32, 48, 32, 32, 32])
    graph = program.graph
    space = SearchSpace(graph, CostModel(MESH, HardwareProfile()))
    space.calibrate(propagate(space, baseline_pins(program, space, [1], [], api="test"))
                    .strategies)
    assert space.bucket_bytes > 0 and space.deferred
    weight = next(n.id for n in graph.nodes
                  if n.kind == "input" and graph.values[n.outputs[0]].shape == (32, 48))
    split = next(c for c in space.candidates(weight) if any(c.factor_axes))
    pins = [Pin(weight, split, "test")]
    shared = build_problem(space, pins)
    fresh = SearchSpace(graph, space.model)
    fresh._bucket = space.bucket_bytes
    alone = build_problem(fresh, pins, share=False)
    assert shared.reps == alone.reps
    for r in shared.reps:
        np.testing.assert_array_equal(shared.cost[r], alone.cost[r])
        np.testing.assert_array_equal(shared.mem[r], alone.mem[r])
    arrays = [a for r in shared.reps for a in (shared.cost[r], shared.mem[r])]
    assert len({id(a) for a in arrays}) == len(arrays)
    # coarse nodes alike (same members' kinds and buckets) exist, and differ from others
    sums = {}
    for r in shared.reps:
        sums.setdefault(shared.cost[r].tobytes(), []).append(r)
    assert max(len(v) for v in sums.values()) >= 3 and len(sums) > 10


def _reference_decisions(graph, strategies, origins, space, details, scatters):
    """planner._decisions as it was written per node (before issue 14's sharing)."""
    model = space.model
    out = []
    for node in graph.nodes:
        in_shapes = tuple(graph.operand_shape(o) for o in node.inputs)
        out_shapes = tuple(graph.values[v].shape for v in node.outputs)
        if node.kind is NodeKind.CONTROL:
            out.append(OpDecision(node.id, "control", node.name, node.source, "", in_shapes,
                                  out_shapes, (), (), "", node.weight, (), ()))
            continue
        strat = strategies[node.id]
        own = model.op_collectives(strat, out_shapes,
                                   [graph.values[v].dtype for v in node.outputs])
        redists = []
        for i, operand, src, dst in layout_changes(graph, strategies, node.id):
            value = graph.values[operand]
            w = space.edge_weight(value.producer, node.id)
            colls = model.redistribution(src, dst, value.shape, value.dtype)
            redists.append(Redistribution(value.producer, value.index, node.id, i, src, dst,
                                          tuple(PredictedCollective.of(c, w) for c in colls)))
        out.append(OpDecision(
            node.id, node.kind, node.name, node.source, node.label, in_shapes, out_shapes,
            strat.in_specs, strat.out_specs, origins.get(node.id, ""), node.weight,
            tuple(PredictedCollective.of(c, node.weight) for c in own) if own else (),
            tuple(redists), flops=space.flops(node.id, strat),
            category=str(space.rule(node.id).category)))
    return tuple(out)


def test_decisions_shared_per_strategy_are_the_per_node_ones():
    """Random strategies (partial sums, layout changes on many edges), one strategy object
    shared by operators of different shapes and loop weights (a scan's body): every decision
    equals the one made node by node."""
    def f(ws, x):
        x = jnp.tanh(x @ ws[0])
        x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws[1:])
        return jnp.sum(x @ ws[0][:, :16])

    program = trace(jax.grad(f), (jnp.ones((4, 32, 32)), jnp.ones((16, 32))))
    graph = program.graph
    space = SearchSpace(graph, CostModel(MESH, HardwareProfile()))
    rng = np.random.default_rng(0)
    by_rule = {}
    for seed in range(3):
        chosen = {}
        for node in graph.searchable():
            cands = space.candidates(node.id)
            # one object per rule and pick: nodes of one rule share it, whatever their weight
            chosen[node.id] = by_rule.setdefault((space.rule(node.id), seed, len(cands)),
                                                 cands[rng.integers(len(cands))])
        origins = {n: "test" for n in chosen}
        got = _decisions(graph, chosen, origins, space, {}, {})
        want = _reference_decisions(graph, chosen, origins, space, {}, {})
        assert got == want
        assert sum(len(d.collectives) for d in got) and sum(len(d.redistributions) for d in got)
    weights = {d.weight for d in got}
    assert len(weights) > 1  # the scan's body weighs its trips


def test_row_classes_partition_rows_as_numpy_unique_does():
    rng = np.random.default_rng(1)
    for shape in [(1, 1), (50, 1), (200, 3), (1000, 6)]:
        rows = rng.integers(0, 3, size=shape)
        inverse, n = _row_classes(rows)
        _, want = np.unique(rows, axis=0, return_inverse=True)
        want = want.reshape(-1)
        assert n == want.max() + 1
        # the same partition: equal rows one number, unequal rows different ones
        pairs = set(zip(inverse.tolist(), want.tolist(), strict=True))
        assert len(pairs) == n == len({a for a, _ in pairs}) == len({b for _, b in pairs})


def test_refinement_tells_apart_nodes_whose_neighbours_differ_only_by_port():
    # 0 -> 1 on ports (0, 0); 2 -> 3 on ports (0, 1): 1 and 3 differ by the port they read
    colours = _refine([0, 0, 0, 0], [(0, 0, 1, 0), (2, 0, 3, 1)], 1)
    assert colours[1] != colours[3]
    same = _refine([0, 0, 0, 0], [(0, 0, 1, 1), (2, 0, 3, 1)], 1)
    assert same[1] == same[3] and same[0] == same[2]


def test_alike_contractions_in_another_gradient_bucket_are_not_shared():
    """Two products of one rule and shape, one feeding another contraction and one reaching
    only the loss (deferred: its all-reduce travels in the combined bucket): priced apart."""
    def f(x, w, w2, v):
        return jnp.sum((x @ w) @ v) + jnp.sum(x @ w2)

    ones = jnp.ones((32, 32))
    graph = trace(f, (jnp.ones((16, 32)), ones, ones, ones)).graph
    dots = [n.id for n in graph.nodes if n.name == "dot_general"]

    def space():
        made = SearchSpace(graph, CostModel(MESH, HardwareProfile()))
        made._bucket = 64e6
        return made

    shared, alone = build_problem(space(), []), build_problem(space(), [], share=False)
    first, deferred = dots[0], dots[2]
    assert shared.space.rule(first) is shared.space.rule(deferred)
    assert deferred in shared.space.deferred and first not in shared.space.deferred
    assert not np.array_equal(alone.cost[first], alone.cost[deferred])
    for r in shared.reps:
        np.testing.assert_array_equal(shared.cost[r], alone.cost[r])


def _layer_step():
    """Residual GELU layers of two widths, then the same layer's product inside a scan (its
    edges priced at the scan's trips: alike in all but the weight) and outside it."""
    def loss(ps, ws, x):
        for p in ps:
            x = jax.nn.gelu(x @ p["w"] + p["b"])
        x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(jnp.tanh(x @ ws[0]) ** 2)

    def step(ps, ws, x):
        gp, gw = jax.grad(loss, argnums=(0, 1))(ps, ws, x)
        return (jax.tree.map(lambda p, g: p - 0.1 * g, ps, gp), ws - 0.1 * gw)

    widths = [32, 48, 32, 32, 32]
    ps = [{"w": jnp.ones((a, b)), "b": jnp.zeros((b,))}
          for a, b in zip(widths, widths[1:] + [widths[0]], strict=True)]
    return step, (ps, jnp.ones((3, 32, 32)), jnp.ones((16, 32)))


def test_layout_shared_per_kind_is_the_per_node_one():
    """The build's candidates, followers, coarse nodes, their prices (with any layout changes
    inside them) and edge matrices (in their order), shared per kind of node and edge, are
    the ones found node by node and edge by edge (``share=False``): with layers of two
    widths, a pinned weight, tied state and edges alike but for their loop weight (a scan's
    body)."""
    from jaxpar._src.state import state_ties

    step, args = _layer_step()
    program = trace(step, args)
    graph = program.graph
    ties = state_ties(program, args, ())
    assert ties
    model = CostModel(MESH, HardwareProfile())
    weight = next(n.id for n in graph.nodes
                  if n.kind == "input" and graph.values[n.outputs[0]].shape == (32, 48))
    space = SearchSpace(graph, model)
    split = next(c for c in space.candidates(weight) if any(c.factor_axes))
    pins = [Pin(weight, split, "test")]
    shared = build_problem(space, pins, ties=ties)
    alone = build_problem(SearchSpace(graph, model), pins, ties=ties, share=False)
    assert shared.reps == alone.reps and shared.cands == alone.cands
    assert shared.forced == alone.forced
    assert list(shared.follow) == list(alone.follow)
    for f, (rep, index) in shared.follow.items():
        assert rep == alone.follow[f][0]
        np.testing.assert_array_equal(index, alone.follow[f][1])
    for r in shared.reps:  # (the layout changes inside a coarse node are in its cost)
        np.testing.assert_array_equal(shared.cost[r], alone.cost[r])
    assert list(shared.edges) == list(alone.edges)
    for key, m in shared.edges.items():
        np.testing.assert_array_equal(m, alone.edges[key])
    # sharing happened: fewer matrices priced than edges; followers exist
    assert shared.priced["edges"] < alone.priced["edges"] == alone.priced["of_edges"]
    assert len(shared.follow) > 10 and len(shared.edges) > 10
    weights = {graph.nodes[r].weight for r in shared.reps}
    assert len(weights) > 1  # the scan's body weighs its trips
