"""User strategies drawn at random: the parallel program must compute what one device does.

For an MLP, a transformer block and a conv net, every parameter and input gets a random valid
strategy (a random set of mesh axes on random dimensions, each axis once, splits that divide),
given to ``parallelize`` as ``in_strategy`` in semi-automatic mode; propagation plans the rest.
Loss and gradients must equal the single-device results.
"""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar._src.spec import Spec
from tests import models
from tests.util import assert_tree_close


@st.composite
def partition_specs(draw, shape, mesh):
    """A valid PartitionSpec for ``shape`` on ``mesh``, or None (free)."""
    if draw(st.booleans()) and draw(st.booleans()):
        return None
    entries = [[] for _ in shape]
    sizes = [1] * len(shape)
    for axis, n in mesh.shape.items():
        dim = draw(st.integers(-1, len(shape) - 1))
        if dim >= 0 and shape[dim] % (sizes[dim] * n) == 0:
            entries[dim].append(axis)
            sizes[dim] *= n
    return P(*[tuple(e) if len(e) > 1 else (e[0] if e else None) for e in entries])


CASES = {
    "mlp": (models.init_mlp, models.mlp_loss),
    "block": (models.init_block, models.block_loss),
    "convnet": (models.init_convnet, models.convnet_loss),
}
MESH_SHAPES = {"2x4": ((2, 4), ("dp", "mp")), "4x2": ((4, 2), ("dp", "mp"))}


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", sorted(MESH_SHAPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_random_user_strategies_match_single_device(case, mesh_name):
    init, loss = CASES[case]
    params, x = init(jax.random.key(3))
    mesh = jaxpar.make_mesh(*MESH_SHAPES[mesh_name])
    grad_fn = jax.value_and_grad(loss)
    want = jax.jit(grad_fn)(params, x)
    leaves, tree = jax.tree.flatten((params, x))

    @settings(max_examples=3, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.tuples(*[partition_specs(np.shape(v), mesh) for v in leaves]))
    def check(specs):
        if all(s is None for s in specs):
            specs = (P(),) + specs[1:]  # propagation needs one pin
        in_strategy = jax.tree.unflatten(tree, specs)
        step = jaxpar.parallelize(grad_fn, mesh=mesh, parallel_mode="semi_auto_parallel",
                                  in_strategy=in_strategy)
        got = step(params, x)
        assert_tree_close(got, want, rtol=2e-4, atol=2e-5)
        # every pinned input really has the requested layout in the compiled program
        compiled = jax.tree.leaves(step.lower(params, x).compile().input_shardings[0])
        for spec, leaf, sharding in zip(specs, leaves, compiled, strict=True):
            if spec is not None:
                ndim = np.ndim(leaf)
                assert Spec.from_partition_spec(sharding.spec, ndim) == \
                    Spec.from_partition_spec(spec, ndim)

    check()
