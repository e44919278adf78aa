"""Lowering leaves the constraints XLA does not need out, and XLA still does what the plan
says: the compiled collectives are those of the fully constrained program, and the plan's."""

import collections
import functools

import jax
import pytest

import jaxpar
from jaxpar._src import api, lower
from tests import models
from tests.util import assert_tree_close


def _compiled(monkeypatch, fn, args, loose, **options):
    monkeypatch.setattr(api, "make_evaluator", functools.partial(lower.make_evaluator,
                                                                 loose=loose))
    step = jaxpar.parallelize(fn, **options)
    lowered = step.lower(*args)
    return step, lowered.as_text().count("sharding_constraint"), lowered.compile()


def _collectives(compiled):
    return sorted((r.kind, tuple(r.axes or ()), r.shapes, r.count)
                  for r in jaxpar.inspect.collectives(compiled))


@pytest.mark.parametrize("case", ["megatron block", "automatic"])
def test_loose_results_change_no_collective(monkeypatch, case):
    """A transformer block's gradient (Megatron by hand on (dp, mp), or as the search
    decides): the same compiled collectives with and without the constraints inside
    elementwise runs; for Megatron, those the plan predicted."""
    params, x = models.init_block(jax.random.key(0), batch=4, seq=8, d=32, ff=64)
    grad = jax.grad(models.block_loss)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    if case == "megatron block":
        options = dict(parallel_mode="semi_auto_parallel", in_strategy=(
            {"wq": (1, 4), "wk": (1, 4), "wv": (1, 4), "wo": (4, 1), "w1": (1, 4), "b1": (4,),
             "w2": (4, 1), "ln_g": (1,), "ln_b": (1,)}, (2, 1, 1)))
    else:
        options = dict(parallel_mode="auto_parallel", search_mode="dynamic_programming")
    full_step, full_n, full = _compiled(monkeypatch, grad, (params, x), False, mesh=mesh,
                                        **options)
    step, n, loose = _compiled(monkeypatch, grad, (params, x), True, mesh=mesh, **options)
    plan = step.plan(params, x)
    assert len(lower.loose_values(step.compiled_entry(params, x).program.graph, plan)) > 20
    assert n < full_n * 0.8
    assert _collectives(loose) == _collectives(full) != []
    assert_tree_close(step(params, x), grad(params, x), rtol=1e-4, atol=1e-5)
    if case != "megatron block":
        return
    predicted, compiled = collections.Counter(), collections.Counter()
    for c in plan.predicted_collectives():
        predicted[(c.kind, tuple(sorted(c.axes)))] += c.count
    for r in jaxpar.inspect.collectives(loose):
        compiled[(r.kind, tuple(sorted(r.axes or ())))] += r.count
    assert compiled == predicted
