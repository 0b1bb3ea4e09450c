"""Finding the loss scale inside (nested) optimizer states, and metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

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

    Every built-in loss scale adds ``"at_min_scale"`` (always true for a
    :class:`StaticLossScale` or :class:`NoOpLossScale`, which cannot go
    lower); a :class:`DynamicLossScale` adds ``"growth_tracker"`` and
    ``"hysteresis_tracker"``; any loss-scale policy with a ``metrics()``
    method adds its own keys. With ``report_nonfinite=True``,
    ``"nonfinite_leaves"`` counts the gradient leaves that held an inf or
    NaN in the last step (int32; :func:`nonfinite_paths` names them); with
    ``on_min_scale="error"``, ``"min_scale_skips"`` counts the consecutive
    skipped steps that ran at the minimum scale; with
    ``report_grad_norm=True``, ``"grad_norm"`` is the global L2 norm of the
    last step's unscaled gradients (float32). With
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
    if state.nonfinite is not None:
        # The last axis holds the leaves; any before it are pmap's or vmap's.
        out["nonfinite_leaves"] = jnp.sum(
            state.nonfinite, axis=-1, dtype=jnp.int32
        )
    if state.min_scale_skips is not None:
        out["min_scale_skips"] = jnp.asarray(state.min_scale_skips, jnp.int32)
    if state.grad_norm is not None:
        out["grad_norm"] = jnp.asarray(state.grad_norm, jnp.float32)
    scales = state.loss_scale
    grouped = isinstance(scales, dict)
    for label, scale in scales.items() if grouped else [(None, scales)]:
        suffix = "" if label is None else f"/{label}"
        out["loss_scale" + suffix] = jnp.asarray(scale.loss_scale, jnp.float32)
        extra: Callable[[], Mapping[str, jax.Array]] | None = getattr(
            scale, "metrics", None
        )
        if callable(extra):
            out.update({k + suffix: v for k, v in extra().items()})
    return out


def nonfinite_paths(opt_state: Any, tree: Any) -> list[str]:
    """The key paths of the gradient leaves that were inf or NaN last step.

    Needs an optimizer built with ``report_nonfinite=True``. Call it on the
    host after a step, e.g. when :func:`metrics` shows a skipped step: it
    fetches one small boolean array from the device.

    Args:
        opt_state: an optimizer state containing exactly one
            :class:`LossScaledState` (see :func:`get_loss_scale`).
        tree: a tree with the gradients' structure, usually the parameters:
            its leaves (and ``None`` nodes, where a gradient is ``None``)
            are matched, in order, with the flags.

    Returns:
        The paths, as ``jax.tree_util.keystr`` writes them, in tree order;
        an empty list after a finite step. Under ``pmap`` (a leading device
        axis) the flags agree across devices, and one device's are read.

    Raises:
        ValueError: if the optimizer was built without
            ``report_nonfinite=True``; if ``tree`` has a different number
            of leaves than the gradients; or if the flags differ along
            leading axes (a ``vmap``-ped ensemble: pass one member's state).

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import lossscale
        >>> tx = lossscale.loss_scaled(
        ...     optax.sgd(0.1), lossscale.StaticLossScale(1.0),
        ...     report_nonfinite=True)
        >>> params = {"dense": {"w": jnp.ones(2), "b": jnp.ones(2)}}
        >>> state = tx.init(params)
        >>> grads = {"dense": {"w": jnp.ones(2), "b": jnp.array([1, jnp.inf])}}
        >>> _, state = tx.update(grads, state, params)
        >>> lossscale.nonfinite_paths(state, params)
        ["['dense']['b']"]
    """
    state = _interop.unwrap_variables(_find_one(opt_state, "nonfinite_paths"))
    if state.nonfinite is None:
        raise ValueError(
            "nonfinite_paths needs an optimizer built with "
            "report_nonfinite=True (loss_scaled(..., report_nonfinite=True)); "
            "this one does not record which leaves were non-finite."
        )
    rows = np.asarray(state.nonfinite)
    rows = rows.reshape(-1, rows.shape[-1])
    if not (rows == rows[:1]).all():
        raise ValueError(
            "the non-finite flags differ along the state's leading axes (a "
            "vmap-ped ensemble, whose members skip alone): pass one member's "
            "state, e.g. jax.tree.map(lambda x: x[i], opt_state)."
        )
    flags = rows[0]
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: x is None
        )
    ]
    if len(paths) != flags.size:
        raise ValueError(
            f"tree has {len(paths)} leaves, but the gradients had "
            f"{flags.size}: pass a tree with the gradients' structure (the "
            "params, usually)."
        )
    return [path for path, bad in zip(paths, flags, strict=True) if bad]
