"""autocast never gives inf, NaN or a wrong value where float32 is finite.

One test per case of issue 28's "What was seen": each is written as a user
would write it, run with ``lossscale.autocast(f, jnp.float16)`` and with
the float32 ``f`` on realistic inputs, and held to the issue's targets:
outputs finite, the loss within 1e-2 relative of float32's, gradients
within 2e-2 relative (global norm of the difference over float32's), loops
taking float32's iteration count, and the deep residual stream within 2x
the gradient error of the same model written with a float32 residual.
The override tests read the dtype a matmul runs in from the jaxpr.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lossscale
from tests.helpers import equations, operand_dtypes

F16, F32 = np.dtype(jnp.float16), np.dtype(np.float32)
LOSS_RTOL, GRAD_RTOL = 1e-2, 2e-2


def normal(seed, shape, scale=1.0):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale


def relative_error(tree, reference):
    """Global norm of ``tree - reference`` over the global norm of reference."""
    diff = jax.tree.map(lambda a, b: a - b, tree, reference)
    return float(optax.tree.norm(diff) / optax.tree.norm(reference))


def assert_finite(tree, what):
    for leaf in jax.tree.leaves(tree):
        assert bool(jnp.all(jnp.isfinite(leaf))), f"{what} not finite"


def assert_loss_and_grads_match(loss, *args):
    """autocast(loss)'s value and gradients (argument 0) against float32's."""
    expected, expected_grads = jax.jit(jax.value_and_grad(loss))(*args)
    assert_finite((expected, expected_grads), "float32")  # the premise
    auto = lossscale.autocast(loss, jnp.float16)
    value, grads = jax.jit(jax.value_and_grad(auto))(*args)
    assert_finite(value, f"loss (float32: {float(expected):.4g})")
    assert_finite(grads, "gradients")
    assert float(value) == pytest.approx(float(expected), rel=LOSS_RTOL)
    error = relative_error(grads, expected_grads)
    assert error <= GRAD_RTOL, f"gradient error {error:.3g}"


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def mlp_params(seed, n_in, n_hidden, n_out):
    return {
        "w1": normal(seed, (n_in, n_hidden), 1 / math.sqrt(n_in)),
        "b1": jnp.zeros((n_hidden,), jnp.float32),
        "w2": normal(seed + 1, (n_hidden, n_out), 1 / math.sqrt(n_hidden)),
    }


# --- float32 results rounded back to float16 -------------------------------


@pytest.mark.parametrize("hinge", ["log_cosh", "relu"])
def test_denormalised_regression_targets_of_2e5(hinge):
    """Issue 28: ``pred * y_std + y_mean`` (targets ~2e5) is inf, not 3.80."""
    x = normal(0, (32, 8))
    y = 2e5 + 3e4 * jnp.tanh(x[:, :1] - 0.5 * x[:, 1:2])
    y_mean, y_std = jnp.mean(y, 0), jnp.std(y, 0)  # float32, shape (1,)

    def loss(params, x, y):
        pred = mlp(params, x) * y_std + y_mean
        if hinge == "log_cosh":
            return jnp.mean(optax.log_cosh(pred, y)) / y_std[0]
        return jnp.mean(jax.nn.relu(jnp.abs(pred - y) - 100.0)) / y_std[0]

    assert_loss_and_grads_match(loss, mlp_params(1, 8, 16, 1), x, y)


def _padded_causal_mask(length, pad):
    valid = jnp.arange(length) >= pad
    causal = jnp.arange(length)[:, None] >= jnp.arange(length)[None, :]
    return causal & valid[None, :]


def _attention_params(seed, d):
    return {
        n: normal(seed + i, (d, d), 1 / math.sqrt(d))
        for i, n in enumerate(("q", "k", "v"))
    }


@pytest.mark.parametrize("fill", [-1e9, float(jnp.finfo(jnp.float32).min)])
def test_blockwise_online_softmax_attention_in_a_scan(fill):
    """Issue 28: online-softmax attention over key blocks, left padded: NaN."""
    length, block, d = 16, 4, 8
    x = normal(0, (length, d))
    mask = _padded_causal_mask(length, pad=6)

    def attention(p, x):
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        blocks = (
            k.reshape(-1, block, d),
            v.reshape(-1, block, d),
            mask.reshape(length, -1, block).transpose(1, 0, 2),
        )

        def step(carry, blk):
            m, denom, acc = carry
            kj, vj, mj = blk
            s = jnp.where(mj, q @ kj.T / math.sqrt(d), fill)
            m_new = jnp.maximum(m, s.max(-1))
            p_ = jnp.exp(s - m_new[:, None])
            correction = jnp.exp(m - m_new)
            denom = denom * correction + p_.sum(-1)
            acc = acc * correction[:, None] + p_ @ vj
            return (m_new, denom, acc), None

        init = (
            jnp.full((length,), -jnp.inf, jnp.float32),
            jnp.zeros((length,), jnp.float32),
            jnp.zeros((length, d), jnp.float32),
        )
        (_, denom, acc), _ = lax.scan(step, init, blocks)
        return acc / denom[:, None]

    def loss(p, x):
        return jnp.mean((attention(p, x) - 0.5) ** 2)

    assert_loss_and_grads_match(loss, _attention_params(1, d), x)


@pytest.mark.parametrize("mask_kind", ["fill", "additive_bias"])
def test_mask_applied_outside_a_checkpointed_softmax(mask_kind):
    """Issue 28: a mask outside ``jax.checkpoint(softmax(s) @ v)``: NaN."""
    length, d = 12, 8
    x = normal(0, (length, d))
    mask = _padded_causal_mask(length, pad=4)
    bias = jnp.where(mask, 0.0, -1e9).astype(jnp.float32)
    attend = jax.checkpoint(lambda s, v: jax.nn.softmax(s) @ v)

    def loss(p, x):
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        s = q @ k.T / math.sqrt(d)
        s = jnp.where(mask, s, -1e9) if mask_kind == "fill" else s + bias
        return jnp.mean((attend(s, v) - 0.5) ** 2)

    assert_loss_and_grads_match(loss, _attention_params(1, d), x)


def test_pairwise_distances_with_relu_triplet_hinges():
    """Issue 28: ``sqrt(maximum(d2, 1e-12))`` and relu hinges: NaN grads."""
    x = normal(0, (8, 6))
    w = normal(1, (6, 4), 0.4)
    anchor, positive = jnp.array([0, 1, 2, 3]), jnp.array([1, 0, 3, 2])
    negative = jnp.array([4, 5, 6, 7])

    def loss(w, x):
        e = x @ w
        sq = jnp.sum(e**2, -1)
        d2 = sq[:, None] + sq[None, :] - 2 * e @ e.T
        dist = jnp.sqrt(jnp.maximum(d2, 1e-12))
        hinge = jax.nn.relu(
            dist[anchor, positive] - dist[anchor, negative] + 1.0
        )
        pull = jax.nn.relu(dist - 0.5)  # every pair, the diagonal included
        return jnp.mean(hinge) + 0.1 * jnp.mean(pull)

    assert_loss_and_grads_match(loss, w, x)


# --- bounded activations rounded where float32 reads them ------------------


def _logits_up_to(seed, bound):
    """Inputs and weights whose logits ``x @ w`` reach ``|z| = bound``."""
    x = normal(seed, (32, 8))
    w = normal(seed + 1, (8, 1))
    return w * (bound / jnp.max(jnp.abs(x @ w))), x


def test_log_of_sigmoid_with_logits_up_to_23():
    """Issue 28: ``log(sigmoid(z))`` with ``|z| <= 23`` is inf."""
    w, x = _logits_up_to(0, 23.0)
    labels = jnp.sign(x[:, :1])

    def loss(w, x):
        return -jnp.mean(jnp.log(jax.nn.sigmoid(labels * (x @ w))))

    assert_loss_and_grads_match(loss, w, x)


@pytest.mark.parametrize("spelling", ["clip", "plus_eps"])
def test_binary_cross_entropy_on_clipped_probabilities(spelling):
    """Issue 28: BCE on ``clip(p, 1e-7, 1-1e-7)`` / ``log(p + 1e-7)``."""
    w, x = _logits_up_to(0, 12.0)
    y = (x[:, :1] + 0.3 * x[:, 1:2] > 0).astype(jnp.float32)

    def loss(w, x):
        p = jax.nn.sigmoid(x @ w)
        if spelling == "clip":
            p = jnp.clip(p, 1e-7, 1 - 1e-7)
            return -jnp.mean(y * jnp.log(p) + (1 - y) * jnp.log(1 - p))
        return -jnp.mean(
            y * jnp.log(p + 1e-7) + (1 - y) * jnp.log(1 - p + 1e-7)
        )

    assert_loss_and_grads_match(loss, w, x)


def test_sin_of_a_cumulative_phase():
    """Issue 28: ``sin`` of a cumsum phase is off by up to 0.95."""
    x = normal(0, (64, 4))
    w = normal(1, (4, 2), 0.5)

    def signal(w, x):
        frequency = 2.0 + jax.nn.sigmoid(x @ w)  # radians per step
        return jnp.sin(jnp.cumsum(frequency, axis=0))

    def loss(w, x):
        return jnp.mean((signal(w, x) - 0.3) ** 2)

    expected = signal(w, x)
    seen = lossscale.autocast(signal, jnp.float16)(w, x)
    assert float(jnp.max(jnp.abs(seen - expected))) <= 2e-2
    assert_loss_and_grads_match(loss, w, x)


# --- dtype-dependent and strongly typed constants ---------------------------


@pytest.mark.parametrize("constant", ["tiny", "eps"])
def test_safe_division_by_finfo_of_the_activation_dtype(constant):
    """Issue 28: ``h / maximum(abs(h), finfo(h.dtype).tiny)``, h has zeros."""
    x = normal(0, (8, 6)).at[::3].set(0.0)  # padding rows: h is exactly 0
    w = normal(1, (6, 4), 0.4)
    readout = normal(2, (4, 3), 0.5)

    def loss(w, x):
        h = x @ w
        floor = getattr(jnp.finfo(h.dtype), constant)
        direction = h / jnp.maximum(jnp.abs(h), floor)  # sign(h), 0 at 0
        return jnp.mean((direction @ readout - 0.2) ** 2) + jnp.mean(h**2)

    # The value only: float32's gradient reads 1 / tiny**2 (inf), and at
    # h = 0 its 1 / eps (8e6) is the cotangent of h, which the float16
    # matmul x @ w takes as its backward operand: an overflow inside a
    # matmul, the boundary every AMP has (hand-cast float16 is NaN there).
    expected = loss(w, x)
    value = lossscale.autocast(loss, jnp.float16)(w, x)
    assert_finite(value, f"loss (float32: {float(expected):.4g})")
    assert float(value) == pytest.approx(float(expected), rel=LOSS_RTOL)


@pytest.mark.parametrize("spelling", ["gate_times_1e5", "units_over_1e5"])
def test_a_strongly_typed_float32_scalar_meets_an_activation(spelling):
    """Issue 28: a strongly typed ``jnp.float32(1e5)`` is taken as weak."""
    x = normal(0, (8, 6)).at[::3].set(0.0)
    w = normal(1, (6, 5), 0.4)

    def loss(w, x):
        h = x @ w
        if spelling == "gate_times_1e5":  # a smooth sign(h)
            return jnp.mean(jnp.tanh(h * jnp.float32(1e5)) * h)
        scale = jnp.array(1e5, jnp.float32)  # e.g. metres to 100 km
        return jnp.mean(jax.nn.relu(h / scale)) * 1e5

    assert_loss_and_grads_match(loss, w, x)


# --- loop carries -------------------------------------------------------


def test_gradient_accumulation_over_micro_batches_inside_autocast():
    """Issue 28: float32 grads summed in a scan carry are 7.4% off."""
    xs = normal(0, (16, 8, 8))
    params = mlp_params(1, 8, 16, 2)
    ys = mlp(params, xs) + 0.02 * normal(2, (16, 8, 2))  # near its fit

    def micro_loss(params, x, y):
        return jnp.mean((mlp(params, x) - y) ** 2)

    def accumulated(params, xs, ys):
        def step(total, batch):
            g = jax.grad(micro_loss)(params, *batch)
            return jax.tree.map(jnp.add, total, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return lax.scan(step, zeros, (xs, ys))[0]

    def accumulated_outside(params, xs, ys):  # only the loss in autocast
        def step(total, batch):
            g = jax.grad(lossscale.autocast(micro_loss))(params, *batch)
            return jax.tree.map(jnp.add, total, g), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        return lax.scan(step, zeros, (xs, ys))[0]

    auto = lossscale.autocast(accumulated, jnp.float16)
    expected = jax.jit(accumulated)(params, xs, ys)
    seen = jax.jit(auto)(params, xs, ys)
    assert_finite(seen, "accumulated gradients")
    # Near the fit, each micro-batch's float16 gradient is a few percent
    # off float32's whoever accumulates it (the float16 matmul's own
    # error over small residuals): accumulating inside autocast must add
    # nothing to it (it added 7.4% when the carry was float16).
    outside = jax.jit(accumulated_outside)(params, xs, ys)
    error = relative_error(seen, outside)
    assert error <= 1e-5, f"inside against outside autocast: {error:.3g}"
    assert relative_error(outside, expected) <= 0.1
    (scan,) = [
        eqn
        for eqn in jax.make_jaxpr(auto)(params, xs, ys).jaxpr.eqns
        if eqn.primitive.name == "scan"
    ]
    assert {np.dtype(v.aval.dtype) for v in scan.outvars} == {F32}


def test_an_ema_carry_over_512_steps():
    """Issue 28: an exponential moving average over 512 steps is 1% off."""
    xs = normal(0, (512, 4, 8))
    w = normal(1, (8, 8), 0.35)

    def ema_of_features(w, xs):
        def step(ema, x):
            return 0.99 * ema + 0.01 * jnp.tanh(x @ w), None

        return lax.scan(step, jnp.zeros((4, 8), jnp.float32), xs)[0]

    expected = jax.jit(ema_of_features)(w, xs)
    seen = jax.jit(lossscale.autocast(ema_of_features, jnp.float16))(w, xs)
    assert_finite(seen, "EMA")
    error = relative_error(seen, expected)
    assert error <= LOSS_RTOL, f"EMA error {error:.3g}"


def test_a_while_loop_fixed_point_solve_to_1e_5():
    """Issue 28: a fixed-point solve to tol 1e-5 runs to its cap (29 rounds)."""
    x = normal(0, (4, 8))
    w = normal(1, (8, 8), 0.15)
    cap = 200

    def solve(w, x):
        def cond(state):
            z, previous, i = state
            return (jnp.max(jnp.abs(z - previous)) > 1e-5) & (i < cap)

        def body(state):
            z, _, i = state
            return jnp.tanh(z @ w + x), z, i + 1

        z0 = jnp.zeros_like(x)
        z, _, count = lax.while_loop(cond, body, (jnp.tanh(x), z0, 0))
        return z, count

    expected, expected_count = jax.jit(solve)(w, x)
    seen, count = jax.jit(lossscale.autocast(solve, jnp.float16))(w, x)
    assert int(expected_count) < cap  # the premise: float32 converges
    assert int(count) == int(expected_count)
    assert_finite(seen, "solution")
    assert relative_error(seen, expected) <= LOSS_RTOL


def test_a_while_loop_counter_reaches_its_bound():
    """Issue 28: ``t += 1e-3`` under ``while t < 1.0`` misses its bound."""
    x = normal(0, (4, 8))
    w = normal(1, (8, 8), 0.3)
    cap = 5000  # the guard: the test cannot hang

    def integrate(w, x):
        """Euler steps of dh/dt, with time carried as a state feature."""

        def cond(state):
            ht, i = state
            return (jnp.max(ht[:, -1]) < 1.0) & (i < cap)

        def body(state):
            ht, i = state
            h, t = ht[:, :-1], ht[:, -1:]
            velocity = jnp.concatenate([jnp.tanh(h @ w), jnp.ones_like(t)], -1)
            return ht + 1e-3 * velocity, i + 1

        t0 = jnp.zeros((4, 1), jnp.float32)
        return lax.while_loop(cond, body, (jnp.concatenate([x, t0], -1), 0))

    _, expected_count = jax.jit(integrate)(w, x)
    seen, count = jax.jit(lossscale.autocast(integrate, jnp.float16))(w, x)
    assert int(expected_count) < cap  # the premise: float32 stops
    assert int(count) == int(expected_count)
    assert_finite(seen, "state")


def test_exp_results_passed_along_an_8_carry_chain():
    """Issue 28: the carry fixed point stops after 5 rounds (8-carry chain)."""
    xs = normal(0, (10, 4, 8))
    w = normal(1, (8, 8), 0.1)

    def loss(w, xs):
        def step(carry, x):
            fresh = jnp.exp(x @ w + 11.0)  # about 6e4, beyond float16
            return (fresh, *carry[:-1]), None

        start = jax.nn.sigmoid(xs[0] @ w)  # an activation: float16
        init = tuple(start for _ in range(8))
        last = lax.scan(step, init, xs)[0][-1]
        return jnp.mean(jnp.log(last))

    grad_jaxpr = jax.make_jaxpr(
        jax.grad(lossscale.autocast(loss, jnp.float16))
    )(w, xs)
    assert set(operand_dtypes(grad_jaxpr, "exp")) == {(F32,)}
    assert_loss_and_grads_match(loss, w, xs)


# --- the residual stream ---------------------------------------------------


def _residual_model(params, x, *, float32_residual=False):
    """48 pre-norm blocks adding updates of ~1e-3 to a stream of |h| ~ 30."""
    h = x
    for w in params:
        mu = jnp.mean(h, -1, keepdims=True)
        var = jnp.var(h, -1, keepdims=True)
        normed = (h - mu) * lax.rsqrt(var + 1e-5)
        if float32_residual:  # hand-cast: 16-bit matmul, float32 stream
            update = jnp.tanh(normed.astype(jnp.float16) @ w.astype(F16))
            h = h + 1e-3 * update.astype(jnp.float32)
        else:
            h = h + 1e-3 * jnp.tanh(normed @ w)
    return h


def test_a_48_layer_residual_stream_with_small_updates():
    """Issue 28: the residual stream is float16: gradient error 1.27."""
    width = 16
    params = [
        normal(i, (width, width), 1 / math.sqrt(width)) for i in range(48)
    ]
    x = 30.0 * jnp.tanh(normal(100, (4, width)))
    target = _residual_model(params, x) + 1e-3 * normal(101, (4, width))

    def loss(params, x, *, float32_residual=False):
        h = _residual_model(params, x, float32_residual=float32_residual)
        return jnp.mean((h - target) ** 2) * 1e4

    # Eager: XLA:CPU takes ~18 s to compile the float32 gradient.
    expected = jax.grad(loss)(params, x)
    hand_cast = jax.grad(lambda p, x: loss(p, x, float32_residual=True))(
        params, x
    )
    seen = jax.jit(jax.grad(lossscale.autocast(loss, jnp.float16)))(params, x)
    assert_finite(seen, "gradients")
    baseline = relative_error(hand_cast, expected)
    error = relative_error(seen, expected)
    assert error <= 2 * baseline, (
        f"error {error:.3g} vs hand-cast {baseline:.3g}"
    )


@pytest.mark.skipif(not hasattr(jax, "new_ref"), reason="needs jax.new_ref")
def test_a_float32_ref_accumulated_in_a_loop():
    """Issue 28: a float32 ``jax.new_ref`` buffer is rounded every step."""
    xs = normal(0, (8192, 2, 8))
    w = normal(1, (8, 8), 0.35)

    def summed_features(w, xs):
        total = jax.new_ref(jnp.zeros((2, 8), jnp.float32))

        def body(i, carry):
            total[...] += jax.nn.sigmoid(xs[i] @ w)  # to ~4000
            return carry

        lax.fori_loop(0, xs.shape[0], body, 0)
        return total[...]

    expected = jax.jit(summed_features)(w, xs)
    seen = jax.jit(lossscale.autocast(summed_features, jnp.float16))(w, xs)
    assert_finite(seen, "buffer")
    error = relative_error(seen, expected)
    assert error <= LOSS_RTOL, f"buffer error {error:.3g}"


# --- overrides -------------------------------------------------------------

ROUTER_SHAPE = (8, 6)  # only the scoped matmul reads an (8, 6) operand


def _scoped_model(params, x):
    with lossscale.float32_scope():
        h = jnp.tanh(x @ params["router"])
    return h @ params["out"]


def _scoped_params():
    return {"router": normal(0, ROUTER_SHAPE, 0.3), "out": normal(1, (6, 4))}


def scoped_and_other_matmul_dtypes(jaxpr, scoped_shape=ROUTER_SHAPE):
    """Operand dtypes of the matmuls reading a ``scoped_shape`` operand, and
    of the others' forward matmul (the one reading the (6, 4) weight)."""
    scoped, other = set(), set()
    for eqn in equations(jaxpr):
        if eqn.primitive.name != "dot_general":
            continue
        shapes = {tuple(v.aval.shape) for v in eqn.invars}
        dtypes = tuple(np.dtype(v.aval.dtype) for v in eqn.invars)
        if scoped_shape in shapes:
            scoped.add(dtypes)
        elif (6, 4) in shapes and any(len(s) and s[-1] == 6 for s in shapes):
            other.add(dtypes)
    return scoped, other


def _untransformed(params, x):
    return jnp.sum(_scoped_model(params, x))


def _under_vmap(params, xs):
    return jnp.sum(jax.vmap(_scoped_model, (None, 0))(params, xs))


def _under_grad(params, x):
    return jax.grad(lambda p: jnp.sum(_scoped_model(p, x)))(params)


def _under_jvp(params, x):
    tangent = jax.tree.map(jnp.ones_like, params)
    return jax.jvp(lambda p: _scoped_model(p, x), (params,), (tangent,))


def _nested(params, xs):
    def outer(params, x):
        with jax.named_scope("block"):
            return jax.vmap(_scoped_model, (None, 0))(params, x)

    return jnp.sum(jax.vmap(outer, (None, 0))(params, xs))


@pytest.mark.parametrize(
    "transform, x_shape",
    [
        (_untransformed, (5, 8)),
        (_under_vmap, (3, 5, 8)),
        (_under_grad, (5, 8)),
        (_under_jvp, (5, 8)),
        (_nested, (2, 3, 5, 8)),
    ],
    ids=["none", "vmap", "grad", "jvp", "nested"],
)
def test_float32_scope_holds_under_transformations(transform, x_shape):
    """Issue 28: ``float32_scope()`` under ``jax.vmap``/``grad``/``jvp``."""
    args = _scoped_params(), normal(2, x_shape)
    jaxpr = jax.make_jaxpr(lossscale.autocast(transform, jnp.float16))(*args)
    scoped, other = scoped_and_other_matmul_dtypes(jaxpr)
    assert scoped == {(F32, F32)}
    assert other == {(F16, F16)}  # the rest is still autocast


@pytest.mark.standard_promotion
def test_float32_scope_holds_under_nnx_vmap():
    """Issue 28: ``float32_scope()`` inside a model run by ``nnx.vmap``."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.router = nnx.Linear(8, 6, use_bias=False, rngs=rngs)
            self.out = nnx.Linear(6, 4, use_bias=False, rngs=rngs)

        def __call__(self, x):
            with lossscale.float32_scope():
                h = jnp.tanh(self.router(x))
            return self.out(h)

    model = Model(nnx.Rngs(0))

    def loss(model, xs):
        return jnp.sum(
            nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(model, xs)
        )

    jaxpr = jax.make_jaxpr(
        lambda xs: lossscale.autocast(loss, jnp.float16)(model, xs)
    )(normal(2, (3, 5, 8)))
    scoped, other = scoped_and_other_matmul_dtypes(jaxpr)
    assert scoped == {(F32, F32)} and other == {(F16, F16)}


def test_float32_scope_holds_under_eqx_filter_vmap():
    """Issue 28: ``float32_scope()`` inside ``eqx.filter_vmap(model)``."""
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        router: eqx.nn.Linear
        out: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.router = eqx.nn.Linear(8, 6, use_bias=False, key=k1)
            self.out = eqx.nn.Linear(6, 4, use_bias=False, key=k2)

        def __call__(self, x):
            with lossscale.float32_scope():
                h = jnp.tanh(self.router(x))
            return self.out(h)

    model = Model(jax.random.key(0))

    def loss(model, xs):
        return jnp.sum(eqx.filter_vmap(model)(xs))

    jaxpr = jax.make_jaxpr(lossscale.autocast(loss, jnp.float16))(
        model, normal(2, (3, 8))
    )
    scoped, _ = scoped_and_other_matmul_dtypes(jaxpr, scoped_shape=(6, 8))
    assert scoped == {(F32, F32)}
    assert set(operand_dtypes(jaxpr, "dot_general")) == {
        (F32, F32),
        (F16, F16),
    }


def _helper_not_jitted(h):
    return jnp.tanh(h)


@pytest.mark.parametrize("key", ["tahn", "_helper_not_jitted"])
def test_a_rules_key_that_matches_nothing_warns_or_raises(key):
    """Issue 28: a ``rules=`` key matching no equation is silently ignored."""

    def loss(w, x):
        return jnp.sum(_helper_not_jitted(x @ w))

    args = normal(0, (4, 4)), normal(1, (2, 4))
    raised = None
    try:
        with pytest.warns(Warning, match=key):
            lossscale.autocast(loss, jnp.float16, rules={key: "float32"})(*args)
    except (ValueError, KeyError, TypeError, LookupError) as error:
        raised = error
    if raised is not None:
        assert key in str(raised)


@pytest.mark.parametrize("name", ["square", "log"])
def test_a_jitted_function_named_like_a_primitive_runs_its_matmul_in_16_bits(
    name,
):
    """Issue 28: a jitted function named ``square`` runs whole in float32."""

    def gram(h):
        return h @ h.T

    gram.__name__ = gram.__qualname__ = name
    inner = jax.jit(gram)

    def loss(w, x):
        return jnp.mean(inner(x @ w))

    jaxpr = jax.make_jaxpr(lossscale.autocast(loss, jnp.float16))(
        normal(0, (8, 4)), normal(1, (3, 8))
    )
    assert set(operand_dtypes(jaxpr, "dot_general")) == {(F16, F16)}


def test_a_function_rule_compute_acts_or_raises():
    """Issue 28: a function rule ``"compute"`` is silently a no-op."""

    @jax.jit
    def gate(h):
        return jnp.exp(-(h**2))

    def loss(w, x):
        return jnp.sum(gate(x @ w) @ w)

    args = normal(0, (4, 4)), normal(1, (2, 4))
    try:
        auto = lossscale.autocast(loss, jnp.float16, rules={"gate": "compute"})
        jaxpr = jax.make_jaxpr(auto)(*args)
    except (ValueError, TypeError, NotImplementedError) as error:
        assert "gate" in str(error)
        return
    default = jax.make_jaxpr(lossscale.autocast(loss, jnp.float16))(*args)
    assert operand_dtypes(default, "exp") == [(F32,)]
    assert operand_dtypes(jaxpr, "exp") == [(F16,)]


@pytest.mark.parametrize("spelling", ["dot_general", "jnp.dot"])
def test_precision_highest_runs_the_matmul_in_float32(spelling):
    """Issue 28: ``precision=HIGHEST`` on a matmul is overridden to float16."""

    def loss(w, x):
        if spelling == "dot_general":
            exact = lax.dot_general(
                x, w, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST
            )
        else:
            exact = jnp.dot(x, w, precision="highest")
        return jnp.sum(exact @ w.T)  # a default-precision matmul as control

    jaxpr = jax.make_jaxpr(lossscale.autocast(loss, jnp.float16))(
        normal(0, (4, 4)), normal(1, (2, 4))
    )
    assert sorted(operand_dtypes(jaxpr, "dot_general")) == [
        (F16, F16),
        (F32, F32),
    ]
