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
and ``bf16`` (see :mod:`lossscale._demo_gpt` and ``docs/transformer.md``).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import math
import pathlib
import sys
import tempfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lossscale
from lossscale import _demo_common as common
from lossscale import _demo_gpt
from lossscale._demo_common import Result, require

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


# What the command line needs to know of each model.
MODELS = {
    "mlp": common.Model(
        modes=MODES,
        steps=2000,
        train=train,
        describe=f"the {DEPTH}-layer sigmoid MLP",
        plot=functools.partial(
            common.plot,
            title=f"{DEPTH}-layer sigmoid MLP, float16 compute with float32 "
            "weights",
        ),
        test_label="test loss",
        results="results.md",
        figure="lossscale_demo.png",
    ),
    "gpt": _demo_gpt.MODEL,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lossscale.demo",
        description="Train one model in float32, float16, float16 with a "
        "static loss scale and float16 with a dynamic loss scale (and, for "
        "the GPT, bfloat16), and compare.",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="mlp",
        help="the deep sigmoid MLP (default) or a character-level GPT "
        "trained on the Python standard library's source",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="per mode (default: "
        + ", ".join(f"{m.steps} for {name}" for name, m in MODELS.items())
        + ")",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of the model's modes (mlp: "
        + ",".join(MODES)
        + "; gpt: "
        + ",".join(_demo_gpt.MODES)
        + "); default all",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("lossscale_demo"),
        help="folder for the results table and the figure",
    )
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    if args.steps is None:
        args.steps = model.steps
    if args.steps < 10:
        parser.error(f"--steps must be at least 10, got {args.steps}")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.modes is None:
        args.modes = ",".join(model.modes)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in model.modes]
    if unknown or not modes or len(set(modes)) != len(modes):
        parser.error(
            f"--modes must be distinct names from {','.join(model.modes)}, "
            f"got {args.modes!r}"
        )
    args.modes = modes
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out must be a folder, got the file {args.out}")
    return args


def prepare_out(out: pathlib.Path) -> None:
    """Creates the --out folder and checks that it takes files.

    Before any training, so that a folder that cannot hold the results
    fails at once with a message rather than after minutes of training with
    a traceback. Exits with status 2, as argparse does for a bad flag.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        print(
            f"python -m lossscale.demo: error: --out must be a folder that "
            f"can be created and written to, got {str(out)!r}: {reason}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> list[Result]:
    args = parse_args(argv)
    prepare_out(args.out)
    model = MODELS[args.model]
    print(
        f"Training {model.describe} for {args.steps} steps in each mode "
        f"({', '.join(args.modes)}); seed {args.seed}."
    )
    results = [
        model.train(mode, args.steps, args.seed, progress=sys.stderr.isatty())
        for mode in args.modes
    ]
    report = common.table(results, model.test_label)
    print(report)
    (args.out / model.results).write_text(report + "\n")
    if not args.no_plot:
        path = args.out / model.figure
        model.plot(results, path)
        print(f"Figure: {path}")
    return results


if __name__ == "__main__":
    main()
