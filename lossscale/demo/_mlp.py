"""The deep sigmoid MLP of ``python -m lossscale.demo`` (the default model).

It trains the same deep sigmoid MLP (flax NNX, float16 compute with
float32 master weights) on the same generated data, seed and optimizer in
four modes: ``f32`` (the reference), ``f16`` (no loss scaling), ``static``
(a static loss scale of 2**15) and ``dynamic``
(:class:`lossscale.DynamicLossScale`). See the package's docstring for why
this model's float16 gradients underflow.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale
from lossscale.demo import _common as common
from lossscale.demo._common import Result, require

MODES = ("f32", "f16", "static", "dynamic")
DEPTH, WIDTH, FEATURES, CLASSES = 8, 64, 16, 4
BATCH, TRAIN_SIZE, TEST_SIZE = 1024, 8192, 2048
STATIC_SCALE = 2.0**15


def make_data(seed: int):
    """A 4-class problem labelled by a random two-layer teacher network."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(TRAIN_SIZE + TEST_SIZE, FEATURES)).astype(np.float32)
    hidden = np.tanh(x @ rng.normal(size=(FEATURES, 32)))
    y = np.argmax(hidden @ rng.normal(size=(32, CLASSES)), axis=1)
    return (
        (jnp.asarray(x[:TRAIN_SIZE]), jnp.asarray(y[:TRAIN_SIZE])),
        (jnp.asarray(x[TRAIN_SIZE:]), jnp.asarray(y[TRAIN_SIZE:])),
    )


def torch_linear_init(fan_in: int):
    """PyTorch's nn.Linear default for weights and biases alike.

    Both are uniform in +-1/sqrt(fan_in) (kaiming_uniform with a=sqrt(5)
    for the weights).
    """
    bound = 1.0 / math.sqrt(fan_in)

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _nnx_list(nnx):
    """The container for a list of submodules on this flax version.

    flax 0.12 wants ``nnx.List`` (it rejects a plain list holding modules);
    flax 0.11, the oldest version the ``demo`` extra allows, has no
    ``nnx.List`` and treats a plain list of modules as a pytree node.
    """
    return getattr(nnx, "List", list)


def make_model(seed: int, dtype):
    nnx = require("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            sizes = [FEATURES] + [WIDTH] * (DEPTH - 1) + [CLASSES]
            self.layers = _nnx_list(nnx)(
                [
                    nnx.Linear(
                        fan_in,
                        fan_out,
                        dtype=dtype,
                        param_dtype=jnp.float32,
                        kernel_init=torch_linear_init(fan_in),
                        bias_init=torch_linear_init(fan_in),
                        rngs=rngs,
                    )
                    for fan_in, fan_out in itertools.pairwise(sizes)
                ]
            )

        def __call__(self, x):
            h = x.astype(self.layers[0].dtype)
            for layer in self.layers[:-1]:
                h = jax.nn.sigmoid(layer(h))
            return self.layers[-1](h).astype(jnp.float32)

    return MLP(nnx.Rngs(seed))


def loss_scale_for(mode: str) -> lossscale.LossScale:
    if mode == "static":
        return lossscale.StaticLossScale(STATIC_SCALE)
    if mode == "dynamic":
        return lossscale.DynamicLossScale(2.0**16, growth_interval=200)
    return lossscale.NoOpLossScale()


def train(mode: str, steps: int, seed: int, progress: bool = True) -> Result:
    nnx = require("flax.nnx")
    train_data, (x_test, y_test) = make_data(seed)
    model = make_model(seed, common.compute_dtype(mode))
    tx = lossscale.loss_scaled(optax.adam(1e-3), loss_scale_for(mode))
    graphdef, params = nnx.split(model, nnx.Param)

    def sample(key, data):
        x, y = data
        idx = jax.random.randint(key, (BATCH,), 0, TRAIN_SIZE)
        return x[idx], y[idx]

    def loss_fn(params, batch):
        x, y = batch
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    step = common.make_step(loss_fn, sample, tx)
    keys = jax.random.split(jax.random.key(seed + 1), steps)
    params, records, seconds = common.run_steps(
        step, params, tx.init(params), train_data, keys, mode, progress
    )

    # Evaluate the final weights the same way for every mode: in float32.
    eval_model = make_model(seed, jnp.float32)
    nnx.update(eval_model, params)
    logits = eval_model(x_test)
    test_loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, y_test
    ).mean()
    accuracy = jnp.mean(jnp.argmax(logits, axis=1) == y_test)
    return common.result(mode, records, test_loss, accuracy, seconds)
