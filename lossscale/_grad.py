"""The scaled gradient and the true loss, in one call.

flax's ``DynamicScale.value_and_grad`` and mpx's ``filter_value_and_grad``
return the loss and the gradient of a loss scaled inside; with lossscale's
optax wrapper the gradients must stay *scaled* (``loss_scaled`` unscales,
checks and skips), and only the loss needs unscaling. Rather than divide
the scaled loss by the scale (which rounds, and is ``inf`` when the scaled
loss overflowed), the unscaled loss is carried out of the same forward pass
as an auxiliary output of the underlying ``value_and_grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lossscale import (
    _checks,
    _compat,
    _inspect,
    _interop,
    _marks,
    _scales,
    _slips,
    _tree,
)
from lossscale._scales import LossScale
from lossscale._transform import LossScaledState


def value_and_grad(
    fun: Callable[..., Any],
    opt_state: Any,
    *,
    argnums: int | Sequence[int] | Any | None = None,
    has_aux: bool = False,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
    via: Callable[..., Callable[..., Any]] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad``, with the loss scaled for the gradients.

    The returned function evaluates ``fun``, multiplies its loss by the
    loss scale, and differentiates that, in one forward and one backward
    pass. It returns:

    - ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``;
    - ``loss``: the *unscaled* loss, bit for bit what ``fun`` returned, in
      its own dtype (taken from the same forward pass, not divided back);
    - ``aux``: ``fun``'s auxiliary output, never scaled (a model's batch
      statistics, say, come out as computed);
    - ``grads``: the gradients of the *scaled* loss: what ``tx.update`` of
      a :func:`lossscale.loss_scaled` optimizer expects, which unscales
      them, checks them and skips the step if they are not finite.

    A train step differs from the plain optax one in one line: the
    optimizer is wrapped once in :func:`lossscale.loss_scaled`, and in the
    step ``jax.value_and_grad(loss_fn)`` becomes
    ``lossscale.value_and_grad(loss_fn, opt_state)``.

    Call it *inside* the train step, with that step's ``opt_state``: the
    scale is read when ``value_and_grad`` is called, and a function made
    once, outside, would keep using the first step's scale.

    The gradients it returns are *marked* with the scale they were scaled
    by (and the axes they were averaged over), and ``tx.update`` checks
    the mark, so that these slips cannot go silently wrong (see the
    guide's "Guarantees"):

    - gradients that ``value_and_grad`` did not return (plain
      ``jax.grad``: unscaled), or arrays made from them on the way (by a
      transformation chained before ``loss_scaled``, a hand-written
      ``unscale``, a ``lax.pmean``, ``optax.MultiSteps``), are refused by
      ``tx.update`` with a ``TypeError`` naming the mistake, at trace
      time;
    - an ``opt_state`` captured from outside the jitted step (the initial
      one, closed over) while ``tx.update`` gets the step's own is refused
      with a ``ValueError`` at trace time, where its scale adapts;
    - gradients scaled by another traced scale than the state
      ``tx.update`` gets (``value_and_grad`` given another ``opt_state``)
      skip the step, as a non-finite step does, without adjusting the
      scale: a check of one scalar on the device (counted, and raised
      after a patience, with ``loss_scaled(..., on_min_scale="error")``);
    - under ``jax.pmap`` (or a ``shard_map`` with ``check_vma=False``),
      gradients not averaged over an axis that ``loss_scaled``'s
      ``axis_name`` names are refused at trace time: pass the axis here.

    ``fun`` must return the plain loss: a loss scale's ``scale()`` called
    inside it would scale the loss twice, and raises a ``ValueError``.

    The mark belongs to the returned arrays themselves (it is kept, weakly,
    beside them, and nothing of it is compiled): pass them to ``tx.update``
    in the same traced function (the jitted step), or both eagerly. An
    array made from them (a ``lax.pmean``, a sum over micro-batches, the
    argument of another ``jax.jit``) is unmarked: average with
    ``axis_name`` here, accumulate with :class:`lossscale.MultiSteps`, or
    say which scale you used with ``tx.update(..., scaled_by=scale)``.

    Args:
        fun: the loss function, returning a floating scalar (or, with
            ``has_aux``, a pair ``(loss, aux)``).
        opt_state: the optimizer state whose scale multiplies the loss:
            any optax state holding one :class:`LossScaledState` (nested in
            a chain, or ``nnx.Optimizer.opt_state``), from which
            :func:`lossscale.get_loss_scale` takes it; or a
            :class:`LossScale` itself (e.g.
            ``lossscale.get_loss_scale(opt_state)``). For
            :func:`loss_scaled_by_group` pass the scale of the group the
            loss is in, e.g. ``get_loss_scale(opt_state)["decoder"]``.
        argnums: which positional arguments to differentiate, passed on to
            ``via``. ``None`` (the default) passes nothing, so ``via``'s own
            default applies (the first argument); give it only to a ``via``
            that takes it (``jax.value_and_grad``, ``nnx.value_and_grad``,
            which also takes ``nnx.DiffState``; not
            ``eqx.filter_value_and_grad``, which differentiates the first
            argument).
        has_aux: whether ``fun`` returns ``(loss, aux)``.
        axis_name: ``None``, or the mapped axis name (or tuple of names)
            over which to *average* the gradients with ``lax.pmean``, as
            flax's ``DynamicScale.value_and_grad(..., axis_name=...)`` does,
            under ``jax.pmap`` or ``shard_map`` (outside them, the returned
            function raises a ``ValueError``). This is not
            :func:`loss_scaled`'s ``axis_name``, which all-reduces only the
            finiteness flag so that the devices agree on a skip: a port of
            a flax pmap step names the axis in both. Under a ``shard_map``
            that tracks varying values (``check_vma=True``, the default),
            JAX's autodiff already sums over an axis the gradient of a
            parameter replicated over it; averaging such a gradient again
            is ambiguous (it is a sum, or a mean if the loss was averaged),
            so it raises: ``pmean`` the loss inside ``fun`` instead, and
            leave ``axis_name`` out.
        via: the ``value_and_grad`` to differentiate with:
            ``jax.value_and_grad`` (the default), ``nnx.value_and_grad``,
            ``eqx.filter_value_and_grad``, or any function of
            ``(fun, *, has_aux, [argnums])`` returning
            ``((value, aux), grads)``. Other options go in a
            ``functools.partial``, e.g.
            ``partial(jax.value_and_grad, allow_int=True)``.

    Returns:
        A function with ``fun``'s signature returning ``(loss, grads)``, or
        ``((loss, aux), grads)`` with ``has_aux``.

    Raises:
        TypeError: if ``fun`` or ``via`` is not callable, ``has_aux`` is not
            a bool, ``axis_name`` is malformed, or ``opt_state`` is neither
            a loss scale nor an optimizer state holding one (or holds a
            dict of them: pass one group's); in the returned function, if
            ``fun`` returns a tuple without ``has_aux=True`` (or anything
            but a pair with it).
        ValueError: if ``opt_state`` holds several
            :class:`LossScaledState` s; and, in the returned function, if
            ``fun`` calls a loss scale's ``scale()`` (the loss would be
            scaled twice), if ``axis_name`` names an axis that is not
            mapped there, or under
            a ``shard_map`` with ``check_vma=True``, if a gradient does not
            vary over an axis of ``axis_name`` (see ``axis_name``).

    Examples:
        A plain optax step, and the same step with loss scaling:

        >>> import jax, jax.numpy as jnp, optax
        >>> import lossscale
        >>> def loss_fn(params, x):
        ...     return jnp.sum((params["w"] * x) ** 2)
        >>> params = {"w": jnp.array([1.0, 2.0])}
        >>> x = jnp.array([1.0, 1.0])
        >>> tx = optax.sgd(0.1)
        >>> @jax.jit
        ... def step(params, opt_state, x):
        ...     loss, grads = jax.value_and_grad(loss_fn)(params, x)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, loss
        >>> tx = lossscale.loss_scaled(tx, lossscale.DynamicLossScale())
        >>> @jax.jit
        ... def scaled_step(params, opt_state, x):
        ...     loss, grads = lossscale.value_and_grad(loss_fn, opt_state)(
        ...         params, x)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state, loss
        >>> params, opt_state, loss = scaled_step(params, tx.init(params), x)
        >>> loss  # the true loss, not 2**15 times it
        Array(5., dtype=float32)
        >>> params["w"]
        Array([0.8, 1.6], dtype=float32)
    """
    if not callable(fun):
        raise TypeError(f"fun must be callable, got fun={fun!r}.")
    if not callable(via):
        raise TypeError(
            "via must be a value_and_grad function such as "
            f"jax.value_and_grad, got via={via!r}."
        )
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got has_aux={has_aux!r}.")
    axes = _checks.axis_name(axis_name)
    scale = _resolve(opt_state)
    source, nested = _provenance(opt_state, scale)
    options: dict[str, Any] = {"has_aux": True}
    if argnums is not None:
        options["argnums"] = argnums

    def scaled(*args: Any, **kwargs: Any) -> tuple[Any, tuple[Any, Any]]:
        with _slips.in_loss(True):  # a scale() in fun would scale twice
            out = fun(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    "with has_aux=True, fun must return a pair (loss, aux), "
                    f"got a {type(out).__name__}."
                )
            loss, aux = out
        elif isinstance(out, tuple):
            raise TypeError(
                f"fun returned a tuple of {len(out)} values, not a scalar "
                "loss: if it returns (loss, aux), pass has_aux=True to "
                "lossscale.value_and_grad."
            )
        else:
            loss, aux = out, None
        # The true loss leaves as an auxiliary output: no second pass, and
        # no division of a scaled loss that may have overflowed.
        with _slips.in_loss(False):
            return scale.scale(loss), (loss, aux)

    grad_fn = via(scaled, **options)

    def loss_and_scaled_grads(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
        if axes is not None:
            grads = _mean_over(grads, axes)
        names = () if axes is None else axes
        names = names if isinstance(names, tuple) else (names,)
        _marks.mark(
            grads,
            _scale_value(scale),
            frozenset(names),
            source=source,
            nested=nested,
        )
        return ((loss, aux) if has_aux else loss), grads

    return loss_and_scaled_grads


def _scale_value(scale: LossScale) -> jax.Array:
    """The float32 scale ``scale.scale`` multiplies by (clamped as used)."""
    return jnp.asarray(_scales.in_range(scale).loss_scale, jnp.float32)


def _provenance(opt_state: Any, scale: LossScale) -> tuple[Any, str | None]:
    """The scale leaf as ``opt_state`` holds it (unclamped), and where the
    :class:`LossScaledState` sits in ``opt_state`` when that makes
    gradients arrive unmarked in its ``update``: ``"chain"`` (after other
    transformations of an ``optax.chain``, whose states come first in its
    tuple) or ``"multisteps"`` (inside ``optax.MultiSteps``)."""
    if isinstance(opt_state, LossScale):
        return _raw_scale(opt_state), None
    leaves, _ = jax.tree_util.tree_flatten_with_path(
        opt_state, is_leaf=lambda x: isinstance(x, LossScaledState)
    )
    for path, leaf in leaves:
        if isinstance(leaf, LossScaledState):
            raw = _interop.unwrap_variables(leaf.loss_scale)
            return _raw_scale(raw), _nesting(opt_state, path)
    return _raw_scale(scale), None


def _raw_scale(scale: Any) -> Any:
    """A built-in scale's own leaf (not a value computed from it)."""
    if isinstance(scale, _scales.StaticLossScale | _scales.DynamicLossScale):
        return scale.loss_scale
    return None


def _nesting(opt_state: Any, path: Any) -> str | None:
    node, nested = opt_state, None
    for key in path:
        if isinstance(node, optax.MultiStepsState):
            nested = nested or "multisteps"
        if isinstance(key, jax.tree_util.SequenceKey):
            # optax.chain's state is a plain tuple, one state per link.
            if type(node) is tuple and key.idx > 0:
                nested = "chain"
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        else:  # a node of some other library: stop looking
            break
    return nested


def _pmean(
    leaf: Any,
    names: tuple[Hashable, ...],
    axes: Hashable | tuple[Hashable, ...],
) -> Any:
    """``lax.pmean``, with a clear error for an axis nothing maps here."""
    try:
        return lax.pmean(leaf, names)
    except NameError as err:
        raise ValueError(
            f"axis_name={axes!r} names an axis that is not mapped here "
            f"({err}): value_and_grad's axis_name averages the gradients "
            "over the devices of a jax.shard_map or jax.pmap. Under plain "
            "jax.jit (any sharding) or eagerly, leave it out: the gradients "
            "are global there."
        ) from None


def _resolve(opt_state: Any) -> LossScale:
    """The loss scale itself, or the one an optimizer state holds."""
    if isinstance(opt_state, type):
        raise TypeError(
            "opt_state must be an optimizer state or a loss-scale instance, "
            f"got the class {opt_state.__name__}."
        )
    if isinstance(opt_state, LossScale):
        return opt_state
    if not _inspect._find_states(opt_state):
        raise TypeError(
            "opt_state must be an optimizer state holding one loss scale "
            "(made by lossscale.loss_scaled(...).init) or a "
            "lossscale.LossScale (e.g. lossscale.get_loss_scale(opt_state)), "
            f"got opt_state of type {type(opt_state).__name__}."
        )
    scale = _inspect.get_loss_scale(opt_state)  # ValueError if several
    if isinstance(scale, dict):
        raise TypeError(
            "opt_state holds one loss scale per group "
            f"({sorted(map(repr, scale))}, from loss_scaled_by_group): pass "
            "the scale of the group the loss is in, e.g. "
            "lossscale.get_loss_scale(opt_state)[label]."
        )
    return _interop.unwrap_variables(scale)


def _mean_over(grads: Any, axes: Hashable | tuple[Hashable, ...]) -> Any:
    """``lax.pmean`` of the floating gradient leaves over ``axes``.

    Under a ``shard_map`` that tracks varying values, a gradient invariant
    over a named axis was already reduced over it by autodiff, and is
    refused (see :func:`value_and_grad`).
    """
    names = axes if isinstance(axes, tuple) else (axes,)
    checked = _compat.manual_axes() - _compat.unchecked_manual_axes()
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    out = []
    for path, leaf in with_paths:
        if not _tree.is_float(leaf):
            out.append(leaf)
            continue
        reduced = [
            a for a in names if a in checked and a not in _compat.vma(leaf)
        ]
        if reduced:
            where = jax.tree_util.keystr(path) or "<root>"
            raise ValueError(
                f"axis_name={axes!r}: the gradient at {where} does not vary "
                f"over {reduced!r}. Under shard_map (check_vma=True) JAX's "
                "autodiff already reduces over a mapped axis the gradient of "
                "a parameter replicated over it: summed, or averaged if the "
                "loss was averaged with lax.pmean. Averaging again is "
                "ambiguous: leave axis_name out, and lax.pmean the loss "
                "inside fun for the mean gradient."
            )
        out.append(_pmean(leaf, names, axes))
    return treedef.unflatten(out)
