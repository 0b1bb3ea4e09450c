"""Which loss scale a gradient was scaled by, known to ``tx.update``.

:func:`lossscale.value_and_grad` records each floating gradient leaf it
returns with a :class:`Mark`: the loss scale it multiplied the loss by,
and the mapped axes it averaged the gradients over. ``tx.update`` of a
:func:`lossscale.loss_scaled` optimizer looks its gradients up here: it
refuses unmarked gradients (plain ``jax.grad``), compares the marked scale
with its state's on the device (a stale scale skips the step), and refuses
gradients a data-parallel step never averaged.

The record is trace-time bookkeeping keyed by the leaf objects themselves
(arrays eagerly, tracers under a transformation), held weakly: a leaf is
marked while it is alive, and nothing of it enters the compiled program.
A leaf made from a marked one (``lax.pmean(grads, ...)``, a sum, a jit
boundary) is a new object, and unmarked.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lossscale import _compat, _scales, _tree


class Mark(NamedTuple):
    """What :func:`lossscale.value_and_grad` did to a gradient leaf."""

    scale: Any  # the float32 scalar the loss was multiplied by
    averaged: frozenset[Hashable]  # the axes it lax.pmean-ed over


_MARKS: dict[int, tuple[weakref.ref[Any], Mark]] = {}


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    entry = _MARKS.get(key)
    if entry is not None and entry[0] is ref:
        del _MARKS[key]


def mark(tree: Any, scale: Any, averaged: frozenset[Hashable]) -> None:
    """Records every floating leaf of ``tree`` as scaled by ``scale``."""
    record = Mark(scale, averaged)
    for leaf in jax.tree.leaves(tree):
        if not _tree.is_float(leaf):
            continue
        key = id(leaf)
        try:
            ref = weakref.ref(leaf, lambda r, key=key: _forget(key, r))
        except TypeError:  # a leaf that cannot be referenced weakly
            continue
        _MARKS[key] = (ref, record)


def lookup(leaf: Any) -> Mark | None:
    """The mark of ``leaf`` itself, or ``None``."""
    entry = _MARKS.get(id(leaf))
    if entry is None or entry[0]() is not leaf:
        return None
    return entry[1]


_UNMARKED = (
    "tx.update of a lossscale.loss_scaled optimizer takes the gradients "
    "that lossscale.value_and_grad(loss_fn, opt_state) returns (scaled by "
    "the state's loss scale, and marked with it), but the gradient at "
    "{path} is not one of them: gradients of plain jax.grad are not scaled "
    "(training would be wrong by the scale), and an array made from marked "
    "ones is a new, unmarked array (a lax.pmean: pass axis_name to "
    "lossscale.value_and_grad instead; an accumulation: use "
    "lossscale.MultiSteps; a jax.jit boundary between the two: call both in "
    "one jitted step). If you scaled the loss yourself, say by what: "
    "tx.update(grads, opt_state, params, scaled_by=scale), with scale = "
    "lossscale.get_loss_scale(opt_state) the scale you multiplied the loss "
    "by; or build the optimizer with loss_scaled(..., "
    "require_scaled_by=False) to take any gradients unchecked."
)


def same_scale(
    leaves: list[Any],
    checked: list[tuple[str, int]],
    groups: dict[Hashable, Any],
    scaled_by: Any,
    *,
    axis_name: Hashable | tuple[Hashable, ...] | None,
    required: bool,
) -> Any:
    """Whether the gradients were scaled by the state's loss scale.

    ``checked`` lists ``(path, index)`` of the leaves ``update`` unscales.
    Returns a boolean scalar (on the device under tracing), or ``None``
    where there is nothing to compare: no leaf to unscale, or unmarked
    gradients accepted unchecked (``required=False``). Raises a
    ``TypeError`` for unmarked gradients when ``required``, and a
    ``ValueError`` for gradients a data-parallel step never averaged.
    """
    scales = {k: _value(v) for k, v in groups.items()}
    if scaled_by is not None:
        return _given(scaled_by, scales)
    if not checked:
        return None
    marks: dict[int, Mark] = {}
    for path, i in checked:
        found = lookup(leaves[i])
        if found is None:
            if not required:
                return None
            raise TypeError(_UNMARKED.format(path=path or "<root>"))
        marks.setdefault(id(found), found)
    _refuse_unaveraged(list(marks.values()), axis_name)
    result = None
    for found in marks.values():
        # With one scale per group the loss was scaled by its group's.
        hit = functools.reduce(
            jnp.logical_or, [found.scale == s for s in scales.values()]
        )
        result = hit if result is None else jnp.logical_and(result, hit)
    return result


def _value(scale: Any) -> Any:
    """A loss scale's float32 value, clamped as its ``scale`` uses it."""
    value = getattr(_scales.in_range(scale), "loss_scale", scale)
    return jnp.asarray(value, jnp.float32)


def _given(scaled_by: Any, scales: dict[Hashable, Any]) -> Any:
    """``scaled_by`` (a loss scale or its value; for groups, a dict of
    them, one per group) against the state's scales."""
    if isinstance(scaled_by, Mapping):
        if set(scaled_by) != set(scales):
            raise ValueError(
                "scaled_by must give the scale of every group "
                f"({sorted(map(repr, scales))}), got the groups "
                f"{sorted(map(repr, scaled_by))}."
            )
        pairs = [(scaled_by[k], s) for k, s in scales.items()]
    elif len(scales) != 1:
        raise TypeError(
            "scaled_by must be a dict from group label to the loss scale "
            "that group's gradients were scaled by (e.g. "
            "lossscale.get_loss_scale(opt_state)), got "
            f"{type(scaled_by).__name__}."
        )
    else:
        pairs = [(scaled_by, next(iter(scales.values())))]
    result = None
    for given, scale in pairs:
        value = _value(given)
        if value.shape != () or not jnp.issubdtype(value.dtype, jnp.floating):
            raise TypeError(
                "scaled_by must be a loss scale (e.g. "
                "lossscale.get_loss_scale(opt_state)) or its scalar value, "
                f"got a value of shape {value.shape} and dtype {value.dtype}."
            )
        hit = value == scale
        result = hit if result is None else jnp.logical_and(result, hit)
    return result


def _refuse_unaveraged(
    marks: list[Mark], axis_name: Hashable | tuple[Hashable, ...] | None
) -> None:
    """Refuses, under ``jax.pmap`` (or ``shard_map(check_vma=False)``),
    gradients that ``value_and_grad`` did not average over an axis the
    optimizer's ``axis_name`` names: each replica would take its own step
    and the replicas would drift apart. (Where JAX tracks varying values,
    its autodiff already reduces a replicated parameter's gradient.)"""
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    untracked = _compat.unchecked_manual_axes()
    for found in marks:
        missing = [
            a for a in names if a in untracked and a not in found.averaged
        ]
        if missing:
            raise ValueError(
                f"loss_scaled(axis_name={axis_name!r}) is given gradients "
                f"that lossscale.value_and_grad did not average over "
                f"{missing!r}: under jax.pmap (or shard_map with "
                "check_vma=False) each replica would then apply its own "
                "gradients, and the replicas' parameters drift apart. Pass "
                f"axis_name={axis_name!r} to lossscale.value_and_grad too. "
                "If the gradients rightly differ over it (parameters sharded "
                "over that axis), compute them yourself and pass "
                "tx.update(..., scaled_by=lossscale.get_loss_scale(opt_state))."
            )


def keep_unless(same: Any, adjusted: Any, old: Any) -> Any:
    """``adjusted`` where ``same`` is true, else ``old`` (a Python branch
    when ``same`` is concrete)."""
    if not _compat.is_tracer(same):
        return adjusted if bool(same) else old
    return jax.tree.map(
        lambda a, b: jnp.where(same, a, b).astype(jnp.result_type(a)),
        adjusted,
        old,
    )


def scale_of(tree: Any) -> Any:
    """The scale every floating leaf of ``tree`` is marked with, or
    ``None`` if one is unmarked (or marked by several calls)."""
    found = [lookup(x) for x in jax.tree.leaves(tree) if _tree.is_float(x)]
    first = found[0] if found else None
    if first is None or any(m is not first for m in found):
        return None
    return first.scale
