"""lossscale.autocast under models and functions it was not written with.

A second look at autocast from users' setups: flax and equinox built-in
layers, jax.nn and optax functions, PRNG keys, float64. Each test states
what broke (or could have) and checks it against the same function
without autocast.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale
from lossscale import _compat
from tests.helpers import enable_x64

F32 = np.dtype(np.float32)


# --- flax NNX: state written back for models with any submodules ---------


def _nnx_model_with_attention():
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            # MultiHeadAttention has a submodule named `value`: it must not
            # be taken for a Variable (whose array is `.value`).
            self.att = nnx.MultiHeadAttention(
                num_heads=2, in_features=4, decode=False, rngs=rngs
            )
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.bn(self.att(x)))

    return Model


@pytest.mark.standard_promotion
def test_nnx_state_is_written_back_in_a_model_with_attention():
    from flax import nnx

    model_cls = _nnx_model_with_attention()
    x = jax.random.normal(jax.random.key(1), (2, 3, 4))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    plain, auto = model_cls(nnx.Rngs(0)), model_cls(nnx.Rngs(0))
    for _ in range(2):
        v_plain, _ = nnx.value_and_grad(loss)(plain, x)
        v_auto, _ = nnx.value_and_grad(lossscale.autocast(loss))(auto, x)
    # BatchNorm's running mean moved (as without autocast) ...
    assert float(jnp.abs(auto.bn.mean[...]).max()) > 0
    np.testing.assert_allclose(
        auto.bn.mean[...], plain.bn.mean[...], rtol=2e-2, atol=1e-4
    )
    # ... and the dropout stream advanced: the second step drew the
    # plain model's second mask, not its first one again.
    assert float(v_auto) == pytest.approx(float(v_plain), rel=2e-2)


@pytest.mark.standard_promotion
def test_nnx_rngs_passed_as_an_argument_advance():
    from flax import nnx

    def noise(rngs, x):
        return x + jax.random.normal(rngs.dropout(), x.shape)

    x = jnp.zeros((3,))
    plain, auto = nnx.Rngs(dropout=0), nnx.Rngs(dropout=0)
    f = lossscale.autocast(noise)
    first_plain, first_auto = noise(plain, x), f(auto, x)
    second_plain, second_auto = noise(plain, x), f(auto, x)
    np.testing.assert_array_equal(first_auto, first_plain)
    np.testing.assert_array_equal(second_auto, second_plain)
    assert not np.array_equal(second_auto, first_auto)  # negative control


# --- PRNG keys in the outputs ----------------------------------------------


def test_a_prng_key_can_be_returned():
    # A loss that hands back the next key (in its aux, say) is common.
    def loss(w, key):
        key, sub = jax.random.split(key)
        noise = jax.random.normal(sub, w.shape)
        return jnp.mean((w + noise) @ w), key

    w, key = jnp.ones((3, 3)), jax.random.key(0)
    value, new_key = lossscale.autocast(loss)(w, key)
    expected_value, expected_key = loss(w, key)
    assert new_key.dtype == expected_key.dtype
    np.testing.assert_array_equal(
        jax.random.key_data(new_key), jax.random.key_data(expected_key)
    )
    assert value.dtype == F32
    assert float(value) == pytest.approx(float(expected_value), rel=1e-2)
    (_, aux_key), grads = jax.value_and_grad(
        lossscale.autocast(loss), has_aux=True
    )(w, key)
    assert aux_key.dtype == expected_key.dtype and grads.dtype == F32


@pytest.mark.standard_promotion
def test_nnx_model_with_dropout_closed_over_is_refused_with_the_way_out():
    # A closed-over NNX model's Variables belong to the outer trace, and
    # flax refuses their update inside autocast's trace with a bare
    # TraceContextError: lossscale's message names the pattern that works.
    from flax import nnx

    model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)))
    model.layers.append(nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1)))
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match="Pass the model as an argument"):
        nnx.value_and_grad(
            lambda m: lossscale.autocast(lambda x: jnp.mean(m(x) ** 2))(x)
        )(model)
    # The pattern it names: the model passed in, its state written back.

    def loss_fn(m, x):
        return jnp.mean(m(x) ** 2)

    count = model.layers[1].rngs.count
    # get_value() since flax 0.12; .value before (and deprecated since).
    read = getattr(count, "get_value", None) or (lambda: count.value)
    before = read()
    loss, _ = nnx.value_and_grad(lossscale.autocast(loss_fn))(model, x)
    assert loss.dtype == F32
    assert read() == before + 1


def test_swapped_arguments_get_a_hint():
    with pytest.raises(TypeError, match="arguments are swapped"):
        lossscale.autocast(jnp.float16, lambda x: x)
    with pytest.raises(TypeError, match="a dtype, not a function"):
        lossscale.autocast(jnp.bfloat16)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_keras_policy_keeps_the_loss_float32(policy):
    # Keras computes losses in float32 under its mixed policies; the
    # policy string gave a float16 loss (5e-7 is a float16 subnormal).
    def loss(w, x):
        return jnp.mean((x @ w) ** 2) * 1e-6

    w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
    value = lossscale.autocast(loss, policy)(w, x)
    assert value.dtype == F32
    np.testing.assert_allclose(value, loss(w, x), rtol=1e-2)
    # jmp's grammar still casts the outputs as it says.
    assert lossscale.autocast(loss, "p=f32,c=f16,o=f16")(w, x).dtype == (
        jnp.float16
    )


# --- functions that share a primitive's name -------------------------------


def _tanh_vjp():
    @jax.custom_vjp
    def tanh(x):  # a user's function named like a "compute" primitive
        return jnp.tanh(x)

    tanh.defvjp(
        lambda x: (jnp.tanh(x), x), lambda x, g: (g / jnp.cosh(x) ** 2,)
    )
    return tanh


@pytest.mark.parametrize(
    "name", ["jnp.round", "jit add", "jit tanh", "custom_vjp tanh"]
)
def test_a_function_named_like_a_primitive_is_not_bound_at_other_dtypes(
    name,
):
    # jnp.round(x, decimals) is a jax.jit named "round": its name is in the
    # rules table (a "promote" primitive), and binding the call itself with
    # float16 operands ran a float32 program on float16 buffers.
    @jax.jit
    def add(a, b):
        return a + b

    @jax.jit
    def tanh(a):
        return jnp.tanh(a)

    inner = {
        "jnp.round": lambda h: jnp.round(h, 2),
        "jit add": lambda h: add(h, h),
        "jit tanh": tanh,
        "custom_vjp tanh": _tanh_vjp(),
    }[name]

    def loss(w, x):
        return jnp.mean(inner(x @ w) @ w)

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    value, grads = jax.jit(jax.value_and_grad(lossscale.autocast(loss)))(w, x)
    eager = lossscale.autocast(loss)(w, x)
    expected, expected_grads = jax.value_and_grad(loss)(w, x)
    assert value.dtype == eager.dtype == grads.dtype == F32
    assert float(value) == pytest.approx(float(expected), rel=2e-2, abs=2e-3)
    np.testing.assert_allclose(grads, expected_grads, rtol=5e-2, atol=5e-3)


# --- NumPy inputs ------------------------------------------------------------


def _dot_dtypes(jaxpr):
    found = []
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(np.dtype(v.aval.dtype) for v in eqn.invars))
    return found


def test_a_numpy_float64_batch_is_read_as_the_float32_jax_makes_it():
    # Data loaders hand out NumPy float64 arrays; JAX (x64 off) reads them
    # as float32. autocast classed them by their NumPy dtype as float64,
    # "never touched": the first matmul ran in float32, forward and back.
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) @ w)

    w = jnp.full((4, 4), 0.1)
    batch = np.random.default_rng(0).standard_normal((8, 4))
    assert batch.dtype == np.float64
    f16 = np.dtype(jnp.float16)
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda w: lossscale.autocast(loss)(w, batch))
    )(w)
    assert _dot_dtypes(jaxpr) and set(_dot_dtypes(jaxpr)) == {(f16, f16)}
    value = lossscale.autocast(loss)(w, batch)  # eagerly
    assert value.dtype == F32
    assert float(value) == pytest.approx(float(loss(w, batch)), rel=1e-2)
    # Negative control: with x64 on, float64 is float64, never touched.
    with enable_x64():
        jaxpr = jax.make_jaxpr(
            lossscale.autocast(lambda x: jnp.sum(jnp.tanh(x @ x.T)))
        )(batch)
    assert set(_dot_dtypes(jaxpr)) == {(np.dtype(np.float64),) * 2}


# --- loops ----------------------------------------------------------------


def test_a_scan_over_no_layers():
    # A stack configured with no layers (or an empty sequence): the probe
    # of the carry's dtype indexed the first slice, which does not exist.
    def loss(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
        return jnp.mean(h)

    ws, x = jnp.ones((0, 4, 4)), jnp.full((2, 4), 0.5)
    value, grads = jax.value_and_grad(lossscale.autocast(loss))(ws, x)
    assert value.dtype == F32 and float(value) == 0.5
    assert grads.shape == (0, 4, 4) and grads.dtype == F32


# --- functions and layers from libraries, against float32 -------------------


def _target(shape):
    return jax.random.normal(jax.random.key(2), shape)


_LOSSES = {
    "softmax where=": lambda h: jnp.sum(
        _target(h.shape) * jax.nn.softmax(h, where=jnp.arange(8) < 5)
    ),
    "causal -inf mask": lambda h: jnp.sum(
        _target((4, 4))
        * jax.nn.softmax(
            jnp.where(jnp.tril(jnp.ones((4, 4), bool)), h @ h.T, -jnp.inf)
        )
    ),
    "logsumexp": lambda h: jnp.mean(jax.nn.logsumexp(h, axis=-1)),
    "gelu exact, silu": lambda h: jnp.mean(
        jax.nn.gelu(jax.nn.silu(h), approximate=False)
    ),
    "norm, var, std": lambda h: (
        jnp.linalg.norm(h)
        + jnp.mean(jnp.var(h, axis=-1))
        + jnp.mean(jnp.std(h, axis=0))
    ),
    "einsum": lambda h: jnp.mean(jnp.einsum("bi,bj->ij", h, h)),
    "fori_loop, static bounds": lambda h: jnp.mean(
        jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) * 0.9, h)
    ),
    "lax.map": lambda h: jnp.mean(jax.lax.map(jnp.tanh, h)),
    "sort": lambda h: jnp.mean(jnp.sort(h, axis=-1)[:, -3:]),
    "dot_product_attention": lambda h: jnp.mean(
        jax.nn.dot_product_attention(
            h.reshape(1, 4, 2, 4),
            h.reshape(1, 4, 2, 4),
            h.reshape(1, 4, 2, 4),
            is_causal=True,
        )
        ** 2
    ),
}


@pytest.mark.parametrize("name", list(_LOSSES))
def test_library_functions_match_float32_with_float16_matmuls(name):
    import optax

    def loss(w, x):
        h = x @ w
        value = _LOSSES[name](h)
        return value + jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(
                h, jnp.arange(4) % 8
            )
        )

    w = jax.random.normal(jax.random.key(0), (8, 8)) / 3
    x = jax.random.normal(jax.random.key(1), (4, 8))
    f16_loss = lossscale.autocast(loss)
    value, grads = jax.jit(jax.value_and_grad(f16_loss))(w, x)
    expected, expected_grads = jax.value_and_grad(loss)(w, x)
    assert value.dtype == grads.dtype == F32
    assert float(value) == pytest.approx(float(expected), rel=1e-2, abs=1e-3)
    scale = float(jnp.max(jnp.abs(expected_grads)))
    np.testing.assert_allclose(grads, expected_grads, atol=1e-2 * scale)
    f16 = np.dtype(jnp.float16)
    found = _dot_dtypes(jax.make_jaxpr(jax.grad(f16_loss))(w, x))
    assert found and set(found) == {(f16, f16)}


@pytest.mark.standard_promotion
def test_linen_conv_batchnorm_dropout_with_mutable_batch_stats():
    import flax.linen as nn
    import optax

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(
                nn.BatchNorm(use_running_average=False)(nn.Conv(4, (3, 3))(x))
            )
            x = nn.Dropout(0.1, deterministic=False)(x)
            return nn.Dense(3)(x.reshape(x.shape[0], -1))

    model = CNN()
    x = jax.random.normal(jax.random.key(0), (2, 5, 5, 3))
    variables = model.init(
        {"params": jax.random.key(1), "dropout": jax.random.key(2)}, x
    )

    def loss(params, x):
        logits, updates = model.apply(
            {"params": params, "batch_stats": variables["batch_stats"]},
            x,
            rngs={"dropout": jax.random.key(3)},
            mutable=["batch_stats"],
        )
        labels = jnp.arange(2)
        return jnp.mean(
            optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        ), updates

    (value, stats), grads = jax.value_and_grad(
        lossscale.autocast(loss), has_aux=True
    )(variables["params"], x)
    (expected, expected_stats), expected_grads = jax.value_and_grad(
        loss, has_aux=True
    )(variables["params"], x)
    assert float(value) == pytest.approx(float(expected), rel=1e-2)
    for got, want in zip(
        jax.tree.leaves(stats), jax.tree.leaves(expected_stats), strict=True
    ):
        assert got.dtype == F32
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-4)
    np.testing.assert_allclose(
        grads["Dense_0"]["kernel"],
        expected_grads["Dense_0"]["kernel"],
        rtol=2e-2,
        atol=2e-3,
    )


# --- sharding of inner jax.jit calls -----------------------------------------


def test_an_inner_jit_keeps_its_shardings_under_auto_axes():
    # autocast inlined a jax.jit called inside fun; the in_shardings and
    # out_shardings it was given were dropped with it, so its results
    # came out replicated instead of sharded as the user asked. It is
    # re-bound now, with its params.
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh(
        (2,),
        ("d",),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:2],
    )
    rows = NamedSharding(mesh, PartitionSpec("d"))
    cols = NamedSharding(mesh, PartitionSpec(None, "d"))
    inner = jax.jit(jnp.tanh, in_shardings=cols, out_shardings=rows)

    def f(w, x):
        return inner(x @ w)

    w, x = jnp.full((4, 4), 0.1), jnp.ones((8, 4))
    plain = jax.jit(f)(w, x)
    auto = jax.jit(lossscale.autocast(f))(w, x)
    assert plain.sharding.spec == PartitionSpec("d")  # negative control
    assert auto.sharding.is_equivalent_to(plain.sharding, plain.ndim)
    jaxpr = jax.make_jaxpr(lossscale.autocast(f))(w, x)
    plain_jaxpr = jax.make_jaxpr(f)(w, x)

    def shardings(jaxpr):
        return [
            (eqn.params["in_shardings"], eqn.params["out_shardings"])
            for eqn in jaxpr.jaxpr.eqns
            if _compat.is_jit(eqn)
        ]

    assert shardings(jaxpr) == shardings(plain_jaxpr) == [((cols,), (rows,))]
    np.testing.assert_allclose(auto, plain, rtol=1e-2)
    grads = jax.jit(jax.grad(lambda w: jnp.sum(lossscale.autocast(f)(w, x))))(w)
    assert grads.dtype == F32


# --- constant outputs --------------------------------------------------------


def test_constant_outputs_come_back_as_arrays_as_from_jit():
    # A constant the function returns (a count in its aux, a flag in an
    # equinox State) is a literal of the traced jaxpr: it came back as
    # jax's internal TypedInt/TypedFloat (or a NumPy array with
    # output_dtype), where jax.jit returns arrays.
    def f(w):
        return jnp.mean(w), 3, 1.5, False

    w = jnp.ones(3)
    expected = jax.jit(f)(w)
    for got in (
        lossscale.autocast(f)(w),
        lossscale.autocast(f, output_dtype=jnp.float16)(w),
    ):
        assert all(isinstance(x, jax.Array) for x in got)
        assert got[1].dtype == expected[1].dtype
        assert got[3].dtype == expected[3].dtype == np.dtype(bool)
        assert [x.tolist() for x in got[1:]] == [3, 1.5, False]
    assert lossscale.autocast(f)(w)[2].dtype == F32
    assert lossscale.autocast(f, output_dtype=jnp.float16)(w)[2].dtype == (
        np.dtype(jnp.float16)
    )
