"""Current scaling: a tensor's float8 scale, its quantisation, and a
weight quantised before it is moved.

The float8 kernel (:mod:`._fp8`) quantises each operand here, with the
scale its largest magnitude gives (one a tensor, or one a row); an FSDP
weight gathered for float8 matmuls is quantised here before its gather
(:func:`quantized_move`), with the scale of the gathered weight.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._float8 import Float8
from ._recipes import _MAX, EPS, F32, MAX_SCALE

__all__ = [
    "as_float32",
    "quantize",
    "quantized_move",
    "round_down_to_power_of_two",
    "scale_for",
    "scale_of",
]


# --- scales -----------------------------------------------------------------


def round_down_to_power_of_two(scale: jax.Array) -> jax.Array:
    """Each float32 of ``scale`` rounded down to a power of two, exactly.

    torchao computes ``exp2(floor(log2(scale)))``; JAX's ``log2`` is
    ``log(x) / log(2)``, which is off at most powers of two (the floor then
    halves the scale). Clearing the mantissa bits of a positive normal
    float is exact; 0 and inf are kept, and NaN is kept NaN (clearing a
    NaN's mantissa would make it inf).
    """
    bits = lax.bitcast_convert_type(scale, np.uint32)
    mask = np.uint32(0xFF800000)
    rounded = lax.bitcast_convert_type(lax.bitwise_and(bits, mask), F32)
    return lax.select(lax.ne(scale, scale), scale, rounded)  # NaN kept


def scale_for(
    x: jax.Array, dtype: np.dtype, axes: Sequence[int] | None, pow2: bool
) -> jax.Array:
    """float32 scale(s) of ``x`` for ``dtype``: one (a scalar) if ``axes``
    is ``None``, else one per position of the other axes (``keepdims``)."""
    # lax, not jnp: each jnp function is a jit call of its own to trace,
    # and a float8 step quantises a few hundred times (its trace took
    # 1.3x to 1.8x bfloat16's). ``x`` is float32 (quantize).
    reduced = tuple(range(x.ndim)) if axes is None else tuple(axes)
    amax = lax.reduce_max(lax.abs(x), reduced)
    if axes is not None:
        amax = lax.expand_dims(amax, reduced)
    return scale_of(amax, dtype, pow2)


def scale_of(amax: jax.Array, dtype: np.dtype, pow2: bool) -> jax.Array:
    """The float32 scale(s) for ``dtype`` of values whose largest
    magnitude is ``amax``."""
    # lax.min and lax.max keep a NaN (a NaN amax; XLA:CPU's reduce_max and
    # pmax may drop one: docs/guide/distributed.md), and an inf amax
    # gives 0.
    # An operand of size 0 has the amax -inf, floored to EPS: its scale is
    # finite (its product zeros, as an empty sum is 0).
    scale = lax.div(np.float32(_MAX[dtype]), lax.max(amax, np.float32(EPS)))
    scale = lax.min(scale, np.float32(MAX_SCALE))
    return round_down_to_power_of_two(scale) if pow2 else scale


def as_float32(x: jax.Array) -> jax.Array:
    """``x``'s values in float32, a 16-bit ``x``'s rounding kept.

    ``x.astype(float32)`` of a 16-bit value that XLA computed in float32
    (its default ``xla_allow_excess_precision`` removes the
    float32 -> 16-bit -> float32 pair) would quantise the unrounded value:
    jitted and eager float8 gradients then differed by 5-12% of their
    largest element on a 4-layer tanh net (an output gradient's rounding
    to bfloat16 lost just before ``e5m2``, whose steps are a quarter of a
    value, turns into whole-quantum flips). ``reduce_precision`` says the
    rounding in a form XLA keeps, and costs one elementwise operation in
    the quantisation's fusion."""
    wide = lax.convert_element_type(x, F32)
    if np.dtype(x.dtype).itemsize != 2:  # float8 and float32 convert
        return wide  # exactly; float64 rounds, as its matmul would
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(
        wide, exponent_bits=info.nexp, mantissa_bits=info.nmant
    )


# A jit, not inlined: a quantisation is one equation for every
# transformation after it (grad's, a scan's, the lowering), and the layers
# of a model quantise operands of a few shapes, each traced once. (Inlined,
# the float8 step of a scanned 12-layer model traced at 1.36x-1.43x
# bfloat16's; benchmarks/float8_trace.py.)
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def quantize(
    x: jax.Array, dtype: np.dtype, axes: tuple[int, ...] | None, pow2: bool
) -> tuple[jax.Array, jax.Array]:
    x = as_float32(x)
    scale = scale_for(x, dtype, axes, pow2)
    return lax.convert_element_type(lax.mul(x, scale), dtype), scale


def quantized_move(
    x: jax.Array, move: Any, config: Float8, global_max: Any
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``move(x)`` for float8 matmuls' weight: quantised, then moved.

    ``x`` is a float32 weight that only matmuls read whose recipe casts
    the weight once, per tensor (:attr:`Recipe.weight_cast_once`), and
    ``move`` a move that adds no value (an all-gather, a resharding).
    Its scale is that of the moved value (``global_max`` of ``x``'s
    largest magnitude: a ``pmax`` over the axes an all-gather gathers),
    so the float8 values moved are those the matmuls would make from the
    moved float32 weight, at a quarter of its bytes.

    Returns:
      The moved weight, float32, its values the float8 ones times the
      inverse scale, through which the matmuls' weight gradients flow:
      its tangent is moved in float32, so the backward pass moves (sums)
      the gradient in float32 (a reduce-scatter). And the moved float8
      copy with its scale, which :func:`dot_general` takes
      (``quantized_weight``) instead of quantising the moved weight again.
    """
    dtype = config.row.weight.dtype
    if dtype is None or not config.row.weight_cast_once:
        raise ValueError(
            "quantized_move needs a recipe that casts the weight once, per "
            f"tensor; got config={config!r}."
        )
    x32 = as_float32(lax.stop_gradient(x))
    amax = global_max(lax.reduce_max(lax.abs(x32), tuple(range(x32.ndim))))
    scale = scale_of(amax, dtype, bool(config.power_of_two_scales))
    q = move(lax.convert_element_type(lax.mul(x32, scale), dtype))

    @jax.custom_jvp
    def moved(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
        del x
        return lax.mul(lax.convert_element_type(q, F32), 1 / scale)

    @moved.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        # The float8 copy and its scale carry no derivative (as the
        # matmuls' own quantisation does not): x's tangent is moved.
        return moved(*primals), move(tangents[0])

    return moved(x, q, scale), (q, scale)
