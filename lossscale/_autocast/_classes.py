"""The precision classes autocast gives every value, and their join.

Each value of the traced program gets one class, chosen by the inference
pass (:mod:`._infer`) before anything is bound:

- ``CONST16``: a float32 constant whose every element the 16-bit compute
  dtype holds (a literal ``0.5``, a mask fill of ``-1e4``, a
  ``jnp.float32(2.0)``, a boolean mask converted to float32): it takes its
  partner's dtype.
- ``LOW``: a value in the compute dtype (a matmul's result, what is
  computed from it and such constants).
- ``F32``: a float32 value: a parameter, an input, a statistic, a
  constant the compute dtype cannot hold (``-1e9``, ``finfo.tiny``), or
  anything computed from one of them (PyTorch's type promotion).
- ``KEEP``: a value autocast never touches: integers, booleans, PRNG keys,
  float64, and float dtypes other than float32 and the compute dtype.

The order is the join used where one value must have one class (a loop's
carry, a conditional's outputs): ``CONST16 < LOW < F32 < KEEP``.
"""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

F32_DTYPE = np.dtype(np.float32)


class Cls(enum.IntEnum):
    CONST16 = 0
    LOW = 1
    F32 = 2
    KEEP = 3


def join(a: Cls, b: Cls) -> Cls:
    return a if a >= b else b


class Info(NamedTuple):
    """What the inference pass knows of a value: its class, and, for a
    small constant, its value (``None`` if not known at trace time)."""

    cls: Cls
    value: Any = None


@functools.lru_cache(maxsize=256)
def is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def class_dtype(cls: Cls, compute: np.dtype) -> np.dtype | None:
    """The dtype a class is stored in (``None``: the value's own)."""
    if cls == Cls.LOW:
        return compute
    if cls == Cls.F32:
        return F32_DTYPE
    return None


def fits(value: Any, compute: np.dtype) -> bool:
    """Whether every element of a float32 ``value`` survives the cast to
    ``compute``: within its range and zero or a normal number of it (a
    subnormal keeps too few bits: ``1e-7`` in float16), or an infinity
    or a NaN, which the cast keeps."""
    v = np.asarray(value, np.float32)
    if v.size == 0:
        return True
    info = jnp.finfo(compute)
    a = np.abs(v)
    special = ~np.isfinite(v)
    normal = (a <= float(info.max)) & ((a == 0) | (a >= float(info.tiny)))
    return bool(np.all(special | normal))


def of_dtype(dtype: Any, compute: np.dtype) -> Cls:
    """The class of a value of ``dtype`` about which nothing else is
    known."""
    if not is_float(dtype):
        return Cls.KEEP
    dtype = np.dtype(dtype)
    if dtype == F32_DTYPE:
        return Cls.F32
    if dtype == compute:
        return Cls.LOW
    return Cls.KEEP


def of_value(value: Any, dtype: Any, compute: np.dtype) -> Cls:
    """The class of a value known at trace time."""
    cls = of_dtype(dtype, compute)
    if cls == Cls.F32 and fits(value, compute):
        return Cls.CONST16
    return cls


def of_conversion(source: Any, new: Any, compute: np.dtype) -> Cls | None:
    """The class of ``convert_element_type`` from a non-float ``source``
    to float32 when every value of ``source`` is exact in ``compute``
    (booleans, 8-bit integers: a dropout mask, int8 weights), else
    ``None``: such a value takes its partner's dtype, as a constant the
    compute dtype holds does."""
    if np.dtype(new) != F32_DTYPE or is_float(source):
        return None
    source = np.dtype(source)
    if source == np.bool_ or (
        jnp.issubdtype(source, jnp.integer) and source.itemsize == 1
    ):
        return Cls.CONST16
    return None
