"""On a GPU: were the float8 matmuls really cuBLASLt float8 GEMMs, and how
fast is the float8 step against the bfloat16 one?

The demo GPT at GPT-2-small shapes (12 layers, width 1024, 16 heads,
context 1024, batch 8 by default; vocabulary 97, so the tied output head
stays bfloat16), written in float32, under
``lossscale.autocast(loss_fn, lossscale.Float8(recipe))``. Two parts:

1. **The check.** The compiled train step's HLO must hold one
   ``__cublas$lt$matmul$f8`` custom call per float8 ``dot_general`` of the
   step's jaxpr (forward and backward; a scan's body counts once, as its
   loop body is compiled once). Fewer means XLA ran some float8 matmuls
   another way (upcast to a 16-bit or float32 GEMM): a silent fallback,
   which costs what float8 was meant to save. Any difference is printed
   in capitals and the script exits with status 1. Only GPUs of compute
   capability 8.9 or more (Ada, Hopper, Blackwell) have float8 GEMMs.
2. **The timing.** The float8 step against the bfloat16 autocast step, side
   by side: both compiled, then rounds that alternate them, a few steps
   each after a warm-up step; the median step time of each and the median
   of per-round ratios. Written to ``--out`` with the GPU's name.

On a CPU the check runs too (``tests/test_benchmarks.py`` does so on a
small model): XLA:CPU has no float8 GEMM, so it finds 0 and reports the
mismatch.

    python benchmarks/float8_gpu.py [--recipe tensorwise] [--layers 12]
        [--width 1024] [--heads 16] [--context 1024] [--batch 8]
        [--rounds 5] [--steps 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import sys
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


def check(step: Any, args: Any) -> Check:
    """Compiles ``step(*args)`` and compares its float8 GEMMs with the float8
    dots of its jaxpr. Raises nothing on a mismatch: see ``Check.ok``."""
    dots = fp8_check.count_fp8_dots(jax.make_jaxpr(step)(*args))
    hlo = jax.jit(step).lower(*args).compile().as_text()
    return compare(dots, fp8_check.count_fp8_gemms(hlo))


def device_name() -> str:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    capability = getattr(device, "compute_capability", None)
    return f"{kind}" + (f", compute capability {capability}" if capability
                        else "")  # fmt: skip


def time_side_by_side(
    variants: dict[str, tuple[Any, Any]], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Median step times per round of each compiled variant, alternated."""
    compiled = {
        name: (jax.jit(step).lower(*args).compile(), args)
        for name, (step, args) in variants.items()
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (fn, args) in compiled.items():
            times[name].append(bench.time_steps(fn, args, steps))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe", default="tensorwise", choices=gpt.FLOAT8_MODES.values()
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    config = gpt.Config(
        layers=args.layers,
        width=args.width,
        heads=args.heads,
        context=args.context,
        batch=args.batch,
    )
    fp8 = f"float8 {args.recipe}"
    step, step_args, _ = bench.build(fp8, config)
    found = check(step, step_args)
    banner = "=" * 72
    if found.ok:
        print(found.message)
    else:
        print(f"{banner}\n{found.message}\n{banner}", file=sys.stderr)
    reference = bench.build(bench.REFERENCE, config)[:2]
    times = time_side_by_side(
        {bench.REFERENCE: reference, fp8: (step, step_args)},
        args.rounds,
        args.steps,
    )
    ratio = statistics.median(
        f / b for f, b in zip(times[fp8], times[bench.REFERENCE], strict=True)
    )
    lines = [
        "## float8 on a GPU: the GEMMs and the step time",
        "",
        f"{device_name()}; jax {jax.__version__}. The demo GPT: layers "
        f"{config.layers}, width {config.width}, heads {config.heads}, "
        f"batch {config.batch} x {config.context}; "
        f"{args.rounds} alternating rounds of {args.steps} steps after a "
        "warm-up step each.",
        "",
        f"- check: {found.message}",
        *(
            []
            if found.ok
            else ["- so the float8 row below is not float8 GEMMs' time"]
        ),
        "",
        "| variant | step ms (median) | step, ratio |",
        "|---|---|---|",
        f"| {bench.REFERENCE} | "
        f"{1e3 * statistics.median(times[bench.REFERENCE]):.1f} | 1.00 |",
        f"| {fp8} | {1e3 * statistics.median(times[fp8]):.1f} | {ratio:.2f} |",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0 if found.ok else 1


if __name__ == "__main__":
    sys.exit(main())
