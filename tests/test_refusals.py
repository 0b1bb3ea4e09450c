"""The train step's last silent slips, and refusals that name the mistake
(issue 34).

Each slip is reproduced with the documented step as its negative control:
a stale or foreign scale, which skipped every step in silence; the loss
scaled twice; float16 master weights; a number given as the loss scale.
Each refusal of unmarked gradients says which mistake made them, and its
fix: every case is checked by a substring that names the fix.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import lossscale

X = jax.random.normal(jax.random.key(0), (32, 4))
Y = X @ jnp.arange(1.0, 5.0)[:, None]
PARAMS = {"w": jnp.zeros((4, 1))}


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] - y) ** 2)


def make_tx(inner=None, **kwargs):
    # A scale that grows every 5 clean steps, so that a stale one shows.
    scale = lossscale.DynamicLossScale(2.0**10, growth_interval=5)
    return lossscale.loss_scaled(inner or optax.sgd(0.05), scale, **kwargs)


def documented_step(tx):
    @jax.jit
    def step(params, opt_state):
        loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def train(step, tx, steps=20, *extra):
    params, opt_state = PARAMS, tx.init(PARAMS)
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, *extra)
    return float(loss), lossscale.metrics(opt_state)


# --- a stale or foreign scale ---------------------------------------------


def test_a_closed_over_state_is_refused_at_trace_time():
    tx = make_tx()
    init_state = tx.init(PARAMS)

    @jax.jit
    def step(params, opt_state):
        # The slip: the initial state closed over, not this step's state.
        _, grads = lossscale.value_and_grad(loss_fn, init_state)(params, X, Y)
        return tx.update(grads, opt_state, params)

    with pytest.raises(ValueError, match="stale opt_state") as err:
        step(PARAMS, init_state)
    assert "lossscale.value_and_grad(loss_fn, opt_state) inside the step" in (
        str(err.value)
    )


def test_the_documented_step_is_not_refused_and_its_scale_grows():
    # The negative control of every slip of a scale: applied steps only,
    # and a scale that grows (so a stale one would show).
    tx = make_tx(on_min_scale="count")
    loss, metrics = train(documented_step(tx), tx, steps=200)
    assert loss < 1e-6
    assert int(metrics["skipped_steps"]) == 0
    assert int(metrics["stale_scale_skips"]) == 0
    assert float(metrics["loss_scale"]) == 2.0**24  # grew to its ceiling


def test_a_closed_over_static_scale_is_accepted():
    # A static scale never changes: the state closed over scales the loss
    # by the value tx.update holds, and every step applies.
    tx = lossscale.loss_scaled(
        optax.sgd(0.05), lossscale.StaticLossScale(2.0**10)
    )
    init_state = tx.init(PARAMS)

    @jax.jit
    def step(params, opt_state):
        loss, grads = lossscale.value_and_grad(loss_fn, init_state)(
            params, X, Y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss, metrics = train(step, tx, steps=200)
    assert loss < 1e-6 and int(metrics["skipped_steps"]) == 0


def foreign_step(tx):
    @jax.jit
    def step(params, opt_state, other_state):
        # The slip: another state (here the initial one, passed in each
        # step, so that the trace cannot tell) gives the scale.
        loss, grads = lossscale.value_and_grad(loss_fn, other_state)(
            params, X, Y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def test_a_foreign_scale_counts_its_skips():
    tx = make_tx(on_min_scale="count")
    _, metrics = train(foreign_step(tx), tx, 20, tx.init(PARAMS))
    # The scale grew after 5 clean steps; from then on the gradients were
    # scaled by the old one, and none of those 15 steps was applied.
    assert int(metrics["skipped_steps"]) == 15
    assert int(metrics["stale_scale_skips"]) == 15
    assert int(metrics["min_scale_skips"]) == 0
    assert not bool(metrics["at_min_scale"])
    assert float(metrics["loss_scale"]) == 2.0**11  # never adjusted again


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_foreign_scale_raises_after_patience_with_on_min_scale_error(jit):
    tx = make_tx(on_min_scale="error", min_scale_patience=3)

    def step(params, opt_state, other_state):
        _, grads = lossscale.value_and_grad(loss_fn, other_state)(params, X, Y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(step) if jit else step
    params, state = PARAMS, tx.init(PARAMS)
    other = tx.init(PARAMS)  # another state: here, the initial one
    applied = 0
    with pytest.raises(Exception, match="scaled by another loss scale") as err:
        for _ in range(20):
            params, state = step(params, state, other)
            jax.block_until_ready(params)
            applied = int(state.steps)
    # Five clean steps grew the scale; the third stale skip raised.
    assert applied == 7
    assert "Give value_and_grad the opt_state" in str(err.value)


def test_the_same_state_passes_with_on_min_scale_error():
    # Control of the raise: the documented step with the same options.
    tx = make_tx(on_min_scale="error", min_scale_patience=3)
    _, metrics = train(documented_step(tx), tx, steps=20)
    assert int(metrics["skipped_steps"]) == 0
    assert int(metrics["stale_scale_skips"]) == 0


def test_the_stale_count_resets_on_a_step_with_the_right_scale():
    tx = make_tx(on_min_scale="count")
    state = tx.init(PARAMS)
    wrong = lossscale.StaticLossScale(2.0**9)
    right = lossscale.get_loss_scale(state)
    update = jax.jit(tx.update)
    for scale, stale in [(wrong, 1), (wrong, 2), (right, 0), (wrong, 1)]:
        grads = jax.grad(lambda p, s=scale: s.scale(loss_fn(p, X, Y)))(PARAMS)
        _, state = update(grads, state, PARAMS, scaled_by=scale)
        assert int(state.stale_scale_skips) == stale


def test_a_state_without_the_stale_count_is_refused():
    tx = make_tx(on_min_scale="error")
    state = tx.init(PARAMS)._replace(stale_scale_skips=None)  # as 0.2 saved
    grads, scale = jnp.ones((4, 1)), lossscale.get_loss_scale(state)
    with pytest.raises(ValueError, match="stale_scale_skips is None"):
        tx.update({"w": grads}, state, PARAMS, scaled_by=scale)


# --- the refusal of plain jax.grad gradients ---------------------------------


def refusal(step, *args):
    with pytest.raises(TypeError) as err:
        step(*args)
    return str(err.value)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_plain_jax_grad_is_sent_to_value_and_grad(jit):
    tx = make_tx()

    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params, X, Y)  # unscaled
        return tx.update(grads, opt_state, params)

    message = refusal(jax.jit(step) if jit else step, PARAMS, tx.init(PARAMS))
    assert "gradient at ['w'] is not one of them" in message
    assert (
        "lossscale.value_and_grad(loss_fn, opt_state)(params, ...)" in message
    )
    # The way out for hand-scaled gradients must not read as one for these:
    # pasted onto unscaled gradients it trains S times too slowly.
    assert "scaled_by=lossscale.get_loss_scale(opt_state)" not in message
    assert "a loss you multiplied by the loss scale yourself" in message


# --- refusals that name the mistake ------------------------------------------


@pytest.mark.parametrize(
    "before",
    [optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-4)],
    ids=["clip_by_global_norm", "add_decayed_weights"],
)
def test_a_transformation_chained_before_loss_scaled(before):
    tx = optax.chain(before, make_tx())
    message = refusal(documented_step(tx), PARAMS, tx.init(PARAMS))
    assert "Put loss_scaled outermost" in message
    assert "loss_scaled(optax.chain(optax.clip_by_global_norm(1.0)" in message


@pytest.mark.standard_promotion
def test_the_same_transformations_inside_loss_scaled_train():
    # Control: the order the message asks for.
    tx = make_tx(
        optax.chain(
            optax.clip_by_global_norm(1e3),
            optax.add_decayed_weights(0.0),
            optax.sgd(0.05),
        )
    )
    loss, metrics = train(documented_step(tx), tx, steps=200)
    assert loss < 1e-6 and int(metrics["skipped_steps"]) == 0


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_a_hand_unscale_before_update(jit):
    tx = make_tx()

    def step(params, opt_state):
        _, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        grads = lossscale.get_loss_scale(opt_state).unscale(grads)
        return tx.update(grads, opt_state, params)

    step = jax.jit(step) if jit else step
    message = refusal(step, PARAMS, tx.init(PARAMS))
    assert "was unscaled by hand" in message
    assert "Pass tx.update the scaled gradients" in message


def test_an_unscale_for_logging_leaves_the_step_alone():
    # Control: unscaling a copy (to log it) while tx.update gets the scaled
    # gradients, as the demo does, is no slip.
    tx = make_tx()

    @jax.jit
    def step(params, opt_state):
        _, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        true = lossscale.get_loss_scale(opt_state).unscale(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, true["w"][0, 0]

    params, state = PARAMS, tx.init(PARAMS)
    params, state, g = step(params, state)
    assert bool(state.grads_finite)
    assert float(g) == pytest.approx(
        float(jax.grad(loss_fn)(PARAMS, X, Y)["w"][0, 0])
    )


def test_a_pmean_of_the_gradients_under_shard_map():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
    tx = make_tx(axis_name="batch")

    def step(params, opt_state, x, y):
        _, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, x, y)
        grads = jax.lax.pmean(grads, "batch")  # the slip
        return tx.update(grads, opt_state, params)

    mapped = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("batch"), P("batch")),
            out_specs=P(),
            check_vma=False,
        )
    )
    message = refusal(mapped, PARAMS, tx.init(PARAMS), X, Y)
    assert "inside a jax.pmap or shard_map" in message
    assert "lossscale.value_and_grad(loss_fn, opt_state, axis_name=...)" in (
        message
    )


def test_value_and_grad_axis_name_under_shard_map_trains():
    # Control: the average the message asks for.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("batch",))
    tx = make_tx(axis_name="batch")

    def step(params, opt_state, x, y):
        _, grads = lossscale.value_and_grad(
            loss_fn, opt_state, axis_name="batch"
        )(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    mapped = jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), P(), P("batch"), P("batch")),
            out_specs=P(),
            check_vma=False,
        )
    )
    params, state = mapped(PARAMS, tx.init(PARAMS), X, Y)
    assert bool(state.grads_finite)
    assert not np.array_equal(np.asarray(params["w"]), np.zeros((4, 1)))


def test_a_jit_boundary_between_value_and_grad_and_update():
    tx = make_tx()
    state = tx.init(PARAMS)
    _, grads = lossscale.value_and_grad(loss_fn, state)(PARAMS, X, Y)
    message = refusal(jax.jit(tx.update), grads, state, PARAMS)
    assert "is an argument of the jax.jit" in message
    assert "call both in one jitted train step" in message
    # The way out for value_and_grad's gradients, in words that say whose.
    assert (
        "If it comes from lossscale.value_and_grad, call both in one jitted "
        "train step, or pass the scale that call used: jax.jit(tx.update)("
        "grads, opt_state, params, scaled_by=lossscale.get_loss_scale("
        "opt_state))"
    ) in message
    assert "If it comes from plain jax.grad, it is not scaled" in message
    # Plain jax.grad gradients crossing the boundary get the same message:
    # nothing inside the jit tells the two apart.
    plain = jax.grad(loss_fn)(PARAMS, X, Y)
    assert refusal(jax.jit(tx.update), plain, state, PARAMS) == message
    # The fix it gives applies the step (and the eager update needs none).
    scale = lossscale.get_loss_scale(state)
    updates, new = jax.jit(tx.update)(grads, state, PARAMS, scaled_by=scale)
    eager_updates, eager = tx.update(grads, state, PARAMS)
    assert bool(new.grads_finite) and bool(eager.grads_finite)
    np.testing.assert_array_equal(updates["w"], eager_updates["w"])


@pytest.mark.standard_promotion
def test_optax_multisteps_is_sent_to_lossscale_multisteps():
    tx = optax.MultiSteps(make_tx(), every_k_schedule=2)
    message = refusal(documented_step(tx), PARAMS, tx.init(PARAMS))
    assert "Use lossscale.MultiSteps(loss_scaled(...)" in message


def test_a_gradient_made_from_marked_ones_otherwise():
    tx = make_tx()

    @jax.jit
    def step(params, opt_state):
        _, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        grads = jax.tree.map(lambda g: g * 1.0, grads)
        return tx.update(grads, opt_state, params)

    message = refusal(step, PARAMS, tx.init(PARAMS))
    assert "was made from the gradients lossscale.value_and_grad" in message
    assert "Pass tx.update value_and_grad's gradients as they are" in message


# --- the loss scaled twice -----------------------------------------------


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_both_idioms_at_once_are_refused(jit):
    tx = make_tx()
    state = tx.init(PARAMS)

    def twice_scaled(params, x, y):  # the slip: a scale inside the loss
        scale = lossscale.get_loss_scale(state)
        return scale.scale(loss_fn(params, x, y))

    def step(params, opt_state):
        return lossscale.value_and_grad(twice_scaled, opt_state)(params, X, Y)

    step = jax.jit(step) if jit else step
    with pytest.raises(ValueError, match="scaled twice") as err:
        step(PARAMS, state)
    assert "Return the plain loss from the function" in str(err.value)


def test_both_idioms_under_autocast_are_refused():
    tx = make_tx()
    state = tx.init(PARAMS)
    scale = lossscale.get_loss_scale(state)
    twice = lossscale.autocast(
        lambda p, x, y: scale.scale(loss_fn(p, x, y)), jnp.float16
    )
    with pytest.raises(ValueError, match="scaled twice"):
        jax.jit(lossscale.value_and_grad(twice, state))(PARAMS, X, Y)


def test_a_scale_by_hand_with_jax_grad_and_nested_value_and_grad_pass():
    # Controls: scaling by hand outside value_and_grad, and value_and_grad
    # called inside another's loss function (its own scaling is no slip).
    tx = make_tx()
    state = tx.init(PARAMS)
    scale = lossscale.get_loss_scale(state)
    grads = jax.grad(lambda p: scale.scale(loss_fn(p, X, Y)))(PARAMS)
    _, new = tx.update(grads, state, PARAMS, scaled_by=scale)
    assert bool(new.grads_finite)

    def outer(params, x, y):
        inner_loss, _ = lossscale.value_and_grad(loss_fn, state)(params, x, y)
        return inner_loss

    loss, grads = lossscale.value_and_grad(outer, state)(PARAMS, X, Y)
    assert float(loss) == float(loss_fn(PARAMS, X, Y))
    _, new = tx.update(grads, state, PARAMS)
    assert bool(new.grads_finite)


# --- float16 master weights -------------------------------------------------


def test_float16_master_weights_warn_naming_the_leaf():
    params = {"dense": {"w": jnp.ones((4, 2), jnp.float16)}, "b": jnp.ones(2)}
    with pytest.warns(UserWarning, match=r"\['dense'\]\['w'\] \(float16\)"):
        make_tx().init(params)


def test_float32_master_weights_and_masked_float16_leaves_do_not_warn():
    params = {"w": jnp.ones((4, 2)), "meta": jnp.ones(2, jnp.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_tx().init({"w": params["w"]})
        make_tx().init({"w": params["w"], "b": jnp.ones(2, jnp.bfloat16)})
        make_tx(mask={"w": True, "meta": False}).init(params)


# --- a number for the loss scale ------------------------------------------


@pytest.mark.parametrize(
    ("value", "written"),
    [(2.0**15, "2.0**15"), (1000.0, "1000.0"), (np.float32(2**12), "2.0**12")],
)
def test_a_number_as_the_loss_scale_names_the_policies(value, written):
    with pytest.raises(TypeError) as err:
        lossscale.loss_scaled(optax.adam(1e-3), value)
    assert f"lossscale.StaticLossScale({written})" in str(err.value)
    assert f"lossscale.DynamicLossScale({written})" in str(err.value)


def test_jax_jit_of_update_is_how_a_partial_is_written():
    # Not a slip: functools.partial(tx.update) under jit with marked
    # gradients computed in the same trace is the documented step.
    tx = make_tx()

    @jax.jit
    def step(params, opt_state):
        _, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        return functools.partial(tx.update, params=params)(grads, opt_state)

    _, state = step(PARAMS, tx.init(PARAMS))
    assert bool(state.grads_finite)
