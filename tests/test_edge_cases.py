"""Options meeting optimizers whose params are not the gradients' shape, an
axis_name with no mapped axis, export, nonfinite_paths in multi_transform,
and the smaller argument rules."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale

S = 2.0**8


def lookahead_params():
    return optax.LookaheadParams.init_synced(
        {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    )


LOOKAHEAD_OPTIONS = {
    "mask_tree": lambda ls: lossscale.loss_scaled(
        optax.lookahead(optax.sgd(1.0), 2, 0.5),
        ls,
        mask={"w": True, "b": False},
        require_scaled_by=False,
    ),
    "mask_callable": lambda ls: lossscale.loss_scaled(
        optax.lookahead(optax.sgd(1.0), 2, 0.5),
        ls,
        mask=lambda g: {"w": True, "b": False},
        require_scaled_by=False,
    ),
    "param_labels_tree": lambda ls: lossscale.loss_scaled_by_group(
        optax.lookahead(optax.sgd(1.0), 2, 0.5),
        {"x": ls, "y": ls},
        param_labels={"w": "x", "b": "y"},
        require_scaled_by=False,
    ),
    "report_nonfinite": lambda ls: lossscale.loss_scaled(
        optax.lookahead(optax.sgd(1.0), 2, 0.5),
        ls,
        report_nonfinite=True,
        require_scaled_by=False,
    ),
}
SCALES = {
    "noop": lambda: lossscale.NoOpLossScale(),
    "static": lambda: lossscale.StaticLossScale(S),
    "dynamic": lambda: lossscale.DynamicLossScale(S, growth_interval=3),
}


@pytest.mark.standard_promotion  # optax.lookahead mixes float and bool
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("option", LOOKAHEAD_OPTIONS)
def test_lookahead_with_options(option, scale):
    tx = LOOKAHEAD_OPTIONS[option](SCALES[scale]())
    params = lookahead_params()
    state = tx.init(params)
    s = 1.0 if scale == "noop" else S
    good = {"w": jnp.array([1.0, 2.0, 3.0]) * s, "b": jnp.ones(2) * s}
    updates, state = jax.jit(tx.update)(good, state, params)
    assert bool(state.grads_finite)
    # Lookahead's fast updates are the sgd steps; "b" unmasked (or its own
    # group): unscaled too, except where the mask leaves it scaled.
    want_b = -s * np.ones(2) if option.startswith("mask") else -np.ones(2)
    np.testing.assert_array_equal(updates.fast["w"], [-1.0, -2.0, -3.0])
    np.testing.assert_array_equal(updates.fast["b"], want_b)
    bad = {"w": jnp.array([1.0, jnp.inf, 3.0]), "b": jnp.ones(2)}
    updates, state = jax.jit(tx.update)(bad, state, params)
    assert not bool(state.grads_finite)
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(updates))
    if option == "report_nonfinite":
        assert lossscale.nonfinite_paths(state, params) == ["['w']"]
        assert lossscale.nonfinite_paths(state, params.fast) == ["['w']"]


@pytest.mark.standard_promotion
def test_lookahead_mask_mismatch_names_the_params():
    tx = lossscale.loss_scaled(
        optax.lookahead(optax.sgd(1.0), 2, 0.5),
        lossscale.NoOpLossScale(),
        mask={"w": True, "c": False},
        require_scaled_by=False,
    )
    with pytest.raises(ValueError, match="params with structure") as info:
        tx.init(lookahead_params())
    assert "for gradients with" not in str(info.value)


def test_report_size_error_does_not_call_params_the_gradients():
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.NoOpLossScale(),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    state = tx.init({"a": jnp.ones(1), "b": jnp.ones(1), "c": jnp.ones(1)})
    with pytest.raises(ValueError, match="sizes it from the params"):
        tx.update({"a": jnp.ones(1)}, state)


# --- axis_name where no axis is mapped ---------------------------------


def test_all_finite_axis_name_eager_and_jit():
    x = jnp.ones(3)
    with pytest.raises(ValueError, match="axis_name='i' names an axis"):
        lossscale.all_finite(x, axis_name="i")
    with pytest.raises(ValueError, match=r"axis_name=\('i', 'j'\)"):
        jax.jit(lambda x: lossscale.all_finite(x, axis_name=("i", "j")))(x)


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_update_axis_name_without_a_mapped_axis(jit):
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.StaticLossScale(S),
        axis_name="batch",
        require_scaled_by=False,
    )
    params = jnp.ones(2)
    update = jax.jit(tx.update) if jit else tx.update
    with pytest.raises(ValueError, match="pass axis_name=None"):
        update(params * S, tx.init(params), params)


def test_axis_name_under_vmap_still_works():
    # The negative control: a mapped axis is not refused.
    x = jnp.array([[1.0, 2.0], [1.0, jnp.inf]])
    out = jax.vmap(
        lambda r: lossscale.all_finite(r, axis_name="i"), axis_name="i"
    )(x)
    np.testing.assert_array_equal(out, [False, False])


# --- jax.export and on_min_scale -----------------------------------------


def _export(on_min_scale):
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.StaticLossScale(S),
        on_min_scale=on_min_scale,
        require_scaled_by=False,
    )
    params = jnp.ones(2)
    state = tx.init(params)
    step = jax.jit(lambda g, s: tx.update(g, s, params))
    from jax import export  # a submodule to import on jax 0.7

    return export.export(step)(params, state), state


def test_export_with_on_min_scale_error_fails_as_documented():
    with pytest.raises(NotImplementedError, match="host_callback"):
        _export("error")


@pytest.mark.parametrize("on_min_scale", ["ignore", "count"])
def test_export_friendly_forms(on_min_scale):
    exported, state = _export(on_min_scale)
    bad = jnp.array([jnp.inf, 1.0])
    for _ in range(3):
        _, state = exported.call(bad, state)
    m = lossscale.metrics(state)
    assert int(m["consecutive_skips"]) == 3
    if on_min_scale == "count":
        assert int(m["min_scale_skips"]) == 3  # the host decides to stop
    else:
        assert "min_scale_skips" not in m


def test_count_never_raises_and_counts_like_error():
    def run(on_min_scale, n):
        tx = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.DynamicLossScale(2.0, min_loss_scale=1.0),
            on_min_scale=on_min_scale,
            min_scale_patience=3,
            require_scaled_by=False,
        )
        state = tx.init(jnp.ones(1))
        counts = []
        for g in [jnp.inf] * n:
            _, state = jax.jit(tx.update)(jnp.array([g]), state)
            counts.append(int(state.min_scale_skips))
        return counts

    # Step 1 backs off from 2 to the minimum 1; then the skips count.
    assert run("count", 6) == [0, 1, 2, 3, 4, 5]
    assert run("error", 3) == [0, 1, 2]
    with pytest.raises(Exception, match="consecutive steps"):
        run("error", 4)


# --- nonfinite_paths for per-group wrappers in multi_transform -----------


def test_nonfinite_paths_in_multi_transform_with_the_params():
    params = {"enc": {"w": jnp.ones(2)}, "dec": {"w": jnp.ones(3)}}
    labels = {"enc": {"w": "enc"}, "dec": {"w": "dec"}}
    wrap = lambda s: lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.StaticLossScale(s),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    tx = optax.multi_transform({"enc": wrap(4.0), "dec": wrap(8.0)}, labels)
    state = tx.init(params)
    grads = {
        "enc": {"w": jnp.ones(2)},
        "dec": {"w": jnp.array([1.0, jnp.inf, 1.0])},
    }
    _, state = tx.update(grads, state, params)
    for group, want in (("enc", []), ("dec", ["['dec']['w']"])):
        sub = state.inner_states[group]
        mask = jax.tree.map(lambda label, g=group: label == g, labels)
        assert lossscale.nonfinite_paths(sub, params, mask=mask) == want
        as_callable = lambda p, m=mask: m
        assert lossscale.nonfinite_paths(sub, params, mask=as_callable) == want
    # Without the mask the error says what to pass.
    with pytest.raises(ValueError, match=r"mask=jax\.tree\.map"):
        lossscale.nonfinite_paths(state.inner_states["dec"], params)
    with pytest.raises(ValueError, match="mask must have the structure"):
        lossscale.nonfinite_paths(
            state.inner_states["dec"], params, mask={"x": True}
        )


# --- the smaller argument rules -------------------------------------------


def test_dataclasses_replace_is_validated():
    ls = lossscale.DynamicLossScale(8.0, growth_interval=5, hysteresis=2)
    new = dataclasses.replace(ls, loss_scale=4.0)
    assert float(new.loss_scale) == 4.0
    assert new.growth_interval == 5 and new.hysteresis == 2
    assert int(new.hysteresis_tracker) == 2
    moved = dataclasses.replace(ls, growth_tracker=3, hysteresis_tracker=1)
    assert int(moved.growth_tracker) == 3
    with pytest.raises(ValueError, match="loss_scale must be in"):
        dataclasses.replace(ls, loss_scale=0.5)
    with pytest.raises(ValueError, match=r"growth_tracker must be in \[0, 4\]"):
        dataclasses.replace(ls, growth_tracker=5)
    with pytest.raises(ValueError, match="hysteresis_tracker"):
        dataclasses.replace(ls, hysteresis_tracker=3)
    with pytest.raises(TypeError, match="growth_tracker must be an integer"):
        dataclasses.replace(ls, growth_tracker=1.0)
    # Under jit the leaves are traced: clamped, not checked.
    out = jax.jit(lambda s, n: dataclasses.replace(s, growth_tracker=n))(
        ls, jnp.int32(99)
    )
    assert int(out.growth_tracker) == 4


def test_integer_config_of_any_array_type():
    for value in (5, np.int64(5), np.int32(5), jnp.int32(5), np.array(5)):
        ls = lossscale.DynamicLossScale(growth_interval=value, hysteresis=value)
        assert ls.growth_interval == 5 and type(ls.growth_interval) is int
        assert ls.hysteresis == 5
    for bad in (jnp.float32(5.0), 5.0, True, jnp.bool_(True)):
        with pytest.raises(TypeError, match="growth_interval"):
            lossscale.DynamicLossScale(growth_interval=bad)
    with pytest.raises(ValueError, match="scalar"):
        lossscale.DynamicLossScale(growth_interval=jnp.array([5]))
    with pytest.raises(TypeError, match="traced"):
        jax.jit(lambda n: lossscale.DynamicLossScale(growth_interval=n))(5)
    # Floats: any concrete real scalar, jax's too.
    ls = lossscale.DynamicLossScale(growth_factor=jnp.float32(3.0))
    assert ls.growth_factor == 3.0 and type(ls.growth_factor) is float
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.NoOpLossScale(),
        on_min_scale="error", min_scale_patience=jnp.int32(4),
    )  # fmt: skip
    assert tx is not None


def test_diagnose_names_scales():
    with pytest.raises(TypeError, match="scales must be"):
        lossscale.diagnose(lambda p: jnp.sum(p), jnp.ones(2), scales="abc")
    with pytest.raises(TypeError, match="scales="):
        lossscale.diagnose(lambda p: jnp.sum(p), jnp.ones(2), scales=[object()])


@pytest.mark.parametrize("leaf", ["abc", object(), b"x"])
def test_all_finite_refuses_non_array_leaves(leaf):
    with pytest.raises(TypeError, match="all_finite takes a pytree of arrays"):
        lossscale.all_finite({"a": jnp.ones(2), "b": leaf})


def test_all_finite_still_takes_numbers_keys_and_none():
    tree = {
        "f": 1.5,
        "i": 3,
        "b": True,
        "key": jax.random.key(0),
        "old_key": jax.random.PRNGKey(0),
        "none": None,
        "x": np.ones(2, np.float16),
    }
    assert bool(lossscale.all_finite(tree))
    assert not bool(lossscale.all_finite({**tree, "f": float("inf")}))
