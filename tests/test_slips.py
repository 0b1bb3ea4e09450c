"""The recommended train step cannot go silently wrong (issue 29).

Three slips used to train wrongly with healthy-looking metrics: unscaled
gradients (plain ``jax.grad``) given to ``tx.update``; ``value_and_grad``
given an earlier ``opt_state`` than ``tx.update``; and a pmap step whose
gradients are never averaged. Each is reproduced here with the correct
step as its negative control, and so are the clearer errors of the same
issue.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from lossscale import _compat

X = jax.random.normal(jax.random.key(0), (32, 4))
Y = X @ jnp.arange(1.0, 5.0)[:, None]
PARAMS = {"w": jnp.zeros((4, 1))}


def loss_fn(params, x, y):
    return jnp.mean((x @ params["w"] - y) ** 2)


def make_tx(**kwargs):
    # A scale that grows every 5 clean steps, so that a stale one shows.
    scale = lossscale.DynamicLossScale(2.0**10, growth_interval=5)
    return lossscale.loss_scaled(optax.sgd(0.05), scale, **kwargs)


def train(step, tx, steps=200):
    params, opt_state = PARAMS, tx.init(PARAMS)
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
    return float(loss), lossscale.metrics(opt_state)


def test_the_recommended_step_trains():
    # The negative control of every slip below.
    tx = make_tx()

    @jax.jit
    def step(params, opt_state):
        loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss, metrics = train(step, tx)
    assert loss < 1e-6
    assert int(metrics["skipped_steps"]) == 0
    assert float(metrics["loss_scale"]) > 2.0**10  # it grew: no stale use


# --- slip 1: unscaled gradients ------------------------------------------


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_unscaled_gradients_are_refused(jit):
    tx = make_tx()
    opt_state = tx.init(PARAMS)

    def step(params, opt_state):
        grads = jax.grad(loss_fn)(params, X, Y)  # forgot to scale
        return tx.update(grads, opt_state, params)

    step = jax.jit(step) if jit else step
    with pytest.raises(TypeError, match=r"gradient at \['w'\] is not one"):
        step(PARAMS, opt_state)


def test_hand_scaled_gradients_say_by_what():
    tx = make_tx()

    @jax.jit
    def step(params, opt_state):
        scale = lossscale.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, X, Y)))(params)
        updates, opt_state = tx.update(
            grads, opt_state, params, scaled_by=scale
        )
        return (
            optax.apply_updates(params, updates),
            opt_state,
            loss_fn(params, X, Y),
        )

    loss, metrics = train(step, tx)
    assert loss < 1e-6 and int(metrics["skipped_steps"]) == 0


def test_require_scaled_by_false_takes_gradients_unchecked():
    tx = make_tx(require_scaled_by=False)
    state = tx.init(PARAMS)
    grads = jax.grad(loss_fn)(PARAMS, X, Y)
    _, state = tx.update(grads, state, PARAMS)
    assert bool(state.grads_finite)
    with pytest.raises(TypeError, match="require_scaled_by must be a bool"):
        make_tx(require_scaled_by=1)


# --- slip 2: a stale scale -------------------------------------------------


def test_a_stale_scale_skips_every_step_it_is_wrong_on():
    tx = make_tx()

    @jax.jit
    def step(params, opt_state, init_state):
        # The slip: the init state, passed in (closed over, it is refused at
        # trace time: tests/test_refusals.py), not this step's state.
        loss, grads = lossscale.value_and_grad(loss_fn, init_state)(
            params, X, Y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    init_state = tx.init(PARAMS)
    params, opt_state = PARAMS, init_state
    for _ in range(20):
        params, opt_state, _ = step(params, opt_state, init_state)
    metrics = lossscale.metrics(opt_state)
    # The scale grew after 5 clean steps; from then on the gradients were
    # scaled by the old one, and no such step was applied.
    assert int(metrics["skipped_steps"]) == 15
    assert int(metrics["consecutive_skips"]) == 15
    assert not bool(metrics["grads_finite"])
    # The scale is not adjusted by a step judged under another scale.
    assert float(metrics["loss_scale"]) == 2.0**11
    assert int(metrics["growth_tracker"]) == 0


def test_a_stale_scaled_by_skips_too():
    tx = make_tx()
    state = tx.init(PARAMS)
    old = lossscale.get_loss_scale(state)
    scale = lossscale.StaticLossScale(2.0**9)  # not the state's 2**10
    grads = jax.grad(lambda p: scale.scale(loss_fn(p, X, Y)))(PARAMS)
    updates, new = jax.jit(tx.update)(grads, state, PARAMS, scaled_by=scale)
    assert not bool(new.grads_finite) and int(new.skipped_steps) == 1
    assert float(jnp.abs(updates["w"]).max()) == 0.0
    assert float(new.loss_scale.loss_scale) == float(old.loss_scale)
    # Control: the right scale (or its bare value) is applied.
    for right in (old, old.loss_scale):
        _, new = jax.jit(tx.update)(
            jax.grad(lambda p: old.scale(loss_fn(p, X, Y)))(PARAMS),
            state,
            PARAMS,
            scaled_by=right,
        )
        assert bool(new.grads_finite)


@pytest.mark.standard_promotion
def test_the_skip_on_a_stale_scale_is_bitwise():
    tx = lossscale.loss_scaled(
        optax.adam(1e-2), lossscale.DynamicLossScale(2.0**10)
    )
    state = tx.init(PARAMS)
    stale = lossscale.StaticLossScale(2.0**9)
    grads = jax.grad(lambda p: stale.scale(loss_fn(p, X, Y)))(PARAMS)
    updates, new = jax.jit(tx.update)(grads, state, PARAMS, scaled_by=stale)
    for a, b in zip(
        jax.tree.leaves(new.inner_state),
        jax.tree.leaves(state.inner_state),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.asarray(updates["w"]).tobytes() == bytes(16)


@pytest.mark.standard_promotion
def test_marked_gradients_accumulate_through_multisteps():
    inner = make_tx()
    tx = lossscale.MultiSteps(inner, every_k_schedule=2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(params, X, Y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, state = PARAMS, tx.init(PARAMS)
    for _ in range(4):
        params, state, _ = step(params, state)
    assert int(lossscale.metrics(state)["steps"]) == 2
    assert int(lossscale.metrics(state)["skipped_steps"]) == 0
    with pytest.raises(TypeError, match=r"is an argument of the jax\.jit"):
        jax.jit(tx.update)(jax.grad(loss_fn)(PARAMS, X, Y), state, PARAMS)


def test_groups_take_scaled_by_a_dict():
    tx = lossscale.loss_scaled_by_group(
        optax.sgd(1.0),
        {
            "a": lossscale.StaticLossScale(4.0),
            "b": lossscale.StaticLossScale(8.0),
        },
        param_labels={"a": "a", "b": "b"},
    )
    params = {"a": jnp.ones(()), "b": jnp.ones(())}
    state = tx.init(params)
    scales = lossscale.get_loss_scale(state)
    grads = {"a": jnp.float32(4.0), "b": jnp.float32(8.0)}
    updates, new = tx.update(grads, state, params, scaled_by=scales)
    assert bool(new.grads_finite) and float(updates["b"]) == -1.0
    with pytest.raises(TypeError, match="dict from group label"):
        tx.update(grads, state, params, scaled_by=scales["a"])
    with pytest.raises(ValueError, match="every group"):
        tx.update(grads, state, params, scaled_by={"a": scales["a"]})
    with pytest.raises(TypeError, match="is not one"):
        tx.update(grads, state, params)


# --- slip 3: replicas that drift --------------------------------------------


def _pmap_is_untracked():
    # pmap is a shard_map without varying-value tracking on newer JAX;
    # on the older one nothing tells a pmap axis from a vmap one.
    seen = []

    def probe(x):
        seen.append(_compat.unchecked_manual_axes())
        return x

    jax.pmap(probe, axis_name="batch")(jnp.zeros((2,)))
    return "batch" in seen[0]


@pytest.mark.skipif(
    not _pmap_is_untracked(), reason="this JAX's pmap is not a shard_map"
)
@pytest.mark.parametrize("average", [False, True], ids=["slip", "control"])
def test_pmap_gradients_never_averaged_are_refused(average):
    n = 2
    tx = make_tx(axis_name="batch")

    def step(params, opt_state, x, y):
        kwargs = {"axis_name": "batch"} if average else {}
        _, grads = lossscale.value_and_grad(loss_fn, opt_state, **kwargs)(
            params, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    replicate = lambda t: jax.tree.map(lambda a: jnp.stack([a] * n), t)
    params, state = replicate(PARAMS), replicate(tx.init(PARAMS))
    xs, ys = X.reshape(n, 16, 4), Y.reshape(n, 16, 1)
    pstep = jax.pmap(step, axis_name="batch")
    if not average:
        with pytest.raises(ValueError, match="did not average over"):
            pstep(params, state, xs, ys)
        return
    for _ in range(5):
        params, state = pstep(params, state, xs, ys)
    w = np.asarray(params["w"])
    assert np.array_equal(w[0], w[1]) and not np.array_equal(w[0], 0 * w[0])


# --- clearer errors ------------------------------------------------------


def test_aux_without_has_aux_names_has_aux():
    state = make_tx().init(PARAMS)
    with_aux = lambda p, x, y: (loss_fn(p, x, y), {"n": 3})
    with pytest.raises(TypeError, match="has_aux=True"):
        lossscale.value_and_grad(with_aux, state)(PARAMS, X, Y)


def test_gradients_of_another_structure_name_both():
    tx = make_tx(require_scaled_by=False)
    state = tx.init(PARAMS)
    with pytest.raises(ValueError, match=r"\{'v': \*\}.*\{'w': \*\}"):
        tx.update({"v": jnp.ones((4, 1))}, state, PARAMS)


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("period", "growth_interval"),
        ("factor", "growth_factor and backoff_factor"),
        ("counter", "growth_tracker"),
        ("minimum_scale", "min_loss_scale"),
        ("fin_steps", "growth_tracker"),
        ("scale", "loss_scale"),
        ("init_scale", "loss_scale"),
    ],
)
def test_other_libraries_names_are_translated(name, ours):
    with pytest.raises(TypeError, match=f"{name!r}: its name here is {ours}"):
        lossscale.DynamicLossScale(**{name: 10})


def test_value_and_grad_takes_opt_state():
    params = inspect.signature(lossscale.value_and_grad).parameters
    assert list(params)[:2] == ["fun", "opt_state"]
    with pytest.raises(TypeError, match="opt_state must be"):
        lossscale.value_and_grad(loss_fn, {"w": 1.0})


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_axis_name_outside_a_mapped_context(jit):
    state = make_tx().init(PARAMS)
    f = lossscale.value_and_grad(loss_fn, state, axis_name="batch")
    f = jax.jit(f) if jit else f
    with pytest.raises(ValueError, match="not mapped here"):
        f(PARAMS, X, Y)
