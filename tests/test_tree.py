"""all_finite and select_tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from tests.helpers import enable_x64

FLOAT_DTYPES = [
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float8_e5m2,
    jnp.complex64,
]


class TestAllFinite:
    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    @pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
    def test_detects_each_bad_value(self, dtype, bad):
        x = jnp.ones((5, 7), dtype)
        assert bool(jax.jit(lossscale.all_finite)({"a": x}))
        y = x.at[3, 4].set(jnp.asarray(bad).astype(dtype))
        assert not bool(jax.jit(lossscale.all_finite)({"a": x, "b": y}))

    def test_complex_imaginary_inf(self):
        x = jnp.zeros(3, jnp.complex64).at[1].set(1j * jnp.inf)
        assert not bool(lossscale.all_finite(x))

    def test_float8_e4m3fn_overflow_is_nan(self):
        # e4m3fn has no inf: a value past its max (448) becomes NaN.
        x = (jnp.array([1.0, 1e4], jnp.float32)).astype(jnp.float8_e4m3fn)
        assert np.isnan(np.asarray(x.astype(jnp.float32))[1])
        assert not bool(lossscale.all_finite(x))
        assert bool(lossscale.all_finite(x[:1]))

    def test_large_finite_values_are_finite(self):
        # A sum of the values would overflow; the check must not.
        big = jnp.full((1000,), jnp.finfo(jnp.float16).max, jnp.float16)
        assert bool(lossscale.all_finite(big))
        assert bool(lossscale.all_finite(jnp.full(10, 3e38, jnp.float32)))

    def test_ignores_non_float_leaves(self):
        tree = {
            "i": jnp.array([2**31 - 1], jnp.int32),
            "b": jnp.array([True]),
            "key": jax.random.key(0),
            "n": None,
        }
        assert bool(lossscale.all_finite(tree))

    def test_python_and_numpy_leaves(self):
        assert bool(lossscale.all_finite([1.0, np.float32(2.0), np.ones(3)]))
        assert not bool(lossscale.all_finite([1.0, np.array([2.0, np.inf])]))
        assert not bool(lossscale.all_finite({"x": float("nan")}))

    def test_empty(self):
        for tree in ({}, [], None, {"a": jnp.zeros((0,))}):
            out = lossscale.all_finite(tree)
            assert out.dtype == jnp.bool_ and out.shape == ()
            assert bool(out)

    def test_float64(self):
        with enable_x64():
            x = jnp.array([1e300, 1e308], jnp.float64)
            assert bool(lossscale.all_finite(x))
            assert not bool(lossscale.all_finite(x * 10))


class TestCheckLayout:
    """On CPU the check reduces big leaves by rows, small ones together."""

    @pytest.mark.parametrize(
        "size", [1, 16, 1023, 1024, 1025, 1040, 16 * 1024 + 5, 100_003]
    )
    def test_every_position_of_a_leaf(self, size):
        check = jax.jit(lossscale.all_finite)
        x = jnp.ones(size, jnp.float32)
        assert bool(check(x))
        # first, middle, last of the row-reduced part, first of the tail
        for pos in {0, size // 2, size // 16 * 16 - 1, size - 1} - {-1}:
            assert not bool(check(x.at[pos].set(jnp.nan))), pos

    @pytest.mark.parametrize(
        "shape", [(40, 37), (16, 128), (37, 16), (3, 40, 33), (8, 1000)]
    )
    def test_every_region_of_a_wide_leaf(self, shape):
        # Tiles of 16 x 16 over the last two axes, then the rows and the
        # columns past the last whole tile; (8, 1000) is too thin for tiles.
        check = jax.jit(lossscale.all_finite)
        x = jnp.ones(shape, jnp.float32)
        assert bool(check(x))
        *lead, a, b = shape
        corner = tuple(n - 1 for n in lead)
        last_tile = (a // 16 * 16 - 1, b // 16 * 16 - 1)
        corners = [(0, 0), (a - 1, 0), (0, b - 1), (a - 1, b - 1)]
        for i, j in [*corners, (a // 2, b // 2), last_tile]:
            bad = x.at[(*corner, i, j)].set(jnp.inf)
            assert not bool(check(bad)), (i, j)

    def test_each_of_many_leaves(self):
        sizes = [1, 7, 64, 1024, 1025, 3, 500, 2048, 9, 1000, 77, 5000, 2]
        tree = [jnp.ones((n,), jnp.float32) for n in sizes]
        check = jax.jit(lossscale.all_finite)
        assert bool(check(tree))
        for i, n in enumerate(sizes):
            bad = list(tree)
            bad[i] = bad[i].at[n - 1].set(-jnp.inf)
            assert not bool(check(bad)), i

    @settings(max_examples=25, deadline=None)
    @given(
        sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=12),
        data=st.data(),
    )
    def test_matches_numpy(self, sizes, data):
        leaves = [np.ones(n, np.float32) for n in sizes]
        for i, n in enumerate(sizes):
            if n and data.draw(st.booleans(), label=f"bad{i}"):
                pos = data.draw(st.integers(0, n - 1), label=f"pos{i}")
                leaves[i][pos] = np.inf
        want = all(np.isfinite(x).all() for x in leaves)
        assert bool(jax.jit(lossscale.all_finite)(leaves)) == want


class TestSelectTree:
    def test_selects(self):
        a = {"x": jnp.ones(2, jnp.float16), "n": jnp.int32(1)}
        b = {"x": jnp.zeros(2, jnp.float16), "n": jnp.int32(2)}
        out = jax.jit(lossscale.select_tree)(jnp.bool_(True), a, b)
        assert out["x"].tolist() == [1.0, 1.0]
        assert out["x"].dtype == jnp.float16
        out = lossscale.select_tree(False, a, b)
        assert int(out["n"]) == 2

    def test_rejects_non_scalar_pred(self):
        a = jnp.ones(2)
        with pytest.raises(ValueError, match="pred must be a boolean scalar"):
            lossscale.select_tree(jnp.array([True, False]), a, a)
        with pytest.raises(TypeError, match="pred must be a boolean scalar"):
            lossscale.select_tree(jnp.float32(1.0), a, a)
        with pytest.raises(TypeError, match="pred must be a boolean scalar"):
            lossscale.select_tree(1, a, a)

    def test_rejects_mismatch(self):
        with pytest.raises(ValueError, match="same tree structure"):
            lossscale.select_tree(True, {"a": 1.0}, {"b": 1.0})
        with pytest.raises(TypeError, match=r"equal dtypes.*\['a'\]"):
            lossscale.select_tree(
                True, {"a": jnp.ones(1)}, {"a": jnp.ones(1, jnp.float16)}
            )
        with pytest.raises(ValueError, match="equal shapes"):
            lossscale.select_tree(True, jnp.ones(1), jnp.ones(2))
