"""On a GPU: were the float8 matmuls really cuBLASLt float8 GEMMs, and how
fast is the float8 step against the bfloat16 one?

The demo GPT at GPT-2 small's depth and GPT-2 medium's width (12
layers, width 1024, 16 heads, context 1024, batch 8 by default;
vocabulary 97, so the tied output head stays bfloat16), written in
float32, under
``lossscale.autocast(loss_fn, lossscale.Float8(recipe))``. Two parts:

1. **The check.** The compiled train step's HLO must hold one
   ``__cublas$lt$matmul$f8`` custom call per float8 ``dot_general`` of the
   step's jaxpr (forward and backward; a scan's body counts once, as its
   loop body is compiled once). Fewer means XLA ran some float8 matmuls
   another way (upcast to a 16-bit or float32 GEMM): a silent fallback,
   which costs what float8 was meant to save. Any difference is printed
   in capitals and the script exits with status 1. Only GPUs of compute
   capability 8.9 or more (Ada, Hopper, Blackwell) have float8 GEMMs.
2. **The timing.** Each recipe's float8 step against the bfloat16 autocast
   step, side by side, without remat and under each ``--remat`` policy
   (each block under ``nnx.remat``; float8 is compared with bfloat16
   under the same policy): all compiled once, then rounds that alternate
   them, a few steps each after a warm-up step; the median step time of
   each, the median of per-round ratios, and the compiled step's
   temporary memory. Written to ``--out`` with the GPU's name.

On a CPU the check runs too (``tests/test_benchmarks.py`` does so on a
small model): XLA:CPU has no float8 GEMM, so it finds 0 and reports the
mismatch.

    python benchmarks/float8_gpu.py [--recipes tensorwise,rowwise,...]
        [--remat none,dots_with_no_batch_dims_saveable] [--layers 12]
        [--width 1024] [--heads 16] [--context 1024] [--batch 8]
        [--rounds 5] [--steps 10] [--out FILE] [--hlo FILE.gz]
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import pathlib
import statistics
import sys
import time
from typing import Any, NamedTuple

import jax

from lossscale.demo import _gpt as gpt

HERE = pathlib.Path(__file__).resolve().parent


def _sibling(name: str) -> Any:
    """A module of this folder (``benchmarks/`` is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fp8_check = _sibling("fp8_check")
bench = _sibling("float8")


class Check(NamedTuple):
    """What :func:`check` found.

    Attributes:
        dots: the float8 ``dot_general``s of the step's jaxpr, by kind.
        gemms: the ``__cublas$lt$matmul$f8`` custom calls in its HLO.
        ok: whether every float8 dot became one float8 GEMM (and none is
            ``e5m2 x e5m2``, which cuBLASLt lacks).
        message: one line saying so, in capitals if not.
    """

    dots: Any
    gemms: int
    ok: bool
    message: str


def compare(dots: Any, gemms: int) -> Check:
    """Compares the float8 dots of a jaxpr with the float8 GEMMs of its
    compiled HLO."""
    expected = dots.forward + dots.backward + dots.other
    counts = (
        f"{gemms} float8 GEMMs ({fp8_check.FP8_GEMM_TARGET}) in the "
        f"compiled HLO, {expected} float8 dots in the jaxpr "
        f"({dots.forward} e4m3 x e4m3, {dots.backward} e5m2 x e4m3, "
        f"{dots.other} other)"
    )
    if dots.other:
        return Check(dots, gemms, False, f"MISMATCH: {counts}: cuBLASLt has "
                     "no GEMM for the other pairs")  # fmt: skip
    if expected == 0:
        return Check(dots, gemms, False, f"MISMATCH: {counts}: nothing to "
                     "check (no float8 matmul in the step)")  # fmt: skip
    if gemms < expected:
        return Check(
            dots,
            gemms,
            False,
            f"MISMATCH, SILENT FALLBACK: {counts}: "
            f"{expected - gemms} float8 matmuls did not become float8 GEMMs "
            f"(backend {jax.default_backend()}; float8 GEMMs need a GPU of "
            "compute capability 8.9 or more and CUDA 12)",
        )
    if gemms > expected:
        return Check(
            dots,
            gemms,
            False,
            f"MISMATCH: {counts}: more GEMMs than dots (a loop unrolled or a "
            "matmul duplicated by XLA?): read the HLO before trusting it",
        )
    return Check(dots, gemms, True, f"ok: {counts}")


def check(step: Any, args: Any, hlo: str | None = None) -> Check:
    """Compares the float8 GEMMs of ``step(*args)``'s compiled HLO (compiled
    here unless its text is given) with the float8 dots of its jaxpr.
    Raises nothing on a mismatch: see ``Check.ok``."""
    dots = fp8_check.count_fp8_dots(jax.make_jaxpr(step)(*args))
    if hlo is None:
        hlo = jax.jit(step).lower(*args).compile().as_text()
    return compare(dots, fp8_check.count_fp8_gemms(hlo))


def device_name() -> str:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    capability = getattr(device, "compute_capability", None)
    return f"{kind}" + (f", compute capability {capability}" if capability
                        else "")  # fmt: skip


class Variant(NamedTuple):
    """One compiled train step: its name, remat policy, the compiled
    function, its arguments and its HLO text."""

    name: str
    remat: str
    compiled: Any
    args: Any
    hlo: str


def compile_variant(
    name: str, config: gpt.Config, remat: str
) -> tuple[Variant, Any]:
    """``name``'s step (``bench.VARIANTS``) under ``remat`` (``"none"`` or a
    ``gpt.REMAT_POLICIES`` name), compiled once; and the step itself."""
    config = dataclasses.replace(
        config, remat=None if remat == "none" else remat
    )
    step, args, _ = bench.build(name, config)
    compiled = jax.jit(step).lower(*args).compile()
    return Variant(name, remat, compiled, args, compiled.as_text() or ""), step


def time_side_by_side(
    variants: list[Variant], rounds: int, steps: int
) -> list[list[float]]:
    """Median step times per round of each compiled variant, alternated."""
    times: list[list[float]] = [[] for _ in variants]
    for _ in range(rounds):
        for variant, row in zip(variants, times, strict=True):
            row.append(bench.time_steps(variant.compiled, variant.args, steps))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0]
    )
    recipes = tuple(gpt.FLOAT8_MODES.values())
    parser.add_argument(
        "--recipes",
        default=",".join(recipes),
        help=f"comma-separated subset of {','.join(recipes)}",
    )
    parser.add_argument(
        "--remat",
        default="none,dots_with_no_batch_dims_saveable",
        help="comma-separated: none (no remat) or gpt.REMAT_POLICIES names; "
        "each block under nnx.remat with that policy",
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--hlo",
        default=None,
        help="a .gz file to write each float8 step's compiled HLO into",
    )
    args = parser.parse_args(argv)
    chosen = args.recipes.split(",")
    if not set(chosen) <= set(recipes):
        parser.error(f"--recipes must name some of {','.join(recipes)}")
    policies = args.remat.split(",")
    if not set(policies) <= {"none", *gpt.REMAT_POLICIES}:
        parser.error(
            f"--remat must name some of none,{','.join(gpt.REMAT_POLICIES)}"
        )
    config = gpt.Config(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        context=args.context,
        batch=args.batch,
    )
    banner = "=" * 72
    variants: list[Variant] = []
    checks: dict[tuple[str, str], Check] = {}
    if args.hlo:
        pathlib.Path(args.hlo).unlink(missing_ok=True)
    for remat in policies:
        for name in (bench.REFERENCE, *(f"float8 {r}" for r in chosen)):
            start = time.perf_counter()
            variant, step = compile_variant(name, config, remat)
            print(
                f"{name}, remat {remat}: built and compiled in "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
            variants.append(variant)
            if name == bench.REFERENCE:
                continue
            found = check(step, variant.args, variant.hlo)
            checks[name, remat] = found
            line = f"{name}, remat {remat}: {found.message}"
            if found.ok:
                print(line, flush=True)
            else:
                print(f"{banner}\n{line}\n{banner}", file=sys.stderr)
            if args.hlo:
                with gzip.open(args.hlo, "at") as f:
                    f.write(f"=== {name}, remat {remat}\n{variant.hlo}\n")
    times = time_side_by_side(variants, args.rounds, args.steps)
    reference = {
        v.remat: row
        for v, row in zip(variants, times, strict=True)
        if v.name == bench.REFERENCE
    }
    ok = all(c.ok for c in checks.values())
    lines = [
        "## float8 on a GPU: the GEMMs and the step time",
        "",
        f"{device_name()}; jax {jax.__version__}. The demo GPT: layers "
        f"{config.layers}, width {config.width}, heads {config.heads}, "
        f"batch {config.batch} x {config.context}; "
        f"{args.rounds} alternating rounds of {args.steps} steps after a "
        "warm-up step each. Ratios: medians of per-round ratios to the "
        f"{bench.REFERENCE} step under the same remat policy (`none`: no "
        "remat). Temp: the compiled step's temporary memory "
        "(`memory_analysis`).",
        "",
        *(
            f"- check, {name}, remat {remat}: {c.message}"
            for (name, remat), c in checks.items()
        ),
        *(
            []
            if ok
            else ["- a row whose check failed is not float8 GEMMs' time"]
        ),
        "",
        "| variant | remat | step ms (median) | step, ratio | temp MB |",
        "|---|---|---|---|---|",
    ]
    for variant, row in zip(variants, times, strict=True):
        ratio = statistics.median(
            t / b for t, b in zip(row, reference[variant.remat], strict=True)
        )
        temp = variant.compiled.memory_analysis().temp_size_in_bytes / 1e6
        lines.append(
            f"| {variant.name} | {variant.remat} "
            f"| {1e3 * statistics.median(row):.1f} | {ratio:.2f} "
            f"| {temp:.1f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
