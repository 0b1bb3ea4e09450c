"""autocast on the GPT demo's model: the issue's memory and jaxpr targets.

The model is written once in float32 with no dtype arguments
(``_demo_gpt.make_model``); the reference is the same model cast by hand to
float16 through flax's ``dtype=`` (the demo's ``hand`` mode). Compiled
memory (``memory_analysis``) is deterministic on CPU, so it is asserted
here; times are measured in ``benchmarks/autocast.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lossscale
from lossscale.demo import _gpt as gpt

nnx = pytest.importorskip("flax.nnx")


def train_step(hand_cast, compute_dtype):
    """A jitted train step of the demo's GPT and its arguments."""
    config = gpt.Config()
    model = gpt.make_model(0, config, hand_cast)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = lossscale.loss_scaled(
        gpt.optimizer(300, config.learning_rate),
        lossscale.DynamicLossScale(),
        require_scaled_by=False,
    )

    def loss_fn(params, batch):
        inputs, targets = batch
        return gpt.cross_entropy(nnx.merge(graphdef, params)(inputs), targets)

    if compute_dtype is not None:
        loss_fn = lossscale.autocast(loss_fn, compute_dtype)

    def step(params, opt_state, batch):
        scale = lossscale.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(loss_fn(p, batch)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    ids = jnp.zeros((config.batch, config.context), jnp.int32)
    return step, (params, tx.init(params), (ids, ids)), loss_fn


def temp_bytes(step, args):
    compiled = jax.jit(step).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def dot_operand_dtypes(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(np.dtype(v.aval.dtype) for v in eqn.invars))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += dot_operand_dtypes(inner)
    return found


@pytest.mark.standard_promotion
def test_every_matmul_of_the_gpt_step_is_float16():
    _, args, loss_fn = train_step(None, jnp.float16)
    params, _, batch = args
    jaxpr = jax.make_jaxpr(jax.grad(loss_fn))(params, batch)
    seen = dot_operand_dtypes(jaxpr.jaxpr)
    f16 = np.dtype(jnp.float16)
    # 4 matmuls a block and the tied output embedding, forward; two per
    # matmul backward (the scan's forward and backward bodies hold them).
    assert len(seen) >= 15
    assert set(seen) == {(f16, f16)}
    # Negative control: the float32 model without autocast.
    _, _, loss32 = train_step(None, None)
    plain = dot_operand_dtypes(
        jax.make_jaxpr(jax.grad(loss32))(params, batch).jaxpr
    )
    assert set(plain) == {(np.dtype(np.float32),) * 2}


@pytest.mark.standard_promotion
def test_gpt_step_memory_is_within_ten_percent_of_the_hand_cast_model():
    auto = temp_bytes(*train_step(None, jnp.float16)[:2])
    hand = temp_bytes(*train_step(jnp.float16, None)[:2])
    full = temp_bytes(*train_step(None, None)[:2])
    assert auto <= 1.10 * hand, (auto / 1e6, hand / 1e6)
    assert auto < 0.8 * full, (auto / 1e6, full / 1e6)  # it saves memory
