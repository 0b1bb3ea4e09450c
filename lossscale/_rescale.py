"""A gradient-boundary op: identity forward, scaled cotangent backward."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _checks, _tree


@jax.custom_vjp
def _rescale(tree: Any, factor: jax.Array) -> Any:
    return tree


def _rescale_fwd(tree: Any, factor: jax.Array) -> tuple[Any, jax.Array]:
    return tree, factor


def _rescale_bwd(factor: jax.Array, cotangent: Any) -> tuple[Any, jax.Array]:
    scaled = jax.tree.map(
        lambda g: _tree.multiply_keep_dtype(g, factor), cotangent
    )
    return scaled, jnp.zeros_like(factor)


_rescale.defvjp(_rescale_fwd, _rescale_bwd)


def rescale_gradient(tree: Any, factor: jax.typing.ArrayLike) -> Any:
    """Identity on the forward pass; multiplies the cotangent by ``factor``.

    Placed where one parameter group feeds another, it gives each group its
    own loss scale (see :func:`loss_scaled_by_group`): with the loss scaled
    by the downstream group's scale ``S_down``, rescaling the boundary
    activations by ``S_up / S_down`` makes every gradient upstream of it come
    out scaled by ``S_up`` instead. The product is computed in float32 (or
    wider) and cast back to each cotangent's dtype, so float16 cotangents
    overflow or underflow exactly as they would under the scale ``S_up``,
    and the finiteness check sees it.

    Args:
        tree: an array or pytree of arrays (e.g. activations).
        factor: a finite scalar > 0, e.g. ``up.loss_scale /
            down.loss_scale``. No gradient flows into it.

    Returns:
        ``tree`` itself.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import lossscale
        >>> jax.grad(lambda x: lossscale.rescale_gradient(x, 8.0) * 3.0)(1.0)
        Array(24., dtype=float32)
    """
    value = _checks.scalar_float("factor", factor)
    if _checks.is_concrete(value) and not (
        np.isfinite(value) and float(value) > 0
    ):
        raise ValueError(
            "factor must be finite and > 0 (a ratio of two loss scales), got "
            f"factor={factor!r}."
        )
    return _rescale(tree, jnp.asarray(value, jnp.float32))
