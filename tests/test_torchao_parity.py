"""Float8("rowwise") and Float8("rowwise_with_gw_hp") against torchao's own
emulated float8 training, on the same weights, inputs and output gradients.

The references in ``tests/torchao_reference.npz`` were written by
``tests/torchao_reference.py`` (inputs from numpy only; the script and how
to run it are there):

    torch 2.13.0+cpu, torchao 0.18.0 (``Float8LinearConfig.from_recipe_name
    (name)`` with ``emulate=True``, ``convert_to_float8_training`` on an
    ``nn.Linear(bias=False)``), numpy 2.4.6, Python 3.11.7, on 2026-12-04;
    ``/tmp/tao/bin/python tests/torchao_reference.py --write``.

torchao's layer ran in float32: its emulated GEMMs multiply the dequantised
operands in float32, and keep float32. lossscale's are float32 sums of the
same products times the same power-of-two inverse scales, so the two differ
only by the order of float32 additions, at most ``K * 2**-24`` of the sum of
the absolute terms each (K terms). lossscale then rounds the forward output
(and ``rowwise_with_gw_hp``'s 16-bit weight gradient) to bfloat16: those
must be the bfloat16 rounding of a value within that bound of torchao's.
The bound's terms come from a numpy model of torchao's casts (``_model``),
itself checked against the references. Measured on XLA:CPU (jax 0.10.2):
the forward outputs and the 16-bit weight gradients are bitwise torchao's
rounded to bfloat16, the float32 gradients bitwise torchao's but for the
3-D case's input gradient (42 of 256 elements for "rowwise", 16 for
"rowwise_with_gw_hp": at most 4 float32 ulps, 2.4 * 2**-24 of the terms,
each side within 1.6 * 2**-24 of them of the exact sum), against a bound
of 2 * K * 2**-24 of the terms. The negative controls (``NEGATIVE``) miss
that bound on most elements of each output whose casts differ.
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

import lossscale
from tests import torchao_reference as ref

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
BF16 = ml_dtypes.bfloat16
VERSIONS = {"torch": "2.13.0+cpu", "torchao": "0.18.0"}


@functools.cache
def recorded() -> dict[str, np.ndarray]:
    with np.load(ref.PATH) as data:
        return dict(data)


# --- a numpy model of torchao's casts (for the bound's terms) -------------


def _dequantised(a: np.ndarray, axis: int | None, dtype=E4M3) -> np.ndarray:
    """``a`` (2-D) cast as torchao's ``hp_tensor_to_float8_dynamic`` with
    power-of-two scales (one per tensor if ``axis`` is None, else one per
    slice along ``axis``), back in float64."""
    amax = np.max(np.abs(a), axis=axis, keepdims=True).astype(np.float64)
    fp8_max = float(ml_dtypes.finfo(dtype).max)
    scale = np.float32(fp8_max / amax)
    scale = np.exp2(np.floor(np.log2(scale.astype(np.float64))))
    q = (a.astype(np.float32) * scale.astype(np.float32)).astype(dtype)
    return q.astype(np.float64) / scale


def _model(
    recipe: str, case: str
) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """``{output: (exact value, sum of |terms|, K)}`` in float64, shaped as
    torchao's outputs: each GEMM of ``recipe`` on the dequantised operands
    (2-D, as torchao reshapes them), with no rounding after the casts."""
    x, w, dy = ref.inputs(case)
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    pairs = {
        # y = input (scaled per row) @ weight.T (per row of W: along K)
        "y": (_dequantised(x2, 1), _dequantised(w, 1).T),
    }
    if recipe == "rowwise":
        pairs["dx"] = (_dequantised(dy2, 1), _dequantised(w, 0))
        pairs["dw"] = (_dequantised(dy2, 0).T, _dequantised(x2, 0))
    else:  # rowwise_with_gw_hp: W per tensor; dW from the 16-bit operands
        pairs["dx"] = (_dequantised(dy2, 1), _dequantised(w, None))
        pairs["dw"] = (dy2.T.astype(np.float64), x2.astype(np.float64))
    shapes = {"y": dy.shape, "dx": x.shape, "dw": w.shape}
    return {
        name: (
            (a @ b).reshape(shapes[name]),
            (np.abs(a) @ np.abs(b)).reshape(shapes[name]),
            a.shape[1],
        )
        for name, (a, b) in pairs.items()
    }


def _outside(
    actual: np.ndarray, reference: np.ndarray, terms: np.ndarray, k: int,
    bf16: bool,
) -> int:  # fmt: skip
    """How many elements of ``actual`` are not a float32 sum of the same
    terms in another order (``reference`` is torchao's float32), each sum
    within ``k * 2**-24 * terms`` of the exact one: within twice that of
    torchao's, then rounded to bfloat16 where ``bf16``."""
    actual = np.asarray(actual, np.float32)
    assert actual.shape == reference.shape
    slack = 2 * k * 2.0**-24 * terms
    lo = (reference - slack).astype(np.float32)
    hi = (reference + slack).astype(np.float32)
    if bf16:  # rounding is monotone: a sum in [lo, hi] rounds into this
        lo = lo.astype(BF16).astype(np.float32)
        hi = hi.astype(BF16).astype(np.float32)
        assert np.all(actual.astype(BF16).astype(np.float32) == actual)
    return int(np.sum((actual < lo) | (actual > hi)))


def _bf16_outputs(recipe) -> set[str]:
    """The outputs lossscale rounds to bfloat16 for ``recipe``."""
    name = recipe if isinstance(recipe, str) else None
    return {"y", "dw"} if name == "rowwise_with_gw_hp" else {"y"}


@functools.cache
def _lossscale_vjp(config: lossscale.Float8, case: str):
    """``(y, dx, dW)`` of ``x @ W.T`` under ``autocast(..., config)``, the
    weight first (``Float8.params_argnums``), as float32 numpy arrays."""
    x, w, dy = ref.inputs(case)
    fun = lossscale.autocast(lambda w, x: x @ w.T, config)
    # Every layer here runs in float8 (no 16-bit fallback).
    assert [m.dtype for m in lossscale.matmuls(fun, w, x)] == ["float8_e4m3fn"]
    y, vjp = jax.vjp(fun, w, x)
    dw, dx = vjp(dy)
    return {
        name: np.asarray(a, np.float32)
        for name, a in zip(ref.OUTPUTS, (y, dx, dw), strict=True)
    }


def _mismatches(config, recipe: str, case: str) -> dict[str, int]:
    """For each output, how many of lossscale's elements (under
    ``config``) are not torchao's (``recipe``) to float32 rounding."""
    got = _lossscale_vjp(config, case)
    model = _model(recipe, case)
    bf16 = _bf16_outputs(config.recipe)
    return {
        name: _outside(
            got[name],
            recorded()[f"{recipe}/{case}/{name}"],
            model[name][1],
            model[name][2],
            name in bf16,
        )
        for name in ref.OUTPUTS
    }


# --- the tests -------------------------------------------------------------


def test_references_are_the_recorded_runs():
    data = recorded()
    assert str(data["inputs_sha256"]) == ref.inputs_sha256()
    assert {k: str(data[k]) for k in VERSIONS} == VERSIONS
    for recipe in ref.RECIPE_NAMES:
        for case in ref.CASES:
            x, w, dy = ref.inputs(case)
            # All magnitudes far from either library's amax floor.
            assert min(np.max(np.abs(a)) for a in (x, w, dy)) > 1e-6
            for name in ref.OUTPUTS:
                assert data[f"{recipe}/{case}/{name}"].dtype == np.float32


@pytest.mark.parametrize("case", ref.CASES)
@pytest.mark.parametrize("recipe", ref.RECIPE_NAMES)
def test_torchao_references_follow_the_model(recipe, case):
    # The numpy model that gives the bound's terms computes what torchao
    # recorded: within float32 accumulation of its exact sums (so a cast,
    # a scale or an axis of the model is torchao's), and float8, not a
    # float32 product, was recorded: a few percent off x @ W.T.
    x, w, _ = ref.inputs(case)
    model = _model(recipe, case)
    for name in ref.OUTPUTS:
        value, terms, k = model[name]
        reference = recorded()[f"{recipe}/{case}/{name}"]
        assert np.all(np.abs(reference - value) <= k * 2.0**-24 * terms)
    y = recorded()[f"{recipe}/{case}/y"]
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    error = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert 1e-3 < error < 0.1


@pytest.mark.parametrize("case", ref.CASES)
@pytest.mark.parametrize("recipe", ref.RECIPE_NAMES)
def test_matches_torchao_to_float32_rounding(recipe, case):
    mismatches = _mismatches(lossscale.Float8(recipe), recipe, case)
    assert mismatches == dict.fromkeys(ref.OUTPUTS, 0)


def _e5m2_grad_output() -> lossscale.Float8Recipe:
    """ "rowwise" with its output gradients in e5m2 (still per row)."""
    row = lossscale.Float8("rowwise").row
    e5m2 = lossscale.Float8Cast(np.dtype(E5M2), rowwise=True)
    return row._replace(grad_output=e5m2, grad_output_for_grad_weight=e5m2)


# (lossscale's config, torchao's recipe, the outputs that must disagree):
# each is the check failing where the casts differ, and only there.
NEGATIVE = {
    "tensorwise vs rowwise": (
        lossscale.Float8("tensorwise"), "rowwise", {"y", "dx", "dw"}
    ),
    "unrounded scales": (
        lossscale.Float8("rowwise", power_of_two_scales=False),
        "rowwise",
        {"y", "dx", "dw"},
    ),
    "e5m2 output gradient": (
        lossscale.Float8(_e5m2_grad_output()), "rowwise", {"dx", "dw"}
    ),
    "rowwise vs rowwise_with_gw_hp": (
        lossscale.Float8("rowwise"), "rowwise_with_gw_hp", {"dx", "dw"}
    ),
    "rowwise_with_gw_hp vs rowwise": (
        lossscale.Float8("rowwise_with_gw_hp"), "rowwise", {"dx", "dw"}
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ref.CASES)
@pytest.mark.parametrize("control", NEGATIVE)
def test_negative_control_disagrees(control, case):
    config, recipe, differ = NEGATIVE[control]
    mismatches = _mismatches(config, recipe, case)
    x, w, _ = ref.inputs(case)
    sizes = {"y": x.size // x.shape[-1] * w.shape[0], "dx": x.size}
    sizes["dw"] = w.size
    for name in ref.OUTPUTS:
        if name in differ:  # most elements, not a stray one
            assert mismatches[name] > sizes[name] // 4, (name, mismatches)
        else:
            assert mismatches[name] == 0, (name, mismatches)
