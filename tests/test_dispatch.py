"""The per-call fast path: a call like the last one goes straight to its jitted program, and
every call that is not like it (shapes, weak types, static values, layouts, context) gets the
plan made for it, as jax.jit would."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.api import Parallelized


@pytest.fixture
def full_calls(monkeypatch):
    """How many calls took the full path (planning, or finding the plan, in Python)."""
    count = [0]
    original = Parallelized._compiled

    def counted(self, args):
        count[0] += 1
        return original(self, args)

    monkeypatch.setattr(Parallelized, "_compiled", counted)
    return count


def _mlp(x, w):
    return jnp.tanh(x @ w) * 2


@pytest.fixture
def compiles():
    """How many times XLA compiled a program of ``_mlp`` (jaxpar names its program after the
    function; moving arrays compiles small programs of its own)."""
    count = [0]

    def compiled(event, *_, fun_name="", **__):
        if event == "/jax/core/compile/backend_compile_duration" and "_mlp" in fun_name:
            count[0] += 1

    jax.monitoring.register_event_duration_secs_listener(compiled)
    yield count
    jax.monitoring.unregister_event_duration_listener(compiled)


def test_a_call_like_the_last_skips_the_full_path(full_calls, compiles):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(_mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((2, 1), (1, 4)))
    x, w = jnp.arange(64.0).reshape(8, 8) / 64, jnp.ones((8, 16)) / 8
    want = jax.jit(lambda *a: _mlp(*a))(x, w)
    first = f(x, w)  # the full path: plan, compile, place
    assert full_calls[0] == 1 and compiles[0] == 1
    xs = jax.device_put(x, NamedSharding(mesh, P("dp")))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "mp")))
    for _ in range(3):  # placed as the plan wants them: straight to the compiled program
        np.testing.assert_allclose(f(xs, ws), want, rtol=1e-6)
        np.testing.assert_allclose(f(xs * 1, ws), want, rtol=1e-6)  # computed, as placed
    assert full_calls[0] == 1
    planned = f.plan(x, w).output_layouts()["out"]
    assert f(xs, ws).sharding.spec == first.sharding.spec == planned


def test_arrays_not_yet_placed_are_placed_not_compiled_for_again(full_calls, compiles):
    """The first call's arguments passed again (not placed): jax.jit would compile the plan's
    program a second time for their layouts; the fast path gives up instead and the full path
    places them for the program compiled once."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    f = jaxpar.parallelize(_mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((2, 1), (1, 4)))
    x, w = jnp.arange(64.0).reshape(8, 8) / 64, jnp.ones((8, 16)) / 8
    want = jax.jit(lambda *a: _mlp(*a))(x, w)
    for _ in range(4):
        np.testing.assert_allclose(f(x, w), want, rtol=1e-6)
    assert compiles[0] == 1 and full_calls[0] >= 2  # placed by the full path each time
    xs = jax.device_put(x, NamedSharding(mesh, P("dp")))
    np.testing.assert_allclose(f(xs, jax.device_put(w, NamedSharding(mesh, P(None, "mp")))),
                               want, rtol=1e-6)
    assert compiles[0] == 1


def test_calls_unlike_the_last_get_their_own_plan(full_calls):
    mesh = jaxpar.make_mesh((8,), ("d",))
    f = jaxpar.parallelize(lambda x, s: x * s, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((8,), None))
    x = jnp.ones((8,), jnp.bfloat16)
    assert f(x, 1.5).dtype == jnp.bfloat16  # a weak scalar keeps bfloat16
    assert f(x, jnp.float32(1.5)).dtype == jnp.float32  # a float32 scalar promotes
    assert f(jnp.ones((16,), jnp.bfloat16), 1.5).shape == (16,)  # another shape
    assert full_calls[0] == 3
    with jax.enable_x64(True):  # another trace context: x64 arrays
        assert f(np.ones(8, np.float64), 1.5).dtype == jnp.float64
    assert full_calls[0] == 4
    # An array committed to another layout is moved by the full path, not refused.
    other = jax.device_put(jnp.arange(8.0), NamedSharding(jaxpar.make_mesh((2, 4), ("a", "b")),
                                                          P(None)))
    np.testing.assert_array_equal(f(other, 2.0), np.arange(8.0) * 2)
    assert f(other, 2.0).sharding.spec == P("d")


def test_static_arguments_and_the_context_are_part_of_the_key(full_calls):
    g = jaxpar.parallelize(lambda x, n: x + jnp.full(x.shape, n), static_argnums=1,
                           batch_argnums=0)
    x = jnp.ones((8, 2))
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel"):
        assert g(x, 1).dtype == jnp.float32 and g(x, True).dtype == jnp.float32
        out = g(x, 2)
        assert full_calls[0] == 3  # 1, True and 2 are three programs, as in jax.jit
        np.testing.assert_array_equal(g(out - 2, 2), np.full((8, 2), 3.0))  # placed: fast
        assert full_calls[0] == 3 and out.sharding.spec == P("devices")
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel", mesh=mesh):
        y = g(x, 2)  # another context: another mesh
    assert full_calls[0] == 4 and y.sharding.mesh.axis_names == ("dp", "mp")
    with jaxpar.auto_parallel_context(parallel_mode="data_parallel", mesh=mesh):
        g(y - 2, 2)  # a new with-block of the same options is the same context
    assert full_calls[0] == 4
    jaxpar.set_algo_parameters(fully_use_devices=False)
    try:
        with jaxpar.auto_parallel_context(parallel_mode="data_parallel", mesh=mesh):
            g(x, 2)
        assert full_calls[0] == 5  # new algorithm parameters: the full path
    finally:
        jaxpar.reset_algo_parameters()


def test_alternating_signatures_stay_right_and_back_off():
    mesh = jaxpar.make_mesh((8,), ("d",))
    f = jaxpar.parallelize(lambda x: x * 3, mesh=mesh, parallel_mode="semi_auto_parallel",
                           in_strategy=((8,),))
    a, b = jnp.arange(8.0), jnp.arange(16.0)
    for _ in range(12):
        np.testing.assert_array_equal(f(a), np.arange(8.0) * 3)
        np.testing.assert_array_equal(f(b), np.arange(16.0) * 3)
    assert f._fast._misses >= 2  # it gave up, and now waits longer before trying again


def test_arguments_are_placed_in_one_transfer(monkeypatch):
    """The leaves not yet where the plan wants them move in one ``jax.device_put`` (JAX batches
    its transfers); leaves already there and Python scalars pass as they
    are, and every placed leaf has the plan's layout and its values."""
    from jaxpar._src import placing

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    row, rep = NamedSharding(mesh, P("dp")), NamedSharding(mesh, P())
    there = jax.device_put(jnp.arange(8.0), row)
    leaves = [jnp.arange(8.0), there, 3.0, jnp.ones((4, 4)), jax.device_put(jnp.ones(4), rep)]
    shardings = [row, row, rep, rep, rep]
    calls = []
    real = jax.device_put
    monkeypatch.setattr(placing.jax, "device_put", lambda *a, **k: calls.append(a) or real(*a, **k))
    out = placing.place_all(leaves, shardings)
    assert len(calls) == 1 and len(calls[0][0]) == 2  # the two uncommitted arrays, together
    assert out[1] is there and out[2] == 3.0 and out[4] is leaves[4]
    for x, y, s in zip(leaves, out, shardings, strict=True):
        if isinstance(y, jax.Array):
            assert y.sharding.is_equivalent_to(s, y.ndim)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


# -- the hot check: a number that changes with the context, and the thread --------------------
def _hot(f):
    """Whether ``f``'s next call like the last one goes straight to its program, unchecked."""
    from jaxpar._src.context import CHANGES

    hot = f._fast._hot
    return hot is not None and hot[0] == CHANGES.count and hot[1] == threading.get_ident()


def _data_parallel():
    return jaxpar.parallelize(lambda x: x * 2, batch_argnums=0)


@pytest.mark.parametrize(("change", "full_path"), [
    (lambda: jaxpar.set_auto_parallel_context(mesh=jaxpar.make_mesh((2, 4), ("a", "b"))), True),
    (lambda: jaxpar.set_auto_parallel_context(device_num=4), True),
    (lambda: jaxpar.set_algo_parameters(fully_use_devices=False), True),
    (lambda: jaxpar.set_context(mode=jaxpar.PYNATIVE_MODE), True),
    (jaxpar.reset_auto_parallel_context, True),  # stand_alone: one device
    # a change to what they already were: compared, found equal, the program runs
    (lambda: jaxpar.set_auto_parallel_context(parallel_mode="data_parallel"), False),
    (lambda: jaxpar.set_algo_parameters(fully_use_devices=True), False),
    (lambda: jaxpar.set_context(mode=jaxpar.GRAPH_MODE), False),
    (jaxpar.reset_algo_parameters, False),
], ids=["mesh", "device_num", "algo", "pynative", "reset", "same-options", "same-algo",
        "same-mode", "reset-algo"])
def test_every_change_of_the_context_is_seen_by_the_hot_check(full_calls, change, full_path):
    """A call like the last one skips every Python check of jaxpar's context while nothing has
    changed it; after a change (any setter, even to the same values) the context itself is
    compared: another one takes the full path (its own plan, or PyNative), the same one goes on
    straight to the program and the hot check is back."""
    jaxpar.set_auto_parallel_context(parallel_mode="data_parallel")
    f = _data_parallel()
    x = f(jnp.arange(8.0))  # the full path: placed over the 8 devices
    assert full_calls[0] == 1 and _hot(f)
    np.testing.assert_array_equal(f(x), np.arange(8.0) * 4)
    assert full_calls[0] == 1 and _hot(f)
    change()
    assert not _hot(f)
    np.testing.assert_array_equal(f(x), np.arange(8.0) * 4)
    assert full_calls[0] == (2 if full_path else 1)
    assert _hot(f) == (jaxpar.get_context("mode") == jaxpar.GRAPH_MODE)  # PyNative: eager


def test_a_with_block_of_another_thread_is_its_own_context(full_calls):
    """The hot check is the thread's too: a with-block holds for its thread only, so a call
    from another thread is compared with the context it was planned in, even where nothing
    changed in between (the other thread's with-block was entered before the last call)."""
    jaxpar.set_auto_parallel_context(parallel_mode="data_parallel")
    f = _data_parallel()
    other = jaxpar.make_mesh((2, 4), ("a", "b"))
    inside, called, done = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def worker():
        with jaxpar.auto_parallel_context(mesh=other):
            inside.set()
            called.wait(60)
            got["out"] = f(got["x"])  # nothing changed since this thread's last full call
        done.set()

    thread = threading.Thread(target=worker)
    thread.start()
    assert inside.wait(60)
    got["x"] = x = f(jnp.arange(8.0))  # the full path, in this thread's context
    np.testing.assert_array_equal(f(x), np.arange(8.0) * 4)
    assert full_calls[0] == 1 and _hot(f)
    called.set()
    assert done.wait(120)
    thread.join()
    assert full_calls[0] == 2  # the other thread's context: its own plan, on its mesh
    assert got["out"].sharding.mesh.axis_names == ("a", "b")
    np.testing.assert_array_equal(got["out"], np.arange(8.0) * 4)


def test_only_a_trace_under_the_fast_path_is_refused():
    """``refuse_fast_trace`` raises where the trace runs under the fast path's call (the stack
    is walked, nothing is set per call), and nowhere else: the full path, ``.lower`` and a call
    of the jitted function itself trace as they would."""
    from jaxpar._src.context import CHANGES, algo_parameters, current_context
    from jaxpar._src.dispatch import MISS, FastPath, refuse_fast_trace

    refuse_fast_trace()  # outside: nothing
    traced = []

    def step(x):
        refuse_fast_trace()
        traced.append(x.shape)
        return x + 1

    jitted = jax.jit(step)
    fast = FastPath()
    fast.remember(CHANGES.count, current_context(), algo_parameters(), jitted)
    assert fast.call((jnp.ones(4),)) is MISS and fast._misses == 1  # traced under it
    np.testing.assert_array_equal(jitted(jnp.ones(4)), np.full(4, 2.0))  # not under it
    fast = FastPath()
    fast.remember(CHANGES.count, current_context(), algo_parameters(), jitted)
    np.testing.assert_array_equal(fast.call((jnp.ones(4),)), np.full(4, 2.0))  # jit's hit
    assert traced == [(4,)] and fast._misses == 0


def test_a_loaded_executable_without_static_arguments_is_called_straight(cache_dir):
    """With an executable loaded from the plan cache, the fast path calls JAX's C++ dispatch of
    it itself (no static arguments for ``Loaded`` to check); with static arguments, ``Loaded``,
    which compares them."""
    from jaxpar._src.executable_cache import LOADED_NOTE

    mesh = jaxpar.make_mesh((8,), ("d",))

    def make(static):
        fn = (lambda x, n: x * n) if static else (lambda x: x * 3)
        return jaxpar.parallelize(fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8,),), static_argnums=(1,) if static else ())

    x = jnp.arange(16.0)
    for static, args in ((False, (x,)), (True, (x, 3))):
        make(static)(*args)
        again = make(static)
        y = again(*args)
        entry = again.compiled_entry(*args)
        assert LOADED_NOTE in entry.plan.notes[-1]
        runner = again._fast._hot[2]
        assert runner is (entry.loaded if static else entry.loaded.run)
        np.testing.assert_array_equal(again(y, *args[1:]), np.arange(16.0) * 9)
        assert again(jnp.arange(8.0), *args[1:]).shape == (8,)  # another shape: refused, planned
