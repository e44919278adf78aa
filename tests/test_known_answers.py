"""Known answers from public suites, in every search mode, checked on the compiled program.

Each case names its source: Alpa's ``tests/shard_parallel`` (``test_mlp.py``, ``test_bert.py``,
``test_conv.py``; the same shapes where they fit) and the JAX scaling book (tensor parallelism on
the fast links, data parallelism across the slow ones).  Every case asserts, per search mode,
the collectives of the compiled (partitioned, combined) program by kind and mesh axes, and that
the plan predicted exactly those.  Plans are priced with the ``cpu`` profile, the machine the
tests compile for (its combiner is XLA:CPU's); the two-axis cases slow one axis down.
"""

import collections

import jax
import pytest
from jax.sharding import PartitionSpec as P

import jaxpar
from tests import auto_models as am
from tests.util import assert_tree_close

MODES = ("recursive_programming", "dynamic_programming", "optimal")
CPU = jaxpar.HardwareProfile()
MESHES = {"4": ((4,), ("x",)), "1x4": ((1, 4), ("a", "x")), "4x1": ((4, 1), ("x", "a")),
          "2x4": ((2, 4), ("a", "x"))}


def _plans(fn, args, mesh, hw=CPU):
    """Per mode: the compiled program, its plan and its collectives (compiled once per distinct
    plan)."""
    out, compiled = {}, {}
    for mode in MODES:
        f = jaxpar.parallelize(fn, mesh=mesh, parallel_mode="auto_parallel", search_mode=mode,
                               hardware=hw)
        plan = f.plan(*args)
        key = tuple((d.in_specs, d.out_specs) for d in plan.decisions)
        if key not in compiled:
            program = f.lower(*args).compile()
            compiled[key] = (program, jaxpar.inspect.collectives(program))
        out[mode] = (compiled[key][0], plan, compiled[key][1])
    return out


def _by_kind_and_axes(items) -> dict:
    table: dict = collections.defaultdict(float)
    for kind, axes, count in items:
        table[(kind, tuple(sorted(axes)))] += count
    return dict(table)


def _check(plans, expected, **kw):
    """Every mode's compiled collectives are ``expected`` ({(kind, axes): count}) and the plan
    predicted them."""
    for mode, (_, plan, colls) in plans.items():
        compiled = _by_kind_and_axes((r.kind, r.axes or (), r.count) for r in colls)
        predicted = _by_kind_and_axes((c.kind, c.axes, c.count)
                                      for c in plan.predicted_collectives())
        assert compiled == expected, (mode, compiled, colls.table())
        assert predicted == compiled, (mode, predicted, compiled)


def _kernels(plan):
    return [spec for name, spec in plan.input_layouts().items()
            if name.startswith("params.") and name.endswith("kernel.value")]


@pytest.mark.parametrize("mesh_name", ["4", "1x4", "4x1", "2x4"])
def test_small_weights_and_a_large_batch_are_data_parallel_with_one_all_reduce(mesh_name):
    """Alpa ``test_mlp.py::test_n_layer_mlp_data_parallel``: 6 layers, 32 wide, batch 256."""
    shape, names = MESHES[mesh_name]
    mesh = jaxpar.make_mesh(shape, names)
    split = tuple(sorted(n for n, s in zip(names, shape, strict=True) if s > 1))
    step, args = am.flax_mlp_adam(batch=256, hidden=32)
    plans = _plans(step, args, mesh)
    _check(plans, {("all-reduce", split): 1})
    for _, plan, _ in plans.values():
        layouts = plan.input_layouts()
        assert all(s == P() for n, s in layouts.items() if n.startswith("params."))
        # The batch split (or whole and sliced on each device: the same cost).
        assert tuple(sorted(a for e in layouts["x"] if e for a in
                            ((e,) if isinstance(e, str) else e))) in (split, ())
        assert plan.objective_s == pytest.approx(plan.baseline_s)  # the search found it
    if mesh_name == "4":  # the case: data parallel's summary predicts one all-reduce
        dp = jaxpar.parallelize(step, mesh=mesh, parallel_mode="data_parallel", hardware=CPU)
        assert dp.plan(*args).summary()["collectives"]["all-reduce"]["count"] == 1
        program = plans["recursive_programming"][0]
        assert_tree_close(program(*args), jax.jit(step)(*args), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("mesh_name", ["4", "1x4", "4x1"])
def test_large_weights_and_a_small_batch_are_megatron_with_l_minus_one_all_reduces(mesh_name):
    """Alpa ``test_mlp.py::test_n_layer_mlp_model_parallel``: 6 layers, 256 wide, batch 32:
    columns and rows alternate, L - 1 = 5 all-reduces (3 forward, 2 backward)."""
    shape, names = MESHES[mesh_name]
    step, args = am.flax_mlp_adam(batch=32, hidden=256)
    plans = _plans(step, args, jaxpar.make_mesh(shape, names))
    _check(plans, {("all-reduce", ("x",)): 5})
    for _, plan, _ in plans.values():
        assert _kernels(plan) == [P(None, "x"), P("x")] * 3
    if mesh_name == "4":
        program = plans["optimal"][0]
        assert_tree_close(program(*args), jax.jit(step)(*args), rtol=1e-3, atol=1e-5)


def test_transformer_layers_are_megatron_attention_and_mlp():
    """Alpa ``test_bert.py::test_bert_layer_model_parallel``: 2 BERT layers, hidden 128, batch
    8, sequence 8 on 4 devices: query, key, value and the MLP's first kernel split by columns,
    the attention output and the MLP's second kernel by rows; 4 L - 1 = 7 all-reduces."""
    step, args = am.bert_stack(layers=2, batch=8, seq=8, hidden=128, heads=8)
    plans = _plans(step, args, jaxpar.make_mesh((4,), ("x",)))
    _check(plans, {("all-reduce", ("x",)): 7})
    for _, plan, _ in plans.values():
        layouts = plan.input_layouts()
        for layer in range(2):
            for name in ("query", "key", "value", "intermediate"):
                assert layouts[f"params.{layer}.{name}.kernel"] == P(None, "x"), name
            for name in ("attention_out", "output"):
                assert layouts[f"params.{layer}.{name}.kernel"] == P("x"), name


@pytest.mark.parametrize("fast", ["a", "x"])
def test_unequal_links_put_tensor_parallel_on_the_fast_axis(fast):
    """Alpa ``test_mlp.py::test_n_layer_mlp_2d_mesh`` (one axis ten times faster: Megatron
    on it, data parallel on the other, L = 6 all-reduces) and the JAX scaling book (tensor
    parallelism inside the fast domain, data parallelism across), with either axis fast."""
    slow = "x" if fast == "a" else "a"
    hw = jaxpar.HardwareProfile(axis_bandwidth={fast: 1e8, slow: 1e7})
    step, args = am.flax_mlp_adam(batch=256, hidden=32)
    plans = _plans(step, args, jaxpar.make_mesh((2, 4), ("a", "x")), hw)
    _check(plans, {("all-reduce", (fast,)): 5, ("all-reduce", (slow,)): 1})
    for _, plan, _ in plans.values():
        assert _kernels(plan) == [P(None, fast), P(fast)] * 3


@pytest.mark.parametrize("mesh_name", ["4", "2x4"])
def test_conv_net_splits_the_batch(mesh_name):
    """Alpa ``test_conv.py::test_n_layer_conv_data_parallel`` (without batch norm): the batch
    split, the weights replicated, one all-reduce of the gradients."""
    shape, names = MESHES[mesh_name]
    split = tuple(sorted(n for n, s in zip(names, shape, strict=True) if s > 1))
    step, args = am.convnet()
    plans = _plans(step, args, jaxpar.make_mesh(shape, names))
    _check(plans, {("all-reduce", split): 1})
    for _, plan, _ in plans.values():
        layouts = plan.input_layouts()
        assert all(s == P() for n, s in layouts.items() if n.startswith("params."))


@pytest.mark.parametrize("names", [("mp", "dp"), ("dp", "mp")])
def test_equal_axes_follow_their_names(names):
    """Two interchangeable axes: the weights go on the one named like the model, the batch on
    the one named like the data, whatever their order (the plan costs the same either way)."""
    hw = jaxpar.HardwareProfile(intra_node_bandwidth=1e7, inter_node_bandwidth=1e7)
    step, args = am.flax_mlp_adam(batch=128, hidden=64)
    mesh = jaxpar.make_mesh((2, 2), names)
    for mode in MODES:
        plan = jaxpar.parallelize(step, mesh=mesh, parallel_mode="auto_parallel",
                                  search_mode=mode, hardware=hw).plan(*args)
        assert _kernels(plan) == [P(None, "mp"), P("mp")] * 3, mode
        assert plan.input_layouts()["x"] in (P("dp"), P()), mode
