"""DynamicLossScale against plain-Python reference models (hypothesis).

The references are written from the anchors' documented semantics, not from
the library: PyTorch's GradScaler (``_amp_update_scale``) for
``hysteresis=1`` and Megatron-LM's ``DynamicGradScaler.update`` for
``hysteresis > 1``, plus lossscale's clip to ``[min, max]``. The scale is
float32, as on the device, and each factor is applied as GradScaler's
kernels apply it: the float32 scale times the factor as a C++ double,
stored in float32 (``times`` below). Megatron-LM's ``self._scale *
self.backoff_factor`` (a float32 tensor times a Python float) computes in
float32 with the factor rounded first, so its values differ from these by
rounding when a factor is not a float32 number; its reference here is the
timing of its state machine with GradScaler's arithmetic, which is what
lossscale promises for ``hysteresis > 1``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lossscale

F32 = np.float32


def times(scale, factor):
    """GradScaler's ``static_cast<float>(float_scale * double_factor)``."""
    return F32(np.float64(scale) * np.float64(factor))


@np.errstate(over="ignore")  # growth past float32 max is inf, then clipped
def torch_reference(cfg, pattern):
    scale, growth = F32(cfg["loss_scale"]), 0
    out = []
    for finite in pattern:
        if not finite:
            scale = times(scale, cfg["backoff_factor"])
            growth = 0
        else:
            growth += 1
            if growth == cfg["growth_interval"]:
                scale = times(scale, cfg["growth_factor"])
                growth = 0
        scale = F32(
            np.clip(scale, cfg["min_loss_scale"], cfg["max_loss_scale"])
        )
        out.append((float(scale), growth))
    return out


@np.errstate(over="ignore")
def megatron_reference(cfg, pattern):
    scale, growth, hyst = F32(cfg["loss_scale"]), 0, cfg["hysteresis"]
    out = []
    for finite in pattern:
        if not finite:
            growth = 0
            hyst -= 1
            if hyst <= 0:
                scale = times(scale, cfg["backoff_factor"])
        else:
            growth += 1
            if growth == cfg["growth_interval"]:
                growth = 0
                hyst = cfg["hysteresis"]
                scale = times(scale, cfg["growth_factor"])
        scale = F32(
            np.clip(scale, cfg["min_loss_scale"], cfg["max_loss_scale"])
        )
        out.append((float(scale), growth))
    return out


def run_library(cfg, pattern):
    ls = lossscale.DynamicLossScale(**cfg)

    def body(state, finite):
        state = state.adjust(finite)
        return state, (state.loss_scale, state.growth_tracker)

    _, (scales, growth) = jax.jit(lambda s, p: jax.lax.scan(body, s, p))(
        ls, jnp.asarray(pattern, jnp.bool_)
    )
    return list(
        zip(
            np.asarray(scales).tolist(),
            np.asarray(growth).tolist(),
            strict=True,
        )
    )


@st.composite
def configs(draw):
    pow2 = draw(st.booleans())
    if pow2:
        growth = draw(st.sampled_from([2.0, 4.0]))
        backoff = draw(st.sampled_from([0.5, 0.25]))
    else:
        # Doubles, not float32 numbers: a factor float32 cannot hold is
        # where rounding it first (as lossscale did before 0.2) differs.
        growth = draw(st.floats(1.0078125, 4.0))
        backoff = draw(st.floats(0.0625, 0.984375))
    lo_exp = draw(st.integers(-20, 10))
    hi_exp = draw(st.integers(lo_exp, 126))  # 2**126: the largest allowed
    init_exp = draw(st.integers(lo_exp, hi_exp))
    return {
        "loss_scale": 2.0**init_exp,
        "growth_interval": draw(st.integers(1, 6)),
        "growth_factor": float(growth),
        "backoff_factor": float(backoff),
        "min_loss_scale": 2.0**lo_exp,
        "max_loss_scale": 2.0**hi_exp,
        "hysteresis": draw(st.integers(1, 4)),
    }


patterns = st.lists(st.booleans(), min_size=1, max_size=300).map(tuple)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(cfg=configs(), pattern=patterns)
def test_matches_reference_step_by_step(cfg, pattern):
    ref = megatron_reference if cfg["hysteresis"] > 1 else torch_reference
    assert run_library(cfg, pattern) == ref(cfg, pattern)
    if cfg["hysteresis"] == 1:  # the two references agree there
        assert torch_reference(cfg, pattern) == megatron_reference(cfg, pattern)


@settings(max_examples=30, deadline=None)
@given(cfg=configs(), pattern=patterns)
@example(  # power-of-two growth but not backoff: scales leave powers of two
    cfg={
        "loss_scale": 16.0,
        "growth_interval": 1,
        "growth_factor": 2.0,
        "backoff_factor": 0.09375,
        "min_loss_scale": 1.0,
        "max_loss_scale": 16.0,
        "hysteresis": 1,
    },
    pattern=(False,),
)
def test_invariants(cfg, pattern):
    out = run_library(cfg, pattern)
    scales = np.array([s for s, _ in out])
    assert np.all(np.isfinite(scales)) and np.all(scales > 0)
    assert np.all(scales >= F32(cfg["min_loss_scale"]))
    assert np.all(scales <= F32(cfg["max_loss_scale"]))

    def is_pow2(x):
        return np.log2(x) == np.round(np.log2(x))

    pow2 = all(
        is_pow2(cfg[k])
        for k in ("growth_factor", "backoff_factor", "max_loss_scale")
    )
    if pow2:
        # power-of-two factors and bounds: every scale is a power of two
        exps = np.log2(scales)
        np.testing.assert_array_equal(exps, np.round(exps))


def test_reference_rounds_as_gradscaler_not_in_float32():
    # Negative control: with a factor float32 cannot hold, rounding it
    # first (float32 arithmetic, lossscale < 0.2, Megatron-LM) drifts from
    # GradScaler within a few backoffs, and the reference sees it.
    cfg = {
        "loss_scale": 1.0,
        "growth_interval": 3,
        "growth_factor": 1.7,
        "backoff_factor": 0.9,
        "min_loss_scale": 2.0**-20,
        "max_loss_scale": 2.0**24,
        "hysteresis": 1,
    }
    pattern = (False,) * 10 + (True,) * 9 + (False,) * 5
    got = run_library(cfg, pattern)
    assert got == torch_reference(cfg, pattern)
    rounded_first = run_reference_with_float32_factors(cfg, pattern)
    assert [s for s, _ in rounded_first] != [s for s, _ in got]


@np.errstate(over="ignore")
def run_reference_with_float32_factors(cfg, pattern):
    """torch_reference with each factor rounded to float32 first."""
    rounded = {
        **cfg,
        "growth_factor": float(F32(cfg["growth_factor"])),
        "backoff_factor": float(F32(cfg["backoff_factor"])),
    }
    return torch_reference(rounded, pattern)


def test_long_patterns_thousands_of_steps():
    rng = np.random.default_rng(1)
    for hysteresis in (1, 3):
        cfg = {
            "loss_scale": 2.0**15,
            "growth_interval": 7,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "min_loss_scale": 1.0,
            "max_loss_scale": 2.0**24,
            "hysteresis": hysteresis,
        }
        pattern = tuple(bool(b) for b in rng.random(5000) < 0.9)
        ref = megatron_reference if hysteresis > 1 else torch_reference
        assert run_library(cfg, pattern) == ref(cfg, pattern)


def test_million_step_scan_counters_do_not_overflow_or_drift():
    n = 1_000_000
    ls = lossscale.DynamicLossScale(
        1.0, growth_interval=2**31 - 1, max_loss_scale=2.0**24, hysteresis=5
    )

    def body(state, i):
        # finite except every 100_000th step
        return state.adjust(i % 100_000 != 99_999), None

    final, _ = jax.jit(lambda s: jax.lax.scan(body, s, jnp.arange(n)))(ls)
    # 10 overflows reset the tracker; 0 finite steps follow the last one.
    assert int(final.growth_tracker) == 0
    assert int(final.hysteresis_tracker) == 0  # clamped at 0, not negative
    # 5 tolerated, then 5 backoffs from 1.0, clamped at the floor of 1.0
    assert float(final.loss_scale) == 1.0
    # And a run of a million finite steps counts exactly.
    final, _ = jax.jit(
        lambda s: jax.lax.scan(lambda c, _: (c.adjust(True), None), s, None, n)
    )(ls)
    assert int(final.growth_tracker) == n


def test_growth_at_the_largest_scale_clamps():
    top = 2.0**126  # the largest scale whose reciprocal is a normal float32
    cfg = {
        "loss_scale": 2.0**125,
        "growth_interval": 1,
        "max_loss_scale": top,
        "growth_factor": 3.0,
    }
    full = {"backoff_factor": 0.5, "min_loss_scale": 1.0, "hysteresis": 1}
    out = run_library(cfg, (True, True, False, True))
    assert [s for s, _ in out] == [top, top, top / 2, top]
    assert out == torch_reference({**cfg, **full}, (True, True, False, True))
