"""Gradient accumulation that recovers from a non-finite micro-batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import optax

from lossscale import _checks, _marks


class MultiSteps(optax.MultiSteps):
    """``optax.MultiSteps`` that clears a non-finite accumulator.

    A drop-in replacement for :class:`optax.MultiSteps` (same arguments,
    state and methods) for use around :func:`lossscale.loss_scaled`:

    .. code-block:: python

        tx = lossscale.MultiSteps(
            lossscale.loss_scaled(
                optax.adamw(1e-3), lossscale.DynamicLossScale()
            ),
            every_k_schedule=4,
        )

    This gives PyTorch's accumulation semantics: the loss scale stays constant
    over the micro-batches of one effective batch (the wrapper's state only
    changes when the accumulated update is emitted), finiteness is judged
    once per real update, and one non-finite micro-batch skips that whole
    effective update and backs the scale off once.

    Why not ``optax.MultiSteps`` itself: it resets its accumulator by
    multiplying it by zero after each emitted update, and ``0 * inf`` is
    NaN, so after the first overflow the accumulator stays NaN for ever and
    every later update is skipped (the scale then falls to its minimum).
    This class zeroes the accumulator with a select instead; everything else
    is inherited unchanged.

    The gradients of :func:`lossscale.value_and_grad` reach the wrapped
    optimizer as an accumulated mean, a new array: this class passes it
    the scale the micro-batch's gradients were marked with as
    ``scaled_by`` (unless given one), so that ``loss_scaled`` still
    refuses unmarked gradients and skips on a stale scale.
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        # Callable[..., Any]: optax annotates the schedule differently
        # across its supported versions.
        every_k_schedule: int | Callable[..., Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if not callable(every_k_schedule):
            _checks.positive_int("every_k_schedule", every_k_schedule)
        super().__init__(opt, every_k_schedule, *args, **kwargs)

    def update(
        self,
        updates: optax.Updates,
        state: optax.MultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.MultiStepsState]:
        if "scaled_by" not in extra_args:
            scale = _marks.scale_of(updates)
            if scale is not None:
                extra_args = {**extra_args, "scaled_by": scale}
        new_updates, new_state = super().update(
            updates, state, params, **extra_args
        )
        # mini_step is 0 exactly when an update was just emitted (or nothing
        # was accumulated yet): the accumulator must then be all zeros.
        fresh = new_state.mini_step == 0
        acc_grads = jax.tree.map(
            lambda acc: jnp.where(fresh, jnp.zeros_like(acc), acc),
            new_state.acc_grads,
        )
        return new_updates, new_state._replace(acc_grads=acc_grads)

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        # update takes a MultiStepsState (from init) where optax's protocol
        # says any OptState, as optax.MultiSteps.update does.
        return optax.GradientTransformationExtraArgs(
            init=self.init,
            update=cast(optax.TransformUpdateExtraArgsFn, self.update),
        )
