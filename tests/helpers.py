"""Assertions shared by the tests."""

import jax
import numpy as np


def assert_trees_bitwise_equal(a, b):
    """Same structure, and every leaf the same dtype, shape and bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def enable_x64():
    """A context with float64 enabled, on every supported jax version."""
    if hasattr(jax, "enable_x64"):  # jax >= 0.8
        return jax.enable_x64(True)
    from jax.experimental import enable_x64 as legacy

    return legacy(True)
