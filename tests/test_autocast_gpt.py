"""autocast on the GPT demo's model: the issue's memory and jaxpr targets.

The model is written once in float32 with no dtype arguments
(``_demo_gpt.make_model``); the reference is the same model cast by hand to
float16 through flax's ``dtype=`` (the demo's ``hand`` mode). Compiled
memory (``memory_analysis``) is deterministic on CPU, so it is asserted
here; times are measured in ``benchmarks/autocast.py``.
"""

from __future__ import annotations

import functools

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


@functools.cache
def _autocast_temp(compute_dtype):
    """The temp bytes of the float32 model's step under autocast (cached:
    two tests compare the same compiled steps)."""
    return temp_bytes(*train_step(None, compute_dtype)[:2])


def _ratio_message(name, fp8, bf16, target):
    return (
        f"{name}: temp {fp8 / 1e6:.1f} MB against bfloat16 autocast's "
        f"{bf16 / 1e6:.1f} MB: {fp8 / bf16:.3f}x (target {target}x)"
    )


@pytest.mark.standard_promotion
@pytest.mark.xfail(
    strict=True,
    reason="issue 33's 0.85x is missed with the default eligibility: "
    "130.5 MB against 144.2 MB, 0.905x (jax 0.10.2). The scan's saved "
    "residuals fall from 74.7 to 67.3 MB: only the operands of the four "
    "linear layers' matmuls become one byte; 34.7 MB of float32 residuals "
    "(the residual stream, the attention softmax's output) and the "
    "bfloat16 attention weights (8.4 MB) and GELU input (8.4 MB) stay. "
    "The prototype's 0.80x had attention's batched matmuls in float8 too "
    "(its 'Linear dots only' row was 130.5 MB, as here); see the next test.",
)
def test_gpt_step_memory_in_float8_is_at_most_85_percent_of_bfloat16s():
    fp8 = _autocast_temp(lossscale.Float8())
    bf16 = _autocast_temp(jnp.bfloat16)
    assert fp8 <= 0.85 * bf16, _ratio_message("Float8()", fp8, bf16, 0.85)


# XLA:CPU's own figures: the same step compiles to other temp sizes from
# one jax release to the next. Measured: this test passes on jax 0.7.0
# (the CI's oldest), 0.9.2 (108.3 MB against 138.8, 0.78x) and 0.10.2
# (0.80x); on 0.12.0.1 the bfloat16 step fell to 99.5 MB while both float8
# steps rose above it (105.4 MB linear-only, 106.9 MB batched). The HLO
# says why: 0.10.2's XLA:CPU runs all 21 bfloat16 dots of the step as
# float32 dots (float32 operand copies inflate bfloat16's figure), 0.12's
# runs 20 in bfloat16 (YNNPACK), and both emulate float8 dots in float32
# (0.12 also converts the stacked float8 GELU output to float16, 8.4 MB).
# Neither is a GPU's figure: benchmarks/float8_gpu.py measures that.
@pytest.mark.xfail(
    jax.__version_info__ >= (0, 12),
    strict=True,
    reason="jax 0.12's XLA:CPU: float8 steps 105.4 and 106.9 MB against "
    "bfloat16 autocast's 99.5 MB: it runs bfloat16 dots natively and "
    "emulates float8 ones in float32 (see the comment)",
)
@pytest.mark.standard_promotion
def test_gpt_step_memory_in_float8_with_attention_in_float8_too():
    # Every matmul but the output head (N=97) in float8, as the prototype
    # measured: 115.8 MB against 144.2 MB, 0.803x (jax 0.10.2); and the
    # default (linear layers only) below bfloat16's all the same.
    bf16 = _autocast_temp(jnp.bfloat16)
    batched = _autocast_temp(lossscale.Float8(batched=True))
    assert batched <= 0.85 * bf16, _ratio_message(
        "Float8(batched=True)", batched, bf16, 0.85
    )
    default = _autocast_temp(lossscale.Float8())
    assert batched < default < bf16, (batched / 1e6, default / 1e6, bf16 / 1e6)
