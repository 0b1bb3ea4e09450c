"""Every invalid argument fails early with a message naming it."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from tests.helpers import explicit_mesh

RANGE = re.escape("must be in [2**-126, 2**126]")
BAD_SCALES = [
    (0.0, ValueError, RANGE),
    (-1.0, ValueError, RANGE),
    (float("nan"), ValueError, RANGE),
    (float("inf"), ValueError, RANGE),
    (1e39, ValueError, RANGE),  # overflows float32
    (3e38, ValueError, RANGE),  # its reciprocal is subnormal: unscales to 0
    (1e-39, ValueError, RANGE),  # subnormal: its reciprocal is inf
    (True, TypeError, "real number"),
    ("2.0", TypeError, "real number"),
    (1j, TypeError, "real number"),
    (jnp.ones(2), ValueError, "scalar"),
    (jnp.array(True), TypeError, "dtype bool"),
    (None, TypeError, "real number"),
]


@pytest.mark.parametrize("value, error, message", BAD_SCALES)
def test_static_bad_scale(value, error, message):
    with pytest.raises(error, match=message) as info:
        lossscale.StaticLossScale(value)
    assert "loss_scale" in str(info.value)


@pytest.mark.parametrize("value, error, message", BAD_SCALES)
def test_dynamic_bad_initial_scale(value, error, message):
    with pytest.raises(error, match=message) as info:
        lossscale.DynamicLossScale(value)
    assert "loss_scale" in str(info.value)


DYNAMIC_BAD = [
    ("growth_interval", 0, ValueError),
    ("growth_interval", -3, ValueError),
    ("growth_interval", 2**31, ValueError),
    ("growth_interval", 1.5, TypeError),
    ("growth_interval", 2000.0, TypeError),
    ("growth_interval", True, TypeError),
    ("growth_interval", "10", TypeError),
    ("hysteresis", 0, ValueError),
    ("hysteresis", 2.0, TypeError),
    ("growth_factor", 1.0, ValueError),
    ("growth_factor", 0.5, ValueError),
    ("growth_factor", float("nan"), ValueError),
    ("growth_factor", float("inf"), ValueError),
    ("growth_factor", 1e39, ValueError),
    ("growth_factor", "2", TypeError),
    ("backoff_factor", 0.0, ValueError),
    ("backoff_factor", 1.0, ValueError),
    ("backoff_factor", 2.0, ValueError),
    ("backoff_factor", -0.5, ValueError),
    ("backoff_factor", float("nan"), ValueError),
    ("min_loss_scale", 0.0, ValueError),
    ("min_loss_scale", -1.0, ValueError),
    ("min_loss_scale", float("nan"), ValueError),
    ("min_loss_scale", None, TypeError),
    ("min_loss_scale", 1e-40, ValueError),  # its reciprocal is inf
    ("max_loss_scale", float("inf"), ValueError),
    ("max_loss_scale", 1e39, ValueError),
    ("max_loss_scale", 3e38, ValueError),  # its reciprocal is subnormal
    ("max_loss_scale", 0.0, ValueError),
    ("backoff_factor", 1 - 1e-9, ValueError),  # 1.0 in float32: no backoff
    ("growth_factor", 1 + 1e-9, ValueError),  # 1.0 in float32: no growth
]


@pytest.mark.parametrize("name, value, error", DYNAMIC_BAD)
def test_dynamic_bad_config(name, value, error):
    kwargs = {"loss_scale": 2.0, "min_loss_scale": 1.0}
    kwargs[name] = value
    with pytest.raises(error) as info:
        lossscale.DynamicLossScale(**kwargs)
    assert name in str(info.value)
    assert repr(value) in str(info.value)


def test_dynamic_min_above_max():
    with pytest.raises(ValueError, match="min_loss_scale must be <= max"):
        lossscale.DynamicLossScale(8.0, min_loss_scale=16.0, max_loss_scale=4.0)


@pytest.mark.parametrize("initial", [0.5, 2.0**25])
def test_dynamic_initial_outside_bounds(initial):
    with pytest.raises(ValueError, match=r"loss_scale must be in \[") as info:
        lossscale.DynamicLossScale(initial)
    assert repr(initial) in str(info.value)


def test_positional_config_rejected():
    with pytest.raises(TypeError):
        lossscale.DynamicLossScale(2.0, 100)  # type: ignore[misc]


@pytest.mark.parametrize(
    "ls",
    [
        lossscale.NoOpLossScale(),
        lossscale.StaticLossScale(2.0),
        lossscale.DynamicLossScale(),
    ],
    ids=["noop", "static", "dynamic"],
)
@pytest.mark.parametrize(
    "finite, error, message",
    [
        (jnp.array([True, False]), ValueError, "shape"),
        (jnp.float32(1.0), TypeError, "dtype float32"),
        (1, TypeError, "boolean scalar"),
        (None, TypeError, "boolean scalar"),
    ],
)
def test_adjust_bad_grads_finite(ls, finite, error, message):
    with pytest.raises(error, match=message) as info:
        ls.adjust(finite)
    assert "grads_finite" in str(info.value)


INNER = optax.sgd(1.0)
LS = lossscale.NoOpLossScale()


@pytest.mark.parametrize(
    "inner", [optax.adam, None, "adam", (lambda p: p, None)]
)
def test_loss_scaled_bad_inner(inner):
    with pytest.raises(TypeError, match="inner must be an optax"):
        lossscale.loss_scaled(inner, LS, require_scaled_by=False)


@pytest.mark.parametrize(
    "ls, message",
    [
        (lossscale.DynamicLossScale, "did you mean DynamicLossScale()"),
        (2.0**15, r"lossscale\.StaticLossScale\(2\.0\*\*15\)"),
        ("dynamic", "LossScale protocol"),
        (None, "LossScale protocol"),
    ],
)
def test_loss_scaled_bad_loss_scale(ls, message):
    with pytest.raises(TypeError, match=message):
        lossscale.loss_scaled(INNER, ls, require_scaled_by=False)


@pytest.mark.parametrize(
    "axis_name, error",
    [
        (["data"], TypeError),
        ((), ValueError),
        (("data", "data"), ValueError),
        (("data", None), TypeError),
        (("data", ["model"]), TypeError),
        ({"data"}, TypeError),
        # Collectives read an int as a positional axis: refused.
        (0, TypeError),
        (3, TypeError),
        (("data", 1), TypeError),
        (np.int32(0), TypeError),
        (True, TypeError),
    ],
)
def test_bad_axis_name(axis_name, error):
    with pytest.raises(error, match="axis_name") as info:
        lossscale.loss_scaled(
            INNER, LS, axis_name=axis_name, require_scaled_by=False
        )
    assert repr(axis_name) in str(info.value)
    with pytest.raises(error, match="axis_name"):
        lossscale.all_finite(jnp.ones(1), axis_name=axis_name)


@pytest.mark.parametrize("mask", [{"w": 1}, {"w": jnp.array(True)}, ["yes"]])
def test_bad_mask_leaves(mask):
    with pytest.raises(TypeError, match="mask leaves must be Python bools"):
        lossscale.loss_scaled(INNER, LS, mask=mask, require_scaled_by=False)


def test_mask_structure_mismatch_at_init_and_update():
    tx = lossscale.loss_scaled(
        INNER, LS, mask={"a": True, "b": False}, require_scaled_by=False
    )
    params = {"a": jnp.ones(1), "c": jnp.ones(1)}
    with pytest.raises(ValueError, match="mask must have the structure"):
        tx.init(params)
    good = lossscale.loss_scaled(
        INNER, LS, mask={"a": True, "c": False}, require_scaled_by=False
    )
    state = good.init(params)
    with pytest.raises(ValueError, match="mask must have the structure"):
        good.update({"a": jnp.ones(1)}, state)


def test_callable_mask_returning_non_bools():
    tx = lossscale.loss_scaled(
        INNER, LS, mask=lambda p: {"a": "yes"}, require_scaled_by=False
    )
    with pytest.raises(TypeError, match="mask leaves must be Python bools"):
        tx.init({"a": jnp.ones(1)})


def test_update_with_foreign_state():
    tx = lossscale.loss_scaled(INNER, LS, require_scaled_by=False)
    params = jnp.ones(1)
    with pytest.raises(TypeError, match="LossScaledState"):
        tx.update(params, INNER.init(params), params)


def test_static_scale_accepts_numpy_and_int():
    for value in (np.float16(4.0), np.int64(4), 4, jnp.bfloat16(4.0)):
        ls = lossscale.StaticLossScale(value)
        assert jnp.asarray(ls.loss_scale).dtype == jnp.float32
        assert float(ls.loss_scale) == 4.0


def test_int_axis_name_message_says_why():
    with pytest.raises(TypeError, match="never ints"):
        lossscale.loss_scaled(INNER, LS, axis_name=0, require_scaled_by=False)


def test_config_reads_back_as_given():
    ls = lossscale.DynamicLossScale(
        8.0,
        growth_factor=1.1,
        backoff_factor=0.8,
        min_loss_scale=0.3,
        max_loss_scale=1e6,
    )
    assert ls.backoff_factor == 0.8  # not 0.800000011920929
    assert ls.growth_factor == 1.1
    assert ls.min_loss_scale == 0.3
    assert ls.max_loss_scale == 1e6
    assert jax.jit(lambda s: s)(ls).backoff_factor == 0.8
    # The arithmetic is float32: 8 * 0.8 rounded to float32.
    backed = ls.adjust(jnp.bool_(False)).loss_scale
    assert float(backed) == float(np.float32(8.0) * np.float32(0.8))


class _NoFloorPolicy:
    """A custom policy that reports nothing about its minimum."""

    loss_scale = jnp.float32(4.0)

    def scale(self, tree):
        return tree

    def unscale(self, tree):
        return tree

    def adjust(self, grads_finite):
        return self


def test_on_min_scale_error_needs_a_policy_that_knows_its_minimum():
    with pytest.raises(ValueError, match="at_min_scale") as info:
        lossscale.loss_scaled(
            INNER,
            _NoFloorPolicy(),
            on_min_scale="error",
            require_scaled_by=False,
        )
    assert "on_min_scale" in str(info.value)
    # Accepted with "ignore", and with every built-in scale.
    lossscale.loss_scaled(INNER, _NoFloorPolicy(), require_scaled_by=False)
    for ls in (
        lossscale.NoOpLossScale(),
        lossscale.StaticLossScale(8.0),
        lossscale.DynamicLossScale(),
    ):
        lossscale.loss_scaled(
            INNER, ls, on_min_scale="error", require_scaled_by=False
        )


def test_report_nonfinite_must_be_a_bool():
    with pytest.raises(TypeError, match="report_nonfinite"):
        lossscale.loss_scaled(
            INNER, LS, report_nonfinite="yes", require_scaled_by=False
        )


@pytest.mark.parametrize(
    "ls",
    [
        lossscale.DynamicLossScale(0.5, min_loss_scale=2.0**-8),
        lossscale.StaticLossScale(0.5),
    ],
    ids=["dynamic", "static"],
)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float8_e4m3fn])
def test_narrow_gradients_under_a_scale_below_one_are_refused(ls, dtype):
    """Unscaling a finite float16 gradient by 0.5 can overflow float16.

    Backing off would only make that worse: every step would be skipped
    while the gradients are finite. Refused at trace time instead.
    """
    tx = lossscale.loss_scaled(optax.sgd(0.1), ls, require_scaled_by=False)
    params = {"w": jnp.ones(3, dtype), "b": jnp.ones(2, jnp.float32)}
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"\['w'\].*can go down to 0\.\d+ < 1"):
        jax.jit(tx.update)(params, state, params)
    # float32 (and bfloat16) gradients have float32's range: accepted.
    wide = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(2, jnp.float32)}
    tx.update(wide, tx.init(wide), wide)


def test_narrow_gradients_with_a_floor_of_one_are_accepted():
    tx = lossscale.loss_scaled(
        optax.sgd(0.1), lossscale.DynamicLossScale(), require_scaled_by=False
    )
    params = {"w": jnp.full(3, 60000.0, jnp.float16)}
    _, state = jax.jit(tx.update)(params, tx.init(params), params)
    assert bool(state.grads_finite)  # 60000 / 2**16 is finite in float16


def test_numpy_str_axis_name_is_a_name():
    lossscale.loss_scaled(
        INNER, LS, axis_name=np.str_("data"), require_scaled_by=False
    )


@pytest.mark.parametrize(
    "factor, error",
    [
        ("a", TypeError),
        (1j, TypeError),
        (True, TypeError),
        (float("inf"), ValueError),
        (float("nan"), ValueError),
        (0.0, ValueError),
        (-2.0, ValueError),
        (jnp.ones(2), ValueError),
    ],
)
def test_rescale_gradient_bad_factor(factor, error):
    with pytest.raises(error, match="factor") as info:
        lossscale.rescale_gradient(jnp.ones(3), factor)
    if error is ValueError and jnp.ndim(factor) == 0:
        assert repr(factor) in str(info.value)


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"headroom": "2"}, TypeError),
        ({"headroom": 0.5}, ValueError),
        ({"scales": [float("inf")]}, ValueError),
        ({"scales": [2.0**200]}, ValueError),
        ({"scales": [0.0, 1.0]}, ValueError),
    ],
)
def test_diagnose_bad_arguments(kwargs, error):
    name = next(iter(kwargs))
    with pytest.raises(error, match=name):
        lossscale.diagnose(lambda w: jnp.sum(w), jnp.ones(2), **kwargs)


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_multisteps_bad_every_k(k):
    with pytest.raises((TypeError, ValueError), match="every_k_schedule"):
        lossscale.MultiSteps(optax.sgd(1.0), every_k_schedule=k)


def test_unknown_axis_name_under_shard_map():
    from jax.sharding import PartitionSpec as P

    mesh = explicit_mesh((8,), ("data",))
    tx = lossscale.loss_scaled(
        INNER, LS, axis_name="batch", require_scaled_by=False
    )
    state = tx.init(jnp.ones(8))
    specs = jax.tree.map(lambda _: P(), state)
    step = jax.shard_map(
        lambda g, s: tx.update(g, s)[1],
        mesh=mesh,
        in_specs=(P("data"), specs),
        out_specs=specs,
    )
    sharded = jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"not mapped axes here.*'data'"):
        jax.jit(step)(sharded, state)
