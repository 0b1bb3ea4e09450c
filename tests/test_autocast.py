"""lossscale.autocast: which dtype every operation runs in, read from jaxprs.

Each test reads the dtypes autocast chose from the jaxpr of the function
(or of its gradient), which is what XLA compiles, and checks values against
the float32 function where numbers matter. A negative control (the same
function without autocast) shows each dtype assertion can fail.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import lossscale
from lossscale import _compat
from tests.helpers import equations, operand_dtypes

F16, BF16, F32 = (
    np.dtype(jnp.float16),
    np.dtype(jnp.bfloat16),
    np.dtype(np.float32),
)


def dots(fun, *args):
    return operand_dtypes(jax.make_jaxpr(fun)(*args), "dot_general")


def mlp_loss(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    out = h @ params["w2"]
    return jnp.mean((out - 1.0) ** 2)


@pytest.fixture
def mlp():
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {
        "w1": jax.random.normal(k1, (8, 16)) / 3,
        "b1": jnp.zeros(16),
        "w2": jax.random.normal(k2, (16, 4)) / 4,
    }
    return params, jax.random.normal(k3, (32, 8))


# --- matmuls, forward and backward ---------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_every_matmul_forward_and_backward_runs_in_the_compute_dtype(
    mlp, dtype
):
    params, x = mlp
    loss = lossscale.autocast(mlp_loss, dtype)
    forward = dots(loss, params, x)
    backward = dots(jax.grad(loss), params, x)
    assert len(forward) == 2 and len(backward) == 2 + 3  # dx, dW twice
    assert set(forward + backward) == {(np.dtype(dtype),) * 2}
    # Negative control: without autocast every matmul is float32.
    assert set(dots(jax.grad(mlp_loss), params, x)) == {(F32, F32)}


def test_convolutions_forward_and_backward_and_vjp():
    def f(kernel, x):
        y = lax.conv_general_dilated(x, kernel, (1, 1), "SAME")
        return jnp.mean(jax.nn.relu(y) ** 2)

    kernel = jax.random.normal(jax.random.key(0), (4, 3, 3, 3)) / 5
    x = jax.random.normal(jax.random.key(1), (2, 3, 8, 8))
    auto = lossscale.autocast(f)
    jaxpr = jax.make_jaxpr(jax.grad(auto))(kernel, x)
    convs = operand_dtypes(jaxpr, "conv_general_dilated")
    assert len(convs) >= 2 and set(convs) == {(F16, F16)}  # fwd, bwd
    value, pullback = jax.vjp(auto, kernel, x)
    (g_kernel, g_x) = pullback(jnp.ones_like(value))
    assert (g_kernel.dtype, g_x.dtype) == (F32, F32)
    np.testing.assert_allclose(
        g_kernel, jax.grad(f)(kernel, x), rtol=2e-2, atol=1e-3
    )


def test_gradients_are_float32_with_the_params_structure(mlp):
    params, x = mlp
    grads = jax.grad(lossscale.autocast(mlp_loss))(params, x)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}
    reference = jax.grad(mlp_loss)(params, x)
    for g, r in zip(
        jax.tree.leaves(grads), jax.tree.leaves(reference), strict=True
    ):
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-3)


def test_composes_with_loss_scaling(mlp):
    params, x = mlp
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.StaticLossScale(2.0**8),
        require_scaled_by=False,
    )
    state = tx.init(params)
    scale = lossscale.get_loss_scale(state)
    loss = lossscale.autocast(mlp_loss)
    scaled = jax.grad(lambda p: scale.scale(loss(p, x)))(params)
    plain = jax.grad(loss)(params, x)
    for s, g in zip(
        jax.tree.leaves(scaled), jax.tree.leaves(plain), strict=True
    ):
        assert s.dtype == F32
        # The cotangents are scaled by a power of two: float16 rounding
        # is the same, and unscaling gives the plain gradients.
        np.testing.assert_allclose(s / 2.0**8, g, rtol=1e-2, atol=1e-6)
    updates, _ = jax.jit(tx.update)(scaled, state, params)
    np.testing.assert_allclose(
        updates["w1"], -plain["w1"], rtol=1e-2, atol=1e-6
    )


def test_composes_with_value_and_grad(mlp):
    params, x = mlp
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.StaticLossScale(2.0**8),
        require_scaled_by=False,
    )
    state = tx.init(params)
    loss = lossscale.autocast(mlp_loss)

    def step(params, state, x):
        return lossscale.value_and_grad(loss, state)(params, x)

    value, grads = jax.jit(step)(params, state, x)
    seen = dots(lambda p: step(p, state, x), params)
    assert value.dtype == F32
    # The unscaled loss (one rounding of a differently fused program off).
    assert float(value) == pytest.approx(float(loss(params, x)), rel=1e-6)
    np.testing.assert_allclose(
        grads["w1"] / 2.0**8,
        jax.grad(loss)(params, x)["w1"],
        rtol=1e-2,
        atol=1e-6,
    )
    assert set(seen) == {(F16, F16)}


# --- what runs in float32 -----------------------------------------------


@pytest.mark.parametrize(
    ("primitive", "fun"),
    [
        ("exp", jnp.exp),
        ("log", lambda h: jnp.log(jnp.abs(h) + 1.0)),
        ("integer_pow", lambda h: h**3),
        ("rsqrt", lambda h: lax.rsqrt(jnp.abs(h) + 1.0)),
        ("reduce_sum", lambda h: h - jnp.mean(h, axis=-1, keepdims=True)),
        ("cumsum", lambda h: jnp.cumsum(h, axis=-1)),
        ("pow", lambda h: jnp.abs(h) ** 1.5),
    ],
)
def test_numerically_sensitive_operations_read_float32(primitive, fun):
    def f(x, w):
        return jnp.sum(jnp.tanh(fun(x @ w)) @ w.T)

    x, w = jnp.ones((4, 3)), jnp.ones((3, 3))
    seen = operand_dtypes(
        jax.make_jaxpr(lossscale.autocast(f))(x, w), primitive
    )
    assert seen and all(set(d) == {F32} for d in seen)
    assert dots(lossscale.autocast(f), x, w) == [(F16, F16)] * 2


def test_float16_overflow_of_a_square_is_avoided():
    # 300**2 overflows float16 (max 65504); the mean of squares does not.
    def f(x):
        h = x @ jnp.eye(2)
        return jnp.mean(h**2)

    x = jnp.full((4, 2), 300.0)
    assert float(lossscale.autocast(f)(x)) == pytest.approx(90000.0)
    hand = jnp.mean(
        (x.astype(jnp.float16) @ jnp.eye(2, dtype=jnp.float16)) ** 2
    )
    assert not np.isfinite(float(hand))  # the hand-cast float16 overflows


def test_softmax_runs_in_float32_including_the_subtraction_of_the_max():
    def f(x, w):
        return jax.nn.softmax(x @ w, axis=-1) @ w.T

    x, w = jnp.ones((4, 3)), jnp.ones((3, 3))
    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(x, w)
    eqns = list(equations(jaxpr))
    exp = next(e for e in eqns if e.primitive.name == "exp")
    sub = next(e for e in eqns if exp.invars[0] in e.outvars)
    assert sub.primitive.name == "sub"
    assert {np.dtype(v.aval.dtype) for v in sub.invars} == {F32}
    assert operand_dtypes(jaxpr, "dot_general") == [(F16, F16)] * 2


@pytest.mark.parametrize("custom_jvp", [False, True])
def test_softmax_as_custom_jvp_runs_whole_in_float32(custom_jvp):
    def f(x, w):
        return jnp.sum(jax.nn.softmax(x @ w, axis=-1) @ w.T)

    x, w = jnp.ones((4, 3)), jnp.ones((3, 3))
    with jax.softmax_custom_jvp(custom_jvp):
        loss = lossscale.autocast(f)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=1))(x, w)
        grad = jax.grad(loss, argnums=1)(x, w)
    exps = operand_dtypes(jaxpr, "exp")
    assert exps and all(d == (F32,) for d in exps)
    np.testing.assert_allclose(grad, jax.grad(f, argnums=1)(x, w), rtol=2e-3)


def test_log_softmax_and_cross_entropy_run_in_float32():
    def loss(w, x, labels):
        logits = x @ w
        return (
            optax.softmax_cross_entropy_with_integer_labels(
                logits, labels
            ).mean()
            + jax.nn.log_softmax(logits).mean()
        )

    w = jax.random.normal(jax.random.key(1), (8, 10))
    x = jax.random.normal(jax.random.key(2), (16, 8))
    labels = jnp.arange(16) % 10
    auto = lossscale.autocast(loss)
    jaxpr = jax.make_jaxpr(auto)(w, x, labels)
    for primitive in ("exp", "log", "sub"):
        seen = operand_dtypes(jaxpr, primitive)
        assert seen and all(set(d) == {F32} for d in seen), primitive
    # Two terms of about 2.3 of opposite signs: compared in absolute terms.
    assert float(auto(w, x, labels)) == pytest.approx(
        float(loss(w, x, labels)), abs=1e-3
    )


def test_activations_between_matmuls_stay_in_the_compute_dtype():
    def f(x, w, scale, bias):
        h = x @ w
        mean = jnp.mean(h, -1, keepdims=True)
        var = jnp.mean((h - mean) ** 2, -1, keepdims=True)
        normed = (h - mean) * lax.rsqrt(var + 1e-5) * scale + bias
        return jnp.sum(jax.nn.gelu(normed) @ w.T)

    args = jnp.ones((4, 3)), jnp.ones((3, 3)), jnp.ones(3), jnp.zeros(3)
    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(*args)
    assert operand_dtypes(jaxpr, "dot_general") == [(F16, F16)] * 2
    # The norm's output meets float32 statistics and parameters: it is
    # float32 (PyTorch's promotion), and so GELU's tanh is computed from
    # it in float32; the second matmul reads GELU's result in float16.
    assert set(operand_dtypes(jaxpr, "tanh")) == {(F32,)}
    # The norm statistics are float32.
    assert {d for d in operand_dtypes(jaxpr, "rsqrt")} == {(F32,)}


def test_weak_constants_do_not_pull_back_to_float32():
    def f(x, w):
        return ((x @ w) * 2.0 + 1.0) @ w

    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(
        jnp.ones((2, 2)), jnp.ones((2, 2))
    )
    assert operand_dtypes(jaxpr, "mul") == [(F16, F16)]
    assert operand_dtypes(jaxpr, "add") == [(F16, F16)]


def test_integers_booleans_keys_and_explicit_casts_are_kept():
    def f(x, w, ids, mask, key):
        h = x @ w
        noise = jax.random.normal(key, h.shape)
        h8 = (h + noise).astype(jnp.float8_e4m3fn)  # an explicit cast
        picked = jnp.take(h, ids, axis=0)
        return picked.sum() + jnp.where(mask, 1.0, 0.0).sum() + h8.astype(
            jnp.float32
        ).sum(), ids + 1

    args = (
        jnp.ones((3, 2)),
        jnp.ones((2, 2)),
        jnp.array([0, 2]),
        jnp.array([True, False]),
        jax.random.key(0),
    )
    auto = lossscale.autocast(f)
    (total, ids) = auto(*args)
    assert ids.dtype == args[2].dtype and total.dtype == F32
    jaxpr = jax.make_jaxpr(auto)(*args)
    casts = [
        np.dtype(e.params["new_dtype"])
        for e in equations(jaxpr)
        if e.primitive.name == "convert_element_type"
    ]
    assert np.dtype(jnp.float8_e4m3fn) in casts
    assert "random_bits" in {e.primitive.name for e in equations(jaxpr)} or (
        "threefry2x32" in {e.primitive.name for e in equations(jaxpr)}
    )


def test_outputs_keep_their_dtypes_unless_asked():
    def f(x, w):
        return x @ w, jnp.sum(x), jnp.int32(3)

    x, w = jnp.ones((2, 2)), jnp.ones((2, 2))
    a, b, c = lossscale.autocast(f)(x, w)
    assert (a.dtype, b.dtype, c.dtype) == (F32, F32, np.dtype(np.int32))
    a, b, c = lossscale.autocast(f, output_dtype="bfloat16")(x, w)
    assert (a.dtype, b.dtype, c.dtype) == (BF16, BF16, np.dtype(np.int32))


def test_signature_pytrees_keywords_and_static_leaves():
    def f(tree, *, scale, name):
        assert name == "static"  # a non-array leaf passed through as it is
        return {"y": tree["a"] @ tree["b"][0] * scale}

    tree = {"a": jnp.ones((2, 2)), "b": [jnp.ones((2, 2)), None]}
    out = lossscale.autocast(f)(tree, scale=3.0, name="static")
    np.testing.assert_array_equal(out["y"], jnp.full((2, 2), 6.0))


# --- composition -------------------------------------------------------


def test_jit_vmap_and_nested_jit(mlp):
    params, x = mlp

    @jax.jit
    def inner(h, w):
        return jax.nn.relu(h @ w)

    def loss(params, x):
        return jnp.mean(inner(x, params["w1"]) @ params["w2"])

    auto = lossscale.autocast(loss)
    per_example = jax.vmap(auto, in_axes=(None, 0))(params, x[:, None, :])
    np.testing.assert_allclose(
        per_example,
        jax.vmap(loss, in_axes=(None, 0))(params, x[:, None, :]),
        rtol=1e-2,
        atol=1e-3,
    )
    assert set(dots(jax.jit(jax.grad(auto)), params, x)) == {(F16, F16)}


def test_scan_carry_keeps_one_dtype_and_matmuls_are_float16():
    def f(ws, x):
        def layer(h, w):
            return h + jnp.tanh(h @ w), jnp.sum(h)

        h, sums = lax.scan(layer, x, ws)
        return jnp.sum(h) + jnp.sum(sums)

    ws = jax.random.normal(jax.random.key(0), (3, 4, 4)) / 2
    x = jax.random.normal(jax.random.key(1), (2, 4))
    auto = lossscale.autocast(f)
    jaxpr = jax.make_jaxpr(jax.grad(auto))(ws, x)
    assert set(operand_dtypes(jaxpr, "dot_general")) == {(F16, F16)}
    scan = next(e for e in equations(jaxpr) if e.primitive.name == "scan")
    body = scan.params["jaxpr"]
    n, carry = _compat.scan_counts(scan.params)
    # The residual stream is a float16 carry, in and out.
    assert [v.aval.dtype for v in body.jaxpr.invars[n : n + carry]] == [
        v.aval.dtype for v in body.jaxpr.outvars[:carry]
    ]
    np.testing.assert_allclose(auto(ws, x), f(ws, x), rtol=1e-2)


def test_while_loop_and_cond_outputs_agree():
    def f(x, w):
        h = x @ w

        def body(c):
            i, acc = c
            return i + 1, acc + jnp.exp(h) * 0.1

        _, acc = lax.while_loop(lambda c: c[0] < 3, body, (0, h))
        branch = lax.cond(
            jnp.sum(x) > 0, lambda a: a * 2.0, lambda a: jnp.exp(a), h
        )
        return acc, branch

    x, w = jnp.ones((2, 2)) / 4, jnp.ones((2, 2))
    acc, branch = lossscale.autocast(f)(x, w)
    ref_acc, ref_branch = f(x, w)
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-2)
    np.testing.assert_allclose(branch, ref_branch, rtol=1e-2)
    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(x, w)
    cond = next(e for e in equations(jaxpr) if e.primitive.name == "cond")
    out_types = {
        tuple(v.aval.dtype for v in b.jaxpr.outvars)
        for b in cond.params["branches"]
    }
    assert len(out_types) == 1  # every branch returns the same dtypes


def test_checkpoint_keeps_its_policy():
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def f(x, w):
        return jnp.sum(
            jax.checkpoint(lambda h: jnp.sin(h @ w), policy=policy)(x)
        )

    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(
        jnp.ones((2, 2)), jnp.ones((2, 2))
    )
    remat = [
        e for e in equations(jaxpr) if e.primitive.name.startswith("remat")
    ]
    assert remat and remat[0].params["policy"] is policy
    assert operand_dtypes(jaxpr, "dot_general") == [(F16, F16)]


def test_custom_jvp_rules_are_kept_not_replaced_by_the_primal():
    @jax.custom_jvp
    def clip_grad(x):
        return x

    # A rule that differs from differentiating the primal (the identity).
    clip_grad.defjvp(lambda p, t: (p[0], t[0] * 0.5))

    def f(x, w):
        return jnp.sum(clip_grad(x @ w))

    x, w = jnp.ones((2, 2)), jnp.ones((2, 2))
    g = jax.grad(lossscale.autocast(f), argnums=1)(x, w)
    np.testing.assert_array_equal(g, jax.grad(f, argnums=1)(x, w))
    np.testing.assert_array_equal(g, jnp.full((2, 2), 1.0))
    # relu is a custom_jvp too; its derivative at 0 is the rule's (0).
    g = jax.grad(lossscale.autocast(lambda x: jnp.sum(jax.nn.relu(x))))(
        jnp.zeros(3)
    )
    np.testing.assert_array_equal(g, jnp.zeros(3))


def test_custom_vjp_rules_are_kept():
    @jax.custom_vjp
    def double_grad(x):
        return x

    double_grad.defvjp(lambda x: (x, None), lambda _, ct: (2.0 * ct,))

    def f(x, w):
        return jnp.sum(double_grad(x @ w))

    x, w = jnp.ones((2, 2)), jnp.ones((2, 2))
    g = jax.grad(lossscale.autocast(f), argnums=1)(x, w)
    np.testing.assert_array_equal(g, jnp.full((2, 2), 4.0))
    # lossscale's own custom_vjp, the gradient boundary of per-group scales.
    h = jax.grad(
        lossscale.autocast(
            lambda x: jnp.sum(lossscale.rescale_gradient(x, 8.0))
        )
    )(jnp.ones(2))
    np.testing.assert_array_equal(h, jnp.full(2, 8.0))


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_sharded_jit(mlp, axis_type):
    from helpers import data_model_mesh, set_mesh

    params, x = mlp
    mesh = data_model_mesh(axis_type)
    with set_mesh(mesh):
        spec = jax.sharding.PartitionSpec("data")
        xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
        try:
            jax.jit(jax.grad(mlp_loss))(params, xs)
        except Exception as err:  # pragma: no cover - JAX's, not ours
            # jax 0.7 and 0.8 refuse the float32 gradient of this step
            # itself ("Contracting dimensions are sharded" under explicit
            # axes): there is nothing for autocast to match.
            pytest.skip(f"this JAX cannot differentiate the step: {err}")
        loss = jax.jit(lossscale.autocast(mlp_loss))(params, xs)
        grads = jax.jit(jax.grad(lossscale.autocast(mlp_loss)))(params, xs)
    assert float(loss) == pytest.approx(float(mlp_loss(params, x)), rel=1e-2)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_shard_map_body_is_autocast_and_collectives_keep_their_dtype(
    axis_type,
):
    from helpers import data_model_mesh, set_mesh

    P = jax.sharding.PartitionSpec
    mesh = data_model_mesh(axis_type)

    def f(x, w):
        return lax.psum(jnp.sum(jnp.tanh(x @ w)), "data")

    mapped = jax.shard_map(
        f, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()
    )
    x = jnp.linspace(0.0, 1.0, 32).reshape(8, 4)
    w = jnp.full((4, 4), 0.5)
    with set_mesh(mesh):
        x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))
        w = jax.device_put(w, jax.sharding.NamedSharding(mesh, P()))
        auto = lossscale.autocast(mapped)
        value = jax.jit(auto)(x, w)
        grad = jax.jit(jax.grad(auto, argnums=1))(x, w)
        jaxpr = jax.make_jaxpr(jax.grad(auto, argnums=1))(x, w)
        expected = jax.jit(mapped)(x, w)
    assert float(value) == pytest.approx(float(expected), rel=1e-2)
    assert grad.dtype == F32
    seen = operand_dtypes(jaxpr, "dot_general")
    assert seen and set(seen) == {(F16, F16)}
    # The collective (psum, or psum_invariant on some JAX versions) runs at
    # its traced dtype: it has no rule.
    psums = [
        d
        for e in equations(jaxpr)
        if e.primitive.name.startswith("psum")
        for d in [tuple(np.dtype(v.aval.dtype) for v in e.invars)]
    ]
    assert psums and set(psums) == {(F32,)}


def test_strict_dtype_promotion_is_the_default_here_and_works(mlp):
    params, x = mlp
    with jax.numpy_dtype_promotion("strict"):
        grads = jax.grad(lossscale.autocast(mlp_loss))(params, x)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


def test_no_retrace_of_an_outer_jit(mlp):
    params, x = mlp
    traces = collections.Counter()

    def loss(p, x):
        traces["n"] += 1
        return mlp_loss(p, x)

    step = jax.jit(jax.grad(lossscale.autocast(loss)))
    step(params, x)
    step(params, x)
    assert traces["n"] == 1


# --- frameworks --------------------------------------------------------


def _assert_dots_f16_and_close(loss, reference, *args):
    jaxpr = jax.make_jaxpr(jax.grad(loss))(*args)
    seen = operand_dtypes(jaxpr, "dot_general")
    assert seen and set(seen) == {(F16, F16)}
    assert float(loss(*args)) == pytest.approx(
        float(reference(*args)), rel=2e-2
    )


def test_flax_nnx_model_written_without_dtypes():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(16, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=2, in_features=16, decode=False, rngs=rngs
            )
            self.up = nnx.Linear(16, 32, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm(x))
            return x + self.down(nnx.gelu(self.up(self.norm(x))))

    model = Block(nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))

    def loss(params, x):
        return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

    _assert_dots_f16_and_close(lossscale.autocast(loss), loss, params, x)

    # Called inside: the model is closed over, under nnx.value_and_grad.
    def inside(model, x):
        return lossscale.autocast(lambda x: jnp.mean(model(x) ** 2))(x)

    value, grads = nnx.value_and_grad(inside)(model, x)
    assert value.dtype == F32 and float(value) == pytest.approx(
        float(loss(params, x)), rel=2e-2
    )
    assert {g.dtype for g in jax.tree.leaves(grads)} == {F32}


@pytest.mark.standard_promotion
def test_flax_nnx_state_updated_inside_is_written_back():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.lin(x)))

    x = jax.random.normal(jax.random.key(1), (8, 4))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    plain, auto = Model(nnx.Rngs(0)), Model(nnx.Rngs(0))
    step = nnx.jit(lambda m, x: nnx.value_and_grad(loss)(m, x))
    auto_step = nnx.jit(
        lambda m, x: nnx.value_and_grad(lossscale.autocast(loss))(m, x)
    )
    for _ in range(2):
        v_plain, _ = step(plain, x)
        v_auto, _ = auto_step(auto, x)
    # BatchNorm's running mean moved, as without autocast, in float32.
    assert auto.bn.mean[...].dtype == F32
    assert float(jnp.abs(auto.bn.mean[...]).max()) > 0
    np.testing.assert_allclose(
        auto.bn.mean[...], plain.bn.mean[...], rtol=2e-2, atol=1e-4
    )
    # The dropout stream advanced as it does without autocast: the same
    # masks were drawn, so the losses agree.
    assert float(v_auto) == pytest.approx(float(v_plain), rel=2e-2)


def test_flax_nnx_scan_and_remat_over_stacked_layers():
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.lin(x))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Layer(rngs)

    layers = make(nnx.Rngs(0))
    x = jnp.ones((2, 8))

    def loss(layers, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def through(h, layer):
            return layer(h)

        return jnp.mean(through(x, layers) ** 2)

    graphdef, state = nnx.split(layers)

    def on_state(state, x):
        return loss(nnx.merge(graphdef, state), x)

    auto = lossscale.autocast(on_state)
    jaxpr = jax.make_jaxpr(jax.grad(auto))(state, x)
    seen = operand_dtypes(jaxpr, "dot_general")
    assert seen and set(seen) == {(F16, F16)}
    assert any(e.primitive.name.startswith("remat") for e in equations(jaxpr))
    assert float(auto(state, x)) == pytest.approx(
        float(on_state(state, x)), rel=2e-2
    )


def test_flax_layers_that_promote_to_float32_still_compute_in_float16():
    from flax import nnx

    layer = nnx.Linear(4, 4, dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x))

    assert dots(lossscale.autocast(loss), params, jnp.ones((2, 4))) == [
        (F16, F16)
    ]


def test_flax_linen_apply():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.LayerNorm()(nn.Dense(16)(x))
            q = nn.Dense(16)(x)
            attn = nn.dot_product_attention(
                q[..., None, :], q[..., None, :], q[..., None, :]
            )
            return nn.Dense(1)(nn.gelu(attn[..., 0, :] + x))

    model = MLP()
    x = jax.random.normal(jax.random.key(0), (4, 3, 8))
    params = model.init(jax.random.key(1), x)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    _assert_dots_f16_and_close(lossscale.autocast(loss), loss, params, x)


def test_equinox_filter_value_and_grad():
    eqx = pytest.importorskip("equinox")

    key = jax.random.key(0)
    k1, k2, k3 = jax.random.split(key, 3)

    class Model(eqx.Module):
        norm: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        mlp: eqx.nn.MLP

        def __init__(self):
            self.norm = eqx.nn.LayerNorm(8)
            self.attn = eqx.nn.MultiheadAttention(2, 8, key=k1)
            self.mlp = eqx.nn.MLP(8, 8, 16, 1, key=k2)

        def __call__(self, x):
            h = jax.vmap(self.norm)(x)
            h = h + self.attn(h, h, h)
            return jax.vmap(self.mlp)(h)

    model = Model()
    x = jax.random.normal(k3, (5, 8))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    value, grads = eqx.filter_value_and_grad(lossscale.autocast(loss))(model, x)
    assert float(value) == pytest.approx(float(loss(model, x)), rel=2e-2)
    leaves = jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array))
    assert leaves and {g.dtype for g in leaves} == {F32}
    params, static = eqx.partition(model, eqx.is_inexact_array)
    seen = dots(
        jax.grad(lambda p: lossscale.autocast(loss)(eqx.combine(p, static), x)),
        params,
    )
    assert seen and set(seen) == {(F16, F16)}


# --- overrides ---------------------------------------------------------


def test_float32_scope_keeps_a_region_in_float32():
    @lossscale.float32_scope()
    def router(x, w):
        return jax.nn.softmax(x @ w)

    def f(x, w):
        return jnp.sum(router(x, w) @ w) + jnp.sum(x @ w)

    seen = dots(lossscale.autocast(f), jnp.ones((2, 2)), jnp.ones((2, 2)))
    assert sorted(seen) == sorted([(F32, F32), (F16, F16), (F16, F16)])


def test_rules_move_a_primitive_between_lists():
    def f(x, w):
        return jnp.sum(jnp.tanh(x @ w) @ w)

    args = jnp.ones((2, 2)), jnp.ones((2, 2))
    default = jax.make_jaxpr(lossscale.autocast(f))(*args)
    assert operand_dtypes(default, "tanh") == [(F16,)]
    moved = jax.make_jaxpr(lossscale.autocast(f, rules={"tanh": "float32"}))(
        *args
    )
    assert operand_dtypes(moved, "tanh") == [(F32,)]
    matmul32 = lossscale.autocast(f, rules={"dot_general": "original"})
    assert dots(matmul32, *args) == [(F32, F32)] * 2
    assert lossscale.AUTOCAST_RULES["dot_general"] == "compute"


def test_a_checkpoint_name_is_a_label_not_a_function_rule():
    from jax.ad_checkpoint import checkpoint_name

    def f(x, w):
        # Labelled "exp": the label must not pick up exp's float32 rule.
        return jnp.sum(checkpoint_name(x @ w, "exp") @ w)

    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(
        jnp.ones((2, 2)), jnp.ones((2, 2))
    )
    assert operand_dtypes(jaxpr, "name") == [(F16,)]


def test_an_unknown_primitive_runs_at_its_traced_dtypes():
    def f(x, w):
        return jnp.sum(jnp.sort(x @ w, axis=-1))  # sort has no rule

    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(
        jnp.ones((2, 2)), jnp.ones((2, 2))
    )
    assert "sort" not in lossscale.AUTOCAST_RULES
    assert operand_dtypes(jaxpr, "sort") == [(F32,)]


# --- bad input ---------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [jnp.float32, "float64", jnp.int16, "nope", None]
)
def test_a_compute_dtype_that_is_not_16_bit_float_is_refused(dtype):
    with pytest.raises(TypeError, match="compute_dtype"):
        lossscale.autocast(mlp_loss, dtype)


def test_a_policy_or_its_string_sets_compute_and_output_dtypes():
    def f(x, w):
        return x @ w, jnp.sum(x)

    x, w = jnp.ones((2, 2)), jnp.ones((2, 2))
    for policy in (
        "p=f32,c=bf16,o=f16",
        lossscale.get_policy("params=float32, compute=bfloat16, output=f16"),
    ):
        auto = lossscale.autocast(f, policy)
        assert dots(auto, x, w) == [(BF16, BF16)]
        assert {o.dtype for o in auto(x, w)} == {F16}
    # Keras's name: float16 compute, outputs in float16 as Keras layers'.
    assert dots(lossscale.autocast(f, "mixed_float16"), x, w) == [(F16, F16)]
    with pytest.raises(TypeError, match="compute_dtype"):
        lossscale.autocast(f, "p=f32,c=f32")
    with pytest.raises(TypeError, match="output_dtype"):
        lossscale.autocast(f, "c=f16", output_dtype=jnp.float32)
    with pytest.raises(ValueError, match="cmpute"):
        lossscale.autocast(f, "cmpute=f16")


def test_names_of_16_bit_floats_are_accepted():
    for name in ("float16", "bfloat16"):
        lossscale.autocast(mlp_loss, name)


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="fun must be callable"):
        lossscale.autocast(3)
    with pytest.raises(ValueError, match=r"rules\['tanh'\]"):
        lossscale.autocast(mlp_loss, rules={"tanh": "fast"})
    with pytest.raises(TypeError, match="rules"):
        lossscale.autocast(mlp_loss, rules=["tanh"])
    with pytest.raises(TypeError, match="output_dtype"):
        lossscale.autocast(mlp_loss, output_dtype=jnp.int32)


@pytest.mark.parametrize(
    "policy",
    [
        lossscale.Policy(jnp.float16, jnp.float16, jnp.float32),
        "p=f16,c=f16,o=f32",
        "p=bf16,c=bf16",
    ],
)
def test_a_policy_storing_parameters_in_16_bits_is_refused(policy):
    # Issue 29: param_dtype was ignored silently (the parameters stayed
    # float32 as they came in, whatever the policy said).
    with pytest.raises(ValueError, match="param_dtype"):
        lossscale.autocast(mlp_loss, policy)
    # The negative control: float32 parameters are what autocast keeps.
    lossscale.autocast(mlp_loss, "p=f32,c=f16,o=f32")


def test_plans_live_exactly_as_long_as_their_jaxpr(mlp):
    # A function retraced every call kept every plan (and the jaxpr it was
    # made for) alive: plans are kept by a weak reference to their jaxpr,
    # as JAX's own weakref_lru_cache keeps traces, and die with it.
    import gc
    import weakref

    from lossscale._autocast import _infer
    from lossscale._autocast._classes import Cls
    from lossscale._autocast._config import Config

    params, x = mlp
    # A function of its own: JAX keeps a function's jaxprs while it lives.
    fun = lambda params, x: mlp_loss(params, x)
    jaxpr = jax.make_jaxpr(fun)(params, x).jaxpr
    config = Config(np.dtype(jnp.float16))
    classes = [Cls.F32] * len(jaxpr.invars)
    plan = _infer.infer(config, jaxpr, [], classes, [True], [True])
    # The same jaxpr and classes: the same plan, not a new one.
    again = _infer.infer(config, jaxpr, [], classes, [True], [True])
    assert again is plan
    alive = weakref.ref(jaxpr)
    before = len(_infer._PLANS)
    del jaxpr, plan, again, fun
    gc.collect()
    assert alive() is None  # nothing of autocast's kept it alive
    assert len(_infer._PLANS) < before  # and its plan died with it


def test_eager_calls_are_compiled_per_static_argument(mlp):
    # An eager call with a Python number (a temperature, a flag) among its
    # arguments traced on every call (9-20 ms against 1.2 ms jitted): the
    # non-array leaves are static now, as in equinox's filter_jit.
    params, x = mlp
    traces = []

    def loss(params, x, temperature, train):
        traces.append((temperature, train))
        return mlp_loss(params, x / temperature) * (2.0 if train else 1.0)

    f = lossscale.autocast(loss)
    first = f(params, x, 2.0, True)
    np.testing.assert_array_equal(f(params, x, 2.0, True), first)
    assert traces == [(2.0, True)]  # compiled once, then cached
    other = f(params, x, 4.0, True)
    assert len(traces) == 2 and not np.array_equal(other, first)
    # True == 1, but a flag and a number are different static arguments.
    f(params, x, 2.0, 1)
    assert len(traces) == 3 and type(traces[-1][1]) is int
    # The same values as the traced call (under an outer jit).
    np.testing.assert_array_equal(
        jax.jit(f, static_argnums=(2, 3))(params, x, 2.0, True), first
    )


def test_eager_call_with_an_unhashable_argument_traces_each_time(mlp):
    # The negative control of the cache: a leaf that cannot be a key
    # (a set) is never compiled and cached; the call still works.
    params, x = mlp
    traces = []

    def loss(params, x, names):
        traces.append(names)
        return mlp_loss(params, x)

    f = lossscale.autocast(loss)
    a, b = f(params, x, {"w"}), f(params, x, {"w"})
    np.testing.assert_array_equal(a, b)
    assert len(traces) == 2


def test_eager_calls_keep_the_most_recently_used_static_values(
    monkeypatch, mlp
):
    # Past the bound the least recently used compilation is dropped: a
    # value called again stays compiled, one left unused is traced again.
    from lossscale._autocast import _eager

    monkeypatch.setattr(_eager, "COMPILED_LIMIT", 2)
    params, x = mlp
    traces = []

    def loss(params, x, temperature):
        traces.append(temperature)
        return mlp_loss(params, x / temperature)

    f = lossscale.autocast(loss)
    for t in (1.0, 2.0, 1.0, 3.0):  # 3.0 drops 2.0, used less recently
        f(params, x, t)
    assert traces == [1.0, 2.0, 3.0]
    f(params, x, 1.0)
    assert traces == [1.0, 2.0, 3.0]  # still compiled
    f(params, x, 2.0)
    assert traces == [1.0, 2.0, 3.0, 2.0]  # traced again
