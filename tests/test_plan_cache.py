"""The persistent plan cache (jaxpar.config.plan_cache_dir): a hit skips the search and gives
the same layouts and numbers; any change of the key misses; a bad entry warns and is replaced."""

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar._src import api
from jaxpar._src.executable_cache import flush
from jaxpar._src.plan_cache import HIT_NOTE


@pytest.fixture
def searches(monkeypatch):
    """How many times a search ran."""
    count = [0]
    original = api.decide

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "decide", counted)
    return count


def _plans(directory):
    """The plan entries (the executables beside them are executable_cache.py's)."""
    return [n for n in os.listdir(directory) if n.endswith(".json")]


def _mlp(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


def _args(batch=16):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(k1, (batch, 32)), jax.random.normal(k2, (32, 64)) / 8,
            jax.random.normal(k3, (64, 16)) / 8)


def _auto(mesh, mode="auto_parallel"):
    return jaxpar.parallelize(_mlp, mesh=mesh, parallel_mode=mode, batch_argnums=0)


def _specs(plan):
    return [(d.in_specs, d.out_specs) for d in plan.decisions]


def test_a_second_parallelize_of_the_same_program_skips_the_search(cache_dir, searches):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    first = _auto(mesh)
    want = first(*args)
    assert searches[0] == 1 and len(_plans(cache_dir)) == 1
    again = _auto(mesh)  # a new function object, as in a second run of the script
    got = again(*args)
    assert searches[0] == 1  # the search did not run
    plan = again.plan(*args)
    assert plan.notes[-1].startswith(HIT_NOTE)
    assert _specs(plan) == _specs(first.plan(*args))
    assert plan.input_layouts() == first.plan(*args).input_layouts()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got, jax.jit(_mlp)(*args), rtol=1e-5, atol=1e-6)
    assert not [n for n in os.listdir(cache_dir) if n.endswith(".tmp")]  # renamed into place


def test_a_change_of_mesh_mode_or_shape_misses(cache_dir, searches):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    _auto(mesh).plan(*_args())
    _auto(jaxpar.make_mesh((4, 2), ("dp", "mp"))).plan(*_args())  # other axis sizes
    _auto(mesh, "data_parallel").plan(*_args())  # another mode
    _auto(mesh).plan(*_args(batch=32))  # another shape
    with jaxpar.auto_parallel_context(search_mode="dynamic_programming"):
        _auto(mesh).plan(*_args())  # another search
    _auto(mesh).plan(*_args())  # the first again: a hit
    assert searches[0] == 5 and len(_plans(cache_dir)) == 5


def test_a_corrupt_entry_warns_once_and_is_replaced(cache_dir, searches):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    want = _auto(mesh).plan(*_args())
    (entry,) = [e for e in cache_dir.iterdir() if e.suffix == ".json"]  # (and an index)
    entry.write_text(entry.read_text()[:1000])  # cut short, as by a crash before the rename
    with pytest.warns(jaxpar.JaxparWarning, match="ignoring the plan cache entry.*not JSON"):
        plan = _auto(mesh).plan(*_args())
    assert searches[0] == 2 and _specs(plan) == _specs(want)
    plan = _auto(mesh).plan(*_args())  # the new entry reads back, with no warning
    assert searches[0] == 2 and plan.notes[-1].startswith(HIT_NOTE)


def test_an_unwritable_cache_warns_and_the_run_goes_on(tmp_path, searches):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    before = jaxpar.config.plan_cache_dir
    jaxpar.config.plan_cache_dir = str(blocked)
    try:
        with pytest.warns(jaxpar.JaxparWarning, match="cannot write to the plan cache"):
            plan = _auto(jaxpar.make_mesh((2, 4), ("dp", "mp"))).plan(*_args())
    finally:
        jaxpar.config.plan_cache_dir = before
    assert plan.decisions and searches[0] == 1


def test_config_rejects_what_it_does_not_know():
    with pytest.raises(jaxpar.ContextError, match="unknown option 'plan_dir'"):
        jaxpar.config.update("plan_dir", "/tmp")
    with pytest.raises(jaxpar.ContextError, match="plan_cache_dir must be a directory path"):
        jaxpar.config.plan_cache_dir = 3


def _digest(fn, *args):
    from jaxpar._src.plan_cache import program_digest
    from jaxpar._src.trace import trace

    program = trace(fn, args)
    return program_digest(program.graph, program.in_tree, program.out_tree)


_X = jax.ShapeDtypeStruct((8, 16), jnp.float32)
_I = jax.ShapeDtypeStruct((8, 16), jnp.int32)


@pytest.mark.parametrize("first, second, args", [
    (lambda x: jnp.sum(x, axis=0), lambda x: jnp.sum(x, axis=1), (_X,)),  # a parameter
    (lambda x: x * 2.0, lambda x: x * 3.0, (_X,)),  # a scalar literal's value
    (lambda x: x * 2, lambda x: x * 3, (_I,)),  # an integer literal's value
    (lambda x: x.astype(jnp.bfloat16), lambda x: x.astype(jnp.float16), (_X,)),  # a dtype
    (lambda x: jnp.tanh(x), lambda x: jnp.sin(x), (_X,)),  # the operator
    (lambda x: x @ x.T, lambda x: jax.lax.dot(x, x.T, precision="highest"), (_X,)),
])
def test_the_program_digest_changes_with_what_the_program_does(first, second, args):
    """The plan cache keys on a digest of every node's operator, operands, result types and
    equation parameters (written in one pass: issue 14): any change of them changes it, and the
    same program traced again has the same digest."""
    assert _digest(first, *args) == _digest(first, *args)
    assert _digest(first, *args) != _digest(second, *args)


def _closing(value, where="top"):
    """A function closing over an array constant ``value`` (jax.jit bakes its value into the
    trace): at the top level, in a nested jit, in a scan body, or a PRNG key."""
    c = np.full((8, 16), value, np.float32)
    if where == "top":
        return lambda x: jnp.tanh(x) + c
    if where == "jit":
        return lambda x: jax.jit(lambda y: y * c)(x)
    if where == "key":  # a typed PRNG key (an extended dtype): its data
        key = jax.random.key(int(value))
        return lambda x: x + jax.random.normal(key, x.shape)
    return lambda x: jax.lax.scan(lambda h, _: (h * c, None), x, None, length=3)[0]


@pytest.mark.parametrize("where", ["top", "jit", "scan", "key"])
def test_the_program_digest_changes_with_a_closed_over_constants_value(where):
    """A closed-over array is a constant of the traced program, like a literal: another value
    is another program (a stale hit would run the old value's executable)."""
    assert _digest(_closing(1.0, where), _X) == _digest(_closing(1.0, where), _X)
    assert _digest(_closing(1.0, where), _X) != _digest(_closing(2.0, where), _X)


def test_a_global_constant_held_in_part_counts_by_its_type():
    """Under jax.distributed a closed-over global array may live partly on other processes:
    its bytes cannot be read here (np.asarray raises), so it counts by dtype and shape (no
    executable is kept across processes: its value reaches no stored program)."""
    from types import SimpleNamespace

    from jaxpar._src.plan_cache import constant_digest

    def held_in_part(shape):
        return SimpleNamespace(dtype=np.dtype(np.float32), shape=shape,
                               is_fully_addressable=False)

    assert constant_digest(held_in_part((8, 16))) == constant_digest(held_in_part((8, 16)))
    assert constant_digest(held_in_part((8, 16))) != constant_digest(held_in_part((16, 8)))
    assert constant_digest(held_in_part((8, 16))) != constant_digest(np.ones((8, 16), np.float32))


@pytest.mark.parametrize("where", ["top", "jit", "scan"])
def test_a_closed_over_constants_value_is_not_served_from_the_cache(cache_dir, where):
    """The same function (one name, one code) closing over another value, as in a second run
    of a script whose constant changed: the result is jax.jit's, not the stored program's."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    x = jax.random.normal(jax.random.key(1), (8, 16))
    for value in (1.0, 2.0):
        f = _closing(value, where)
        got = jaxpar.parallelize(f, mesh=mesh, parallel_mode="auto_parallel")(x)
        flush()  # the executable is in the directory, as for a second process
        np.testing.assert_allclose(got, jax.jit(f)(x), rtol=1e-5, atol=1e-6)


def test_the_program_digest_leaves_object_addresses_out():
    from jaxpar._src.plan_cache import _params, _text

    class Thing:  # a repr with the object's address, as an opaque parameter may have
        pass

    assert _text((Thing(), 1)) == _text((Thing(), 1))
    assert " at 0x" not in _text(Thing()) and _text(Thing()).endswith("Thing object>")
    assert _params({"f": Thing(), "n": 2}, control=False) == \
        _params({"n": 2, "f": Thing()}, control=False)
    assert _params({"n": 2}, control=False) != _params({"n": 3}, control=False)


_NOT_AN_INDEX = "is not a jaxpar.prefetch/1 index naming an executable"


@pytest.mark.parametrize("suffix, content, why", [
    (".json", b"{cut short", "it is not JSON"),
    (".json", b"null", "it is not a jaxpar.plan-cache/1 entry (found 'NoneType')"),
    (".json", b"[1, 2]", "it is not a jaxpar.plan-cache/1 entry (found 'list')"),
    (".json", b"\xff\xfe", "it cannot be read"),
    (".last", b"{cut short", "it is not JSON"),
    (".last", b"null", _NOT_AN_INDEX),
    (".last", b'"a string"', _NOT_AN_INDEX),
    (".last", b"\xff\xfe", "it cannot be read"),
])
def test_an_unusable_entry_or_index_warns_from_parallelize_and_is_replaced(
        cache_dir, suffix, content, why):
    """A plan entry (.json) or pre-key index (.last, prefetch.py) that is not JSON, is JSON
    ``null`` or another non-object, or is not text: one warning saying why, attributed to
    jaxpar's api.py (the readers' stacklevel), and the file written anew for the next run."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    want = np.asarray(_auto(mesh)(*args))
    flush()  # the executable and its index, written in the background
    (path,) = [p for p in cache_dir.iterdir() if p.suffix == suffix]
    path.write_bytes(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _auto(mesh)(*args)
    ours = [w for w in caught if issubclass(w.category, jaxpar.JaxparWarning)]
    assert [(os.path.basename(w.filename), why in str(w.message)) for w in ours] == [
        ("api.py", True)], [str(w.message) for w in ours]
    np.testing.assert_array_equal(np.asarray(got), want)
    flush()
    assert path.read_bytes() != content  # rewritten
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxpar.JaxparWarning)
        _auto(mesh)(*args)


def test_a_loaded_plans_decisions_are_converted_when_read_and_equal_the_searched(
        cache_dir, searches):
    """A hit's plan holds its decisions in their JSON form (plan_json.LoadedDecisions): a call
    with the executable loaded converts the arguments' only, and each decision, once read,
    equals the searched plan's (so do the plan, its hash, JSON and pickle)."""
    import pickle

    from jaxpar._src.plan_json import LoadedDecisions

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    first = _auto(mesh)
    want = first(*args)
    searched = first.plan(*args)
    flush()  # the executable kept beside the entry
    again = _auto(mesh)
    np.testing.assert_array_equal(np.asarray(again(*args)), np.asarray(want))
    entry = again.compiled_entry(*args)
    assert entry.loaded is not None  # the executable too: nothing lowered
    decisions = entry.plan.decisions
    assert isinstance(decisions, LoadedDecisions)
    made = sum(d is not None for d in decisions._made)
    assert made == len(searched.inputs) < len(decisions)
    assert [decisions.header(i) for i in range(len(decisions))] == [
        (d.kind, d.name, d.out_shapes) for d in searched.decisions]
    assert decisions == searched.decisions and searched.decisions == decisions
    assert tuple(decisions) == searched.decisions and decisions[1:3] == searched.decisions[1:3]
    plan = dataclasses.replace(entry.plan, notes=searched.notes)
    assert plan == searched and hash(plan) == hash(searched)
    assert plan.to_json() == searched.to_json()
    assert plan.explain() == searched.explain()
    copy = pickle.loads(pickle.dumps(plan))
    assert type(copy.decisions) is tuple and copy == searched
    assert searches[0] == 1


def test_a_decision_edited_by_hand_warns_and_is_searched_again(cache_dir, searches):
    """Only an entry whose executable is kept beside it (whose key holds the digest of the
    entry's text) has its decisions converted when read: an edited entry is converted whole
    when loaded, so an edit the fit check does not read (a layout) warns and the plan is
    searched again, as an edited operator does; the call's answer is right."""
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    args = _args()
    want = np.asarray(_auto(mesh)(*args))
    flush()  # the executable kept beside the entry
    (path,) = [e for e in cache_dir.iterdir() if e.suffix == ".json"]
    data = json.loads(path.read_text())
    ops = [i for i, d in enumerate(data["plan"]["decisions"]) if d["kind"] == "op"]
    del data["plan"]["decisions"][ops[-1]]["in_specs"]
    path.write_text(json.dumps(data))
    again = _auto(mesh)
    with pytest.warns(jaxpar.JaxparWarning, match="not well-formed"):
        np.testing.assert_array_equal(np.asarray(again(*args)), want)
    assert searches[0] == 2 and not any(n.startswith(HIT_NOTE)
                                        for n in again.plan(*args).notes)
    flush()
    data = json.loads(path.read_text())  # replaced by the plan searched again
    data["plan"]["decisions"][ops[-1]]["name"] = "not_an_operator"
    path.write_text(json.dumps(data))
    with pytest.warns(jaxpar.JaxparWarning, match="does not fit this program"):
        plan = _auto(mesh).plan(*args)
    assert searches[0] == 3 and not any(n.startswith(HIT_NOTE) for n in plan.notes)

def _devices_reversed():
    devices = np.array(jax.devices()[:8][::-1]).reshape(2, 4)
    return jax.sharding.Mesh(devices, ("dp", "mp"))


_P = jax.sharding.PartitionSpec


@pytest.mark.parametrize("change", [
    dict(mesh=_devices_reversed),  # the same shape and names, another device order
    dict(mesh=lambda: jaxpar.make_mesh((2, 4), ("data", "model"))),  # other axis names
    dict(options=dict(hardware="h100")),  # another hardware profile
    dict(options=dict(in_strategy=(_P("dp"), _P(None, "mp"), None))),  # the user's layouts
    dict(options=dict(out_strategy=_P(None, "mp"))),
    dict(context=dict(enable_parallel_optimizer=True)),  # ZeRO
    dict(context=dict(enable_parallel_optimizer=True,
                      parallel_optimizer_config={"optimizer_level": "level3"})),
    dict(x64=True),  # jax_enable_x64: other dtypes
], ids=["device-order", "axis-names", "hardware", "in_strategy", "out_strategy", "zero",
        "zero-level3", "x64"])
def test_a_change_of_what_keys_the_plan_searches_again_and_computes_as_jit(
        cache_dir, searches, change):
    """One change at a time against a stored plan and executable (the second callable is what
    a second run of the script has): the plan is searched again, not loaded, and the result is
    jax.jit's; the first settings again are a hit."""
    def run(mesh, options, context, x64):
        with jaxpar.auto_parallel_context(**context), jax.enable_x64(x64):
            args = _args()
            f = jaxpar.parallelize(_mlp, mesh=mesh, parallel_mode="auto_parallel", **options)
            got = f(*args)
            flush()
            np.testing.assert_allclose(got, jax.jit(_mlp)(*args), rtol=1e-5, atol=1e-5)
            return any(n.startswith(HIT_NOTE) for n in f.plan(*args).notes)

    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    assert not run(mesh, {}, {}, False)
    other = change.get("mesh", lambda: mesh)()
    assert not run(other, change.get("options", {}), change.get("context", {}),
                   change.get("x64", False))
    assert searches[0] == 2
    assert run(mesh, {}, {}, False) and searches[0] == 2
