"""all_finite and select_tree."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lossscale
from lossscale import _finite
from tests.helpers import enable_x64, set_mesh

FLOAT_DTYPES = [
    jnp.float16,
    jnp.bfloat16,
    jnp.float32,
    jnp.float8_e5m2,
    jnp.complex64,
]


class TestAllFinite:
    def test_eager_call_compiles_once_per_signature(self):
        # Eagerly, the check runs as one cached program, not one dispatch
        # (and first-time compile) per operation per leaf.
        compiled = _finite._check_compiled
        tree = {"a": jnp.ones((3, 5)), "b": jnp.ones(7, jnp.float16)}
        assert bool(lossscale.all_finite(tree))
        size = compiled._cache_size()
        tree["a"] = tree["a"].at[1, 2].set(jnp.nan)
        assert not bool(lossscale.all_finite(tree))
        assert compiled._cache_size() == size  # same signature: no compile
        tree["c"] = jnp.ones(2)
        assert not bool(lossscale.all_finite(tree))
        assert compiled._cache_size() == size + 1  # control: a new one

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


BRANCHES = {
    # On this 8-device test process the CPU branch reduces each leaf alone
    # (the types do not show how arrays are sharded); on one device of an
    # explicit mesh it reduces leaves of one shape together. Both run.
    "cpu": _finite._cpu_flags,
    "cpu, grouped": _finite._cpu_flags,
    "default": _finite._default_flags,
}


def one_device_mesh():
    explicit = jax.sharding.AxisType.Explicit
    return jax.make_mesh(
        (1,), ("one",), axis_types=(explicit,), devices=jax.devices()[:1]
    )


_JITTED = {
    branch: jax.jit(lambda *xs, fn=fn: jnp.stack(fn(list(xs))))
    for branch, fn in BRANCHES.items()
}


@pytest.mark.parametrize("branch", sorted(BRANCHES))
class TestBothBranches:
    """Each platform's check, run directly here on the CPU.

    ``lax.platform_dependent`` keeps only the branch of the platform it
    lowers for, so the default (GPU/TPU) branch never runs in the tests
    through ``all_finite`` on this machine: it is called directly.
    """

    def flags(self, branch, leaves):
        # One jitted function per branch, so that repeated signatures reuse
        # their compiled program.
        run = _JITTED[branch]
        if branch == "cpu, grouped":
            with set_mesh(one_device_mesh()):
                return run(*leaves)
        return run(*leaves)

    @pytest.mark.parametrize(
        "shape", [(1,), (1023,), (100_003,), (40, 37), (3, 40, 33), (8, 1000)]
    )
    def test_every_region_of_one_leaf(self, branch, shape):
        x = np.ones(shape, np.float32)
        assert self.flags(branch, [x]).tolist() == [True]
        last = tuple(n - 1 for n in shape)
        middle = tuple(n // 2 for n in shape)
        first = (0,) * len(shape)
        for pos, bad in [(first, np.nan), (middle, np.inf), (last, -np.inf)]:
            y = x.copy()
            y[pos] = bad
            assert self.flags(branch, [y]).tolist() == [False], pos

    @pytest.mark.parametrize("dtype", FLOAT_DTYPES)
    def test_dtypes(self, branch, dtype):
        leaves = [jnp.ones((4, 6), dtype) for _ in range(3)]
        leaves[1] = leaves[1].at[2, 3].set(jnp.asarray(np.nan).astype(dtype))
        assert self.flags(branch, leaves).tolist() == [True, False, True]

    @settings(max_examples=20, deadline=None)
    @given(data=st.data())
    def test_many_leaves_of_few_shapes_match_numpy(self, branch, data):
        # Repeated shapes make the CPU branch reduce leaves together, 16
        # small ones or 4 large ones (over 4096 elements) at a time.
        shapes = [(5,), (3, 4), (2000,), (33, 17), (70, 70), (5000,)]
        picks = data.draw(st.lists(st.sampled_from(shapes), max_size=40))
        leaves = [np.ones(shape, np.float32) for shape in picks]
        for i, x in enumerate(leaves):
            if data.draw(st.booleans(), label=f"bad{i}"):
                pos = data.draw(st.integers(0, x.size - 1), label=f"pos{i}")
                x.reshape(-1)[pos] = data.draw(
                    st.sampled_from([np.inf, -np.inf, np.nan]), label=f"v{i}"
                )
        want = [bool(np.isfinite(x).all()) for x in leaves]
        got = self.flags(branch, leaves).tolist() if leaves else []
        assert got == want


def test_cpu_branch_groups_leaves_of_one_shape_where_types_allow():
    leaves = [jnp.ones((65, 65)) for _ in range(8)] + [jnp.ones(5)] * 20

    def reductions(mesh):
        with set_mesh(mesh):
            jaxpr = jax.make_jaxpr(lambda *xs: _finite._cpu_flags(list(xs)))(
                *leaves
            )
        return sum(eqn.primitive.name == "reduce" for eqn in jaxpr.eqns)

    # 8 large leaves, 4 at a time; 20 small ones, 16 at a time.
    assert reductions(one_device_mesh()) == 2 + 2
    # Under automatic axes of 8 devices each leaf is reduced alone.
    auto = jax.sharding.AxisType.Auto
    assert reductions(jax.make_mesh((8,), ("x",), axis_types=(auto,))) == 28


def test_cpu_branch_materialises_nothing():
    """The CPU branch reads each gradient once and writes no temporary.

    Negative control: the plain reduction, which XLA's CPU backend splits
    into a windowed pre-reduction that writes a byte per element.
    """
    leaves = [jnp.ones((512, 256)), jnp.ones((512, 256)), jnp.ones(100_000)]
    size = sum(x.nbytes for x in leaves)

    def temp(branch):
        compiled = (
            jax.jit(lambda *xs: jnp.stack(branch([x * 2.0 for x in xs])))
            .lower(*leaves)
            .compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes / size

    assert temp(_finite._cpu_flags) < 0.001
    assert temp(_finite._default_flags) > 0.2


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
