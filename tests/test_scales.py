"""Loss-scale states: semantics, dtypes, pytree behaviour."""

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale
from tests.helpers import enable_x64

T, F = True, False


def run_adjust(ls, pattern):
    """Scales after each step of ``pattern``, under jit and lax.scan."""

    def body(state, finite):
        state = state.adjust(finite)
        return state, (
            state.loss_scale,
            state.growth_tracker,
            state.hysteresis_tracker,
        )

    final, (scales, growth, hyst) = jax.jit(
        lambda s, p: jax.lax.scan(body, s, p)
    )(ls, jnp.asarray(pattern, jnp.bool_))
    return final, np.asarray(scales).tolist(), growth, hyst


class TestDynamicAdjust:
    def test_grows_on_every_interval_th_finite_step(self):
        ls = lossscale.DynamicLossScale(8.0, growth_interval=2)
        _, scales, growth, _ = run_adjust(ls, [T] * 6)
        assert scales == [8, 16, 16, 32, 32, 64]
        assert growth.tolist() == [1, 0, 1, 0, 1, 0]

    def test_interval_one_grows_every_step(self):
        ls = lossscale.DynamicLossScale(1.0, growth_interval=1)
        _, scales, _, _ = run_adjust(ls, [T] * 4)
        assert scales == [2, 4, 8, 16]

    def test_backoff_on_every_overflow_resets_growth(self):
        ls = lossscale.DynamicLossScale(64.0, growth_interval=3)
        # T T F: the tracker resets, so growth needs three more clean steps.
        _, scales, growth, _ = run_adjust(ls, [T, T, F, T, T, T, F, F])
        assert scales == [64, 64, 32, 32, 32, 64, 32, 16]
        assert growth.tolist() == [1, 2, 0, 1, 2, 0, 0, 0]

    def test_custom_factors(self):
        ls = lossscale.DynamicLossScale(
            100.0, growth_interval=1, growth_factor=3.0, backoff_factor=0.25
        )
        _, scales, _, _ = run_adjust(ls, [T, F, F])
        assert scales == [300, 75, 18.75]

    def test_hysteresis_megatron(self):
        # Megatron-LM: each overflow decrements the tracker and resets the
        # growth counter; back off once the tracker is exhausted, then on
        # every overflow until a growth refills it.
        ls = lossscale.DynamicLossScale(1024.0, growth_interval=2, hysteresis=3)
        pattern = [F, F, F, F, T, T, F, T, F, F, F]
        _, scales, growth, hyst = run_adjust(ls, pattern)
        assert scales == [
            1024,
            1024,
            512,
            256,  # 3rd and 4th overflow back off
            256,
            512,  # growth refills the tracker to 3
            512,
            512,
            512,
            256,  # two tolerated (non-consecutive)
            128,
        ]
        assert hyst.tolist() == [2, 1, 0, 0, 0, 3, 2, 2, 1, 0, 0]
        assert growth.tolist() == [0, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0]

    def test_hysteresis_one_is_pytorch(self):
        pattern = [T, F, T, T, F, F, T, T, T]
        a = lossscale.DynamicLossScale(16.0, growth_interval=2)
        b = lossscale.DynamicLossScale(16.0, growth_interval=2, hysteresis=1)
        assert run_adjust(a, pattern)[1] == run_adjust(b, pattern)[1]
        assert run_adjust(a, pattern)[1] == [16, 8, 8, 16, 8, 4, 4, 8, 8]

    def test_clamped_to_min_and_max(self):
        ls = lossscale.DynamicLossScale(
            4.0, growth_interval=1, min_loss_scale=2.0, max_loss_scale=16.0
        )
        _, scales, _, _ = run_adjust(ls, [F, F, F, T, T, T, T, T])
        assert scales == [2, 2, 2, 4, 8, 16, 16, 16]

    def test_growth_past_the_largest_scale_is_clamped(self):
        ls = lossscale.DynamicLossScale(
            2.0**125, growth_interval=1, max_loss_scale=2.0**126
        )
        _, scales, _, _ = run_adjust(ls, [T, T])
        assert scales == [2.0**126, 2.0**126]
        assert 1 / np.float32(scales[-1]) == np.float32(2.0**-126)  # normal

    def test_scale_never_zero_with_tiny_min(self):
        tiny = float(jnp.finfo(jnp.float32).tiny)
        ls = lossscale.DynamicLossScale(1.0, min_loss_scale=tiny)
        _, scales, _, _ = run_adjust(ls, [F] * 300)
        assert scales[-1] == pytest.approx(tiny)
        assert min(scales) > 0

    def test_powers_of_two_stay_exact(self):
        rng = np.random.default_rng(0)
        pattern = rng.random(500) < 0.7
        ls = lossscale.DynamicLossScale(2.0**10, growth_interval=3)
        _, scales, _, _ = run_adjust(ls, pattern)
        exps = np.log2(scales)
        np.testing.assert_array_equal(exps, np.round(exps))

    def test_state_dtypes_pinned(self):
        ls = lossscale.DynamicLossScale()
        for state in (
            ls,
            ls.adjust(True),
            jax.jit(lambda s: s.adjust(False))(ls),
        ):
            assert jnp.asarray(state.loss_scale).dtype == jnp.float32
            assert jnp.asarray(state.growth_tracker).dtype == jnp.int32
            assert jnp.asarray(state.hysteresis_tracker).dtype == jnp.int32
            assert np.shape(state.loss_scale) == ()

    def test_python_bool_accepted(self):
        ls = lossscale.DynamicLossScale(8.0, growth_interval=1)
        assert float(ls.adjust(True).loss_scale) == 16.0
        assert float(ls.adjust(False).loss_scale) == 4.0


class TestPytree:
    CONFIG: typing.ClassVar[dict] = dict(
        growth_interval=7,
        growth_factor=4.0,
        backoff_factor=0.125,
        min_loss_scale=0.5,
        max_loss_scale=2.0**20,
        hysteresis=3,
    )

    def assert_config(self, ls):
        for name, value in self.CONFIG.items():
            assert getattr(ls, name) == value, name

    def test_leaves_and_static_fields(self):
        ls = lossscale.DynamicLossScale(64.0, **self.CONFIG)
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_leaves_with_path(ls)
        ]
        assert paths == [
            ".loss_scale",
            ".growth_tracker",
            ".hysteresis_tracker",
        ]
        # Every dataclass field is either a leaf or static: none is dropped.
        import dataclasses

        names = {f.name for f in dataclasses.fields(ls)}
        assert names == {
            "loss_scale",
            "growth_tracker",
            "hysteresis_tracker",
            *self.CONFIG,
        }

    def test_config_survives_jit_tree_map_and_unflatten(self):
        ls = lossscale.DynamicLossScale(64.0, **self.CONFIG)
        self.assert_config(jax.jit(lambda s: s)(ls))
        self.assert_config(jax.tree.map(lambda x: x, ls))
        leaves, treedef = jax.tree.flatten(ls)
        self.assert_config(jax.tree.unflatten(treedef, leaves))
        # Many overflows under jit end at this min, not a default of 1.0.
        final, _, _, _ = run_adjust(ls, [F] * 40)
        assert float(final.loss_scale) == 0.5
        self.assert_config(final)

    def test_static_scale_value_does_not_retrace(self):
        traces = []

        @jax.jit
        def f(ls, x):
            traces.append(None)
            return ls.scale(x)

        x = jnp.float32(3.0)
        assert float(f(lossscale.StaticLossScale(2.0), x)) == 6.0
        assert float(f(lossscale.StaticLossScale(8.0), x)) == 24.0
        assert len(traces) == 1

    def test_dynamic_second_call_does_not_retrace(self):
        traces = []

        @jax.jit
        def f(ls, finite):
            traces.append(None)
            return ls.adjust(finite)

        ls = lossscale.DynamicLossScale()
        ls = f(ls, jnp.bool_(True))
        ls = f(ls, jnp.bool_(False))
        ls = f(lossscale.DynamicLossScale(4.0), jnp.bool_(True))
        assert len(traces) == 1

    def test_different_config_is_a_different_treedef(self):
        a = jax.tree.structure(lossscale.DynamicLossScale(growth_interval=2))
        b = jax.tree.structure(lossscale.DynamicLossScale(growth_interval=3))
        assert a != b

    def test_noop_has_no_leaves(self):
        assert jax.tree.leaves(lossscale.NoOpLossScale()) == []

    def test_immutable(self):
        ls = lossscale.DynamicLossScale()
        with pytest.raises(AttributeError):
            ls.loss_scale = 3.0  # type: ignore[misc]

    def test_protocol(self):
        for ls in (
            lossscale.NoOpLossScale(),
            lossscale.StaticLossScale(2.0),
            lossscale.DynamicLossScale(),
        ):
            assert isinstance(ls, lossscale.LossScale)
            assert jnp.asarray(ls.loss_scale).dtype == jnp.float32
            assert type(ls.adjust(True)) is type(ls)


class TestScaleUnscale:
    @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
    def test_scale_loss_in_float32(self, dtype):
        ls = lossscale.StaticLossScale(2.0**17)
        loss = jnp.asarray(1.0, dtype)
        scaled = ls.scale(loss)
        assert scaled.dtype == jnp.float32
        # 2**17 overflows float16 (max 65504); in float32 it does not.
        assert float(scaled) == 2.0**17

    @pytest.mark.parametrize(
        "dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64]
    )
    def test_unscale_keeps_dtype(self, dtype):
        ls = lossscale.DynamicLossScale(2.0**12)
        g = jnp.asarray([4096.0, 8192.0, -2048.0], dtype)
        out = ls.unscale(g)
        assert out.dtype == dtype
        np.testing.assert_array_equal(
            np.asarray(out.astype(jnp.complex64)), [1.0, 2.0, -0.5]
        )

    def test_unscale_computes_in_float32(self):
        # Every float16 in [1, 2) divided by 3: rounding once from float32
        # matches the exact quotient; a float16 product rounds twice and
        # misses often (the negative control).
        x = np.arange(1024, dtype=np.float16) / np.float16(1024) + 1
        exact = (x.astype(np.float64) / 3.0).astype(np.float16)
        ours = np.asarray(
            lossscale.StaticLossScale(3.0).unscale(jnp.asarray(x))
        )
        assert ours.dtype == np.float16
        in_f16 = x * np.float16(1 / 3)
        assert (in_f16 != exact).sum() > 100
        assert (ours != exact).sum() == 0

    def test_non_float_leaves_pass_through(self):
        ls = lossscale.StaticLossScale(8.0)
        key = jax.random.key(0)
        tree = {
            "i": jnp.arange(3, dtype=jnp.int32),
            "b": jnp.array([True, False]),
            "key": key,
            "none": None,
            "f": jnp.ones(2, jnp.bfloat16),
        }
        for fn in (ls.scale, ls.unscale):
            out = fn(tree)
            assert out["i"] is tree["i"]
            assert out["b"] is tree["b"]
            assert out["key"] is key
            assert out["none"] is None
        assert ls.unscale(tree)["f"].tolist() == [0.125, 0.125]

    def test_noop_is_identity(self):
        ls = lossscale.NoOpLossScale()
        g = {"a": jnp.ones(2, jnp.float16)}
        assert ls.scale(g) is g
        assert ls.unscale(g) is g
        assert float(ls.loss_scale) == 1.0

    def test_float64_with_x64(self):
        with enable_x64():
            ls = lossscale.StaticLossScale(4.0)
            g = jnp.asarray([1.0 + 2.0**-40], jnp.float64)
            out = ls.unscale(ls.scale(g))
            assert out.dtype == jnp.float64
            # computed in float64, not rounded through float32
            assert float(out[0]) == 1.0 + 2.0**-40

    def test_float8(self):
        ls = lossscale.StaticLossScale(16.0)
        for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
            g = jnp.asarray([32.0, 8.0], dtype)
            out = ls.unscale(g)
            assert out.dtype == dtype
            assert out.astype(jnp.float32).tolist() == [2.0, 0.5]
