"""Executables in the plan cache (executable_cache.py): a second parallelize of the same program
with the same cache directory (a new callable: nothing in memory, as in a second process) loads
the compiled program and runs it without lowering or compiling; same numbers and collectives.
A bad file warns once and is replaced; a change that alters the executable but not the plan
(donate_argnums) does not reuse it; a call jax.jit would trace anew is not served by it."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar._src import api, cached_build
from jaxpar._src.executable_cache import LOADED_NOTE, flush


@pytest.fixture
def lowerings(monkeypatch):
    """How many times jaxpar built a program to lower (its evaluator of the plan) and how many
    times XLA compiled one."""
    count = {"evaluator": 0, "compile": 0}
    original = api.make_evaluator

    def counted(*args, **kwargs):
        count["evaluator"] += 1
        return original(*args, **kwargs)

    def compiled(event, *_, **__):
        if event == "/jax/core/compile/backend_compile_duration":
            count["compile"] += 1

    monkeypatch.setattr(api, "make_evaluator", counted)
    jax.monitoring.register_event_duration_secs_listener(compiled)
    yield count
    jax.monitoring.unregister_event_duration_listener(compiled)


def _mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def _args():
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    return (jax.random.normal(k1, (16, 32)), jax.random.normal(k2, (32, 64)) / 8,
            jax.random.normal(k3, (64, 16)) / 8)


def _auto(mesh, **kwargs):
    return jaxpar.parallelize(_mlp, mesh=mesh, parallel_mode="auto_parallel", batch_argnums=0,
                              **kwargs)


def _executables(directory):
    flush()  # the background write of the last first call
    return sorted(p for p in os.listdir(directory) if p.endswith(".xla"))


def test_a_second_parallelize_runs_the_stored_executable_without_lowering(cache_dir, lowerings):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    single = np.asarray(_mlp(*args))
    first = _auto(mesh)
    entry = first.compiled_entry(*args)  # traced and planned
    args = tuple(jax.device_put(a, s) for a, s in zip(args, entry.in_shardings, strict=True))
    lowerings.update(evaluator=0, compile=0)
    want = first(*args)
    assert lowerings == {"evaluator": 1, "compile": 1}  # stored: compiled once, not twice
    assert len(_executables(cache_dir)) == 1
    theirs = jaxpar.inspect.collectives(first.lower(*args))
    assert lowerings["evaluator"] == 1  # the call's jitted function, lowered again
    lowerings.update(evaluator=0, compile=0)

    again = _auto(mesh)  # a new callable: what a second process has
    got = again(*args)
    assert LOADED_NOTE in again.plan(*args).notes[-1]
    assert lowerings == {"evaluator": 0, "compile": 0}  # nothing lowered, nothing compiled
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(np.asarray(got), single, rtol=1e-5, atol=1e-5)
    assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
    loaded = again.compiled_entry(*args).loaded
    ours = jaxpar.inspect.collectives(loaded.compiled, mesh)
    assert ours.by_kind() == theirs.by_kind()
    again(*args)  # the fast path runs the loaded executable too
    assert lowerings == {"evaluator": 0, "compile": 0}
    # .lower() still works: the jitted function is built and lowered when asked for
    lowered = again.lower(*args)
    assert lowerings["evaluator"] == 1
    assert jaxpar.inspect.collectives(lowered).by_kind() == theirs.by_kind()


def _flipped(data, start, n=64):
    """``data`` with ``n`` bytes from ``start`` inverted (a disk or copy error)."""
    return data[:start] + bytes(b ^ 0xFF for b in data[start:start + n]) + data[start + n:]


@pytest.mark.parametrize("corrupt", [
    lambda data: data[:len(data) // 2],  # truncated: a header, half an executable
    lambda data: _flipped(data, len(data) // 2),  # bytes changed inside XLA's program
    lambda data: _flipped(data, len(data) - 200),  # ... near its end
    lambda data: _flipped(data, len(data) * 2 // 3, n=1),  # one byte
    lambda data: data + b"\0" * 16,  # more than was written
], ids=["truncated", "flipped-middle", "flipped-end", "one-byte", "appended"])
def test_a_corrupt_executable_warns_once_and_is_compiled_and_replaced(cache_dir, lowerings,
                                                                     corrupt):
    """A file whose payload is not the bytes written (a flipped byte may still deserialize,
    into another program: it ran and gave other numbers) is refused before XLA reads it."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    want = _auto(mesh)(*args)
    (name,) = _executables(cache_dir)
    path = cache_dir / name
    data = path.read_bytes()
    path.write_bytes(corrupt(data))
    bad = path.read_bytes()
    lowerings.update(evaluator=0, compile=0)
    with pytest.warns(jaxpar.JaxparWarning, match="ignoring the executable") as caught:
        got = _auto(mesh)(*args)
    assert len([w for w in caught if issubclass(w.category, jaxpar.JaxparWarning)]) == 1
    assert lowerings["evaluator"] == 1  # the normal path: lowered and compiled
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    flush()  # the background write of the new executable
    assert path.read_bytes() != bad  # replaced by a good one
    lowerings.update(evaluator=0, compile=0)
    np.testing.assert_array_equal(np.asarray(_auto(mesh)(*args)), np.asarray(want))
    assert lowerings == {"evaluator": 0, "compile": 0}


def _update(w, g):
    return w - 0.1 * jnp.tanh(g)


def test_other_donate_argnums_do_not_reuse_the_executable(cache_dir, lowerings):
    mesh = jaxpar.make_mesh((8,), ("d",))

    def make(**kwargs):
        return jaxpar.parallelize(_update, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8, 1), (8, 1)), **kwargs)

    w, g = jnp.ones((16, 4)), jnp.full((16, 4), 0.5)
    want = np.asarray(make()(w, g))
    donating = make(donate_argnums=0)
    sharding = donating.compiled_entry(w, g).in_shardings[0]
    lowerings.update(evaluator=0, compile=0)
    donating(jax.device_put(w, sharding), g)
    assert LOADED_NOTE not in donating.plan(w, g).notes[-1]  # only the plan reused
    assert lowerings["evaluator"] == 1 and len(_executables(cache_dir)) == 2
    # ... and the executable that donates, loaded in turn, donates
    loaded = make(donate_argnums=0)
    x = jax.device_put(w, sharding)
    np.testing.assert_array_equal(np.asarray(loaded(x, g)), want)
    assert LOADED_NOTE in loaded.plan(w, g).notes[-1]
    assert x.is_deleted()


def test_a_call_jit_would_trace_anew_is_not_served_by_the_loaded_executable(cache_dir):
    mesh = jaxpar.make_mesh((8,), ("d",))

    def scale(x, s):
        return x * s  # bfloat16 with a weakly typed s, float32 with a float32 one

    def make():
        return jaxpar.parallelize(scale, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8,), ()))

    x = jnp.ones(16, jnp.bfloat16)
    make()(x, jnp.float32(2))
    again = make()
    assert again(x, jnp.float32(2)).dtype == jnp.float32  # loaded, then on the fast path
    assert LOADED_NOTE in again.plan(x, jnp.float32(2)).notes[-1]
    assert again(x, 2.0).dtype == jnp.bfloat16 == jax.jit(scale)(x, 2.0).dtype
    assert again(x, jnp.float32(3)).dtype == jnp.float32


def test_a_mesh_of_some_devices_runs_on_them(cache_dir):
    mesh = jaxpar.make_mesh((2,), ("d",), devices=jax.devices()[4:6])

    def make():
        return jaxpar.parallelize(_update, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((2, 1), (1, 1)))

    w, g = jnp.ones((16, 4)), jnp.full((16, 4), 0.5)
    want = np.asarray(make()(w, g))
    again = make()
    got = again(w, g)
    assert LOADED_NOTE in again.plan(w, g).notes[-1]
    np.testing.assert_array_equal(np.asarray(got), want)
    assert {d.id for d in got.sharding.device_set} == {4, 5}


def test_a_loaded_executable_serves_only_its_static_values(cache_dir):
    mesh = jaxpar.make_mesh((8,), ("d",))

    def power(x, n):
        return x ** n

    def make():
        return jaxpar.parallelize(power, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8,),), static_argnums=1)

    x = jnp.arange(16.0)
    make()(x, 2)
    again = make()
    np.testing.assert_array_equal(np.asarray(again(x, 2)), np.asarray(x) ** 2)
    assert LOADED_NOTE in again.plan(x, 2).notes[-1]
    np.testing.assert_array_equal(np.asarray(again(x, 2)), np.asarray(x) ** 2)  # fast path
    np.testing.assert_array_equal(np.asarray(again(x, 3)), np.asarray(x) ** 3)
    np.testing.assert_array_equal(np.asarray(again(x, 2.0)), np.asarray(x) ** 2)
    assert again.plan(x, 2.0).input_layouts() == again.plan(x, 2).input_layouts()


@pytest.mark.parametrize("cpp", [True, False], ids=["jax-cpp-dispatch", "python-checks"])
def test_the_loaded_fast_path_checks_only_calls_jax_dispatch_has_not_seen(cache_dir,
                                                                          monkeypatch, cpp):
    """The loaded executable runs through JAX's C++ dispatch: a call like the last one is not
    flattened and checked in Python again; another tree, weak type, shape, dtype, static value
    or JAX configuration is refused (Retrace: the full path plans it) as jax.jit would retrace
    it, and tracers go to the jitted function.  The same where the C++ dispatch is not
    available (another JAX): every call checked in Python."""
    from jaxpar._src import executable_cache
    from jaxpar._src.dispatch import Retrace
    from jaxpar._src.executable_cache import Loaded

    mesh = jaxpar.make_mesh((8,), ("d",))

    def scale(x, s, n):
        return x * s * n

    def make():
        return jaxpar.parallelize(scale, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8,), ()), static_argnums=2)

    x, s = jnp.ones(16), jnp.float32(2)
    make()(x, s, 3)
    checks = []
    original = Loaded._check

    def counted(self, *args):
        checks.append(1)
        return original(self, *args)

    monkeypatch.setattr(Loaded, "_check", counted)  # before the Loaded takes its bound method
    if not cpp:
        monkeypatch.setattr(executable_cache, "checked_cpp_call", lambda *a: None)
    entry = make().compiled_entry(x, s, 3)
    fast = entry.loaded
    assert fast is not None and (fast.run != fast._checked) == cpp
    x = jax.device_put(x, entry.in_shardings[0])
    np.testing.assert_array_equal(np.asarray(fast(x, s, 3)), np.full(16, 6.0))
    np.testing.assert_array_equal(np.asarray(fast(x, jnp.float32(4), 3)), np.full(16, 12.0))
    assert len(checks) == (1 if cpp else 2)  # with C++ dispatch the second call is its hit
    refused = [(x, 2.0, 3),  # a weakly typed scalar
               ((x,), s, 3),  # another tree
               (jnp.ones(8), s, 3),  # another shape
               (x.astype(jnp.bfloat16), s, 3),  # another dtype
               (x, s, 4)]  # another static value
    for args in refused:
        with pytest.raises(Retrace):
            fast(*args)
    with jax.default_matmul_precision("highest"), pytest.raises(Retrace):
        fast(x, s, 3)  # another JAX configuration: jax.jit traces anew in it too
    # tracers (inside another transformation) go to the jitted function
    grad = jax.grad(lambda v: fast(v, s, 3).sum())(x)
    np.testing.assert_array_equal(np.asarray(grad), np.full(16, 6.0))


def test_the_executable_is_written_in_the_background_and_a_second_process_loads_it(cache_dir):
    """A script whose only call is the first exits after its background write: the next
    process loads the executable."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import jax
        jax.config.update("jax_num_cpu_devices", 8)  # as conftest.py: part of the key
        import jaxpar
        from tests.test_executable_cache import _args, _auto
        jaxpar.config.update("plan_cache_dir", {str(cache_dir)!r})
        _auto(jaxpar.make_mesh((2, 4), ("dp", "mp")))(*_args())  # and the process exits
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(jaxpar.__file__)),
               XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    assert len(_executables(cache_dir)) == 1
    assert not [p for p in os.listdir(cache_dir) if p.endswith(".tmp")]
    # The next process: a fresh one too (this test worker's process has run other tests,
    # whose leftovers could key the plan otherwise), which says what it ran.
    again = textwrap.dedent(f"""
        import jax
        jax.config.update("jax_num_cpu_devices", 8)
        import numpy as np
        import jaxpar
        from jaxpar._src import prefetch
        from tests.test_executable_cache import _args, _auto, _mlp
        taken, take = [], prefetch.Prefetch.take
        def counted(*a):
            got = take(*a)
            taken.append(got is not None)
            return got
        prefetch.Prefetch.take = counted
        jaxpar.config.update("plan_cache_dir", {str(cache_dir)!r})
        again, args = _auto(jaxpar.make_mesh((2, 4), ("dp", "mp"))), _args()
        err = float(np.max(np.abs(np.asarray(again(*args)) - np.asarray(_mlp(*args)))))
        print(repr((err, again.plan(*args).notes, taken)))
    """)
    out = subprocess.run([sys.executable, "-c", again], check=True, env=env, timeout=300,
                         capture_output=True, text=True).stdout
    err, notes, taken = eval(out.strip().splitlines()[-1])  # noqa: S307 - our own repr
    assert err < 1e-5, err
    assert notes and LOADED_NOTE in notes[-1], notes
    assert taken[:1] == [True], taken  # read ahead of the trace: the pre-key is the same


def test_the_executable_is_serialized_only_once_the_step_is_done(cache_dir, monkeypatch):
    """The background writer waits for the call's outputs before it serializes: beside the
    running step the serialization took three times as long and held the GIL the caller needed
    to return (``executable_cache.store_in_background``)."""
    import threading

    from jaxpar._src import executable_cache

    class Output:  # a step still running until ``done`` is set
        def __init__(self) -> None:
            self.done = threading.Event()

        def block_until_ready(self) -> "Output":
            self.done.wait(timeout=60)
            return self

    seen = []
    monkeypatch.setattr(executable_cache, "store_executable",
                        lambda *a, **k: seen.append(out.done.is_set()))
    out = Output()
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile()
    key = executable_cache.ExecutableKey("ab" * 32, "cd" * 32, {})
    executable_cache.store_in_background(str(cache_dir), key, compiled, api="f", after=out)
    threading.Event().wait(0.2)
    assert seen == []  # not while the step runs
    out.done.set()
    flush()
    assert seen == [True]
    # an output deleted meanwhile (donated to the next step) counts as done
    gone = jnp.ones(4)
    gone.delete()
    executable_cache.store_in_background(str(cache_dir), key, compiled, api="f", after=gone)
    flush()
    assert seen == [True, True]


def test_a_kept_executable_is_not_also_written_to_jax_compilation_cache(cache_dir, tmp_path):
    """With JAX's persistent compilation cache on too, the program whose executable the plan
    cache keeps is not serialized into JAX's cache a second time (a later process loads it
    from the plan cache and never asks JAX's); other programs of the process still are."""
    import subprocess
    import sys
    import textwrap

    jax_dir = tmp_path / "jax-cache"
    script = textwrap.dedent(f"""
        import jax, jax.numpy as jnp
        jax.config.update("jax_num_cpu_devices", 8)
        jax.config.update("jax_compilation_cache_dir", {str(jax_dir)!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        import jaxpar
        from tests.test_executable_cache import _args, _auto
        jaxpar.config.update("plan_cache_dir", {str(cache_dir)!r})
        args = _args()
        _auto(jaxpar.make_mesh((2, 4), ("dp", "mp")))(*args)
        def other(x):
            return jnp.sin(x) * 3
        jax.jit(other)(args[0])
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(jaxpar.__file__)),
               XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=300)
    assert len(_executables(cache_dir)) == 1  # kept in the plan cache
    written = [p for p in os.listdir(jax_dir) if p.endswith("-cache")]
    assert any(p.startswith("jit_other") for p in written), written  # JAX's cache works
    assert not any(p.startswith("jit__mlp") for p in written), written  # not a second copy


def test_old_executables_of_a_plan_are_pruned(cache_dir, monkeypatch):
    """Each LIBTPU_INIT_ARGS (part of the executable's key, not the plan's) adds an executable
    beside the same plan entry; only the KEEP_PER_PLAN most recent stay, the newest loads."""
    from jaxpar._src import executable_cache

    monkeypatch.setattr(executable_cache, "KEEP_PER_PLAN", 2)
    mesh = jaxpar.make_mesh((8,), ("d",))
    args = (jnp.ones((16, 4)), jnp.full((16, 4), 0.5))

    def make():
        return jaxpar.parallelize(_update, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8, 1), (8, 1)))

    made = []
    for i in range(4):
        monkeypatch.setenv("LIBTPU_INIT_ARGS", f"--jaxpar_test_{i}")
        make()(*args)
        made.append(_executables(cache_dir))
    assert [len(m) for m in made] == [1, 2, 2, 2]
    assert len({p.split(".")[0] for p in made[-1]}) == 1  # one plan entry
    written = [(set(m) - set().union(*made[:i])).pop() for i, m in enumerate(made)]
    assert set(made[-1]) == set(written[-2:])  # the two most recent
    again = make()
    again(*args)  # the newest (LIBTPU_INIT_ARGS as now) is kept and loads
    assert LOADED_NOTE in again.plan(*args).notes[-1]
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--jaxpar_test_0")  # pruned: compiled again
    first = make()
    first(*args)
    assert LOADED_NOTE not in first.plan(*args).notes[-1]


def test_prune_keeps_the_most_recent_and_removes_a_killed_writers_old_temporary(tmp_path):
    from jaxpar._src.executable_cache import prune

    names = [f"plan.{i}.xla" for i in range(6)] + ["other.0.xla", ".plan.5.xla.abc.tmp",
                                                    ".plan.6.xla.def.tmp"]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1000 + i, 1000 + i))  # written in this order, long ago
    os.utime(tmp_path / ".plan.6.xla.def.tmp")  # being written now
    gone = prune(str(tmp_path), "plan", keep=2)
    assert sorted(os.path.basename(p) for p in gone) == sorted(
        [f"plan.{i}.xla" for i in range(4)] + [".plan.5.xla.abc.tmp"])
    assert sorted(os.listdir(tmp_path)) == sorted(
        ["plan.4.xla", "plan.5.xla", "other.0.xla", ".plan.6.xla.def.tmp"])


# -- read ahead of the trace (prefetch.py) ----------------------------------------------------
@pytest.fixture
def taken(monkeypatch):
    """What each read-ahead executable became: True (used), False (dropped after the trace)."""
    from jaxpar._src import prefetch

    seen = []
    original = prefetch.Prefetch.take

    def take(self, *args, **kwargs):
        got = original(self, *args, **kwargs)
        seen.append(got is not None)
        return got

    monkeypatch.setattr(prefetch.Prefetch, "take", take)
    return seen


def _scaled(scale):
    def f(x, w1, w2):  # one code object, one qualified name: one pre-key for every scale
        return jnp.tanh(x @ w1) @ w2 * scale
    return f


def test_the_executable_read_ahead_is_used_only_on_its_full_key(cache_dir, lowerings, taken,
                                                                 monkeypatch):
    """The executable the index names is read while the program is traced and used only when
    the full keys are its own: another program with the same pre-key (another closed-over
    scale) or another executable key (LIBTPU_INIT_ARGS) runs its own, right, numbers."""
    from jaxpar._src.prefetch import pre_key

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()

    def make(scale):
        return jaxpar.parallelize(_scaled(scale), mesh=mesh, parallel_mode="auto_parallel",
                                  batch_argnums=0)

    two, three = make(2.0), make(3.0)
    pre = [pre_key(p._info.fn, p.compiled_entry(*args).program and
                   _signature(p, args), p.compiled_entry(*args).settings, p._info)
           for p in (two, three)]
    assert pre[0] == pre[1]
    want = {s: np.asarray(_scaled(s)(*args)) for s in (2.0, 3.0)}
    np.testing.assert_allclose(np.asarray(two(*args)), want[2.0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(three(*args)), want[3.0], rtol=1e-5, atol=1e-5)
    assert len(_executables(cache_dir)) == 2 and taken == []  # each index written anew
    # the index names 3.0's executable (the last one): read ahead for 2.0, and dropped
    again = make(2.0)
    lowerings.update(evaluator=0, compile=0)
    np.testing.assert_allclose(np.asarray(again(*args)), want[2.0], rtol=1e-5, atol=1e-5)
    assert taken == [False] and LOADED_NOTE in again.plan(*args).notes[-1]
    assert lowerings == {"evaluator": 0, "compile": 0}  # 2.0's own, loaded after the trace
    # now the index names 2.0's: read ahead and used
    again = make(2.0)
    np.testing.assert_allclose(np.asarray(again(*args)), want[2.0], rtol=1e-5, atol=1e-5)
    assert taken == [False, True] and LOADED_NOTE in again.plan(*args).notes[-1]
    # another executable key, the same pre-key and plan: compiled, not the one read ahead
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--jaxpar_test_other")
    other = make(2.0)
    np.testing.assert_allclose(np.asarray(other(*args)), want[2.0], rtol=1e-5, atol=1e-5)
    assert taken == [False, True, False] and lowerings["compile"] == 1
    assert LOADED_NOTE not in other.plan(*args).notes[-1]


def _signature(p, args):
    from jaxpar._src.cache_key import call_key

    return call_key(args, p._info.static_argnums, api="f")


def test_an_executable_file_with_another_key_is_not_used_when_read_ahead(cache_dir, taken):
    """The file the index names, at the full key's name, but holding another program's
    executable (its stored key another): dropped, and the load after it warns and compiles."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()

    def make(scale):
        return jaxpar.parallelize(_scaled(scale), mesh=mesh, parallel_mode="auto_parallel",
                                  batch_argnums=0)

    make(3.0)(*args)
    (three,) = _executables(cache_dir)
    make(2.0)(*args)
    (two,) = set(_executables(cache_dir)) - {three}
    (cache_dir / two).write_bytes((cache_dir / three).read_bytes())  # 3.0's, named 2.0's
    again = make(2.0)
    with pytest.warns(jaxpar.JaxparWarning, match="its key is not the key its name"):
        got = again(*args)
    assert taken == [False] and LOADED_NOTE not in again.plan(*args).notes[-1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(_scaled(2.0)(*args)), rtol=1e-5,
                               atol=1e-5)


def test_read_ahead_under_thread_local_jax_configuration(cache_dir, taken):
    """jax.enable_x64 and jax.transfer_guard hold for the calling thread only: the thread that
    reads ahead reads none of JAX's configuration (XLA deserializes; the rest of the file is
    read in the calling thread), so a float64 program stored and loaded under enable_x64 runs
    in float64; a transfer guard of the calling thread is part of the executable's full key
    (a jax.config value): the executable read ahead without it is not used under it."""
    mesh = jaxpar.make_mesh((8,), ("d",))

    def make():
        return jaxpar.parallelize(_update, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8, 1), (8, 1)))

    with jax.enable_x64(True):
        w, g = jnp.ones((16, 4), jnp.float64), jnp.full((16, 4), 0.5, jnp.float64)
        want = np.asarray(_update(w, g))
        assert want.dtype == np.float64
        make()(w, g)
        flush()  # the executable written (in the background), as the next process finds it
        again = make()
        entry = again.compiled_entry(w, g)  # traced, plan and executable loaded
        assert taken == [True] and entry.loaded is not None
        got = again(w, g)
        assert got.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(got), want)
        with jax.transfer_guard("disallow"):
            guarded = make().compiled_entry(w, g)
        assert taken == [True, False] and guarded.loaded is None  # another key: compiled
    w, g = jnp.ones((16, 4)), jnp.full((16, 4), 0.5)  # without x64: float32's executable
    without = make()
    np.testing.assert_array_equal(np.asarray(without(w, g)), np.asarray(_update(w, g)))
    assert not any(LOADED_NOTE in n for n in without.plan(w, g).notes)
    assert taken == [True, False]  # another pre-key (the trace context): nothing read ahead


def test_a_corrupt_index_warns_and_is_rewritten(cache_dir, taken):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    want = np.asarray(_auto(mesh)(*args))
    flush()  # the index is written with the executable, in the background
    (index,) = [p for p in os.listdir(cache_dir) if p.endswith(".last")]
    (cache_dir / index).write_text('{"format": "jaxpar.prefetch/1", "executable": "../x.xla"}')
    again = _auto(mesh)
    with pytest.warns(jaxpar.JaxparWarning, match="ignoring the plan cache's index"):
        got = again(*args)
    assert taken == [] and LOADED_NOTE in again.plan(*args).notes[-1]  # loaded after the trace
    np.testing.assert_array_equal(np.asarray(got), want)
    (cache_dir / index).write_text("{not json")
    with pytest.warns(jaxpar.JaxparWarning, match="ignoring the plan cache's index"):
        _auto(mesh)(*args)
    _auto(mesh)(*args)  # rewritten: read ahead and used
    assert taken == [True]


def _indexes(directory):
    """``{index file: the executable it names}``."""
    flush()
    return {p: json.loads((directory / p).read_text())["executable"]
            for p in os.listdir(directory) if p.endswith(".last")}


def test_an_index_is_written_with_its_executable_not_by_plan(cache_dir, taken):
    """``.plan()`` compiles nothing: it writes no index naming an executable that is not in the
    plan cache (the next process would read ahead for nothing).  The call that stores the
    executable writes the index after it; a ``.plan()`` that loads it (a hit) names it too."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    first = _auto(mesh)
    first.plan(*args)
    assert _indexes(cache_dir) == {} and _executables(cache_dir) == []
    first(*args)
    (exe,) = _executables(cache_dir)
    assert list(_indexes(cache_dir).values()) == [exe]
    (index,) = _indexes(cache_dir)
    os.unlink(cache_dir / index)
    assert LOADED_NOTE in _auto(mesh).plan(*args).notes[-1]  # loaded: in the plan cache
    assert _indexes(cache_dir) == {index: exe} and taken == []
    _auto(mesh)(*args)  # read ahead from that index, and used
    assert taken == [True]


def test_pruning_an_executable_deletes_the_index_naming_it(cache_dir, monkeypatch):
    """donate_argnums keys the executable and the pre-key, not the plan: two indexes, two
    executables beside one plan entry.  Keeping one executable per plan, the second's write
    prunes the first, and the index naming it with it (read ahead, it named nothing)."""
    from jaxpar._src import executable_cache

    monkeypatch.setattr(executable_cache, "KEEP_PER_PLAN", 1)
    mesh = jaxpar.make_mesh((8,), ("d",))

    def make(**kwargs):
        return jaxpar.parallelize(_update, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8, 1), (8, 1)), **kwargs)

    w, g = jnp.ones((16, 4)), jnp.full((16, 4), 0.5)
    make()(w, g)
    (first,) = _executables(cache_dir)
    assert list(_indexes(cache_dir).values()) == [first]
    donating = make(donate_argnums=0)
    donating(jax.device_put(w, donating.compiled_entry(w, g).in_shardings[0]), g)
    (second,) = _executables(cache_dir)
    assert second != first and list(_indexes(cache_dir).values()) == [second]


def test_prune_deletes_the_indexes_of_executables_not_there(tmp_path):
    """Indexes naming an executable pruned now or gone before are deleted; one naming an
    executable kept, and files that are not an index prune can read, stay."""
    from jaxpar._src.executable_cache import prune
    from jaxpar._src.prefetch import INDEX_FORMAT

    plan, other = "a" * 64, "b" * 64
    exes = [f"{plan}.{str(i) * 64}.xla" for i in range(3)]
    for i, name in enumerate(exes):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (1000 + i, 1000 + i))  # 0 the oldest
    names = {"old.last": exes[0], "kept.last": exes[2],
             "missing.last": f"{other}.{'c' * 64}.xla"}
    for index, name in names.items():
        (tmp_path / index).write_text(json.dumps({"format": INDEX_FORMAT, "executable": name}))
    (tmp_path / "corrupt.last").write_text("{not json")
    (tmp_path / "null.last").write_text("null")
    gone = prune(str(tmp_path), plan, keep=2)
    assert sorted(os.path.basename(p) for p in gone) == sorted(
        [exes[0], "old.last", "missing.last"])
    assert sorted(os.listdir(tmp_path)) == sorted(
        exes[1:] + ["kept.last", "corrupt.last", "null.last"])


def test_nothing_is_read_ahead_for_more_than_one_process(cache_dir, monkeypatch):
    """Under jax.distributed (storable() false) executables are neither kept nor loaded: none
    is read ahead either, though the index names one."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    want = np.asarray(_auto(mesh)(*args))
    flush()
    started = []
    monkeypatch.setattr(cached_build, "storable", lambda: False)
    monkeypatch.setattr(cached_build, "Prefetch", lambda *a: started.append(a))
    again = _auto(mesh)
    np.testing.assert_array_equal(np.asarray(again(*args)), want)
    assert started == [] and LOADED_NOTE not in again.plan(*args).notes[-1]
