"""Casting values to the dtype their class is stored in.

The casting helpers both passes' handlers share: a value's dtype
(:func:`dtype_of`), a cast that converts each value once per evaluation
(:func:`cast`, :func:`cast_cache`), a strongly typed cast for loop
carries, branch outputs and call operands (:func:`strong`), and storing
values for their classes (:func:`as_class`, :func:`store`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from lossscale import _compat
from lossscale._autocast._classes import Cls, class_dtype, is_float


def dtype_of(x: Any) -> Any:
    """``x``'s dtype: a numpy dtype, or an extended one (PRNG keys)."""
    dtype = getattr(x, "dtype", None)
    return np.asarray(x).dtype if dtype is None else dtype


def _concrete(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic) or not hasattr(x, "dtype")


def cast(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (one conversion per value and dtype per
    evaluation, inside :func:`cast_cache`)."""
    # Compared before np.dtype, which refuses extended dtypes: a PRNG key
    # is "cast" to its own dtype, which is no cast at all.
    if dtype_of(x) == dtype:
        return x
    dtype = np.dtype(dtype)
    if _concrete(x):
        return np.asarray(x).astype(dtype)
    cache = _CASTS.get()
    if cache is None:
        return _compat.convert(x, dtype)
    key = (id(x), dtype)
    hit = cache.get(key)
    if hit is None or hit[0] is not x:
        # The value is kept with its cast, so that its id is not reused.
        hit = (x, _compat.convert(x, dtype))
        cache[key] = hit
    return hit[1]


def strong(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype``, strongly typed (a loop carry, a branch output,
    a call's operand must have one type)."""
    if not is_float(dtype_of(x)) and not is_float(dtype):
        return x
    if _concrete(x):
        return np.asarray(x).astype(dtype)
    if dtype_of(x) == dtype and not getattr(jax.typeof(x), "weak_type", False):
        return x
    return lax.convert_element_type(x, dtype)


def as_class(x: Any, cls: Cls, traced: Any, compute: np.dtype) -> Any:
    """``x`` stored for ``cls``, strongly typed; a constant or a value
    autocast keeps in the dtype it was traced with (``traced``)."""
    dtype = class_dtype(cls, compute)
    if dtype is None:
        if not is_float(traced):
            return x
        dtype = traced
    return strong(x, dtype)


def store(outs: Sequence[Any], classes: Sequence[Cls], compute: np.dtype):
    """Each of ``outs`` in the dtype its class is stored in."""
    result = []
    for x, cls in zip(outs, classes, strict=True):
        dtype = class_dtype(cls, compute)
        if dtype is not None and is_float(dtype_of(x)):
            x = cast(x, dtype)
        result.append(x)
    return result


# One cast of a value to a dtype per evaluation: an activation read in
# float32 by several equations is converted once. A cache belongs to the
# evaluation that opened it (a loop body's values must not leak out).
_CASTS: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "lossscale_autocast_casts", default=None
)


# The float8 copies of the weights moved quantised in this evaluation
# (``._scaling.quantized_move``), by the moved weight: its float8 matmuls,
# which read it in the same jaxpr, take the copy in place of quantising.
_QUANTIZED: contextvars.ContextVar[dict[int, Any] | None] = (
    contextvars.ContextVar("lossscale_autocast_quantized", default=None)
)


@contextlib.contextmanager
def cast_cache() -> Iterator[None]:
    """Opens a cast cache for one evaluation."""
    token = _CASTS.set({})
    quantised = _QUANTIZED.set({})
    try:
        yield
    finally:
        _QUANTIZED.reset(quantised)
        _CASTS.reset(token)


def remember_quantized(x: Any, copy: tuple[Any, Any]) -> None:
    """Records ``copy``, the float8 copy and scale of the moved ``x``."""
    cache = _QUANTIZED.get()
    if cache is not None:
        cache[id(x)] = (x, copy)  # x kept, so that its id is not reused


def quantized_copy(x: Any) -> tuple[Any, Any] | None:
    """The float8 copy and scale recorded for ``x`` in this evaluation."""
    cache = _QUANTIZED.get()
    hit = None if cache is None else cache.get(id(x))
    return None if hit is None or hit[0] is not x else hit[1]
