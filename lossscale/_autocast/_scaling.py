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

from lossscale import _compat

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


# --- the operations, in lax or emitted as StableHLO ------------------------
#
# The quantisation is written once, over ``ops``: :data:`LAX` traces it
# (``quantized_move``, and the jit ``quantize`` falls back on where JAX
# lacks what the primitive needs), and ``_compat.Hlo`` emits the same
# operations into the lowering of the primitive ``quantize`` binds.


class _Lax:
    """The operations of a quantisation, as ``lax`` functions."""

    convert = staticmethod(lax.convert_element_type)
    reduce_precision = staticmethod(lax.reduce_precision)
    abs = staticmethod(lax.abs)
    max = staticmethod(lax.max)
    min = staticmethod(lax.min)
    div = staticmethod(lax.div)
    mul = staticmethod(lax.mul)
    bitwise_and = staticmethod(lax.bitwise_and)
    bitcast = staticmethod(lax.bitcast_convert_type)
    ne = staticmethod(lax.ne)
    select = staticmethod(lax.select)

    @staticmethod
    def reduce_max(x: jax.Array, axes: Sequence[int] | None) -> jax.Array:
        # lax, not jnp: each jnp function is a jit call of its own to
        # trace.
        reduced = tuple(range(x.ndim)) if axes is None else tuple(axes)
        amax = lax.reduce_max(x, reduced)
        return amax if axes is None else lax.expand_dims(amax, reduced)


LAX: Any = _Lax()


def kept_rounding(dtype: Any) -> tuple[int, int] | None:
    """The exponent and mantissa bits of a 16-bit ``dtype``, whose
    rounding :func:`as_float32` keeps; ``None`` for other dtypes (float8
    and float32 convert to float32 exactly; float64 rounds, as its matmul
    would)."""
    if np.dtype(dtype).itemsize != 2:
        return None
    info = jnp.finfo(dtype)
    return int(info.nexp), int(info.nmant)


def as_float32(x: Any, ops: Any = LAX) -> Any:
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
    wide = ops.convert(x, F32)
    bits = kept_rounding(x.dtype)
    return wide if bits is None else ops.reduce_precision(wide, *bits)


# --- scales -----------------------------------------------------------------


def round_down_to_power_of_two(scale: Any, ops: Any = LAX) -> Any:
    """Each float32 of ``scale`` rounded down to a power of two, exactly.

    torchao computes ``exp2(floor(log2(scale)))``; JAX's ``log2`` is
    ``log(x) / log(2)``, which is off at most powers of two (the floor then
    halves the scale). Clearing the mantissa bits of a positive normal
    float is exact; 0 and inf are kept, and NaN is kept NaN (clearing a
    NaN's mantissa would make it inf).
    """
    bits = ops.bitcast(scale, np.uint32)
    mask = np.uint32(0xFF800000)
    rounded = ops.bitcast(ops.bitwise_and(bits, mask), F32)
    return ops.select(ops.ne(scale, scale), scale, rounded)  # NaN kept


def scale_for(
    x: Any, dtype: np.dtype, axes: Sequence[int] | None, pow2: bool,
    ops: Any = LAX,
) -> Any:  # fmt: skip
    """float32 scale(s) of ``x`` for ``dtype``: one (a scalar) if ``axes``
    is ``None``, else one per position of the other axes (``keepdims``).
    ``x`` is float32 (:func:`as_float32`)."""
    return scale_of(ops.reduce_max(ops.abs(x), axes), dtype, pow2, ops)


def scale_of(amax: Any, dtype: np.dtype, pow2: bool, ops: Any = LAX) -> Any:
    """The float32 scale(s) for ``dtype`` of values whose largest
    magnitude is ``amax``."""
    # lax.min and lax.max keep a NaN (a NaN amax; XLA:CPU's reduce_max and
    # pmax may drop one: docs/guide/distributed.md), and an inf amax
    # gives 0.
    # An operand of size 0 has the amax -inf, floored to EPS: its scale is
    # finite (its product zeros, as an empty sum is 0).
    scale = ops.div(np.float32(_MAX[dtype]), ops.max(amax, np.float32(EPS)))
    scale = ops.min(scale, np.float32(MAX_SCALE))
    return round_down_to_power_of_two(scale, ops) if pow2 else scale


def _quantized(
    ops: Any, x: Any, *, dtype: np.dtype, axes: tuple[int, ...] | None,
    pow2: bool,
) -> tuple[Any, Any]:  # fmt: skip
    """``x`` quantised to ``dtype``, and its scale(s)."""
    x = as_float32(x, ops)
    scale = scale_for(x, dtype, axes, pow2, ops)
    return ops.convert(ops.mul(x, scale), dtype), scale


# --- the quantisation, one equation ------------------------------------------


def _avals(x: Any, *, dtype: np.dtype, axes: Any, pow2: bool) -> list[Any]:
    del pow2
    return [_compat.retyped(x, dtype), _compat.reduced_aval(x, axes, F32)]


def _batched(
    args: Sequence[jax.Array], dims: Sequence[Any], *, dtype: np.dtype,
    axes: tuple[int, ...] | None, pow2: bool,
) -> tuple[list[jax.Array], list[int]]:  # fmt: skip
    # As vmap of the lax operations: one scale per example (a per-tensor
    # scale of each), or per row of each.
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)
    rows = range(1, x.ndim) if axes is None else (a + 1 for a in axes)
    q, scale = _QUANTIZE.bind(x, dtype=dtype, axes=tuple(rows), pow2=pow2)
    if axes is None:
        scale = lax.reshape(scale, (x.shape[0],))
    return [q, scale], [0, 0]


_QUANTIZE = _compat.lowered_primitive(
    "lossscale_float8_quantize",
    abstract_eval=_avals,
    lower=_quantized,
    traced=lambda x, **params: list(_quantized(LAX, x, **params)),
    batch=_batched,
)


# Where JAX lacks what the primitive needs: a jit, not inlined, so that a
# quantisation is one equation for every transformation after it (grad's,
# a scan's, the lowering), traced once a signature.
@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _traced(
    x: jax.Array, dtype: np.dtype, axes: tuple[int, ...] | None, pow2: bool
) -> tuple[jax.Array, jax.Array]:
    return _quantized(LAX, x, dtype=dtype, axes=axes, pow2=pow2)


def quantize(
    x: jax.Array, dtype: np.dtype, axes: tuple[int, ...] | None, pow2: bool
) -> tuple[jax.Array, jax.Array]:
    """``x`` quantised to the float8 ``dtype`` with current scaling, and
    its float32 scale(s): one per tensor (a scalar) if ``axes`` is
    ``None``, else one per position of the other axes, along ``axes``
    (``keepdims``). ``x * scale`` cast to ``dtype`` is the float8 value.

    One equation (the primitive ``lossscale_float8_quantize``), lowered
    to the operations :data:`LAX` would trace: a float8 step's trace and
    lowering cost a scanned model's quantisations once each, and a
    quantisation's traced form cost a scanned float8 step 1.21x-1.28x
    bfloat16 autocast's trace and lowering (``benchmarks/float8_trace.py``)."""
    dtype, pow2 = np.dtype(dtype), bool(pow2)
    if axes is not None:
        axes = tuple(int(a) for a in axes)
        if any(not 0 <= a < np.ndim(x) for a in axes):
            raise ValueError(
                f"axes must be axes of x (ndim {np.ndim(x)}), got axes={axes}."
            )
    if _QUANTIZE is None:  # pragma: no cover - every supported JAX
        return _traced(x, dtype, axes, pow2)
    q, scale = _QUANTIZE.bind(x, dtype=dtype, axes=axes, pow2=pow2)
    return q, scale


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
