"""autocast against float32 and against the same model cast by hand.

The model is the GPT of ``python -m lossscale.demo --model gpt`` (its
default size and batch), trained by one jitted step: the loss, its
gradient and ``loss_scaled(adam)``'s update. Three variants:

- ``float32``: the model as written (float32, no dtype arguments);
- ``hand-cast float16``: the same model with flax's ``dtype=float16`` on
  every layer and the attention scores and logits cast to float32 (the
  demo's ``hand`` mode), with a dynamic loss scale;
- ``autocast float16``: the float32 model under
  ``lossscale.autocast(loss_fn, jnp.float16)``, with a dynamic loss scale.

For each, in rounds that interleave the variants (so that a change in the
machine's speed hits them alike): the time to trace and lower the step,
the time to compile it, and the median step time; and once, the compiled
step's temporary memory (``memory_analysis``, deterministic). Ratios are
the medians of per-round ratios to the hand-cast step.

    python benchmarks/autocast.py [--quick] [--rounds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import lossscale
from lossscale.demo import _gpt as gpt

VARIANTS = ("float32", "hand-cast float16", "autocast float16")


def build(variant: str, config: gpt.Config):
    from flax import nnx

    hand = variant == "hand-cast float16"
    model = gpt.make_model(0, config, jnp.float16 if hand else None)
    graphdef, params = nnx.split(model, nnx.Param)
    scale = (
        lossscale.NoOpLossScale()
        if variant == "float32"
        else lossscale.DynamicLossScale(2.0**12)
    )
    tx = lossscale.loss_scaled(gpt.optimizer(300, config.learning_rate), scale)

    def loss_fn(params, batch):
        inputs, targets = batch
        return gpt.cross_entropy(nnx.merge(graphdef, params)(inputs), targets)

    if variant == "autocast float16":
        loss_fn = lossscale.autocast(loss_fn, jnp.float16)

    def step(params, opt_state, batch):
        loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(
            params, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    key = jax.random.key(1)
    ids = jax.random.randint(
        key, (config.batch, config.context + 1), 0, 97, jnp.int32
    )
    batch = (ids[:, :-1], ids[:, 1:])
    return step, (params, tx.init(params), batch)


def measure(variant: str, config: gpt.Config, steps: int) -> dict[str, float]:
    step, args = build(variant, config)
    start = time.perf_counter()
    lowered = jax.jit(step).lower(*args)
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    times = []
    params, opt_state, _ = out
    for _ in range(steps):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, args[2])
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
    memory = compiled.memory_analysis()
    return {
        "trace": traced - start,
        "compile": done - traced,
        "step": statistics.median(times),
        "temp": memory.temp_size_in_bytes / 1e6,
    }


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="1 round, 3 steps")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rounds, steps = (1, 3) if args.quick else (args.rounds, args.steps)
    config = gpt.Config()
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            results[variant].append(measure(variant, config, steps))

    def ratio(variant: str, key: str) -> float:
        return statistics.median(
            r[key] / h[key]
            for r, h in zip(
                results[variant], results["hand-cast float16"], strict=True
            )
        )

    lines = [
        "## autocast against the hand-cast model",
        "",
        f"The demo GPT's train step ({config.layers} layers, width "
        f"{config.width}, batch {config.batch} x {config.context}); "
        f"{rounds} interleaved rounds of {steps} steps; jax {jax.__version__}"
        f", {jax.devices()[0].platform} ({platform.processor() or 'cpu'}), "
        f"Python {sys.version.split()[0]}. Ratios: medians of per-round "
        "ratios to the hand-cast float16 step.",
        "",
        "| variant | trace + lower s | compile s | step ms | temp MB | "
        "trace + compile, ratio | step, ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in VARIANTS:
        rs = results[variant]
        both = statistics.median(
            (r["trace"] + r["compile"]) / (h["trace"] + h["compile"])
            for r, h in zip(rs, results["hand-cast float16"], strict=True)
        )
        lines.append(
            f"| {variant} "
            f"| {statistics.median(r['trace'] for r in rs):.2f} "
            f"| {statistics.median(r['compile'] for r in rs):.2f} "
            f"| {1e3 * statistics.median(r['step'] for r in rs):.1f} "
            f"| {rs[0]['temp']:.1f} "
            f"| {both:.2f} | {ratio(variant, 'step'):.2f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main()
