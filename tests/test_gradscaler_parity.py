"""DynamicLossScale against values produced by the real torch.amp.GradScaler.

The inputs come from ``tests/gradscaler_reference.py`` (numpy only); run as
a script with torch installed, that file printed the values recorded here:

    torch 2.14.1+cu130 (CPU kernel ``torch._amp_update_scale_``, the one
    behind ``GradScaler.update``), Python 3.11, numpy from this repository's
    environment; ``PYTHONPATH=<torch> python tests/gradscaler_reference.py``.

GradScaler multiplies the float32 scale by a double factor and stores the
product in float32 (two roundings: to 53 bits, then to 24). lossscale
reproduces that bit for bit without float64 in the traced program.
"""

import fractions

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import lossscale
from tests import gradscaler_reference as ref

F32 = np.float32
TORCH_VERSION = "2.14.1+cu130"

# Printed by gradscaler_reference.py under torch 2.14.1+cu130.
FINALS = [
    "0x1.af79ba0000000p+19", "0x1.8002d20000000p+19", "0x1.dc0bb80000000p+19",
    "0x1.214f180000000p+20", "0x1.17e2200000000p+20", "0x1.f194cc0000000p+19",
    "0x1.10e4380000000p+20", "0x1.e0db380000000p+19", "0x1.b1f9140000000p+18",
    "0x1.6b10e60000000p+5", "0x1.c96f720000000p+8", "0x1.d1c3560000000p-1",
    "0x1.00e2520000000p+19", "0x1.5620dc0000000p+19", "0x1.93cda80000000p+19",
    "0x1.e8cd9a0000000p+20", "0x1.20540e0000000p+17", "0x1.bcb9600000000p+18",
    "0x1.adc7080000000p+15", "0x1.8545900000000p+8", "0x1.9d14b80000000p+18",
    "0x1.987ae80000000p+17", "0x1.cb33120000000p+19", "0x1.211a240000000p+19",
    "0x1.ea77a40000000p+19", "0x1.90e2020000000p+13", "0x1.d5f1e40000000p+3",
    "0x1.896c960000000p-8", "0x1.2d62920000000p+20", "0x1.254c860000000p+20",
    "0x1.be68e00000000p+20", "0x1.d194a80000000p+19",
]  # fmt: skip
TRAJECTORIES_SHA256 = (
    "44a21a47c01475e4d651aca728d8786d762c338b67dea4a82e5d94dec9fc0901"
)
FIRST_PRODUCTS = [
    "0x1.a182940000000p+89", "0x1.de7a0a0000000p+24", "0x1.4613480000000p+37",
    "0x1.b0a97e0000000p+79", "0x1.98be9c0000000p+15", "0x1.4c2ab40000000p+55",
    "0x1.081cc40000000p+68", "0x1.03a2e60000000p-56",
]  # fmt: skip
PRODUCTS_SHA256 = (
    "114f0d30a63b400fbc9a9977ef5d60f840ba7b72769b8787c8b2c42e61f56183"
)
# GradScaler(init_scale=0.1, backoff_factor=0.9) after one overflow.
ONE_BACKOFF_FROM_0_1 = 0.09000000357627869


def dynamic(init, growth, backoff, interval):
    # Bounds far outside the runs: GradScaler has none.
    return lossscale.DynamicLossScale(
        init,
        growth_interval=interval,
        growth_factor=growth,
        backoff_factor=backoff,
        min_loss_scale=2.0**-126,
        max_loss_scale=2.0**126,
    )


def test_one_backoff_from_0_1_with_0_9():
    ls = dynamic(0.1, 2.0, 0.9, 2000).adjust(jnp.bool_(False))
    assert float(ls.loss_scale) == ONE_BACKOFF_FROM_0_1
    # lossscale < 0.2 rounded the factor to float32 first:
    assert float(F32(0.1) * F32(0.9)) == 0.08999999612569809


def test_runs_match_gradscaler_step_by_step():
    trajectory, finals = [], []
    for init, growth, backoff, interval, pattern in ref.runs():
        ls = dynamic(init, growth, backoff, interval)

        def body(state, finite):
            state = state.adjust(finite)
            return state, state.loss_scale

        final, scales = jax.jit(lambda s, p: jax.lax.scan(body, s, p))(
            ls, jnp.asarray(pattern, jnp.bool_)
        )
        trajectory.extend(np.asarray(scales).tolist())
        finals.append(float(final.loss_scale).hex())
    assert finals == FINALS
    assert ref.digest(trajectory) == TRAJECTORIES_SHA256


def products_by_lossscale():
    pairs = ref.products()
    out = [None] * len(pairs)
    by_factor = {}
    for i, (_, f) in enumerate(pairs):
        by_factor.setdefault(f, []).append(i)
    for f, idx in by_factor.items():
        ls = dynamic(1.0, f, 0.5, 1) if f > 1 else dynamic(1.0, 2.0, f, 1)
        finite = jnp.bool_(f > 1)
        scales = jnp.asarray([pairs[i][0] for i in idx], jnp.float32)

        # Eagerly, on a vector of scales (adjust is elementwise): one
        # compiled program per factor would take half a minute.
        counters = jax.tree.leaves(ls)[1:]
        state = jax.tree.structure(ls).unflatten([scales, *counters])
        values = state.adjust(finite).loss_scale

        for i, value in zip(idx, np.asarray(values), strict=True):
            out[i] = float(value)
    return pairs, out


def test_single_products_match_gradscaler():
    pairs, got = products_by_lossscale()
    assert [v.hex() for v in got[:8]] == FIRST_PRODUCTS
    assert ref.digest(got) == PRODUCTS_SHA256
    # The reference rule, checked against torch's values above.
    assert got == [float(ref.times(F32(s), f)) for s, f in pairs]
    # Negative controls: the factors float32 cannot hold do differ when
    # rounded first, and the constructed ties tell two roundings from one.
    float32_first = [float(F32(s) * F32(f)) for s, f in pairs]
    assert sum(a != b for a, b in zip(got, float32_first, strict=True)) > 100
    ties = pairs[-200:]
    correctly_rounded = [
        round_once(fractions.Fraction(s) * fractions.Fraction(f))
        for s, f in ties
    ]
    assert any(
        a != b for a, b in zip(got[-200:], correctly_rounded, strict=True)
    )


def round_once(x):
    """The float32 nearest the exact ``x`` (ties to even): one rounding."""
    near = F32(float(x))
    candidates = [
        np.nextafter(near, F32(0)),
        near,
        np.nextafter(near, F32(np.inf)),
    ]
    best = min(
        candidates,
        key=lambda v: (
            abs(fractions.Fraction(float(v)) - x),
            int(np.asarray(v).view(np.uint32)) & 1,
        ),
    )
    return float(best)


@pytest.mark.parametrize("factor", [0.9, 0.5, 2.0, 1 / 3, 1.7])
def test_eager_and_jit_agree(factor):
    backoff = factor if factor < 1 else 0.5
    growth = factor if factor > 1 else 2.0
    ls = dynamic(0.1, growth, backoff, 1)
    finite = jnp.bool_(factor > 1)
    eager = ls.adjust(finite).loss_scale
    jitted = jax.jit(lambda s: s.adjust(finite))(ls).loss_scale
    want = ref.times(F32(0.1), factor)
    assert float(eager) == float(jitted) == float(want)
