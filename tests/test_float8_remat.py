"""Float8 under ``jax.checkpoint``, ``nnx.remat`` and ``nn.remat``: what a
policy saves of a float8 step, against bfloat16 autocast's (issue 41,
item 2).

Each float8 matmul is bound as one equation (``_compat.bind_as_dot``) that
a policy saves or recomputes as it decides for the ``dot_general`` inside:
what it saves is the matmul's compute-dtype result, 2 bytes an element as
bfloat16 autocast's, not the float32 accumulator (4 bytes). The negative
control binds the matmul inline, as before, and saves more than bfloat16.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

# jax.ad_checkpoint.print_saved_residuals prints what this returns.
from jax._src.ad_checkpoint import saved_residuals
from jax.ad_checkpoint import checkpoint_name

import lossscale
from lossscale import _compat
from tests.helpers import normal

_POLICIES = {
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": (
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names(
        "hidden"
    ),
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}
_DOTS = ("dots_saveable", "dots_with_no_batch_dims_saveable", "checkpoint_dots")


def _residuals(fun, *args):
    """``(dtype, shape)`` of each residual ``jax.grad`` of ``fun`` saves,
    the arguments left out."""
    return [
        (np.dtype(aval.dtype), tuple(aval.shape))
        for aval, why in saved_residuals(fun, *args)
        if "argument" not in why
    ]


def _bytes(residuals):
    return sum(d.itemsize * int(np.prod(s)) for d, s in residuals)


def _saved(loss, dtype, *args):
    """Residual bytes of ``loss`` under autocast to ``dtype``."""
    return _bytes(_residuals(lossscale.autocast(loss, dtype), *args))


def _block(p, x):
    # Attention (its q, k, v saved by a dots policy: the softmax's
    # backward reads them) and an MLP (its up-projection saved: gelu's).
    b, t, d = x.shape
    q, k, v = ((x @ p[n]).reshape(b, t, 4, d // 4) for n in ("q", "k", "v"))
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0, -1)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(x.shape)
    x = x + o @ p["o"]
    h = checkpoint_name(x @ p["up"], "hidden")
    return x + jax.nn.gelu(h) @ p["down"]


def _block_params(d=64):
    p = {n: normal(i, (d, d), d**-0.5) for i, n in enumerate("qkvo")}
    p["up"] = normal(5, (d, 4 * d), d**-0.5)
    p["down"] = normal(6, (4 * d, d), (4 * d) ** -0.5)
    return p


def _checkpointed(policy):
    def loss(p, x):
        y = jax.checkpoint(_block, policy=policy)(p, x)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    return loss


def _plain(p, x):
    return jnp.mean(_block(p, x).astype(jnp.float32) ** 2)


@pytest.fixture
def inline(monkeypatch):
    """Binds the float8 matmuls inline from here on, as before."""
    # JAX keeps traces (a custom_vjp's forward, a jit's jaxpr): cleared,
    # so that what is traced next binds them inline.
    jax.clear_caches()
    monkeypatch.setattr(_compat, "_DOT", None)
    yield
    monkeypatch.undo()
    jax.clear_caches()


@pytest.fixture(scope="module")
def block_args():
    return _block_params(), normal(7, (2, 16, 64))


@pytest.mark.parametrize("name", list(_POLICIES))
def test_jax_checkpoint_saves_no_more_than_bf16(name, block_args):
    loss = _checkpointed(_POLICIES[name])
    bf16 = _bytes(
        _residuals(lossscale.autocast(loss, jnp.bfloat16), *block_args)
    )
    f8_fun = lossscale.autocast(loss, lossscale.Float8())
    f8 = _bytes(_residuals(f8_fun, *block_args))
    assert f8 <= bf16, (f8, bf16)
    if name in _DOTS:  # the same matmul results, in the same dtype
        assert f8 == bf16


def test_without_a_policy_float8_saves_at_most_0_85_of_bf16(block_args):
    bf16 = _bytes(
        _residuals(lossscale.autocast(_plain, jnp.bfloat16), *block_args)
    )
    f8 = _saved(_plain, lossscale.Float8(), *block_args)
    assert f8 <= 0.85 * bf16, (f8, bf16)


def test_a_dots_policy_saves_the_compute_dtype_result(block_args):
    """What is saved: the bfloat16 results of the matmuls bfloat16 autocast
    saves too, no float32 accumulator."""
    loss = _checkpointed(jax.checkpoint_policies.dots_saveable)
    bf16 = _residuals(lossscale.autocast(loss, jnp.bfloat16), *block_args)
    f8_fun = lossscale.autocast(loss, lossscale.Float8())
    dtypes = [m.dtype for m in lossscale.matmuls(f8_fun, *block_args)]
    assert dtypes.count("float8_e4m3fn") == 6
    f8 = _residuals(f8_fun, *block_args)
    assert sorted(f8) == sorted(bf16)
    # The q, k, v, output and up-projection results (the attention's
    # matmuls are 16-bit; the output projection's gives the input of the
    # up-projection's quantisation); the loss's own residual (float32) is
    # outside the block.
    f32 = np.dtype(np.float32)
    assert [s for d, s in f8 if d == f32] == [(2, 16, 64)]


def test_negative_control_inline_float8_saves_the_float32_accumulator(
    block_args, inline
):
    """The matmul bound inline (as before): a dots policy saves each float8
    matmul's float32 result, more than bfloat16 autocast saves."""
    loss = _checkpointed(jax.checkpoint_policies.dots_saveable)
    bf16 = _bytes(
        _residuals(lossscale.autocast(loss, jnp.bfloat16), *block_args)
    )
    f8_fun = lossscale.autocast(loss, lossscale.Float8())
    f8 = _residuals(f8_fun, *block_args)
    assert _bytes(f8) > 1.4 * bf16
    assert (np.dtype(np.float32), (2, 16, 256)) in f8


def test_values_and_gradients_unchanged(block_args, request):
    """Bitwise: the float8 loss and gradients with the matmul as one
    equation, remat or not, are those of the inline matmul."""
    got = {}
    for inline in (False, True):
        if inline:
            request.getfixturevalue("inline")
        for name in ("dots_saveable", None):
            loss = _plain if name is None else _checkpointed(_POLICIES[name])
            f8 = lossscale.autocast(loss, lossscale.Float8())
            got[inline, name] = jax.jit(jax.value_and_grad(f8))(*block_args)
    expected = got[True, None]
    for key, value in got.items():
        for a, b in zip(
            jax.tree.leaves(value), jax.tree.leaves(expected), strict=True
        ):
            np.testing.assert_array_equal(a, b, err_msg=str(key))


def test_vmap_of_a_remat_float8_gradient(block_args):
    p, x = block_args
    f8 = lossscale.autocast(
        _checkpointed(jax.checkpoint_policies.dots_saveable),
        lossscale.Float8(),
    )
    xs = jnp.stack([x, 2 * x])
    batched = jax.jit(jax.vmap(jax.grad(f8), (None, 0)))(p, xs)
    one = jax.jit(jax.grad(f8))
    for i in range(2):
        expected = jax.tree.leaves(one(p, xs[i]))
        for a, b in zip(jax.tree.leaves(batched), expected, strict=True):
            np.testing.assert_array_equal(a[i], b)


def test_an_offloading_policy_recomputes_the_float8_matmul(block_args):
    """A policy that offloads a dot's result to the host: the float8
    matmul is recomputed instead (nothing of it saved on the device)."""
    policy = jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        "device", "pinned_host"
    )
    f8 = lossscale.autocast(_checkpointed(policy), lossscale.Float8())
    nothing = lossscale.autocast(
        _checkpointed(jax.checkpoint_policies.nothing_saveable),
        lossscale.Float8(),
    )
    assert _residuals(f8, *block_args) == _residuals(nothing, *block_args)


# --- flax -------------------------------------------------------------------


class _LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(256)(x)
        h = checkpoint_name(h, "hidden")
        return nn.Dense(64)(jax.nn.gelu(h))


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 256, rngs=rngs)
        self.down = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
        h = checkpoint_name(self.up(x), "hidden")
        return self.down(jax.nn.gelu(h))


def _linen_loss(policy):
    remat = nn.remat(_LinenMLP, policy=policy)

    def loss(params, x):
        return jnp.mean(remat().apply(params, x).astype(jnp.float32) ** 2)

    params = remat().init(jax.random.key(1), jnp.zeros((32, 64)))
    return loss, params


def _nnx_loss(policy):
    graph, state = nnx.split(_NnxMLP(nnx.Rngs(0)))

    def loss(state, x):
        module = nnx.merge(graph, state)
        y = nnx.remat(lambda m, x: m(x), policy=policy)(module, x)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    return loss, state


@pytest.mark.parametrize("flax_api", ["nn.remat", "nnx.remat"])
@pytest.mark.parametrize("name", list(_POLICIES))
def test_flax_remat_saves_no_more_than_bf16(flax_api, name):
    make = _linen_loss if flax_api == "nn.remat" else _nnx_loss
    loss, params = make(_POLICIES[name])
    x = normal(3, (32, 64))
    bf16 = _saved(loss, jnp.bfloat16, params, x)
    f8 = _saved(loss, lossscale.Float8(), params, x)
    assert f8 <= bf16, (f8, bf16)
    if name in _DOTS:
        assert f8 == bf16
