"""64-bit arguments inside and outside ``jax.enable_x64``: jaxpar does what ``jax.jit`` does.

``jax.jit`` traces a ``jax.Array`` with its own dtype (a float64 array made under x64 and passed
outside it is a float64 input, converted by the program's first promotion, with JAX's warning),
and canonicalizes NumPy arrays to 32 bits outside x64.  A ``ShapeDtypeStruct`` canonicalizes,
so a trace from structs alone handed float64 data to a float32 program.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar._src.cache_key import call_key


def _shift(x):
    return x - 1


def _mlp(x, w):
    return jnp.tanh(x @ w) * 2 + 1


def _make(kind):
    """The argument of each kind, made under x64 where its name says so (values that 32 bits
    cannot hold exactly, so a lost conversion shows)."""
    base = np.arange(64).reshape(16, 4)
    if kind == "numpy_f64":
        return base / 3
    if kind == "numpy_i64":
        return (base + 2**40).astype(np.int64)
    if kind == "jax_f32_made_outside":
        return jnp.asarray(base / 3, jnp.float32)
    if kind == "jax_i32_made_outside":
        return jnp.asarray(base, jnp.int32)
    with jax.enable_x64(True):
        return {"jax_f64_made_in_x64": jnp.asarray(base / 3, jnp.float64),
                "jax_i64_made_in_x64": jnp.asarray(base + 2**40, jnp.int64),
                "jax_u64_made_in_x64": jnp.asarray(base, jnp.uint64)}[kind]


KINDS = ["jax_f64_made_in_x64", "jax_i64_made_in_x64", "jax_u64_made_in_x64", "numpy_f64",
         "numpy_i64", "jax_f32_made_outside", "jax_i32_made_outside"]


def _quiet(fn, *args):
    """``fn(*args)`` with JAX's "requested dtype ... is not available" warning recorded."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn(*args)
    return out, [str(m.message) for m in w if "is not available" in str(m.message)]


def _check(got, want):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("x64", [False, True], ids=["called_outside_x64", "called_in_x64"])
@pytest.mark.parametrize("kind", KINDS)
def test_elementwise_matches_jit(kind, x64):
    mesh = jaxpar.make_mesh((8,), ("d",))
    x = _make(kind)
    with jax.enable_x64(x64):
        pf = jaxpar.parallelize(_shift, mesh=mesh, parallel_mode="semi_auto_parallel",
                                in_strategy=((8, 1),))
        want, jit_warned = _quiet(jax.jit(_shift), x)
        got, warned = _quiet(pf, x)
        _check(got, want)
        assert bool(warned) == bool(jit_warned)  # JAX's truncation warning, as jax.jit gives it
        lowered = pf.lower(x).as_text()  # lowering from the arguments' structs agrees
        dtype = jax.jit(_shift).trace(x).jaxpr.in_avals[0].dtype  # what jax.jit's program takes
        short = {"float64": "f64", "int64": "i64", "uint64": "ui64", "float32": "f32",
                 "int32": "i32"}[str(dtype)]
        assert f"tensor<2x4x{short}>" in lowered or f"tensor<16x4x{short}>" in lowered


@pytest.mark.parametrize("x64", [False, True], ids=["called_outside_x64", "called_in_x64"])
@pytest.mark.parametrize("kind", ["jax_f64_made_in_x64", "numpy_f64", "jax_f32_made_outside"])
def test_mlp_matches_jit(kind, x64):
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    x = _make(kind)
    w = np.linspace(-1, 1, 4 * 8).reshape(4, 8)
    with jax.enable_x64(True):
        w = jnp.asarray(w, x.dtype if kind != "numpy_f64" else jnp.float64)
    with jax.enable_x64(x64):
        pf = jaxpar.parallelize(_mlp, mesh=mesh, parallel_mode="semi_auto_parallel",
                                in_strategy=((2, 1), (1, 4)))
        want, _ = _quiet(jax.jit(_mlp), x, w)
        got, _ = _quiet(pf, x, w)
        assert got.dtype == want.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_one_callable_both_modes_and_keys_differ():
    """A float64 array made under x64 gives another program inside x64 than outside, in one
    callable: the keys differ by the trace context, and each call matches jax.jit."""
    pf = jaxpar.parallelize(_shift, mesh=jaxpar.make_mesh((8,), ("d",)),
                            parallel_mode="semi_auto_parallel", in_strategy=((8, 1),))
    x = _make("jax_f64_made_in_x64")
    outside = call_key((x,), (), api="f")
    got, _ = _quiet(pf, x)
    _check(got, _quiet(jax.jit(_shift), x)[0])
    with jax.enable_x64(True):
        inside = call_key((x,), (), api="f")
        _check(pf(x), jax.jit(_shift)(x))
        assert pf(x).dtype == jnp.float64
    assert inside != outside
    got, _ = _quiet(pf, x)  # the float32 program again, from the cache
    assert got.dtype == jnp.float32


def _layers(w, x):
    for i in range(4):
        x = jnp.tanh(x @ w[i])
    return jnp.mean(x ** 2)


def test_a_pipeline_refuses_a_64_bit_array_outside_x64_naming_it():
    """The pipeline's loop makes its buffers in the canonical (32-bit) dtypes: a float64 array
    outside x64 made lax.cond refuse float64 against float32; now a PlanError says which
    argument and what to do."""
    with jax.enable_x64(True):
        w = jnp.asarray(np.linspace(-0.5, 0.5, 4 * 8 * 8).reshape(4, 8, 8))
    x = jnp.ones((16, 8))
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2):
        step = jaxpar.parallelize(jax.value_and_grad(jaxpar.PipelineCell(_layers)),
                                  micro_batches=4, batch_argnums=1)
        with pytest.raises(jaxpar.PlanError,
                           match=r"PipelineCell\(_layers\): argument 0 is float64 outside "
                                 r"jax_enable_x64.*x.astype\(float32\)"):
            step(w, x)


@pytest.mark.parametrize("grad", [True, False], ids=["value_and_grad", "forward"])
def test_a_pipelined_step_under_x64_returns_the_unpipelined_loss_dtype_and_value(grad):
    """Under x64 a float64 loss is accumulated over the micro-batches in float64, and its
    gradients seeded with the float64 1/M: the pipelined step returns what the unpipelined one
    does, to float64's precision (the loop's float32 accumulator gave a float32 loss, and M=3's
    float32 1/3 gradients 3e-8 off)."""
    mesh = jaxpar.make_mesh((4, 2), ("dp", "pp"))
    with jax.enable_x64(True):
        w = jnp.asarray(np.linspace(-0.5, 0.5, 4 * 8 * 8).reshape(4, 8, 8))
        x = jnp.asarray(np.linspace(-1.0, 1.0, 24 * 8).reshape(24, 8))
        assert w.dtype == x.dtype == jnp.float64
        with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                          pipeline_stages=2):
            cell = jaxpar.PipelineCell(_layers)
            step = jaxpar.parallelize(jax.value_and_grad(cell) if grad else cell,
                                      micro_batches=3, batch_argnums=1)
            got = step(w, x)
            red = step.plan(w, x).pipeline.gradient_reduction  # pipelined
            colls = jaxpar.inspect.collectives(step.lower(w, x).compile()) if grad else None
        want = (jax.value_and_grad(_layers) if grad else _layers)(w, x)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == r.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-13, atol=1e-15)
    if grad:  # the loss's parts summed per dp group: one float64 (8 B) in the dp all-reduce
        assert red.once and red.loss_bytes == 8, red
        summed = [(r.count, r.nbytes) for r in colls.of("all-reduce") if r.axes == ("dp",)
                  and any(sh.endswith("8,8]") for sh in r.shapes)]
        assert summed == [(1, red.step_bytes + red.loss_bytes)], colls.table()
