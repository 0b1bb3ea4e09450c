"""Eager mode, ``jax.disable_jit()`` and ``jax_debug_nans``.

Called outside ``jit`` the finiteness flag is a concrete value, and the
skip is a Python branch: a skipped step never runs the inner update, so it
does no arithmetic on the non-finite gradients and ``jax_debug_nans`` (the
usual way to hunt NaNs eagerly) stays quiet.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from tests.helpers import assert_trees_bitwise_equal, explicit_mesh

pytestmark = pytest.mark.standard_promotion


def params_and_grads():
    params = {"w": jnp.arange(1.0, 7.0).reshape(2, 3), "b": jnp.ones(3)}
    grads = {"w": jnp.full((2, 3), 64.0), "b": jnp.full(3, -32.0)}
    return params, grads


def test_debug_nans_skipped_overflow_raises_nothing():
    """The overflow that the default 2**16 scale makes at the start."""
    params, grads = params_and_grads()
    bad = dict(grads, w=grads["w"].at[0, 1].set(jnp.inf))
    tx = lossscale.loss_scaled(
        optax.adam(1e-2), lossscale.DynamicLossScale(), require_scaled_by=False
    )
    state = tx.init(params)
    with jax.debug_nans(True):
        updates, new_state = tx.update(bad, state, params)
    assert not bool(new_state.grads_finite)
    assert float(new_state.loss_scale.loss_scale) == 2.0**15
    assert_trees_bitwise_equal(new_state.inner_state, state.inner_state)
    assert_trees_bitwise_equal(updates, jax.tree.map(jnp.zeros_like, params))

    # Negative control: adam itself, run on those gradients, makes a NaN.
    with jax.debug_nans(True), pytest.raises(FloatingPointError):
        optax.adam(1e-2).update(bad, optax.adam(1e-2).init(params), params)


def test_disable_jit_takes_the_python_branch():
    params, grads = params_and_grads()
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.StaticLossScale(32.0), require_scaled_by=False
    )

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = tx.init(params)
    with jax.disable_jit():
        p1, s1 = step(params, state, grads)
        assert not isinstance(s1.grads_finite, jax.core.Tracer)
    p2, s2 = step(params, state, grads)
    # sgd(1.0): p - g / 32, exactly, eagerly and compiled.
    want = {"w": params["w"] - 2.0, "b": params["b"] + 1.0}
    assert_trees_bitwise_equal(p1, want)
    assert_trees_bitwise_equal(p1, p2)
    assert_trees_bitwise_equal(s1, s2)

    bad = dict(grads, b=grads["b"].at[2].set(jnp.nan))
    with jax.disable_jit(), jax.debug_nans(True):
        p3, s3 = step(p1, s1, bad)
    assert_trees_bitwise_equal(p3, p1)
    assert int(s3.skipped_steps) == 1


def test_eager_steps_match_compiled_steps():
    params, grads = params_and_grads()
    tx = lossscale.loss_scaled(
        optax.adamw(1e-2),
        lossscale.DynamicLossScale(64.0, growth_interval=2),
        require_scaled_by=False,
    )
    step = jax.jit(tx.update)
    eager_state = compiled_state = tx.init(params)
    for i in range(5):
        g = (
            grads
            if i != 2
            else dict(grads, w=grads["w"].at[1, 1].set(-jnp.inf))
        )
        u1, eager_state = tx.update(g, eager_state, params)
        u2, compiled_state = step(g, compiled_state, params)
        for a, b in zip(
            jax.tree.leaves((u1, eager_state)),
            jax.tree.leaves((u2, compiled_state)),
            strict=True,
        ):
            np.testing.assert_allclose(a, b, rtol=1e-6)
    assert int(eager_state.skipped_steps) == 1
    # 64 -> 128 (grown on step 2) -> 64 (backed off) -> 128 (grown again)
    assert float(eager_state.loss_scale.loss_scale) == 128.0


def test_eager_skip_keeps_the_structure_the_update_returns():
    """optax's momentum drops the trace of a leaf whose gradient is None."""
    params = {"w": jnp.ones(3), "n": jnp.int32(7)}
    bad = {"w": jnp.array([1.0, jnp.nan, 1.0]), "n": None}
    inner = optax.sgd(0.1, momentum=0.9)
    tx = lossscale.loss_scaled(
        inner, lossscale.StaticLossScale(1.0), require_scaled_by=False
    )
    state = tx.init(params)
    updates, skipped = tx.update(bad, state, params)
    plain_updates, plain_state = inner.update(
        {"w": jnp.ones(3), "n": None}, inner.init(params), params
    )
    assert jax.tree.structure(skipped.inner_state) == jax.tree.structure(
        plain_state
    )
    assert jax.tree.structure(updates) == jax.tree.structure(plain_updates)
    np.testing.assert_array_equal(skipped.inner_state[0].trace["w"], 0.0)
    assert not bool(skipped.grads_finite)


def test_on_min_scale_error_raises_directly():
    params, grads = params_and_grads()
    bad = dict(grads, b=grads["b"].at[0].set(jnp.inf))
    tx = lossscale.loss_scaled(
        optax.sgd(0.1),
        lossscale.StaticLossScale(4.0),
        on_min_scale="error",
        min_scale_patience=2,
        require_scaled_by=False,
    )
    state = tx.init(params)
    _, state = tx.update(bad, state, params)
    with pytest.raises(FloatingPointError, match="2 consecutive steps"):
        tx.update(bad, state, params)


def test_eager_skip_keeps_the_gradients_sharding():
    """A skipped eager step's zero updates are sharded like the gradients
    (not gathered whole onto every device)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = explicit_mesh((8,), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    params = {"w": jax.device_put(jnp.ones(64), sharding)}
    grads = {"w": jax.device_put(jnp.ones(64).at[3].set(jnp.inf), sharding)}
    tx = lossscale.loss_scaled(
        optax.adam(1e-2),
        lossscale.StaticLossScale(2.0),
        require_scaled_by=False,
    )
    updates, state = tx.update(grads, tx.init(params), params)
    assert not bool(state.grads_finite)
    assert updates["w"].sharding.is_equivalent_to(sharding, 1)
    np.testing.assert_array_equal(updates["w"], np.zeros(64))


def test_leaves_committed_to_different_devices():
    # Model parallelism by hand: each leaf on its own device, no mesh. The
    # eager check cannot be one program (its inputs would have to move), so
    # each leaf is checked where it lives.
    d0, d1 = jax.devices()[:2]
    params = {
        "a": jax.device_put(jnp.ones(3), d0),
        "b": jax.device_put(jnp.ones(2), d1),
    }
    grads = {
        "a": jax.device_put(jnp.full(3, 4.0), d0),
        "b": jax.device_put(jnp.full(2, 8.0), d1),
    }
    assert bool(lossscale.all_finite(grads))
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.DynamicLossScale(4.0),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    np.testing.assert_array_equal(updates["a"], -np.ones(3))
    np.testing.assert_array_equal(updates["b"], -2 * np.ones(2))

    grads["b"] = grads["b"].at[1].set(jnp.inf)
    assert not bool(lossscale.all_finite(grads))
    updates, state = tx.update(grads, state, params)
    assert_trees_bitwise_equal(updates, jax.tree.map(jnp.zeros_like, params))
    assert lossscale.nonfinite_paths(state, params) == ["['b']"]
    assert float(lossscale.get_loss_scale(state).loss_scale) == 2.0


def test_concrete_leaves_closed_over_by_a_traced_function():
    # Concrete arrays meeting a trace: every operation on them is staged,
    # so the check must not take its eager (Python branch) path.
    d0, d1 = jax.devices()[:2]
    tree = {
        "a": jax.device_put(jnp.ones(3), d0),
        "b": jax.device_put(jnp.array([jnp.inf]), d1),
    }
    assert not bool(jax.jit(lambda: lossscale.all_finite(tree))())
    params, grads = {"w": jnp.ones(3)}, {"w": jnp.full(3, 2.0)}
    # A scale below 1: the check reads the unscaled gradients, after the
    # scaled ones where it runs eagerly.
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.StaticLossScale(0.5), require_scaled_by=False
    )
    updates, _ = jax.jit(lambda s: tx.update(grads, s, params))(tx.init(params))
    np.testing.assert_array_equal(updates["w"], np.full(3, -4.0))


def test_one_device_set_in_two_orders():
    # Two meshes over the same devices: one program cannot take both, so
    # each leaf is checked where it lives.
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    grid = np.array(jax.devices()[:4]).reshape(2, 2)
    a = jax.device_put(
        np.ones(4), NamedSharding(Mesh(grid, ("a", "b")), P("a"))
    )
    b = jax.device_put(
        np.array([1.0, 2.0, np.nan, 4.0]),
        NamedSharding(Mesh(grid.T, ("b", "a")), P("a")),
    )
    assert bool(lossscale.all_finite([a, a]))
    assert not bool(lossscale.all_finite([a, b]))


def test_pmap_outputs_checked_eagerly():
    # Arrays laid out by jax.pmap (a PmapSharding on jax 0.7, checked where
    # they live; NamedSharding since 0.8), alone and beside an array on one
    # device, with the bad element on the last device.
    n = jax.local_device_count()
    rows = jax.pmap(lambda x: x * 2.0)(jnp.ones((n, 3)))
    last = jnp.arange(float(n))[:, None] - (n - 1)
    bad = jax.pmap(lambda x: x / x)(last)  # 0 / 0 on the last device
    assert bool(lossscale.all_finite(rows))
    assert bool(lossscale.all_finite({"r": rows, "x": jnp.ones(2)}))
    assert not bool(lossscale.all_finite(bad))
    assert not bool(lossscale.all_finite({"r": rows, "b": bad}))
    params = {"r": jnp.ones((n, 3))}
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.DynamicLossScale(2.0), require_scaled_by=False
    )
    updates, state = tx.update({"r": rows}, tx.init(params), params)
    np.testing.assert_array_equal(updates["r"], -np.ones((n, 3)))
    updates, state = tx.update({"r": rows.at[n - 1, 0].set(jnp.inf)}, state)
    assert not bool(state.grads_finite)
    np.testing.assert_array_equal(updates["r"], np.zeros((n, 3)))
