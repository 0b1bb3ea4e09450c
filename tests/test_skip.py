"""The branch-free skip: exact semantics, and no state copy in the program.

The copy-free property is what makes the default skip cheap; it is checked
on XLA's compiled program (copies and temporary bytes), which is exact and
machine-independent, never by timing.
"""

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from lossscale import _compat, _skip
from tests.helpers import assert_trees_bitwise_equal, loss_scaled

pytestmark = pytest.mark.standard_promotion


class OddState(NamedTuple):
    trace: jax.Array  # also returned as the updates
    kept: jax.Array  # passed through unchanged
    twin_a: jax.Array  # twin_a and twin_b get the same new value
    twin_b: jax.Array
    const: jax.Array  # set to a literal
    count: jax.Array  # int32, read by the updates


def odd_optimizer():
    """An inner optimizer whose state exercises every substitution case."""

    def init(params):
        return OddState(
            trace=jnp.zeros_like(params),
            kept=jnp.full_like(params, 7.0),
            twin_a=jnp.ones_like(params),
            twin_b=jnp.full_like(params, 2.0),
            const=jnp.zeros((), jnp.float32),
            count=jnp.zeros((), jnp.int32),
        )

    def update(grads, state, params=None):
        del params
        trace = 0.5 * state.trace + grads
        twin = state.twin_a + state.twin_b + grads
        count = state.count + 1
        new = OddState(
            trace=trace,
            kept=state.kept,
            twin_a=twin,
            twin_b=twin,
            const=jnp.float32(3.0),
            count=count,
        )
        # The updates read new state values (trace, count): the case the
        # substitution exists for.
        return trace * count.astype(jnp.float32), new

    return optax.GradientTransformation(init, update)


def reference(grads, state):
    trace = 0.5 * np.asarray(state.trace) + grads
    twin = np.asarray(state.twin_a) + np.asarray(state.twin_b) + grads
    count = int(state.count) + 1
    return trace * np.float32(count), (trace, twin, count)


@pytest.mark.parametrize("impl", ["select", "cond"])
def test_every_kind_of_state_leaf(impl):
    tx = loss_scaled(
        odd_optimizer(),
        lossscale.StaticLossScale(4.0),
        impl=impl,
        require_scaled_by=False,
    )
    params = jnp.zeros(3, jnp.float32)
    state = tx.init(params)
    step = jax.jit(tx.update)

    grads = np.array([4.0, 8.0, -4.0], np.float32)  # unscaled: 1, 2, -1
    want_u, (trace, twin, count) = reference(grads / 4, state.inner_state)
    u, state = step(jnp.asarray(grads), state, params)
    inner = state.inner_state
    np.testing.assert_array_equal(u, want_u)
    np.testing.assert_array_equal(inner.trace, trace)
    np.testing.assert_array_equal(inner.kept, np.full(3, 7.0))
    np.testing.assert_array_equal(inner.twin_a, twin)
    np.testing.assert_array_equal(inner.twin_b, twin)
    assert float(inner.const) == 3.0 and int(inner.count) == count == 1

    before = jax.tree.map(np.asarray, state.inner_state)
    bad = jnp.asarray(grads).at[1].set(jnp.nan)
    u, state = step(bad, state, params)
    assert not bool(state.grads_finite)
    np.testing.assert_array_equal(u, np.zeros(3))
    assert not np.signbit(np.asarray(u)).any()  # +0.0, not -0.0
    for got, old in zip(
        jax.tree.leaves(state.inner_state), jax.tree.leaves(before), strict=True
    ):
        assert got.dtype == old.dtype
        np.testing.assert_array_equal(got, old)


def test_select_update_zero_updates_keep_dtype():
    def update():
        return (
            {"a": jnp.ones(2, jnp.bfloat16), "b": jnp.int32(5)},
            (jnp.float32(1.0),),
        )

    u, s = jax.jit(
        lambda f: _skip.select_update(f, update, (jnp.float32(9.0),))
    )(jnp.bool_(False))
    assert u["a"].dtype == jnp.bfloat16 and u["a"].tolist() == [0.0, 0.0]
    assert u["b"].dtype == jnp.int32 and int(u["b"]) == 0
    assert float(s[0]) == 9.0


def test_state_structure_mismatch_is_an_error():
    def update():
        return jnp.ones(2), (jnp.ones(2), jnp.ones(2))

    with pytest.raises(ValueError, match="structure"):
        _skip.select_update(jnp.bool_(True), update, (jnp.ones(2),))


def test_state_shape_mismatch_is_an_error():
    def update():
        return jnp.ones(2), (jnp.ones(3),)

    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(2,\)"):
        _skip.select_update(jnp.bool_(True), update, (jnp.ones(2),))


# --- the compiled program ---------------------------------------------------

SIZE = 1 << 16  # elements per leaf
LEAVES = 4


def problem():
    params = {
        f"w{i}": jnp.full((SIZE,), 0.5, jnp.float32) for i in range(LEAVES)
    }
    return params, jax.tree.map(lambda p: p * 2.0**10, params)


def compiled_step(update_fn, init_fn):
    params, grads = problem()

    def step(params, state, grads):
        updates, state = update_fn(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = init_fn(params)
    compiled = (
        jax.jit(step, donate_argnums=(0, 1))
        .lower(params, state, grads)
        .compile()
    )
    leaf_copies = len(
        re.findall(rf"f32\[{SIZE}\]\{{0\}} copy\(", compiled.as_text())
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    return leaf_copies, temp / (LEAVES * SIZE * 4)


def naive_select(inner):
    """The textbook select (jmp, flax): new-if-finite-else-old afterwards."""

    def update(grads, state, params):
        finite = lossscale.all_finite(grads)
        updates, new = inner.update(grads, state, params)
        return lossscale.select_tree(
            finite,
            (updates, new),
            (jax.tree.map(jnp.zeros_like, updates), state),
        )

    return update


def test_default_skip_copies_no_state_and_adds_no_buffer():
    inner = optax.adam(1e-3)
    tx = lossscale.loss_scaled(
        inner, lossscale.DynamicLossScale(), require_scaled_by=False
    )
    copies, temp = compiled_step(tx.update, tx.init)
    assert copies == 0
    # Only the finiteness check's per-block flags: 1/16 byte per element.
    assert temp < 0.03

    # Negative controls: the same program written the textbook way copies
    # Adam's state, and the conditional materialises the updates.
    copies, temp = compiled_step(naive_select(inner), inner.init)
    assert copies >= LEAVES
    cond = loss_scaled(
        inner,
        lossscale.DynamicLossScale(),
        impl="cond",
        require_scaled_by=False,
    )
    copies, temp = compiled_step(cond.update, cond.init)
    assert temp >= 1.0


def hlo_size(leaves: int) -> int:
    params = {f"w{i:03d}": jnp.ones(64, jnp.float32) for i in range(leaves)}
    tx = lossscale.loss_scaled(
        optax.adam(1e-3), lossscale.DynamicLossScale(), require_scaled_by=False
    )

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    compiled = jax.jit(step).lower(params, tx.init(params), params).compile()
    return compiled.as_text().count("\n")


def test_program_grows_linearly_with_leaves():
    """A guard: compile time follows program size, which must stay linear.

    An early version of this skip let XLA fuse a copy of the per-leaf
    finiteness conjunction into every per-leaf select: quadratic in the
    number of leaves, minutes of compile time at 500.
    """
    small, large = hlo_size(40), hlo_size(80)
    assert 1.8 < large / small < 2.2


ZOO = {
    # Every optax alias that takes gradients alone.
    "adabelief": lambda: optax.adabelief(1e-2),
    "adadelta": lambda: optax.adadelta(1e-1),
    "adafactor": lambda: optax.adafactor(1e-2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adam": lambda: optax.adam(1e-2),
    "adamax": lambda: optax.adamax(1e-2),
    "adamaxw": lambda: optax.adamaxw(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "adan": lambda: optax.adan(1e-2),
    "amsgrad": lambda: optax.amsgrad(1e-2),
    "fromage": lambda: optax.fromage(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    "lars": lambda: optax.lars(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "nadam": lambda: optax.nadam(1e-2),
    "nadamw": lambda: optax.nadamw(1e-2),
    "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=0),
    "novograd": lambda: optax.novograd(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2, momentum=0.9),
    "rprop": lambda: optax.rprop(1e-2),
    "sgd": lambda: optax.sgd(1e-2),
    "nesterov": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "sign_sgd": lambda: optax.sign_sgd(1e-2),
    "sm3": lambda: optax.sm3(1e-2),
    "yogi": lambda: optax.yogi(1e-2),
    # Chains and wrappers.
    "clip+adam": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(1e-2)
    ),
    "clip_by_block_rms+sgd": lambda: optax.chain(
        optax.clip_by_block_rms(1.0), optax.clip(2.0), optax.sgd(1e-1)
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)
    ),
    "multi_transform": lambda: optax.multi_transform(
        {"a": optax.adam(1e-2), "b": optax.sgd(1e-1)},
        {"w": "a", "b": "b"},
    ),
    "accumulate": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    # A few of optax.contrib.
    "ademamix": lambda: optax.contrib.ademamix(1e-2),
    "cocob": lambda: optax.contrib.cocob(),
    "dadapt_adamw": lambda: optax.contrib.dadapt_adamw(),
    "prodigy": lambda: optax.contrib.prodigy(),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
}
if hasattr(optax, "signum"):  # optax >= 0.2.7
    ZOO["signum"] = lambda: optax.signum(1e-2)
if hasattr(optax.contrib, "muon"):
    ZOO["muon"] = lambda: optax.contrib.muon(1e-2)


def host(tree):
    """A copy on the host (PRNG keys as their raw data)."""

    def leaf(x):
        if jnp.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return jax.tree.map(leaf, tree)


# The optimizers every quick run (-m "not slow") checks; the rest of the zoo
# runs in the full suite.
QUICK_ZOO = {"adafactor", "adam", "clip+adam", "lion", "nesterov", "sgd"}


def zoo_params():
    return [
        pytest.param(name, marks=() if name in QUICK_ZOO else pytest.mark.slow)
        for name in sorted(ZOO)
    ]


def zoo_grads(params, rng):
    return jax.tree.map(
        lambda p: jnp.asarray(rng.normal(size=p.shape) * 64, p.dtype), params
    )


@pytest.mark.parametrize("name", zoo_params())
def test_optax_zoo(name):
    """Finite steps are plain optax's; a skipped step changes nothing.

    Plain optax runs on the true gradients, lossscale on the same gradients
    scaled by 64 (exactly, a power of two). Finite steps agree to float32
    rounding (the programs fuse the same arithmetic differently); the
    skipped step leaves parameters and state bitwise as they were, with
    either skip. The conditional agrees with the default select.
    """
    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32),
        "b": jnp.asarray(rng.normal(size=(5,)), jnp.float32),
    }
    grads = [zoo_grads(params, rng) for _ in range(5)]
    grads[2]["w"] = grads[2]["w"].at[1, 1].set(jnp.inf)

    inner = ZOO[name]()

    @jax.jit
    def plain_step(p, s, g):
        u, s = inner.update(jax.tree.map(lambda x: x / 64, g), s, p)
        return optax.apply_updates(p, u), s

    p, s, plain = params, inner.init(params), []
    for i, g in enumerate(grads):
        if i != 2:  # plain optax never sees the bad step
            p, s = plain_step(p, s, g)
        plain.append(host((p, s)))

    runs = {}
    for impl in ("select", "cond"):
        tx = loss_scaled(
            ZOO[name](),
            lossscale.StaticLossScale(64.0),
            impl=impl,
            require_scaled_by=False,
        )

        @jax.jit
        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        p, s, trail = params, tx.init(params), []
        for i, g in enumerate(grads):
            before = host((p, s.inner_state))
            p, s = step(p, s, g)
            after = host((p, s.inner_state))
            if i == 2:
                assert not bool(s.grads_finite)
                assert_trees_bitwise_equal(after, before)
            trail.append(after)
        runs[impl] = trail
    for ours, cond, want in zip(
        runs["select"], runs["cond"], plain, strict=True
    ):
        for x, y, z in zip(
            jax.tree.leaves(ours),
            jax.tree.leaves(cond),
            jax.tree.leaves(want),
            strict=True,
        ):
            np.testing.assert_allclose(x, z, rtol=2e-6, atol=1e-7)
            np.testing.assert_allclose(y, z, rtol=2e-6, atol=1e-7)
    # Control: the steps did change the parameters.
    assert not np.allclose(runs["select"][-1][0]["w"], params["w"])


# On CPU the default skip adds no temporary buffer to an optimizer whose
# update is elementwise per leaf (the adam family, sgd and momentum,
# rmsprop, lion, ...). Where the update reduces over each leaf before using
# it (adafactor, lamb, lars, novograd, prodigy, sm3, clipping by block RMS)
# or accumulates (MultiSteps), XLA's scheduler orders the program
# differently with the selects in it, sometimes keeping a gradient-sized
# value alive longer than plain optax does, sometimes shorter: measured on
# jax 0.7 and 0.10, up to this many parameter-sized buffers more. The
# conditional skip is no better for any of them: it materialises the
# updates, one buffer more than plain optax for every optimizer.
MORE_BUFFERS = {
    "accumulate": 1.0,
    "adafactor": 1.0,
    "clip_by_block_rms+sgd": 1.0,
    "dadapt_adamw": 0.5,
    "lamb": 1.0,
    "lars": 1.0,
    "novograd": 2.0,
    "prodigy": 1.0,
    "sm3": 0.05,
}


@pytest.mark.parametrize("name", zoo_params())
def test_optax_zoo_temp_memory(name):
    """The default skip adds no temporary buffer to plain optax's program.

    XLA's buffer analysis of the compiled, donated step is deterministic.
    Plain optax is given the true gradients; the check's flags may add a
    few bytes. MORE_BUFFERS lists the exceptions and their bounds.
    """
    params = {f"w{i}": jnp.full((256, 256), 0.5) for i in range(4)}
    params["b"] = jnp.ones(256)
    if name == "multi_transform":
        params = {"w": params["w0"], "b": params["b"]}
    size = sum(x.nbytes for x in jax.tree.leaves(params))

    def temp(update, init, grads):
        def step(p, s, g):
            u, s = update(g, s, p)
            return optax.apply_updates(p, u), s

        compiled = (
            jax.jit(step, donate_argnums=(0, 1))
            .lower(params, init(params), grads)
            .compile()
        )
        return compiled.memory_analysis().temp_size_in_bytes / size

    inner = ZOO[name]()
    plain = temp(inner.update, inner.init, params)
    tx = lossscale.loss_scaled(
        ZOO[name](), lossscale.StaticLossScale(64.0), require_scaled_by=False
    )
    ours = temp(tx.update, tx.init, jax.tree.map(lambda p: p * 64.0, params))
    allowed = plain + 0.01 + MORE_BUFFERS.get(name, 0.0)
    assert ours <= allowed, (ours, plain)


def test_falls_back_to_the_conditional_if_jax_internals_change(monkeypatch):
    """A JAX whose jaxpr internals moved degrades to the conditional, loudly."""
    params = {"w": jnp.arange(3.0)}
    grads = {"w": jnp.array([64.0, -128.0, 32.0])}
    ls = lossscale.StaticLossScale(64.0)
    cond = loss_scaled(
        optax.adam(0.1), ls, impl="cond", require_scaled_by=False
    )
    want_u, want_s = jax.jit(cond.update)(grads, cond.init(params), params)

    def moved(eqn, invals):
        raise AttributeError("'JaxprEqn' object has no attribute 'params'")

    monkeypatch.setattr(_compat, "bind_equation", moved)
    tx = lossscale.loss_scaled(optax.adam(0.1), ls, require_scaled_by=False)
    with pytest.warns(RuntimeWarning, match="copy-free skip"):
        u, s = jax.jit(tx.update)(grads, tx.init(params), params)
    np.testing.assert_array_equal(u["w"], want_u["w"])
    np.testing.assert_array_equal(
        s.inner_state[0].mu["w"], want_s.inner_state[0].mu["w"]
    )


def test_errors_of_the_inner_update_are_not_taken_for_jax_changes():
    """A wrong call still fails as itself (no fallback, no warning)."""
    tx = lossscale.loss_scaled(
        optax.adam(0.1), lossscale.StaticLossScale(2.0), require_scaled_by=False
    )
    state = tx.init({"w": jnp.ones(3)})
    grads = {"w": jnp.ones(3), "extra": jnp.ones(2)}
    with pytest.raises((ValueError, TypeError)) as info:
        jax.jit(tx.update)(grads, state)
    assert "inner optimizer's update failed" in " ".join(
        getattr(info.value, "__notes__", [])
    )
