"""A small character-level GPT for ``python -m lossscale.demo --model gpt``.

A GPT-2-style decoder in flax NNX (pre-LayerNorm blocks of causal
self-attention and a GELU MLP, learned positions, tied input and output
embeddings) trained on the Python standard library's source (see
:mod:`lossscale.demo._text`) in six modes by default:

1. ``f32``: float32 compute (the reference);
2. ``f16``: :func:`lossscale.autocast` to float16 (float32 master
   weights), no loss scaling;
3. ``static``: autocast to float16 with a static loss scale;
4. ``dynamic``: autocast to float16 with :class:`lossscale.DynamicLossScale`;
5. ``bf16``: autocast to bfloat16 (float32's range, so no scaling);
6. ``hand``: float16 cast by hand (``dtype=`` on every layer, the attention
   scores and the logits cast to float32), with the dynamic scale: what
   autocast replaces, for comparison.

and, on request (``--modes``), three float8 modes, one per recipe of
:class:`lossscale.Float8` (current scaling):

7. ``fp8``: ``autocast(loss_fn, lossscale.Float8("tensorwise"))``;
8. ``fp8-rowwise``: ``Float8("rowwise")``;
9. ``fp8-rowwise-gw-hp``: ``Float8("rowwise_with_gw_hp")``.

Each runs the linear layers' matmuls (``x @ w`` of q, k, v, the attention
output and the MLP) in float8 and everything else, attention's batched
matmuls and the output head included, as the ``bf16`` mode does. They
need no loss scale: every float8 operand and gradient is scaled by its own
amax in that step (current scaling), so a small gradient is scaled up into
float8's range before it is quantised, whatever the loss scale, and the
rest of the program is bfloat16, whose exponent range is float32's. They
are not in the default run because XLA:CPU has no float8 arithmetic: it
emulates each float8 matmul in float32 plus the quantisation, and a step
of per-tensor scaling takes about twice a bfloat16 step's time there.

The model is written once, in float32, with no dtype arguments and no
casts; autocast decides the precision of each operation. The setup is the
usual one, not one chosen to make float16 fail: GPT-2's initialisation
(normal with std 0.02, residual projections divided by sqrt(2 * layers)),
the mean of the token cross-entropies as the loss, Adam with warmup, cosine
decay and gradient clipping (no weight decay: a run this short does not
overfit).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale
from lossscale.demo import _common as common
from lossscale.demo import _text as text
from lossscale.demo._common import Result, require

MODES = ("f32", "f16", "static", "dynamic", "bf16", "hand")
# The float8 modes (not run by default) and their lossscale.Float8 recipe.
FLOAT8_MODES = {
    "fp8": "tensorwise",
    "fp8-rowwise": "rowwise",
    "fp8-rowwise-gw-hp": "rowwise_with_gw_hp",
}
STEPS = 300
# The policies of jax.checkpoint_policies that take no argument.
REMAT_POLICIES = (
    "everything_saveable",
    "nothing_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)
TRAIN_CHARS, HELDOUT_CHARS, EVAL_WINDOWS = 2_000_000, 100_000, 1024
STATIC_SCALE = 2.0**15
# PyTorch's GradScaler starts at 2**16 and grows every 2000 clean steps,
# which would never happen in a run this short: growing every 50 steps lets
# the scale climb to where this model's gradients overflow and back off.
GROWTH_INTERVAL = 50


@dataclasses.dataclass(frozen=True)
class Config:
    """The model's size and the optimizer's settings.

    The defaults train 300 steps in under a minute per mode on a 2-core
    CPU: 4096 characters per batch, 210k weights. ``--width`` on the
    command line changes ``width`` alone (the heads stay 4).
    """

    layers: int = 4
    width: int = 64
    heads: int = 4
    context: int = 64
    batch: int = 64
    learning_rate: float = 3e-3
    # A ``jax.checkpoint_policies`` name: each block runs under
    # ``nnx.remat`` with that policy (the benchmarks' remat rows); None
    # saves what autodiff saves.
    remat: str | None = None


def _stacked(nnx, make, rngs, count: int):
    """``count`` modules made by ``make(rngs)``, stacked on a leading axis.

    ``nnx.vmap`` over split random streams gives each layer its own
    initial weights in one array per parameter, which ``nnx.scan`` then
    walks through: one traced layer however deep the model.
    """

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return make(rngs)

    return create(rngs)


def causal_attention(q, k, v):
    """Causal multi-head attention over ``[batch, time, heads, head_dim]``.

    Written in float32 with no casts: under :func:`lossscale.autocast` the
    two matmuls run in the compute dtype and the softmax in float32.
    (``jax.nn.dot_product_attention`` would do as well, but its float16
    backward pass asks for a dot precision that XLA's CPU backend lacks.)
    """
    steps = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((steps, steps), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v)


def hand_cast_attention(q, k, v):
    """:func:`causal_attention` cast by hand, as before autocast: the
    scores go to float32 for the softmax, the weights back to ``v``'s
    dtype for the second matmul."""
    steps = q.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k).astype(jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((steps, steps), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights.astype(v.dtype), v)


def make_model(
    seed: int, config: Config = Config(), hand_cast=None, attention=None
):
    """The GPT, with float32 weights.

    Args:
        seed: the initialisation's seed.
        config: the size.
        hand_cast: ``None`` (the model as written: float32, no dtype
            arguments), or a dtype that every layer computes in through
            flax's ``dtype=`` (the ``hand`` mode's float16 reference).
        attention: ``attention(q, k, v)`` over ``[batch, time, heads,
            head_dim]``, causal; by default :func:`causal_attention`
            (:func:`hand_cast_attention` with ``hand_cast``).
            ``benchmarks/gpu_hlo.py`` passes cuDNN's flash attention.
    """
    nnx = require("flax.nnx")
    width, heads = config.width, config.heads
    # GPT-2: std 0.02 everywhere, and 0.02 / sqrt(2 * layers) for the two
    # projections that write into the residual stream, so that its variance
    # does not grow with depth.
    normal = jax.nn.initializers.normal
    weights = normal(0.02)
    residual = normal(0.02 / math.sqrt(2 * config.layers))
    dense = {} if hand_cast is None else dict(dtype=hand_cast)
    if attention is None:
        attention = (
            causal_attention if hand_cast is None else hand_cast_attention
        )
    norm = functools.partial(nnx.LayerNorm, width, epsilon=1e-5, **dense)
    remat = None
    if config.remat is not None:
        if config.remat not in REMAT_POLICIES:
            raise ValueError(
                f"config.remat must be one of {REMAT_POLICIES} (a policy of "
                f"jax.checkpoint_policies) or None, got {config.remat!r}"
            )
        remat = getattr(jax.checkpoint_policies, config.remat)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm1 = norm(rngs=rngs)
            self.qkv = nnx.Linear(
                width, 3 * width, kernel_init=weights, rngs=rngs, **dense
            )
            self.attn_out = nnx.Linear(
                width, width, kernel_init=residual, rngs=rngs, **dense
            )
            self.norm2 = norm(rngs=rngs)
            self.up = nnx.Linear(
                width, 4 * width, kernel_init=weights, rngs=rngs, **dense
            )
            self.down = nnx.Linear(
                4 * width, width, kernel_init=residual, rngs=rngs, **dense
            )

        def __call__(self, x):
            batch, steps, _ = x.shape
            qkv = self.qkv(self.norm1(x))
            q, k, v = jnp.split(
                qkv.reshape(batch, steps, 3 * heads, width // heads), 3, axis=2
            )
            attended = attention(q, k, v).reshape(x.shape)
            x = x + self.attn_out(attended)
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs):
            embed = functools.partial(
                nnx.Embed, embedding_init=weights, rngs=rngs, **dense
            )
            self.tokens = embed(text.VOCAB, width)
            self.positions = embed(config.context, width)
            self.blocks = _stacked(nnx, Block, rngs, config.layers)
            self.norm = norm(rngs=rngs)

        def __call__(self, ids):
            x = self.tokens(ids) + self.positions(jnp.arange(ids.shape[-1]))

            def apply(x, block):
                return block(x)

            if remat is not None:
                apply = nnx.remat(apply, policy=remat)

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def through(x, block):
                return apply(x, block)

            x = through(x, self.blocks)
            logits = self.tokens.attend(self.norm(x))  # tied embedding
            # Only the hand-cast model needs this cast (a no-op in float32).
            return logits.astype(jnp.float32)

    return GPT(nnx.Rngs(seed))


def compute_dtype(mode: str):
    """What ``mode`` passes to :func:`lossscale.autocast`: a dtype, or a
    :class:`lossscale.Float8` recipe for the float8 modes."""
    if mode in FLOAT8_MODES:
        # The output head (tied to the token embedding) stays 16-bit, as
        # torchao's module_filter_fn keeps a model's head out.
        return lossscale.Float8(FLOAT8_MODES[mode], exclude="tokens.embedding")
    return common.compute_dtype(mode)


def loss_scale_for(mode: str) -> lossscale.LossScale:
    if mode == "static":
        return lossscale.StaticLossScale(STATIC_SCALE)
    if mode in ("dynamic", "hand"):
        return lossscale.DynamicLossScale(growth_interval=GROWTH_INTERVAL)
    return lossscale.NoOpLossScale()


def optimizer(steps: int, peak: float) -> optax.GradientTransformation:
    """Adam with linear warmup, cosine decay to a tenth, and clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak,
        warmup_steps=max(1, steps // 10),
        decay_steps=steps,
        end_value=peak / 10,
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adam(schedule, b2=0.99)
    )


def cross_entropy(logits, targets):
    """The mean over every predicted character, in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, targets
    ).mean()


def sampler(config: Config):
    """``sample(key, data)``: random windows of the encoded training text.

    Returns the windows' first ``context`` characters as inputs and the
    same windows shifted by one as the characters to predict.
    """

    def sample(key, data):
        shape = (config.batch, 1)
        starts = jax.random.randint(key, shape, 0, len(data) - config.context)
        windows = data[starts + jnp.arange(config.context + 1)]
        windows = windows.astype(jnp.int32)
        return windows[:, :-1], windows[:, 1:]

    return sample


def heldout_loss(model, heldout: np.ndarray, context: int) -> float:
    """The mean loss over ``EVAL_WINDOWS`` consecutive held-out windows."""
    nnx = require("flax.nnx")
    windows = heldout[: EVAL_WINDOWS * (context + 1)]
    windows = windows.reshape(-1, context + 1).astype(np.int32)

    @nnx.jit
    def loss(model, windows):
        return cross_entropy(model(windows[:, :-1]), windows[:, 1:])

    return float(np.mean([loss(model, w) for w in np.split(windows, 8)]))


def train(
    mode: str,
    steps: int,
    seed: int,
    progress: bool = True,
    config: Config = Config(),
) -> Result:
    """Train in ``mode``, then evaluate the held-out loss in float32."""
    nnx = require("flax.nnx")
    corpus = text.load_corpus(TRAIN_CHARS, HELDOUT_CHARS)
    hand = mode == "hand"
    model = make_model(seed, config, jnp.float16 if hand else None)
    tx = lossscale.loss_scaled(
        optimizer(steps, config.learning_rate), loss_scale_for(mode)
    )
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_fn(params, batch):
        inputs, targets = batch
        return cross_entropy(nnx.merge(graphdef, params)(inputs), targets)

    if mode not in ("f32", "hand"):
        loss_fn = lossscale.autocast(loss_fn, compute_dtype(mode))
    step = common.make_step(loss_fn, sampler(config), tx)
    keys = jax.random.split(jax.random.key(seed + 1), steps)
    params, records, seconds = common.run_steps(
        step,
        params,
        tx.init(params),
        jnp.asarray(corpus.train),
        keys,
        mode,
        progress,
    )
    # Evaluate the final weights the same way for every mode: in float32.
    eval_model = make_model(seed, config)
    nnx.update(eval_model, params)
    loss = heldout_loss(eval_model, corpus.heldout, config.context)
    return common.result(mode, records, loss, None, seconds)


def model(config: Config = Config()) -> common.Model:
    """What the command line needs to know of the GPT of this size."""
    size = (
        f"width {config.width}, context {config.context}, batch {config.batch}"
    )
    return common.Model(
        modes=(*MODES, *FLOAT8_MODES),
        default_modes=MODES,
        steps=STEPS,
        train=functools.partial(train, config=config),
        describe=f"a {config.layers}-layer character-level GPT ({size}) on "
        "the Python standard library's source",
        plot=functools.partial(
            common.plot,
            title=f"{config.layers}-layer character-level GPT ({size}) on "
            "the Python standard library's source",
            # The modes differ by hundredths of a nat and float16's
            # underflow peaks at a tenth of the elements: both need a
            # closer look.
            zero_ylim=None,
            difference_window=25,
        ),
        test_label="held-out loss",
        results="gpt_results.md",
        figure="gpt_demo.png",
    )


MODEL = model()
