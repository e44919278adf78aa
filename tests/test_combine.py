"""combine.py: the plan's collectives as XLA's combiners leave them, and the step time.

Checked against the compiled program where the profile's combiner is XLA:CPU's (the ``cpu``
preset), and against the combiner's rules (XLA's ``CombineInstructionsByKey``) where it is not.
"""

import jax
import pytest

import jaxpar
from jaxpar._src.combine import deferred_nodes, sibling_buckets
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
    graph = jaxpar.parallelize(am.sgd_step(models.block_loss), parallel_mode="auto_parallel",
                               mesh=jaxpar.make_mesh((4,), ("x",))).compiled_entry(
        params, x).program.graph
    deferred = deferred_nodes(graph)
    dots = [n for n in graph.nodes if n.name == "dot_general"]
    # Every weight gradient is deferred; no forward contraction is (they feed the next one).
    forward = [n for n in dots if n.source.endswith("(block)")][:4]
    assert not any(n.id in deferred for n in forward)
    assert sum(n.id in deferred for n in dots) >= 6  # wq, wk, wv, wo, w1, w2 gradients
    siblings = sibling_buckets(graph)
    assert len(siblings) == 3  # the input gradients through the query, key and value kernels
    assert len(set(siblings.values())) == 1
