"""``pipeline_residuals="auto"`` (``jaxpar/_src/pipeline/residual_choice.py``): a pipelined step
stores its residuals where it fits ``HardwareProfile.memory_per_device``, else recomputes them;
with ``"optimizer_level": "auto"`` the parallel optimizer's levels come first at each.  On the
toy of ``test_pipeline_memory.py`` (8 ``tanh`` layers, S=2, M=4, GPipe, dp=4, Adam)."""

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar._src.pipeline.view import format_bytes
from tests.test_pipeline_memory import _step

GPIPE = {"pipeline_scheduler": "gpipe"}


def _config(residuals: str) -> dict:
    return {**GPIPE, "pipeline_residuals": residuals}


def _auto(budget: float, *, run: bool = False, **kw):
    return _step(2, 4, _config("auto"), dp=4, adam=True, run=run,
                 hardware=jaxpar.HardwareProfile(memory_per_device=budget), **kw)


def _note(plan) -> str:
    notes = [n for n in plan.notes if n.startswith("pipeline_residuals (auto")]
    assert len(notes) == 1, plan.notes
    return notes[0]


@pytest.mark.parametrize("value", ["sometimes", True, None])
def test_bad_values_are_refused(value):
    with pytest.raises(jaxpar.JaxparError, match="pipeline_residuals.*'store', 'recompute', "
                                                 "'auto'"):
        with jaxpar.auto_parallel_context(pipeline_stages=2,
                                          pipeline_config={"pipeline_residuals": value}):
            pass


def test_budget_sweep_stores_then_recomputes():
    """Budgets from unbounded down: storing where it fits, recomputing below; the compiled
    peak within every budget that gives a plan and non-increasing as the budget falls; a
    budget below both predictions refused, naming it and the smallest prediction; numerics
    equal one device's step, storing and recomputing."""
    peaks, chose, predicted = [], [], {}
    budget = float("inf")  # then each budget from what the one before found
    for step in ("unbounded", "above store", "below store", "above recompute"):
        plan, mem, hlo, got, one = _auto(budget, run=True)
        note = _note(plan)
        chose.append(note.split(": ", 1)[1].split(" chosen")[0])
        assert mem["total"] <= budget, (budget, mem, note)
        assert note in plan.explain() and note in plan.summary()["recompute"]
        peaks.append(mem["total"])
        predicted[chose[-1]] = max(plan.memory_bytes, mem["total"])
        if chose[-1] == "recompute":
            assert format_bytes(budget) in note and "store" in note, note
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
            assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6), (step, float(jnp.max(abs(a - b))))
        budget = {"unbounded": 1.02, "above store": 0.95}.get(step, 1.02) * \
            predicted[chose[-1]]
    assert chose == ["store", "store", "recompute", "recompute"], chose
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1], peaks
    assert peaks[0] == peaks[1] and peaks[2] == peaks[3], peaks  # the same programs
    small = 0.5 * predicted["recompute"]
    with pytest.raises(jaxpar.PlanError) as e:
        _auto(small)
    msg = str(e.value)
    assert format_bytes(small) in msg, msg
    assert f"recompute, is predicted {format_bytes(plan.memory_bytes)}" in msg, msg


@pytest.mark.slow
def test_zero_levels_come_before_recomputing():
    """With ``"optimizer_level": "auto"`` too: store at off, level 1, level 3, then recompute
    at each, the first that fits (the order of non-pipelined steps' recompute ladder).  A
    sweep of budgets just above each fixed choice's peak: each choice's compiled peak is
    within its budget and the peaks fall with the budget."""
    fixed = {}
    for r in ("store", "recompute"):
        for z in (False, "level1"):
            plan, mem = _step(2, 4, _config(r), dp=4, adam=True, zero=z, mode="auto_parallel")
            fixed[r, z] = max(plan.memory_bytes, mem["total"])
    order = [("store", False), ("store", "level1"), ("recompute", False),
             ("recompute", "level1")]
    assert [fixed[k] for k in order] == sorted(fixed.values(), reverse=True), fixed
    peaks = []
    for residuals, level in order:
        budget = 1.01 * fixed[residuals, level]
        plan, mem = _auto(budget, zero="auto", mode="auto_parallel")
        note = _note(plan)
        name = "off" if level is False else level
        assert f"{residuals} (parallel optimizer {name}) chosen" in note, note
        assert plan.optimizer_level == (0 if level is False else 1), plan.notes
        assert mem["total"] <= budget, (budget, mem, note)
        peaks.append(mem["total"])
    assert peaks == sorted(peaks, reverse=True), peaks


def test_auto_blocks_inside_the_pipeline_are_refused_for_now():
    """``jaxpar.recompute(policy="auto")`` blocks in a pipelined loss are not chosen together
    with ``pipeline_residuals="auto"`` yet: a clear error, not a silent choice."""
    def loss(w, x):
        for i in range(8):
            x = jaxpar.recompute(lambda x, w: jnp.tanh(x @ w), policy="auto")(x, w[i])
        return jnp.mean(x ** 2)

    k = jax.random.split(jax.random.key(0), 2)
    w, x = list(jax.random.normal(k[0], (8, 32, 32)) * 0.3), jax.random.normal(k[1], (64, 32))
    with jaxpar.auto_parallel_context(
            parallel_mode="auto_parallel", mesh=jaxpar.make_mesh((4, 2), ("dp", "pp")),
            pipeline_stages=2, micro_batches=4, pipeline_config=_config("auto")):
        f = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(loss, batch_argnums=1)),
                               batch_argnums=1,
                               hardware=jaxpar.HardwareProfile(memory_per_device=1e6))
        with pytest.raises(jaxpar.PlanError, match="not chosen together with jaxpar.recompute"):
            f.plan(w, x)
