"""Shared test helpers."""

from __future__ import annotations

import jax
import numpy as np


def assert_tree_close(got, want, rtol=1e-5, atol=1e-5):
    g_leaves, g_tree = jax.tree.flatten(got)
    w_leaves, w_tree = jax.tree.flatten(want)
    assert g_tree == w_tree, (g_tree, w_tree)
    for g, w in zip(g_leaves, w_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


def shard_shape(array):
    """The shape of the piece one device holds."""
    return array.sharding.shard_shape(array.shape)
