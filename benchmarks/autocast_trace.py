"""Trace + lower time of ``jit(grad(autocast(f)))`` against ``jit(grad(f))``.

The program shapes issue 28 names: a ``jax.jit``-ed block called 48 times,
scans nested 5 deep, an unrolled 48-layer model; and the second eager call
of an autocast function against the jitted function's call. Each pair is
measured side by side, interleaved, best of ``--repeats``; the ratio is
what the targets bound (1.5x, 2x, 1.5x, 3x).

    python benchmarks/autocast_trace.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax import lax

import lossscale

WIDTH = 64


def jitted_block_48(w, x):
    @jax.jit
    def block(h, w):
        return h + jnp.tanh(h @ w) * 0.5

    for _ in range(48):
        x = block(x, w)
    return jnp.mean(x**2)


def nested_scans_5(w, x):
    def level(depth):
        def body(h, _):
            if depth == 0:
                return h + jnp.tanh(h @ w), None
            return level(depth - 1)(h), None

        return lambda h: lax.scan(body, h, None, length=2)[0]

    return jnp.mean(level(4)(x) ** 2)


def unrolled_48(w, x):
    for _ in range(48):
        mean = jnp.mean(x, -1, keepdims=True)
        var = jnp.var(x, -1, keepdims=True)
        x = x + jax.nn.gelu(((x - mean) * lax.rsqrt(var + 1e-5)) @ w)
    return jnp.mean(x**2)


CASES = {
    "jitted block x48": jitted_block_48,
    "scans nested 5 deep": nested_scans_5,
    "unrolled 48 layers": unrolled_48,
}


def trace_lower(f, args) -> float:
    # Cold for both: no jaxpr, JVP or lowering of an inner jax.jit (jnp.var
    # is one) cached from an earlier measurement.
    jax.clear_caches()
    start = time.perf_counter()
    jax.jit(jax.grad(f)).lower(*args)
    return time.perf_counter() - start


def eager_call(f, args, calls: int = 200) -> float:
    """The mean time of a call after the first (which compiles)."""
    jax.block_until_ready(f(*args))
    start = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(f(*args))
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    key = jax.random.key(0)
    w = jax.random.normal(key, (WIDTH, WIDTH)) / WIDTH**0.5
    x = jax.random.normal(jax.random.key(1), (8, WIDTH))
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print("| program | plain (s) | autocast (s) | ratio |")
    print("|---|---|---|---|")
    for name, f in CASES.items():
        plain, auto = [], []
        for _ in range(repeats):
            # A fresh function each time, so that no cache is reused.
            def g(w, x, f=f):
                return f(w, x)

            plain.append(trace_lower(g, (w, x)))
            auto.append(trace_lower(lossscale.autocast(g), (w, x)))
        print(
            f"| {name} | {min(plain):.3f} | {min(auto):.3f} "
            f"| {min(auto) / min(plain):.2f}x |"
        )
    plain_call, auto_call = [], []
    for _ in range(repeats):
        plain_call.append(eager_call(jax.jit(jitted_block_48), (w, x)))
        auto_call.append(
            eager_call(lossscale.autocast(jitted_block_48), (w, x))
        )
    print(
        "| eager call after the first (block x48) "
        f"| {min(plain_call) * 1e3:.2f} ms (jitted) "
        f"| {min(auto_call) * 1e3:.2f} ms "
        f"| {min(auto_call) / min(plain_call):.2f}x |"
    )


if __name__ == "__main__":
    main()
