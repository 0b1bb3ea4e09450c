"""The problem loss scaling solves, and lossscale solving it.

Run ``python -m lossscale.demo`` (needs the ``demo`` extra: flax, matplotlib,
tqdm). It trains the same deep sigmoid MLP (flax NNX, float16 compute with
float32 master weights) on the same generated data, seed and optimizer in
four modes:

1. ``f32``: float32 compute (the reference);
2. ``f16``: float16 compute without loss scaling;
3. ``static``: float16 with a static loss scale of 2**15;
4. ``dynamic``: float16 with :class:`lossscale.DynamicLossScale`.

Why this model: a deep stack of sigmoids initialised as PyTorch's
``nn.Linear`` is (uniform in +-1/sqrt(fan_in)) has vanishing gradients, and
a mean-reduced loss over a large batch divides them further, so the
backward pass of the early layers produces values below float16's smallest
subnormal (about 6e-8): they become exactly zero, and the network stalls.
This is the effect described by Micikevicius et al. (2018); no gradient is
artificially shrunk. The table reports the fraction of gradient elements
that are exactly zero after unscaling (the float32 run shows the baseline),
the skipped steps and the final scale.

``python -m lossscale.demo --model gpt`` trains a small character-level GPT
on the Python standard library's source instead, in the same four modes
and ``bf16``, and on request in float8 (see ``docs/transformer.md``).
"""

from lossscale.demo._cli import MODELS, main, parse_args
from lossscale.demo._mlp import (
    BATCH,
    CLASSES,
    DEPTH,
    FEATURES,
    MODES,
    STATIC_SCALE,
    TEST_SIZE,
    TRAIN_SIZE,
    WIDTH,
    loss_scale_for,
    make_data,
    make_model,
    torch_linear_init,
    train,
)

__all__ = [
    "BATCH",
    "CLASSES",
    "DEPTH",
    "FEATURES",
    "MODELS",
    "MODES",
    "STATIC_SCALE",
    "TEST_SIZE",
    "TRAIN_SIZE",
    "WIDTH",
    "loss_scale_for",
    "main",
    "make_data",
    "make_model",
    "parse_args",
    "torch_linear_init",
    "train",
]
