"""A user who pins FSDP layouts in semi-automatic mode gets no worse than ``jax.jit`` with the
same input and output shardings (issue 11): collective bytes and per-device memory of the
compiled programs, read from the partitioned HLO and ``memory_analysis()``.

Before the fix, propagation priced a candidate by its layout changes alone and took the node's
own all-reduce of partial sums only as a tie-break: a matmul whose weight is split on the
contraction dimension (FSDP's dimension 0) then chose the contraction split, all-reducing
whole activations, where XLA all-gathers the weight (MaxText/Levanter's FSDP).
"""

from __future__ import annotations

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from tests import models


def _fsdp(a) -> P:
    return P("dp") if a.ndim >= 2 and a.shape[0] % 8 == 0 else P()


def fsdp_block_case():
    """An Adam step of a transformer block with FSDP layouts pinned over 8 devices: the step,
    its arguments, ``parallelize``'s options and the pinned (in, out) layouts."""
    params, x = models.init_block(jax.random.key(0), batch=8, seq=8, d=32, ff=64)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, x):
        loss, grads = jax.value_and_grad(models.block_loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    pspec, sspec = jax.tree.map(_fsdp, params), jax.tree.map(_fsdp, opt_state)
    layouts = ((pspec, sspec, P("dp")), (pspec, sspec, P()))
    return step, (params, opt_state, x), dict(
        mesh=jaxpar.make_mesh((8,), ("dp",)), parallel_mode="semi_auto_parallel",
        in_strategy=layouts[0], out_strategy=layouts[1]), layouts


def test_pinned_fsdp_moves_no_more_bytes_and_memory_than_jit():
    step, (params, opt_state, x), options, (ins, outs) = fsdp_block_case()
    mesh = options["mesh"]
    f = jaxpar.parallelize(step, **options)
    ours = f.lower(params, opt_state, x).compile()

    def named(tree):
        return jax.tree.map(lambda s: NamedSharding(mesh, s), tree,
                            is_leaf=lambda s: isinstance(s, P))

    theirs = jax.jit(step, in_shardings=named(ins), out_shardings=named(outs)).lower(
                         params, opt_state, x).compile()
    ours_c, theirs_c = jaxpar.inspect.collectives(ours), jaxpar.inspect.collectives(theirs)
    assert ours_c.total_bytes() <= theirs_c.total_bytes(), (ours_c.table(), theirs_c.table())
    ours_m, theirs_m = jaxpar.inspect.memory(ours), jaxpar.inspect.memory(theirs)
    assert ours_m["total"] <= theirs_m["total"], (ours_m, theirs_m)
    # The weights are gathered for use, not their activations all-reduced: no all-reduce
    # carries an activation (batch x seq x features) here.
    assert not [r for r in ours_c.of("all-reduce") if "[8,8," in " ".join(r.shapes)], \
        ours_c.table()
