"""Shared test helpers."""

from __future__ import annotations

import jax
import numpy as np

# For the tests that start Python processes (the examples, the multi-process jobs): XLA:CPU's
# LLVM back end at -O0.  XLA's HLO passes are unchanged (the partitioned program, its
# collectives and buffers); only the machine code is less optimised, and it compiles faster:
# examples/gpt_3d.py --smoke spent 30 CPU s instead of 44 past its imports, and those processes
# run each program a step or two.  Every number such a test compares comes from programs
# compiled alike (the examples check themselves against one device in the same process).
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def assert_tree_close(got, want, rtol=1e-5, atol=1e-5):
    g_leaves, g_tree = jax.tree.flatten(got)
    w_leaves, w_tree = jax.tree.flatten(want)
    assert g_tree == w_tree, (g_tree, w_tree)
    for g, w in zip(g_leaves, w_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def shard_shape(array):
    """The shape of the piece one device holds."""
    return array.sharding.shard_shape(array.shape)
