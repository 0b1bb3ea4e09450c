"""Choosing an initial loss scale: overflow and underflow per candidate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _checks, _tree
from lossscale._scales import StaticLossScale


class Diagnosis(NamedTuple):
    """What :func:`diagnose` found.

    Attributes:
        scales: the candidate scales, ascending.
        overflow: for each scale, the fraction of gradient elements that are
            inf or NaN once the scaled gradients are in ``dtype``.
        underflow: for each scale, the fraction of gradient elements that
            are non-zero in the reference but zero once scaled into
            ``dtype``.
        recommended: the suggested initial scale (see :func:`diagnose`).
        dtype: the low-precision dtype the gradients were judged in.
    """

    scales: np.ndarray
    overflow: np.ndarray
    underflow: np.ndarray
    recommended: float
    dtype: np.dtype

    def __str__(self) -> str:
        rows = [
            f"loss scale diagnosis ({self.dtype.name} gradients)",
            "    scale   overflow  underflow",
        ]
        for s, o, u in zip(
            self.scales, self.overflow, self.underflow, strict=True
        ):
            mark = "  <- recommended" if s == self.recommended else ""
            rows.append(f"{_pretty(s):>9}  {o:9.2%}  {u:9.2%}{mark}")
        return "\n".join(rows)


def _pretty(scale: float) -> str:
    exponent = np.log2(scale)
    if exponent == np.round(exponent):
        return f"2**{int(exponent)}"
    return f"{scale:.4g}"


def diagnose(
    loss_fn: Callable[..., jax.Array],
    params: Any,
    *args: Any,
    reference_loss_fn: Callable[..., jax.Array] | None = None,
    scales: Sequence[float] | np.ndarray | None = None,
    dtype: jax.typing.DTypeLike = jnp.float16,
    headroom: float = 2.0,
) -> Diagnosis:
    """Measures overflow and underflow of the gradients for candidate scales.

    For each candidate scale ``S`` it takes ``jax.grad`` of
    ``S * loss_fn(params, *args)`` (computed however ``loss_fn`` computes:
    float16 compute makes the backward pass itself underflow), puts the
    scaled gradients in ``dtype`` (which is what a float16 gradient holds,
    and simulates it for a float32 model) and counts, against the reference
    gradients of ``reference_loss_fn`` (default ``loss_fn`` itself):

    - overflow: elements that are inf or NaN;
    - underflow: elements that are non-zero in the reference but zero.

    The recommended initial scale is the largest candidate without
    overflow, divided by ``headroom`` for the batches to come (a dynamic
    scale finds its own way from there). If every candidate overflows, it
    is the smallest candidate.

    Args:
        loss_fn: ``loss_fn(params, *args) -> scalar loss``, in the precision
            you train with (e.g. a flax model with ``dtype=jnp.float16``).
        params: the parameters to differentiate with respect to.
        *args: the remaining arguments of ``loss_fn`` (e.g. a batch).
        reference_loss_fn: the same loss in float32, for the underflow
            reference; pass it when ``loss_fn`` computes in low precision.
        scales: the candidates; default the powers of two from 1 to 2**24.
        dtype: the low-precision dtype, float16 (default), bfloat16 or a
            float8 type.
        headroom: the factor between the largest overflow-free candidate and
            the recommendation, >= 1.

    Returns:
        A :class:`Diagnosis`; ``print`` it for a table.

    Raises:
        TypeError: if ``dtype`` is not a floating dtype or ``scales`` is
            not a list of numbers.
        ValueError: if ``scales`` is empty, not one-dimensional or has a
            scale outside ``[2**-126, 2**126]``, or ``headroom < 1``.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> def loss_fn(w, x):  # gradients 1e-6 * x: 1e-9, 1e-6 and 0.03
        ...     return jnp.sum(w * x) * 1e-6
        >>> x = jnp.array([1e-3, 1.0, 3e4])
        >>> d = lossscale.diagnose(loss_fn, jnp.ones(3), x)
        >>> float(d.underflow[0]), float(d.overflow[-1])  # at 1 and at 2**24
        (0.3333333333333333, 0.3333333333333333)
        >>> d.recommended  # 2**21 is the largest without overflow; halved
        1048576.0
    """
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got dtype={dtype}.")
    headroom = _checks.static_float("headroom", headroom)
    if not (np.isfinite(headroom) and headroom >= 1):
        raise ValueError(f"headroom must be >= 1, got headroom={headroom!r}.")
    if scales is None:
        scales = 2.0 ** np.arange(0, 25)
    try:
        scales = np.sort(np.asarray(scales, np.float64))
    except (TypeError, ValueError) as err:
        raise TypeError(
            "scales must be None or a list of loss scales (real numbers), "
            f"got scales={scales!r} ({err})."
        ) from None
    if (
        scales.ndim != 1
        or not scales.size
        or not np.all(scales >= _checks.MIN_SCALE)
        or not np.all(scales <= _checks.MAX_SCALE)
    ):
        raise ValueError(
            "scales must be a non-empty list of loss scales, each in "
            f"{_checks.SCALE_RANGE}, got "
            f"{scales!r}."
        )

    ref_fn = reference_loss_fn or loss_fn
    reference = jax.grad(ref_fn)(params, *args)
    ref_nonzero = [
        np.asarray(r) != 0
        for r in jax.tree.leaves(reference)
        if _tree.is_float(r)
    ]
    total = sum(r.size for r in ref_nonzero)

    @jax.jit
    def scaled_grads(scale: jax.Array) -> list[jax.Array]:
        ls = StaticLossScale(scale)
        grads = jax.grad(lambda p: ls.scale(loss_fn(p, *args)))(params)
        return [
            g.astype(dtype) for g in jax.tree.leaves(grads) if _tree.is_float(g)
        ]

    overflow, underflow = [], []
    for scale in scales:
        grads = [np.asarray(g.astype(jnp.float32)) for g in scaled_grads(scale)]
        overflow.append(sum(np.sum(~np.isfinite(g)) for g in grads) / total)
        underflow.append(
            sum(
                np.sum((g == 0) & nz)
                for g, nz in zip(grads, ref_nonzero, strict=True)
            )
            / total
        )
    overflow, underflow = np.asarray(overflow), np.asarray(underflow)
    safe = scales[overflow == 0]
    recommended = (
        float(max(safe[-1] / headroom, scales[0]))
        if safe.size
        else float(scales[0])
    )
    return Diagnosis(scales, overflow, underflow, recommended, dtype)
