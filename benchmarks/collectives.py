"""The collectives of an FSDP train step: their dtypes and bytes, read from
the compiled HLO.

An MLP (512 -> 2048 -> 512) whose float32 weights are sharded on their
first axis over every device (FSDP, ZeRO-3), under ``jax.shard_map``: the
body gathers each weight (``all_gather(tiled=True)``) before its matmul, and
the gradient's transpose reduce-scatters it. Variants: float32, bfloat16
autocast and ``Float8()``, each ``lossscale.autocast(loss, ...)`` inside
the body (and float16 autocast, whose collectives XLA's CPU backend keeps
16-bit: it widens bfloat16 ones to float32). For each, the all-gathers,
reduce-scatters and all-reduces by dtype, with their result bytes (the
gathered tensor for an all-gather, the scattered shard for a
reduce-scatter), summed: those the program asks for (the lowered module,
before XLA's passes) and those the compiled module keeps.

On a CPU with simulated devices (``jax_num_cpu_devices``) this shows what
autocast's program asks for; on a GPU, what XLA's GPU pipeline leaves (on
one device it may remove the collectives altogether: then the table says
so, and the parsing has still run on a real module).

    python benchmarks/collectives.py [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import lossscale

# The element size of each HLO type that a collective of a train step moves.
BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
# The collectives counted, in their synchronous form; an asynchronous pair
# (``all-gather-start`` / ``all-gather-done``) is counted at its ``-done``,
# whose result is the collective's.
OPS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>[a-z][a-z\-]*)\("
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z]+\d*[a-z\d]*)\[(?P<dims>[\d,]*)\]")


class Collective(NamedTuple):
    """One collective instruction of a compiled module."""

    op: str  # one of OPS
    dtype: str  # the HLO element type of its result, e.g. "bf16"
    bytes: int  # its result's size


def collectives(hlo_text: str) -> list[Collective]:
    """The all-gathers, reduce-scatters, all-reduces and all-to-alls of a
    compiled module's text (``compiled.as_text()``), one per array of each
    result (XLA's combiners make tuples of several)."""
    found = []
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        op = match["op"].removesuffix("-done")
        if op not in OPS or match["op"].endswith("-start"):
            continue
        for array in _ARRAY.finditer(match["type"]):
            dtype = array["dtype"]
            if dtype not in BYTES:
                raise ValueError(
                    f"unknown HLO element type {dtype!r} in {line!r}"
                )
            size = 1
            for dim in filter(None, array["dims"].split(",")):
                size *= int(dim)
            found.append(Collective(op, dtype, size * BYTES[dtype]))
    return found


def summary(found: list[Collective]) -> dict[tuple[str, str], tuple[int, int]]:
    """(op, dtype) -> (how many, total bytes)."""
    table: dict[tuple[str, str], list[int]] = collections.defaultdict(
        lambda: [0, 0]
    )
    for c in found:
        table[c.op, c.dtype][0] += 1
        table[c.op, c.dtype][1] += c.bytes
    return {key: (n, b) for key, (n, b) in sorted(table.items())}


VARIANTS = ("float32", "autocast bfloat16", "autocast float16", "Float8()")


def fsdp_step(variant: str, mesh: jax.sharding.Mesh, width: int = 512):
    """The jitted FSDP gradient step of ``variant`` and its arguments."""
    axis = mesh.axis_names[0]
    devices = mesh.devices.size

    def loss(params, x, y):
        w1 = jax.lax.all_gather(params["w1"], axis, tiled=True)
        w2 = jax.lax.all_gather(params["w2"], axis, tiled=True)
        h = jax.nn.relu(x @ w1)
        return jnp.mean(jnp.square(h @ w2 - y))

    if variant == "autocast bfloat16":
        loss = lossscale.autocast(loss, jnp.bfloat16)
    elif variant == "autocast float16":
        loss = lossscale.autocast(loss, jnp.float16)
    elif variant == "Float8()":
        loss = lossscale.autocast(loss, lossscale.Float8())
    elif variant != "float32":
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")

    def body(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.lax.pmean(value, axis), grads

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(axis), P(axis), P(axis)),
            out_specs=(P(), P(axis)),
        )
    )
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (width, 4 * width)) / width**0.5,
        "w2": jax.random.normal(keys[1], (4 * width, width)) / width**0.5,
    }
    batch = 64 * devices
    x = jax.random.normal(keys[2], (batch, width))
    y = jax.random.normal(keys[3], (batch, width))
    return step, (params, x, y)


def report(mesh: jax.sharding.Mesh) -> str:
    device = jax.devices()[0]
    lines = [
        "## The collectives of an FSDP step",
        "",
        f"{getattr(device, 'device_kind', device.platform)} x "
        f"{mesh.devices.size}; jax {jax.__version__}. An MLP 512 -> 2048 -> "
        "512, float32 weights sharded on their first axis, gathered in a "
        "`shard_map` body; the collectives by dtype (result bytes, "
        "summed): those the compiled module keeps, then those the program "
        "asks for (the lowered module, before XLA's passes).",
    ]
    modules = {}
    for variant in VARIANTS:
        step, args = fsdp_step(variant, mesh)
        lowered = step.lower(*args)
        modules[variant] = (
            lowered.compile().as_text() or "",
            lowered.as_text(dialect="hlo"),
        )
    for stage, title in enumerate(("compiled", "lowered")):
        lines += [
            "",
            f"### {title}",
            "",
            "| variant | collective | dtype | count | MiB |",
            "|---|---|---|---|---|",
        ]
        for variant in VARIANTS:
            table = summary(collectives(modules[variant][stage]))
            if not table:
                lines.append(f"| {variant} | (none left by XLA) | | | |")
            for (op, dtype), (count, size) in table.items():
                lines.append(
                    f"| {variant} | {op} | {dtype} | {count} "
                    f"| {size / 2**20:.3f} |"
                )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    mesh = jax.sharding.Mesh(jax.devices(), ("fsdp",))
    text = report(mesh)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
