"""The trace of a float8 train step against bfloat16 autocast's.

A 12-layer transformer (causal attention, a GELU MLP and two layer norms,
jnp only, ``benchmarks/autocast_trace.py``'s layers) at width 128, its
train step ``jax.grad`` of the autocast loss and an adam update, with its
layers unrolled and under ``lax.scan``. For bfloat16 autocast and each
float8 recipe, in rounds that interleave them, from cold caches
(``jax.clear_caches``) and with the garbage collector off: the CPU time of
``jax.jit(step).trace(...)`` and of the trace and its ``.lower()``
together (both single-threaded Python, whose CPU time is what other jobs
disturb least; issue 41's target is on the two together), and, in the
first round only, the time to compile the lowered step. Ratios are the
medians of per-round ratios to the bfloat16 step's. XLA:CPU emulates
float8, so the compile times are reported, not targeted.

    python benchmarks/float8_trace.py [--rounds 7] [--layers 12]
        [--width 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax
from jax import lax

import lossscale

HERE = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location(
    "autocast_trace", HERE / "autocast_trace.py"
)
assert _spec is not None and _spec.loader is not None
layers_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers_module)

VARIANTS = {
    "autocast bfloat16": jnp.bfloat16,
    "float8 tensorwise": lossscale.Float8("tensorwise"),
    "float8 rowwise": lossscale.Float8("rowwise"),
    "float8 rowwise_with_gw_hp": lossscale.Float8("rowwise_with_gw_hp"),
}
REFERENCE = "autocast bfloat16"


def block(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    m = layers_module
    x = x + m._attention(m._layer_norm(x, p["ln1_g"], p["ln1_b"]), p)
    return x + m._mlp(m._layer_norm(x, p["ln2_g"], p["ln2_b"]), p)


def layer_params(key: jax.Array, width: int) -> dict[str, jax.Array]:
    k = jax.random.split(key, 4)

    def normal(i: int, shape: tuple[int, ...]) -> jax.Array:
        return jax.random.normal(k[i], shape) * 0.02

    return {
        "ln1_g": jnp.ones(width), "ln1_b": jnp.zeros(width),
        "ln2_g": jnp.ones(width), "ln2_b": jnp.zeros(width),
        "qkv": normal(0, (width, 3 * width)), "qkv_b": jnp.zeros(3 * width),
        "o": normal(1, (width, width)), "o_b": jnp.zeros(width),
        "up": normal(2, (width, 4 * width)), "up_b": jnp.zeros(4 * width),
        "down": normal(3, (4 * width, width)), "down_b": jnp.zeros(width),
    }  # fmt: skip


def unrolled(params: list[dict[str, jax.Array]], x: jax.Array) -> jax.Array:
    for p in params:
        x = block(x, p)
    return jnp.mean(x**2)


def scanned(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    x, _ = lax.scan(lambda x, p: (block(x, p), None), x, params)
    return jnp.mean(x**2)


def build(variant: str, layout: str, layers: int, width: int):
    """The train step of ``variant`` and its arguments."""
    keys = jax.random.split(jax.random.key(0), layers + 1)
    per_layer = [layer_params(keys[i], width) for i in range(layers)]
    if layout == "unrolled":
        loss, params = unrolled, per_layer
    else:
        loss, params = (
            scanned,
            jax.tree.map(lambda *a: jnp.stack(a), *per_layer),
        )
    loss = lossscale.autocast(loss, VARIANTS[variant])
    tx = optax.adam(1e-3)

    def step(params, opt_state, x):
        grads = jax.grad(loss)(params, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    x = jax.random.normal(keys[-1], (8, 32, width))
    return step, (params, tx.init(params), x)


def measure(
    variant: str, layout: str, layers: int, width: int, compile_too: bool
) -> dict[str, float]:
    step, args = build(variant, layout, layers, width)
    jax.clear_caches()  # cold: nothing traced by another variant
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        traced = jax.jit(step).trace(*args)
        traced_at = time.thread_time()
        lowered = traced.lower()
        result = {
            "trace": traced_at - start,
            "trace + lower": time.thread_time() - start,
        }
    finally:
        gc.enable()
    if compile_too:
        start = time.perf_counter()
        lowered.compile()
        result["compile"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lines = [
        "## The trace of a float8 train step against bfloat16 autocast's",
        "",
        f"A {args.layers}-layer transformer, width {args.width}, batch 8 x 32; "
        f"{args.rounds} interleaved rounds of cold traces (CPU time, the "
        "garbage collector off), the compile in the first round; jax "
        f"{jax.__version__}, {jax.devices()[0].platform} "
        f"({platform.processor() or 'cpu'}), Python "
        f"{sys.version.split()[0]}. Ratios: medians of per-round ratios to "
        f"the {REFERENCE} step's.",
        "",
        "| layers | variant | trace CPU s | trace, ratio "
        "| trace + lower CPU s | trace + lower, ratio | compile s "
        "| compile, ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout in ("unrolled", "scanned"):
        results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
        for i in range(args.rounds):
            for variant in VARIANTS:
                results[variant].append(
                    measure(variant, layout, args.layers, args.width, i == 0)
                )
        base = results[REFERENCE]
        for variant, rows in results.items():
            cells = []
            for key in ("trace", "trace + lower"):
                ratio = statistics.median(
                    r[key] / b[key] for r, b in zip(rows, base, strict=True)
                )
                median = statistics.median(r[key] for r in rows)
                cells.append(f"{median:.3f} | {ratio:.2f}")
            lines.append(
                f"| {layout} | {variant} | {' | '.join(cells)} "
                f"| {rows[0]['compile']:.2f} "
                f"| {rows[0]['compile'] / base[0]['compile']:.2f} |"
            )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
