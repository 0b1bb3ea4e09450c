"""A property of autocast over random programs built from users' idioms.

Issue 28's property test: hypothesis chooses a list of building blocks
(matmul + bias, layer norms by hand and by flax, activations, masked
softmaxes with a -1e9 fill or an additive float32 bias, ``where``,
``log_softmax``, ``finfo`` constants, a scan and a checkpoint around a
part) and a final loss (cross-entropy by hand and by optax, a mean squared
error, a clipped binary cross-entropy). On each program
``autocast(f, jnp.float16)`` must be finite wherever float32 is, with the
loss within 1e-2 and gradients within 2e-2 relative. ``check_program``
takes the autocast to test, so a negative control can inject an unsafe one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import lossscale

BATCH, WIDTH, CLASSES = 8, 16, 5
LOSS_RTOL, GRAD_RTOL = 1e-2, 2e-2
MASK = (jnp.arange(WIDTH) >= 3)[None, :] & (
    jnp.arange(WIDTH)[None, :] <= jnp.arange(BATCH)[:, None] + 2
)  # left padding, some rows fully masked
BIAS = jnp.where(MASK, 0.0, -1e9).astype(jnp.float32)


def _layer_norm(h, p):
    mu = jnp.mean(h, -1, keepdims=True)
    var = jnp.mean((h - mu) ** 2, -1, keepdims=True)
    return (h - mu) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def _flax_layer_norm(h, p):
    from flax import linen

    return linen.LayerNorm().apply({"params": p}, h)


def _scan(h, p):
    def step(c, _):
        return c + 0.5 * jnp.tanh(c @ p["w"]), None

    return lax.scan(step, h, None, length=3)[0]


def _checkpointed(h, p):
    return jax.checkpoint(lambda h: jax.nn.gelu(h @ p["w"] + p["b"]))(h)


BLOCKS = {
    "dense": lambda h, p: h @ p["w"] + p["b"],
    "layer_norm": _layer_norm,
    "flax_layer_norm": _flax_layer_norm,
    "relu": lambda h, p: jax.nn.relu(h),
    "sigmoid": lambda h, p: jax.nn.sigmoid(h),
    "gelu": lambda h, p: jax.nn.gelu(h),
    "tanh": lambda h, p: jnp.tanh(h),
    "leaky_where": lambda h, p: jnp.where(h > 0, h, 0.1 * h),
    "masked_softmax_fill": lambda h, p: (
        WIDTH * jax.nn.softmax(jnp.where(MASK, h, -1e9))
    ),
    "masked_softmax_bias": lambda h, p: WIDTH * jax.nn.softmax(h + BIAS),
    "log_softmax": lambda h, p: jax.nn.log_softmax(h),
    "finfo_soft_sign": lambda h, p: h / (jnp.abs(h) + jnp.finfo(h.dtype).eps),
    "scan": _scan,
    "checkpoint": _checkpointed,
    "mask_outside_checkpoint": lambda h, p: (
        WIDTH * jax.checkpoint(jax.nn.softmax)(jnp.where(MASK, h, -1e9))
    ),
    "log_sigmoid": lambda h, p: jnp.log(jax.nn.sigmoid(6.0 * h)),
    "relu_after_float32_bias": lambda h, p: jax.nn.relu(h + BIAS),
}


def _clipped_bce(logits, labels):
    p = jnp.clip(jax.nn.sigmoid(logits), 1e-7, 1 - 1e-7)
    y = jax.nn.one_hot(labels, CLASSES, dtype=logits.dtype)
    return -jnp.mean(y * jnp.log(p) + (1 - y) * jnp.log(1 - p))


def _cross_entropy_by_hand(logits, labels):
    m = jnp.max(logits, -1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m), -1, keepdims=True))
    picked = jnp.take_along_axis(logits, labels[:, None], -1)
    return jnp.mean(lse - picked)


def _denormalised_log_cosh(logits, labels):
    y_mean = jnp.full((CLASSES,), 2e5, jnp.float32)
    y_std = jnp.full((CLASSES,), 3e4, jnp.float32)
    target = y_mean + y_std * jax.nn.one_hot(labels, CLASSES, dtype=y_std.dtype)
    return jnp.mean(optax.log_cosh(logits * y_std + y_mean, target)) / 3e4


LOSSES = {
    "denormalised_log_cosh": _denormalised_log_cosh,
    "cross_entropy_by_hand": _cross_entropy_by_hand,
    "optax_integer_cross_entropy": lambda logits, labels: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    ),
    "mean_squared_error": lambda logits, labels: jnp.mean(
        (logits - jax.nn.one_hot(labels, CLASSES, dtype=logits.dtype)) ** 2
    ),
    "clipped_binary_cross_entropy": _clipped_bce,
}


def _block_params(name, key):
    k1, k2 = jax.random.split(key)
    w = jax.random.normal(k1, (WIDTH, WIDTH), jnp.float32) / np.sqrt(WIDTH)
    b = 0.1 * jax.random.normal(k2, (WIDTH,), jnp.float32)
    if name in ("dense", "checkpoint"):
        return {"w": w, "b": b}
    if name == "scan":
        return {"w": w}
    if name in ("layer_norm", "flax_layer_norm"):
        return {"scale": 1.0 + b, "bias": b}
    return {}


def build_program(blocks, loss_name):
    """A loss ``f(params, x, labels)`` and its params, from the blocks."""
    keys = jax.random.split(jax.random.key(0), len(blocks) + 1)
    params = {
        "blocks": [
            _block_params(n, k) for n, k in zip(blocks, keys[:-1], strict=True)
        ],
        "head": jax.random.normal(keys[-1], (WIDTH, CLASSES), jnp.float32)
        / np.sqrt(WIDTH),
    }

    def f(params, x, labels):
        h = x
        for name, p in zip(blocks, params["blocks"], strict=True):
            h = BLOCKS[name](h, p)
        return LOSSES[loss_name](h @ params["head"], labels)

    return f, params


def _inputs():
    x = 2.0 * jax.random.normal(jax.random.key(1), (BATCH, WIDTH), jnp.float32)
    labels = jax.random.randint(jax.random.key(2), (BATCH,), 0, CLASSES)
    return x, labels


def _finite(tree):
    return all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(tree))


def _relative_error(tree, reference):
    diff = float(optax.tree.norm(jax.tree.map(jnp.subtract, tree, reference)))
    scale = float(optax.tree.norm(reference))
    return diff / scale if scale > 0 else diff  # absolute where float32's is 0


def check_program(blocks, f16_fun_factory, loss_name="cross_entropy_by_hand"):
    """Contract point 1 of issue 28 on one program: ``f16_fun_factory(f)``
    (e.g. ``lambda f: lossscale.autocast(f, jnp.float16)``) against ``f``."""
    f, params = build_program(tuple(blocks), loss_name)
    x, labels = _inputs()
    expected, expected_grads = jax.jit(jax.value_and_grad(f))(params, x, labels)
    if not _finite((expected, expected_grads)):
        return  # the property is about programs float32 computes
    value, grads = jax.jit(jax.value_and_grad(f16_fun_factory(f)))(
        params, x, labels
    )
    program = f"{list(blocks)} + {loss_name}"
    assert _finite(value), f"{program}: loss {value} (float32 {expected})"
    assert _finite(grads), f"{program}: gradients not finite"
    assert float(value) == pytest.approx(float(expected), rel=LOSS_RTOL), (
        f"{program}: loss {float(value):.5g} vs float32 {float(expected):.5g}"
    )
    error = _relative_error(grads, expected_grads)
    assert error <= GRAD_RTOL, f"{program}: gradient error {error:.3g}"


def autocast_float16(f):
    return lossscale.autocast(f, jnp.float16)


@pytest.mark.standard_promotion  # flax's LayerNorm, optax's cross-entropy
@settings(
    max_examples=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    blocks=st.lists(st.sampled_from(sorted(BLOCKS)), min_size=1, max_size=4),
    loss_name=st.sampled_from(sorted(LOSSES)),
)
def test_autocast_is_finite_and_close_to_float32_on_random_programs(
    blocks, loss_name
):
    """Issue 28's property test: contract point 1 on random programs."""
    check_program(blocks, autocast_float16, loss_name)


def _cast_everything_to_float16(f):
    """An unsafe autocast: every float32 argument cast to float16."""

    def f16(params, x, labels):
        half = jax.tree.map(lambda a: a.astype(jnp.float16), (params, x))
        return f(*half, labels).astype(jnp.float32)

    return f16


@pytest.mark.standard_promotion
def test_negative_control_the_check_fails_on_an_unsafe_autocast():
    """Issue 28's negative control: check_program catches unsafe casts."""
    with pytest.raises(AssertionError):
        check_program(
            ["dense", "masked_softmax_fill"], _cast_everything_to_float16
        )
    check_program(["dense", "masked_softmax_fill"], lambda f: f)  # float32


@pytest.mark.standard_promotion
@pytest.mark.parametrize(
    ("blocks", "loss_name"),
    [
        (["checkpoint"], "denormalised_log_cosh"),
        (["dense", "masked_softmax_bias"], "cross_entropy_by_hand"),
        (["dense", "masked_softmax_fill"], "mean_squared_error"),
    ],
)
def test_negative_control_the_check_fails_on_the_rules_before_issue_28(
    monkeypatch, blocks, loss_name
):
    """The same check fails on autocast's earlier rule (an activation
    meeting a float32 value computed in float32 and rounded back to
    float16), put in place of the promotion rule of the pass's table."""
    from lossscale._autocast import _equation
    from lossscale._autocast._rules import Kind

    promote = _equation.KINDS[Kind.PROMOTE]

    def round_mixed(a):
        if _equation.Cls.LOW in a.floats:
            return a.result(_equation.Mode.FLOAT32, _equation.Cls.LOW)
        return promote(a)

    check_program(blocks, autocast_float16, loss_name)  # today's rules
    monkeypatch.setitem(_equation.KINDS, Kind.PROMOTE, round_mixed)
    with pytest.raises(AssertionError):
        check_program(blocks, autocast_float16, loss_name)
