"""The loss's tail per row group (``jaxpar/_src/pipeline/tail.py``): the proof that it is affine
in the sums over the rows, and its parts summed over the groups equal to the whole.

The pipelined steps that use it (no scalar crossing the row axes inside the loop) are checked
in ``test_pipeline_groups.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar._src.graph import NodeKind
from jaxpar._src.pipeline.tail import affine_tail, run_free, run_tail
from jaxpar._src.trace import trace

ROWS, GROUPS = 8, 4


def _tail(fn, m_dtype=jnp.float32):
    """``fn(h, m, w)`` traced with two per-row values ``h: [8, 3]``, ``m: [8]`` (rows on
    dimension 0) and a weight ``w: [3]``: the graph, the inputs' ids, the proof."""
    args = [jnp.ones((ROWS, 3)), jnp.ones(ROWS, m_dtype), jnp.ones(3)]
    g = trace(fn, args).graph
    h, m, w = (g.nodes[i].outputs[0] for i in g.inputs)
    ops = [n.id for n in g.nodes if n.kind is NodeKind.OP]
    out = g.nodes[g.outputs[0]].inputs[0]
    return g, (h, m, w), affine_tail(g, ops, {h: 0, m: 0}, {w}, {w}, out)


AFFINE = [  # (loss, adds a term without rows)
    (lambda h, m, w: jnp.mean(h), False),
    (lambda h, m, w: -jnp.mean(h) + 1e-2 * jnp.sum(w ** 2), True),  # cross-entropy + decay
    (lambda h, m, w: jnp.sum(w) - jnp.sum(h) / 100.0, True),
    (lambda h, m, w: 0.5 * jnp.mean(jnp.sum(h, axis=0)) + jnp.sum(m) * 3.0, False),
    (lambda h, m, w: (jnp.mean(h) + jnp.mean(m)).astype(jnp.float32).reshape(1, 1)[0, 0],
     False),
]


@pytest.mark.parametrize("fn,offset", AFFINE)
def test_an_affine_tail_summed_over_the_groups_equals_the_whole(fn, offset):
    g, (h, m, w), tail = _tail(fn)
    assert not isinstance(tail, str), tail
    assert tail.offset == offset
    keys = jax.random.split(jax.random.key(0), 3)
    hv, mv = jax.random.normal(keys[0], (ROWS, 3)), jax.random.normal(keys[1], (ROWS,))
    wv = jax.random.normal(keys[2], (3,))
    n = ROWS // GROUPS
    free = run_free(g, tail, {w: wv})  # what reads no rows: once
    parts = [run_tail(g, tail, free | {h: hv[k * n:(k + 1) * n], m: mv[k * n:(k + 1) * n]},
                      linear=True) for k in range(GROUPS)]
    once = run_tail(g, tail, free, linear=False)
    # each group's part divides by the whole micro-batch's count; the decay is added once
    np.testing.assert_allclose(sum(parts) + once, fn(hv, mv, wv), rtol=1e-6)


@pytest.mark.parametrize("fn,why", [
    (lambda h, m, w: jnp.log(jnp.mean(h)), "log of a sum over the rows is not affine"),
    (lambda h, m, w: jnp.max(h), "reduce_max of the rows is not a sum over them"),
    (lambda h, m, w: jnp.sum(h) / jnp.sum(m), "div of two sums over the rows is not affine"),
    (lambda h, m, w: jnp.mean(h) ** 2, "integer_pow of a sum over the rows is not affine"),
    (lambda h, m, w: jnp.mean(h) * jnp.sum(w), "mul scales a sum over the rows by a value "
     "read from a weight"),
    (lambda h, m, w: 1.0 / jnp.mean(h), "div by a sum over the rows is not affine"),
    (lambda h, m, w: jnp.mean(h).astype(jnp.int32).astype(jnp.float32),
     "convert_element_type rounds a sum over the rows"),
    (lambda h, m, w: jnp.mean(h).astype(jnp.bfloat16).astype(jnp.float32),
     "convert_element_type rounds a sum over the rows"),  # each group's part, not the whole
])
def test_a_tail_that_is_not_affine_is_refused_with_its_operator(fn, why):
    _, _, tail = _tail(fn)
    assert isinstance(tail, str) and tail.startswith(why), tail


def test_an_integer_division_of_a_sum_is_refused():
    """Integer division rounds each group's part, not the whole sum: 4 groups of 2 rows of 1
    give 4 * (2 // 3) = 0 where the whole gives 8 // 3 = 2."""
    _, _, tail = _tail(lambda h, m, w: jax.lax.div(jnp.sum(m), 3).astype(jnp.float32),
                       m_dtype=jnp.int32)
    assert isinstance(tail, str) and tail.startswith("div rounds a sum over the rows"), tail


def test_a_gather_in_the_tail_is_refused_so_the_plan_lowers_it():
    """The proven tail is bound with ``bind_equation`` inside the loop's ``shard_map``, not
    through the plan's lowering, which evaluates a ``take_along_axis`` over a split dimension
    as a masked sum (``masked_gather.py``: XLA's partitioner aborts the process on that gather
    there).  A gather never enters it: reading the rows, or a sum over them, it is no sum
    itself, so the tail stays whole (run by the plan), and the label's logit of a
    cross-entropy is picked per row, by the head, before the tail's sum."""
    sums = lambda h, m, w: jnp.take_along_axis(jnp.mean(h, 0), jnp.array([1]), 0)[0]  # noqa: E731
    _, _, tail = _tail(sums)
    assert isinstance(tail, str) and tail.startswith("gather of a sum over the rows"), tail
    rows = lambda h, m, w: jnp.take_along_axis(h, jnp.ones((ROWS, 1), int), -1).sum()  # noqa: E731
    _, _, tail = _tail(rows)
    assert isinstance(tail, str) and tail.startswith("gather of the rows is not a sum"), tail
    for fn, _ in AFFINE:  # what a proven tail binds: sums over the rows and linear operators
        g, _, tail = _tail(fn)
        assert {g.nodes[n].name for n in tail.rows} <= {
            "reduce_sum", "add", "sub", "mul", "div", "neg", "reshape", "squeeze",
            "convert_element_type", "broadcast_in_dim", "copy", "copy_p", "transpose",
            "expand_dims", "sharding_constraint"}, tail
