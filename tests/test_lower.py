"""Lowering leaves the constraints XLA does not need out, and XLA still does what the plan
says: the compiled collectives are those of the fully constrained program, and the plan's."""

import collections
import functools
import os
import re
import sys

import jax
import pytest

import jaxpar
from jaxpar._src import annotate, api, lower
from jaxpar._src.graph import Const, NodeKind
from tests import models
from tests.util import assert_tree_close


def _compiled(monkeypatch, fn, args, loose, annotate=True, **options):
    monkeypatch.setattr(api, "make_evaluator", functools.partial(
        lower.make_evaluator, loose=loose, annotate=annotate))
    step = jaxpar.parallelize(fn, **options)
    lowered = step.lower(*args)
    return step, lowered.as_text().count("sharding_constraint"), lowered.compile()


def _instructions(compiled):
    """The partitioned program's instructions, names and metadata left out, sorted."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    text = re.sub(r"%[\w.\-]+", "%v", text)
    return sorted(line.strip() for line in text.splitlines() if " = " in line)


def _collectives(compiled):
    return sorted((r.kind, tuple(r.axes or ()), r.shapes, r.count)
                  for r in jaxpar.inspect.collectives(compiled))


@pytest.mark.parametrize("case", ["megatron block"])  # searched plans: the test below
def test_loose_results_change_no_collective(monkeypatch, case):
    """A transformer block's gradient (Megatron by hand on (dp, mp)): the same compiled
    collectives with and without the constraints XLA derives anyway, and lowered from the
    annotated jaxpr (one nested call: JAX traces one equation, not the program again) or
    evaluated equation by equation; for Megatron, those the plan predicted."""
    params, x = models.init_block(jax.random.key(0), batch=4, seq=8, d=32, ff=64)
    grad = jax.grad(models.block_loss)
    mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
    if case == "megatron block":
        options = dict(parallel_mode="semi_auto_parallel", in_strategy=(
            {"wq": (1, 4), "wk": (1, 4), "wv": (1, 4), "wo": (4, 1), "w1": (1, 4), "b1": (4,),
             "w2": (4, 1), "ln_g": (1,), "ln_b": (1,)}, (2, 1, 1)))
    else:
        options = dict(parallel_mode="auto_parallel", search_mode="dynamic_programming")
    full_step, full_n, full = _compiled(monkeypatch, grad, (params, x), False, mesh=mesh,
                                        **options)
    step, n, loose = _compiled(monkeypatch, grad, (params, x), True, mesh=mesh, **options)
    _, evaluated_n, evaluated = _compiled(monkeypatch, grad, (params, x), True, annotate=False,
                                          mesh=mesh, **options)
    entry = step.compiled_entry(params, x)
    assert annotate.can_annotate(entry.program.graph)
    traced = entry.jitted.trace(*step._placed((params, x), entry))
    assert [e.primitive.name for e in traced.jaxpr.eqns] == ["jit"]  # one nested call
    assert n == evaluated_n  # the same constraints, written down instead of traced
    assert _collectives(evaluated) == _collectives(loose)
    assert _instructions(evaluated) == _instructions(loose)  # the very same program
    plan = step.plan(params, x)
    assert len(lower.loose_values(step.compiled_entry(params, x).program.graph, plan)) > 20
    assert n < full_n * 0.8
    assert _collectives(loose) == _collectives(full) != []
    assert_tree_close(step(params, x), grad(params, x), rtol=1e-4, atol=1e-5)
    if case != "megatron block":
        return
    predicted, compiled = collections.Counter(), collections.Counter()
    for c in plan.predicted_collectives():
        predicted[(c.kind, tuple(sorted(c.axes)))] += c.count
    for r in jaxpar.inspect.collectives(loose):
        compiled[(r.kind, tuple(sorted(r.axes or ())))] += r.count
    assert compiled == predicted


def test_layouts_that_follow_their_operands_are_left_unconstrained():
    """A Megatron block's gradient: results of reshapes, transposes, and contractions and
    reductions made from operands in their own layouts and read as made go unconstrained,
    those whose partial sums are all-reduced too (the row-parallel contractions: XLA
    all-reduces what split operands leave); elementwise results whose size-1 operands
    broadcast (a layer norm's scale) follow their split operands; a broadcast of a scalar
    keeps its constraint (the programs' equality: the tests above and below)."""
    params, x = models.init_block(jax.random.key(0), batch=4, seq=8, d=32, ff=64)
    step = jaxpar.parallelize(
        jax.grad(models.block_loss), mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")),
        parallel_mode="semi_auto_parallel", in_strategy=(
            {"wq": (1, 4), "wk": (1, 4), "wv": (1, 4), "wo": (4, 1), "w1": (1, 4), "b1": (4,),
             "w2": (4, 1), "ln_g": (1,), "ln_b": (1,)}, (2, 1, 1)))
    graph, plan = step.compiled_entry(params, x).program.graph, step.plan(params, x)
    loose = lower.loose_values(graph, plan)
    seen = collections.Counter()
    for node in graph.nodes:
        if node.kind is not NodeKind.OP:
            continue
        d = plan.decisions[node.id]
        free = node.outputs[0] in loose
        operands = [graph.values[o].shape for o in node.inputs if not isinstance(o, Const)]
        if node.name in ("reshape", "transpose", "dot_general", "reduce_sum"):
            seen[(node.name, bool(d.collectives), free)] += 1
        elif node.name in ("mul", "add") and any(1 in s for s in operands if s):
            seen[("broadcasting " + node.name, False, free)] += 1
        elif node.name == "broadcast_in_dim" and not operands:
            seen[("scalar broadcast", False, free)] += 1
        if d.collectives and free:  # only partial sums all-reduced
            assert node.name in ("dot_general", "reduce_sum"), (node, d.strategy_str())
            assert {c.kind for c in d.collectives} == {"all-reduce"}, (node, d.strategy_str())
    for name in ("reshape", "transpose", "dot_general", "reduce_sum", "broadcasting mul"):
        assert seen[(name, False, True)] > 0, (name, seen)
    assert seen[("dot_general", True, True)] > 0, seen  # the row-parallel contractions
    assert seen[("scalar broadcast", False, False)] > 0, seen
    assert seen[("scalar broadcast", False, True)] == 0, seen


def test_loops_and_checkpoints_are_evaluated():
    """What the annotated jaxpr does not cover (loops, checkpoint bodies) is evaluated."""
    def scanned(x):
        return jax.lax.scan(lambda c, _: (jax.numpy.tanh(c), None), x, None, length=3)[0]

    def remat(x):
        return jax.checkpoint(lambda y: jax.numpy.sin(y) * 2)(x)

    mesh = jaxpar.make_mesh((8,), ("d",))
    x = jax.numpy.ones((16, 4))
    for fn in (scanned, jax.grad(lambda x: remat(x).sum())):
        step = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=((8, 1),))
        assert not annotate.can_annotate(step.compiled_entry(x).program.graph)
        assert_tree_close(step(x), fn(x), rtol=1e-5, atol=1e-6)


def test_annotated_edge_cases():
    """Results that are arguments, literals and constants, and literal operands."""
    mesh = jaxpar.make_mesh((8,), ("d",))
    x = jax.numpy.arange(32.0).reshape(16, 2)
    table = jax.numpy.arange(2.0)

    def f(x):
        return x, 1.0, x * 2 + table, jax.numpy.float32(3) * x

    step = jaxpar.parallelize(f, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=((8, 1),))
    assert not annotate.can_annotate(step.compiled_entry(x).program.graph)  # the literal 1.0
    assert_tree_close(step(x), f(x))
    g = lambda x: f(x)[::2]  # noqa: E731
    step = jaxpar.parallelize(g, mesh=mesh, parallel_mode="semi_auto_parallel",
                              in_strategy=((8, 1),))
    assert annotate.can_annotate(step.compiled_entry(x).program.graph)
    assert_tree_close(step(x), g(x))


def _gpt_case(annotate: bool):
    """The demo GPT's train step (examples/gpt.py, 1 layer: a second block's constraints are
    pruned as the first's, at 12% more CPU): semi-automatic with its ``jaxpar.shard``
    annotations (Megatron), or unannotated and searched."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    try:
        import gpt
    finally:
        sys.path.pop(0)
    cfg = gpt.GPTConfig(layers=1, seq=8, d_model=32, heads=4, ff=64, annotate=annotate)
    step, params, opt_state = gpt.make_train_step(cfg)
    batch = next(gpt.batches(gpt.corpus(), 8, cfg.seq))
    mode = "semi_auto_parallel" if annotate else "auto_parallel"
    return step, (params, opt_state, batch), dict(mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")),
                                                  parallel_mode=mode)


def _fsdp_case():
    """An Adam step of a transformer block with FSDP layouts pinned (tests/test_fsdp_pins.py)."""
    from tests.test_fsdp_pins import fsdp_block_case

    return fsdp_block_case()[:3]


def _mlp_case():
    params, x = models.init_mlp(jax.random.key(1))
    return jax.grad(models.mlp_loss), (params, x), dict(
        mesh=jaxpar.make_mesh((2, 4), ("dp", "mp")), parallel_mode="auto_parallel")


def _remat_case():
    """tests/test_recompute.py's step of 3 blocks (a backward add_any read by two
    contractions: without its constraint XLA ordered them the other way, 64 KiB more live)."""
    from tests import test_recompute as tr

    k = jax.random.split(jax.random.key(1), 2 * tr.LAYERS + 1)
    params = [{"w1": jax.random.normal(k[2 * i], (tr.D, tr.F)) * 0.1,
               "w2": jax.random.normal(k[2 * i + 1], (tr.F, tr.D)) * 0.1}
              for i in range(tr.LAYERS)]
    return tr.make_step(tr.block), (params, jax.random.normal(k[-1], (tr.BATCH, tr.D))), dict(
        mesh=jaxpar.make_mesh((8,), ("dp",)), parallel_mode="auto_parallel")


@pytest.mark.parametrize("case", ["gpt semi-auto", "gpt auto", "mlp auto", "fsdp pinned",
                                  "blocks auto"])
def test_pruned_constraints_compile_to_the_same_program(monkeypatch, tmp_path, case):
    """Left out are the constraints XLA's propagation derives anyway (elementwise runs and
    their last values, layouts that follow from the operands', values only returned): the
    partitioned program is the fully constrained one's, collectives and every instruction,
    with far fewer constraints to propagate (XLA's compile time grows with them:
    bench/first_call.py --compile)."""
    fn, args, options = {"gpt semi-auto": lambda: _gpt_case(True),
                         "gpt auto": lambda: _gpt_case(False),
                         "mlp auto": _mlp_case, "fsdp pinned": _fsdp_case,
                         "blocks auto": _remat_case}[case]()
    monkeypatch.setattr(jaxpar.config, "plan_cache_dir", str(tmp_path))  # one search
    full_step, full_n, full = _compiled(monkeypatch, fn, args, False, **options)
    step, n, pruned = _compiled(monkeypatch, fn, args, True, **options)
    assert step.plan(*args).decisions == full_step.plan(*args).decisions  # one plan
    assert n <= 0.6 * full_n
    assert _collectives(pruned) == _collectives(full) != []
    assert _instructions(pruned) == _instructions(full)
    # and scheduled alike: the same buffers live at once
    assert jaxpar.inspect.memory(pruned) == jaxpar.inspect.memory(full)
    ours, theirs = (c(*jax.device_put(args, c.input_shardings[0])) for c in (pruned, full))
    assert_tree_close(ours, theirs, rtol=0, atol=0)  # the same numbers
    if case in ("mlp auto", "fsdp pinned"):  # and those of one device: the gradients, or the
        want = fn(*args)  # loss (Adam's step of a near-zero gradient is its sign: not close)
        got, want = (ours[-1], want[-1]) if isinstance(want, tuple) else (ours, want)
        assert_tree_close(got, want, rtol=1e-4, atol=1e-5)
