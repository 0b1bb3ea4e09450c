"""Inputs for tests/test_gradscaler_parity.py, and the script that ran them
through the real ``torch.amp.GradScaler`` kernel.

The inputs are generated here, deterministically, with numpy only, so that
the test needs no torch. Run as a script (with torch installed) it prints
the reference values that the test records::

    python tests/gradscaler_reference.py

It calls ``torch._amp_update_scale_``, the kernel behind
``GradScaler.update`` (checked once against the public ``GradScaler``
below), on CPU.
"""

from __future__ import annotations

import fractions
import hashlib

import numpy as np

F32 = np.float32

# (growth_factor, backoff_factor): PyTorch's defaults, then factors that
# float32 cannot hold, where rounding them to float32 first differs.
FACTORS = [
    (2.0, 0.5),
    (2.0, 0.9),
    (1.5, 0.8),
    (3.0, 1 / 3),
    (1.1, 0.7),
    (1.0001, 0.999),
]


def runs() -> list[tuple[float, float, float, int, list[bool]]]:
    """``(init_scale, growth, backoff, interval, finite pattern)`` runs."""
    rng = np.random.default_rng(2024)
    out = []
    for growth, backoff in FACTORS + [
        (float(1 + rng.random() * 3), float(0.05 + rng.random() * 0.9))
        for _ in range(10)
    ]:
        for interval in (1, 3):
            init = float(F32(2.0 ** rng.integers(-4, 17) * rng.random() + 0.1))
            # Overflows above 2**20 (as a model's gradients would) and at
            # random (5%): the scale stays far inside [2**-126, 2**126],
            # where lossscale's bounds do not clamp it.
            pattern, scale, tracker = [], F32(init), 0
            for noise in rng.random(200):
                finite = bool(scale <= 2.0**20 and noise > 0.05)
                pattern.append(finite)
                if not finite:
                    scale, tracker = times(scale, backoff), 0
                elif tracker + 1 == interval:
                    scale, tracker = times(scale, growth), 0
                else:
                    tracker += 1
            out.append((init, growth, backoff, interval, pattern))
    return out


def times(scale: np.float32, factor: float) -> np.float32:
    """float(double(scale) * factor), which is what the kernel computes."""
    return F32(np.float64(scale) * factor)


def _double_rounding_cases(rng: np.random.Generator, n: int) -> list:
    """Products that land, in float64, exactly on a float32 midpoint.

    ``float32(float64(s) * f)`` then rounds the tie to even, where the
    correctly rounded float32 product may round the other way: these are
    the cases that tell GradScaler's two roundings from one.
    """
    out = []
    while len(out) < n:
        s = F32(rng.uniform(1.0, 2.0))
        below = F32(s * F32(0.9))
        m = float(below) + float(np.spacing(below)) / 2  # a float32 midpoint
        f = float(fractions.Fraction(m) / fractions.Fraction(float(s)))
        if float(F32(f)) != f and np.float64(s) * f == m:
            out.append((float(s), f))
    return out


def products() -> list[tuple[float, float]]:
    """``(scale, factor)`` pairs for single multiplications."""
    rng = np.random.default_rng(7)
    exps = rng.integers(-100, 100, 2000)
    mants = rng.integers(0, 2**23, 2000)
    scales = ((mants | 2**23) * 2.0 ** (exps - 23)).astype(F32)
    factors = [f for pair in FACTORS for f in pair]
    factors += [float(x) for x in rng.uniform(0.01, 0.99, 20)]
    factors += [float(x) for x in rng.uniform(1.01, 8.0, 20)]
    out = [(float(s), factors[i % len(factors)]) for i, s in enumerate(scales)]
    return out + _double_rounding_cases(rng, 200)


def digest(values: list[float]) -> str:
    """sha256 of the values as float32 bytes."""
    return hashlib.sha256(np.asarray(values, F32).tobytes()).hexdigest()


def _torch_main() -> None:  # pragma: no cover - needs torch
    import torch

    def step(scale, tracker, finite, growth, backoff, interval):
        found_inf = torch.full((), 0.0 if finite else 1.0)
        torch._amp_update_scale_(
            scale, tracker, found_inf, growth, backoff, interval
        )

    print("torch", torch.__version__)
    finals, trajectory = [], []
    for init, growth, backoff, interval, pattern in runs():
        scale = torch.full((), init, dtype=torch.float32)
        tracker = torch.zeros((), dtype=torch.int32)
        for finite in pattern:
            step(scale, tracker, finite, growth, backoff, interval)
            trajectory.append(float(scale))
        finals.append(float(scale).hex())
    print("finals =", finals)
    print("trajectories sha256 =", digest(trajectory))
    results = []
    for s, f in products():
        scale = torch.full((), s, dtype=torch.float32)
        tracker = torch.zeros((), dtype=torch.int32)
        if f < 1:
            step(scale, tracker, False, 2.0, f, 1)
        else:
            step(scale, tracker, True, f, 0.5, 1)
        results.append(float(scale))
    print("first products =", [r.hex() for r in results[:8]])
    print("products sha256 =", digest(results))
    # The public API goes through the same kernel.
    gs = torch.amp.GradScaler(
        "cpu", init_scale=0.1, backoff_factor=0.9, growth_interval=2000
    )
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    gs.scale((p * float("inf")).sum()).backward()
    gs.step(opt)
    gs.update()
    print("GradScaler(init_scale=0.1, backoff_factor=0.9) after one overflow:")
    print(float(gs.get_scale()).hex(), gs.get_scale())


if __name__ == "__main__":
    _torch_main()
