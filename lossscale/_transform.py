"""The optax wrapper: unscale, check, update or skip, adjust."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lossscale import _checks, _tree
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
    """

    loss_scale: LossScale
    inner_state: optax.OptState
    grads_finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array


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


def _check_loss_scale(loss_scale: Any) -> LossScale:
    if isinstance(loss_scale, type):
        raise TypeError(
            "loss_scale must be a loss-scale instance, got the class "
            f"{loss_scale.__name__}; did you mean {loss_scale.__name__}()?"
        )
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "loss_scale must implement the lossscale.LossScale protocol "
            "(loss_scale, scale, unscale, adjust), e.g. "
            "lossscale.DynamicLossScale(), got "
            f"loss_scale={loss_scale!r} of type {type(loss_scale).__name__}."
        )
    return loss_scale


def _resolve_skip_impl(skip_impl: SkipImpl) -> Literal["select", "cond"]:
    # "auto" is a conditional on every backend. A branch-free select over
    # the inner state (new if finite else old) makes XLA copy the state,
    # because the in-place update and the select both read the old values:
    # on CPU that measured about twice as slow as the conditional, and its
    # compile time exploded with the number of leaves (minutes at 500). The
    # select stays available for measurements (benchmarks/).
    return "cond" if skip_impl == "auto" else skip_impl


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
       moments and schedules do not advance. No host round-trip is needed;
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

    Returns:
        A :class:`optax.GradientTransformationExtraArgs` whose state is a
        :class:`LossScaledState`.

    Raises:
        TypeError: if ``inner`` is not a gradient transformation,
            ``loss_scale`` does not implement the protocol, or ``axis_name``
            or ``mask`` is malformed.

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
    inner = _check_inner(inner)
    loss_scale = _check_loss_scale(loss_scale)
    axis_name = _checks.axis_name(axis_name)
    mask = _tree.check_mask(mask)
    if _skip_impl not in ("auto", "select", "cond"):
        raise ValueError(f"unknown _skip_impl={_skip_impl!r}.")

    def init_fn(params: optax.Params) -> LossScaledState:
        if mask is not None:
            _tree.resolve_mask(mask, params)
        return LossScaledState(
            loss_scale=loss_scale,
            inner_state=inner.init(params),
            grads_finite=jnp.ones((), jnp.bool_),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
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
        scale_state = state.loss_scale
        mask_tree = _tree.resolve_mask(mask, updates)

        def unscaled():
            # Unscaled where it is used rather than once up front: XLA fuses
            # the multiply into the finiteness reduction and into the inner
            # update (inside the conditional), instead of materialising a
            # parameter-sized copy of the gradients that both must read.
            return _tree.map_masked(scale_state.unscale, mask_tree, updates)

        finite = _tree.all_finite(
            _tree.masked_leaves(mask_tree, unscaled()), axis_name=axis_name
        )

        def apply():
            try:
                return inner.update(
                    unscaled(), state.inner_state, params, **extra_args
                )
            except (ValueError, TypeError) as err:
                err.add_note(
                    "lossscale.loss_scaled: the inner optimizer's update "
                    "failed. Do the gradients have the structure of the "
                    "params given to init, and does the state come from "
                    "this optimizer's init?"
                )
                raise

        impl = _resolve_skip_impl(_skip_impl)
        if impl == "select":
            new_updates, new_inner = apply()
            new_updates = jax.tree.map(
                lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates
            )
            new_inner = jax.tree.map(
                lambda new, old: jnp.where(finite, new, old).astype(new.dtype),
                new_inner,
                state.inner_state,
            )
        else:

            def skip():
                out_updates, out_inner = jax.eval_shape(apply)
                zeros = _zeros_like_updates(updates, out_updates)
                if zeros is None:
                    # Rare: the updates differ from the gradients in
                    # structure or shape. Trace the update for its exact
                    # output types (zeros_like has no data dependency, so
                    # XLA drops the dead computation).
                    zeros = jax.tree.map(jnp.zeros_like, apply()[0])
                old = jax.tree.map(
                    lambda o, n: lax.convert_element_type(o, n.dtype),
                    state.inner_state,
                    out_inner,
                )
                return zeros, old

            new_updates, new_inner = lax.cond(finite, apply, skip)

        not_finite = jnp.logical_not(finite)
        new_state = LossScaledState(
            loss_scale=scale_state.adjust(finite),
            inner_state=new_inner,
            grads_finite=finite,
            skipped_steps=jnp.where(
                not_finite,
                optax.safe_increment(state.skipped_steps),
                state.skipped_steps,
            ).astype(jnp.int32),
            consecutive_skips=jnp.where(
                not_finite, optax.safe_increment(state.consecutive_skips), 0
            ).astype(jnp.int32),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
