"""Finding the loss scale inside (nested) optimizer states, and metrics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from lossscale import _interop
from lossscale._scales import LossScale
from lossscale._transform import LossScaledState


def _is_state(x: Any) -> bool:
    return isinstance(x, LossScaledState)


def _find_states(
    opt_state: Any, prefix: str = ""
) -> list[tuple[str, LossScaledState]]:
    found = []
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=_is_state
    )
    for path, leaf in leaves:
        if _is_state(leaf):
            where = prefix + jax.tree_util.keystr(path)
            found.append((where, leaf))
            found.extend(_find_states(leaf.inner_state, where + ".inner_state"))
    return found


def _find_one(opt_state: Any, caller: str) -> LossScaledState:
    found = _find_states(opt_state)
    if not found:
        raise ValueError(
            f"{caller} found no LossScaledState in opt_state (of type "
            f"{type(opt_state).__name__}); was the optimizer built with "
            "lossscale.loss_scaled(...)?"
        )
    if len(found) > 1:
        paths = ", ".join(repr("opt_state" + path) for path, _ in found)
        raise ValueError(
            f"{caller} found {len(found)} LossScaledStates in opt_state, at "
            f"{paths}; pass the one you mean."
        )
    return found[0][1]


def get_loss_scale(opt_state: Any) -> LossScale:
    """Returns the loss-scale state held inside an optimizer state.

    Searches any nesting of optax states (``optax.chain``,
    ``optax.MultiSteps``, ``optax.inject_hyperparams``,
    ``optax.multi_transform``, a flax optimizer's ``opt_state``) for the
    single :class:`LossScaledState` and returns its ``loss_scale``: the scale
    to use for the next forward pass. Works inside ``jit``. Leaves that flax
    NNX wraps in ``nnx.Variable`` (``nnx.Optimizer.opt_state``) come back as
    plain arrays.

    Args:
        opt_state: an optimizer state containing exactly one
            :class:`LossScaledState`.

    Returns:
        The loss-scale state, e.g. a :class:`DynamicLossScale`; for
        :func:`loss_scaled_by_group`, a dict from group label to state.

    Raises:
        ValueError: if there is no :class:`LossScaledState`, or more than one
            (the message lists where; pass the sub-state you mean).

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import lossscale
        >>> tx = optax.MultiSteps(
        ...     lossscale.loss_scaled(optax.adam(1e-3),
        ...                           lossscale.StaticLossScale(128.0)),
        ...     every_k_schedule=2)
        >>> state = tx.init({"w": jnp.zeros(3)})
        >>> lossscale.get_loss_scale(state).loss_scale
        array(128., dtype=float32)
    """
    return _interop.unwrap_variables(
        _find_one(opt_state, "get_loss_scale").loss_scale
    )


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Loss-scaling metrics, as a flat dict of scalar arrays, ready to log.

    Always present:

    - ``"loss_scale"``: the scale for the next step (float32);
    - ``"grads_finite"``: whether the last step was applied (bool);
    - ``"skipped_steps"``: skipped steps since ``init`` (int32);
    - ``"consecutive_skips"``: skipped steps since the last applied one;
    - ``"steps"``: ``update`` calls since ``init``, applied or skipped
      (``steps - skipped_steps`` updates were applied);
    - ``"last_skip_step"``: the index of the last skipped step, -1 if none.

    A :class:`DynamicLossScale` adds ``"growth_tracker"``,
    ``"hysteresis_tracker"`` and ``"at_min_scale"``; any loss-scale policy
    with a ``metrics()`` method adds its own keys. With
    :func:`loss_scaled_by_group` the per-scale keys carry the group label:
    ``"loss_scale/<label>"``, ``"at_min_scale/<label>"``, ... No value
    leaves the device: call it inside ``jit`` and fetch when you log.

    Args:
        opt_state: an optimizer state containing exactly one
            :class:`LossScaledState` (see :func:`get_loss_scale`).

    Returns:
        A dict from metric name to scalar array.
    """
    state = _interop.unwrap_variables(_find_one(opt_state, "metrics"))
    out = {
        "grads_finite": jnp.asarray(state.grads_finite, jnp.bool_),
        "skipped_steps": jnp.asarray(state.skipped_steps, jnp.int32),
        "consecutive_skips": jnp.asarray(state.consecutive_skips, jnp.int32),
        "steps": jnp.asarray(state.steps, jnp.int32),
        "last_skip_step": jnp.asarray(state.last_skip_step, jnp.int32),
    }
    scales = state.loss_scale
    grouped = isinstance(scales, dict)
    for label, scale in scales.items() if grouped else [(None, scales)]:
        suffix = "" if label is None else f"/{label}"
        out["loss_scale" + suffix] = jnp.asarray(scale.loss_scale, jnp.float32)
        extra = getattr(scale, "metrics", None)
        if callable(extra):
            out.update({k + suffix: v for k, v in extra().items()})
    return out
