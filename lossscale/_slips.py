"""Two slips with a loss scale's own methods, caught as they are made.

A loss scale's ``scale`` called inside the function that
:func:`lossscale.value_and_grad` differentiates would scale the loss twice:
it is refused at once. Gradients that a built-in scale's ``unscale``
returns outside ``tx.update`` were unscaled by hand, and ``tx.update``,
which unscales by itself, would unscale them twice: they are recorded
here, for the refusal of unmarked gradients (:mod:`lossscale._marks`) to
name the mistake.

``value_and_grad`` and ``tx.update`` say where the code runs
(:func:`in_loss`, :func:`quiet`); the built-in loss scales ask.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

from lossscale import _records, _tree

# Leaves a built-in loss scale's unscale returned outside tx.update.
_UNSCALED: _records.LeafRecord[bool] = _records.LeafRecord()

# Inside tx.update, which unscales by itself: its unscale records nothing.
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lossscale_marks_quiet", default=False
)
# Inside the function given to value_and_grad, which scales its loss.
_IN_LOSS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lossscale_in_loss", default=False
)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar[bool], value: bool) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def quiet() -> contextlib.AbstractContextManager[None]:
    """``tx.update``'s own unscaling: not a hand-written one."""
    return _setting(_QUIET, True)


def in_loss(inside: bool) -> contextlib.AbstractContextManager[None]:
    """Whether the code run in this context is the loss function given to
    :func:`lossscale.value_and_grad` (``True``), or value_and_grad's own
    scaling of its result (``False``)."""
    return _setting(_IN_LOSS, inside)


def refuse_double_scaling() -> None:
    """Refuses a loss scale's ``scale`` inside the loss function that
    :func:`lossscale.value_and_grad` is differentiating: the loss would be
    scaled twice."""
    if _IN_LOSS.get():
        raise ValueError(
            "a loss scale's scale() was called inside the function given to "
            "lossscale.value_and_grad, which multiplies the loss by the "
            "scale itself: the gradients would be scaled twice (S**2 times "
            "the true ones) and the loss it returns would be the scaled one. "
            "Return the plain loss from the function and let "
            "lossscale.value_and_grad scale it; scale by hand only with "
            "plain jax.grad (then pass tx.update(..., scaled_by=scale))."
        )


def note_unscaled(tree: Any) -> None:
    """Records the floating leaves a loss scale's ``unscale`` returned,
    unless ``tx.update`` itself is unscaling (see :func:`quiet`)."""
    if _QUIET.get():
        return
    for leaf in jax.tree.leaves(tree):
        if _tree.is_float(leaf):
            _UNSCALED.remember(leaf, True)


def unscaled_by_hand(leaf: Any) -> bool:
    """Whether ``leaf`` itself is one a hand-written ``unscale`` returned."""
    return bool(_UNSCALED.recall(leaf))
