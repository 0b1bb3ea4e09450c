"""The float8 matmul kernel: :func:`dot_general` with current scaling.

A leaf of the package but for its configuration (:mod:`._float8`),
recipes (:mod:`._recipes`) and quantisation (:mod:`._scaling`):
:func:`dot_general` is what autocast binds in place of a matmul it would
run in its compute dtype, with the equation's dimension numbers.

XLA:CPU runs a ``dot_general`` of float8 operands exactly (it converts them
to float32), so the tests check the numerics on CPU; on a GPU of compute
capability 8.9 or more, XLA rewrites it into a cuBLASLt float8 GEMM
(``benchmarks/fp8_check.py`` counts those in compiled HLO).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale import _compat

from ._float8 import Float8
from ._recipes import F32, Cast
from ._scaling import as_float32, quantize

__all__ = ["dot_general"]


Axes = tuple[int, ...]
# ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))
Dims = tuple[tuple[Axes, Axes], tuple[Axes, Axes]]


def dot_general(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    dimension_numbers: Any,
    config: Float8,
    *,
    out_sharding: Any = None,
    weight: int = 1,
    quantized_weight: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in float8.

    Quantises both operands to ``float8_e4m3fn`` with current scaling
    (:class:`Float8` says how), runs one float8 ``dot_general`` with float32
    accumulation, and returns its result times the inverse scales, in
    ``config.compute_dtype``. Differentiable once, in reverse mode (a
    ``jax.custom_vjp``; a second derivative raises :data:`SECOND_ORDER`):
    the backward matmuls are float8 too, ``e5m2`` gradient by ``e4m3`` operand,
    with the dimension numbers and output shardings of JAX's own transpose
    rules for ``dot_general``.

    Args:
      lhs: a real floating-point array, of any float dtype.
      rhs: likewise.
      dimension_numbers: as ``lax.dot_general``'s,
        ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
      config: a :class:`Float8`.
      out_sharding: as ``lax.dot_general``'s (the equation's
        ``out_sharding`` param), for the forward matmul.
      weight: which operand is the layer's weight, 0 (lhs: equinox's
        ``weight @ x``) or 1 (rhs: ``x @ w``, flax's ``Dense``); only
        ``"rowwise_with_gw_hp"`` reads it, whose weight gradient is
        16-bit.
      quantized_weight: the weight's float8 copy and scale, made before
        it was moved (:func:`._scaling.quantized_move`), which the matmul
        takes in place of quantising the weight; only where the recipe
        casts the weight once, per tensor (:attr:`Recipe.weight_cast_once`).

    Returns:
      The product, in ``config.compute_dtype``; its gradients with respect
      to ``lhs`` and ``rhs`` are in their dtypes.

    Examples:
      >>> import jax, jax.numpy as jnp, lossscale
      >>> from lossscale._autocast import _fp8
      >>> x, w = jnp.ones((4, 8)), jnp.full((8, 2), 0.5)
      >>> dims = (((1,), (0,)), ((), ()))  # x @ w
      >>> y = _fp8.dot_general(x, w, dims, lossscale.Float8())
      >>> y.dtype, float(y[0, 0])
      (dtype(bfloat16), 4.0)
      >>> def loss(x, w):
      ...     y = _fp8.dot_general(x, w, dims, lossscale.Float8())
      ...     return jnp.sum(y.astype(jnp.float32))
      >>> dx, dw = jax.grad(loss, (0, 1))(x, w)
      >>> dx.dtype, round(float(dx[0, 0]), 4), round(float(dw[0, 0]), 4)
      (dtype('float32'), 1.0, 4.0)
    """
    if not isinstance(config, Float8):
        raise TypeError(
            f"config must be a lossscale Float8, got config={config!r}."
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{name} must be a real floating-point array, got {name} of "
                f"dtype {x.dtype}."
            )
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ValueError(f"weight must be 0 or 1, got weight={weight!r}.")
    dims = _canonical(dimension_numbers)
    # Under shard_map, a replicated weight meeting a sharded activation is
    # made varying first, as lax.dot_general would (its cotangent is then
    # the psum of the per-device ones).
    varying = _compat.vma(lhs) | _compat.vma(rhs)
    dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    lhs, rhs = _compat.vary_over(lhs, varying), _compat.vary_over(rhs, varying)
    if quantized_weight is not None:
        if not config.row.weight_cast_once:
            raise ValueError(
                "quantized_weight needs a recipe that casts the weight "
                f"once, per tensor; got config={config!r}."
            )
        quantized_weight = cast(
            tuple[jax.Array, jax.Array],
            tuple(_compat.vary_over(v, varying) for v in quantized_weight),
        )
    pre = (None, quantized_weight)
    if weight == 1 or config.row.symmetric:
        pre = pre if weight == 1 else pre[::-1]
        return _fp8_dot(lhs, rhs, pre, dims, config, out_sharding, dtypes)
    # The rules below take the rhs for the weight: it is put there, and
    # the product's axes (batch, weight free, input free) back in lhs's
    # order.
    (lc, rc), (lb, rb) = dims
    nb = len(lb)
    w_free = np.ndim(lhs) - len(lc) - nb
    x_free = np.ndim(rhs) - len(rc) - nb
    back = (
        *range(nb),
        *range(nb + x_free, nb + x_free + w_free),
        *range(nb, nb + x_free),
    )
    order = tuple(int(a) for a in np.argsort(back))
    sharding = _compat.permuted_sharding(out_sharding, order)
    swapped: Dims = ((rc, lc), (rb, lb))
    out = _fp8_dot(rhs, lhs, pre, swapped, config, sharding, dtypes[::-1])
    return lax.transpose(cast(jax.Array, out), back)


def _canonical(dimension_numbers: Any) -> Dims:
    (lc, rc), (lb, rb) = dimension_numbers
    return (
        (tuple(int(d) for d in lc), tuple(int(d) for d in rc)),
        (tuple(int(d) for d in lb), tuple(int(d) for d in rb)),
    )


def _inverse_in_output(
    scale: jax.Array, contract: Sequence[int], batch: Sequence[int],
    ndim: int, other_free: int, lhs_side: bool,
) -> jax.Array:  # fmt: skip
    """``1 / scale`` laid out for a ``dot_general`` output, whose axes are
    (batch, lhs free, rhs free): the operand's batch axes in the order the
    dimension numbers give, its free axes in order, and size-1 axes for the
    other operand's free axes."""
    inverse = lax.div(np.float32(1), scale)
    if inverse.ndim == 0:
        return inverse
    free = [d for d in range(ndim) if d not in contract and d not in batch]
    kept = sorted([*batch, *free])
    order = tuple(kept.index(d) for d in [*batch, *free])
    sizes = [inverse.shape[d] for d in [*batch, *free]]
    start = len(batch) + len(free) if lhs_side else len(batch)
    shape = (*sizes[:start], *[1] * other_free, *sizes[start:])
    if order != tuple(range(len(order))):  # batch axes after free ones
        inverse = lax.transpose(lax.squeeze(inverse, tuple(contract)), order)
    # Only size-1 axes move: a reshape (none at all for ``x @ w``'s
    # layouts), one equation where squeeze and expand_dims would be two.
    return inverse if inverse.shape == shape else lax.reshape(inverse, shape)


@functools.partial(_compat.inline_jit, static_argnums=(4, 5))
def _scaled_dot(
    qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array,
    dims: Dims, out_sharding: Any,
) -> jax.Array:  # fmt: skip
    """``dot(qa, qb) / (sa * sb)`` in float32: one float8 matmul, then its
    output times the inverse scales (first ``qa``'s, then ``qb``'s)."""
    (ac, bc), (ab, bb) = dims
    out = lax.dot_general(
        qa,
        qb,
        dims,
        preferred_element_type=F32,
        out_sharding=out_sharding,
    )
    a_free = qa.ndim - len(ac) - len(ab)
    b_free = qb.ndim - len(bc) - len(bb)
    inv_a = _inverse_in_output(sa, ac, ab, qa.ndim, b_free, True)
    inv_b = _inverse_in_output(sb, bc, bb, qb.ndim, a_free, False)
    # Row-wise scales are sharded as their operands: they must not reshard
    # the product (explicit mesh axes) away from its out_sharding.
    out = out * _compat.sharded_for(inv_a, out)
    return out * _compat.sharded_for(inv_b, out)


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _product(
    qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array,
    dims: Dims, out_sharding: Any, out_axes: tuple[int, ...] | None,
    dtype: np.dtype,
) -> jax.Array:  # fmt: skip
    """A product in ``dtype``: :func:`_scaled_dot`, transposed by
    ``out_axes`` (``None``: not at all), then the cast. Traced
    (``_product.trace``), never called: a jit traces once per
    signature."""
    out = _scaled_dot(qa, sa, qb, sb, dims, out_sharding)
    if out_axes is not None:
        out = lax.transpose(out, out_axes)
    return out.astype(dtype)


# The result dtypes of :func:`_dequantized`. Not float16: the inverse
# scale, rounded to float16 where XLA does not rewrite the form (a GPU
# without float8 GEMMs), flushes to zero or loses its precision below a
# largest magnitude of 448 x 2**-14 (0.027), as gradients' often are.
_DEQUANTIZED_OUTPUTS = frozenset(np.dtype(d) for d in ("bfloat16", "float32"))


def _dequantized(
    qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array, *,
    spec: tuple[Dims, Any, tuple[int, ...] | None, np.dtype],
) -> jax.Array:  # fmt: skip
    """:func:`_product` of per-tensor scales as CUDA lowers it: each
    operand dequantised into the result's dtype (``q * (1 / s)``) and one
    matmul in that dtype, the pattern XLA's GEMM rewriter turns into a
    cuBLASLt float8 GEMM that takes both inverse scales in float32 and
    writes the result itself (flax's ``fp8_ops`` feeds it the same): the
    same float32 accumulation and scaling, rounded once.

    XLA's GPU compiler made :func:`_product`'s form a GEMM writing float32
    with one of the scales, and a kernel scaling and casting its output
    (a [8192, 1024] x [1024, 4096] product's temporary memory 138.4 MB
    against 8.4 MB, the H200's compile, jax 0.10.2). Where the rewriter
    does not take this form (a GPU without float8 GEMMs;
    ``benchmarks/fp8_check.py`` counts them), the dot runs in the result's
    dtype on operands rounded to it.
    """
    dims, out_sharding, out_axes, dtype = spec

    def dequantize(q: jax.Array, scale: jax.Array) -> jax.Array:
        return q.astype(dtype) * lax.div(np.float32(1), scale).astype(dtype)

    out = lax.dot_general(
        dequantize(qa, sa),
        dequantize(qb, sb),
        dims,
        preferred_element_type=dtype,
        out_sharding=out_sharding,
    )
    return out if out_axes is None else lax.transpose(out, out_axes)


def _bind_product(
    args: tuple[jax.Array, jax.Array, jax.Array, jax.Array],
    dims: Dims, out_sharding: Any, out_axes: tuple[int, ...] | None,
    dtype: np.dtype,
) -> jax.Array:  # fmt: skip
    """:func:`_product` as one equation (``_compat.bind_as_dot``), which
    CUDA lowers as :func:`_dequantized` where both scales are per tensor
    and ``dtype`` is one it writes."""
    static = (dims, out_sharding, out_axes, dtype)
    jaxpr = _product.trace(*args, *static).jaxpr
    _, sa, _, sb = args
    per_tensor = not sa.ndim and not sb.ndim
    cuda = (
        (_dequantized, static)
        if per_tensor and dtype in _DEQUANTIZED_OUTPUTS
        else None
    )
    return _compat.bind_as_dot(jaxpr, args, cuda)


# --- the matmul and its derivative -----------------------------------------


def _cast(
    x: jax.Array, cast: Cast, axes: Sequence[int], config: Float8
) -> tuple[jax.Array, jax.Array | None]:
    """``x`` cast for a GEMM that contracts its ``axes``: quantised, with
    its scale(s), or in the compute dtype (scale ``None``)."""
    if cast.dtype is None:
        return x.astype(config.compute_dtype), None
    rows = tuple(axes) if cast.rowwise else None
    return quantize(x, cast.dtype, rows, bool(config.power_of_two_scales))


def _forward(
    lhs: jax.Array, rhs: jax.Array, pre: Any, dims: Dims, config: Float8,
    out_sharding: Any,
) -> tuple[jax.Array, tuple[Any, Any]]:  # fmt: skip
    """The product, and what the backward pass keeps of each operand: its
    float8 copy and scale where its backward cast is its forward one per
    tensor, else the operand itself. ``pre``: per operand, its float8
    copy and scale made before it was moved, or None."""
    row = config.row
    (lc, rc), _ = dims
    pre_lhs, pre_rhs = pre
    # float8 both (_check_recipe): each has its scale(s).
    q_lhs, s_lhs = pre_lhs or _cast(lhs, row.input, lc, config)
    q_rhs, s_rhs = pre_rhs or _cast(rhs, row.weight, rc, config)
    s_lhs, s_rhs = cast(jax.Array, s_lhs), cast(jax.Array, s_rhs)
    # One equation, for jax.checkpoint's policies (_compat.bind_as_dot):
    # a dots-saveable policy saves its compute-dtype result, not the
    # float32 accumulator inside.
    args = (q_lhs, s_lhs, q_rhs, s_rhs)
    out = _bind_product(
        args, dims, out_sharding, None, np.dtype(config.compute_dtype)
    )
    keep_lhs = _reused(row.input, row.input_for_grad_weight)
    keep_rhs = _reused(row.weight, row.weight_for_grad_input)
    return out, (
        (q_lhs, s_lhs) if keep_lhs else lhs,
        (q_rhs, s_rhs) if keep_rhs else rhs,
    )


def _reused(forward: Cast, backward: Cast) -> bool:
    """Whether the backward GEMM can take the forward's quantised operand:
    the same cast, per tensor (a row-wise one scales along the axes of
    another contraction)."""
    return forward == backward and not forward.rowwise


SECOND_ORDER = (
    "lossscale.autocast with a Float8 recipe: a float8 matmul is "
    "differentiated once, in reverse mode (jax.grad, jax.vjp, jax.jacrev). "
    "A derivative of its gradient (jax.hessian, jax.grad or jax.jacrev of a "
    "gradient, jax.jvp of one) would differentiate its quantisation to "
    "float8, where the tangents underflow to zero or overflow: not "
    "supported. Keep the matmuls 16-bit where you need it: "
    "lossscale.autocast(fun, lossscale.Float8(...), "
    "rules={'dot_general': 'compute'}), or a 16-bit compute_dtype."
)


@jax.custom_jvp
def _differentiated_once(xs: Any) -> Any:
    """``xs`` itself; differentiating it raises :data:`SECOND_ORDER`.

    Around what the float8 matmul's derivative rules read (the operands
    in the forward rule, the cotangent in the backward): a first
    derivative never differentiates those rules, a second one would, and
    its tangents would go through the casts to float8 unscaled (a
    Hessian of NaNs and zeros, measured)."""
    return xs


@_differentiated_once.defjvp
def _differentiated_once_jvp(primals: Any, tangents: Any) -> Any:
    del primals, tangents
    raise TypeError(SECOND_ORDER)


# The static arguments: the dimension numbers, the config, the forward's
# out_sharding, and the operands' dtypes (the float8 residuals lose them).
# ``pre``: per operand, its float8 copy and scale, made before it was
# moved (quantized_move), or None; they carry no derivative.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fp8_dot(
    lhs: jax.Array, rhs: jax.Array, pre: Any, dims: Dims, config: Float8,
    out_sharding: Any, dtypes: tuple[np.dtype, np.dtype],
) -> jax.Array:  # fmt: skip
    del dtypes
    return _forward(lhs, rhs, pre, dims, config, out_sharding)[0]


def _fp8_dot_fwd(
    lhs: jax.Array, rhs: jax.Array, pre: Any, dims: Dims, config: Float8,
    out_sharding: Any, dtypes: tuple[np.dtype, np.dtype],
) -> tuple[jax.Array, tuple[Any, Any]]:  # fmt: skip
    del dtypes
    lhs, rhs = _differentiated_once((lhs, rhs))
    return _forward(lhs, rhs, pre, dims, config, out_sharding)


def _transpose(
    dims: Dims, x_ndim: int, y_ndim: int, swap_ans: bool
) -> tuple[Dims, list[int], tuple[int, ...]]:
    """JAX's ``_dot_general_transpose_lhs`` (jax/_src/lax/lax.py): the
    dimension numbers of ``dot_general(g, y)`` giving x's cotangent, the
    order of x's axes in its output, and the permutation back to x's."""
    (x_contract, y_contract), (x_batch, y_batch) = dims
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    nb = len(x_batch)
    ans_batch = tuple(range(nb))
    if swap_ans:
        ans_y = tuple(range(nb, nb + len(y_kept)))
    else:
        start = nb + len(x_kept)
        ans_y = tuple(range(start, start + len(y_kept)))
    new_dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    by_y = [int(d) for d in np.take(x_contract, np.argsort(y_contract))]
    unsorted = [*x_batch, *x_kept, *by_y]
    return new_dims, unsorted, tuple(int(d) for d in np.argsort(unsorted))


def _remaining(ndim: int, *removed: Sequence[int]) -> list[int]:
    gone = {d for axes in removed for d in axes}
    return [d for d in range(ndim) if d not in gone]


def _cotangent(
    g: jax.Array, gs: jax.Array, qy: jax.Array, ys: jax.Array, x_ref: Any,
    x_dtype: Any, dims: Dims, swap_ans: bool,
) -> jax.Array:  # fmt: skip
    """x's cotangent from float8 ``g`` and ``y`` (scales ``gs``, ``ys``), as
    JAX's transpose rule computes it; ``x_ref`` has x's shape and sharding
    (x itself, or its float8 copy)."""
    new_dims, unsorted, out_axes = _transpose(
        dims, x_ref.ndim, qy.ndim, swap_ans
    )
    sharding = _compat.transpose_out_sharding(x_ref, unsorted)
    return _cotangent_product(
        g, gs, qy, ys, new_dims, sharding, out_axes, np.dtype(x_dtype)
    )


@functools.partial(jax.jit, static_argnums=(4, 5, 6, 7))
def _cotangent_product(
    g: jax.Array, gs: jax.Array, qy: jax.Array, ys: jax.Array, dims: Dims,
    sharding: Any, out_axes: tuple[int, ...], dtype: np.dtype,
) -> jax.Array:  # fmt: skip
    """:func:`_product`, transposed to x's axes, in x's dtype: a jit, one
    equation of the backward pass (bound a few hundred times in a deep
    model's step, each a dozen-odd operations otherwise), traced and
    lowered once per signature."""
    return _bind_product((g, gs, qy, ys), dims, sharding, out_axes, dtype)


def _fp8_dot_bwd(
    dims: Dims, config: Float8, out_sharding: Any,
    dtypes: tuple[np.dtype, np.dtype], saved: Any, g: jax.Array,
) -> tuple[jax.Array, jax.Array, None]:  # fmt: skip
    del out_sharding  # the cotangents take their operands' shardings
    dlhs, drhs = _cotangents(
        _differentiated_once(g), saved, dims, config, dtypes
    )
    return dlhs, drhs, None


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _cotangents(
    g: jax.Array, saved: Any, dims: Dims, config: Float8,
    dtypes: tuple[np.dtype, np.dtype],
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Both operands' cotangents: a jit, so that the backward pass of each
    float8 matmul is one equation for the transformations after it (a
    scan's transpose, the lowering), traced once per signature."""
    row = config.row
    lhs_dtype, rhs_dtype = dtypes
    kept_lhs, kept_rhs = saved
    (lc, rc), (lb, rb) = dims
    swapped: Dims = ((rc, lc), (rb, lb))
    ndims = tuple(_ndim(k) for k in (kept_lhs, kept_rhs))
    # lhs's (the input's) cotangent: dot(g, rhs), contracting g's
    # rhs-free axes and rhs's free ones.
    l_dims, _, _ = _transpose(dims, ndims[0], ndims[1], False)
    (g_axes, r_axes), _ = l_dims
    dlhs = _gemm(
        (g, row.grad_output, g_axes),
        (kept_rhs, row.weight_for_grad_input, r_axes),
        (kept_lhs, lhs_dtype, dims, False),
        config,
    )
    # rhs's (the weight's) cotangent: dot(g, lhs).
    r_dims, _, _ = _transpose(swapped, ndims[1], ndims[0], True)
    (g_axes, l_axes), _ = r_dims
    drhs = _gemm(
        (g, row.grad_output_for_grad_weight, g_axes),
        (kept_lhs, row.input_for_grad_weight, l_axes),
        (kept_rhs, rhs_dtype, swapped, True),
        config,
    )
    return dlhs, drhs


def _ndim(kept: Any) -> int:
    return kept[0].ndim if isinstance(kept, tuple) else kept.ndim


def _gemm(
    g_side: tuple[jax.Array, Cast, Sequence[int]],
    y_side: tuple[Any, Cast, Sequence[int]],
    x_side: tuple[Any, Any, Dims, bool],
    config: Float8,
) -> jax.Array:
    """x's cotangent, ``dot(g, y)`` as JAX's transpose rule computes it,
    each operand cast as the recipe says (``y`` may be kept quantised
    from the forward pass); ``x_side``: what x was kept as, x's dtype,
    the dimension numbers with x first, and whether x is the rhs."""
    g, g_cast, g_axes = g_side
    y, y_cast, y_axes = y_side
    x_kept, x_dtype, dims, swap_ans = x_side
    x_ref = x_kept[0] if isinstance(x_kept, tuple) else x_kept
    if g_cast.dtype is None:  # and y_cast's (_check_recipe)
        return _high_precision_cotangent(
            g, y, x_ref, x_dtype, dims, swap_ans, config
        )
    # y was kept quantised by the forward pass, or is quantised here.
    qy, ys = y if isinstance(y, tuple) else _cast(y, y_cast, y_axes, config)
    q_g, s_g = _cast(g, g_cast, g_axes, config)
    return _cotangent(
        q_g, cast(jax.Array, s_g), qy, cast(jax.Array, ys), x_ref, x_dtype,
        dims, swap_ans,
    )  # fmt: skip


def _high_precision_cotangent(
    g: jax.Array, y: jax.Array, x_ref: jax.Array, x_dtype: Any, dims: Dims,
    swap_ans: bool, config: Float8,
) -> jax.Array:  # fmt: skip
    """x's cotangent ``dot(g, y)`` from ``config.compute_dtype`` operands,
    accumulated in float32 and rounded to the compute dtype once, as a
    GPU's 16-bit GEMM does on every backend (with a bfloat16 result type,
    XLA:CPU on jax 0.12 strayed past that rounding on the tests' shapes).

    On CPU the 16-bit operands are multiplied as float32 (their products
    are exact in float32, so the result is the same): XLA:CPU runs some
    16-bit dots with a float32 result outside its fast kernels, whose
    ``DotThunk`` refuses them (``Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32``, jax 0.10.2, on the weight
    gradient of ``einsum("mhd,hdn->mn")``, a flax ``DenseGeneral``)."""
    new_dims, unsorted, out_axes = _transpose(
        dims, x_ref.ndim, y.ndim, swap_ans
    )
    dtype = config.compute_dtype
    sharding = _compat.transpose_out_sharding(x_ref, unsorted)

    def dot(wide: bool) -> jax.Array:
        a, b = g.astype(dtype), y.astype(dtype)
        if wide:
            a, b = as_float32(a), as_float32(b)
        return lax.dot_general(
            a,
            b,
            new_dims,
            precision=lax.Precision.HIGHEST if wide else None,
            preferred_element_type=F32,
            out_sharding=sharding,
        )

    out = lax.platform_dependent(
        cpu=lambda: dot(True), default=lambda: dot(False)
    )
    return lax.transpose(out.astype(dtype), out_axes).astype(x_dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)
