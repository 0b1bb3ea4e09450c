"""Odd trees, vmap, donation, and misuse that must fail clearly."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from tests.helpers import enable_x64

pytestmark = pytest.mark.standard_promotion


def sgd_wrapped(ls=None, **kwargs):
    ls = lossscale.StaticLossScale(4.0) if ls is None else ls
    return lossscale.loss_scaled(
        optax.sgd(1.0), ls, require_scaled_by=False, **kwargs
    )


class TestOddTrees:
    def test_empty_params(self):
        tx = sgd_wrapped()
        state = tx.init({})
        updates, state = jax.jit(tx.update)({}, state, {})
        assert updates == {}
        assert bool(state.grads_finite)

    def test_complex_params(self):
        tx = sgd_wrapped()
        params = jnp.zeros(2, jnp.complex64)
        updates, state = tx.update(
            jnp.array([4 + 8j, -4j], jnp.complex64), tx.init(params), params
        )
        assert updates.dtype == jnp.complex64
        np.testing.assert_array_equal(updates, [-1 - 2j, 1j])
        bad = jnp.array([1j * jnp.inf, 0], jnp.complex64)
        updates, state = tx.update(bad, state, params)
        assert not bool(state.grads_finite)
        np.testing.assert_array_equal(updates, [0, 0])

    def test_float64_with_x64(self):
        with enable_x64():
            tx = sgd_wrapped()
            params = jnp.zeros(1, jnp.float64)
            g = jnp.array([4.0 * (1 + 2.0**-40)], jnp.float64)
            updates, _ = jax.jit(tx.update)(g, tx.init(params), params)
            assert updates.dtype == jnp.float64
            assert float(updates[0]) == -(1 + 2.0**-40)  # no float32 rounding

    def test_mixed_dtypes(self):
        tx = lossscale.loss_scaled(
            optax.adam(1e-3),
            lossscale.DynamicLossScale(2.0**8),
            require_scaled_by=False,
        )
        params = {
            "h": jnp.ones(3, jnp.float16),
            "b": jnp.ones(3, jnp.bfloat16),
            "f": jnp.ones(3, jnp.float32),
        }
        grads = jax.tree.map(lambda p: p * 256, params)
        updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
        assert {k: v.dtype for k, v in updates.items()} == {
            k: v.dtype for k, v in params.items()
        }
        assert bool(state.grads_finite)

    def test_grads_of_another_tree_fail_clearly(self):
        tx = lossscale.loss_scaled(
            optax.adam(1e-3),
            lossscale.StaticLossScale(4.0),
            require_scaled_by=False,
        )
        state = tx.init({"a": jnp.ones(1)})
        # With params, update itself names both structures.
        with pytest.raises(ValueError, match=r"PyTreeDef\(\{'b'.*'a'"):
            tx.update({"b": jnp.ones(1)}, state, {"a": jnp.ones(1)})
        # Without, the inner optimizer fails, with a note from the wrapper.
        with pytest.raises(ValueError) as info:
            tx.update({"b": jnp.ones(1)}, state, None)
        assert "structure of the params given to init" in "".join(
            getattr(info.value, "__notes__", [])
        )


def test_vmap_ensemble_each_member_own_scale():
    """vmap over a train step (an ensemble): every member scales alone.

    flax's DynamicScale breaks confusingly here (flax#4114); the state is a
    pytree of arrays, so vmap just batches it.
    """
    tx = lossscale.loss_scaled(
        optax.adam(0.1),
        lossscale.DynamicLossScale(2.0**8),
        require_scaled_by=False,
    )
    members = 4
    params = {"w": jnp.ones((members, 3))}
    state = jax.vmap(tx.init)(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grads = {"w": jnp.full((members, 3), 256.0).at[2, 1].set(jnp.nan)}
    new_params, new_state = jax.jit(jax.vmap(step))(params, state, grads)
    assert np.asarray(new_state.grads_finite).tolist() == [
        True,
        True,
        False,
        True,
    ]
    assert np.asarray(new_state.loss_scale.loss_scale).tolist() == [
        256.0,
        256.0,
        128.0,
        256.0,
    ]
    np.testing.assert_array_equal(new_params["w"][2], np.ones(3))
    assert not np.any(np.asarray(new_params["w"][0]) == 1.0)
    # A second call takes the batched state back.
    jax.jit(jax.vmap(step))(new_params, new_state, grads)


def test_vmap_per_example_gradients():
    tx = sgd_wrapped(lossscale.DynamicLossScale(2.0**4))
    params = jnp.zeros(2)
    state = tx.init(params)
    xs = jnp.arange(8.0).reshape(4, 2)
    scale = lossscale.get_loss_scale(state)
    per_example = jax.vmap(
        jax.grad(lambda p, x: scale.scale(jnp.sum(p * x))), in_axes=(None, 0)
    )(params, xs)
    updates, _ = tx.update(per_example.mean(0), state, params)
    np.testing.assert_array_equal(updates, -xs.mean(0))


def test_donated_buffers():
    tx = lossscale.loss_scaled(
        optax.adam(1e-2),
        lossscale.DynamicLossScale(2.0**8),
        require_scaled_by=False,
    )
    params = {"w": jnp.ones((16, 16))}

    @jax.jit
    def init(params):
        return tx.init(params)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(step, donate_argnums=(0, 1))
    state = init(params)
    good = {"w": jnp.full((16, 16), 256.0)}
    bad = {"w": good["w"].at[0, 0].set(jnp.inf)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "donated buffers not usable"
        for grads in (good, bad, good, bad, bad, good):
            old = params
            params, state = step(params, state, grads)
            assert old["w"].is_deleted()  # really donated
    assert int(state.skipped_steps) == 3
    assert bool(lossscale.all_finite(params))


class TestScaleInvariants:
    """The scale and its reciprocal stay normal float32 numbers, always."""

    @pytest.mark.parametrize("value", [2.0**-126, 2.0**126])
    def test_extreme_static_scales_unscale_to_normal_numbers(self, value):
        ls = lossscale.StaticLossScale(value)
        one = ls.unscale(ls.scale(jnp.float32(1.0)))
        assert float(one) == 1.0
        tiny = float(jnp.finfo(jnp.float32).tiny)
        assert tiny <= float(ls.unscale(jnp.float32(1.0))) < np.inf

    @pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 0.0, -3.0])
    def test_traced_dynamic_scale_is_clamped(self, bad):
        def make(v):
            ls = lossscale.DynamicLossScale(
                v, min_loss_scale=2.0, max_loss_scale=2.0**20
            )
            return ls.loss_scale, ls.adjust(jnp.bool_(False)).loss_scale

        initial, backed = jax.jit(make)(jnp.float32(bad))
        # NaN maps to the floor, like everything below it.
        want = 2.0**20 if bad == np.inf else 2.0
        assert float(initial) == want
        assert np.isfinite(float(backed)) and float(backed) >= 2.0

    def test_nan_scale_in_the_state_becomes_the_floor(self):
        ls = lossscale.DynamicLossScale(8.0, min_loss_scale=2.0)
        corrupt = jax.tree.map(
            lambda x: jnp.float32(np.nan) if x.dtype == np.float32 else x, ls
        )
        for finite in (True, False):
            out = jax.jit(lambda s, f: s.adjust(f))(corrupt, jnp.bool_(finite))
            assert float(out.loss_scale) == 2.0
            assert bool(out.metrics()["at_min_scale"])

    @pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, 1e-45])
    def test_traced_static_scale_is_clamped(self, bad):
        value = jax.jit(lambda v: lossscale.StaticLossScale(v).loss_scale)(
            jnp.float32(bad)
        )
        value = float(value)
        if np.isnan(bad):
            assert value == 1.0
        else:
            assert 2.0**-126 <= value <= 2.0**126


class TestOnMinScale:
    """on_min_scale="error" fires for scales that can never go lower."""

    @pytest.mark.parametrize(
        "ls",
        [lossscale.StaticLossScale(8.0), lossscale.NoOpLossScale()],
        ids=["static", "noop"],
    )
    def test_fires_after_patience_under_jit(self, ls):
        tx = lossscale.loss_scaled(
            optax.sgd(0.1),
            ls,
            on_min_scale="error",
            min_scale_patience=3,
            require_scaled_by=False,
        )
        params = jnp.zeros(2)
        state = tx.init(params)
        update = jax.jit(tx.update)
        bad = jnp.full(2, jnp.nan)
        for _ in range(2):  # below the patience: no error
            _, state = update(bad, state, params)
            jax.block_until_ready(state)
        assert int(state.consecutive_skips) == 2
        with pytest.raises(Exception, match="3 consecutive steps"):
            _, state = update(bad, state, params)
            jax.block_until_ready(state)

    def test_counts_only_skips_at_the_minimum(self):
        """The minimum scale is tried before the alarm fires.

        A float16 gradient of 60000 overflows at any scale above 1: the
        scale backs off 16 -> 8 -> 4 -> 2 -> 1 (four skips not at the
        minimum), and at 1 the step applies. No error.
        """
        tx = lossscale.loss_scaled(
            optax.sgd(1e-9),
            lossscale.DynamicLossScale(2.0**4),
            on_min_scale="error",
            min_scale_patience=3,
            require_scaled_by=False,
        )
        params = jnp.ones(2)
        state = tx.init(params)

        def loss(p, scale):
            return scale.scale(
                jnp.sum(p.astype(jnp.float16) * jnp.float16(60000.0))
            )

        for _ in range(6):
            scale = lossscale.get_loss_scale(state)
            grads = jax.grad(loss)(params, scale)
            _, state = tx.update(grads, state, params)
        assert int(state.skipped_steps) == 4
        assert int(lossscale.metrics(state)["min_scale_skips"]) == 0

    def test_a_group_at_its_minimum_counts_only_when_it_overflows(self):
        tx = lossscale.loss_scaled_by_group(
            optax.sgd(0.1),
            {
                "enc": lossscale.StaticLossScale(1.0),  # always at minimum
                "dec": lossscale.DynamicLossScale(2.0**24),
            },
            param_labels={"enc": "enc", "dec": "dec"},
            on_min_scale="error",
            min_scale_patience=2,
            require_scaled_by=False,
        )
        params = {"enc": jnp.ones(2), "dec": jnp.ones(2)}
        state = tx.init(params)
        bad = {"enc": jnp.ones(2), "dec": jnp.full(2, jnp.inf)}
        for _ in range(10):  # dec backs off; enc is finite: no alarm
            _, state = tx.update(bad, state, params)
        assert int(state.min_scale_skips) == 0
        worse = {"enc": jnp.full(2, jnp.nan), "dec": jnp.ones(2)}
        _, state = tx.update(worse, state, params)
        with pytest.raises(FloatingPointError, match="2 consecutive steps"):
            tx.update(worse, state, params)

    def test_metrics_say_static_scales_are_at_their_minimum(self):
        for ls in (lossscale.StaticLossScale(8.0), lossscale.NoOpLossScale()):
            tx = lossscale.loss_scaled(
                optax.sgd(0.1), ls, require_scaled_by=False
            )
            assert bool(
                lossscale.metrics(tx.init(jnp.zeros(1)))["at_min_scale"]
            )


def test_float16_parameters():
    """The documented limit: the inner optimizer's arithmetic is unchecked.

    With float16 parameters (hence a float16 Adam state), a finite gradient
    of 1e-4 squares to 0 in float16 and eps (1e-8) is 0 too: the update is
    inf, and it is applied. float32 master weights, given the very same
    float16 gradient, update finitely.
    """
    tx = lossscale.loss_scaled(
        optax.adam(1e-3),
        lossscale.StaticLossScale(1.0),
        require_scaled_by=False,
    )
    grads = jnp.full(3, 1e-4, jnp.float16)
    for dtype, finite_update in ((jnp.float16, False), (jnp.float32, True)):
        params = jnp.zeros(3, dtype)
        updates, state = jax.jit(tx.update)(
            grads.astype(dtype), tx.init(params), params
        )
        assert bool(state.grads_finite)  # the gradients were finite
        assert bool(jnp.isfinite(updates).all()) == finite_update, dtype


def test_a_static_scale_changed_in_the_state_is_still_checked():
    """The floor that decides what is checked is the state's, not init's.

    A static scale is a leaf: a checkpoint or a user may put 0.5 where 1.0
    was. Unscaling a finite float16 gradient by 0.5 then overflows: the
    step must be skipped, not applied with an inf update.
    """
    tx = lossscale.loss_scaled(
        optax.sgd(1e-3), lossscale.StaticLossScale(1.0), require_scaled_by=False
    )
    params = {"w": jnp.ones(2)}
    state = tx.init(params)._replace(loss_scale=lossscale.StaticLossScale(0.5))
    grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert not bool(state.grads_finite)
    np.testing.assert_array_equal(updates["w"], [0.0, 0.0])
