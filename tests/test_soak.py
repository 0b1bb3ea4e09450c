"""Fault injection: thousands of float16 steps with NaN/+-inf injected."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale

pytestmark = pytest.mark.standard_promotion

STEPS = 3000
INJECT_RATE = 0.03
MIN_SCALE, MAX_SCALE = 1.0, 2.0**24


def init_params(key):
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (8, 32), jnp.float32) * 0.3,
        "b1": jnp.zeros(32, jnp.float32),
        "w2": jax.random.normal(k2, (32, 1), jnp.float32) * 0.3,
        "b2": jnp.zeros(1, jnp.float32),
    }


def loss_fn(params, x, y):
    p = jax.tree.map(lambda a: a.astype(jnp.float16), params)
    h = jnp.tanh(x.astype(jnp.float16) @ p["w1"] + p["b1"])
    pred = (h @ p["w2"] + p["b2"]).astype(jnp.float32)
    return jnp.mean((pred - y) ** 2)


def batch(key):
    x = jax.random.normal(key, (64, 8), jnp.float32)
    y = jnp.sin(x[:, :1]) + 0.5 * x[:, 1:2]
    return x, y


def inject(key, grads):
    """Puts NaN, +inf or -inf at a random element of one random leaf."""
    leaves, treedef = jax.tree.flatten(grads)
    k_leaf, k_pos, k_val = jax.random.split(key, 3)
    which = jax.random.randint(k_leaf, (), 0, len(leaves))
    value = jax.random.choice(k_val, jnp.array([jnp.nan, jnp.inf, -jnp.inf]))
    out = []
    for i, g in enumerate(leaves):
        pos = jax.random.randint(k_pos, (), 0, g.size)
        poisoned = g.ravel().at[pos].set(value).reshape(g.shape)
        out.append(jnp.where(which == i, poisoned, g))
    return jax.tree.unflatten(treedef, out)


def run(inject_rate, seed=0):
    tx = lossscale.loss_scaled(
        optax.adam(3e-3),
        lossscale.DynamicLossScale(
            MAX_SCALE,
            growth_interval=20,
            min_loss_scale=MIN_SCALE,
            max_loss_scale=MAX_SCALE,
        ),
        require_scaled_by=False,
    )
    params = init_params(jax.random.key(seed))

    def step(carry, key):
        params, opt_state = carry
        k_data, k_coin, k_inject = jax.random.split(key, 3)
        x, y = batch(k_data)
        scale = lossscale.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, x, y)))(params)
        natural = ~lossscale.all_finite(grads)
        injected = jax.random.uniform(k_coin) < inject_rate
        grads = jax.tree.map(
            lambda a, b: jnp.where(injected, a, b),
            inject(k_inject, grads),
            grads,
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        healthy = lossscale.all_finite((params, opt_state.inner_state))
        record = {
            "natural": natural,
            "injected": injected,
            "healthy": healthy,
            "scale": lossscale.get_loss_scale(opt_state).loss_scale,
            "loss": loss_fn(params, x, y),
        }
        return (params, opt_state), record

    keys = jax.random.split(jax.random.key(seed + 1), STEPS)
    (params, opt_state), rec = jax.jit(lambda c, k: jax.lax.scan(step, c, k))(
        (params, tx.init(params)), keys
    )
    return params, opt_state, jax.tree.map(np.asarray, rec)


def test_soak_with_injected_faults():
    params, opt_state, rec = run(INJECT_RATE)
    _, _, clean = run(0.0)

    n_injected = int(rec["injected"].sum())
    n_natural = int(rec["natural"].sum())
    assert 0.02 * STEPS < n_injected < 0.04 * STEPS  # the faults happened
    # and so did real overflows: the scale starts at 2**24 and backs off
    assert n_natural >= 5
    m = lossscale.metrics(opt_state)
    expected_skips = int((rec["injected"] | rec["natural"]).sum())
    assert int(m["skipped_steps"]) == expected_skips

    # Nothing non-finite ever reached the params or any optimizer leaf.
    assert rec["healthy"].all()
    assert lossscale.all_finite(params) and lossscale.all_finite(opt_state)
    assert (rec["scale"] >= MIN_SCALE).all() and (
        rec["scale"] <= MAX_SCALE
    ).all()

    # Training went on: the final loss is close to the clean run's.
    final, final_clean = rec["loss"][-100:].mean(), clean["loss"][-100:].mean()
    first = clean["loss"][:10].mean()
    assert final_clean < 0.2 * first
    assert abs(final - final_clean) < 0.1 * first
