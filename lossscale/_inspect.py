"""Finding the loss scale inside (nested) optimizer states, and metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _checks, _interop, _scales, _transform, _tree
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
        Leaves outside what the configuration allows (a checkpoint saved
        under another configuration, a leaf set by hand) come back clamped
        into its ranges, as ``update`` uses them; see
        :func:`compare_config`.

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
    scales = _interop.unwrap_variables(
        _find_one(opt_state, "get_loss_scale").loss_scale
    )
    # Leaves restored from another configuration (or set by hand) are
    # clamped into this one's ranges, as update clamps them: the scale
    # returned here is the one update unscales by.
    if isinstance(scales, dict):
        return cast(Any, {k: _scales.in_range(v) for k, v in scales.items()})
    return _scales.in_range(scales)


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
    ``on_min_scale="error"`` or ``"count"``, ``"min_scale_skips"`` counts
    the consecutive skipped steps that ran at the minimum scale, and
    ``"stale_scale_skips"`` the consecutive steps skipped because their
    gradients were scaled by another scale than the state's; with
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
    if state.stale_scale_skips is not None:
        out["stale_scale_skips"] = jnp.asarray(
            state.stale_scale_skips, jnp.int32
        )
    scales = state.loss_scale
    grouped = isinstance(scales, dict)
    for label, scale in scales.items() if grouped else [(None, scales)]:
        suffix = "" if label is None else f"/{label}"
        scale = _scales.in_range(scale)
        out["loss_scale" + suffix] = jnp.asarray(scale.loss_scale, jnp.float32)
        extra: Callable[[], Mapping[str, jax.Array]] | None = getattr(
            scale, "metrics", None
        )
        if callable(extra):
            out.update({k + suffix: v for k, v in extra().items()})
    return out


def nonfinite_paths(
    opt_state: Any, tree: Any, *, mask: _tree.MaskOrFn = None
) -> list[str]:
    """The key paths of the gradient leaves that were inf or NaN last step.

    Needs an optimizer built with ``report_nonfinite=True``. Call it on the
    host after a step, e.g. when :func:`metrics` shows a skipped step: it
    fetches one small boolean array from the device.

    Args:
        opt_state: an optimizer state containing exactly one
            :class:`LossScaledState` (see :func:`get_loss_scale`).
        tree: a tree with the gradients' structure, usually the parameters:
            its leaves (and ``None`` nodes, where a gradient is ``None``)
            are matched, in order, with the flags. optax.lookahead's
            ``LookaheadParams`` stand for their fast params.
        mask: ``None``, or the leaves of ``tree`` that the wrapper saw, as
            ``optax.masked`` takes them: a tree of bools with the structure
            of ``tree`` (or a prefix of it), or a callable returning one.
            For one wrapper per group inside ``optax.multi_transform``
            (which hands each group's transformation its leaves alone),
            pass that group's ``opt_state.inner_states[group]`` and
            ``mask=jax.tree.map(lambda label: label == group, labels)``.

    Returns:
        The paths, as ``jax.tree_util.keystr`` writes them, in tree order;
        an empty list after a finite step. Under ``pmap`` (a leading device
        axis) the flags agree across devices, and one device's are read.

    Raises:
        ValueError: if the optimizer was built without
            ``report_nonfinite=True``; if ``tree`` (its leaves that ``mask``
            keeps) has a different number of leaves than the gradients; if
            ``mask`` does not fit ``tree``; or if the flags differ along
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
        >>> scale = lossscale.get_loss_scale(state)  # grads made by hand
        >>> _, state = tx.update(grads, state, params, scaled_by=scale)
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
    tree = _transform.gradients_like(tree)
    paths = [
        jax.tree_util.keystr(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(
            tree, is_leaf=lambda x: x is None
        )
    ]
    if mask is not None:
        keep = _mask_leaves(mask, tree)
        paths = [path for path, k in zip(paths, keep, strict=True) if k]
    if len(paths) != flags.size:
        kept = "" if mask is None else " that mask keeps"
        raise ValueError(
            f"tree has {len(paths)} leaves{kept}, but the gradients had "
            f"{flags.size}: pass a tree with the gradients' structure (the "
            "params, usually). For a wrapper inside optax.multi_transform "
            "(or optax.masked), which sees its group's leaves alone, also "
            "pass mask=jax.tree.map(lambda label: label == group, labels)."
        )
    return [path for path, bad in zip(paths, flags, strict=True) if bad]


def _mask_leaves(mask: _tree.MaskOrFn, tree: Any) -> list[bool]:
    """One bool per leaf (or ``None`` node) of ``tree``, from ``mask``."""
    mask_tree = mask(tree) if callable(mask) else mask
    _tree.check_mask(mask_tree)

    def is_none(x: Any) -> bool:
        return x is None

    try:
        full = jax.tree.map(
            lambda m, sub: jax.tree.map(
                lambda _: bool(m), sub, is_leaf=is_none
            ),
            mask_tree,
            tree,
            is_leaf=is_none,
        )
    except ValueError as err:
        raise ValueError(
            "mask must have the structure of tree (or a prefix of it), got "
            f"mask structure {jax.tree.structure(mask_tree)} for tree with "
            f"structure {jax.tree.structure(tree, is_leaf=is_none)}."
        ) from err
    return list(jax.tree.leaves(full))


_CONFIG_FIELDS = {
    "DynamicLossScale": (
        "growth_interval",
        "growth_factor",
        "backoff_factor",
        "min_loss_scale",
        "max_loss_scale",
        "hysteresis",
    ),
    "StaticLossScale": (),
    "NoOpLossScale": (),
}


def _groups_of(state: LossScaledState) -> list[tuple[str, Any]]:
    scales = state.loss_scale
    if isinstance(scales, dict):
        return [(f"loss_scale[{k!r}]", v) for k, v in scales.items()]
    return [("loss_scale", scales)]


def _config_of(scale: Any) -> dict[str, Any]:
    kind = type(scale).__name__
    fields = _CONFIG_FIELDS.get(kind)
    if fields is None:  # a policy of your own: its static fields, if any
        static = getattr(type(scale), "_static_fields", ())
        fields = tuple(static)
    return {"type": kind, **{f: getattr(scale, f) for f in fields}}


def loss_scale_config(opt_state: Any) -> dict[str, Any]:
    """The static configuration of the loss scale(s) in ``opt_state``.

    A checkpoint holds the leaves (the scale and the counters), not this:
    restoring takes it from the target. Save this dict next to the
    checkpoint (it is JSON-ready: ``json.dumps`` it into orbax's metadata,
    say), and give it to :func:`compare_config` after restoring to see
    every field that changed.

    Args:
        opt_state: an optimizer state containing exactly one
            :class:`LossScaledState` (see :func:`get_loss_scale`).

    Returns:
        ``{"type": "DynamicLossScale", "growth_interval": ..., ...}`` (the
        class name and every static field; for :class:`StaticLossScale` and
        :class:`NoOpLossScale` the type alone); for
        :func:`loss_scaled_by_group`, a dict from ``"loss_scale[<label
        repr>]"`` to such a dict.

    Examples:
        >>> import jax.numpy as jnp, optax
        >>> import lossscale
        >>> tx = lossscale.loss_scaled(
        ...     optax.sgd(0.1), lossscale.DynamicLossScale(hysteresis=2))
        >>> config = lossscale.loss_scale_config(tx.init(jnp.zeros(2)))
        >>> config["type"], config["hysteresis"]
        ('DynamicLossScale', 2)
    """
    state = _interop.unwrap_variables(_find_one(opt_state, "loss_scale_config"))
    groups = _groups_of(state)
    if not isinstance(state.loss_scale, dict):
        return _config_of(groups[0][1])
    return {where: _config_of(scale) for where, scale in groups}


def _outside(
    where: str, name: str, value: Any, low: float, high: float, how: str
) -> list[str]:
    values = np.asarray(value, np.float64).reshape(-1)
    bad = values[~((values >= low) & (values <= high))]  # NaN is outside
    if not bad.size:
        return []
    return [
        f"{where}.{name}={_number(bad[0])} is outside [{_number(low)}, "
        f"{_number(high)}], the range this configuration allows ({how})."
    ]


def _number(x: float) -> str:
    x = float(x)
    return str(int(x)) if x.is_integer() and abs(x) < 2**53 else repr(x)


def _leaf_mismatches(where: str, scale: Any) -> list[str]:
    kind = type(scale).__name__
    if kind == "StaticLossScale":
        return _outside(
            where,
            "loss_scale",
            scale.loss_scale,
            _checks.MIN_SCALE,
            _checks.MAX_SCALE,
            "clamped into it on use, NaN to 1",
        )
    if kind != "DynamicLossScale":
        return []
    low = float(np.float32(scale.min_loss_scale))
    high = float(np.float32(scale.max_loss_scale))
    return [
        *_outside(
            where,
            "loss_scale",
            scale.loss_scale,
            low,
            high,
            "[min_loss_scale, max_loss_scale]; clamped into it on use, NaN "
            "to the minimum",
        ),
        *_outside(
            where,
            "growth_tracker",
            scale.growth_tracker,
            0,
            scale.growth_interval - 1,
            "[0, growth_interval - 1]; clamped into it on use",
        ),
        *_outside(
            where,
            "hysteresis_tracker",
            scale.hysteresis_tracker,
            0,
            scale.hysteresis,
            "[0, hysteresis]; clamped into it on use",
        ),
    ]


def compare_config(
    opt_state: Any, saved_config: Mapping[str, Any] | None = None
) -> list[str]:
    """How a restored state disagrees with the target's configuration.

    A checkpoint (orbax, ``flax.serialization``) holds the leaves of a loss
    scale, not its static configuration, which comes from the target the
    state is restored into. A state saved under another configuration is
    safe to use (its leaves are clamped into the target's ranges on use;
    see :class:`DynamicLossScale`), but it is a mix. This lists:

    - always, every leaf the target's configuration could not have
      produced: a scale outside ``[min_loss_scale, max_loss_scale]`` (or
      NaN), a ``growth_tracker`` outside ``[0, growth_interval - 1]``, a
      ``hysteresis_tracker`` outside ``[0, hysteresis]`` (a
      :class:`StaticLossScale` outside ``[2**-126, 2**126]``);
    - with ``saved_config`` (what :func:`loss_scale_config` returned when
      the checkpoint was saved), every static field that differs.

    Without ``saved_config`` a change the leaves do not show goes unseen:
    another factor, or a larger ``growth_interval``, ``hysteresis`` or
    range whose leaves happen to fit the target's. Call it on the host
    after restoring: it fetches the scalar leaves.

    Args:
        opt_state: an optimizer state containing exactly one
            :class:`LossScaledState` (see :func:`get_loss_scale`), as
            restored.
        saved_config: ``None``, or :func:`loss_scale_config` of the state
            that was saved.

    Returns:
        One sentence per disagreement; empty if none was found.

    Raises:
        TypeError: if ``saved_config`` is not a dict.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import lossscale
        >>> params = jnp.zeros(2)
        >>> old = lossscale.loss_scaled(
        ...     optax.sgd(0.1), lossscale.DynamicLossScale(hysteresis=3))
        >>> saved = old.init(params)
        >>> new = lossscale.loss_scaled(
        ...     optax.sgd(0.1), lossscale.DynamicLossScale())
        >>> restored = new.init(params)._replace(
        ...     loss_scale=jax.tree.unflatten(
        ...         jax.tree.structure(new.init(params).loss_scale),
        ...         jax.tree.leaves(saved.loss_scale)))
        >>> found = lossscale.compare_config(
        ...     restored, lossscale.loss_scale_config(saved))
        >>> found[0].split(", the range")[0]
        'loss_scale.hysteresis_tracker=3 is outside [0, 1]'
        >>> found[1]
        'loss_scale.hysteresis: saved 3, target 1.'
    """
    if saved_config is not None and not isinstance(saved_config, Mapping):
        raise TypeError(
            "saved_config must be None or the dict that "
            "lossscale.loss_scale_config returned, got "
            f"saved_config={saved_config!r}."
        )
    state = _interop.unwrap_variables(_find_one(opt_state, "compare_config"))
    out = []
    for where, scale in _groups_of(state):
        out.extend(_leaf_mismatches(where, scale))
    if saved_config is None:
        return out
    target = loss_scale_config(state)
    pairs = (
        [("loss_scale", saved_config, target)]
        if "type" in target
        else [
            (where, saved_config.get(where), target.get(where))
            for where in sorted({*saved_config, *target})
        ]
    )
    for where, saved, now in pairs:
        if saved is None or now is None:
            side = "the saved configuration" if saved is None else "the target"
            out.append(f"{where}: absent from {side}.")
            continue
        for key in sorted({*saved, *now}, key=lambda k: (k != "type", k)):
            if saved.get(key) != now.get(key):
                out.append(
                    f"{where}.{key}: saved {saved.get(key)!r}, target "
                    f"{now.get(key)!r}."
                )
    return out
