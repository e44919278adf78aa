"""The epilogue's collectives the stage split prices (``pipeline/transpose.py``), forward and
backward, against the compiled loop's, on (dp, tp, pp) = (2, 2, 2) with the head's weight split
over ``tp`` and whole, the label's logit picked by a one-hot product or by ``take_along_axis``
(optax's; ``masked_gather.py``: XLA aborts on that gather inside the loop's ``shard_map``)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpar
from tests.util import FAST_COMPILE_FLAGS

V, D, LAYERS, ROWS, SEQ = 64, 16, 2, 8, 8


def _one_hot(logits, y):
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * jax.nn.one_hot(y, V), -1))


def _optax(logits, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


# the label's logit: a one-hot product, or optax's gather (take_along_axis), which XLA's
# partitioner aborts on over a vocabulary split on tp inside the loop's shard_map unless jaxpar
# lowers it as a masked sum (masked_gather.py)
PICKS = {"one-hot": _one_hot, "optax": _optax}


def _loss(head, pick):
    def loss(p, tok, y):
        x = p["emb"][tok]
        for i in range(LAYERS):
            x = x + jnp.tanh(x @ p["w"][i])
        return pick(head(x, p["head"]), y)
    return loss


def _matmul(h, w):
    return h @ w


HEADS = {
    # column split: forward the loss's max and sums over tp; backward the head input's
    # cotangent all-reduced over tp.  The head runs per row group and the loss's tail too, so
    # nothing crosses dp inside the loop: the head weight's gradient and the loss are summed
    # over dp once after it.  (It ran per micro-batch, the head weight's gradient and the
    # loss's scalar all-reduced over dp every micro-batch, 2052 B a trip, while the loss
    # traced at a group's rows wrote the head's input constraint on the step's mesh, "pp" in
    # it, and the row proof took that for another operator: "the loss reads its weights
    # after mixing rows".)
    "column over tp": jaxpar.shard(_matmul, in_strategy=((2, 1, 1), (1, 2))),
    # whole: the head runs per row group and the loss's tail too (tail.py): nothing crosses
    # the row axes inside the loop, forward or backward
    "unsplit": _matmul,
}


@pytest.mark.parametrize("name, pick", [("column over tp", "one-hot"), ("unsplit", "one-hot")])
def test_priced_epilogue_collectives_match_the_compiled_loop(name, pick):
    loss = _loss(HEADS[name], PICKS[pick])
    k = jax.random.split(jax.random.key(0), 4)
    p = {"emb": jax.random.normal(k[0], (V, D)) * 0.1,
         "w": jax.random.normal(k[1], (LAYERS, D, D)) * 0.3,
         "head": jax.random.normal(k[2], (D, V)) * 0.1}
    tok = jax.random.randint(k[3], (ROWS, SEQ), 0, V)
    y = jnp.roll(tok, 1, 1)
    mesh = jaxpar.make_mesh((2, 2, 2), ("dp", "tp", "pp"))
    with jaxpar.auto_parallel_context(parallel_mode="semi_auto_parallel", mesh=mesh,
                                      pipeline_stages=2, micro_batches=2,
                                      pipeline_config={"pipeline_scheduler": "gpipe"}):
        cell = jaxpar.PipelineCell(loss)
        step = jaxpar.parallelize(jax.value_and_grad(cell), batch_argnums=(1, 2))
        compiled = step.lower(p, tok, y).compile()
        value, grad = compiled(p, tok, y)
        colls = jaxpar.inspect.collectives(compiled)
    ref_value, ref_grad = jax.value_and_grad(loss)(p, tok, y)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    program = cell.last_program
    # the tick loop's collectives: as many trips as its permutes over pp (the layers' run
    # in the chunk's scan, more often; here they have none)
    trips = {r.count for r in colls.of("collective-permute") if r.count > 1}
    assert len(trips) == 1, colls.table()
    looped: dict[tuple[str, ...], float] = {}
    issued = 0  # the loop's collectives off pp, after XLA's combiner
    for r in colls:
        if r.count in trips and r.axes and "pp" not in r.axes:
            key = tuple(sorted(r.axes))
            looped[key] = looped.get(key, 0.0) + r.nbytes
            issued += 1
    priced = program.epilogue_comm
    assert priced.bytes_by_axes() == looped, (priced, colls.table())
    # combined as XLA combines them: the loss's two independent sums over tp are one
    # all-reduce (its max another, the head input's cotangent a third), one latency each
    assert len(priced.forward + priced.backward) == issued, (priced, colls.table())
    assert program.ends.epilogue and program.ends.affine is not None, program.ends
    if name == "column over tp":
        assert looped == {("tp",): 3 * 64 + 1024}
        assert sorted(c.members for c in priced.forward) == [1, 2], priced
        assert {c.axes for c in priced.backward} == {("tp",)}
    else:
        assert looped == {}
    # after the loop, the head weight's gradient summed over dp once, with the others' (the
    # unsplit head's rows split over tp too: over dp+tp)
    after = [r for r in colls.of("all-reduce") if r.count == 1 and "dp" in r.axes]
    shape = "f32[16,32]" if name == "column over tp" else "f32[16,64]"
    assert any(shape in r.shapes for r in after), colls.table()
    # the split's epilogue price holds them beside its compute
    assert program.split.epilogue_s > priced.time == sum(
        c.time for c in priced.forward + priced.backward)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTAX_LOSS = """
from tests.test_pipeline_transpose import test_priced_epilogue_collectives_match_the_compiled_loop
test_priced_epilogue_collectives_match_the_compiled_loop("column over tp", "optax")
print("passed", flush=True)
"""


def test_optax_cross_entropy_over_the_split_vocabulary():
    """The label's logit by optax's integer-label cross-entropy (its ``take_along_axis``) with
    the vocabulary split over tp: the loss and gradients of a single device's run, and the
    one-hot product's collectives above.  Its gather aborted the process inside the loop's
    ``shard_map`` (XLA's partitioner), so it runs in a child: a regression fails this test,
    not the whole run."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_COMPILE_FLAGS}")
    run = subprocess.run([sys.executable, "-c", OPTAX_LOSS], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["passed"]
