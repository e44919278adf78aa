"""The automatic recompute choice compiles each rung it tries once, and nothing again: the call
runs the chosen rung's executable; the plan cache keeps the choice, so a second process loads
it and compiles only the chosen program.

Compiles are counted with JAX's own event (jax.monitoring), numbers checked against one device.
"""

from __future__ import annotations

import contextlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar._src import api
from jaxpar._src.executable_cache import LOADED_NOTE, flush
from jaxpar._src.plan_cache import HIT_NOTE
from tests.test_recompute import BATCH, LAYERS, D, F, block, make_step

_COMPILE = "/jax/core/compile/backend_compile_duration"
_compiled: list[str] | None = None  # the XLA compiles of the step while counting


def _listen(event: str, duration: float, **kwargs) -> None:
    if event == _COMPILE and _compiled is not None:
        _compiled.append(kwargs.get("fun_name", "?"))


jax.monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def counting():
    """The names of the step programs XLA compiles inside (placement programs left out)."""
    global _compiled
    _compiled = []
    steps: list[str] = []
    try:
        yield steps
    finally:
        steps.extend(n for n in _compiled if "step" in n)
        _compiled = None


def _budget(x: float):
    return jaxpar.auto_parallel_context(hardware=jaxpar.HardwareProfile(memory_per_device=x))


def _auto(mesh, **kwargs):
    return jaxpar.parallelize(make_step(jaxpar.recompute(block, policy="auto")), mesh=mesh,
                              parallel_mode="auto_parallel", **kwargs)


def _rungs_tried(plan) -> int:
    (note,) = [n for n in plan.notes if n.startswith("recompute (auto")]
    return int(note.split("; rung ", 1)[1].split(" ", 1)[0])


def _choice(plan) -> tuple[str, ...]:
    return tuple(n.rsplit(": ", 1)[1] for n in plan.notes if n.startswith("recompute block"))


def _close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def data():
    k = jax.random.split(jax.random.key(1), 2 * LAYERS + 1)
    params = [{"w1": jax.random.normal(k[2 * i], (D, F)) * 0.1,
               "w2": jax.random.normal(k[2 * i + 1], (F, D)) * 0.1} for i in range(LAYERS)]
    x = jax.random.normal(k[-1], (BATCH, D))
    want = jax.jit(make_step(block))(params, x)  # one device, nothing recomputed
    return params, x, want, jax.jit(make_step(block))(want, x)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    before = jaxpar.config.plan_cache_dir
    path = tmp_path_factory.mktemp("plans")
    jaxpar.config.update("plan_cache_dir", str(path))
    yield path
    jaxpar.config.update("plan_cache_dir", before)


@pytest.fixture(scope="module")
def climbed(data, cache_dir):
    """A first call with room for everything, then a fresh function's first call under 80% of
    that peak (donating its parameters), each with the step compiles it made."""
    params, x, _, _ = data
    mesh = jaxpar.make_mesh((8,), ("dp",))
    roomy = _auto(mesh)
    with _budget(1e12), counting() as compiles:
        roomy(params, x)
        peak0 = jaxpar.inspect.memory(roomy.lower(params, x).compile())["total"]
        roomy_plan = roomy.plan(params, x)
    out = {"roomy": (roomy_plan, list(compiles)), "peak0": peak0, "mesh": mesh}
    f = _auto(mesh, donate_argnums=0)
    with _budget(0.8 * peak0), counting() as compiles:
        got = f(jax.tree.map(jnp.copy, params), x)  # the copy is donated
        plan = f.plan(params, x)
    out["tight"] = (f, plan, list(compiles), got)
    return out


# The auto plan lays the updated parameters out split, their inputs replicated: XLA cannot reuse
# the donated buffers and JAX says so. Donation is here for the lowering key (donated inputs are
# part of it), which the rung's lowering and the call must share.
_DONATION = pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")


@_DONATION
def test_each_rung_compiles_once_and_the_call_compiles_nothing(data, climbed):
    params, x, want, want2 = data
    plan, compiles = climbed["roomy"]
    assert _choice(plan) == ("none",) * LAYERS and _rungs_tried(plan) == 1
    assert len(compiles) == 1, compiles  # the rung; the call and lower().compile() reuse it
    f, plan, compiles, got = climbed["tight"]
    assert _rungs_tried(plan) == 3 and _choice(plan) == ("dots", "dots", "none"), plan.notes
    assert len(compiles) == 3, compiles  # before: 4, the chosen rung compiled again
    _close(got, want)
    full = [0]
    planned = f._compiled

    def counted(args):
        full[0] += 1
        return planned(args)

    f._compiled = counted
    with _budget(0.8 * climbed["peak0"]), counting() as compiles:
        placed = f._placed((params, x), f.compiled_entry(params, x))  # (a full-path look-up)
        _close(f(*placed), want)  # the fast path: arguments where the plan wants them
        assert full[0] == 1, full
        _close(f(got, x), want2)  # the full path: got is laid out as the plan's outputs
        _close(f(jax.tree.map(jnp.copy, params), x), want)  # the full path, placing
        peak = jaxpar.inspect.memory(f.lower(params, x).compile())["total"]
    assert compiles == [] and peak <= 0.8 * climbed["peak0"]
    jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE)  # eager, on the plan's placement
    try:
        with _budget(0.8 * climbed["peak0"]):
            _close(f(jax.tree.map(jnp.copy, params), x), want)
    finally:
        jaxpar.set_context(mode=jaxpar.GRAPH_MODE)


@_DONATION
def test_the_plan_cache_keeps_the_choice(data, climbed, cache_dir, monkeypatch):
    params, x, want, _ = data
    _, first, _, _ = climbed["tight"]
    searches = [0]
    original = api.decide

    def counted(*args, **kwargs):
        searches[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "decide", counted)
    second = _auto(climbed["mesh"], donate_argnums=0)  # a fresh function: a second run
    with _budget(0.8 * climbed["peak0"]), counting() as compiles:
        got = second(jax.tree.map(jnp.copy, params), x)
        plan = second.plan(params, x)
    assert plan.notes[-1].startswith(HIT_NOTE) and searches[0] == 0
    assert _choice(plan) == _choice(first) and plan.decisions == first.decisions
    # the chosen rung's executable, kept by the first run: nothing lowered, nothing compiled
    assert compiles == [] and LOADED_NOTE in plan.notes[-1], plan.notes[-1]
    _close(got, want)
    flush()  # the indexes (prefetch.py) name executables in the plan cache, none missing
    named = [json.loads(p.read_text())["executable"] for p in cache_dir.iterdir()
             if p.suffix == ".last"]
    assert named and all((cache_dir / n).exists() for n in named), named
    other = _auto(climbed["mesh"])
    with _budget(0.9 * climbed["peak0"]):  # another budget: another key, the ladder again
        plan = other.plan(params, x)
    assert not plan.notes[-1].startswith(HIT_NOTE) and searches[0] == _rungs_tried(plan) == 2
    assert _choice(plan) == ("dots", "none", "none")
    # The roomy first call's entry, its choice spoilt: ignored with a warning, and replaced.
    (entry,) = [e for e in cache_dir.iterdir() if e.suffix == ".json"
                and json.loads(e.read_text())["choice"] == ["none"] * LAYERS]
    entry.write_text(entry.read_text().replace('"choice": ["none", "none", "none"]',
                                               '"choice": ["some"]'))
    with _budget(1e12), pytest.warns(jaxpar.JaxparWarning, match="recompute choice.*some"):
        plan = _auto(climbed["mesh"]).plan(params, x)
    assert _choice(plan) == ("none",) * LAYERS and not plan.notes[-1].startswith(HIT_NOTE)
    assert json.loads(entry.read_text())["choice"] == ["none"] * LAYERS
