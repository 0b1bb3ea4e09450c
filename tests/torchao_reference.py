"""Inputs for tests/test_torchao_parity.py, and the script that ran them
through torchao's float8 training (emulated, on torch's CPU).

The inputs are generated here, deterministically, with numpy only, so that
the test needs no torch. Run as a script with torch and torchao installed,
it runs one ``nn.Linear`` (``bias=False``, ``y = x @ W.T``) converted by
``torchao.float8.convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name(name)`` and ``emulate=True``, forward
and backward, for each row-wise recipe and each case below, and writes
``y``, ``dx`` and ``dW`` with the versions to ``tests/torchao_reference.npz``::

    python3 -m venv /tmp/tao
    /tmp/tao/bin/pip install torch==2.13.0 torchao==0.18.0 numpy
    /tmp/tao/bin/python tests/torchao_reference.py --write

(without ``--write`` it prints what it would record).

Every input is exactly representable in bfloat16 (an integer of at most
8 bits times a power of two), so that lossscale's bfloat16 casts (the
output gradient, the cotangent of its bfloat16 output, and
``rowwise_with_gw_hp``'s 16-bit weight-gradient operands) lose nothing,
and per-row and per-column magnitudes spread over powers of two (with
amaxes that are not powers of two), so that each GEMM's scales differ
along both axes and a per-tensor scale, a scale along the wrong axis or an
unrounded scale gives other numbers. Every amax is far above torchao's
floor (1e-12) and lossscale's (float32's smallest normal).

The layer runs in float32, where torchao's emulated GEMMs are float32
matmuls of the dequantised operands (``torch.mm(a._data.float() / a._scale,
b._data.float() / b._scale)``), kept in float32, and the high-precision
weight gradient of ``rowwise_with_gw_hp`` a float32 matmul; lossscale's
are float32 sums of the same products, times the same power-of-two inverse
scales, its forward output (and ``rowwise_with_gw_hp``'s weight gradient)
then rounded to bfloat16. The script also runs the layer in bfloat16
(bfloat16 weight, input and output gradient, as torchao runs under FSDP's
bfloat16 parameters) and checks that each of its results is the float32
one rounded to bfloat16, so the float32 references stand for both.
"""

from __future__ import annotations

import datetime
import hashlib
import pathlib
import sys

import numpy as np

RECIPE_NAMES = ("rowwise", "rowwise_with_gw_hp")
OUTPUTS = ("y", "dx", "dw")

# name: (x's shape, W's shape (out, in)); dy has y's shape, x's leading
# axes by W's out. "3d": (batch, sequence, features), which torchao
# reshapes to 2-D and lossscale contracts over both leading axes.
CASES = {
    "2d": ((16, 64), (16, 64)),
    "3d": ((2, 4, 32), (16, 32)),
}

PATH = pathlib.Path(__file__).with_name("torchao_reference.npz")


def _bf16_exact(
    rng: np.random.Generator, shape: tuple[int, ...], spread: int
) -> np.ndarray:
    """float32 values of ``shape``, each an integer of |n| <= 255 (8
    significant bits: exact in bfloat16) times a power of two; each row
    (all axes but the last) and each column its own power of two in
    ``2**[-spread, spread]``."""
    ints = np.clip(np.rint(rng.standard_normal(shape) * 60), -255, 255)
    rows = rng.integers(-spread, spread + 1, (*shape[:-1], 1))
    cols = rng.integers(-spread, spread + 1, shape[-1])
    return (ints * np.exp2(rows + cols - 8.0)).astype(np.float32)


def inputs(case: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, w, dy)`` of ``case`` in float32, W in torch's (out, in)."""
    x_shape, w_shape = CASES[case]
    seed = 40 + list(CASES).index(case)
    rng = np.random.default_rng(seed)
    x = _bf16_exact(rng, x_shape, 6)
    w = _bf16_exact(rng, w_shape, 6)
    dy = _bf16_exact(rng, (*x_shape[:-1], w_shape[0]), 6)
    return x, w, dy


def inputs_sha256() -> str:
    """A digest of every case's inputs (the test checks it against the
    one recorded with the references)."""
    digest = hashlib.sha256()
    for case in CASES:
        for array in inputs(case):
            digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()


def torchao_vjp(recipe, case, dtype):  # pragma: no cover - needs torch
    """``(y, dx, dW)`` of torchao's emulated float8 ``nn.Linear``, as
    float32 numpy arrays, the layer run in ``dtype``."""
    import dataclasses

    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    x, w, dy = inputs(case)
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), emulate=True
    )
    model = torch.nn.Sequential(
        torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    )
    with torch.no_grad():
        model[0].weight.copy_(torch.from_numpy(w))
    model = convert_to_float8_training(model, config=config).to(dtype)
    layer = model[0]
    assert isinstance(layer, Float8Linear) and layer.config.emulate
    tx = torch.from_numpy(x).to(dtype).requires_grad_(True)
    ty = model(tx)
    ty.backward(torch.from_numpy(dy).to(dtype))
    assert ty.dtype == tx.grad.dtype == layer.weight.grad.dtype == dtype
    return tuple(
        t.detach().float().numpy() for t in (ty, tx.grad, layer.weight.grad)
    )


def main(argv: list[str]) -> None:  # pragma: no cover - needs torch
    import torch
    import torchao

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    record: dict[str, np.ndarray] = {}
    for recipe in RECIPE_NAMES:
        for case in CASES:
            wide = torchao_vjp(recipe, case, torch.float32)
            narrow = torchao_vjp(recipe, case, torch.bfloat16)
            for name, f32, bf16 in zip(OUTPUTS, wide, narrow, strict=True):
                rounded = (
                    torch.from_numpy(f32).to(torch.bfloat16).float().numpy()
                )
                differ = int(np.sum(rounded != bf16))
                print(
                    f"{recipe:19} {case} {name:2} {f32.shape}: in bfloat16, "
                    f"{differ} of {f32.size} differ from the float32 run "
                    "rounded to bfloat16"
                )
                if differ:
                    raise SystemExit("the bfloat16 run is not float32's")
                record[f"{recipe}/{case}/{name}"] = f32
    versions = {
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "date": datetime.date.today().isoformat(),
        "inputs_sha256": inputs_sha256(),
    }
    for key, value in versions.items():
        print(f"{key}: {value}")
        record[key] = np.array(value)
    if "--write" in argv:
        np.savez_compressed(PATH, **record)
        print(f"wrote {PATH} ({PATH.stat().st_size} bytes)")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
