"""Float8 matmuls through ``lossscale.autocast(f, lossscale.Float8(...))``.

The kernel alone (numerics against numpy, residuals, shard_map and an
explicit mesh on ``_fp8.dot_general`` itself) is tested in
``test_fp8_kernel.py``; here the feature is used as a user would: a model
written in float32, wrapped once, differentiated with ``jax.grad``,
trained with ``lossscale.loss_scaled``. Dtypes are read from the jaxprs
of the gradients (recursively, through ``jit``, ``scan``, ``checkpoint``,
``shard_map`` and ``custom_vjp``), values against float32's.

Shapes are multiples of 16 (the default eligibility) and small: a batch
of 32 rows of 64 features, layers of 32 and 16.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import Any, cast

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import lossscale
from lossscale import _compat
from tests.helpers import (
    assert_trees_bitwise_equal,
    equations,
    explicit_mesh,
    operand_dtypes,
    set_mesh,
)

E4, E5 = "float8_e4m3fn", "float8_e5m2"
F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
FORWARD, BACKWARD = ((E4, E4), "float32"), ((E4, E5), "float32")


def normal(seed, shape, scale=1.0):
    # numpy's generator: no JAX operation to compile for the test data.
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(values, jnp.float32)


def mlp_params(seed=0, sizes=(64, 32, 16)):
    """A two-layer MLP's float32 parameters, scaled as LeCun's init."""
    (n_in, n_hid, n_out) = sizes
    return {
        "w1": normal(seed, (n_in, n_hid), 1 / math.sqrt(n_in)),
        "b1": jnp.zeros((n_hid,), jnp.float32),
        "w2": normal(seed + 1, (n_hid, n_out), 1 / math.sqrt(n_hid)),
    }


def mlp(params, x):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return h @ params["w2"]


def mse(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def batch(seed=2, n=32):
    """Inputs and regression targets of a smooth teacher."""
    x = np.asarray(normal(seed, (n, 64)))
    y = np.sin(x[:, :16]) + 0.5 * x[:, 16:32]
    return jnp.asarray(x), jnp.asarray(y)


def dots(jaxpr):
    """(operand dtypes, sorted, and ``preferred_element_type``) of every
    ``dot_general`` of a jaxpr and of the jaxprs nested in it."""
    return [
        (
            tuple(sorted(np.dtype(v.aval.dtype).name for v in eqn.invars)),
            np.dtype(eqn.params["preferred_element_type"]).name,
        )
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "dot_general"
    ]


def fp8_counts(jaxpr):
    """How many float8 ``dot_general``s of each kind: e4m3 x e4m3 into
    float32 (forward), e5m2 x e4m3 into float32 (backward), any other
    pairing with a float8 operand (none should exist)."""
    counts = collections.Counter()
    for found in dots(jaxpr):
        if found == FORWARD:
            counts["forward"] += 1
        elif found == BACKWARD:
            counts["backward"] += 1
        elif any(name.startswith("float8") for name in found[0]):
            counts["other"] += 1
    return counts


def grad_jaxpr(fun, *args, argnums=0):
    return jax.make_jaxpr(jax.grad(fun, argnums))(*args)


def fp8_expected(recipe, layers):
    """:func:`fp8_counts` of the gradient of ``layers`` float8 layers under
    ``recipe``, read from its row: a forward GEMM each, and each backward
    GEMM the recipe runs in float8 (``"backward"`` where an operand is
    ``e5m2``; the row-wise recipes' ``e4m3`` gradients count as
    ``"forward"``); none for a GEMM in the compute dtype (gw_hp's weight
    gradient)."""
    row = lossscale.Float8(recipe).row
    counts = collections.Counter(forward=layers)
    for g, y in (
        (row.grad_output, row.weight_for_grad_input),
        (row.grad_output_for_grad_weight, row.input_for_grad_weight),
    ):
        if g.dtype is not None:
            kind = (
                "backward" if np.dtype(E5) in (g.dtype, y.dtype) else "forward"
            )
            counts[kind] += layers
    return dict(counts)


def assert_two_float8_layers(fun, *args, recipe="tensorwise"):
    """Both of the MLP's layers run in float8 in ``fun``'s gradient (else a
    test of values could pass without float8), in ``recipe``'s formats."""
    assert fp8_counts(grad_jaxpr(fun, *args)) == fp8_expected(recipe, 2)


# The checks below run in numpy: each JAX operation run eagerly on a new
# shape is compiled first, which costs more than the check.


def relative_error(tree, reference):
    """Global norm of ``tree - reference`` over the global norm of
    ``reference``."""
    leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]
    refs = [np.asarray(x, np.float64) for x in jax.tree.leaves(reference)]
    diff = sum(np.sum((a - b) ** 2) for a, b in zip(leaves, refs, strict=True))
    return float(np.sqrt(diff / sum(np.sum(b**2) for b in refs)))


def all_finite(tree):
    return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def differ(a, b):
    """Whether two arrays differ anywhere."""
    return bool(np.any(np.asarray(a) != np.asarray(b)))


@functools.cache
def fp8_value_and_grad(recipe):
    """The jitted value and gradient of ``autocast(mse, Float8(recipe))``,
    made once (and compiled once per shape) for the tests that share it."""
    f = lossscale.autocast(mse, lossscale.Float8(recipe))
    return jax.jit(jax.value_and_grad(f))


def fp8_grad(recipe, *args):
    return fp8_value_and_grad(recipe)(*args)[1]


float32_value_and_grad = jax.jit(jax.value_and_grad(mse))
bfloat16_value_and_grad = jax.jit(
    jax.value_and_grad(lossscale.autocast(mse, jnp.bfloat16))
)


def slow_but_first(values):
    """pytest params: the first value, then the others marked slow."""
    return [values[0]] + [
        pytest.param(v, marks=pytest.mark.slow) for v in values[1:]
    ]


# --- 1. structure, read from the jaxprs of jax.grad ------------------------


def zoo(params, x):
    """Every kind of matmul the default rule tells apart, in program order:
    two linear layers (float8), attention's two batched einsums, a layer 24
    wide, a convolution, a matmul asking for a float32 result from 16-bit
    operands, one at precision=HIGHEST (all kept out of float8)."""
    h = jnp.tanh(x @ params["w1"])  # (32, 64) @ (64, 32): float8
    q = h.reshape(2, 16, 32)
    scores = jnp.einsum("bqd,bkd->bqk", q, q)  # batched: 16-bit
    att = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), q)  # 16-bit
    h = h + att.reshape(32, 32)
    odd = h @ params["w_odd"]  # N = 24: 16-bit
    image = lax.conv_general_dilated(
        h[None, None], params["kernel"], (1, 1), "SAME"
    )[0, 0]  # a convolution: 16-bit
    wide = jnp.matmul(
        image.astype(jnp.bfloat16),
        params["w2"].astype(jnp.bfloat16),
        preferred_element_type=jnp.float32,
    )  # bfloat16 x bfloat16 -> float32: kept so
    exact = jnp.dot(h, params["w2"], precision=lax.Precision.HIGHEST)
    out = h @ params["w2"]  # (32, 32) @ (32, 16): float8
    return (
        jnp.mean(out**2)
        + jnp.mean(odd**2)
        + jnp.mean(wide**2)
        + jnp.mean(exact**2)
    )


def zoo_params():
    return {
        "w1": normal(0, (64, 32), 1 / 8),
        "w_odd": normal(1, (32, 24), 1 / 6),
        "kernel": normal(2, (1, 1, 3, 3), 1 / 3),
        "w2": normal(3, (32, 16), 1 / 6),
    }


BOTH_DATA = "both operands depend on the data (attention, a Gram matrix)"
ZOO_REPORT = [
    ("float8_e4m3fn", "float8"),
    ("bfloat16", BOTH_DATA),
    ("bfloat16", BOTH_DATA),
    ("bfloat16", "the weight's N=24, K=32 not both multiples of 16"),
    ("bfloat16", "conv_general_dilated does not run in float8"),
    ("bfloat16", "a preferred_element_type wider than its operands"),
    ("float32", "precision above DEFAULT"),
    ("float8_e4m3fn", "float8"),
]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_gradient_jaxpr_float8_where_eligible_16_bit_elsewhere(recipe):
    params, (x, _) = zoo_params(), batch()
    f = lossscale.autocast(zoo, lossscale.Float8(recipe))
    jaxpr = grad_jaxpr(f, params, x)
    found = dots(jaxpr)
    counts = fp8_counts(jaxpr)
    # Two linear layers: each one e4m3 x e4m3 forward matmul accumulating
    # in float32, and two backward ones (its operands' cotangents), each an
    # e5m2 cotangent by an e4m3 operand (tensorwise) or e4m3 by e4m3
    # (rowwise); no e5m2 x e5m2, no other pairing.
    assert counts == fp8_expected(recipe, 2)
    assert ((E5, E5), "float32") not in found
    # Everything else keeps autocast's 16-bit rule, forward and backward:
    # attention's einsums (two forward, four backward) and the layer 24
    # wide (one forward, two backward) in bfloat16 ...
    assert found.count(((BF16.name, BF16.name), BF16.name)) == 9
    assert operand_dtypes(jaxpr, "conv_general_dilated") == [(BF16, BF16)] * 3
    # ... the float32 result asked for from bfloat16 operands stays float32
    # (forward, then its two cotangents from a float32 one) ...
    assert found.count(((BF16.name, BF16.name), "float32")) == 1
    assert found.count((("bfloat16", "float32"), "float32")) == 2
    # ... and precision=HIGHEST stays a float32 matmul at that precision.
    highest = [
        eqn
        for eqn in equations(jaxpr)
        if eqn.primitive.name == "dot_general"
        and _compat.explicit_precision(eqn)
    ]
    assert len(highest) == 3
    for eqn in highest:
        assert {np.dtype(v.aval.dtype) for v in eqn.invars} == {F32}
    assert len(found) == 6 + 9 + 3 + 3
    # lossscale.matmuls lists the forward ones, in program order, agreeing.
    report = lossscale.matmuls(f, params, x)
    assert [(m.dtype, m.why) for m in report] == ZOO_REPORT
    n_float8 = sum(m.dtype == E4 for m in report)
    assert fp8_expected(recipe, n_float8) == counts


def test_gradient_jaxpr_without_float8_is_all_16_bit():
    # The negative control of the test above: a bfloat16 autocast of the
    # same function has no float8 matmul, and the report says why.
    params, (x, _) = zoo_params(), batch()
    f = lossscale.autocast(zoo, jnp.bfloat16)
    assert fp8_counts(grad_jaxpr(f, params, x)) == {}
    report = lossscale.matmuls(f, params, x)
    assert [m.dtype for m in report] == [
        BF16.name if dtype == E4 else dtype for dtype, _ in ZOO_REPORT
    ]
    assert report[0].why == "the compute dtype"


# --- 2. overrides through the rule tables ---------------------------------


def two_layers(params, x):
    """The MLP, its first layer a jitted function named ``layer``."""
    return jnp.mean(layer(x, params["w1"]) @ params["w2"])


@jax.jit
def layer(x, w):
    return jnp.tanh(x @ w)


def test_rules_dot_general_compute_means_no_float8_at_all():
    params, (x, _) = mlp_params(), batch()
    f = lossscale.autocast(
        two_layers, lossscale.Float8(), rules={"dot_general": "compute"}
    )
    found = dots(grad_jaxpr(f, params, x))
    # two forward, and three backward (x is not differentiated)
    assert len(found) == 5
    assert set(found) == {((BF16.name, BF16.name), BF16.name)}
    report = lossscale.matmuls(f, params, x)
    assert [(m.dtype, m.why) for m in report] == [
        ("bfloat16", "rules['dot_general']: 'compute'")
    ] * 2
    # Spelling the default out changes nothing.
    default = lossscale.autocast(
        two_layers, lossscale.Float8(), rules={"dot_general": "float8"}
    )
    assert_two_float8_layers(default, params, x)


def test_function_rules_compute_keeps_a_jitted_function_16_bit():
    params, (x, _) = mlp_params(), batch()
    f = lossscale.autocast(
        two_layers, lossscale.Float8(), function_rules={"layer": "compute"}
    )
    jaxpr = grad_jaxpr(f, params, x)
    # The jitted function's matmuls (its forward one, and the weight's
    # gradient, which JAX computes inside a jit of its own) are bfloat16;
    # the second layer's, outside it, float8.
    inside = [
        dots(eqn.params["jaxpr"])
        for eqn in equations(jaxpr)
        if eqn.params.get("name") == "layer"
    ]
    assert inside and all(
        set(found) == {((BF16.name, BF16.name), BF16.name)} for found in inside
    )
    assert sum(map(len, inside)) == 2
    assert fp8_counts(jaxpr) == {"forward": 1, "backward": 2}
    report = lossscale.matmuls(f, params, x)
    assert [m.dtype for m in report] == [BF16.name, E4]
    # Negative control: the rule "autocast" (the default for a jitted
    # function) leaves its matmul in float8.
    other = lossscale.autocast(
        two_layers, lossscale.Float8(), function_rules={"layer": "autocast"}
    )
    assert_two_float8_layers(other, params, x)


def test_matmuls_says_which_function_rule_kept_a_matmul_16_bit():
    params, (x, _) = mlp_params(), batch()
    f = lossscale.autocast(
        two_layers, lossscale.Float8(), function_rules={"layer": "compute"}
    )
    assert "function_rules" in lossscale.matmuls(f, params, x)[0].why


def test_matmuls_where_names_the_jitted_function():
    params, (x, _) = mlp_params(), batch()
    f = lossscale.autocast(two_layers, lossscale.Float8())
    assert "layer" in lossscale.matmuls(f, params, x)[0].where


def test_float32_scope_keeps_its_matmul_at_traced_dtypes():
    def f(params, x):
        with lossscale.float32_scope():
            h = jnp.tanh(x @ params["w1"])
        return jnp.mean(h @ params["w2"])

    params, (x, _) = mlp_params(), batch()
    auto = lossscale.autocast(f, lossscale.Float8())
    found = dots(grad_jaxpr(auto, params, x))
    # The scoped matmul and its weight's gradient in float32; the other
    # layer in float8 (its input's cotangent included: it flows into the
    # scope).
    assert collections.Counter(found) == {
        ((F32.name, F32.name), F32.name): 2,
        FORWARD: 1,
        BACKWARD: 2,
    }
    report = lossscale.matmuls(auto, params, x)
    assert [(m.dtype, m.why) for m in report] == [
        ("float32", "float32_scope"),
        (E4, "float8"),
    ]


def attention(params, x):
    q = (x @ params["w1"]).reshape(2, 16, 32)
    scores = jnp.einsum("bqd,bkd->bqk", q, q)
    return jnp.mean(jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores), q))


def test_batched_true_runs_attention_in_float8():
    params, (x, _) = mlp_params(), batch()
    default = lossscale.autocast(attention, lossscale.Float8())
    batched = lossscale.autocast(attention, lossscale.Float8(batched=True))
    assert fp8_counts(grad_jaxpr(default, params, x)) == {
        "forward": 1,
        "backward": 2,
    }
    assert fp8_counts(grad_jaxpr(batched, params, x)) == {
        "forward": 3,
        "backward": 6,
    }
    assert [m.dtype for m in lossscale.matmuls(batched, params, x)] == [E4] * 3


def test_multiple_sets_the_sizes_that_run_in_float8():
    # A layer 24 wide: not a multiple of 16, a multiple of 8.
    params, (x, _) = mlp_params(sizes=(64, 24, 16)), batch()

    def f(params, x):
        return jnp.mean(mlp(params, x))

    def counts_of(multiple):
        f8 = lossscale.autocast(f, lossscale.Float8(multiple=multiple))
        return fp8_counts(grad_jaxpr(f8, params, x))

    with pytest.warns(UserWarning, match="ran no float8 matmul.*N=24"):
        counts = {16: counts_of(16)}
    counts[8] = counts_of(8)
    assert counts[16] == {}
    assert counts[8] == {"forward": 2, "backward": 4}
    report = lossscale.matmuls(
        lossscale.autocast(f, lossscale.Float8()), params, x
    )
    assert [m.why for m in report] == [
        "the weight's N=24, K=64 not both multiples of 16",
        "the weight's N=16, K=24 not both multiples of 16",
    ]


def test_float8_rule_needs_a_recipe_and_a_dot_general():
    with pytest.raises(ValueError, match=r"rules\['dot_general'\]"):
        lossscale.autocast(mse, jnp.bfloat16, rules={"dot_general": "float8"})
    for compute_dtype in (jnp.bfloat16, lossscale.Float8()):
        with pytest.raises(
            ValueError, match=r"rules\['conv_general_dilated'\]"
        ):
            lossscale.autocast(
                mse, compute_dtype, rules={"conv_general_dilated": "float8"}
            )


# --- 3. non-finite values are never hidden --------------------------------


def corrupt(array, bad, where=(3, 5)):
    array = np.array(array)
    array[where] = bad
    return jnp.asarray(array)


@pytest.mark.parametrize("recipe", slow_but_first(["tensorwise", "rowwise"]))
def test_inf_or_nan_in_input_or_target_gives_non_finite_gradients(recipe):
    # A non-finite input reaches the forward float8 matmul; a non-finite
    # target reaches only the backward ones, through the loss's cotangent.
    # Quantisation must keep it non-finite (no clip to 448 or 57344, no
    # "keep the previous scale" guard): wherever float32's gradient is
    # inf or NaN, so is float8's (float8 spreads a non-finite value
    # further: a per-tensor scale of 0 or NaN reaches every element).
    params, (x, y) = mlp_params(), batch()
    grad = functools.partial(fp8_grad, recipe)
    f = lossscale.autocast(mse, lossscale.Float8(recipe))
    assert_two_float8_layers(f, params, x, y, recipe=recipe)

    def reference(*args):
        return float32_value_and_grad(*args)[1]

    assert all_finite(grad(params, x, y))  # the negative control
    for bad in (np.inf, -np.inf, np.nan):
        for args in ((corrupt(x, bad), y), (x, corrupt(y, bad))):
            got, expected = grad(params, *args), reference(params, *args)
            assert not all_finite(expected)  # the premise
            assert not all_finite(got), bad
            pairs = zip(
                jax.tree.leaves(got), jax.tree.leaves(expected), strict=True
            )
            for a, b in pairs:
                assert not np.any(np.isfinite(a) & ~np.isfinite(b)), bad


def scanned_loss(params, x, y):
    """Layers stacked along a leading axis, run by lax.scan."""

    def body(h, w):
        return jnp.tanh(h @ w), None

    h, _ = lax.scan(body, x @ params["w_in"], params["ws"])
    return jnp.mean((h @ params["w_out"] - y) ** 2)


def scanned_params():
    return {
        "w_in": normal(0, (64, 32), 1 / 8),
        "ws": normal(1, (2, 32, 32), 1 / math.sqrt(32)),
        "w_out": normal(2, (32, 16), 1 / math.sqrt(32)),
    }


def checkpointed_loss(params, x, y):
    h = jax.checkpoint(lambda x, w, b: jnp.tanh(x @ w + b))(
        x, params["w1"], params["b1"]
    )
    out = jax.checkpoint(lambda h, w: h @ w)(h, params["w2"])
    return jnp.mean((out - y) ** 2)


def data_mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))


def data_parallel_loss(params, x, y):
    """The batch split over two devices by jax.shard_map, the parameters
    replicated, the loss averaged over the devices (16 rows each: a
    multiple of 16, as float8 needs).

    No collective is needed for current scaling: each replica quantises
    its own batch with scales from its own amax, and dequantises its own
    products with them, so each device's loss and gradients are those of
    its rows exactly as they would be on one device; the replicated
    weights have the same amax everywhere, and JAX sums the weights'
    gradients (already dequantised, in float32) over the devices, as it
    does without float8.
    """

    def local(params, x, y):
        return lax.pmean(mse(params, x, y), "data")

    return jax.shard_map(
        local,
        mesh=data_mesh(),
        in_specs=(P(), P("data"), P("data")),
        out_specs=P(),
    )(params, x, y)


def unplaced(tree, spec=None):
    del spec
    return tree


def placed_on(mesh):
    """Puts a tree on ``mesh``: replicated, or its rows over "data"."""

    def place(tree, spec=None):
        spec = P() if spec is None else spec
        return jax.device_put(tree, jax.NamedSharding(mesh, spec))

    return place


# The loss, its parameters, and the float8 matmuls of its gradient's jaxpr
# (forward, backward), each under jax.jit: a scan's body once, and under
# jax.checkpoint the first layer's forward matmul again, recomputed in the
# backward pass.
SKIP_CASES = {
    "scan": (scanned_loss, scanned_params, (3, 6)),
    "checkpoint": (checkpointed_loss, mlp_params, (3, 4)),
    "shard_map": (data_parallel_loss, mlp_params, (2, 4)),
    "explicit_mesh": (mse, mlp_params, (2, 4)),
}


def make_step(loss, tx):
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, opt_state, x, y):
        value, grads = lossscale.value_and_grad(loss, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step


@pytest.mark.parametrize("case", list(SKIP_CASES))
def test_loss_scaled_skips_a_non_finite_step_untouched(case):
    loss, init, (n_forward, n_backward) = SKIP_CASES[case]
    f = lossscale.autocast(loss, lossscale.Float8())
    params, (x, y) = init(), batch()
    inputs = [(x, y), (corrupt(x, np.inf), y), (x, corrupt(y, np.nan)), (x, y)]
    # On a mesh from the start (a jitted step whose inputs change sharding
    # between calls is traced again), or where they are.
    place, context = unplaced, contextlib.nullcontext()
    if case == "shard_map":
        place = placed_on(data_mesh())
    elif case == "explicit_mesh":
        mesh = explicit_mesh((4, 2), ("data", "model"))
        place, context = placed_on(mesh), set_mesh(mesh)
    params = place(params)
    inputs = [place(pair, P("data")) for pair in inputs]
    tx = lossscale.loss_scaled(
        optax.sgd(0.1, momentum=0.9), lossscale.DynamicLossScale(2.0**10)
    )
    with context:
        counts = fp8_counts(grad_jaxpr(f, params, *inputs[0]))
        assert counts == {"forward": n_forward, "backward": n_backward}
        step = make_step(f, tx)
        state = place(tx.init(params))
        # A finite step trains (the negative control) ...
        params, state, value = step(params, state, *inputs[0])
        assert np.isfinite(value) and bool(state.grads_finite)
        assert all_finite(params)
        # ... an inf in the input, then a NaN in the target, are skipped:
        # the parameters and the inner optimizer's state bitwise untouched.
        for bad in inputs[1:3]:
            new_params, new_state, _ = step(params, state, *bad)
            assert not bool(new_state.grads_finite)
            assert_trees_bitwise_equal(new_params, params)
            assert_trees_bitwise_equal(new_state.inner_state, state.inner_state)
            state = new_state
        # ... and the next finite step trains again.
        new_params, state, _ = step(params, state, *inputs[3])
        assert bool(state.grads_finite)
        assert int(lossscale.metrics(state)["skipped_steps"]) == 2
        for new, old in zip(
            jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True
        ):
            assert differ(new, old)


# --- 4. one library with the loss scaler ----------------------------------


@pytest.mark.parametrize(
    "recipe", slow_but_first(["tensorwise", "rowwise", "rowwise_with_gw_hp"])
)
def test_power_of_two_loss_scale_leaves_the_float8_gradients_bitwise(recipe):
    # Current scaling absorbs a power-of-two loss scale: the cotangent's
    # amax, and its inverse scale, take the factor exactly, its float8
    # values do not change. The unscaled gradients are bitwise those of an
    # unscaled loss, from 2**-60 to 2**60 (with torchao's amax floor of
    # 1e-12, 2**-60 put the gradients' amax under the floor: 22% off, and
    # every gradient zero at 2**-70). A scale that is not a power of two
    # changes them.
    f = lossscale.autocast(mse, lossscale.Float8(recipe))
    params, (x, y) = mlp_params(), batch()
    assert_two_float8_layers(f, params, x, y, recipe=recipe)
    powers = (-60, -30, 12, 30, 60)
    scales = {
        "none": lossscale.NoOpLossScale(),
        **{f"2**{k}": lossscale.StaticLossScale(2.0**k) for k in powers},
        "1000": lossscale.StaticLossScale(1000.0),
    }

    @jax.jit
    def unscaled_grads(params, x, y):
        return {
            name: scale.unscale(
                lossscale.value_and_grad(f, scale)(params, x, y)[1]
            )
            for name, scale in scales.items()
        }

    grads = unscaled_grads(params, x, y)
    assert all_finite(grads["none"])
    for k in powers:
        assert_trees_bitwise_equal(grads[f"2**{k}"], grads["none"])
    with pytest.raises(AssertionError):  # the negative control
        assert_trees_bitwise_equal(grads["1000"], grads["none"])
    # ... by float8's rounding only.
    assert 0 < relative_error(grads["1000"], grads["none"]) < 0.1


def grouped_loss(params, x, y, ratio):
    """The MLP, its first layer's gradient rescaled by ``ratio`` (its
    group's scale over the second's) where it feeds the second layer."""
    h = jnp.tanh(x @ params["first"]["w1"] + params["first"]["b1"])
    h = lossscale.rescale_gradient(h, ratio)
    return jnp.mean((h @ params["second"]["w2"] - y) ** 2)


def test_loss_scaled_by_group_gives_the_unscaled_float8_step():
    p = mlp_params()
    params = {
        "first": {"w1": p["w1"], "b1": p["b1"]},
        "second": {"w2": p["w2"]},
    }
    x, y = batch()
    tx = lossscale.loss_scaled_by_group(
        optax.sgd(1.0),
        {
            "first": lossscale.StaticLossScale(2.0**4),
            "second": lossscale.StaticLossScale(2.0**10),
        },
        param_labels={"first": "first", "second": "second"},
    )
    f = lossscale.autocast(grouped_loss, lossscale.Float8())

    @jax.jit
    def step(params, state, x, y):
        scales = cast(dict[str, Any], lossscale.get_loss_scale(state))
        ratio = scales["first"].loss_scale / scales["second"].loss_scale
        loss = functools.partial(f, ratio=ratio)
        value, grads = lossscale.value_and_grad(loss, scales["second"])(
            params, x, y
        )
        updates, state = tx.update(grads, state, params, scaled_by=scales)
        # the gradients computed without loss scaling
        unscaled = jax.grad(f)(params, x, y, jnp.float32(1))
        return updates, state, value, unscaled

    updates, state, value, unscaled = step(params, tx.init(params), x, y)
    assert bool(state.grads_finite) and np.isfinite(value)
    assert fp8_counts(
        jax.make_jaxpr(jax.grad(f))(params, x, y, jnp.float32(2.0**-6))
    ) == {"forward": 2, "backward": 4}
    # Powers of two all through: sgd(1.0)'s updates are bitwise minus the
    # gradients of the unscaled loss.
    assert_trees_bitwise_equal(updates, jax.tree.map(jnp.negative, unscaled))
    assert all(differ(u, 0) for u in jax.tree.leaves(updates))
    assert set(lossscale.metrics(state)) >= {"loss_scale/first", "steps"}


@pytest.mark.standard_promotion  # optax.MultiSteps
def test_multi_steps_skips_an_effective_batch_with_a_non_finite_micro_batch():
    f = lossscale.autocast(mse, lossscale.Float8())
    tx = lossscale.MultiSteps(
        lossscale.loss_scaled(
            optax.sgd(0.1), lossscale.DynamicLossScale(2.0**10)
        ),
        every_k_schedule=2,
    )
    step = make_step(f, tx)
    params, (x, y) = mlp_params(), batch()
    assert_two_float8_layers(f, params, x, y)
    state = tx.init(params)
    # A finite micro-batch, then one with an inf: nothing is applied, and
    # the scale backs off once.
    for micro in ((x, y), (corrupt(x, np.inf), y)):
        new_params, state, _ = step(params, state, *micro)
        assert_trees_bitwise_equal(new_params, params)
    metrics = lossscale.metrics(state)
    assert int(metrics["skipped_steps"]) == 1
    assert float(metrics["loss_scale"]) == 2.0**9
    # Two finite ones: applied.
    for micro in ((x, y), (x, y)):
        new_params, state, _ = step(params, state, *micro)
    metrics = lossscale.metrics(state)
    assert bool(metrics["grads_finite"]) and int(metrics["steps"]) == 2
    assert differ(new_params["w1"], params["w1"])


@pytest.mark.standard_promotion
def test_float16_compute_dtype_with_dynamic_loss_scale_trains():
    # Outside the float8 matmuls, the program runs in float16: a loss scale
    # too large overflows the float16 cotangents, the step is skipped and
    # the scale backs off until it fits; then the model trains.
    config = lossscale.Float8(compute_dtype=jnp.float16)
    f = lossscale.autocast(mse, config)
    params, (x, y) = mlp_params(), batch()
    assert [m.dtype for m in lossscale.matmuls(f, params, x, y)] == [E4] * 2
    f16_outputs = {
        np.dtype(v.aval.dtype)
        for eqn in equations(grad_jaxpr(f, params, x, y))
        for v in eqn.outvars
    }
    assert np.dtype(np.float16) in f16_outputs and BF16 not in f16_outputs
    tx = lossscale.loss_scaled(
        optax.adam(1e-2), lossscale.DynamicLossScale(2.0**24)
    )
    step = make_step(f, tx)
    state = tx.init(params)
    losses = []
    for _ in range(10):
        params, state, value = step(params, state, x, y)
        losses.append(float(value))
    metrics = lossscale.metrics(state)
    assert int(metrics["skipped_steps"]) >= 1
    assert float(metrics["loss_scale"]) < 2.0**24
    assert bool(metrics["grads_finite"]) and all_finite(params)
    assert losses[-1] < 0.8 * losses[0]


# --- 5. everywhere the rest of autocast runs ------------------------------

# Float8 against float32 (section 6 explains the tolerances).
LOSS_RTOL, GRAD_RTOL = 2.0**-5, 0.15


def assert_close_to_float32(got, expected):
    (value, grads), (ref_value, ref_grads) = got, expected
    assert abs(float(value) / float(ref_value) - 1) < LOSS_RTOL
    assert all_finite(grads)
    assert relative_error(grads, ref_grads) < GRAD_RTOL


def check_float8(loss, params, *args, counts=(2, 4)):
    """autocast(loss, Float8())'s gradient: its float8 matmuls (forward,
    backward), and its value and gradients against float32's.

    Run eagerly: JAX dispatches one operation at a time and compiles each
    once for all the tests (the models here have the same shapes), where
    jit would compile each model's program (the skip tests run jit)."""
    f = lossscale.autocast(loss, lossscale.Float8())
    found = fp8_counts(grad_jaxpr(f, params, *args))
    assert found == dict(zip(("forward", "backward"), counts, strict=True))
    got = jax.value_and_grad(f)(params, *args)
    expected = jax.value_and_grad(loss)(params, *args)
    assert_close_to_float32(got, expected)


def test_flax_nnx_linear_mlp():
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(64, 32, rngs=rngs)
            self.down = nnx.Linear(32, 16, rngs=rngs)

        def __call__(self, x):
            return self.down(jnp.tanh(self.up(x)))

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))

    def loss(state, x, y):
        return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

    check_float8(loss, state, *batch())


def test_flax_nnx_scan_over_layers():
    nnx = pytest.importorskip("flax.nnx")

    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(32, 32, rngs=rngs)

        def __call__(self, h):
            return jnp.tanh(self.lin(h))

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Layer(rngs)

    graphdef, state = nnx.split(make(nnx.Rngs(0)))

    def loss(state, x, y):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def through(h, layer):
            return layer(h)

        out = through(x[:, :32], nnx.merge(graphdef, state))
        return jnp.mean((out[:, :16] - y) ** 2)

    check_float8(loss, state, *batch(), counts=(1, 2))  # the body, once


def test_flax_linen_dense():
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(16)(jnp.tanh(nn.Dense(32)(x)))

    model = MLP()
    x, y = batch()
    variables = model.init(jax.random.key(0), x)

    def loss(variables, x, y):
        return jnp.mean((model.apply(variables, x) - y) ** 2)

    check_float8(loss, variables, x, y)


def test_equinox_mlp_under_filter_value_and_grad():
    eqx = pytest.importorskip("equinox")
    model = eqx.nn.MLP(
        64, 16, 32, 1, activation=jnp.tanh, key=jax.random.key(0)
    )
    x, y = batch()

    def loss(model, x, y):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    # A user's step: eqx.filter_value_and_grad of the autocast function
    # (eagerly, as check_float8).
    f = lossscale.autocast(loss, lossscale.Float8())
    got = eqx.filter_value_and_grad(f)(model, x, y)
    expected = eqx.filter_value_and_grad(loss)(model, x, y)
    arrays = functools.partial(eqx.filter, filter_spec=eqx.is_inexact_array)
    assert_close_to_float32(
        (got[0], arrays(got[1])), (expected[0], arrays(expected[1]))
    )
    # Each Linear is a matrix-vector product under jax.vmap: the batched
    # matmul JAX makes of it has no batch dimension, and runs in float8.
    params, static = eqx.partition(model, eqx.is_inexact_array)
    jaxpr = grad_jaxpr(lambda p: f(eqx.combine(p, static), x, y), params)
    assert fp8_counts(jaxpr) == {"forward": 2, "backward": 4}


def test_custom_vjp_runs_whole_at_traced_dtypes():
    # autocast runs a custom_vjp function as written (its forward and its
    # backward rule at the dtypes they were traced with): its matmul is a
    # float32 one, not float8; the matmul outside it is float8.
    linear = jax.custom_vjp(lambda x, w: x @ w)
    linear.defvjp(
        lambda x, w: (x @ w, (x, w)),
        lambda saved, g: (g @ saved[1].T, saved[0].T @ g),
    )

    def loss(params, x, y):
        h = jnp.tanh(linear(x, params["w1"]) + params["b1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    params, (x, y) = mlp_params(), batch()
    f = lossscale.autocast(loss, lossscale.Float8())
    found = dots(grad_jaxpr(f, params, x, y))
    assert collections.Counter(found) == {
        ((F32.name, F32.name), F32.name): 3,  # forward, and its rule's two
        FORWARD: 1,
        BACKWARD: 2,
    }
    report = lossscale.matmuls(f, params, x, y)
    assert [(m.dtype, m.why) for m in report] == [
        (F32.name, "at its traced dtypes"),
        (E4, "float8"),
    ]
    check_float8(loss, params, x, y, counts=(1, 2))


def sliced():
    """The parameters, the batch in two slices of 16 rows, and the float8
    gradient of each slice alone."""
    params, (x, y) = mlp_params(), batch()
    xs, ys = x.reshape(2, 16, 64), y.reshape(2, 16, 16)
    grad = jax.grad(lossscale.autocast(mse, lossscale.Float8()))
    one = jax.jit(grad)
    return params, xs, ys, grad, [one(params, xs[i], ys[i]) for i in range(2)]


def assert_slices_equal(mapped, expected):
    for i in range(2):
        chex.assert_trees_all_close(
            jax.tree.map(lambda g, i=i: g[i], mapped),
            expected[i],
            rtol=1e-6,
            atol=1e-7,
        )


def test_vmap_quantises_each_slice_on_its_own():
    # Mapped over two slices of 16 rows, the float8 gradient of each slice
    # is the one computed for that slice alone: each is quantised with its
    # own scales (the amax of its own rows).
    params, xs, ys, grad, expected = sliced()
    by_vmap = jax.jit(jax.vmap(grad, in_axes=(None, 0, 0)))(params, xs, ys)
    assert_slices_equal(by_vmap, expected)
    # Negative control: the whole batch, quantised together, differs.
    whole = grad(params, xs.reshape(32, 64), ys.reshape(32, 16))
    average = jax.tree.map(lambda g: (g[0] + g[1]) / 2, by_vmap)
    assert 0 < relative_error(average, whole) < GRAD_RTOL


def test_pmap_quantises_each_device_slice_on_its_own():
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (conftest asks for 8 CPU devices)")
    params, xs, ys, grad, expected = sliced()
    by_pmap = jax.pmap(grad, in_axes=(None, 0, 0))(params, xs, ys)
    assert_slices_equal(by_pmap, expected)


def model_parallel_mse(params, x, y):
    """mse, its second matmul contracting the axis the first's output and
    the second weight are sharded along: under Explicit axes, JAX asks
    for the result's sharding (as it would without autocast)."""
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = jnp.matmul(h, params["w2"], out_sharding=P("data", None))
    return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("recipe", slow_but_first(["tensorwise", "rowwise"]))
def test_explicit_mesh_batch_and_model_parallel_weights(recipe):
    # The batch over "data", the first layer's columns and the second's
    # rows over "model". Scales are global (the amax of a sharded tensor is
    # reduced over the devices by XLA), so the gradients are the unsharded
    # ones but for float32 summation order, each in its weight's sharding.
    params, (x, y) = mlp_params(), batch()
    expected = fp8_grad(recipe, params, x, y)
    mesh = explicit_mesh((4, 2), ("data", "model"))
    place = placed_on(mesh)
    specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    with set_mesh(mesh):
        params = {name: place(w, specs[name]) for name, w in params.items()}
        x, y = place((x, y), P("data", None))
        f = lossscale.autocast(model_parallel_mse, lossscale.Float8(recipe))
        assert_two_float8_layers(f, params, x, y, recipe=recipe)
        grads = jax.jit(jax.grad(f))(params, x, y)
    for name, g in grads.items():
        assert _compat.spec(g) == _compat.spec(params[name])
    chex.assert_trees_all_close(grads, expected, rtol=1e-5, atol=1e-7)


# --- 6. numerics ----------------------------------------------------------


@pytest.mark.parametrize(
    "recipe", slow_but_first(["tensorwise", "rowwise", "rowwise_with_gw_hp"])
)
def test_loss_and_gradients_within_float8_tolerance_of_float32(recipe):
    """The tolerances (``LOSS_RTOL``, ``GRAD_RTOL``) from float8's rounding.

    Rounding to e4m3 (3 mantissa bits) errs by at most 2**-4 of a value,
    to e5m2 (2 bits) by 2**-3; spread uniformly, their RMS relative errors
    are 2**-4 / sqrt(3) = 0.036 and 2**-3 / sqrt(3) = 0.072. A matmul's
    result, a sum of products with independent errors, keeps about the
    products' relative error: 0.05 forward (e4m3 x e4m3), 0.08 backward
    (e5m2 x e4m3). The first layer's weight gradient goes through two
    backward matmuls (0.08 * sqrt(2) = 0.115): the gradients' global
    relative error must stay under ``GRAD_RTOL`` = 0.15. The loss, a mean
    of 512 squared residuals whose errors are independent, averages them
    away: within 2**-5 (half of e4m3's largest relative error). bfloat16
    autocast's errors (2**-9 rounding) are some 20 times smaller: float8's
    above 0.02 shows that float8 really ran (the negative control).
    """
    params, (x, y) = mlp_params(), batch()
    expected = float32_value_and_grad(params, x, y)
    got = fp8_value_and_grad(recipe)(params, x, y)
    assert_close_to_float32(got, expected)
    bf16_error = relative_error(
        bfloat16_value_and_grad(params, x, y)[1], expected[1]
    )
    assert bf16_error < 0.01 < 0.02 < relative_error(got[1], expected[1])


def test_rowwise_is_closer_than_tensorwise_with_an_outlier_row():
    # One row of the input 2**20 times the others: one scale for the whole
    # tensor takes the other rows below e4m3's smallest subnormal (2**-9),
    # to 0; one per row keeps each row's 3 bits. Errors of the other rows'
    # outputs, each relative to its own norm.
    x = np.array(batch()[0])
    x[0] *= 2.0**20
    w = mlp_params()["w1"]
    expected = (x.astype(np.float64) @ np.asarray(w, np.float64))[1:]

    def worst_row_error(recipe):
        f = lossscale.autocast(lambda x, w: x @ w, lossscale.Float8(recipe))
        out = np.asarray(f(jnp.asarray(x), w), np.float64)[1:]
        err = np.linalg.norm(out - expected, axis=1)
        return float(np.max(err / np.linalg.norm(expected, axis=1)))

    assert (
        worst_row_error("rowwise") < 0.1 < 0.5 < worst_row_error("tensorwise")
    )
