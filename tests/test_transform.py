"""The optax wrapper: exact updates, skipping, dtypes, composition."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from tests.helpers import assert_trees_bitwise_equal, loss_scaled

SKIP_IMPLS = ["select", "cond"]


def make(inner, ls, impl, **kwargs):
    """The optimizer these tests feed hand-made scaled gradients to."""
    return loss_scaled(inner, ls, impl=impl, require_scaled_by=False, **kwargs)


@pytest.mark.parametrize("impl", SKIP_IMPLS)
class TestUpdate:
    def test_sgd_exact_values(self, impl):
        tx = make(optax.sgd(1.0), lossscale.StaticLossScale(8.0), impl)
        params = {"w": jnp.array([1.0, 2.0]), "b": jnp.array(0.5)}
        state = tx.init(params)
        scaled = {"w": jnp.array([8.0, -16.0]), "b": jnp.array(4.0)}
        updates, state = jax.jit(tx.update)(scaled, state, params)
        new = optax.apply_updates(params, updates)
        assert new["w"].tolist() == [0.0, 4.0]
        assert new["b"].tolist() == 0.0
        assert bool(state.grads_finite)
        assert int(state.skipped_steps) == 0

    def test_real_training_loop(self, impl):
        # The canonical loop: scale the loss, unscale in the wrapper.
        tx = make(
            optax.sgd(0.5),
            lossscale.DynamicLossScale(2.0**10, growth_interval=2),
            impl,
        )
        params = {"w": jnp.array([1.0, -3.0])}
        state = tx.init(params)

        @jax.jit
        def step(params, state):
            scale = lossscale.get_loss_scale(state)
            grads = jax.grad(lambda p: scale.scale(jnp.sum(p["w"] ** 2)))(
                params
            )
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        params, state = step(params, state)
        # w - 0.5 * 2w = 0, exactly, with the scale divided back out.
        assert params["w"].tolist() == [0.0, 0.0]
        params, state = step(params, state)
        m = lossscale.metrics(state)
        assert float(m["loss_scale"]) == 2.0**11  # grew on the 2nd step

    @pytest.mark.standard_promotion
    def test_skip_leaves_params_and_adam_state_bitwise(self, impl):
        tx = make(optax.adam(1e-2), lossscale.DynamicLossScale(4.0), impl)
        params = {"w": jnp.array([1.0, 2.0, 3.0]), "n": jnp.arange(2.0)}
        state = tx.init(params)
        update = jax.jit(tx.update)
        good = {"w": jnp.array([4.0, -4.0, 8.0]), "n": jnp.array([1.0, 2.0])}
        updates, state = update(good, state, params)
        params = optax.apply_updates(params, updates)
        before_params, before_state = params, state

        for bad_value in (jnp.inf, -jnp.inf, jnp.nan):
            bad = {"w": good["w"].at[1].set(bad_value), "n": good["n"]}
            updates, new_state = update(bad, state, params)
            for u in jax.tree.leaves(updates):
                assert not np.any(np.asarray(u))  # zero updates
            new_params = optax.apply_updates(params, updates)
            assert_trees_bitwise_equal(new_params, before_params)
            assert_trees_bitwise_equal(
                new_state.inner_state, before_state.inner_state
            )
            assert not bool(new_state.grads_finite)
            assert float(new_state.loss_scale.loss_scale) == 2.0

        # Negative control: a finite step does change params and the state.
        updates, after = update(good, state, params)
        assert int(after.inner_state[0].count) == 2
        assert not np.array_equal(
            optax.apply_updates(params, updates)["w"], params["w"]
        )

    def test_skip_counters(self, impl):
        tx = make(optax.sgd(1.0), lossscale.NoOpLossScale(), impl)
        params = jnp.zeros(2)
        state = tx.init(params)
        update = jax.jit(tx.update)
        seen = []
        for g in [1.0, jnp.inf, jnp.nan, 1.0, jnp.inf]:
            _, state = update(jnp.full(2, g), state, params)
            m = lossscale.metrics(state)
            seen.append(
                (
                    bool(m["grads_finite"]),
                    int(m["skipped_steps"]),
                    int(m["consecutive_skips"]),
                )
            )
        assert seen == [
            (True, 0, 0),
            (False, 1, 1),
            (False, 2, 2),
            (True, 2, 0),
            (False, 3, 1),
        ]

    @pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
    @pytest.mark.standard_promotion
    def test_dtypes_preserved(self, impl, dtype):
        tx = make(optax.adam(1e-3), lossscale.DynamicLossScale(), impl)
        params = {"a": jnp.ones(4, dtype), "b": jnp.ones((2, 2), jnp.float32)}
        state = tx.init(params)
        grads = jax.tree.map(lambda p: p * 1024, params)
        updates, new_state = jax.jit(tx.update)(grads, state, params)
        assert updates["a"].dtype == dtype
        assert updates["b"].dtype == jnp.float32
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        assert [jnp.result_type(x) for x in jax.tree.leaves(new_state)] == [
            jnp.result_type(x) for x in jax.tree.leaves(state)
        ]

    @pytest.mark.standard_promotion
    def test_no_recompilation(self, impl):
        tx = make(optax.adamw(1e-3), lossscale.DynamicLossScale(), impl)
        params = {"w": jnp.ones((3, 2), jnp.float16), "b": jnp.zeros(2)}
        traces = []

        @jax.jit
        def step(params, state, grads):
            traces.append(None)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        state = tx.init(params)
        grads = jax.tree.map(jnp.ones_like, params)
        for _ in range(3):
            params, state = step(params, state, grads)
        bad = jax.tree.map(lambda g: g * jnp.inf, grads)
        params, state = step(params, state, bad)
        assert len(traces) == 1

    def test_integer_and_none_leaves(self, impl):
        tx = make(
            optax.masked(optax.sgd(1.0), {"f": True, "i": False, "z": False}),
            lossscale.StaticLossScale(2.0),
            impl,
        )
        params = {"f": jnp.ones(2), "i": jnp.arange(2), "z": None}
        state = tx.init(params)
        grads = {"f": jnp.full(2, 4.0), "i": jnp.arange(2), "z": None}
        updates, state = jax.jit(tx.update)(grads, state, params)
        assert updates["f"].tolist() == [-2.0, -2.0]
        assert updates["i"].dtype == jnp.int32
        assert updates["z"] is None
        assert bool(state.grads_finite)

    def test_mask_excludes_leaves(self, impl):
        # "meta" holds float8-style metadata: neither unscaled nor checked.
        params = {"w": jnp.ones(2), "meta": jnp.ones(2)}
        mask = {"w": True, "meta": False}
        tx = make(
            optax.sgd(1.0), lossscale.StaticLossScale(4.0), impl, mask=mask
        )
        state = tx.init(params)
        grads = {"w": jnp.full(2, 8.0), "meta": jnp.array([3.0, jnp.inf])}
        updates, state = jax.jit(tx.update)(grads, state, params)
        assert bool(state.grads_finite)
        assert updates["w"].tolist() == [-2.0, -2.0]
        assert updates["meta"].tolist() == [-3.0, -jnp.inf]
        # Negative control: without the mask, the inf skips the step.
        tx = make(optax.sgd(1.0), lossscale.StaticLossScale(4.0), impl)
        _, state = jax.jit(tx.update)(grads, tx.init(params), params)
        assert not bool(state.grads_finite)

    def test_callable_and_prefix_mask(self, impl):
        params = {"enc": {"a": jnp.ones(1), "b": jnp.ones(1)}, "x": jnp.ones(1)}
        grads = {
            "enc": {"a": jnp.full(1, 4.0), "b": jnp.full(1, 4.0)},
            "x": jnp.full(1, 4.0),
        }
        for mask in (
            {"enc": False, "x": True},
            lambda g: {"enc": False, "x": True},
        ):
            tx = make(
                optax.sgd(1.0), lossscale.StaticLossScale(4.0), impl, mask=mask
            )
            updates, _ = tx.update(grads, tx.init(params), params)
            assert updates["enc"]["a"].tolist() == [-4.0]
            assert updates["x"].tolist() == [-1.0]

    def test_clipping_inside_sees_true_gradients(self, impl):
        inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
        tx = make(inner, lossscale.StaticLossScale(2.0**12), impl)
        params = jnp.zeros(2)
        true = jnp.array([0.3, 0.4])  # norm 0.5: below the clip
        updates, _ = tx.update(true * 2.0**12, tx.init(params), params)
        np.testing.assert_allclose(updates, -true, rtol=1e-6)

    def test_extra_args_pass_through(self, impl):
        seen = {}

        def update_fn(updates, state, params=None, *, value, **extra):
            seen["value"] = value
            return updates, state

        inner = optax.GradientTransformationExtraArgs(
            lambda p: optax.EmptyState(), update_fn
        )
        tx = make(inner, lossscale.NoOpLossScale(), impl)
        chained = optax.chain(tx, optax.scale(1.0))
        params = jnp.ones(1)
        chained.update(
            params, chained.init(params), params, value=3.0, ignored=1
        )
        assert float(seen["value"]) == 3.0


class TestInitAndInspect:
    def test_init_state(self):
        tx = lossscale.loss_scaled(
            optax.adam(1e-3),
            lossscale.DynamicLossScale(),
            require_scaled_by=False,
        )
        state = tx.init({"w": jnp.ones(2)})
        assert isinstance(state, lossscale.LossScaledState)
        assert bool(state.grads_finite)
        assert state.skipped_steps.dtype == jnp.int32
        assert state.consecutive_skips.dtype == jnp.int32
        assert float(state.loss_scale.loss_scale) == 2.0**16

    def test_init_on_shape_dtype_structs(self):
        tx = lossscale.loss_scaled(
            optax.adam(1e-3),
            lossscale.DynamicLossScale(),
            require_scaled_by=False,
        )
        abstract = {"w": jax.ShapeDtypeStruct((3,), jnp.float32)}
        shapes = jax.eval_shape(tx.init, abstract)
        assert shapes.inner_state[0].mu["w"].shape == (3,)
        assert shapes.loss_scale.loss_scale.dtype == jnp.float32

    def test_get_loss_scale_through_wrappers(self):
        ls = lossscale.DynamicLossScale(64.0)
        params = {"a": jnp.ones(2), "b": jnp.ones(2)}
        wrapped = lossscale.loss_scaled(
            optax.adam(1e-3), ls, require_scaled_by=False
        )
        for tx in (
            wrapped,
            optax.chain(optax.clip(1.0), wrapped),
            optax.MultiSteps(wrapped, every_k_schedule=2),
            optax.inject_hyperparams(
                lambda learning_rate: lossscale.loss_scaled(
                    optax.sgd(learning_rate), ls, require_scaled_by=False
                )
            )(learning_rate=0.1),
            optax.multi_transform(
                {"x": wrapped, "y": optax.sgd(1.0)}, {"a": "x", "b": "y"}
            ),
        ):
            state = tx.init(params)
            found = lossscale.get_loss_scale(state)
            assert isinstance(found, lossscale.DynamicLossScale)
            assert float(found.loss_scale) == 64.0
            assert float(lossscale.metrics(state)["loss_scale"]) == 64.0
            # Works on traced states too.
            jitted = jax.jit(lambda s: lossscale.get_loss_scale(s).loss_scale)
            assert float(jitted(state)) == 64.0

    def test_get_loss_scale_none_or_many(self):
        params = {"a": jnp.ones(2), "b": jnp.ones(2)}
        with pytest.raises(ValueError, match="found no LossScaledState"):
            lossscale.get_loss_scale(optax.adam(1e-3).init(params))
        wrapped = lossscale.loss_scaled(
            optax.sgd(1.0), lossscale.NoOpLossScale(), require_scaled_by=False
        )
        tx = optax.multi_transform(
            {"x": wrapped, "y": wrapped}, {"a": "x", "b": "y"}
        )
        with pytest.raises(ValueError, match="found 2 LossScaledStates"):
            lossscale.get_loss_scale(tx.init(params))
        nested = lossscale.loss_scaled(
            wrapped, lossscale.NoOpLossScale(), require_scaled_by=False
        )
        with pytest.raises(ValueError, match="inner_state"):
            lossscale.metrics(nested.init(params))

    def test_metrics_keys_and_dtypes(self):
        tx = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(),
            require_scaled_by=False,
        )
        m = lossscale.metrics(tx.init(jnp.ones(1)))
        assert {k: str(v.dtype) for k, v in m.items()} == {
            "loss_scale": "float32",
            "grads_finite": "bool",
            "skipped_steps": "int32",
            "consecutive_skips": "int32",
            "steps": "int32",
            "last_skip_step": "int32",
            "growth_tracker": "int32",
            "hysteresis_tracker": "int32",
            "at_min_scale": "bool",
        }
        for v in m.values():
            assert v.shape == ()


@pytest.mark.standard_promotion
def test_skip_impls_agree_with_manual_reference():
    """Both skip implementations follow the hand-written recipe.

    The reference unscales by hand, runs plain adam on finite steps and
    does nothing on the others. XLA may fuse the arithmetic differently
    inside a conditional, so finite steps agree to float32 rounding; the
    skipped step and the scale trajectory agree exactly.
    """
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    grads_seq = [
        {"w": jnp.asarray(rng.normal(size=(4, 3)) * 1e3, jnp.float32)}
        for _ in range(6)
    ]
    grads_seq[2]["w"] = grads_seq[2]["w"].at[0, 0].set(jnp.inf)

    adam = optax.adam(1e-2)
    ref_p, ref_s, scale, ref_scales = params, adam.init(params), 2.0**8, []
    clean = 0
    for g in grads_seq:
        g = jax.tree.map(lambda x, s=scale: x / s, g)
        if all(np.isfinite(x).all() for x in jax.tree.leaves(g)):
            u, ref_s = adam.update(g, ref_s, ref_p)
            ref_p = optax.apply_updates(ref_p, u)
            clean += 1
            if clean == 2:
                scale, clean = scale * 2, 0
        else:
            scale, clean = scale / 2, 0
        ref_scales.append(scale)

    for impl in SKIP_IMPLS:
        tx = make(
            optax.adam(1e-2),
            lossscale.DynamicLossScale(2.0**8, growth_interval=2),
            impl,
        )
        p, s, scales = params, tx.init(params), []
        for g in grads_seq:
            u, s = jax.jit(tx.update)(g, s, p)
            p = optax.apply_updates(p, u)
            scales.append(float(s.loss_scale.loss_scale))
        assert scales == ref_scales
        assert int(s.skipped_steps) == 1
        assert int(s.inner_state[0].count) == int(ref_s[0].count) == 5
        np.testing.assert_allclose(p["w"], ref_p["w"], rtol=1e-6, atol=0)
        np.testing.assert_allclose(
            s.inner_state[0].nu["w"], ref_s[0].nu["w"], rtol=1e-6
        )
