"""Level 3 (ZeRO-3, FSDP) gathers each split parameter again for the backward pass.

Known answer: ZeRO-3 (Rajbhandari et al., SC 2020, section 5.3) and PyTorch FSDP
(``reshard_after_forward=True``) all-gather each parameter before its forward use, free it, and
all-gather it again before its backward use: two all-gathers per parameter and step, the second
after the forward pass.  Counted here in the compiled HLO, per parameter (by the gathered
shape, distinct per parameter), for both lowerings (the annotated jaxpr and the evaluator,
which checkpoint bodies take), with numerics against one device.
"""

from __future__ import annotations

import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxpar
from jaxpar._src import api, lower
from tests.test_zero_plan import _predicted, _table
from tests.util import assert_tree_close

V, D, F, B, T = 64, 32, 128, 16, 8
LEVEL3 = dict(enable_parallel_optimizer=True,
              parallel_optimizer_config={"optimizer_level": "level3",
                                         "parallel_optimizer_threshold": 0})
# parameter -> its full shape (distinct per parameter, so all-gathers count by shape)
SHAPES = {"emb": (V, D), "w1": (D, F), "w2": (F, D)}


def _problem(remat: bool):
    """A tied embedding (the lookup and the output projection read it: two forward uses) and
    an MLP block, optionally under ``jax.checkpoint``; Adam."""
    k = jax.random.split(jax.random.key(0), 4)
    params = {name: jax.random.normal(kk, shape) * 0.1
              for (name, shape), kk in zip(SHAPES.items(), k[:3], strict=True)}
    tokens = jax.random.randint(k[3], (B, T + 1), 0, V)
    tx = optax.adam(1e-2, eps=1e-3)

    def block(p, h):
        return h + jax.nn.relu(h @ p["w1"]) @ p["w2"]

    body = jax.checkpoint(block) if remat else block

    def loss(p, tokens):
        h = body(p, jnp.take(p["emb"], tokens[:, :-1], axis=0))
        logits = h @ p["emb"].T
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, (params, tx.init(params), tokens)


def _gathers(compiled) -> collections.Counter:
    """All-gathers of the compiled program by gathered shape."""
    return collections.Counter(r.shapes[-1] for r in _collectives(compiled)
                               if r.kind == "all-gather")


def _collectives(compiled):
    return jaxpar.inspect.collectives(compiled)


def _schedule(compiled) -> list[str]:
    """The gathered shapes in the order of the compiled (scheduled) entry computation."""
    hlo = compiled.as_text()
    return re.findall(r"= (f32\[[0-9,]+\])\{[^}]*\} all-gather(?:-start)?\(",
                      hlo[hlo.index("ENTRY"):])


def _compile(monkeypatch, remat: bool, annotate: bool):
    monkeypatch.setattr(api, "make_evaluator", functools.partial(lower.make_evaluator,
                                                                 annotate=annotate))
    step, args = _problem(remat)
    with jaxpar.auto_parallel_context(**LEVEL3):
        f = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
                               parallel_mode="data_parallel")
        compiled = f.lower(*args).compile()
        entry = f.compiled_entry(*args)
        return compiled, f(*args), jax.jit(step)(*args), entry.program.graph, entry.plan


@pytest.mark.parametrize("remat,annotate", [(False, True), (False, False), (True, True)],
                         ids=["annotated", "evaluated", "checkpointed"])
def test_each_parameter_gathered_for_forward_and_again_for_backward(monkeypatch, remat,
                                                                   annotate):
    """Both lowerings alike: the annotated jaxpr, the evaluator (forced, and taken by the
    checkpointed step)."""
    compiled, result, single, graph, plan = _compile(monkeypatch, remat, annotate)
    assert bool(graph.remats) == remat
    # emb.T, w1, w2: the plan says which are gathered again
    assert any("level 3: 3 split parameters" in n for n in plan.notes), plan.notes
    counts = _gathers(compiled)
    # w1, w2: one forward all-gather, one backward (a checkpoint body's recomputation counts
    # as backward and shares it).  The tied embedding: two forward ones (the lookup reads
    # emb, the projection emb.T, gathered transposed: f32[32,64]) and one backward (emb.T,
    # the projection's cotangent dh = dlogits @ emb).
    assert counts == {"f32[32,128]": 2, "f32[128,32]": 2, "f32[64,32]": 1, "f32[32,64]": 2}
    # ZeRO-3's order: the forward's gathers layer by layer, then the backward's in reverse,
    # each after the forward pass (an optimization barrier keeps XLA from merging them, its
    # tie to the cotangent from hoisting them).  Under jax.checkpoint the recomputation reads
    # w1 before dh = dy @ w2ᵀ reads w2: either order keeps the data dependences.
    schedule = _schedule(compiled)
    assert schedule[:4] == ["f32[64,32]", "f32[32,128]", "f32[128,32]", "f32[32,64]"]
    backward = ["f32[32,64]", "f32[128,32]", "f32[32,128]"]
    assert (sorted(schedule[4:]) == sorted(backward)) if remat else schedule[4:] == backward
    # FSDP's gradients are reduce-scattered, each once (Ψ in all), none all-reduced: w1's and
    # w2's contractions over the batch, and the tied embedding's sum of two gradients (the
    # projection's contraction and the lookup's scatter-add) added locally first
    # (jaxpar/_src/scatter.py); only the f32 loss is all-reduced.
    colls = _collectives(compiled)
    psi = sum(math.prod(shape) * 4 for shape in SHAPES.values())
    assert colls.count("reduce-scatter") == 3, colls.table()
    assert colls.total_bytes("reduce-scatter") == psi, colls.table()
    assert colls.total_bytes("all-reduce") == 4, colls.table()
    # the plan predicts every one of them, the second gathers included
    assert _predicted(plan) == _table((r.kind, r.axes, r.nbytes, r.count) for r in colls)
    assert_tree_close(result, single, rtol=1e-5, atol=1e-6)


def test_backward_nodes_are_those_jax_transposed():
    """``Node.backward``: made under JAX's ``transpose`` (inside an inlined body too); the
    forward's reads of the tied embedding and the optimizer's update are not."""
    step, args = _problem(remat=True)
    f = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
                           parallel_mode="data_parallel")
    graph = f.compiled_entry(*args).program.graph
    emb = graph.nodes[graph.inputs[0]].outputs[0]  # params["emb"], the first leaf
    def readers(vid):
        return [graph.nodes[u.consumer] for u in graph.consumers[vid]]

    # the lookup and emb.T read it forward; Adam's update (``add``) is after the backward
    assert sorted((n.name, n.backward) for n in readers(emb)) == [
        ("add", False), ("gather", False), ("transpose", False)]
    (t,) = [n for n in readers(emb) if n.name == "transpose"]
    # emb.T: the projection reads it forward, its cotangent dh = dlogits @ emb backward
    assert sorted((n.name, n.backward) for n in readers(t.outputs[0])) == [
        ("dot_general", False), ("dot_general", True)]
    # The differentiated step's checkpoint body is the transposed one (its recomputation and
    # backward): marked through the inlining; the forward pass ran outside it.
    in_blocks = [n for n in graph.nodes if n.remat is not None]
    assert in_blocks and all(n.backward for n in in_blocks)
    w1 = graph.nodes[graph.inputs[1]].outputs[0]
    assert sorted((n.name, n.backward, n.remat is not None) for n in readers(w1)) == [
        ("add", False, False), ("dot_general", False, False),  # forward, update
        ("dot_general", True, True), ("dot_general", True, True)]  # recomputed, transposed


def test_scanned_layers_gather_each_slice_in_the_forward_and_the_backward_loop():
    """Layers stacked and run by ``lax.scan`` (as ``nn.scan`` / MaxText do): at level 3 the
    stack is split, and each iteration of the forward loop and of the backward loop (JAX's
    transposed scan, another loop) gathers its own layer's slice inside the loop body: no
    whole stack lives across the step.  (Planning used to fail here: the backward scan's own
    node reads the split stack.)"""
    layers, d, batch = 8, 64, 64  # the stack's dimension 0 divides over the 8 devices
    k = jax.random.split(jax.random.key(0), 3)
    params = {"w": jax.random.normal(k[0], (layers, d, d)) * 0.3,
              "out": jax.random.normal(k[1], (d, 16)) * 0.3}
    x = jax.random.normal(k[2], (batch, d))
    tx = optax.adam(1e-2, eps=1e-3)

    def loss(p, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])
        return jnp.mean((h @ p["out"]) ** 2)

    def step(params, opt_state, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    args = (params, tx.init(params), x)
    with jaxpar.auto_parallel_context(**LEVEL3):
        f = jaxpar.parallelize(step, mesh=jaxpar.make_mesh((8,), ("dp",)),
                               parallel_mode="data_parallel")
        got = f(*args)
        colls = jaxpar.inspect.collectives(f.lower(*args))
        plan = f.plan(*args)
        assert plan.input_layouts()["params.w"] == jax.sharding.PartitionSpec("dp")
    # the layer's slice f32[d, d], gathered in two loop bodies, once per iteration each
    in_loops = [c for c in colls if c.kind == "all-gather" and c.shapes == (f"f32[{d},{d}]",)
                and c.count == layers]
    assert len({c.computation for c in in_loops}) == 2, colls.table()
    assert not [c for c in colls if c.kind == "all-gather" and f"f32[{layers}," in c.shapes[0]]
    # the plan predicts every collective: ``out`` gathered again for the backward pass, the
    # stack's slices gathered in each loop (the backward loop reads the stack through the
    # forward loop's layout change: no second one of the whole stack)
    assert _predicted(plan) == _table((r.kind, r.axes, r.nbytes, r.count) for r in colls)
    assert_tree_close(got, jax.jit(step)(*args), rtol=1e-5, atol=1e-5)
