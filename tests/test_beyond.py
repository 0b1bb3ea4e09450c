"""Pluggable policies, health signals, diagnosis and float8."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from lossscale import demo

pytestmark = pytest.mark.standard_promotion


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FastBackoffLossScale:
    """A custom policy: the k-th consecutive overflow divides by 2**k."""

    loss_scale: jax.Array
    overflows: jax.Array  # consecutive overflows so far
    growth_interval: int = dataclasses.field(metadata=dict(static=True))
    clean: jax.Array = dataclasses.field(
        default_factory=lambda: jnp.zeros((), jnp.int32)
    )

    def scale(self, tree):
        return jax.tree.map(lambda x: x * self.loss_scale, tree)

    def unscale(self, tree):
        return jax.tree.map(lambda x: x / self.loss_scale, tree)

    def adjust(self, grads_finite):
        overflows = jnp.where(grads_finite, 0, self.overflows + 1)
        clean = jnp.where(grads_finite, self.clean + 1, 0)
        grow = clean >= self.growth_interval
        scale = jnp.where(
            grads_finite,
            jnp.where(grow, self.loss_scale * 2, self.loss_scale),
            self.loss_scale / 2.0 ** overflows.astype(jnp.float32),
        )
        return FastBackoffLossScale(
            jnp.maximum(scale, 1.0).astype(jnp.float32),
            overflows.astype(jnp.int32),
            self.growth_interval,
            jnp.where(grow, 0, clean).astype(jnp.int32),
        )

    def metrics(self):
        return {"consecutive_overflows": self.overflows}


def test_custom_policy_in_the_wrapper():
    policy = FastBackoffLossScale(
        jnp.float32(2.0**10), jnp.int32(0), growth_interval=3
    )
    assert isinstance(policy, lossscale.LossScale)
    tx = lossscale.loss_scaled(optax.sgd(1.0), policy, require_scaled_by=False)
    params = jnp.zeros(2)
    state = tx.init(params)
    update = jax.jit(tx.update)
    scales = []
    for g in [jnp.inf, jnp.inf, jnp.inf, 1.0, 1.0, 1.0]:
        scale = lossscale.get_loss_scale(state).loss_scale
        updates, state = update(jnp.full(2, g) * scale, state, params)
        scales.append(float(lossscale.get_loss_scale(state).loss_scale))
    # 1024 / 2 / 4 / 8 = 16, then grows after three clean steps.
    assert scales == [512.0, 128.0, 16.0, 16.0, 16.0, 32.0]
    np.testing.assert_array_equal(updates, [-1.0, -1.0])
    m = lossscale.metrics(state)
    assert int(m["consecutive_overflows"]) == 0
    assert int(m["skipped_steps"]) == 3


class TestHealth:
    def make(self, **kwargs):
        return lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(4.0, min_loss_scale=1.0),
            require_scaled_by=False,
            **kwargs,
        )

    def test_metrics_track_overflows(self):
        tx = self.make()
        params = jnp.zeros(1)
        state = tx.init(params)
        m = lossscale.metrics(state)
        assert int(m["last_skip_step"]) == -1 and int(m["steps"]) == 0
        update = jax.jit(tx.update)
        for g in [1.0, jnp.nan, 1.0, jnp.inf, jnp.inf, jnp.inf, 1.0]:
            _, state = update(jnp.full(1, g), state, params)
        m = lossscale.metrics(state)
        assert int(m["steps"]) == 7
        assert int(m["last_skip_step"]) == 5
        assert int(m["skipped_steps"]) == 4
        assert bool(m["at_min_scale"])  # 4 -> 2 -> 1 -> 1 ...
        applied = int(m["steps"]) - int(m["skipped_steps"])
        assert applied == 3

    def test_on_min_scale_error_raises_after_patience(self):
        tx = self.make(on_min_scale="error", min_scale_patience=3)
        params = jnp.zeros(1)
        state = tx.init(params)
        update = jax.jit(tx.update)
        bad = jnp.full(1, jnp.nan)
        # Skips 1 and 2 run at 4 and 2 and back off to the minimum 1; skips
        # 3, 4 and 5 run at the minimum, and the third of them raises.
        for _ in range(4):
            _, state = update(bad, state, params)
            jax.block_until_ready(state)
        assert int(lossscale.metrics(state)["min_scale_skips"]) == 2
        with pytest.raises(Exception, match="3 consecutive steps had non-fin"):
            _, state = update(bad, state, params)
            jax.block_until_ready(state)

    def test_on_min_scale_ignore_never_raises(self):
        tx = self.make(min_scale_patience=1)  # on_min_scale="ignore"
        params = jnp.zeros(1)
        state = tx.init(params)
        for _ in range(5):
            _, state = jax.jit(tx.update)(jnp.full(1, jnp.nan), state, params)
        assert int(jax.block_until_ready(state).consecutive_skips) == 5

    def test_bad_health_arguments(self):
        with pytest.raises(ValueError, match="on_min_scale"):
            self.make(on_min_scale="raise")
        with pytest.raises(ValueError, match="min_scale_patience"):
            self.make(min_scale_patience=0)


class TestDiagnose:
    def test_on_the_demo_model(self):
        (x, y), _ = demo.make_data(0)
        x, y = x[:512], y[:512]
        nnx = pytest.importorskip("flax.nnx")

        def loss_for(dtype):
            graphdef, params = nnx.split(demo.make_model(0, dtype), nnx.Param)

            def loss_fn(params, x, y):
                logits = nnx.merge(graphdef, params)(x)
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits, y
                ).mean()

            return loss_fn, params

        loss16, params = loss_for(jnp.float16)
        loss32, _ = loss_for(jnp.float32)
        d = lossscale.diagnose(loss16, params, x, y, reference_loss_fn=loss32)
        assert d.underflow[0] > 0.2  # float16 without scaling
        at_2_15 = int(np.flatnonzero(d.scales == 2.0**15)[0])
        assert d.underflow[at_2_15] < 0.01
        assert d.overflow[at_2_15] == 0.0
        assert 2.0**12 <= d.recommended <= 2.0**24
        assert "<- recommended" in str(d)

    def test_bfloat16_needs_no_scale(self):
        def loss_fn(w, x):
            return jnp.sum(w * x) * 1e-6

        x = jnp.array([1e-3, 1.0, 3e4])
        d16 = lossscale.diagnose(loss_fn, jnp.ones(3), x)
        dbf = lossscale.diagnose(loss_fn, jnp.ones(3), x, dtype=jnp.bfloat16)
        assert d16.underflow[0] > 0 and dbf.underflow[0] == 0
        assert dbf.overflow.max() == 0

    @pytest.mark.parametrize(
        "kwargs, error",
        [
            (dict(dtype=jnp.int8), TypeError),
            (dict(headroom=0.5), ValueError),
            (dict(scales=[]), ValueError),
            (dict(scales=[1.0, -2.0]), ValueError),
        ],
    )
    def test_bad_arguments(self, kwargs, error):
        with pytest.raises(error):
            lossscale.diagnose(lambda w: jnp.sum(w), jnp.ones(2), **kwargs)


class TestFloat8:
    @pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
    def test_float8_gradients(self, dtype):
        tx = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(16.0),
            require_scaled_by=False,
        )
        params = jnp.zeros(2, dtype)
        state = tx.init(params)
        updates, state = tx.update(
            jnp.array([32.0, 16.0], dtype), state, params
        )
        assert updates.dtype == dtype
        assert updates.astype(jnp.float32).tolist() == [-2.0, -1.0]
        # Overflow past the format's max: NaN for e4m3fn, inf for e5m2.
        big = jnp.array([1e6, 1.0], jnp.float32).astype(dtype)
        assert not np.isfinite(np.asarray(big.astype(jnp.float32))[0])
        updates, state = tx.update(big, state, params)
        assert not bool(state.grads_finite)
        assert updates.astype(jnp.float32).tolist() == [0.0, 0.0]


def fp8_model():
    nn = pytest.importorskip("flax.linen")
    from flax.linen import fp8_ops

    return nn.Dense(4, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp), fp8_ops


def test_flax_fp8_metadata_untouched_with_train_state():
    from flax.training import train_state

    model, fp8_ops = fp8_model()
    owg = fp8_ops.OVERWRITE_WITH_GRADIENT
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = jax.jit(model.init)(jax.random.key(0), x)
    scale = 2.0**8

    def loss_fn(v):
        return jnp.mean(model.apply(v, x) ** 2)

    # lossscale: TrainState hands only the non-fp8 leaves to tx, so the
    # wrapper never unscales the fp8 metadata.
    state = train_state.TrainState.create(
        apply_fn=model.apply,
        params=variables,
        tx=lossscale.loss_scaled(
            optax.sgd(0.1),
            lossscale.StaticLossScale(scale),
            require_scaled_by=False,
        ),
    )
    # Compiled, not eager: the test is about values, and one compile is
    # cheaper than op-by-op dispatch.
    grads = jax.jit(jax.grad(lambda v: scale * loss_fn(v)))(state.params)
    new = jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
    meta = new.params[owg]["Fp8DirectDotGeneralOp_0"]
    np.testing.assert_array_equal(
        meta["input_amax_history"],
        grads[owg]["Fp8DirectDotGeneralOp_0"]["input_amax_history"],
    )
    assert float(meta["input_amax_history"][0]) == float(jnp.max(jnp.abs(x)))

    # Negative control: flax's DynamicScale divides every gradient by the
    # scale, fp8 metadata included, corrupting the amax history.
    from flax.training.dynamic_scale import DynamicScale

    ds = DynamicScale(scale=scale)
    _, _, _, ds_grads = jax.jit(ds.value_and_grad(loss_fn))(variables)
    corrupted = ds_grads[owg]["Fp8DirectDotGeneralOp_0"]["input_amax_history"][
        0
    ]
    assert float(corrupted) == pytest.approx(float(jnp.max(jnp.abs(x))) / scale)


def test_mask_keeps_fp8_metadata_out_of_unscaling():
    model, fp8_ops = fp8_model()
    owg = fp8_ops.OVERWRITE_WITH_GRADIENT
    x = jax.random.normal(jax.random.key(1), (4, 8))
    variables = model.init(jax.random.key(0), x)
    overwrite = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p: (jax.tree.map(lambda new, old: new - old, u, p), s),
    )
    labels = {"params": "train", owg: "overwrite"}
    tx = lossscale.loss_scaled(
        optax.multi_transform(
            {"train": optax.sgd(0.1), "overwrite": overwrite}, labels
        ),
        lossscale.StaticLossScale(2.0**8),
        mask={"params": True, owg: False},
        require_scaled_by=False,
    )
    state = tx.init(variables)
    grads = jax.grad(lambda v: 2.0**8 * jnp.mean(model.apply(v, x) ** 2))(
        variables
    )
    updates, state = tx.update(grads, state, variables)
    new = optax.apply_updates(variables, updates)
    amax = new[owg]["Fp8DirectDotGeneralOp_0"]["input_amax_history"][0]
    assert float(amax) == pytest.approx(float(jnp.max(jnp.abs(x))))
    assert bool(state.grads_finite)
