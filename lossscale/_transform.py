"""The optax wrapper: unscale, check, update or skip, adjust."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lossscale import _checks, _skip, _tree
from lossscale._scales import LossScale

SkipImpl = Literal["auto", "select", "cond"]


class LossScaledState(NamedTuple):
    """State of :func:`loss_scaled`.

    Attributes:
        loss_scale: the loss-scale state (e.g. a :class:`DynamicLossScale`)
            to use for the *next* step's ``scale``/``unscale``.
        inner_state: the wrapped optimizer's state. It is left exactly as it
            was on a skipped step.
        grads_finite: whether the last step's gradients were finite (and the
            step applied). ``True`` after ``init``. ``shape=(), dtype=bool``.
        skipped_steps: the number of skipped steps since ``init``, saturating
            at the int32 maximum. ``shape=(), dtype=int32``.
        consecutive_skips: the number of skipped steps since the last applied
            one. ``shape=(), dtype=int32``.
        steps: the number of ``update`` calls since ``init``, applied or
            skipped (saturating). ``steps - skipped_steps`` is the number of
            applied updates. ``shape=(), dtype=int32``.
        last_skip_step: the 0-based index (in ``steps``) of the last skipped
            step, or -1 if none was. ``shape=(), dtype=int32``.

    With :func:`loss_scaled_by_group`, ``loss_scale`` is a dict from group
    label to that group's loss-scale state.
    """

    loss_scale: LossScale | dict[Any, LossScale]
    inner_state: optax.OptState
    grads_finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    steps: jax.Array
    last_skip_step: jax.Array


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
    if not (
        callable(getattr(inner, "init", None))
        and callable(getattr(inner, "update", None))
    ):
        raise TypeError(
            "inner must be an optax.GradientTransformation (with init and "
            f"update), got inner={inner!r} of type {type(inner).__name__}."
        )
    if not isinstance(inner, optax.GradientTransformation):
        inner = optax.GradientTransformation(inner.init, inner.update)
    return optax.with_extra_args_support(inner)


def _check_loss_scale(loss_scale: Any, name: str = "loss_scale") -> LossScale:
    if isinstance(loss_scale, type):
        raise TypeError(
            f"{name} must be a loss-scale instance, got the class "
            f"{loss_scale.__name__}; did you mean {loss_scale.__name__}()?"
        )
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"{name} must implement the lossscale.LossScale protocol "
            "(loss_scale, scale, unscale, adjust), e.g. "
            f"lossscale.DynamicLossScale(), got {name}={loss_scale!r} of "
            f"type {type(loss_scale).__name__}."
        )
    return loss_scale


def _resolve_skip_impl(skip_impl: SkipImpl) -> Literal["select", "cond"]:
    # "auto" is the branch-free select on every backend: no host round-trip
    # for the predicate (a conditional needs one on GPU), and, written as in
    # _skip.select_update, no copy of the state and no extra buffer. The
    # conditional materialises the updates (they leave it as a buffer instead
    # of fusing into optax.apply_updates); it stays for measurements and
    # as the fallback when _skip cannot evaluate this JAX's jaxprs.
    return "select" if skip_impl == "auto" else skip_impl


def _zeros_like_updates(grads: Any, out: Any) -> Any:
    """Zeros shaped like the inner updates ``out``, built from ``grads``.

    Zeros made with ``zeros_like(grad)`` inherit the gradient's varying
    mapped axes under ``shard_map``, which fresh ``jnp.zeros`` would not, so
    both branches of the conditional have the same type. Returns ``None``
    when the updates do not mirror the gradients leaf for leaf.
    """
    if jax.tree.structure(grads) != jax.tree.structure(out):
        return None
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(out), strict=True)
    if any(jnp.shape(g) != o.shape for g, o in pairs):
        return None
    return jax.tree.map(
        lambda g, o: jnp.zeros_like(g, dtype=o.dtype), grads, out
    )


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: Any = None,
    mask: Any = None,
    on_min_scale: Literal["ignore", "error"] = "ignore",
    min_scale_patience: int = 10,
    _skip_impl: SkipImpl = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer so that it takes scaled gradients.

    Each ``update(scaled_grads, state, params=None, **extra_args)``:

    1. unscales the gradients with the current scale (in float32; each leaf
       keeps its dtype);
    2. checks them for finiteness, agreed over ``axis_name`` when given;
    3. runs ``inner.update`` on the *unscaled* gradients, so clipping and
       every other transformation inside ``inner`` sees true gradients;
    4. if any gradient was inf or NaN, returns zero updates (so
       ``optax.apply_updates`` leaves the parameters bit-for-bit unchanged)
       and keeps ``inner``'s state exactly as it was: its step count,
       moments and schedules do not advance. The skip is a branch-free
       select on the device (no host round-trip) that copies no state:
       see ``lossscale/_skip.py``;
    5. adjusts the loss scale (e.g. backs off a :class:`DynamicLossScale`).

    Read the scale for the next forward pass with
    :func:`lossscale.get_loss_scale` and log :func:`lossscale.metrics`.

    Args:
        inner: the optimizer to wrap, e.g. ``optax.adamw(1e-3)``.
        loss_scale: the initial loss-scale state: :class:`NoOpLossScale`,
            :class:`StaticLossScale`, :class:`DynamicLossScale` or any object
            implementing :class:`LossScale`.
        axis_name: ``None``, or the name (or tuple of names) of the mapped
            axes (``pmap``/``shard_map``) over which replicas must agree on
            skipping. Only the finiteness flag is all-reduced. Not needed
            under plain ``jax.jit`` with globally sharded gradients.
        mask: ``None`` (every floating leaf is loss-scaled), a pytree of
            bools with the structure of the parameters (or a prefix of it),
            or a callable returning one, as in ``optax.masked``. Leaves
            marked ``False`` are neither unscaled nor checked (e.g. float8
            scale/amax metadata, frozen leaves); they reach ``inner``
            unchanged. A callable is called on the gradients in ``update``
            and on the parameters in ``init``.
        on_min_scale: ``"ignore"`` (the default: keep skipping; watch
            ``at_min_scale`` and ``consecutive_skips`` in :func:`metrics`)
            or ``"error"``: raise a ``FloatingPointError`` from the host
            (through ``jax.debug.callback``, called only when it fires)
            once ``min_scale_patience`` consecutive steps were skipped with
            the loss scale at its minimum, where lowering it no longer
            helps. JAX may surface it wrapped in its own runtime error.
        min_scale_patience: the number of consecutive skipped steps at the
            minimum scale before ``on_min_scale="error"`` raises; a
            positive int.

    Returns:
        A :class:`optax.GradientTransformationExtraArgs` whose state is a
        :class:`LossScaledState`.

    Raises:
        TypeError: if ``inner`` is not a gradient transformation,
            ``loss_scale`` does not implement the protocol, or ``axis_name``
            or ``mask`` is malformed.
        ValueError: if ``on_min_scale`` is not ``"ignore"`` or ``"error"``,
            or ``min_scale_patience`` is not in ``[1, 2**31 - 1]`` (a
            ``TypeError`` if it is not an int); and in ``update`` under
            ``shard_map``, if the gradients' finiteness varies over a mapped
            axis that some of ``inner``'s state is replicated over
            (``axis_name`` does not name it).

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import lossscale
        >>> tx = lossscale.loss_scaled(
        ...     optax.sgd(1.0), lossscale.DynamicLossScale(2.0**10))
        >>> params = {"w": jnp.array([1.0, 2.0])}
        >>> state = tx.init(params)
        >>> scale = lossscale.get_loss_scale(state)
        >>> grads = jax.grad(
        ...     lambda p: scale.scale(jnp.sum(p["w"] ** 2)))(params)
        >>> updates, state = tx.update(grads, state, params)
        >>> optax.apply_updates(params, updates)["w"]
        Array([-1., -2.], dtype=float32)

    References:
        Micikevicius et al., `Mixed Precision Training
        <https://arxiv.org/abs/1710.03740>`_, 2017.
    """
    return _make(
        inner,
        _check_loss_scale(loss_scale),
        None,
        axis_name=axis_name,
        mask=mask,
        on_min_scale=on_min_scale,
        min_scale_patience=min_scale_patience,
        skip_impl=_skip_impl,
    )


def loss_scaled_by_group(
    inner: optax.GradientTransformation,
    loss_scales: Mapping[Any, LossScale],
    param_labels: Any,
    *,
    axis_name: Any = None,
    mask: Any = None,
    on_min_scale: Literal["ignore", "error"] = "ignore",
    min_scale_patience: int = 10,
    _skip_impl: SkipImpl = "auto",
) -> optax.GradientTransformationExtraArgs:
    """Like :func:`loss_scaled`, with an independent loss scale per group.

    In a model whose parts have gradients of very different magnitudes (an
    image encoder feeding a text decoder, say), one shared scale can
    overflow one part while the other still underflows. Here each parameter
    group has its own scale: the gradients of group ``g`` must arrive scaled
    by ``loss_scales[g]``, which :func:`rescale_gradient` arranges at the
    boundary where one group feeds another. Each group's scale backs off or
    grows on its own evidence (the finiteness of its own gradients); a
    non-finite gradient in *any* group skips the whole update, because the
    groups depend on each other through the backward pass.

    Args:
        inner: the optimizer to wrap.
        loss_scales: a dict from group label to that group's initial loss
            scale (any :class:`LossScale`).
        param_labels: a pytree of labels with the structure of the
            parameters (or a prefix of it), or a callable returning one, as
            in ``optax.multi_transform``. Every label must be a key of
            ``loss_scales``.
        axis_name: as in :func:`loss_scaled`; one all-reduce carries every
            group's flag.
        mask: as in :func:`loss_scaled`.
        on_min_scale: as in :func:`loss_scaled`; any group at its minimum
            counts.
        min_scale_patience: as in :func:`loss_scaled`.

    Returns:
        A :class:`optax.GradientTransformationExtraArgs` whose state is a
        :class:`LossScaledState` with a dict of loss scales;
        :func:`get_loss_scale` returns that dict and :func:`metrics` reports
        ``"loss_scale/<label>"`` (and every other per-scale metric) for
        each group.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import lossscale
        >>> tx = lossscale.loss_scaled_by_group(
        ...     optax.sgd(1.0),
        ...     {"enc": lossscale.StaticLossScale(2.0**4),
        ...      "dec": lossscale.StaticLossScale(2.0**12)},
        ...     param_labels={"enc": "enc", "dec": "dec"})
        >>> params = {"enc": jnp.array(2.0), "dec": jnp.array(3.0)}
        >>> state = tx.init(params)
        >>> scales = lossscale.get_loss_scale(state)
        >>> def loss_fn(p):
        ...     h = lossscale.rescale_gradient(
        ...         p["enc"] * 1.0,
        ...         scales["enc"].loss_scale / scales["dec"].loss_scale)
        ...     return scales["dec"].scale(h * p["dec"])
        >>> updates, state = tx.update(jax.grad(loss_fn)(params), state)
        >>> updates
        {'dec': Array(-2., dtype=float32), 'enc': Array(-3., dtype=float32)}
    """
    if not isinstance(loss_scales, Mapping) or not loss_scales:
        raise TypeError(
            "loss_scales must be a non-empty dict from group label to loss "
            f"scale, got loss_scales={loss_scales!r}."
        )
    groups = {
        label: _check_loss_scale(ls, f"loss_scales[{label!r}]")
        for label, ls in loss_scales.items()
    }
    if param_labels is None:
        raise TypeError(
            "param_labels must be a pytree of group labels or a callable "
            "returning one, got None."
        )
    return _make(
        inner,
        groups,
        param_labels,
        axis_name=axis_name,
        mask=mask,
        on_min_scale=on_min_scale,
        min_scale_patience=min_scale_patience,
        skip_impl=_skip_impl,
    )


def _check_on_min_scale(value: Any) -> str:
    if value not in ("ignore", "error"):
        raise ValueError(
            'on_min_scale must be "ignore" or "error", got '
            f"on_min_scale={value!r}."
        )
    return value


def _check_skip_impl(value: Any) -> SkipImpl:
    if value not in ("auto", "select", "cond"):
        raise ValueError(f"unknown _skip_impl={value!r}.")
    return value


_SINGLE = 0  # the one group's label when there are no groups


def _resolve_labels(param_labels: Any, groups: dict, tree: Any) -> Any:
    """A tree of group labels with the structure of ``tree``."""
    if param_labels is None:
        return jax.tree.map(lambda _: _SINGLE, tree)
    labels = param_labels(tree) if callable(param_labels) else param_labels
    full = _tree.broadcast_prefix(labels, tree, "param_labels")
    unknown = {lab for lab in jax.tree.leaves(full) if lab not in groups}
    if unknown:
        raise ValueError(
            f"param_labels uses labels {sorted(map(repr, unknown))} that are "
            f"not keys of loss_scales {sorted(map(repr, groups))}."
        )
    return full


def _at_min_scale(scale_state: Any) -> jax.Array:
    metrics = getattr(scale_state, "metrics", None)
    at_min = metrics().get("at_min_scale") if callable(metrics) else None
    return jnp.zeros((), jnp.bool_) if at_min is None else at_min


def _raise_stuck_at_min(stuck, skips, scales) -> None:
    if stuck:
        raise FloatingPointError(
            f"lossscale: {int(skips)} consecutive steps had non-finite "
            "gradients with the loss scale at its minimum "
            f"({', '.join(f'{float(s):g}' for s in scales)}). Lowering the "
            "scale no longer helps: the loss or the gradients themselves "
            "are inf or NaN. Check the inputs and labels for NaN/inf, the "
            "learning rate and any division or log in the loss; or lower "
            "min_loss_scale if the gradients are genuinely that large."
        )


def _make(
    inner: Any,
    loss_scale: LossScale | dict[Any, LossScale],
    param_labels: Any,
    *,
    axis_name: Any,
    mask: Any,
    on_min_scale: Any,
    min_scale_patience: Any,
    skip_impl: Any,
) -> optax.GradientTransformationExtraArgs:
    """The transformation behind both factories; validates the options."""
    inner = _check_inner(inner)
    axis_name = _checks.axis_name(axis_name)
    mask = _tree.check_mask(mask)
    on_min_scale = _check_on_min_scale(on_min_scale)
    min_scale_patience = _checks.positive_int(
        "min_scale_patience", min_scale_patience
    )
    skip_impl = _check_skip_impl(skip_impl)
    grouped = param_labels is not None

    def as_groups(scale_state):
        return scale_state if grouped else {_SINGLE: scale_state}

    def init_fn(params: optax.Params) -> LossScaledState:
        if mask is not None:
            _tree.resolve_mask(mask, params)
        if grouped:
            _resolve_labels(param_labels, loss_scale, params)
        return LossScaledState(
            loss_scale=loss_scale,
            inner_state=inner.init(params),
            grads_finite=jnp.ones((), jnp.bool_),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            steps=jnp.zeros((), jnp.int32),
            last_skip_step=jnp.full((), -1, jnp.int32),
        )

    def update_fn(
        updates: optax.Updates,
        state: LossScaledState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        if not isinstance(state, LossScaledState):
            raise TypeError(
                "state must be the LossScaledState returned by this "
                f"transformation's init, got {type(state).__name__}."
            )
        if params is not None and (
            jax.tree.structure(params) != jax.tree.structure(updates)
        ):
            raise ValueError(
                "updates and params must have the same tree structure, got "
                f"{jax.tree.structure(updates)} and "
                f"{jax.tree.structure(params)}."
            )
        groups = as_groups(state.loss_scale)
        labels = _resolve_labels(param_labels, groups, updates)
        mask_tree = _tree.resolve_mask(mask, updates)

        flat_grads, treedef = jax.tree.flatten(updates)
        flat_labels = jax.tree.leaves(labels)
        flat_mask = jax.tree.leaves(mask_tree)
        members = {key: [] for key in groups}
        for i, (lab, m) in enumerate(zip(flat_labels, flat_mask, strict=True)):
            if m:
                members[lab].append(i)

        def unscaled():
            # One unscale per group (one reciprocal of its scale), called
            # where the result is used: XLA fuses the multiply into the
            # finiteness check and into the inner update (inside the
            # conditional with _skip_impl="cond") instead of materialising
            # an unscaled copy of the gradients.
            out = list(flat_grads)
            for key, idx in members.items():
                if idx:
                    new = groups[key].unscale([flat_grads[i] for i in idx])
                    for i, g in zip(idx, new, strict=True):
                        out[i] = g
            return out

        checked = unscaled()
        order = list(groups)
        group_finite = _tree.finite_by_group(
            [[checked[i] for i in members[key]] for key in order],
            axis_name=axis_name,
        )
        finite = jnp.all(group_finite)

        def apply():
            try:
                return inner.update(
                    jax.tree.unflatten(treedef, unscaled()),
                    state.inner_state,
                    params,
                    **extra_args,
                )
            except (ValueError, TypeError) as err:
                err.add_note(
                    "lossscale.loss_scaled: the inner optimizer's update "
                    "failed. Do the gradients have the structure of the "
                    "params given to init, and does the state come from "
                    "this optimizer's init?"
                )
                raise

        new_updates, new_inner = _apply_or_skip(
            finite, apply, updates, state.inner_state, skip_impl
        )
        new_groups = {
            key: groups[key].adjust(group_finite[i])
            for i, key in enumerate(order)
        }
        not_finite = jnp.logical_not(finite)
        consecutive = jnp.where(
            not_finite, optax.safe_increment(state.consecutive_skips), 0
        ).astype(jnp.int32)
        if on_min_scale == "error":
            at_min = jnp.any(
                jnp.stack([_at_min_scale(ls) for ls in new_groups.values()])
            )
            stuck = at_min & (consecutive >= min_scale_patience)
            scales = jnp.stack(
                [jnp.asarray(ls.loss_scale) for ls in new_groups.values()]
            )
            lax.cond(
                stuck,
                lambda: jax.debug.callback(
                    _raise_stuck_at_min, stuck, consecutive, scales
                ),
                lambda: None,
            )
        new_state = LossScaledState(
            loss_scale=new_groups if grouped else new_groups[_SINGLE],
            inner_state=new_inner,
            grads_finite=finite,
            skipped_steps=jnp.where(
                not_finite,
                optax.safe_increment(state.skipped_steps),
                state.skipped_steps,
            ).astype(jnp.int32),
            consecutive_skips=consecutive,
            steps=optax.safe_increment(state.steps).astype(jnp.int32),
            last_skip_step=jnp.where(
                not_finite, state.steps, state.last_skip_step
            ).astype(jnp.int32),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _apply_or_skip(finite, apply, grads, old_inner, skip_impl):
    """The inner update if ``finite``, else zero updates and the old state."""
    if _resolve_skip_impl(skip_impl) == "select":
        try:
            return _skip.select_update(finite, apply, old_inner)
        except _skip.UnsupportedJax as err:
            warnings.warn(
                "lossscale: the copy-free skip does not support this JAX "
                f"version ({jax.__version__}; {err}); using a conditional "
                "skip instead, which is correct but copies the updates. "
                "Please report this.",
                RuntimeWarning,
                stacklevel=4,
            )

    def skip():
        out_updates, out_inner = jax.eval_shape(apply)
        zeros = _zeros_like_updates(grads, out_updates)
        if zeros is None:
            # Rare: the updates differ from the gradients in structure or
            # shape. Trace the update for its exact output types (zeros_like
            # has no data dependency, so XLA drops the dead computation).
            zeros = jax.tree.map(jnp.zeros_like, apply()[0])
        old = jax.tree.map(
            lambda o, n: lax.convert_element_type(o, n.dtype),
            old_inner,
            out_inner,
        )
        return zeros, old

    return lax.cond(finite, apply, skip)
