"""Float8 recipes as data: :class:`Recipe` rows of :class:`Cast` cells, and
the named rows (:data:`RECIPES`).

A recipe says, for each operand of each of a linear layer's three GEMMs,
its float8 dtype (or the 16-bit compute dtype) and whether it is scaled
per tensor or per row: torchao's ``CastConfig`` fields. The kernel
(:mod:`._fp8`) reads only the row, and :mod:`._report` describes it, so a
new recipe is one row here.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = ["EPS", "MAX_SCALE", "RECIPES", "Cast", "Recipe"]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32 = np.dtype(np.float32)
_MAX = {E4M3: 448.0, E5M2: 57344.0}

# The floor under an amax: float32's smallest normal, so that every
# finite non-zero amax above it is scaled to float8's range. torchao's
# floor, 1e-12 (torchao/float8/float8_utils.py), scales a gradient below
# it (a loss scaled by 2**-60) by less than it needs, and breaks the
# absorption of a power-of-two loss scale. Below 448 / float32's max
# (2**-119 for e4m3, 2**-111 for e5m2) the scale overflows: it is capped
# at float32's largest finite value (:data:`MAX_SCALE`), which still maps
# the amax to at least 4 (e4m3) or 2**-1 (e5m2), normal numbers of the
# format, and keeps a tensor of zeros zero (0 * inf would be NaN).
EPS = float(np.finfo(np.float32).tiny)
MAX_SCALE = float(np.finfo(np.float32).max)


class Cast(NamedTuple):
    """How one operand of one of a linear layer's three GEMMs is cast:
    torchao's ``CastConfig``.

    Attributes:
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``, or ``None``: the 16-bit
        compute dtype, unscaled (torchao's ``ScalingType.DISABLED``).
      rowwise: one scale per row, along the axes this GEMM contracts
        (torchao's ``AXISWISE``), else one per tensor.
    """

    dtype: np.dtype | None
    rowwise: bool = False


class Recipe(NamedTuple):
    """A float8 recipe, as data: how each operand of each of a linear
    layer's GEMMs is cast, in the shape of torchao's ``Float8LinearConfig``
    (its ``cast_config_*`` fields). With ``y = x @ w``:

    - ``y = input @ weight`` (the forward GEMM);
    - ``dx = grad_output @ weight_for_grad_input.T``;
    - ``dw = input_for_grad_weight.T @ grad_output_for_grad_weight``.

    Each GEMM accumulates in float32. A GEMM's two operands are both
    float8 or both in the compute dtype. An operand whose backward cast is
    its forward one, per tensor, is kept quantised for the backward pass
    (one byte an element); otherwise the operand is kept as it came and
    cast again. ``power_of_two_scales`` is the recipe's default for
    :attr:`Float8.power_of_two_scales`.
    """

    input: Cast
    weight: Cast
    grad_output: Cast
    weight_for_grad_input: Cast
    input_for_grad_weight: Cast
    grad_output_for_grad_weight: Cast
    power_of_two_scales: bool = False

    @property
    def weight_cast_once(self) -> bool:
        """Whether one float8 copy of the weight serves both GEMMs that
        read it (the forward and the input gradient's): the same cast,
        per tensor. Then a weight gathered for its matmuls may be
        quantised before it is gathered, and gathered in float8."""
        return (
            self.weight.dtype is not None
            and not self.weight.rowwise
            and self.weight == self.weight_for_grad_input
        )

    @property
    def symmetric(self) -> bool:
        """Whether swapping the input and the weight gives the same
        numbers (then which operand is the weight does not matter)."""
        return (
            self.input == self.weight
            and self.weight_for_grad_input == self.input_for_grad_weight
            and self.grad_output == self.grad_output_for_grad_weight
        )


_E4, _E4_ROWS = Cast(E4M3), Cast(E4M3, rowwise=True)
_HIGH = Cast(None)

RECIPES: Mapping[str, Recipe] = types.MappingProxyType(
    {
        # torchao/float8/config.py, Float8LinearConfig.from_recipe_name
        # (its default config for "tensorwise": e5m2 output gradients,
        # TransformerEngine's HYBRID format).
        "tensorwise": Recipe(_E4, _E4, Cast(E5M2), _E4, _E4, Cast(E5M2), False),
        "rowwise": Recipe(
            _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4_ROWS, True
        ),
        "rowwise_with_gw_hp": Recipe(
            _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4, _HIGH, _HIGH, True
        ),
    }
)
"""The named recipes, one row each (torchao's names and casts)."""


def _float8_dtype(dtype: Any) -> np.dtype | bool | None:
    """A float8 dtype as a NumPy dtype, ``None`` as it is, else False."""
    if dtype is None:
        return None
    try:
        result = np.dtype(dtype)
    except TypeError:
        return False
    return result if result in (E4M3, E5M2) else False


def _normalised(row: Recipe) -> Recipe:
    """``row`` with each cast's dtype a NumPy dtype (``jnp.float8_e4m3fn``
    is a scalar type), checked: float8 or None, and each GEMM's operands
    both float8 or both None."""
    casts: list[Cast] = []
    for name, one in zip(Recipe._fields, row[:6], strict=False):
        dtype = _float8_dtype(getattr(one, "dtype", ()))
        if not isinstance(one, Cast) or isinstance(dtype, bool):
            raise TypeError(
                f"Float8Recipe.{name} must be a Float8Cast of "
                f"float8_e4m3fn, float8_e5m2 or None, got {name}={one!r}."
            )
        casts.append(Cast(dtype, bool(one.rowwise)))
    row = Recipe(*casts[:6], power_of_two_scales=bool(row.power_of_two_scales))
    gemms = {
        "the forward GEMM": (row.input, row.weight),
        "the input gradient's GEMM": (
            row.grad_output,
            row.weight_for_grad_input,
        ),
        "the weight gradient's GEMM": (
            row.input_for_grad_weight,
            row.grad_output_for_grad_weight,
        ),
    }
    for gemm, (a, b) in gemms.items():
        if (a.dtype is None) != (b.dtype is None):
            raise ValueError(
                f"Float8Recipe: {gemm} has one float8 operand and one in "
                f"the compute dtype ({a!r}, {b!r}): both are float8, or "
                "both None."
            )
    if row.input.dtype is None:
        raise ValueError(
            "Float8Recipe: the forward GEMM's operands must be float8, got "
            f"input={row.input!r}."
        )
    return row
