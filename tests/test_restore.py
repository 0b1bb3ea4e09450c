"""States whose leaves disagree with the static configuration.

A checkpoint holds the leaves (the scale, the counters); the configuration
comes from the target. A state saved under one configuration and restored
into another, or set by hand, must never be trusted: its leaves are clamped
into the target's ranges on use, the finiteness decision depends on the
scale actually used, and :func:`lossscale.compare_config` says what differs.
"""

import dataclasses
import itertools

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale

CONFIGS = {
    "noop": lambda: lossscale.NoOpLossScale(),
    "static_high": lambda: lossscale.StaticLossScale(2.0**10),
    "static_low": lambda: lossscale.StaticLossScale(2.0**-4),
    "dynamic": lambda: lossscale.DynamicLossScale(2.0**15),
    "dynamic_below_1": lambda: lossscale.DynamicLossScale(
        2.0**-4, min_loss_scale=2.0**-8
    ),
    "dynamic_hysteresis": lambda: lossscale.DynamicLossScale(
        2.0**6, hysteresis=3, growth_interval=5
    ),
    "dynamic_wide": lambda: lossscale.DynamicLossScale(
        2.0**28,
        max_loss_scale=2.0**30,
        min_loss_scale=2.0**20,
        growth_interval=3,
        backoff_factor=0.9,
    ),
}
PAIRS = list(itertools.product(CONFIGS, CONFIGS))


def below_one(name):
    return name in ("static_low", "dynamic_below_1")


def build(name, option):
    """The transformation and params for a configuration and an option."""
    params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    if option == "param_labels":
        # Both groups the same configuration; labels as a tree.
        return lossscale.loss_scaled_by_group(
            optax.sgd(1.0),
            {"x": CONFIGS[name](), "y": CONFIGS[name]()},
            param_labels={"a": "x", "b": "y"},
            require_scaled_by=False,
        ), params
    kwargs = {
        "plain": {},
        "mask": {"mask": {"a": True, "b": True}},
        "report_nonfinite": {"report_nonfinite": True},
    }[option]
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), CONFIGS[name](), require_scaled_by=False, **kwargs
    )
    return tx, params


def saved_blob(name, option):
    """A checkpoint of a state that has moved: finite steps, an overflow."""
    tx, params = build(name, option)
    state = tx.init(params)
    dtype = jnp.float32
    for g in (1.0, 1.0, jnp.inf):
        grads = jax.tree.map(lambda p, g=g: jnp.full_like(p, g, dtype), params)
        _, state = tx.update(grads, state, params)
    return flax.serialization.to_bytes(state)


def scales_of(state):
    scales = lossscale.get_loss_scale(state)
    return scales.values() if isinstance(scales, dict) else [scales]


def check_step(tx, state, params, dtype, values):
    """One jitted step on gradients ``values``: the decision follows the
    scale actually used, updates are finite, the next state is in range."""
    grads = jax.tree.map(lambda _: jnp.asarray(values, dtype), params)
    used = [float(s.loss_scale) for s in scales_of(state)]
    updates, new = jax.jit(tx.update)(grads, state, params)
    assert lossscale.compare_config(new) == []
    with np.errstate(over="ignore"):
        unscaled = [
            np.asarray(values, np.float32).astype(dtype) / np.float32(u)
            for u in used
        ]
        want_finite = all(
            np.isfinite(np.asarray(v, dtype)).all() for v in unscaled
        )
    assert bool(new.grads_finite) == want_finite
    for leaf in jax.tree.leaves(updates):
        assert np.isfinite(np.asarray(leaf)).all()
        if not want_finite:
            assert not np.asarray(leaf).any()
    return new


def run_pair(saved, target, option):
    tx, params = build(target, option)
    blob = saved_blob(saved, option)
    kind = lambda n: type(CONFIGS[n]()).__name__
    if kind(saved) != kind(target):
        with pytest.raises(ValueError, match="does not fit"):
            flax.serialization.from_bytes(tx.init(params), blob)
        return
    state = flax.serialization.from_bytes(tx.init(params), blob)
    for scale in scales_of(state):  # what update will use, in range
        assert (
            lossscale.compare_config(
                tx.init(params)._replace(loss_scale=scale)
                if option != "param_labels"
                else tx.init(params)._replace(
                    loss_scale={"x": scale, "y": scale}
                )
            )
            == []
        )
    # float16 where the target allows it (its floor >= 1): the repro's
    # 40000 overflows float16 once divided by a scale below 1. float32
    # otherwise, with a value that overflows divided by 2**-4.
    if below_one(target):
        dtype, values = jnp.float32, [3e38, 1.0]
    else:
        dtype, values = jnp.float16, [40000.0, 1.0]
    state = check_step(tx, state, params, dtype, values)
    check_step(tx, state, params, dtype, [1.0, 2.0])


@pytest.mark.parametrize(
    ("saved", "target"), PAIRS, ids=[f"{a}-into-{b}" for a, b in PAIRS]
)
def test_restore_into_every_target(saved, target):
    run_pair(saved, target, "plain")


# The quick run (-m "not slow") restores every pair without options, and
# with each option the pairs restored into the first target only; the
# rest of the options' matrix is slow.
OPTION_PAIRS = [
    pytest.param(
        a,
        b,
        id=f"{a}-into-{b}",
        marks=() if b == PAIRS[0][1] else pytest.mark.slow,
    )
    for a, b in PAIRS
]


@pytest.mark.parametrize("option", ["mask", "param_labels", "report_nonfinite"])
@pytest.mark.parametrize(("saved", "target"), OPTION_PAIRS)
def test_restore_into_every_target_with_options(saved, target, option):
    run_pair(saved, target, option)


def test_issue_repro_scale_below_the_targets_floor():
    params = {"w": jnp.ones(2, jnp.float16)}
    saved = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.DynamicLossScale(2.0**-4, min_loss_scale=2.0**-8),
        require_scaled_by=False,
    )
    blob = flax.serialization.to_bytes(saved.init(params))
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.DynamicLossScale(1.0), require_scaled_by=False
    )
    state = flax.serialization.from_bytes(tx.init(params), blob)
    assert float(state.loss_scale.loss_scale) == 2.0**-4  # the raw leaf
    assert float(lossscale.get_loss_scale(state).loss_scale) == 1.0  # used
    assert float(lossscale.metrics(state)["loss_scale"]) == 1.0
    grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
    updates, state = jax.jit(tx.update)(grads, state, params)
    # Unscaled by the clamped scale, 1: finite, and applied as such.
    assert bool(state.grads_finite)
    np.testing.assert_array_equal(
        updates["w"], np.array([-40000.0, -1.0], np.float16)
    )
    assert float(state.loss_scale.loss_scale) == 1.0


def test_hysteresis_tracker_from_a_larger_hysteresis():
    params = jnp.ones(2)
    saved = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.DynamicLossScale(64.0, hysteresis=3),
        require_scaled_by=False,
    )
    blob = flax.serialization.to_bytes(saved.init(params))
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.DynamicLossScale(64.0),
        require_scaled_by=False,
    )
    state = flax.serialization.from_bytes(tx.init(params), blob)
    assert int(state.loss_scale.hysteresis_tracker) == 3  # restored as is
    step = jax.jit(tx.update)
    scales = []
    for _ in range(3):
        _, state = step(jnp.array([jnp.inf, 1.0]), state, params)
        scales.append(float(state.loss_scale.loss_scale))
    assert scales == [32.0, 16.0, 8.0]  # hysteresis=1: every overflow


def test_adjust_and_scale_clamp_a_hand_made_state():
    ls = lossscale.DynamicLossScale(4.0, growth_interval=3, hysteresis=2)
    leaves = [np.float32(np.nan), np.int32(-5), np.int32(9)]
    bad = jax.tree.unflatten(jax.tree.structure(ls), leaves)
    assert float(bad.scale(jnp.float32(3.0))) == 3.0  # NaN -> min 1.0
    m = bad.metrics()
    assert int(m["growth_tracker"]) == 0 and int(m["hysteresis_tracker"]) == 2
    after = bad.adjust(jnp.bool_(False))  # tolerated: 2 -> 1
    assert float(after.loss_scale) == 1.0
    assert int(after.hysteresis_tracker) == 1
    static = jax.tree.unflatten(
        jax.tree.structure(lossscale.StaticLossScale(2.0)),
        [np.float32(np.inf)],
    )
    assert float(static.unscale(jnp.float32(2.0**127))) == 2.0
    assert float(lossscale.get_loss_scale(_state_with(static)).loss_scale) == (
        2.0**126
    )


def _state_with(scale):
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.StaticLossScale(2.0), require_scaled_by=False
    )
    return tx.init(jnp.ones(1))._replace(loss_scale=scale)


def test_static_scale_below_one_is_checked_unscaled_under_jit():
    # A StaticLossScale whose leaf was set to 2**-4 after construction: the
    # trace does not show its value, so the unscaled gradients decide.
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.StaticLossScale(2.0**10),
        require_scaled_by=False,
    )
    params = jnp.ones(2)
    state = tx.init(params)
    state = state._replace(
        loss_scale=dataclasses.replace(state.loss_scale, loss_scale=2.0**-4)
    )
    grads = jnp.array([3e38, 1.0], jnp.float32)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert not bool(state.grads_finite)
    assert not np.asarray(updates).any()


class TestCompareConfig:
    def test_leaves_outside_the_target(self):
        params = jnp.ones(2)
        old = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(
                2.0**-4, min_loss_scale=2.0**-8, growth_interval=50
            ),
            require_scaled_by=False,
        )
        state = old.init(params)
        for _ in range(20):
            _, state = old.update(params, state, params)
        new = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(1.0, growth_interval=10),
            require_scaled_by=False,
        )
        restored = flax.serialization.from_bytes(
            new.init(params), flax.serialization.to_bytes(state)
        )
        found = lossscale.compare_config(restored)
        assert [line.split(" is outside")[0] for line in found] == [
            "loss_scale.loss_scale=0.0625",
            "loss_scale.growth_tracker=20",
        ]
        assert "[1, 16777216]" in found[0] and "[0, 9]" in found[1]
        # The saved configuration shows what the leaves cannot.
        full = lossscale.compare_config(
            restored, lossscale.loss_scale_config(state)
        )
        assert full[2:] == [
            "loss_scale.growth_interval: saved 50, target 10.",
            "loss_scale.min_loss_scale: saved 0.00390625, target 1.0.",
        ]

    def test_same_configuration_finds_nothing(self):
        tx = lossscale.loss_scaled(
            optax.sgd(1e-3, momentum=0.9),
            lossscale.DynamicLossScale(hysteresis=2),
            report_nonfinite=True,
            require_scaled_by=False,
        )
        state = tx.init({"w": jnp.ones(3)})
        for g in (1.0, jnp.inf, 1.0):
            _, state = tx.update({"w": jnp.full(3, g)}, state)
        assert lossscale.compare_config(state) == []
        config = lossscale.loss_scale_config(state)
        assert lossscale.compare_config(state, config) == []
        assert config == {
            "type": "DynamicLossScale",
            "growth_interval": 2000,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "min_loss_scale": 1.0,
            "max_loss_scale": 2.0**24,
            "hysteresis": 2,
        }

    def test_limits_a_factor_change_needs_the_saved_config(self):
        params = jnp.ones(2)
        old = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(backoff_factor=0.25),
            require_scaled_by=False,
        )
        new = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(backoff_factor=0.5),
            require_scaled_by=False,
        )
        saved = old.init(params)
        restored = flax.serialization.from_bytes(
            new.init(params), flax.serialization.to_bytes(saved)
        )
        assert lossscale.compare_config(restored) == []  # unseen
        assert lossscale.compare_config(
            restored, lossscale.loss_scale_config(saved)
        ) == ["loss_scale.backoff_factor: saved 0.25, target 0.5."]

    def test_groups_and_kinds(self):
        def tx_for(enc):
            return lossscale.loss_scaled_by_group(
                optax.sgd(1.0),
                {"enc": enc, "dec": lossscale.StaticLossScale(4.0)},
                param_labels={"a": "enc", "b": "dec"},
                require_scaled_by=False,
            )

        params = {"a": jnp.ones(1), "b": jnp.ones(1)}
        saved = tx_for(lossscale.StaticLossScale(2.0)).init(params)
        target = tx_for(lossscale.DynamicLossScale()).init(params)
        diff = lossscale.compare_config(
            target, lossscale.loss_scale_config(saved)
        )
        assert diff == [
            "loss_scale['enc'].type: saved 'StaticLossScale', target "
            "'DynamicLossScale'."
        ] + [
            f"loss_scale['enc'].{k}: saved None, target {v!r}."
            for k, v in sorted(
                lossscale.loss_scale_config(target)["loss_scale['enc']"].items()
            )
            if k != "type"
        ]

    def test_bad_saved_config(self):
        tx = lossscale.loss_scaled(
            optax.sgd(1.0), lossscale.NoOpLossScale(), require_scaled_by=False
        )
        with pytest.raises(TypeError, match="saved_config"):
            lossscale.compare_config(tx.init(jnp.ones(1)), "abc")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FloorPolicy:
    """A policy of one's own that claims a floor of 1 (a static field)."""

    loss_scale: jax.Array
    min_loss_scale: float = dataclasses.field(
        default=1.0, metadata={"static": True}
    )

    def scale(self, tree):
        return jax.tree.map(lambda x: x * self.loss_scale.astype(x.dtype), tree)

    def unscale(self, tree):
        inv = 1 / self.loss_scale
        return jax.tree.map(
            lambda x: (x.astype(jnp.float32) * inv).astype(x.dtype), tree
        )

    def adjust(self, grads_finite):
        return self


def test_own_policy_below_its_claimed_floor_is_checked_unscaled():
    # Its leaves are not clamped (lossscale cannot know its ranges), so the
    # attribute does not let the scaled float16 gradients decide.
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), FloorPolicy(jnp.float32(4.0)), require_scaled_by=False
    )
    params = jnp.ones(2, jnp.float16)
    state = tx.init(params)
    state = state._replace(loss_scale=FloorPolicy(jnp.float32(2.0**-4)))
    grads = jnp.array([40000.0, 1.0], jnp.float16)
    updates, state = jax.jit(tx.update)(grads, state, params)
    assert not bool(state.grads_finite)  # 40000 * 16 overflows float16
    assert not np.asarray(updates).any()


def test_an_ensembles_restored_leaves_are_clamped_element_wise():
    # flax restores numpy leaves; a vmap-ped ensemble's have a batch axis.
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.DynamicLossScale(4.0, hysteresis=2),
        require_scaled_by=False,
    )
    params = jnp.ones((3, 2))
    state = jax.vmap(tx.init)(params)
    leaves = [
        np.array([4.0, 0.25, np.nan], np.float32),
        np.array([0, 5000, -1], np.int32),
        np.array([2, 7, 0], np.int32),
    ]
    state = state._replace(
        loss_scale=jax.tree.unflatten(
            jax.tree.structure(state.loss_scale), leaves
        )
    )
    used = lossscale.get_loss_scale(state)
    np.testing.assert_array_equal(used.loss_scale, [4.0, 1.0, 1.0])
    np.testing.assert_array_equal(used.growth_tracker, [0, 1999, 0])
    np.testing.assert_array_equal(used.hysteresis_tracker, [2, 2, 0])
    assert len(lossscale.compare_config(state)) == 3
    _, new = jax.vmap(tx.update)(params, state, params)
    assert lossscale.compare_config(new) == []
