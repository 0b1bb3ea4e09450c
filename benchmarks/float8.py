"""Float8 autocast on the demo GPT's train step, against bfloat16 autocast.

The model is the GPT of ``python -m lossscale.demo --model gpt`` (its
default size and batch, or ``--width``), written in float32, trained by one
jitted step: the loss, its gradient and ``loss_scaled(adam)``'s update
(no loss scale, as the demo's ``bf16`` and float8 modes). Variants:

- ``autocast bfloat16``: ``lossscale.autocast(loss_fn, jnp.bfloat16)``,
  the reference;
- ``float8 <recipe>``: ``lossscale.autocast(loss_fn,
  lossscale.Float8(recipe))`` for each recipe: the linear layers' matmuls
  in float8, the rest as the reference.

First, in rounds that interleave the variants (so that a change in the
machine's speed hits them alike), from cold caches and with the garbage
collector off: the time to trace the step (``jax.jit(step).trace``:
autocast's own work happens there), in wall time and in the tracing
thread's CPU time (``time.thread_time``: tracing is single-threaded
Python, and its CPU time is what other jobs on a shared machine disturb
least). Then, in fewer interleaved rounds: the time to trace and lower
the step, to compile it, and the median step time; and once, the
compiled step's temporary memory (``memory_analysis``, deterministic).
Ratios are the medians of per-round ratios to the reference. XLA:CPU has
no float8 arithmetic (it converts float8 operands to float32 and runs a
float32 matmul), so on a CPU the compile and step times of the float8
variants say nothing of a GPU's: ``benchmarks/float8_gpu.py`` measures
those.

    python benchmarks/float8.py [--quick] [--trace-rounds N] [--rounds N]
        [--steps N] [--width W] [--out FILE]

(``--quick``: one round of each, one step, the reference and
``tensorwise`` only: the smoke test's.)
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import lossscale
from lossscale.demo import _gpt as gpt

REFERENCE = "autocast bfloat16"
VARIANTS = (REFERENCE, *(f"float8 {r}" for r in gpt.FLOAT8_MODES.values()))


def compute_dtype(variant: str) -> Any:
    """What ``variant`` passes to :func:`lossscale.autocast`."""
    if variant == REFERENCE:
        return jnp.bfloat16
    return lossscale.Float8(variant.removeprefix("float8 "))


def build(
    variant: str, config: gpt.Config, *, hand_cast: Any = None, attention=None
):
    """The jitted-to-be train step of ``variant``, its arguments, and its
    autocast loss function.

    ``hand_cast`` (a dtype) builds the model cast by hand instead, with no
    autocast (``variant`` is then only a name); ``attention`` replaces the
    model's attention (``gpt.make_model``'s)."""
    from flax import nnx

    model = gpt.make_model(0, config, hand_cast=hand_cast, attention=attention)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = lossscale.loss_scaled(
        gpt.optimizer(300, config.learning_rate), lossscale.NoOpLossScale()
    )

    def loss_fn(params, batch):
        inputs, targets = batch
        return gpt.cross_entropy(nnx.merge(graphdef, params)(inputs), targets)

    if hand_cast is None:
        loss_fn = lossscale.autocast(loss_fn, compute_dtype(variant))

    def step(params, opt_state, batch):
        loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(
            params, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    ids = jax.random.randint(
        jax.random.key(1), (config.batch, config.context + 1), 0, 97, jnp.int32
    )
    batch = (ids[:, :-1], ids[:, 1:])
    return step, (params, tx.init(params), batch), loss_fn


def time_steps(compiled, args, steps: int) -> float:
    """The median time of ``steps`` steps after one warm-up step."""
    params, opt_state, batch = args
    params, opt_state, loss = compiled(params, opt_state, batch)
    jax.block_until_ready(loss)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, batch)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trace_times(variant: str, config: gpt.Config) -> dict[str, float]:
    """The time to trace ``variant``'s step, cold, in wall and in CPU time,
    with the garbage collector off (as ``timeit`` does)."""
    step, args, _ = build(variant, config)
    jax.clear_caches()  # cold: nothing traced by another variant
    gc.collect()
    gc.disable()
    try:
        start, cpu_start = time.perf_counter(), time.thread_time()
        jax.jit(step).trace(*args)
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu_start
    finally:
        gc.enable()
    return {"trace": wall, "trace_cpu": cpu}


def measure(variant: str, config: gpt.Config, steps: int) -> dict[str, float]:
    step, args, _ = build(variant, config)
    jax.clear_caches()  # cold: nothing traced or lowered by another variant
    start = time.perf_counter()
    lowered = jax.jit(step).trace(*args).lower()
    t_lower = time.perf_counter()
    compiled = lowered.compile()
    t_compile = time.perf_counter()
    return {
        "trace_lower": t_lower - start,
        "compile": t_compile - t_lower,
        "step": time_steps(compiled, args, steps) if steps else float("nan"),
        "temp": compiled.memory_analysis().temp_size_in_bytes / 1e6,
    }


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace-rounds", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=gpt.Config().width)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 round of each, 1 step, the reference and tensorwise only",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    trace_rounds, rounds, steps = (
        (1, 1, 1)
        if args.quick
        else (args.trace_rounds, args.rounds, args.steps)
    )
    if rounds > trace_rounds:
        parser.error(
            f"--rounds must be at most --trace-rounds ({trace_rounds}), got "
            f"{rounds}"
        )
    config = gpt.Config(width=args.width)
    variants = VARIANTS[:2] if args.quick else VARIANTS
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for _ in range(trace_rounds):
        for variant in variants:
            results[variant].append(trace_times(variant, config))
    for i in range(rounds):
        for variant in variants:
            # Round i's compile and steps beside trace round i's.
            results[variant][i] |= measure(variant, config, steps)

    def median(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[variant] if key in r)

    def ratio(variant: str, key: str) -> float:
        return statistics.median(
            r[key] / b[key]
            for r, b in zip(results[variant], results[REFERENCE], strict=True)
            if key in r
        )

    lines = [
        "## float8 against bfloat16 autocast",
        "",
        f"The demo GPT's train step ({config.layers} layers, width "
        f"{config.width}, batch {config.batch} x {config.context}); "
        f"{trace_rounds} interleaved rounds of tracing, then {rounds} of "
        f"lowering, compiling and {steps} timed steps; jax "
        f"{jax.__version__}, {jax.devices()[0].platform} "
        f"({platform.processor() or 'cpu'}), Python "
        f"{sys.version.split()[0]}. Ratios: medians of per-round ratios to "
        f"the {REFERENCE} step.",
        "",
        "| variant | trace CPU s | trace s | trace + lower s | compile s "
        "| step ms | temp MB | trace CPU, ratio | trace, ratio "
        "| compile, ratio | step, ratio | temp, ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for variant in variants:
        lines.append(
            f"| {variant} "
            f"| {median(variant, 'trace_cpu'):.2f} "
            f"| {median(variant, 'trace'):.2f} "
            f"| {median(variant, 'trace_lower'):.2f} "
            f"| {median(variant, 'compile'):.2f} "
            f"| {1e3 * median(variant, 'step'):.1f} "
            f"| {results[variant][0]['temp']:.1f} "
            f"| {ratio(variant, 'trace_cpu'):.2f} "
            f"| {ratio(variant, 'trace'):.2f} "
            f"| {ratio(variant, 'compile'):.2f} "
            f"| {ratio(variant, 'step'):.2f} "
            f"| {ratio(variant, 'temp'):.2f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main()
