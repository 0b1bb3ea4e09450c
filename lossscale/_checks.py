"""Eager validation of static configuration.

Every public constructor and factory funnels its Python arguments through
these helpers, so that a bad value fails at construction time with a
``TypeError``/``ValueError`` that names the argument and the value it got.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _compat

_F32_MAX = float(np.finfo(np.float32).max)
# A loss scale is usable only if it and its reciprocal are normal float32
# numbers: a subnormal or infinite reciprocal unscales to 0 or inf.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
SCALE_RANGE = "[2**-126, 2**126]"


def is_concrete(value: Any) -> bool:
    """Whether ``value`` can be inspected in Python (it is not a tracer)."""
    return not _compat.is_tracer(value)


def scalar_float(name: str, value: Any) -> Any:
    """Checks that ``value`` is a real scalar and returns it as float32.

    Python numbers and concrete arrays come back as a 0-d ``np.float32``
    array; tracers (a scale built inside a traced function) come back as
    float32 tracers, their value unchecked.
    """
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be a real number, got {name}={value!r}.")
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        if not isinstance(value, numbers.Real):
            raise TypeError(
                f"{name} must be a real number, got {name}={value!r} "
                f"of type {type(value).__name__}."
            )
    elif not (
        jnp.issubdtype(dtype, jnp.floating)
        or jnp.issubdtype(dtype, jnp.integer)
    ):
        raise TypeError(
            f"{name} must have a real floating or integer dtype, got "
            f"{name} with dtype {dtype}."
        )
    # A real number or an array of a real dtype from here on. The isinstance
    # above narrowed it to numbers.Real, which numpy's stubs do not count as
    # array-like (np.ndim and np.shape take any object).
    value = cast(Any, value)
    if np.ndim(value) != 0:
        raise ValueError(
            f"{name} must be a scalar, got {name} with shape {np.shape(value)}."
        )
    if not is_concrete(value):
        return value.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        as_f32 = np.asarray(value, dtype=np.float32)
    return as_f32


def _in_scale_range(x: float) -> bool:
    return bool(np.isfinite(x)) and MIN_SCALE <= x <= MAX_SCALE


def scale_value(name: str, value: Any) -> Any:
    """A loss scale: a float32 scalar in :data:`SCALE_RANGE`.

    Concrete values are checked; tracers (a scale built inside a traced
    function) are returned unchecked, for the caller to clamp.
    """
    as_f32 = scalar_float(name, value)
    if is_concrete(as_f32) and not _in_scale_range(float(as_f32)):
        raise ValueError(
            f"{name} must be in {SCALE_RANGE} in float32, so that it and its "
            f"reciprocal are normal float32 numbers, got {name}={value!r}."
        )
    return as_f32


def static_float(name: str, value: Any) -> float:
    """A static real number, as the Python float it is (never rounded)."""
    if not is_concrete(value):
        raise TypeError(
            f"{name} is static configuration and must be a Python number, "
            f"got a traced value {name}={value!r}."
        )
    scalar_float(name, value)  # type and shape
    return float(value)


def open_interval(name: str, value: Any, *, low: float, high: float) -> float:
    """A static float in ``(low, high)``, also once rounded to float32.

    The value is kept as given (as PyTorch keeps its factors); the check
    on its float32 rounding refuses, e.g., a backoff factor so close to 1
    that the float32 arithmetic would never back off.
    """
    result = static_float(name, value)
    with np.errstate(over="ignore"):
        rounded = float(np.float32(result))
    if not (
        np.isfinite(result) and low < result < high and low < rounded < high
    ):
        raise ValueError(
            f"{name} must be in the open interval ({low}, {high}), also "
            f"once rounded to float32, got {name}={value!r}."
        )
    return result


def scale_bound(name: str, value: Any) -> float:
    """A static scale bound in :data:`SCALE_RANGE`, kept as given."""
    result = static_float(name, value)
    with np.errstate(over="ignore"):
        rounded = float(np.float32(result))
    if not (_in_scale_range(result) and _in_scale_range(rounded)):
        raise ValueError(
            f"{name} must be in {SCALE_RANGE}, so that every scale it allows "
            "and its reciprocal are normal float32 numbers, got "
            f"{name}={value!r}."
        )
    return result


def positive_int(name: str, value: Any) -> int:
    """A static int in ``[1, 2**31 - 1]`` (it is compared with int32 state).

    Any concrete integer scalar is accepted: a Python int, a numpy integer or
    a 0-d integer array of numpy or JAX (as :func:`static_float` accepts any
    concrete real scalar). Booleans, floats (even integral ones) and traced
    values are refused.
    """
    dtype = getattr(value, "dtype", None)
    integral = isinstance(value, numbers.Integral) or (
        dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    )
    if isinstance(value, bool | np.bool_) or not integral:
        raise TypeError(
            f"{name} must be a positive integer, got {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    value = cast(Any, value)  # an integer or an integer array (see above)
    if not is_concrete(value):
        raise TypeError(
            f"{name} is static configuration and must be a concrete integer, "
            f"got a traced value {name}={value!r}."
        )
    if np.ndim(value) != 0:
        raise ValueError(
            f"{name} must be a scalar, got {name} with shape {np.shape(value)}."
        )
    if not 1 <= int(value) <= np.iinfo(np.int32).max:
        raise ValueError(
            f"{name} must be a positive integer that fits in int32, got "
            f"{name}={value!r}."
        )
    return int(value)


def counter(name: str, value: Any, high: int) -> Any:
    """An int32 state counter in ``[0, high]``, as a 0-d ``np.int32``.

    Concrete values are checked; tracers come back as int32 tracers, their
    value unchecked, for the caller to clamp.
    """
    dtype = getattr(value, "dtype", None)
    integral = isinstance(value, numbers.Integral) or (
        dtype is not None and jnp.issubdtype(dtype, jnp.integer)
    )
    if isinstance(value, bool | np.bool_) or not integral:
        raise TypeError(
            f"{name} must be an integer, got {name}={value!r} of type "
            f"{type(value).__name__}."
        )
    value = cast(Any, value)  # an integer or an integer array (see above)
    if np.ndim(value) != 0:
        raise ValueError(
            f"{name} must be a scalar, got {name} with shape {np.shape(value)}."
        )
    if not is_concrete(value):
        return value.astype(np.int32)
    if not 0 <= int(value) <= high:
        raise ValueError(
            f"{name} must be in [0, {high}] for this configuration, got "
            f"{name}={value!r}."
        )
    return np.asarray(value, dtype=np.int32)


def axis_name(value: Any) -> Hashable | tuple[Hashable, ...] | None:
    """``None``, one mapped-axis name, or a tuple of distinct names."""
    if value is None:
        return None
    if isinstance(value, tuple):
        if not value:
            raise ValueError(
                "axis_name must be a name or a non-empty tuple of names, "
                "got axis_name=()."
            )
        for item in value:
            if not _is_axis_name(item):
                raise TypeError(
                    "axis_name must be a name or a tuple of names, got "
                    f"axis_name={value!r} (bad element {item!r}{_INT_HINT})."
                )
        if len(set(value)) != len(value):
            raise ValueError(
                f"axis_name must not repeat a name, got axis_name={value!r}."
            )
        return value
    if not _is_axis_name(value):
        raise TypeError(
            "axis_name must be a name or a tuple of names, got "
            f"axis_name={value!r} of type {type(value).__name__}"
            f"{_INT_HINT}."
        )
    return value


_INT_HINT = (
    "; names of mapped axes are strings (or other hashables), never ints, "
    "which JAX's collectives read as positional axes"
)


def _is_axis_name(item: Any) -> bool:
    if isinstance(item, str):  # numpy's str_ included
        return True
    return not (
        item is None
        or isinstance(item, tuple | list | set | dict | numbers.Number)
        or not isinstance(item, Hashable)
        or (hasattr(item, "dtype") and hasattr(item, "shape"))
    )


def scalar_bool(name: str, value: Any) -> jax.Array:
    """A boolean scalar (Python bool or bool array of shape ``()``)."""
    dtype = getattr(value, "dtype", None)
    if dtype is None and not isinstance(value, bool | np.bool_):
        raise TypeError(
            f"{name} must be a boolean scalar, got {name}={value!r} "
            f"of type {type(value).__name__}."
        )
    if dtype is not None and dtype != np.bool_:
        raise TypeError(
            f"{name} must be a boolean scalar, got {name} with dtype {dtype}."
        )
    if np.ndim(value) != 0:
        raise ValueError(
            f"{name} must be a boolean scalar, got {name} with shape "
            f"{np.shape(value)}. Reduce it first, e.g. with "
            "lossscale.all_finite(grads)."
        )
    return jnp.asarray(value, dtype=jnp.bool_)


def f32_max() -> float:
    return _F32_MAX
