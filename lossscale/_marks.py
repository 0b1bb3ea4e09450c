"""Which loss scale a gradient was scaled by, known to ``tx.update``.

:func:`lossscale.value_and_grad` records each floating gradient leaf it
returns with a :class:`Mark`: the loss scale it multiplied the loss by,
and the mapped axes it averaged the gradients over. ``tx.update`` of a
:func:`lossscale.loss_scaled` optimizer looks its gradients up here: it
refuses unmarked gradients (plain ``jax.grad``) with a message naming the
mistake that made them, compares the marked scale with its state's (at
trace time where the trace tells, else on the device: a stale scale skips
the step), and refuses gradients a data-parallel step never averaged.

Gradients unscaled by hand before ``tx.update`` (which would unscale them
twice) are unmarked too: the refusal names that mistake from the record
the built-in scales' ``unscale`` keeps (:mod:`lossscale._slips`).

The record is trace-time bookkeeping keyed by the leaf objects themselves
(arrays eagerly, tracers under a transformation), held weakly: a leaf is
marked while it is alive, and nothing of it enters the compiled program.
A leaf made from a marked one (``lax.pmean(grads, ...)``, a sum, a jit
boundary) is a new object, and unmarked.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from lossscale import _compat, _records, _scales, _slips, _tree


class Mark(NamedTuple):
    """What :func:`lossscale.value_and_grad` did to a gradient leaf."""

    scale: Any  # the float32 scalar the loss was multiplied by
    averaged: frozenset[Hashable]  # the axes it lax.pmean-ed over
    # The state's own scale leaf that value_and_grad read (unclamped), to
    # tell at trace time a scale captured from outside the trace; None for
    # a scale with no such leaf.
    source: Any = None
    # Where the LossScaledState sat in the opt_state value_and_grad got,
    # when that explains unmarked gradients in tx.update: "chain" (after
    # other transformations of an optax.chain) or "multisteps" (inside an
    # optax.MultiSteps). None otherwise.
    nested: str | None = None


_MARKS: _records.LeafRecord[Mark] = _records.LeafRecord()


def mark(
    tree: Any,
    scale: Any,
    averaged: frozenset[Hashable],
    *,
    source: Any = None,
    nested: str | None = None,
) -> None:
    """Records every floating leaf of ``tree`` as scaled by ``scale``."""
    record = Mark(scale, averaged, source, nested)
    for leaf in jax.tree.leaves(tree):
        if _tree.is_float(leaf):
            _MARKS.remember(leaf, record)


def lookup(leaf: Any) -> Mark | None:
    """The mark of ``leaf`` itself, or ``None``."""
    return _MARKS.recall(leaf)


def same_scale(
    leaves: list[Any],
    checked: list[tuple[str, int]],
    groups: dict[Hashable, Any],
    scaled_by: Any,
    *,
    axis_name: Hashable | tuple[Hashable, ...] | None,
    required: bool,
    sources: dict[Hashable, Any] | None = None,
) -> Any:
    """Whether the gradients were scaled by the state's loss scale.

    ``checked`` lists ``(path, index)`` of the leaves ``update`` unscales;
    ``sources`` holds each group's scale leaf as the state holds it
    (unclamped), to compare with the leaf ``value_and_grad`` read. Returns
    a boolean scalar (on the device under tracing), or ``None`` where there
    is nothing to compare: no leaf to unscale, unmarked gradients accepted
    unchecked (``required=False``), or gradients marked with the very leaf
    the state holds (the same traced value: the same scale). Raises a
    ``TypeError`` for unmarked gradients when ``required``, saying which
    mistake made them; a ``ValueError`` for gradients a data-parallel step
    never averaged, and for gradients scaled by a scale captured from
    outside the traced step while the state's is traced (a stale state).
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
            raise TypeError(
                refusal(
                    path or "<root>",
                    leaves,
                    [] if sources is None else list(sources.values()),
                )
            )
        if id(found) not in marks:
            _refuse_captured(
                found, path or "<root>", leaves[i], groups, sources
            )
        marks.setdefault(id(found), found)
    _refuse_unaveraged(list(marks.values()), axis_name)
    known = [] if sources is None else list(sources.values())
    result = None
    for found in marks.values():
        if found.source is not None and any(found.source is s for s in known):
            continue  # read from this very state: nothing to compare
        # With one scale per group the loss was scaled by its group's.
        hit = functools.reduce(
            jnp.logical_or, [found.scale == s for s in scales.values()]
        )
        result = hit if result is None else jnp.logical_and(result, hit)
    return result


def _adapts(scale: Any) -> bool:
    """Whether a loss scale's value can change from step to step (as far
    as is known: a policy of your own is taken to)."""
    return not isinstance(
        scale, _scales.StaticLossScale | _scales.NoOpLossScale
    )


def _refuse_captured(
    found: Mark,
    path: str,
    leaf: Any,
    groups: dict[Hashable, Any],
    sources: dict[Hashable, Any] | None,
) -> None:
    """Refuses gradients traced in this step but scaled by a concrete scale
    (read from a state captured from outside the trace, fixed when the
    step was traced) while the state's adaptive scale is traced: every
    step after the first change of the scale would be skipped."""
    if sources is None or found.source is None:
        return
    if not _compat.is_tracer(leaf) or _compat.is_tracer(found.source):
        return
    adapting = [
        label
        for label, source in sources.items()
        if _compat.is_tracer(source) and _adapts(groups[label])
    ]
    if adapting:
        raise ValueError(
            f"the gradient at {path} was scaled by the loss scale of an "
            "opt_state captured from outside the traced step (a concrete "
            "value, fixed when the step was traced), while tx.update gets "
            "the step's own opt_state: lossscale.value_and_grad was given a "
            "stale opt_state (the initial one, closed over by the step?), "
            "and every step after the scale first changes would be skipped. "
            "Give value_and_grad the opt_state the step passes to tx.update: "
            "lossscale.value_and_grad(loss_fn, opt_state) inside the step."
        )


# --- the refusal of unmarked gradients, one message per mistake -----------


def refusal(path: str, leaves: list[Any], sources: list[Any]) -> str:
    """The ``TypeError`` message for unmarked gradients: which mistake
    made them, as far as the trace shows, and its fix.

    ``sources`` are the scale leaves of the state ``tx.update`` got. Marked
    gradients read from one of them (``value_and_grad`` given this very
    state) show that the unmarked ones were made from them in between:
    the state says where ``loss_scaled`` sat (after other links of a
    chain, inside ``optax.MultiSteps``). Unmarked tracers that are inputs
    of their trace crossed a ``jax.jit`` boundary (or ``optax.MultiSteps``'
    conditional, if live marked gradients of the same shapes say so): the
    message covers both origins they may have, as nothing inside the jit
    tells them apart. Anything else is taken for plain ``jax.grad``, whose
    message offers ``scaled_by`` only for a loss scaled by hand.
    """
    where = f"the gradient at {path}"
    bad = [x for x in leaves if _tree.is_float(x) and lookup(x) is None]
    if any(_slips.unscaled_by_hand(x) for x in bad):
        return (
            f"{where} was unscaled by hand (loss_scale.unscale(grads)) "
            "before tx.update, which unscales by itself: it would be divided "
            "by the scale twice. Pass tx.update the scaled gradients "
            "lossscale.value_and_grad returned, as they are; to clip the "
            "unscaled gradients, chain the clipping inside the wrapper: "
            "loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), "
            "optax.adamw(1e-3)), ...) (report_grad_norm=True records their "
            "norm)."
        )
    calls = _live_calls()
    linked = [
        found
        for found, _ in calls
        if found.source is not None and any(found.source is s for s in sources)
    ]
    if linked:
        return _made_from(where, linked[-1])
    inputs = {_compat.is_trace_input(x) for x in bad}
    if bad and all(_compat.is_tracer(x) for x in bad) and False not in inputs:
        want = _signature(leaves)
        shaped = [(f, m) for f, m in calls if _signature(m) == want]
        if shaped and shaped[-1][0].nested == "multisteps":
            return _MULTISTEPS.format(where=where)
        # Where this JAX cannot tell an input (None), marked arrays of the
        # same shapes outside any trace make a jit boundary likely.
        concrete = [m for _, m in shaped if not _compat.is_tracer(m[0])]
        if inputs == {True} or concrete:
            return (
                f"{where} is an argument of the jax.jit (or other traced "
                "function) that tx.update runs in, jax.jit(tx.update) say, "
                "so tx.update cannot see where it was made: the mark "
                "lossscale.value_and_grad leaves on its gradients stays "
                "outside, with the arrays it marked. If it comes from "
                "lossscale.value_and_grad, call both in one jitted train "
                "step, or pass the scale that call used: jax.jit(tx.update)("
                "grads, opt_state, params, scaled_by=lossscale.get_loss_scale("
                "opt_state)). If it comes from plain jax.grad, it is not "
                "scaled at all: compute it with lossscale.value_and_grad("
                "loss_fn, opt_state) instead."
            )
    return (
        "tx.update of a lossscale.loss_scaled optimizer takes the gradients "
        f"lossscale.value_and_grad returns, but {where} is not one of them: "
        "gradients of plain jax.grad (or jax.value_and_grad) are not "
        "scaled, and tx.update, which divides by the loss scale, would "
        "train that many times too slowly. Compute them with "
        "lossscale.value_and_grad(loss_fn, opt_state)(params, ...), in the "
        "step that passes the same opt_state to tx.update. (Only gradients "
        "of a loss you multiplied by the loss scale yourself, with "
        "loss_scale.scale(loss) before jax.grad, may instead say so with "
        "tx.update(..., scaled_by=loss_scale).)"
    )


_MULTISTEPS = (
    "{where} is optax.MultiSteps' accumulated mean of the gradients "
    "lossscale.value_and_grad returned, a new array that carries no mark "
    "of its scale. Use lossscale.MultiSteps(loss_scaled(...), "
    "every_k_schedule=k) in place of optax.MultiSteps: it passes the scale "
    "on, and recovers from an overflowing micro-batch."
)


def _made_from(where: str, found: Mark) -> str:
    """The message for gradients made from marked ones in between."""
    if found.nested == "chain":
        return (
            f"{where} reached loss_scaled after other transformations of an "
            "optax.chain (optax.chain(optax.clip_by_global_norm(1.0), "
            "loss_scaled(...)), or optax.add_decayed_weights before it): "
            "they ran on the scaled gradients (clipping at S times the "
            "norm, adding weight decay S times too small) and made new "
            "arrays. Put loss_scaled outermost, with the rest inside: "
            "loss_scaled(optax.chain(optax.clip_by_global_norm(1.0), "
            "optax.adamw(1e-3)), loss_scale)."
        )
    if found.nested == "multisteps":
        return _MULTISTEPS.format(where=where)
    if _compat.manual_axes():
        return (
            f"{where} was made from the gradients lossscale.value_and_grad "
            "returned, inside a jax.pmap or shard_map (a lax.pmean of "
            "them?): a new array, which carries no mark of its scale. Let "
            "value_and_grad average them, and pmean nothing yourself: "
            "lossscale.value_and_grad(loss_fn, opt_state, axis_name=...)."
        )
    return (
        f"{where} was made from the gradients lossscale.value_and_grad "
        "returned (a sum, a cast, an accumulation...): a new array, which "
        "carries no mark of its scale. Pass tx.update value_and_grad's "
        "gradients as they are: average over devices with "
        "value_and_grad(..., axis_name=...), accumulate with "
        "lossscale.MultiSteps. If the new array is still scaled by exactly "
        "the scale value_and_grad used, say so: tx.update(..., "
        "scaled_by=lossscale.get_loss_scale(opt_state))."
    )


def _signature(leaves: list[Any]) -> list[tuple[tuple[int, ...], str]]:
    return sorted(
        (tuple(jnp.shape(x)), str(jnp.result_type(x)))
        for x in leaves
        if _tree.is_float(x)
    )


def _live_calls() -> list[tuple[Mark, list[Any]]]:
    """Each :func:`lossscale.value_and_grad` call whose marked gradients
    are (partly) alive, with those leaves, the latest last."""
    calls: dict[int, tuple[Mark, list[Any]]] = {}
    for leaf, found in _MARKS.alive():
        calls.setdefault(id(found), (found, []))[1].append(leaf)
    return list(calls.values())


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
