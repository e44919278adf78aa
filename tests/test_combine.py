"""combine.py: the plan's collectives as XLA's combiners leave them, and the step time.

Checked against the compiled program where the profile's combiner is XLA:CPU's (the ``cpu``
preset), and against the combiner's rules (XLA's ``CombineInstructionsByKey``) where it is not.
"""

import jax
import pytest

import jaxpar
from jaxpar._src.combine import deferred_nodes, sibling_buckets
from jaxpar._src.cost import CostModel
from jaxpar._src.search import SearchSpace
from jaxpar._src.spec import MeshShape
from tests import auto_models as am
from tests import models


@pytest.fixture(scope="module")
def dp_mlp():
    step, args = am.flax_mlp_adam(batch=256, hidden=32)
    return step, args, jaxpar.make_mesh((4,), ("x",))


def _dp_plan(step, args, mesh, hw):
    return jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel",
                              hardware=hw).plan(*args)


def test_gradient_all_reduces_combine_into_one_as_compiled(dp_mlp):
    step, args, mesh = dp_mlp
    f = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel")
    plan = f.plan(*args)
    raw = plan.predicted_collectives(combined=False)
    assert len(raw) == 13  # 6 kernels, 6 biases, the loss
    (one,) = plan.predicted_collectives()
    assert one.kind == "all-reduce" and one.members == 13 and one.deferred
    compiled = jaxpar.inspect.collectives(f.lower(*args))
    assert compiled.count() == 1 and compiled[0].nbytes == one.nbytes, compiled.table()
    # One latency for the one collective: priced alone, the 13 would cost more.
    assert one.time < sum(c.time for c in raw)


def test_the_combiner_threshold_splits_the_gradients(dp_mlp):
    step, args, mesh = dp_mlp
    total = sum(c.nbytes for c in _dp_plan(step, args, mesh, jaxpar.HardwareProfile())
                .predicted_collectives())
    small = jaxpar.HardwareProfile(combine_threshold_bytes={"all-reduce": total / 3})
    buckets = _dp_plan(step, args, mesh, small).predicted_collectives()
    assert 3 <= len(buckets) <= 13
    assert all(c.nbytes <= total / 3 for c in buckets)
    none = jaxpar.HardwareProfile(combine_threshold_bytes={})
    assert len(_dp_plan(step, args, mesh, none).predicted_collectives()) == 13


def test_overlap_hides_gradient_reduction_behind_the_backward_pass():
    step, args = am.wide_mlp(batch=2048, d=256, h=1024)
    mesh = jaxpar.make_mesh((8,), ("x",))
    blocking = jaxpar.HardwareProfile(preset="h100", overlap_collectives=False)
    overlapping = jaxpar.HardwareProfile(preset="h100", overlap_collectives=True,
                                         combine_threshold_bytes={"all-reduce": 1.5 * 2 ** 20})
    a = _dp_plan(step, args, mesh, blocking).summary()
    b = _dp_plan(step, args, mesh, overlapping).summary()
    assert a["step_time_s"] == pytest.approx(a["compute_s"] + a["communication_s"])
    # Two 1 MiB gradients, buckets of 1.5 MiB: the first (the second layer's gradient) runs
    # while the first layer's backward pass computes.
    assert b["collectives"]["all-reduce"]["count"] >= 2
    assert b["compute_s"] < b["step_time_s"] < (b["compute_s"] + b["communication_s"]) * 0.999


def test_deferred_operators_and_summed_siblings():
    params, x = models.init_block(jax.random.key(0))
    mesh = jaxpar.make_mesh((4,), ("x",))
    graph = jaxpar.parallelize(am.sgd_step(models.block_loss), parallel_mode="auto_parallel",
                               mesh=mesh).compiled_entry(params, x).program.graph
    space = SearchSpace(graph, CostModel(MeshShape.of(mesh), jaxpar.HardwareProfile()))
    # contractions by their rule's category (OpCategory.CONTRACTION), not by name
    assert space.contractions == {n.id for n in graph.nodes if n.name == "dot_general"}
    deferred = deferred_nodes(graph, space.contractions)
    assert deferred == space.deferred
    dots = [n for n in graph.nodes if n.name == "dot_general"]
    # Every weight gradient is deferred; no forward contraction is (they feed the next one).
    forward = [n for n in dots if n.source.endswith("(block)")][:4]
    assert not any(n.id in deferred for n in forward)
    assert sum(n.id in deferred for n in dots) >= 6  # wq, wk, wv, wo, w1, w2 gradients
    siblings = sibling_buckets(graph, space.contractions)
    assert len(siblings) == 3  # the input gradients through the query, key and value kernels
    assert len(set(siblings.values())) == 1


def _crossed_gathers(hw: str):
    """Two values gathered in two steps over the two mesh axes in opposite orders (as a
    sharded optimizer update is gathered back to replicated parameters): ``a`` over ``mp``
    then ``dp``, ``b`` over ``dp`` then ``mp``."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))

    def f(a, b):
        a = jax.lax.with_sharding_constraint(a * 2, NamedSharding(mesh, P("dp", None)))
        b = jax.lax.with_sharding_constraint(b * 2, NamedSharding(mesh, P(None, "mp")))
        return a + 1, b + 1

    args = (jax.numpy.ones((16, 16)), jax.numpy.ones((16, 16)))
    g = jaxpar.parallelize(f, mesh=mesh, parallel_mode="semi_auto_parallel", hardware=hw,
                           in_strategy=(P("dp", "mp"), P("dp", "mp")), out_strategy=(P(), P()))
    return g, args


def _by_kind_and_axes(items) -> dict:
    out: dict = {}
    for c in items:
        out[(c.kind, tuple(c.axes))] = out.get((c.kind, tuple(c.axes)), 0) + c.count
    return out


def test_crossed_gathers_predicted_as_compiled():
    g, args = _crossed_gathers("cpu")  # XLA:CPU combines no all-gathers: four remain
    predicted = _by_kind_and_axes(g.plan(*args).predicted_collectives())
    compiled = _by_kind_and_axes(jaxpar.inspect.collectives(g.lower(*args).compile()))
    assert predicted == compiled == {("all-gather", ("mp",)): 2, ("all-gather", ("dp",)): 2}


def test_combining_never_makes_a_cycle():
    # XLA:GPU combines all-gathers.  The first mp gather (a's) and the second (b's) are
    # independent and combine; a's dp gather then waits for that group, which waits for b's
    # dp gather: the two dp gathers cannot combine too (a cycle, which once priced the whole
    # step at 0 s because the schedule never reached the deadlocked collectives).
    g, args = _crossed_gathers("h100")
    plan = g.plan(*args)
    groups = sorted((c.kind, c.axes, c.members) for c in plan.predicted_collectives())
    assert groups == [("all-gather", ("dp",), 1), ("all-gather", ("dp",), 1),
                      ("all-gather", ("mp",), 2)]
    s = plan.summary()
    # One network stream: the step takes at least every collective's time.
    assert s["step_time_s"] >= s["communication_s"] > 0


def _per_kind_and_axes(items) -> dict:
    out: dict = {}
    for kind, axes, count in items:
        key = (kind, tuple(sorted(axes or ())))
        out[key] = out.get(key, 0) + count
    return out


@pytest.mark.parametrize("how", ["dynamic_programming", "batch on mp, sequence on dp"])
def test_a_reduction_split_over_two_dimensions_all_reduces_per_axis(how):
    """A transformer block's gradient on (dp, mp) whose weight gradients contract a batch and
    a sequence split over different axes: XLA reduces over one axis, then the other (two
    all-reduces, each combined with the others over its axis), not once over both; the plan
    predicts the compiled collectives per kind and axes (this case once predicted a third,
    joint all-reduce over (dp, mp))."""
    params, x = models.init_block(jax.random.key(0), batch=4, seq=8, d=32, ff=64)
    grad = jax.grad(models.block_loss)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    if how == "dynamic_programming":
        options = dict(parallel_mode="auto_parallel", search_mode=how)
    else:
        options = dict(parallel_mode="semi_auto_parallel", in_strategy=(
            {k: tuple(1 for _ in v.shape) for k, v in params.items()}, (4, 2, 1)))
    step = jaxpar.parallelize(grad, mesh=mesh, hardware=jaxpar.HardwareProfile(), **options)
    plan = step.plan(params, x)
    compiled = jaxpar.inspect.collectives(step.lower(params, x).compile())
    got = _per_kind_and_axes((r.kind, r.axes, r.count) for r in compiled)
    assert got == _per_kind_and_axes((c.kind, c.axes, c.count)
                                     for c in plan.predicted_collectives()), compiled.table()
    assert ("all-reduce", ("mp",)) in got and ("all-reduce", ("dp",)) in got
    assert ("all-reduce", ("dp", "mp")) not in got
