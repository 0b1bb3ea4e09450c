"""Composition with optax: clipping, accumulation, hyperparams, groups."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from tests.helpers import assert_trees_bitwise_equal, loss_scaled

pytestmark = pytest.mark.standard_promotion

S = 2.0**10


def test_clip_inside_matches_clipping_unscaled_by_hand():
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = lossscale.loss_scaled(
        inner, lossscale.StaticLossScale(S), require_scaled_by=False
    )
    params = {"a": jnp.zeros(3), "b": jnp.zeros(2)}
    true = {"a": jnp.array([3.0, -4.0, 1.0]), "b": jnp.array([2.0, 0.5])}
    scaled = jax.tree.map(lambda g: g * S, true)
    ours, _ = jax.jit(tx.update)(scaled, tx.init(params), params)
    by_hand, _ = inner.update(true, inner.init(params), params)
    for x, y in zip(
        jax.tree.leaves(ours), jax.tree.leaves(by_hand), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    # Negative control: clipping the scaled gradients is a different answer.
    neg = optax.chain(optax.clip_by_global_norm(1.0), optax.scale(-1.0 / S))
    wrong, _ = neg.update(scaled, neg.init(params), params)
    assert not np.allclose(wrong["a"], ours["a"])


class TestMultiStepsOutside:
    """lossscale.MultiSteps(loss_scaled(inner), k): PyTorch's accumulation."""

    def make(self, k=4, cls=lossscale.MultiSteps):
        wrapped = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(S, growth_interval=1),
            require_scaled_by=False,
        )
        return cls(wrapped, every_k_schedule=k)

    def run(self, tx, micro_grads, params, state=None):
        state = tx.init(params) if state is None else state
        scales = []
        update = jax.jit(tx.update)  # once: each `tx.update` is a new method
        for g in micro_grads:
            scales.append(float(lossscale.get_loss_scale(state).loss_scale))
            updates, state = update(g * scales[-1], state, params)
            params = optax.apply_updates(params, updates)
        return params, state, scales

    def test_finite_effective_batch(self):
        micro = [jnp.array([1.0, 2.0]) * i for i in (1, 2, 3, 4)]
        params, state, scales = self.run(self.make(), micro, jnp.zeros(2))
        # the scale is constant over the micro-batches of one update...
        assert scales == [S] * 4
        # ...the update is the mean of the unscaled micro-gradients...
        np.testing.assert_array_equal(params, -jnp.array([2.5, 5.0]))
        # ...and the scale grows once, after the real update.
        assert float(lossscale.get_loss_scale(state).loss_scale) == 2 * S

    def test_one_bad_micro_batch_skips_the_whole_update_once(self):
        micro = [jnp.array([1.0, 2.0])] * 4
        micro[1] = jnp.array([jnp.inf, 2.0])
        params, state, scales = self.run(self.make(), micro, jnp.zeros(2))
        assert scales == [S] * 4
        np.testing.assert_array_equal(params, jnp.zeros(2))
        m = lossscale.metrics(state)
        assert int(m["skipped_steps"]) == 1  # judged once per real update
        assert float(m["loss_scale"]) == S / 2  # backed off once
        # The next effective batch starts clean at the lower scale.
        params, state, scales = self.run(
            self.make(), [jnp.array([1.0, 2.0])] * 4, params, state
        )
        assert scales == [S / 2] * 4
        np.testing.assert_array_equal(params, -jnp.array([1.0, 2.0]))

    def test_optax_multisteps_never_recovers(self):
        """Why lossscale.MultiSteps exists: optax's keeps the NaN.

        optax.MultiSteps resets its accumulator as ``0 * acc``, which stays
        NaN after an overflow, so every later update is skipped too. If this
        test starts failing, optax fixed it and lossscale.MultiSteps can go.
        """
        tx = self.make(cls=optax.MultiSteps)
        micro = [jnp.array([1.0, 2.0])] * 4
        bad = [jnp.array([jnp.inf, 2.0]), *micro[1:]]
        params, state, _ = self.run(tx, bad, jnp.zeros(2))
        params, state, _ = self.run(tx, micro * 3, params, state)
        np.testing.assert_array_equal(params, jnp.zeros(2))
        assert int(lossscale.metrics(state)["skipped_steps"]) == 4

    def test_is_a_drop_in_replacement(self):
        tx = self.make(k=2)
        assert isinstance(tx, optax.MultiSteps)
        state = tx.init(jnp.zeros(2))
        _, state = tx.update(jnp.ones(2) * S, state, jnp.zeros(2))
        assert not bool(tx.has_updated(state))
        _, state = tx.update(jnp.ones(2) * S, state, jnp.zeros(2))
        assert bool(tx.has_updated(state))
        chained = optax.chain(tx.gradient_transformation(), optax.scale(1.0))
        chained.update(jnp.ones(2), chained.init(jnp.zeros(2)), value=1.0)


def test_multisteps_inside_checks_every_micro_batch():
    """loss_scaled(MultiSteps(inner), k): the other order, documented.

    Each micro-batch is unscaled and checked on its own: a bad one is dropped
    (MultiSteps does not count it, so the effective batch takes one more
    micro-batch) and the scale backs off at once, mid-accumulation.
    """
    tx = lossscale.loss_scaled(
        optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2),
        lossscale.DynamicLossScale(S),
        require_scaled_by=False,
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    micro = [jnp.array([1.0, 1.0]), jnp.array([jnp.nan, 1.0])]
    micro += [jnp.array([3.0, 3.0])]
    scales = []
    for g in micro:
        scales.append(float(lossscale.get_loss_scale(state).loss_scale))
        updates, state = jax.jit(tx.update)(g * scales[-1], state, params)
        params = optax.apply_updates(params, updates)
    assert scales == [S, S, S / 2]  # the scale changed mid-accumulation
    np.testing.assert_array_equal(params, -jnp.array([2.0, 2.0]))  # mean(1, 3)
    assert int(state.skipped_steps) == 1


def test_inject_hyperparams_inner():
    inner = optax.inject_hyperparams(optax.sgd)(learning_rate=1.0)
    tx = lossscale.loss_scaled(
        inner, lossscale.StaticLossScale(S), require_scaled_by=False
    )
    params = jnp.zeros(2)
    state = tx.init(params)
    hp = dict(state.inner_state.hyperparams, learning_rate=jnp.asarray(0.5))
    state = state._replace(
        inner_state=state.inner_state._replace(hyperparams=hp)
    )
    updates, state = jax.jit(tx.update)(jnp.array([S, -S]), state, params)
    np.testing.assert_array_equal(updates, [-0.5, 0.5])
    # A skipped step leaves the injected hyperparameters' state alone too.
    count = int(state.inner_state.count)
    _, state = jax.jit(tx.update)(jnp.array([jnp.inf, 0.0]), state, params)
    assert int(state.inner_state.count) == count
    assert float(state.inner_state.hyperparams["learning_rate"]) == 0.5


def test_multi_transform_one_scale_per_group():
    def group(scale):
        return lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(scale, growth_interval=1),
            require_scaled_by=False,
        )

    tx = optax.multi_transform(
        {"enc": group(2.0**4), "dec": group(2.0**12)},
        {"enc": "enc", "dec": "dec"},
    )
    params = {"enc": jnp.zeros(2), "dec": jnp.zeros(2)}
    state = tx.init(params)
    with pytest.raises(ValueError, match="found 2 LossScaledStates"):
        lossscale.get_loss_scale(state)

    def scale_of(state, name):
        return lossscale.get_loss_scale(state.inner_states[name]).loss_scale

    # Each group's gradients arrive scaled by its own scale.
    grads = {
        "enc": jnp.array([1.0, 2.0]) * scale_of(state, "enc"),
        "dec": jnp.array([jnp.inf, 1.0]),  # only the decoder overflows
    }
    updates, state = jax.jit(tx.update)(grads, state, params)
    np.testing.assert_array_equal(updates["enc"], [-1.0, -2.0])
    np.testing.assert_array_equal(updates["dec"], [0.0, 0.0])
    assert float(scale_of(state, "enc")) == 2.0**5  # grew
    assert float(scale_of(state, "dec")) == 2.0**11  # backed off


def test_extra_args_reach_reduce_on_plateau():
    inner = optax.chain(
        optax.sgd(1.0),
        optax.contrib.reduce_on_plateau(patience=0, factor=0.5, cooldown=0),
    )
    tx = lossscale.loss_scaled(
        inner, lossscale.StaticLossScale(S), require_scaled_by=False
    )
    params = jnp.zeros(1)
    state = tx.init(params)
    update = jax.jit(tx.update)
    g = jnp.array([S])
    for value in (1.0, 2.0):  # the second value does not improve: halve
        updates, state = update(g, state, params, value=jnp.asarray(value))
    np.testing.assert_array_equal(updates, [-0.5])
    # A skipped step does not count towards the plateau.
    plateau = state.inner_state[1]
    _, state = update(g * jnp.inf, state, params, value=jnp.asarray(9.0))
    assert int(state.inner_state[1].plateau_count) == int(plateau.plateau_count)


class TestParamsAsGiven:
    """``params`` reaches the inner optimizer as given, as in plain optax."""

    def run_both(self, inner_fn, params, grad_steps, impl):
        """Plain optax on the true gradients vs lossscale on scaled ones."""
        inner = inner_fn()
        tx = loss_scaled(
            inner_fn(),
            lossscale.StaticLossScale(S),
            impl=impl,
            require_scaled_by=False,
        )
        plain_step = jax.jit(inner.update)
        step = jax.jit(tx.update)
        plain_state, state = inner.init(params), tx.init(params)
        for grads in grad_steps:
            want, plain_state = plain_step(grads, plain_state, params)
            scaled = jax.tree.map(lambda g: g * S, grads)
            got, state = step(scaled, state, params)
            assert jax.tree.structure(got) == jax.tree.structure(want)
            for x, y in zip(
                jax.tree.leaves((got, state.inner_state)),
                jax.tree.leaves((want, plain_state)),
                strict=True,
            ):
                np.testing.assert_allclose(x, y, rtol=1e-6)
        return tx, state

    @pytest.mark.parametrize("impl", ["select", "cond"])
    def test_lookahead(self, impl):
        # Its params are LookaheadParams (fast and slow), the gradients are
        # those of the fast params alone, and the updates cover both.
        params = optax.LookaheadParams.init_synced(
            {"w": jnp.arange(3.0), "b": jnp.ones(2)}
        )
        grads = [
            {"w": jnp.array([0.5, -1.0, 2.0]) * i, "b": jnp.ones(2) / i}
            for i in range(1, 5)
        ]
        inner_fn = lambda: optax.lookahead(optax.adam(1e-2), 2, 0.5)
        tx, state = self.run_both(inner_fn, params, grads, impl)
        before = state.inner_state
        bad = {"w": jnp.array([S, jnp.inf, S]), "b": jnp.ones(2) * S}
        updates, state = jax.jit(tx.update)(bad, state, params)
        assert not bool(state.grads_finite)
        assert_trees_bitwise_equal(state.inner_state, before)
        assert_trees_bitwise_equal(
            updates, jax.tree.map(jnp.zeros_like, params)
        )

    @pytest.mark.parametrize("impl", ["select", "cond"])
    @pytest.mark.parametrize(
        "inner_fn",
        [
            lambda: optax.sgd(0.1),
            lambda: optax.sgd(0.1, momentum=0.9),
            lambda: optax.chain(
                optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.5)
            ),
        ],
        ids=["sgd", "momentum", "clip+momentum"],
    )
    def test_none_gradient_for_an_int_param(self, impl, inner_fn):
        # equinox's opt.update(grads, state, eqx.filter(model, eqx.is_array))
        # with an int array in the model: its gradient is None. optax's
        # momentum then drops that leaf from its trace at the first update.
        params = {"w": jnp.array([1.0, -2.0]), "step": jnp.int32(3)}
        grads = [
            {"w": jnp.array([0.25, 1.0]) * i, "step": None} for i in (1, 2)
        ]
        tx, state = self.run_both(inner_fn, params, grads, impl)
        before = state.inner_state
        bad = {"w": jnp.array([jnp.nan, 1.0]), "step": None}
        updates, state = jax.jit(tx.update)(bad, state, params)
        assert not bool(state.grads_finite)
        assert_trees_bitwise_equal(state.inner_state, before)
        assert updates["step"] is None

    @pytest.mark.parametrize("impl", ["select", "cond"])
    def test_first_step_skipped_takes_the_new_structure(self, impl):
        params = {"w": jnp.array([1.0, -2.0]), "step": jnp.int32(3)}
        tx = loss_scaled(
            optax.sgd(0.1, momentum=0.9),
            lossscale.StaticLossScale(S),
            impl=impl,
            require_scaled_by=False,
        )
        state = tx.init(params)
        bad = {"w": jnp.array([jnp.inf, 1.0]), "step": None}
        _, skipped = jax.jit(tx.update)(bad, state, params)
        trace = skipped.inner_state[0].trace
        assert list(trace) == ["w"] or trace["step"] is None
        np.testing.assert_array_equal(trace["w"], np.zeros(2))
        # The next (finite) step runs on that state without retracing
        # anything but the structure change.
        good = {"w": jnp.array([S, S]), "step": None}
        updates, state = jax.jit(tx.update)(good, skipped, params)
        np.testing.assert_allclose(updates["w"], [-0.1, -0.1])
