"""lossscale.value_and_grad: the true loss and the scaled gradients in one call.

With ``optax.sgd(1.0)`` and a power-of-two ``StaticLossScale`` every number
is exact: the gradients are exactly ``scale`` times the plain ones, and the
update is exactly minus the plain gradient.
"""

import functools
import pathlib
import subprocess
import sys

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
from lossscale import _records
from tests import helpers
from tests.helpers import assert_trees_bitwise_equal

SCALE = 8.0
N = 8  # devices (conftest.py)


def loss_fn(params, x):
    return jnp.sum((params["w"] * x) ** 2) + params["b"]


def loss_aux_fn(params, x):
    pred = params["w"] * x
    return jnp.sum(pred**2) + params["b"], {"pred": pred, "n": jnp.int32(3)}


PARAMS = {"w": jnp.array([1.0, 2.0, -3.0]), "b": jnp.array(0.5, jnp.float32)}
X = jnp.array([0.5, 1.5, 2.0])


def scaled_tx():
    return lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.StaticLossScale(SCALE)
    )


def assert_trees_close(a, b, atol=1e-6):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(
            np.asarray(x), np.asarray(y), atol=atol, rtol=1e-6
        )


def times(tree, factor):
    return jax.tree.map(lambda g: g * jnp.asarray(factor, g.dtype), tree)


# --- plain jax --------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_plain_exact_values(jit):
    tx = scaled_tx()
    state = tx.init(PARAMS)

    def step(params, state, x):
        loss, grads = lossscale.value_and_grad(loss_fn, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    def plain(params, x):
        return jax.value_and_grad(loss_fn)(params, x)

    if jit:
        step, plain = jax.jit(step), jax.jit(plain)
    new_params, state, loss, grads = step(PARAMS, state, X)
    plain_loss, plain_grads = plain(PARAMS, X)
    assert_trees_bitwise_equal(loss, plain_loss)  # the true loss, bitwise
    assert_trees_bitwise_equal(grads, times(plain_grads, SCALE))
    # grad of sum((w x)^2) + b is 2 w x^2 and 1.
    np.testing.assert_array_equal(
        np.asarray(grads["w"]), SCALE * np.array([0.5, 9.0, -24.0], np.float32)
    )
    assert float(grads["b"]) == SCALE
    expected = jax.tree.map(lambda p, g: p - g, PARAMS, plain_grads)
    assert_trees_bitwise_equal(new_params, expected)
    assert bool(state.grads_finite)


def test_one_forward_pass():
    calls = []

    def counted(params, x):
        calls.append(None)
        return loss_fn(params, x)

    tx = scaled_tx()
    lossscale.value_and_grad(counted, tx.init(PARAMS))(PARAMS, X)
    assert len(calls) == 1
    jaxpr = jax.make_jaxpr(
        lambda p: lossscale.value_and_grad(loss_fn, tx.init(PARAMS))(p, X)
    )(PARAMS)
    plain = jax.make_jaxpr(lambda p: jax.value_and_grad(loss_fn)(p, X))(PARAMS)
    # One multiply by the scale (and its cotangent) more than the plain one.
    n_eqns = len(jaxpr.jaxpr.eqns)
    assert n_eqns <= len(plain.jaxpr.eqns) + 4


@pytest.mark.parametrize("jit", [False, True])
def test_has_aux_only_the_loss_is_scaled(jit):
    tx = scaled_tx()
    state = tx.init(PARAMS)

    def both(params, x):
        ours = lossscale.value_and_grad(loss_aux_fn, state, has_aux=True)(
            params, x
        )
        theirs = jax.value_and_grad(loss_aux_fn, has_aux=True)(params, x)
        return ours, theirs

    if jit:
        both = jax.jit(both)
    ((loss, aux), grads), ((plain_loss, plain_aux), plain_grads) = both(
        PARAMS, X
    )
    assert_trees_bitwise_equal(loss, plain_loss)
    assert_trees_bitwise_equal(aux, plain_aux)  # not scaled
    assert aux["n"].dtype == jnp.int32
    assert_trees_bitwise_equal(grads, times(plain_grads, SCALE))


def test_argnums():
    def f(a, b, c):
        return jnp.sum(a * b * c)

    a, b, c = jnp.array(2.0), jnp.array(3.0), jnp.array(5.0)
    scale = lossscale.StaticLossScale(SCALE)
    loss, g = lossscale.value_and_grad(f, scale, argnums=1)(a, b, c)
    assert float(loss) == 30.0 and float(g) == SCALE * 10.0
    loss, (ga, gc) = lossscale.value_and_grad(f, scale, argnums=(0, 2))(a, b, c)
    assert float(ga) == SCALE * 15.0 and float(gc) == SCALE * 6.0
    # The default is via's default: the first argument.
    _, g = lossscale.value_and_grad(f, scale)(a, b, c)
    assert float(g) == SCALE * 15.0
    (loss, aux), g = lossscale.value_and_grad(
        lambda a, b: (f(a, b, c), b), scale, argnums=1, has_aux=True
    )(a, b)
    assert float(g) == SCALE * 10.0 and float(aux) == 3.0


def test_float16_loss_keeps_its_dtype():
    def f(w):
        return jnp.sum(w.astype(jnp.float16) ** 2)

    w = jnp.array([1.0, 2.0, 3.0])
    loss, grads = lossscale.value_and_grad(
        f, lossscale.StaticLossScale(1024.0)
    )(w)
    plain_loss, plain_grads = jax.value_and_grad(f)(w)
    assert loss.dtype == jnp.float16
    assert_trees_bitwise_equal(loss, plain_loss)
    assert grads.dtype == jnp.float32
    assert_trees_bitwise_equal(grads, times(plain_grads, 1024.0))


def test_overflowing_scaled_loss_still_returns_the_true_loss():
    # A float32 loss of 2e32 scaled by 2**24 is inf; dividing it back would
    # give inf. The true loss comes from the forward pass.
    def f(w):
        return jnp.sum(w) * jnp.float32(1e32)

    w = jnp.ones(2)
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.DynamicLossScale(2.0**24)
    )
    state = tx.init(w)
    loss, grads = lossscale.value_and_grad(f, state)(w)
    assert float(loss) == float(np.float32(2e32))
    assert not np.isfinite(np.asarray(grads)).all()
    updates, state = tx.update(grads, state, w)
    assert not bool(state.grads_finite)  # the step is skipped
    np.testing.assert_array_equal(np.asarray(updates), np.zeros(2))


def test_dynamic_scale_step_loop_under_jit():
    tx = lossscale.loss_scaled(
        optax.sgd(0.125), lossscale.DynamicLossScale(2.0**10, growth_interval=2)
    )
    ref_tx = optax.sgd(0.125)

    traces = []

    @jax.jit
    def step(params, state, x):
        traces.append(None)
        loss, grads = lossscale.value_and_grad(loss_fn, state)(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    @jax.jit
    def ref_step(params, state, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        updates, state = ref_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    p, s = PARAMS, tx.init(PARAMS)
    rp, rs = PARAMS, ref_tx.init(PARAMS)
    for _ in range(5):
        p, s, loss = step(p, s, X)
        rp, rs, ref_loss = ref_step(rp, rs, X)
        assert_trees_bitwise_equal(loss, ref_loss)
        assert_trees_bitwise_equal(p, rp)
    assert float(lossscale.get_loss_scale(s).loss_scale) == 2.0**12
    assert len(traces) == 1  # the scale is read from the state: no retrace


# --- where the scale comes from -----------------------------------------


def test_scale_from_nested_states():
    inner = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.StaticLossScale(SCALE)
    )
    for tx in (
        optax.chain(optax.clip_by_global_norm(1.0), inner),
        optax.MultiSteps(inner, every_k_schedule=2),
        inner,
    ):
        state = tx.init(PARAMS)
        _, grads = lossscale.value_and_grad(loss_fn, state)(PARAMS, X)
        assert float(grads["b"]) == SCALE


def test_scale_given_directly():
    _, g = lossscale.value_and_grad(loss_fn, lossscale.StaticLossScale(4.0))(
        PARAMS, X
    )
    assert float(g["b"]) == 4.0
    _, g = lossscale.value_and_grad(loss_fn, lossscale.NoOpLossScale())(
        PARAMS, X
    )
    assert float(g["b"]) == 1.0


def test_grouped_scales_need_one_group():
    tx = lossscale.loss_scaled_by_group(
        optax.sgd(1.0),
        {
            "w": lossscale.StaticLossScale(2.0),
            "b": lossscale.StaticLossScale(4.0),
        },
        param_labels={"w": "w", "b": "b"},
    )
    state = tx.init(PARAMS)
    with pytest.raises(TypeError, match=r"one loss scale per group.*\[label\]"):
        lossscale.value_and_grad(loss_fn, state)
    scale = lossscale.get_loss_scale(state)["b"]
    _, g = lossscale.value_and_grad(loss_fn, scale)(PARAMS, X)
    assert float(g["b"]) == 4.0


def test_bad_arguments():
    state = scaled_tx().init(PARAMS)
    with pytest.raises(TypeError, match="fun must be callable"):
        lossscale.value_and_grad(3, state)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="via must be"):
        lossscale.value_and_grad(loss_fn, state, via=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        lossscale.value_and_grad(loss_fn, state, has_aux=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="axis_name"):
        lossscale.value_and_grad(loss_fn, state, axis_name=["d"])
    with pytest.raises(TypeError, match="optimizer state holding one"):
        lossscale.value_and_grad(loss_fn, optax.sgd(1.0).init(PARAMS))
    with pytest.raises(TypeError, match="got the class DynamicLossScale"):
        lossscale.value_and_grad(loss_fn, lossscale.DynamicLossScale)
    with pytest.raises(TypeError, match="optimizer state holding one"):
        lossscale.value_and_grad(loss_fn, 128.0)
    two = (state, scaled_tx().init(PARAMS))
    with pytest.raises(ValueError, match="found 2 LossScaledStates"):
        lossscale.value_and_grad(loss_fn, two)
    with pytest.raises(TypeError, match=r"pair \(loss, aux\)"):
        lossscale.value_and_grad(loss_fn, state, has_aux=True)(PARAMS, X)


# --- flax NNX ---------------------------------------------------------------


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


def nnx_loss(model, x):
    return jnp.mean(model(x) ** 2)


def nnx_loss_aux(model, x):
    y = model(x)
    return jnp.mean(y**2), y


@pytest.mark.standard_promotion  # nnx.BatchNorm mixes weak types
@pytest.mark.parametrize("has_aux", [False, True])
def test_nnx(has_aux):
    x = jax.random.normal(jax.random.key(1), (4, 3))
    fn = nnx_loss_aux if has_aux else nnx_loss
    model = NNXModel(nnx.Rngs(0))
    ref = nnx.clone(model)
    opt = nnx.Optimizer(model, scaled_tx(), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.sgd(1.0), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt, x):
        out, grads = lossscale.value_and_grad(
            fn, opt.opt_state, has_aux=has_aux, via=nnx.value_and_grad
        )(model, x)
        opt.update(model, grads)
        return out, grads

    @nnx.jit
    def ref_step(model, opt, x):
        out, grads = nnx.value_and_grad(fn, has_aux=has_aux)(model, x)
        opt.update(model, grads)
        return out, grads

    out, grads = step(model, opt, x)
    ref_out, ref_grads = ref_step(ref, ref_opt, x)
    assert_trees_bitwise_equal(out, ref_out)  # the true loss (and aux)
    # The gradients differ from 8 x the plain ones only by the rounding of
    # the cancellations in BatchNorm's backward pass, fused differently.
    assert_trees_close(nnx.state(grads), times(nnx.state(ref_grads), SCALE))
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    # The batch statistics the forward pass updated are not scaled.
    assert_trees_bitwise_equal(
        nnx.state(model, nnx.BatchStat), nnx.state(ref, nnx.BatchStat)
    )
    assert bool(lossscale.metrics(opt.opt_state)["grads_finite"])
    # The nnx.Optimizer itself holds the state, and serves as loss_scale.
    _, grads = lossscale.value_and_grad(nnx_loss, opt, via=nnx.value_and_grad)(
        model, x
    )
    _, ref_grads = nnx.value_and_grad(nnx_loss)(model, x)
    assert_trees_close(nnx.state(grads), times(nnx.state(ref_grads), SCALE))


# --- linen ------------------------------------------------------------------


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        x = nn.Dense(2)(x)
        return nn.BatchNorm(use_running_average=not train, momentum=0.5)(x)


@pytest.mark.standard_promotion  # linen's BatchNorm mixes weak types
@pytest.mark.parametrize("has_aux", [False, True])
def test_linen(has_aux):
    model = LinenModel()
    x = jax.random.normal(jax.random.key(1), (4, 3)) * 3.0 + 1.0
    variables = model.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]

    def loss(params, stats, x):
        y, updates = model.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        value = jnp.mean(y**2)
        return (value, updates["batch_stats"]) if has_aux else value

    tx = scaled_tx()
    state = tx.init(params)

    @jax.jit
    def step(params, stats, state, x):
        out, grads = lossscale.value_and_grad(loss, state, has_aux=has_aux)(
            params, stats, x
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, out, grads

    @jax.jit
    def ref(params, stats, x):
        return jax.value_and_grad(loss, has_aux=has_aux)(params, stats, x)

    new_params, state, out, grads = step(params, stats, state, x)
    ref_out, ref_grads = ref(params, stats, x)
    assert_trees_bitwise_equal(out, ref_out)
    assert_trees_bitwise_equal(grads, times(ref_grads, SCALE))
    assert_trees_bitwise_equal(
        new_params, jax.tree.map(lambda p, g: p - g, params, ref_grads)
    )


@pytest.mark.standard_promotion
def test_batchnorm_aux_is_not_scaled():
    """Scaling the aux multiplies running statistics by the scale every
    step, and evaluation goes NaN while training looks fine."""
    model = LinenModel()
    x = jax.random.normal(jax.random.key(1), (16, 3)) * 3.0 + 1.0
    variables = model.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]
    big = lossscale.StaticLossScale(2.0**15)

    def loss(params, stats, x):
        y, updates = model.apply(
            {"params": params, "batch_stats": stats}, x, mutable=["batch_stats"]
        )
        return jnp.mean(y**2), updates["batch_stats"]

    def scaled_by_hand(params, stats, x):  # the mistake: scale the pair
        return big.scale(loss(params, stats, x))

    @functools.partial(jax.jit, static_argnums=0)
    def train(how, stats):
        for _ in range(12):
            if how == "lossscale":
                (_, stats), _ = lossscale.value_and_grad(
                    loss, big, has_aux=True
                )(params, stats, x)
            elif how == "plain":
                (_, stats), _ = jax.value_and_grad(loss, has_aux=True)(
                    params, stats, x
                )
            else:
                (_, stats), _ = jax.value_and_grad(
                    scaled_by_hand, has_aux=True
                )(params, stats, x)
        return stats

    def evaluate(stats):
        y = model.apply(
            {"params": params, "batch_stats": stats}, x, train=False
        )
        return float(jnp.mean(y**2))

    good = train("lossscale", stats)
    assert_trees_bitwise_equal(good, train("plain", stats))
    assert np.isfinite(evaluate(good))
    # Negative control: scaled, the running variance overflows, and the
    # evaluation of the model is no longer a number.
    bad = train("by_hand", stats)
    assert not np.isfinite(np.asarray(bad["BatchNorm_0"]["var"])).all()
    assert not np.isfinite(evaluate(bad))


# --- equinox ----------------------------------------------------------------


@pytest.mark.parametrize("has_aux", [False, True])
def test_equinox(has_aux):
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 3))

    def loss(model, x):
        y = jax.vmap(model)(x)
        value = jnp.mean(y**2)
        return (value, y) if has_aux else value

    tx = scaled_tx()
    state = tx.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, x):
        out, grads = lossscale.value_and_grad(
            loss, state, has_aux=has_aux, via=eqx.filter_value_and_grad
        )(model, x)
        updates, state = tx.update(
            grads, state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), state, out, grads

    @eqx.filter_jit
    def ref(model, x):
        return eqx.filter_value_and_grad(loss, has_aux=has_aux)(model, x)

    new_model, state, out, grads = step(model, state, x)
    ref_out, ref_grads = ref(model, x)
    assert_trees_bitwise_equal(out, ref_out)
    assert_trees_bitwise_equal(grads, times(ref_grads, SCALE))
    expected = eqx.apply_updates(model, jax.tree.map(jnp.negative, ref_grads))
    assert_trees_bitwise_equal(
        eqx.filter(new_model, eqx.is_array), eqx.filter(expected, eqx.is_array)
    )


def test_equinox_refuses_argnums_itself():
    # argnums goes to via only when given; equinox has none and says so.
    with pytest.raises(ValueError, match="argnums"):
        lossscale.value_and_grad(
            loss_fn,
            lossscale.StaticLossScale(2.0),
            argnums=0,
            via=eqx.filter_value_and_grad,
        )(PARAMS, X)


# --- pmap and shard_map, with axis_name -----------------------------------


def per_device_x():
    return jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3) / 4.0


def replicated(tree):
    return jax.tree.map(lambda p: jnp.broadcast_to(p, (N, *jnp.shape(p))), tree)


def flax_mean_grads(params, xs):
    """What flax's DynamicScale.value_and_grad(axis_name=...) averages."""
    return jax.tree.map(
        lambda *g: sum(g[1:], g[0]) / N,
        *[jax.grad(loss_fn)(params, xs[i]) for i in range(N)],
    )


@pytest.mark.parametrize("has_aux", [False, True])
def test_pmap_axis_name_averages(has_aux):
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.StaticLossScale(SCALE), axis_name="batch"
    )
    state = tx.init(PARAMS)
    fn = loss_aux_fn if has_aux else loss_fn

    def step(params, state, x):
        out, grads = lossscale.value_and_grad(
            fn, state, has_aux=has_aux, axis_name="batch"
        )(params, x)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, out, grads

    xs = per_device_x()
    new_params, state, out, grads = jax.pmap(step, axis_name="batch")(
        replicated(PARAMS), replicated(state), xs
    )
    mean = flax_mean_grads(PARAMS, xs)
    for i in range(N):
        got = jax.tree.map(lambda g, i=i: g[i], grads)
        np.testing.assert_allclose(
            np.asarray(got["w"]), SCALE * np.asarray(mean["w"]), rtol=1e-6
        )
        assert float(got["b"]) == SCALE
        p = jax.tree.map(lambda a, i=i: a[i], new_params)
        np.testing.assert_allclose(
            np.asarray(p["w"]),
            np.asarray(PARAMS["w"] - mean["w"]),
            rtol=1e-6,
        )
    # Each device's own loss, not averaged (as in flax).
    loss = out[0] if has_aux else out
    for i in range(N):
        assert float(loss[i]) == float(loss_fn(PARAMS, xs[i]))
    # Negative control: without axis_name the gradients differ by device.
    _, g = jax.pmap(
        lambda p, x: lossscale.value_and_grad(
            fn, tx.init(PARAMS), has_aux=has_aux
        )(p, x),
        axis_name="batch",
    )(replicated(PARAMS), xs)
    assert not np.allclose(np.asarray(g["w"][0]), np.asarray(g["w"][1]))


def explicit_mesh():
    return helpers.explicit_mesh((N,), ("d",), devices=jax.devices()[:N])


def put(mesh, tree, spec):
    return jax.tree.map(
        lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree
    )


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("has_aux", [False, True])
def test_shard_map_axis_name_averages(check_vma, has_aux):
    """pmap-style: every device holds its own copy of the params (a
    leading axis sharded over "d"), so the gradients differ by device."""
    mesh = explicit_mesh()
    fn = loss_aux_fn if has_aux else loss_fn
    scale = lossscale.StaticLossScale(SCALE)

    def step(params, x):
        params = jax.tree.map(lambda p: p[0], params)
        _, grads = lossscale.value_and_grad(
            fn, scale, has_aux=has_aux, axis_name="d"
        )(params, x[0])
        return jax.tree.map(lambda g: g[None], grads)

    f = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("d"), P("d")),
            out_specs=P("d"),
            check_vma=check_vma,
        )
    )
    xs = per_device_x()
    grads = f(put(mesh, replicated(PARAMS), P("d")), put(mesh, xs, P("d")))
    mean = flax_mean_grads(PARAMS, xs)
    for i in range(N):
        np.testing.assert_allclose(
            np.asarray(grads["w"])[i], SCALE * np.asarray(mean["w"]), rtol=1e-6
        )


def test_shard_map_replicated_params_refuse_a_second_average():
    """check_vma=True: autodiff already summed the gradient of a replicated
    parameter over "d"; averaging it again is refused, loudly."""
    mesh = explicit_mesh()
    scale = lossscale.StaticLossScale(SCALE)

    def run(axis_name, mean_loss):
        def step(params, x):
            def fn(p, x):
                loss = loss_fn(p, x[0])
                return lax_pmean(loss) if mean_loss else loss

            return lossscale.value_and_grad(fn, scale, axis_name=axis_name)(
                params, x
            )[1]

        f = jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P("d")),
            out_specs=P(),
            check_vma=True,
        )
        return jax.jit(f)(
            put(mesh, PARAMS, P()), put(mesh, per_device_x(), P("d"))
        )

    def lax_pmean(x):
        return jax.lax.pmean(x, "d")

    with pytest.raises(ValueError, match=r"\['b'\] does not vary over \['d'\]"):
        run("d", False)
    # The advice in the message: pmean the loss, leave axis_name out.
    grads = run(None, True)
    mean = flax_mean_grads(PARAMS, per_device_x())
    np.testing.assert_allclose(
        np.asarray(grads["w"]), SCALE * np.asarray(mean["w"]), rtol=1e-6
    )


def test_vmap_axis_name():
    # Any named axis: vmap's too (no shard_map, so pmean as flax does).
    scale = lossscale.StaticLossScale(SCALE)
    xs = per_device_x()
    grads = jax.vmap(
        lambda x: lossscale.value_and_grad(loss_fn, scale, axis_name="v")(
            PARAMS, x
        )[1],
        axis_name="v",
    )(xs)
    mean = flax_mean_grads(PARAMS, xs)
    np.testing.assert_allclose(
        np.asarray(grads["w"][3]), SCALE * np.asarray(mean["w"]), rtol=1e-6
    )


def test_partial_via_options():
    via = functools.partial(jax.value_and_grad, allow_int=True)

    def f(w, n):
        return jnp.sum(w) * 2.0

    loss, (gw, gn) = lossscale.value_and_grad(
        f, lossscale.StaticLossScale(SCALE), argnums=(0, 1), via=via
    )(jnp.ones(2), jnp.int32(3))
    assert float(loss) == 4.0
    np.testing.assert_array_equal(
        np.asarray(gw), np.full(2, 2 * SCALE, np.float32)
    )
    assert gn.dtype == jax.dtypes.float0


_KEPT_AT_MODULE_LEVEL = """
import jax.numpy as jnp
import optax

import lossscale


def loss_fn(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"]) ** 2)


params = {
    "w1": jnp.ones((4, 8), jnp.float32),
    "b1": jnp.zeros((8,), jnp.float32),
    "w2": jnp.ones((8, 1), jnp.float32),
}
tx = lossscale.loss_scaled(optax.adam(1e-3), lossscale.DynamicLossScale(4.0))
opt_state = tx.init(params)
loss, grads = lossscale.value_and_grad(
    lossscale.autocast(loss_fn, jnp.float16), opt_state
)(params, jnp.ones((2, 4), jnp.float32))
updates, opt_state = tx.update(grads, opt_state, params)
"""


def test_marked_gradients_kept_in_module_variables_exit_quietly():
    # They die at interpreter exit, after lossscale's module globals are
    # cleared: forgetting their marks once printed a traceback per leaf.
    proc = subprocess.run(
        [sys.executable, "-c", _KEPT_AT_MODULE_LEVEL],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).resolve().parent.parent,
    )
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_dying_marked_leaf_needs_no_module_global(monkeypatch):
    # At interpreter exit a module's globals may be cleared to None before
    # the leaves kept in another module's variables die: forgetting a mark
    # must not look any of them up then, whatever order the exit takes.
    record = _records.LeafRecord()
    leaf = jnp.ones(2)
    record.remember(leaf, "mark")
    monkeypatch.setattr(_records, "_forget", None)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    del leaf
    assert (record.alive(), unraisable) == ([], [])
    assert not record._entries
