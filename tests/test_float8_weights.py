"""Float8 knows the weight: which operand of a matmul is the weight, read
from the dataflow (lossscale/_autocast/_weights.py), and what follows from
it: ``rowwise_with_gw_hp``'s 16-bit weight gradient on either side of the
matmul, eligibility from the weight's sizes, what is not a linear layer,
layers kept out by name or by a callable, the weight's path in
``lossscale.matmuls``, and ``autocast`` around a gradient refused.

Values are read against float32's, dtypes from the jaxprs of the
gradients (through the ``cond`` that ``lax.platform_dependent`` makes of
gw_hp's weight gradient: float32 products of 16-bit operands on CPU, a
16-bit GEMM elsewhere).
"""

from __future__ import annotations

import warnings

import chex
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from flax import nnx

import lossscale
from lossscale._autocast import _fp8
from tests.helpers import equations, normal, relative_error

E4, E5 = "float8_e4m3fn", "float8_e5m2"
GW_HP = "rowwise_with_gw_hp"
BOTH = "both operands depend on the data (attention, a Gram matrix)"
GATHER = (
    "an exact gather: the data reaches it through integers or booleans "
    "only (a one-hot product)"
)


def dot_dtypes(jaxpr, platform="cpu"):
    """The operand dtypes of every dot_general, nested ones included, that
    ``platform`` runs."""
    return [
        tuple(np.dtype(v.aval.dtype).name for v in eqn.invars)
        for eqn in equations(jaxpr, platform)
        if eqn.primitive.name == "dot_general"
    ]


def fp8_dots(jaxpr):
    return [d for d in dot_dtypes(jaxpr) if any("float8" in t for t in d)]


# --- the weight on either side: gw_hp ----------------------------------------

# The output's cotangent is the target itself (a linear loss): the weight
# gradient is x^T y, which gw_hp computes in bfloat16 whichever side of the
# matmul the weight is on, and float8 would round to e4m3.
X = normal(0, (32, 64))
Y = normal(1, (32, 128))
W = normal(2, (128, 64), 1 / 8)  # (out, in), as equinox and torch store it


def _linear_loss(apply):
    def loss(w, x):
        return jnp.sum(apply(w, x) * Y) / Y.size

    return loss


LAYERS = {
    # name: (apply(w, x), the weight in the layout apply takes)
    "x @ W.T": (lambda w, x: x @ w.T, W),
    "x @ w": (lambda w, x: x @ w, W.T),
    "W @ x, vmapped (equinox)": (
        lambda w, x: jax.vmap(lambda xi: w @ xi)(x),
        W,
    ),
    'einsum("mhd,hdn->mn") (DenseGeneral)': (
        lambda w, x: jnp.einsum("mhd,hdn->mn", x.reshape(32, 4, 16), w),
        W.reshape(128, 4, 16).transpose(1, 2, 0),
    ),
}


class EitherSide(chex.TestCase):
    """gw_hp's weight gradient, called eagerly and under jax.jit."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(*LAYERS)
    def test_gw_hp_keeps_the_weight_gradient_16_bit_on_either_side(self, layer):
        apply, w = LAYERS[layer]
        loss = _linear_loss(apply)
        f8 = lossscale.autocast(loss, lossscale.Float8(GW_HP))
        grad = self.variant(jax.grad(f8))(w, X)
        exact = jax.grad(loss)(w, X)
        bf16 = jax.grad(lossscale.autocast(loss, jnp.bfloat16))(w, X)
        # At bfloat16's level: the error of the same product in bfloat16,
        # and under the 2**-8 of a bfloat16 rounding.
        error = relative_error(grad, exact)
        assert error <= 2 * relative_error(bf16, exact) + 1e-7, layer
        assert error < 2**-8, layer
        # The jaxpr of both gradients: the weight's from 16-bit operands
        # (the matmul whose result has the weight's size), the input's
        # float8 (an e4m3 gradient, as torchao's), the forward e4m3 too,
        # as a GPU runs them (on CPU the 16-bit operands are multiplied in
        # float32).
        jaxpr = jax.make_jaxpr(jax.grad(f8, (0, 1)))(w, X)
        sizes = {kind: set() for kind in ("float8", "bfloat16")}
        for eqn in equations(jaxpr, "cuda"):
            if eqn.primitive.name == "dot_general":
                kind = np.dtype(eqn.invars[0].aval.dtype).name
                kind = "float8" if "float8" in kind else kind
                sizes.setdefault(kind, set()).add(eqn.outvars[0].aval.size)
        assert sizes["bfloat16"] == {w.size}, layer
        assert w.size not in sizes["float8"], layer
        assert fp8_dots(jaxpr) == [(E4, E4), (E4, E4)], layer


def test_the_weight_on_the_wrong_side_gives_a_float8_weight_gradient():
    # The negative control of the test above: told that the activation is
    # the weight (the old rule, rhs by position, on equinox's W @ x), the
    # recipe computes the weight's gradient in float8, far from bfloat16's.
    dims = (((1,), (0,)), ((), ()))

    def loss(w, x, weight):
        y = _fp8.dot_general(
            w, x.T, dims, lossscale.Float8(GW_HP), weight=weight
        )
        return jnp.sum(y.T.astype(jnp.float32) * Y) / Y.size

    exact = jax.grad(lambda w: jnp.sum((X @ w.T) * Y) / Y.size)(W)
    right = relative_error(jax.grad(loss)(W, X, 0), exact)
    wrong = relative_error(jax.grad(loss)(W, X, 1), exact)
    assert right < 2**-8 < 5 * right < wrong


# --- the weight in the layers of flax, equinox ------------------------------


def _linen():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(128, name="hidden")(x)
            h = nn.DenseGeneral(32, axis=(-2, -1), name="general")(
                jax.nn.relu(h).reshape(-1, 8, 16)
            )
            return nn.Dense(16, name="head")(h)

    model = Model()
    params = model.init(jax.random.key(0), X)

    def loss(params, x):
        return jnp.mean(model.apply(params, x) ** 2)

    return loss, params, ["params.hidden.kernel", "params.general.kernel",
                          "params.head.kernel"]  # fmt: skip


def _nnx():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 128, rngs=rngs)
            self.head = nnx.Linear(128, 16, rngs=rngs)

        def __call__(self, x):
            return self.head(jax.nn.relu(self.hidden(x)))

    def loss(model, x):
        return jnp.mean(model(x) ** 2)

    return loss, Model(nnx.Rngs(0)), ["hidden.kernel", "head.kernel"]


def _equinox():
    model = eqx.nn.MLP(64, 16, 128, 2, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, x):
        return jnp.mean(jax.vmap(eqx.combine(params, static))(x) ** 2)

    return loss, params, [f"layers.{i}.weight" for i in range(3)]


MODELS = {"linen": _linen, "nnx": _nnx, "equinox": _equinox}


@pytest.mark.parametrize("library", list(MODELS))
def test_matmuls_names_each_weight_and_gw_hp_follows_it(library):
    loss, model, paths = MODELS[library]()
    f8 = lossscale.autocast(loss, lossscale.Float8(GW_HP))
    report = lossscale.matmuls(f8, model, X)
    assert [(m.dtype, m.weight) for m in report] == [(E4, p) for p in paths]
    # Each layer's weight gradient is 16-bit, its input's float8: one
    # float8 matmul forward a layer, and one backward (the first layer's
    # input gradient is computed, and read by nothing).
    if library == "nnx":
        grad = nnx.grad(f8)(model, X)
        exact = nnx.grad(loss)(model, X)
    else:
        grad = jax.grad(f8)(model, X)
        exact = jax.grad(loss)(model, X)
    leaves = zip(jax.tree.leaves(grad), jax.tree.leaves(exact), strict=True)
    for a, b in leaves:
        assert relative_error(a, b) < 0.25  # float8's, 64 to 128 wide
    jaxpr = jax.make_jaxpr(jax.grad(lambda m: f8(m, X)))(model)
    assert fp8_dots(jaxpr) == [(E4, E4)] * (2 * len(paths))


# --- what is a linear layer, and its eligibility -----------------------------


def test_per_example_gradients_of_one_row_run_in_float8():
    # DP-SGD's vmap(grad) over 1-row examples: the weight is 64 x 128 and
    # its rows do not matter (XLA's GPU rewrite pads them).
    w = normal(3, (64, 128), 1 / 8)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    f8 = lossscale.autocast(loss, lossscale.Float8())
    xs = X[:, None, :]  # 32 examples of one row
    per_example = jax.vmap(jax.grad(f8), in_axes=(None, 0))
    jaxpr = jax.make_jaxpr(per_example)(w, xs)
    # Every matmul is float8: the forward one, and the backward ones (the
    # weight's gradient; the input's, which nothing reads).
    assert {tuple(sorted(d)) for d in dot_dtypes(jaxpr)} == {
        (E4, E4),
        (E4, E5),
    }
    got = per_example(w, xs)
    exact = jax.vmap(jax.grad(loss), in_axes=(None, 0))(w, xs)
    assert relative_error(got, exact) < 0.25
    # 24 rows (not a multiple of 16) run in float8 too.
    assert [m.dtype for m in lossscale.matmuls(f8, w, X[:24])] == [E4]


def test_what_is_not_a_linear_layer_stays_16_bit_with_its_reason():
    table = normal(4, (64, 32), 1.0)
    w = normal(5, (32, 32), 1 / 6)
    ids = jnp.arange(32) % 64

    def loss(params, ids, x):
        table, w = params
        rows = jax.nn.one_hot(ids, 64) @ table  # an exact gather
        looked_up = jnp.take(table, ids, axis=0)  # a gather, then a layer
        h = (rows + looked_up + x) @ w  # a linear layer
        gram = h.T @ h  # data by data
        return jnp.mean(gram**2), rows

    f8 = lossscale.autocast(loss, lossscale.Float8())
    x = normal(6, (32, 32))
    report = lossscale.matmuls(f8, (table, w), ids, x)
    assert [(m.dtype, m.why, m.weight) for m in report] == [
        ("bfloat16", GATHER, ""),
        (E4, "float8", "1"),
        ("bfloat16", BOTH, ""),
    ]
    # The one-hot product is the table's rows, rounded to bfloat16 only.
    _, rows = f8((table, w), ids, x)
    expected = table[ids].astype(jnp.bfloat16).astype(jnp.float32)
    np.testing.assert_array_equal(rows, expected)


def test_neither_operand_from_the_data_stays_16_bit():
    # A merged LoRA product computes a weight from two parameters.
    a, b = normal(7, (64, 16), 0.1), normal(8, (16, 64), 0.1)

    def loss(params, x):
        a, b = params
        return jnp.mean((x @ (a @ b)) ** 2)

    report = lossscale.matmuls(
        lossscale.autocast(loss, lossscale.Float8()), (a, b), X
    )
    assert [(m.dtype, m.why, m.weight) for m in report] == [
        ("bfloat16", "neither operand depends on the data", ""),
        (E4, "float8", "0, 1"),
    ]


def test_the_weight_is_found_through_scan_remat_jit_and_custom_vjp():
    stacked = normal(9, (3, 64, 64), 1 / 8)

    @jax.custom_vjp
    def scaled(w):
        return w * 0.5

    scaled.defvjp(lambda w: (scaled(w), None), lambda _, g: (g * 0.5,))

    @jax.jit
    def layer(h, w):
        return jnp.tanh(h @ scaled(w))

    def loss(stacked, x):
        def body(h, w):
            return jax.checkpoint(layer)(h, w), None

        h, _ = jax.lax.scan(body, x, stacked)
        return jnp.mean(h**2)

    f8 = lossscale.autocast(loss, lossscale.Float8(GW_HP))
    (matmul,) = lossscale.matmuls(f8, stacked, X)
    assert (matmul.dtype, matmul.weight) == (E4, "stacked")
    grad = jax.grad(f8)(stacked, X)
    assert relative_error(grad, jax.grad(loss)(stacked, X)) < 0.25
    # A closed-over weight is a constant, and a weight all the same (no
    # argument holds parameters: params_argnums=()).
    f8 = lossscale.autocast(
        lambda x: loss(stacked, x), lossscale.Float8(params_argnums=())
    )
    (matmul,) = lossscale.matmuls(f8, X)
    assert (matmul.dtype, matmul.weight) == (E4, "<constant>")


def test_params_argnums_says_which_arguments_hold_the_parameters():
    w = normal(3, (64, 128), 1 / 8)

    def loss(x, w):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    # By default the first argument: here the data, so that the product
    # is of a "parameter" by data, with x as the weight.
    default = lossscale.matmuls(
        lossscale.autocast(loss, lossscale.Float8()), X, w
    )
    assert [m.weight for m in default] == ["x"]
    moved = lossscale.autocast(loss, lossscale.Float8(params_argnums=1))
    assert [m.weight for m in lossscale.matmuls(moved, X, w)] == ["w"]
    with pytest.raises(TypeError, match="params_argnums must be"):
        lossscale.Float8(params_argnums="w")
    with pytest.raises(TypeError, match="params_argnums must be"):
        lossscale.Float8(params_argnums=(0, -1))
    with pytest.raises(ValueError, match="params_argnums=2"):
        lossscale.autocast(loss, lossscale.Float8(params_argnums=2))(X, w)


# --- layers kept out --------------------------------------------------------


def test_a_layer_kept_out_by_name_or_scope():
    loss, model, _ = _nnx()
    kept = lossscale.autocast(loss, lossscale.Float8(exclude="head"))
    report = lossscale.matmuls(kept, model, X)
    assert [(m.dtype, m.why) for m in report] == [
        (E4, "float8"),
        ("bfloat16", "Float8(exclude=...): 'head'"),
    ]

    def scoped(w, x):
        h = jnp.tanh(x @ w)
        with lossscale.compute_scope():
            return jnp.mean(h @ w.T)

    w = normal(3, (64, 64), 1 / 8)
    report = lossscale.matmuls(
        lossscale.autocast(scoped, lossscale.Float8()), w, X
    )
    assert [(m.dtype, m.why) for m in report] == [
        (E4, "float8"),
        ("bfloat16", "compute_scope"),
    ]
    with pytest.raises(TypeError, match="exclude must be"):
        lossscale.Float8(exclude=["head", ""])


def test_a_filter_or_rule_that_matches_nothing_warns_in_matmuls_too():
    loss, model, _ = _nnx()
    typo = lossscale.autocast(loss, lossscale.Float8(exclude="haed"))
    with pytest.warns(UserWarning, match="'haed' is part of no matmul"):
        lossscale.matmuls(typo, model, X)
    rule = lossscale.autocast(
        loss, lossscale.Float8(), function_rules={"head": "compute"}
    )
    with pytest.warns(UserWarning, match=r"function_rules\['head'\]"):
        lossscale.matmuls(rule, model, X)
    with warnings.catch_warnings():  # the control: a filter that matches
        warnings.simplefilter("error")
        lossscale.matmuls(
            lossscale.autocast(loss, lossscale.Float8(exclude="head")),
            model,
            X,
        )


def test_a_float8_function_without_a_float8_matmul_warns_once():
    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w) ** 2)

    w = normal(3, (64, 24), 1 / 8)  # N = 24
    f8 = lossscale.autocast(loss, lossscale.Float8())
    with pytest.warns(UserWarning, match="ran no float8 matmul.*N=24"):
        f8(w, X)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f8(w, X[:16])  # once only
        good = lossscale.autocast(loss, lossscale.Float8())
        good(normal(3, (64, 32), 1 / 8), X)  # the control


# --- autocast around a gradient ---------------------------------------------


def test_autocast_of_a_gradient_is_refused_with_the_way_round():
    w = normal(3, (64, 128), 1 / 8)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w @ w.T) ** 2)

    for recipe in ("tensorwise", GW_HP):
        wrong = lossscale.autocast(jax.grad(loss), lossscale.Float8(recipe))
        with pytest.raises(TypeError, match=r"jax\.grad\(lossscale\.autocast"):
            wrong(w, X)
    # The way round, and the 16-bit way out.
    right = jax.grad(lossscale.autocast(loss, lossscale.Float8()))(w, X)
    assert relative_error(right, jax.grad(loss)(w, X)) < 0.25
    out = lossscale.autocast(
        jax.grad(loss), lossscale.Float8(), rules={"dot_general": "compute"}
    )
    assert relative_error(out(w, X), jax.grad(loss)(w, X)) < 0.05


# --- a recipe is a row ----------------------------------------------------


def test_a_new_recipe_is_one_row():
    # Per-tensor scaling with a 16-bit weight gradient, a recipe no library
    # names: one row, read by the kernel and by the report.
    e4, e5 = lossscale.Float8Cast(E4), lossscale.Float8Cast(E5)
    high = lossscale.Float8Cast(None)
    row = lossscale.Float8Recipe(
        input=e4,
        weight=e4,
        grad_output=e5,
        weight_for_grad_input=e4,
        input_for_grad_weight=high,
        grad_output_for_grad_weight=high,
    )
    f8 = lossscale.autocast(
        _linear_loss(LAYERS["x @ w"][0]), lossscale.Float8(row)
    )
    w = LAYERS["x @ w"][1]
    assert [m.dtype for m in lossscale.matmuls(f8, w, X)] == [E4]
    jaxpr = jax.make_jaxpr(jax.grad(f8, (0, 1)))(w, X)
    assert sorted(tuple(sorted(d)) for d in fp8_dots(jaxpr)) == [
        (E4, E4),
        (E4, E5),
    ]
    # (on CPU its 16-bit operands are multiplied in float32)
    assert ("bfloat16", "bfloat16") in dot_dtypes(jaxpr, "cuda")
    # Its weight gradient is tensorwise's input gradient's partner, 16-bit:
    # at bfloat16's level.
    exact = jax.grad(_linear_loss(LAYERS["x @ w"][0]))(w, X)
    assert relative_error(jax.grad(f8)(w, X), exact) < 2**-8
    # The named recipes are rows too, and a row is checked.
    assert lossscale.Float8("rowwise").row == lossscale.Float8Recipe(
        *[lossscale.Float8Cast(E4, rowwise=True)] * 6, power_of_two_scales=True
    )
    with pytest.raises(ValueError, match="weight gradient's GEMM"):
        lossscale.Float8(row._replace(input_for_grad_weight=e4))
    with pytest.raises(TypeError, match=r"Float8Recipe\.input must be"):
        lossscale.Float8(row._replace(input=lossscale.Float8Cast(jnp.float16)))
    with pytest.raises(ValueError, match="recipe must be one of"):
        lossscale.Float8("rowwise_e5m2")


# --- found in a hostile review ---------------------------------------------


def test_a_loss_that_closes_over_its_batch_inside_a_jitted_step():
    # flax's pattern: loss_fn(params) closes over the batch, a value of the
    # enclosing jit's trace: data, not a constant (it made every matmul
    # "neither", and no float8 ran).
    params = {
        "w1": normal(3, (64, 64), 1 / 8),
        "w2": normal(4, (64, 32), 1 / 8),
    }

    def grads(params, x):
        def loss_fn(p):
            return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])

        return jax.grad(lossscale.autocast(loss_fn, lossscale.Float8()))(params)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "ran no float8 matmul"
        jaxpr = jax.make_jaxpr(jax.jit(grads))(params, X)
    # Two layers: a forward and two backward float8 matmuls each.
    assert len(fp8_dots(jaxpr)) == 6


def test_a_model_called_as_the_function_holds_the_weights():
    # autocast(model)(x): equinox's and NNX's modules are their weights;
    # the argument is the data.
    model = eqx.nn.MLP(64, 16, 128, 2, key=jax.random.key(0))
    report = lossscale.matmuls(
        lossscale.autocast(model, lossscale.Float8()), X[0]
    )
    assert [m.dtype for m in report] == [E4, E4, E4]
    # A plain function that closes over its weights says so.
    w = normal(3, (64, 64), 1 / 8)
    closed = lossscale.autocast(lambda x: x @ w, lossscale.Float8())
    with pytest.warns(UserWarning, match=r"params_argnums=\(\)"):
        assert lossscale.matmuls(closed, X)[0].dtype == "bfloat16"
        closed(X)
    fixed = lossscale.autocast(
        lambda x: x @ w, lossscale.Float8(params_argnums=())
    )
    assert lossscale.matmuls(fixed, X)[0].dtype == E4


def test_a_layer_called_at_several_places_keeps_each_weight():
    # One jax.jit-ed (or checkpointed) layer, one jaxpr, three weights: each
    # call is planned with its own (a shared plan named them all, and
    # exclude="head" kept every layer out).
    @jax.jit
    def layer(h, w):
        return jnp.tanh(h @ w)

    def loss(p, x):
        for name in ("w1", "w2", "head"):
            x = layer(x, p[name])
        return jnp.mean(x)

    params = {
        n: normal(i, (64, 64), 1 / 8)
        for i, n in enumerate(["w1", "w2", "head"])
    }
    f8 = lossscale.autocast(loss, lossscale.Float8(exclude="head"))
    report = lossscale.matmuls(f8, params, X)
    assert [(m.dtype, m.weight) for m in report] == [
        (E4, "w1"),
        (E4, "w2"),
        ("bfloat16", "head"),
    ]
    jaxpr = jax.make_jaxpr(jax.grad(f8))(params, X)
    assert len([d for d in fp8_dots(jaxpr) if d == (E4, E4)]) == 2


def test_exclude_matches_whole_parts_of_a_name():
    params = {
        "w1": normal(3, (64, 64), 1 / 8),
        "w10": normal(4, (64, 64), 1 / 8),
    }

    def loss(p, x):
        return jnp.mean(x @ p["w1"] @ p["w10"])

    f8 = lossscale.autocast(loss, lossscale.Float8(exclude="w1"))
    assert [(m.dtype, m.weight) for m in lossscale.matmuls(f8, params, X)] == [
        ("bfloat16", "w1"),
        (E4, "w10"),
    ]


def test_keeping_out_reaches_into_calls_loops_and_scopes():
    w, head = normal(3, (64, 64), 1 / 8), normal(4, (64, 64), 1 / 8)

    @jax.jit
    def head_fn(h, w):
        return h @ w

    def scoped(params, x):
        h = x @ params[0]
        with lossscale.compute_scope():
            return jnp.mean(head_fn(h, params[1]))

    def named(params, x):
        h = x @ params[0]
        with jax.named_scope("output"):
            return jnp.mean(jax.checkpoint(head_fn)(h, params[1]))

    for fun, kept, why in [
        (scoped, lossscale.Float8(), "compute_scope"),
        (
            named,
            lossscale.Float8(exclude="output"),
            "Float8(exclude=...): 'output'",
        ),
    ]:
        report = lossscale.matmuls(lossscale.autocast(fun, kept), (w, head), X)
        assert [(m.dtype, m.why) for m in report] == [
            (E4, "float8"),
            ("bfloat16", why),
        ]


def test_forward_mode_around_a_float8_function_is_refused():
    w = normal(3, (64, 64), 1 / 8)

    def loss(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    wrong = lossscale.autocast(jax.jacfwd(loss), lossscale.Float8())
    with pytest.raises(TypeError, match="derivative's matmul"):
        wrong(w, X[:16])

    # A gradient taken inside compute_scope is allowed: 16-bit there.
    def penalty(w, x):
        with lossscale.compute_scope():
            g = jax.grad(loss)(w, x)
        return loss(w, x) + jnp.sum(g**2)

    f8 = lossscale.autocast(penalty, lossscale.Float8())
    report = lossscale.matmuls(f8, w, X)
    assert [(m.dtype, m.why) for m in report] == [
        ("bfloat16", "compute_scope"),  # the gradient's forward ...
        ("bfloat16", "compute_scope"),  # ... and backward matmuls
        (E4, "float8"),
    ]


@pytest.mark.parametrize(
    "recipe, weight_shape, converted",
    # torchao's own cases (test/float8/test_auto_filter.py): an nn.Linear's
    # weight, (out_features, in_features), and whether it is converted.
    [
        ("tensorwise", (8192, 2048), True),
        ("tensorwise", (4096, 1024), False),
        ("rowwise", (4096, 8192), True),
        ("rowwise", (2048, 4096), False),
    ],
)
def test_auto_filter_is_torchaos(recipe, weight_shape, converted):
    x = (32, weight_shape[1])  # 32 rows of in_features
    dims = (((1,), (1,)), ((), ()))  # x @ W.T, the weight on the right
    auto = lossscale.Float8(recipe, auto_filter=True)
    reason = auto.ineligible(x, weight_shape, dims, weight=1)
    assert (reason is None) == converted, reason
    # Off by default: multiples of 16 are enough.
    assert lossscale.Float8(recipe).ineligible(x, weight_shape, dims, 1) is None
    with pytest.raises(ValueError, match="auto_filter has sizes"):
        lossscale.Float8(GW_HP, auto_filter=True)


# --- layers kept out by a callable ------------------------------------------

PARAMS = {
    "w1": normal(3, (64, 64), 1 / 8),
    "w2": normal(4, (64, 128), 1 / 8),
    "head": normal(5, (128, 32), 1 / 8),
}


def _three_layers(p, x):
    h = jnp.tanh(x @ p["w1"])
    h = jnp.tanh(h @ p["w2"])
    return jnp.mean(h @ p["head"])


def _wide(m):
    return m.out_features == 128


def test_a_callable_exclude_keeps_out_exactly_what_it_returns_true_for():
    f8 = lossscale.autocast(_three_layers, lossscale.Float8(exclude=_wide))
    assert f8._config.float8.exclude == (_wide,)  # alone, not in a tuple
    report = lossscale.matmuls(f8, PARAMS, X)
    assert [(m.dtype, m.weight, m.why) for m in report] == [
        (E4, "w1", "float8"),
        ("bfloat16", "w2", "Float8(exclude=...): _wide"),
        (E4, "head", "float8"),
    ]
    # The program: two float8 forward products, and w2's in bfloat16,
    # backward too (its input gradient and weight gradient).
    dots = dot_dtypes(jax.make_jaxpr(jax.grad(f8))(PARAMS, X))
    assert dots.count((E4, E4)) == 2
    assert dots.count(("bfloat16", "bfloat16")) == 3
    values = jax.grad(f8)(PARAMS, X)
    assert all(v.dtype == jnp.float32 for v in values.values())


def test_a_callable_exclude_that_returns_false_changes_nothing():
    seen = []

    def record(m):
        seen.append(m)
        return False

    def program(f):
        return dot_dtypes(jax.make_jaxpr(jax.grad(f))(PARAMS, X))

    plain = lossscale.autocast(_three_layers, lossscale.Float8())
    kept = lossscale.autocast(_three_layers, lossscale.Float8(exclude=record))
    # It warns in the listing and in the call, as a name that matches none.
    with pytest.warns(UserWarning, match="callable .*record returned True"):
        assert lossscale.matmuls(kept, PARAMS, X) == lossscale.matmuls(
            plain, PARAMS, X
        )
    with pytest.warns(UserWarning, match="callable .*record returned True"):
        assert program(kept) == program(plain)
    assert program(plain).count((E4, E4)) == 3
    assert {(m.weight, m.in_features, m.out_features) for m in seen} == {
        ("w1", 64, 64),
        ("w2", 64, 128),
        ("head", 128, 32),
    }


def test_a_callable_exclude_is_told_what_the_matmul_is():
    seen = set()

    def record(m):
        seen.add(m)
        return False

    @jax.jit
    def block(h, w):
        return jnp.tanh(h @ w)

    def loss(p, x):
        with jax.named_scope("decoder"):
            h = block(x, p["w1"])
        scores = h @ h.T  # not a linear layer
        out = p["w2"].T @ (scores @ h).T  # the weight on the left
        return jnp.mean(out)

    f8 = lossscale.autocast(loss, lossscale.Float8(exclude=record))
    with pytest.warns(UserWarning, match="returned True for no matmul"):
        lossscale.matmuls(f8, PARAMS, X)
    assert seen == {
        lossscale.MatmulInfo(
            "decoder/block", "w1", ((32, 64), (64, 64)), 1, 64, 64
        ),
        lossscale.MatmulInfo("", "", ((32, 64), (64, 32)), None, None, None),
        lossscale.MatmulInfo("", "", ((32, 32), (32, 64)), None, None, None),
        lossscale.MatmulInfo("", "w2", ((128, 64), (64, 32)), 0, 64, 128),
    }


def test_a_callable_exclude_decides_at_each_place_a_layer_is_called():
    # One jax.jit-ed layer, called in two scopes with the same weight: one
    # plan would serve both if the callable could not tell them apart.
    @jax.jit
    def layer(h, w):
        return jnp.tanh(h @ w)

    def loss(w, x):
        with jax.named_scope("encoder"):
            x = layer(x, w)
        with jax.named_scope("decoder"):
            return jnp.mean(layer(x, w))

    def decoder(m):
        return m.where.startswith("decoder/")

    w = PARAMS["w1"]
    f8 = lossscale.autocast(loss, lossscale.Float8(exclude=decoder))
    report = lossscale.matmuls(f8, w, X)
    assert [(m.dtype, m.where) for m in report] == [
        (E4, "encoder/layer"),
        ("bfloat16", "decoder/layer"),
    ]
    assert dot_dtypes(jax.make_jaxpr(f8)(w, X)) == [
        (E4, E4),
        ("bfloat16", "bfloat16"),
    ]


def test_names_and_callables_mixed_in_order():
    def head_too(m):
        return m.out_features in (128, 32)

    f8 = lossscale.autocast(
        _three_layers, lossscale.Float8(exclude=("head", head_too))
    )
    report = lossscale.matmuls(f8, PARAMS, X)
    assert [(m.dtype, m.why) for m in report] == [
        (E4, "float8"),
        ("bfloat16", f"Float8(exclude=...): {head_too.__qualname__}"),
        ("bfloat16", "Float8(exclude=...): 'head'"),  # the first entry's
    ]
    with warnings.catch_warnings():  # both matched: neither warns
        warnings.simplefilter("error")
        f8(PARAMS, X)


def test_a_callable_exclude_that_raises_propagates():
    def broken(m):
        raise ValueError(f"no rule for {m.weight}")

    f8 = lossscale.autocast(_three_layers, lossscale.Float8(exclude=broken))
    with pytest.raises(ValueError, match="no rule for w1"):
        f8(PARAMS, X)


def test_an_exclude_that_is_neither_a_name_nor_a_hashable_callable():
    class Unhashable:
        def __eq__(self, other):
            return self is other

        def __call__(self, m):
            return False

    for bad, shown in [
        (["head", 3], r"got 3 in exclude=\['head', 3\]"),
        (3, "got 3 in exclude=3"),
        ([_wide, ""], "got '' in"),
        ([Unhashable()], "got <.*Unhashable object"),
    ]:
        with pytest.raises(TypeError, match=f"exclude must be .*{shown}"):
            lossscale.Float8(exclude=bad)
    # A recipe with a callable is a static jit argument: hashable, equal
    # to another with the same function.
    assert lossscale.Float8(exclude=_wide) == lossscale.Float8(exclude=[_wide])
    assert hash(lossscale.Float8(exclude=("head", _wide))) is not None
