"""The optax wrapper: unscale, check, update or skip, adjust.

``update`` (:func:`_update`) is a sequence of named steps, each a function
below: :func:`_plan` (which leaves belong to which loss scale),
:func:`_refuse_narrow_gradients`, :class:`_Unscaled`, :func:`_decide` (the
finiteness check, agreed across devices),
:func:`lossscale._skip.apply_if_finite` (the inner update, or the skip),
:func:`_adjust` (the next loss scales), :func:`_next_counters` and
:func:`_min_scale_alarm`.

Internally every state holds a dict of loss scales, one per group; a
single scale (:func:`loss_scaled`) is the group ``_SINGLE``, converted at
the boundary to and from the public ``LossScaledState.loss_scale``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import gc
import math
import numbers
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, Literal, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from lossscale import (
    _checks,
    _compat,
    _finite,
    _marks,
    _scales,
    _skip,
    _slips,
    _tree,
)
from lossscale._scales import LossScale

OnMinScale = Literal["ignore", "error", "count"]
Groups = dict[Hashable, LossScale]

_SINGLE = "loss_scale"  # the one group of loss_scaled


class LossScaledState(NamedTuple):
    """State of :func:`loss_scaled` and :func:`loss_scaled_by_group`.

    Attributes:
        loss_scale: the loss-scale state (e.g. a :class:`DynamicLossScale`)
            to use for the *next* step's ``scale``/``unscale``; with
            :func:`loss_scaled_by_group`, a dict from group label to that
            group's loss-scale state.
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
        nonfinite: with ``report_nonfinite=True``, which leaves of the last
            step's gradients held an inf or NaN, in tree order
            (``shape=(number of leaves,), dtype=bool``; read it with
            :func:`lossscale.nonfinite_paths`); else ``None``.
        min_scale_skips: with ``on_min_scale="error"`` or ``"count"``, the
            number of consecutive skipped steps on which a group whose
            gradients were not finite was already at its minimum scale
            (``shape=(), dtype=int32``); else ``None``.
        grad_norm: with ``report_grad_norm=True``, the global L2 norm of
            the last step's unscaled gradients (``shape=(), dtype=float32``;
            0 after ``init``); else ``None``.
        stale_scale_skips: with ``on_min_scale="error"`` or ``"count"``,
            the number of consecutive steps skipped because their gradients
            were scaled by another loss scale than the state's
            (``value_and_grad`` given another ``opt_state`` than
            ``tx.update``, or a wrong ``scaled_by``;
            ``shape=(), dtype=int32``); else ``None``.

    lossscale 0.1's state had the first seven fields only, 0.2's the first
    nine: restore their checkpoints into a dict of those fields taken from
    a fresh target (``tx.init(params)``), and complete it with the
    target's other fields, ``target._replace(**restored)`` (see the
    guide's checkpointing section).
    """

    loss_scale: Any
    inner_state: optax.OptState
    grads_finite: jax.Array
    skipped_steps: jax.Array
    consecutive_skips: jax.Array
    steps: jax.Array
    last_skip_step: jax.Array
    nonfinite: jax.Array | None = None
    min_scale_skips: jax.Array | None = None
    grad_norm: jax.Array | None = None
    stale_scale_skips: jax.Array | None = None


# How to skip under tracing. Private: tests and benchmarks compare the two
# (`with _transform.skip_impl("cond"): tx = loss_scaled(...)`); the select
# is the default everywhere, and the conditional is its fallback.
_SKIP_IMPL: contextvars.ContextVar[_skip.Impl] = contextvars.ContextVar(
    "lossscale_skip_impl", default="select"
)


@contextlib.contextmanager
def skip_impl(impl: _skip.Impl) -> Iterator[None]:
    """Transformations built in this context skip with ``impl``."""
    if impl not in _skip.IMPLS:
        raise ValueError(f"impl must be one of {_skip.IMPLS}, got {impl!r}.")
    token = _SKIP_IMPL.set(impl)
    try:
        yield
    finally:
        _SKIP_IMPL.reset(token)


@dataclasses.dataclass(frozen=True, eq=False)
class _Spec:
    """The validated static configuration of one transformation."""

    inner: optax.GradientTransformationExtraArgs
    initial: Groups
    param_labels: Any  # None (one group), a label tree, or a callable
    floors: dict[Hashable, float | None]
    axis_name: Hashable | tuple[Hashable, ...] | None
    mask: _tree.MaskOrFn
    on_min_scale: OnMinScale
    min_scale_patience: int
    report_nonfinite: bool
    skip_impl: _skip.Impl
    report_grad_norm: bool = False
    require_scaled_by: bool = True

    @property
    def grouped(self) -> bool:
        return self.param_labels is not None


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
    mask: _tree.MaskOrFn = None,
    on_min_scale: OnMinScale = "ignore",
    min_scale_patience: int = 10,
    report_nonfinite: bool = False,
    report_grad_norm: bool = False,
    require_scaled_by: bool = True,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer so that it takes scaled gradients.

    Each ``update(scaled_grads, state, params=None, *, scaled_by=None,
    **extra_args)``:

    0. checks that ``scaled_grads`` are scaled by the state's current
       scale: they must be the gradients :func:`lossscale.value_and_grad`
       returned (which marks them with the scale it used), or come with
       ``scaled_by``, the scale the loss was multiplied by (a
       :class:`LossScale` such as ``lossscale.get_loss_scale(opt_state)``
       or its value; for :func:`loss_scaled_by_group`, a dict of them).
       Other gradients (plain ``jax.grad``, not scaled at all) raise a
       ``TypeError`` at trace time, unless ``require_scaled_by=False``;
       its message names the mistake that made them where the trace shows
       it (a transformation chained before ``loss_scaled``, a hand-written
       ``unscale``, a ``lax.pmean``, ``optax.MultiSteps``, a ``jax.jit``
       boundary). Gradients scaled by a concrete scale while the state's
       adaptive one is traced (an ``opt_state`` closed over by the jitted
       step) raise a ``ValueError`` at trace time. Gradients scaled by
       another scale than the state's (another ``opt_state`` given to
       ``value_and_grad``) make the step a skipped one, as in 4., and
       leave the scale unadjusted: a comparison of one scalar on the
       device, left out where the trace shows that the mark was read from
       the state's own scale. Under ``jax.pmap`` with ``axis_name``,
       gradients that ``value_and_grad`` did not average over it are
       refused (a ``ValueError``): the replicas would drift apart;
    1. unscales the gradients with the current scale (in float32; each leaf
       keeps its dtype);
    2. checks them for finiteness, agreed over ``axis_name`` when given;
    3. runs ``inner.update`` on the *unscaled* gradients, so clipping and
       every other transformation inside ``inner`` sees true gradients;
       ``params`` and ``extra_args`` are passed on as given;
    4. if any gradient was inf or NaN, returns zero updates (so
       ``optax.apply_updates`` leaves the parameters bit-for-bit unchanged)
       and keeps ``inner``'s state exactly as it was: its step count,
       moments and schedules do not advance. Under ``jit`` the skip is a
       branch-free select on the device (no host round-trip) that copies
       no state (see the guide's "Skipping without a host round-trip");
       called eagerly, it is a Python branch, and a skipped step never
       runs ``inner.update``;
    5. adjusts the loss scale (e.g. backs off a :class:`DynamicLossScale`).

    Read the scale for the next forward pass with
    :func:`lossscale.get_loss_scale` and log :func:`lossscale.metrics`.

    Args:
        inner: the optimizer to wrap, e.g. ``optax.adamw(1e-3)``.
        loss_scale: the initial loss-scale state: :class:`NoOpLossScale`,
            :class:`StaticLossScale`, :class:`DynamicLossScale` or any object
            implementing :class:`LossScale`.
        axis_name: ``None``, or the name (or tuple of names) of the mapped
            axes (``shard_map``/``pmap``) over which replicas must agree on
            skipping: every mapped axis over which the gradients (or the
            shards of them a device holds) differ. Only the finiteness flag
            is all-reduced. Not needed under plain ``jax.jit``, whatever
            the sharding. Under ``shard_map`` a missing axis is an error at
            trace time; with ``check_vma=False`` (and under ``jax.pmap`` on
            JAX versions that build it on ``shard_map``) every mapped axis
            must be named, as JAX cannot tell which values differ.
        mask: ``None`` (every floating leaf is loss-scaled), a pytree of
            bools with the structure of the gradients (or a prefix of it),
            or a callable returning one, as in ``optax.masked``. Leaves
            marked ``False`` are neither unscaled nor checked (e.g. float8
            scale/amax metadata, frozen leaves); they reach ``inner``
            unchanged. A callable is called on the gradients in ``update``
            and on the parameters in ``init`` (on their fast params for
            ``optax.lookahead``'s ``LookaheadParams``, whose gradients are
            those of the fast params; ``report_nonfinite`` is sized the
            same way).
        on_min_scale: ``"ignore"`` (the default: keep skipping; watch
            ``at_min_scale`` and ``consecutive_skips`` in :func:`metrics`)
            or ``"error"``: raise a ``FloatingPointError`` once
            ``min_scale_patience`` consecutive steps were skipped although
            the scale of a group whose gradients overflowed was already at
            its minimum (the minimum was tried, and lowering no longer
            helps); the state then counts them in ``min_scale_skips``. A
            :class:`StaticLossScale` or :class:`NoOpLossScale` is always at
            its minimum; a policy of your own must report ``at_min_scale``
            in its ``metrics()``. Under ``jit`` the error comes from the
            host through ``jax.debug.callback`` (called only when it
            fires), and JAX may wrap it in its own runtime error; that host
            callback cannot be serialized, so ``jax.export`` of a step built
            with ``"error"`` fails (``NotImplementedError: serialization of
            host_callbacks``). ``"count"`` is the export-friendly form:
            the state counts ``min_scale_skips`` exactly as with
            ``"error"``, nothing is raised, and the host stops the run when
            ``metrics(opt_state)["min_scale_skips"] >= patience``. Both
            also count ``stale_scale_skips``: the consecutive steps skipped
            because the gradients were scaled by another scale than the
            state's (``value_and_grad`` given another ``opt_state``), which
            no change of the scale ends; ``"error"`` raises a
            ``FloatingPointError`` that says so once there were
            ``min_scale_patience`` of them.
        min_scale_patience: the number of such consecutive skipped steps
            (of either kind) before ``on_min_scale="error"`` raises (unused
            by ``"count"``); a positive int.
        report_nonfinite: record in the state which gradient leaves held an
            inf or NaN in the last step (agreed over ``axis_name``), for
            :func:`lossscale.nonfinite_paths` and the ``nonfinite_leaves``
            metric. Default ``False``: the state and the compiled program
            are then exactly those without the option.
        report_grad_norm: record the global L2 norm of the step's
            *unscaled* gradients (every leaf that is unscaled: floating and
            not masked out), in float32, as ``"grad_norm"`` in
            :func:`lossscale.metrics`: computed on every step, so it is
            ``inf`` or NaN on a skipped one. Under ``shard_map`` it is the
            norm of the whole gradient the devices hold together, the same
            on every device: the squared norms of leaves that vary over a
            mapped axis (shards, or per-device gradients) are summed over
            it, while a leaf identical across an axis (replicated, or after
            a ``pmean``) counts once. Where JAX does not track which values
            vary (``check_vma=False``, and ``jax.pmap``) every leaf counts
            once: right for the gradients of a data-parallel step, which
            are the same on every device after their ``pmean``, not for
            gradients sharded across devices (``psum`` the squared norm of
            the shards yourself there, or keep ``check_vma=True``). Called
            eagerly under ``jax_debug_nans``, the norm's arithmetic on
            non-finite gradients stops there. Default ``False``: the state
            and the compiled program are then exactly those without the
            option.
        require_scaled_by: refuse (the default) gradients whose scale
            ``update`` cannot tell: neither returned by
            :func:`lossscale.value_and_grad` nor given ``scaled_by``.
            ``False`` takes them unchecked, as lossscale 0.2 did (marked
            gradients, and ``scaled_by``, are still checked).

    Returns:
        A :class:`optax.GradientTransformationExtraArgs` whose state is a
        :class:`LossScaledState`.

    Raises:
        TypeError: if ``inner`` is not a gradient transformation,
            ``loss_scale`` does not implement the protocol, or ``axis_name``
            or ``mask`` is malformed.
        ValueError: if ``on_min_scale`` is not ``"ignore"``, ``"error"`` or
            ``"count"``, either of the last two is given a policy that does
            not report ``at_min_scale``, or ``min_scale_patience`` is not in
            ``[1, 2**31 - 1]`` (a ``TypeError`` if it is not an int); and
            in ``update``, at trace time: if float16 (or float8) gradients
            meet a loss scale that may go below 1 (unscaling them could
            overflow), or under ``shard_map`` if the devices could disagree
            on skipping (``axis_name`` does not name a mapped axis over
            which the gradients differ).
        TypeError: in ``update``, at trace time, for gradients it cannot
            tell the scale of (see 0.).
        ValueError: in ``update``, if the gradients' tree structure is not
            the params'.

    Examples:
        >>> import jax, jax.numpy as jnp, optax
        >>> import lossscale
        >>> tx = lossscale.loss_scaled(
        ...     optax.sgd(1.0), lossscale.DynamicLossScale(2.0**10))
        >>> params = {"w": jnp.array([1.0, 2.0])}
        >>> state = tx.init(params)
        >>> loss_fn = lambda p: jnp.sum(p["w"] ** 2)
        >>> loss, grads = lossscale.value_and_grad(loss_fn, state)(params)
        >>> updates, state = tx.update(grads, state, params)
        >>> optax.apply_updates(params, updates)["w"]
        Array([-1., -2.], dtype=float32)

        Gradients scaled by hand say by which scale:

        >>> scale = lossscale.get_loss_scale(state)
        >>> grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
        >>> updates, state = tx.update(grads, state, params, scaled_by=scale)

    References:
        Micikevicius et al., `Mixed Precision Training
        <https://arxiv.org/abs/1710.03740>`_, 2017.
    """
    spec = _make_spec(
        inner,
        {_SINGLE: _check_loss_scale(loss_scale, "loss_scale")},
        None,
        axis_name=axis_name,
        mask=mask,
        on_min_scale=on_min_scale,
        min_scale_patience=min_scale_patience,
        report_nonfinite=report_nonfinite,
        report_grad_norm=report_grad_norm,
        require_scaled_by=require_scaled_by,
    )
    return _transformation(spec)


def loss_scaled_by_group(
    inner: optax.GradientTransformation,
    loss_scales: Mapping[Hashable, LossScale],
    param_labels: Any,
    *,
    axis_name: Hashable | tuple[Hashable, ...] | None = None,
    mask: _tree.MaskOrFn = None,
    on_min_scale: OnMinScale = "ignore",
    min_scale_patience: int = 10,
    report_nonfinite: bool = False,
    report_grad_norm: bool = False,
    require_scaled_by: bool = True,
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
            gradients (or a prefix of it), or a callable returning one, as
            in ``optax.multi_transform``. Every label must be a key of
            ``loss_scales``.
        axis_name: as in :func:`loss_scaled`; one all-reduce carries every
            group's flag.
        mask: as in :func:`loss_scaled`.
        on_min_scale: as in :func:`loss_scaled`; any group at its minimum
            counts.
        min_scale_patience: as in :func:`loss_scaled`.
        report_nonfinite: as in :func:`loss_scaled`.
        report_grad_norm: as in :func:`loss_scaled`: the norm of every
            group's unscaled gradients together.
        require_scaled_by: as in :func:`loss_scaled`. With one scale per
            group, pass ``scaled_by=lossscale.get_loss_scale(opt_state)``
            (the dict) to ``update``; gradients of
            :func:`lossscale.value_and_grad` must be marked with one of
            the groups' scales.

    Returns:
        A :class:`optax.GradientTransformationExtraArgs` whose state is a
        :class:`LossScaledState` with a dict of loss scales;
        :func:`get_loss_scale` returns that dict and :func:`metrics` reports
        ``"loss_scale/<label>"`` (and every other per-scale metric) for
        each group.

    Raises:
        TypeError: as in :func:`loss_scaled`, and if ``loss_scales`` is not
            a non-empty dict or ``param_labels`` is ``None``.
        ValueError: as in :func:`loss_scaled`, and if ``param_labels`` uses
            a label that is not a key of ``loss_scales``.

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
        >>> grads = jax.grad(loss_fn)(params)
        >>> updates, state = tx.update(grads, state, scaled_by=scales)
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
    spec = _make_spec(
        inner,
        groups,
        param_labels,
        axis_name=axis_name,
        mask=mask,
        on_min_scale=on_min_scale,
        min_scale_patience=min_scale_patience,
        report_nonfinite=report_nonfinite,
        report_grad_norm=report_grad_norm,
        require_scaled_by=require_scaled_by,
    )
    return _transformation(spec)


# --- validation of the static configuration ------------------------------


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


def _check_loss_scale(loss_scale: Any, name: str) -> LossScale:
    if isinstance(loss_scale, type):
        raise TypeError(
            f"{name} must be a loss-scale instance, got the class "
            f"{loss_scale.__name__}; did you mean {loss_scale.__name__}()?"
        )
    number = _as_number(loss_scale)
    if number is not None:
        raise TypeError(
            f"{name} must be a loss scale, not a number: got "
            f"{name}={loss_scale!r}. For a fixed scale pass "
            f"lossscale.StaticLossScale({number}); for one that backs off "
            f"on overflow and grows, lossscale.DynamicLossScale({number})."
        )
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            f"{name} must implement the lossscale.LossScale protocol "
            "(loss_scale, scale, unscale, adjust), e.g. "
            f"lossscale.DynamicLossScale(), got {name}={loss_scale!r} of "
            f"type {type(loss_scale).__name__}."
        )
    return loss_scale


def _as_number(value: Any) -> str | None:
    """A real scalar as it would be written in code (``2.0**15`` for a
    power of two), or ``None`` if ``value`` is not one."""
    if isinstance(value, bool | np.bool_) or not (
        isinstance(value, numbers.Real)
        or (
            isinstance(value, np.ndarray | np.generic | jax.Array)
            and np.ndim(value) == 0
            and jnp.issubdtype(jnp.result_type(value), jnp.number)
            and not _compat.is_tracer(value)
        )
    ):
        return None
    x = float(cast(Any, value))
    mantissa, exponent = math.frexp(x)
    if mantissa == 0.5 and abs(exponent - 1) > 6:
        return f"2.0**{exponent - 1}"
    return repr(x)


def _warn_narrow_params(spec: _Spec, params: Any) -> None:
    """Warns, naming the leaves, of float16 (or float8) parameters that
    this wrapper updates: an update below half a unit in the last place of
    a weight is rounded away when it is applied (float16 holds 11 bits: an
    update 2**-12 of the weight is lost), the underflow loss scaling is
    there to prevent, and Adam's ``eps`` (1e-8) is 0 in float16."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(params)
    mask = jax.tree.leaves(_tree.resolve_mask(spec.mask, params))
    narrow = [
        (jax.tree_util.keystr(path) or "<root>", jnp.result_type(leaf))
        for (path, leaf), trained in zip(with_paths, mask, strict=True)
        if trained
        and _tree.is_float(leaf)
        and jnp.issubdtype(jnp.result_type(leaf), jnp.floating)
        and _tree.narrower_range_than_float32(jnp.result_type(leaf))
    ]
    if not narrow:
        return
    named = ", ".join(f"{path} ({dtype})" for path, dtype in narrow[:3])
    if len(narrow) > 3:
        named += f" and {len(narrow) - 3} more"
    warnings.warn(
        f"lossscale.loss_scaled: 16-bit master weights, the parameters at "
        f"{named}. An update smaller than half a weight's resolution (2**-12 "
        "of it in float16) is rounded away when applied, which is the "
        "underflow loss scaling exists to prevent, and Adam's eps is 0 in "
        "float16. Keep the parameters in float32 and compute in 16 bits "
        "with lossscale.autocast(loss_fn, jnp.float16).",
        UserWarning,
        stacklevel=3,
    )


def _metrics_of(scale: Any) -> dict[str, jax.Array]:
    metrics: Callable[[], Mapping[str, jax.Array]] | None = getattr(
        scale, "metrics", None
    )
    return dict(metrics()) if callable(metrics) else {}


def _floor(scale: Any) -> float | None:
    """The lowest value ``scale`` can take, where that is known statically.

    A :class:`DynamicLossScale` (or any policy with a ``min_loss_scale``)
    never goes below that; a scale at its minimum from the start (a
    :class:`StaticLossScale`, whose ``at_min_scale`` is always true) stays
    at its value. Unknown (``None``) otherwise.
    """
    floor = getattr(scale, "min_loss_scale", None)
    if floor is not None:
        return float(floor)
    at_min = _metrics_of(scale).get("at_min_scale")
    value = scale.loss_scale
    if at_min is None or not (
        _checks.is_concrete(at_min) and _checks.is_concrete(value)
    ):
        return None
    return float(np.asarray(value)) if bool(at_min) else None


def _make_spec(
    inner: Any,
    groups: Groups,
    param_labels: Any,
    *,
    axis_name: Any,
    mask: Any,
    on_min_scale: Any,
    min_scale_patience: Any,
    report_nonfinite: Any,
    report_grad_norm: Any = False,
    require_scaled_by: Any = True,
) -> _Spec:
    if on_min_scale not in ("ignore", "error", "count"):
        raise ValueError(
            'on_min_scale must be "ignore", "error" or "count", got '
            f"on_min_scale={on_min_scale!r}."
        )
    if on_min_scale != "ignore":
        for label, scale in groups.items():
            if "at_min_scale" not in _metrics_of(scale):
                where = "loss_scale" if label == _SINGLE else label
                raise ValueError(
                    f"on_min_scale={on_min_scale!r} needs to know when the "
                    f"scale is at its minimum, but {where}={scale!r} has no "
                    "'at_min_scale' in its metrics(). Add it to your "
                    'policy\'s metrics(), or use on_min_scale="ignore" and '
                    "watch consecutive_skips in lossscale.metrics."
                )
    if not isinstance(report_nonfinite, bool | np.bool_):
        raise TypeError(
            "report_nonfinite must be a bool, got "
            f"report_nonfinite={report_nonfinite!r}."
        )
    if not isinstance(report_grad_norm, bool | np.bool_):
        raise TypeError(
            "report_grad_norm must be a bool, got "
            f"report_grad_norm={report_grad_norm!r}."
        )
    if not isinstance(require_scaled_by, bool | np.bool_):
        raise TypeError(
            "require_scaled_by must be a bool, got "
            f"require_scaled_by={require_scaled_by!r}."
        )
    return _Spec(
        inner=_check_inner(inner),
        initial=groups,
        param_labels=param_labels,
        floors={label: _floor(scale) for label, scale in groups.items()},
        axis_name=_checks.axis_name(axis_name),
        mask=_tree.check_mask(mask),
        on_min_scale=on_min_scale,
        min_scale_patience=_checks.positive_int(
            "min_scale_patience", min_scale_patience
        ),
        report_nonfinite=bool(report_nonfinite),
        skip_impl=_SKIP_IMPL.get(),
        report_grad_norm=bool(report_grad_norm),
        require_scaled_by=bool(require_scaled_by),
    )


# --- init and update ----------------------------------------------------


def _transformation(spec: _Spec) -> optax.GradientTransformationExtraArgs:
    def init_fn(params: optax.Params) -> LossScaledState:
        leaves = None
        like = gradients_like(params)
        if spec.mask is not None:
            _at_init("mask", spec.mask, like, _tree.resolve_mask)
        if spec.grouped:
            _at_init(
                "param_labels",
                spec.param_labels,
                like,
                lambda _, tree: _labels(spec, spec.initial, tree),
            )
        if spec.report_nonfinite:
            n = len(_tree.leaves_and_nones(like))
            leaves = jnp.zeros((n,), jnp.bool_)
        _warn_narrow_params(spec, like)
        counting = spec.on_min_scale != "ignore"
        return LossScaledState(
            loss_scale=_public(spec, spec.initial),
            inner_state=spec.inner.init(params),
            grads_finite=jnp.ones((), jnp.bool_),
            skipped_steps=jnp.zeros((), jnp.int32),
            consecutive_skips=jnp.zeros((), jnp.int32),
            steps=jnp.zeros((), jnp.int32),
            last_skip_step=jnp.full((), -1, jnp.int32),
            nonfinite=leaves,
            min_scale_skips=jnp.zeros((), jnp.int32) if counting else None,
            grad_norm=(
                jnp.zeros((), jnp.float32) if spec.report_grad_norm else None
            ),
            stale_scale_skips=jnp.zeros((), jnp.int32) if counting else None,
        )

    def update_fn(
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        *,
        scaled_by: Any = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, LossScaledState]:
        if not isinstance(state, LossScaledState):
            raise TypeError(
                "state must be the LossScaledState returned by this "
                f"transformation's init, got {type(state).__name__}."
            )
        with _gc_paused():
            return _update(spec, updates, state, params, scaled_by, extra_args)

    # optax.OptState is a tree of ArrayLike leaves, with no room for a None
    # leaf (an empty subtree to JAX), which LossScaledState.nonfinite is
    # without report_nonfinite: the functions meet optax's protocols at run
    # time, but not in optax's annotations.
    return optax.GradientTransformationExtraArgs(
        cast(optax.TransformInitFn, init_fn),
        cast(optax.TransformUpdateExtraArgsFn, update_fn),
    )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Defers Python's cyclic garbage collector while ``update`` traces.

    Tracing the inner update to a jaxpr and binding it again allocates many
    objects, and every few hundred of them the collector scans the heap,
    which inside a large train step is mostly the step's own trace. Measured
    on a 12-layer transformer step: the collector took 0.1 s of the 0.16 s
    that ``update`` added to tracing. The garbage is collected after, at the
    next collection. Nothing is deferred when the collector was already off.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _update(
    spec: _Spec,
    grads: optax.Updates,
    state: LossScaledState,
    params: optax.Params | None,
    scaled_by: Any,
    extra_args: dict[str, Any],
) -> tuple[optax.Updates, LossScaledState]:
    """One step: unscale, check, update or skip, adjust, count."""
    groups = _groups(spec, state.loss_scale)
    _check_structure(grads, params)
    plan = _plan(spec, groups, grads)
    _refuse_narrow_gradients(spec, plan)
    same_scale = _marks.same_scale(
        plan.leaves,
        [(plan.paths[i], i) for idx in plan.members.values() for i in idx],
        groups,
        scaled_by,
        axis_name=spec.axis_name,
        required=spec.require_scaled_by,
        sources=_sources(spec, state.loss_scale),
    )
    if spec.report_nonfinite:
        _check_report_size(state, plan)
    unscaled = _Unscaled(plan, groups)
    grad_norm = None
    if spec.report_grad_norm:
        grad_norm = _grad_norm(plan, unscaled, state.grad_norm)
    group_finite, nonfinite = _decide(spec, plan, unscaled)
    finite = jnp.all(group_finite)
    if same_scale is not None:
        finite = jnp.logical_and(finite, same_scale)
    if _compat.is_tracer(finite):
        # Unscale at this level of the trace: values first computed inside
        # the skip's own traces (a jaxpr, a conditional's branches) must not
        # leak out of them. Eagerly, only a step that is applied unscales.
        unscaled.all()
    updates, inner_state = _skip.apply_if_finite(
        finite,
        lambda: _inner_update(spec, plan, unscaled, state, params, extra_args),
        state.inner_state,
        impl=spec.skip_impl,
        like=grads,
    )
    new_groups = _adjust(groups, group_finite)
    if same_scale is not None:
        # Gradients scaled by another scale say nothing of this one's
        # overflow: the scale stays as it was.
        new_groups = _marks.keep_unless(same_scale, new_groups, groups)
    counters = _next_counters(state, finite)
    min_scale_skips = stale_scale_skips = None
    if spec.on_min_scale != "ignore":
        min_scale_skips, stale_scale_skips = _min_scale_alarm(
            groups,
            group_finite,
            same_scale,
            state,
            spec.min_scale_patience if spec.on_min_scale == "error" else None,
        )
    return updates, counters._replace(
        loss_scale=_public(spec, new_groups),
        inner_state=inner_state,
        nonfinite=nonfinite,
        min_scale_skips=min_scale_skips,
        grad_norm=grad_norm,
        stale_scale_skips=stale_scale_skips,
    )


def _sources(spec: _Spec, loss_scale: Any) -> dict[Hashable, Any]:
    """Each group's scale leaf as the state holds it, before any clamping:
    the leaf ``value_and_grad`` read, if it was given this state."""
    scales = dict(loss_scale) if spec.grouped else {_SINGLE: loss_scale}
    return {
        label: getattr(scale, "loss_scale", None)
        if isinstance(scale, _scales.StaticLossScale | _scales.DynamicLossScale)
        else None
        for label, scale in scales.items()
    }


def _check_structure(grads: Any, params: Any) -> None:
    """Refuses gradients shaped unlike the params (``None`` leaves match
    anything: equinox's gradients hold ``None`` for non-arrays)."""
    if params is None:
        return
    none_leaf = lambda x: x is None
    got = jax.tree.structure(grads, is_leaf=none_leaf)
    want = jax.tree.structure(gradients_like(params), is_leaf=none_leaf)
    if got != want:
        raise ValueError(
            "the gradients must have the tree structure of the params, got "
            f"gradients with structure {got} for params with structure "
            f"{want}."
        )


def _groups(spec: _Spec, loss_scale: Any) -> Groups:
    """The state's loss scale(s) as a dict of groups, each clamped into its
    configuration's range: a restored or hand-made state is never trusted,
    so the floor the check relies on holds for the scale actually used."""
    if spec.grouped:
        return {k: _scales.in_range(v) for k, v in dict(loss_scale).items()}
    return {_SINGLE: _scales.in_range(loss_scale)}


def _public(spec: _Spec, groups: Groups) -> Any:
    """The dict of groups as ``LossScaledState.loss_scale`` holds it."""
    return dict(groups) if spec.grouped else groups[_SINGLE]


def _labels(spec: _Spec, groups: Groups, tree: Any) -> Any:
    """A tree of group labels with the structure of ``tree``."""
    if not spec.grouped:
        return jax.tree.map(lambda _: _SINGLE, tree)
    labels = spec.param_labels
    labels = labels(tree) if callable(labels) else labels
    full = _tree.broadcast_prefix(labels, tree, "param_labels")
    unknown = {label for label in jax.tree.leaves(full) if label not in groups}
    if unknown:
        raise ValueError(
            f"param_labels uses labels {sorted(map(repr, unknown))} that are "
            f"not keys of loss_scales {sorted(map(repr, groups))}."
        )
    return full


class _Plan(NamedTuple):
    """Which gradient leaves each loss scale unscales and checks."""

    leaves: list[Any]  # the gradients, flattened
    treedef: Any
    paths: list[str]
    floats: list[int]  # indices of the floating leaves
    members: dict[Hashable, list[int]]  # group -> its unmasked floats
    floors: dict[Hashable, float | None]  # of the scales in the state
    # Where each leaf stands among the leaves and Nones of the gradients:
    # report_nonfinite's flags, one per leaf or None, line up with params.
    report_positions: list[int]
    report_size: int


def _plan(spec: _Spec, groups: Groups, grads: optax.Updates) -> _Plan:
    """Assigns each floating, unmasked gradient leaf to its group."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(grads)
    leaves = [leaf for _, leaf in with_paths]
    paths = [jax.tree_util.keystr(path) for path, _ in with_paths]
    labels = jax.tree.leaves(_labels(spec, groups, grads))
    mask = jax.tree.leaves(_tree.resolve_mask(spec.mask, grads))
    floats = [i for i, leaf in enumerate(leaves) if _tree.is_float(leaf)]
    members: dict[Hashable, list[int]] = {label: [] for label in groups}
    for i in floats:
        if mask[i]:
            members[labels[i]].append(i)
    # The floor of the scale in the state, where the trace shows it (a
    # dynamic scale's bound is static; a static scale's value is traced
    # under jit). Only the built-in scales clamp their leaves into their
    # configuration on use: a policy of your own may hold (restored, or set
    # by hand) a scale below the floor its attribute claims, so its check
    # reads the unscaled gradients; its floor still guides the refusal.
    floors = {
        label: _floor(scale) if _scales.clamps_on_use(scale) else None
        for label, scale in groups.items()
    }
    with_nones = _tree.leaves_and_nones(grads)
    positions = [j for j, leaf in enumerate(with_nones) if leaf is not None]
    return _Plan(
        leaves,
        treedef,
        paths,
        floats,
        members,
        floors,
        positions,
        len(with_nones),
    )


def _refuse_narrow_gradients(spec: _Spec, plan: _Plan) -> None:
    """Refuses float16 (or float8) gradients under a scale that may go
    below 1: unscaling a finite gradient could overflow, and backing off
    would make it worse, so every step would be skipped.

    Where the trace does not show the floor of the scale in use (a static
    scale under ``jit``), the scale given to ``loss_scaled`` is the guide.
    """
    for label, idx in plan.members.items():
        floor = plan.floors[label]
        floor = spec.floors[label] if floor is None else floor
        if floor is None or floor >= 1:
            continue
        for i in idx:
            dtype = jnp.result_type(plan.leaves[i])
            if _tree.narrower_range_than_float32(dtype):
                where = "loss_scale" if label == _SINGLE else repr(label)
                raise ValueError(
                    f"the gradient at {plan.paths[i] or '<root>'} is {dtype}, "
                    f"and the loss scale {where} can go down to {floor!r} < "
                    f"1: a finite {dtype} gradient divided by it can overflow "
                    f"{dtype}, and backing off would only make that worse. "
                    "Keep the scale >= 1 for such gradients (min_loss_scale="
                    "1.0, the default), or compute gradients in float32 "
                    "(float32 master weights)."
                )


class _Unscaled:
    """The gradients with each group unscaled, computed when first needed.

    One reciprocal per group. The inner update reads all of them; the check
    reads a group only when its scale can go below 1. A skipped eager step
    computes none, so no arithmetic touches its non-finite gradients.
    """

    def __init__(self, plan: _Plan, groups: Groups) -> None:
        self._plan = plan
        self._groups = groups
        self._done: dict[Hashable, list[Any]] = {}

    def group(self, label: Hashable) -> list[Any]:
        if label not in self._done:
            idx = self._plan.members[label]
            leaves = [self._plan.leaves[i] for i in idx]
            with _slips.quiet():  # not a hand-written unscale
                self._done[label] = (
                    list(self._groups[label].unscale(leaves)) if idx else []
                )
        return self._done[label]

    def all(self) -> list[Any]:
        """Every gradient leaf, unscaled where its group unscales it."""
        out = list(self._plan.leaves)
        for label, idx in self._plan.members.items():
            for i, leaf in zip(idx, self.group(label), strict=True):
                out[i] = leaf
        return out


def _checked_values(
    spec: _Spec, plan: _Plan, unscaled: _Unscaled, label: Hashable
) -> list[jax.Array]:
    """The values whose finiteness decides a group's step.

    A finite gradient divided by a scale >= 1 cannot overflow, so where the
    scale cannot go below 1 the scaled gradients are finite exactly when the
    unscaled ones are: they are checked as they arrive, and XLA need not
    fuse the unscale into the check. The floor is that of the scale in use:
    a built-in scale's leaves are clamped into its configuration first (a
    restored or hand-set scale below ``min_loss_scale`` is used as that
    minimum). Where the scale may go below 1 (or its floor is unknown: a
    static scale's value, traced under ``jit``, may be anything a checkpoint
    or a user put in the state; a policy of your own, whose leaves are not
    clamped) the unscaled ones are checked, after the scaled ones
    when called eagerly: scaled gradients already non-finite are never
    unscaled (``jax_debug_nans`` would stop at the multiply).
    """
    raw = [jnp.asarray(plan.leaves[i]) for i in plan.members[label]]
    floor = plan.floors[label]  # of the scale in use, not the initial one
    if floor is not None and floor >= 1:
        return raw
    eager = bool(raw) and not _compat.tracing()
    if eager and not bool(_finite.check([raw])[0][0]):
        return raw
    return [jnp.asarray(x) for x in unscaled.group(label)]


def _decide(
    spec: _Spec, plan: _Plan, unscaled: _Unscaled
) -> tuple[jax.Array, jax.Array | None]:
    """Per-group finiteness (and, if reporting, per-leaf non-finiteness)."""
    order = list(plan.members)
    group_finite, bad = _finite.check(
        [_checked_values(spec, plan, unscaled, label) for label in order],
        axis_name=spec.axis_name,
        per_leaf=spec.report_nonfinite,
    )
    if bad is None:
        return group_finite, None
    # One flag per leaf (or None) of the gradients, in tree order, so that
    # they line up with the params' leaves; only checked leaves can be True.
    checked = [plan.report_positions[i] for k in order for i in plan.members[k]]
    nonfinite = jnp.zeros((plan.report_size,), jnp.bool_)
    if checked:
        nonfinite = nonfinite.at[np.asarray(checked)].set(bad)
    return group_finite, nonfinite


def _grad_norm(plan: _Plan, unscaled: _Unscaled, previous: Any) -> jax.Array:
    """The global L2 norm of the unscaled gradients, in float32.

    Squared norms are summed over the mapped axes each leaf varies over,
    one ``psum`` per distinct set of axes; leaves that JAX sees as equal
    across an axis count once (see ``report_grad_norm``).
    """
    if previous is None:
        raise ValueError(
            "report_grad_norm=True needs a state made by this "
            "transformation's init (its grad_norm is None: a checkpoint "
            "saved without report_grad_norm=True?)."
        )
    by_axes: dict[frozenset[Any], list[jax.Array]] = {}
    for label in plan.members:
        for x in unscaled.group(label):
            x = jnp.asarray(x)
            if jnp.iscomplexobj(x):
                x = jnp.abs(x)
            sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
            by_axes.setdefault(_compat.vma(x), []).append(sq)
    total = jnp.zeros((), jnp.float32)
    for axes, squares in by_axes.items():
        part = functools.reduce(jnp.add, squares)
        if axes:
            part = lax.psum(part, tuple(sorted(axes, key=repr)))
        total = total + part
    return jnp.sqrt(total)


def _at_init(
    name: str, given: Any, like: Any, resolve: Callable[[Any, Any], Any]
) -> None:
    """Checks ``mask`` or ``param_labels`` against the params in ``init``,
    with an error that says it is the params (not the gradients) that do
    not fit."""
    try:
        resolve(given, like)
    except ValueError as err:
        if not str(err).startswith(f"{name} must have the structure"):
            raise
        tree = given(like) if callable(given) else given
        raise ValueError(
            f"{name} must have the structure of the gradients (or a prefix "
            "of it), which init reads from the params it is given (from "
            "their fast params for optax.lookahead's LookaheadParams): got "
            f"{name} structure {jax.tree.structure(tree)} for params with "
            f"structure {jax.tree.structure(like)}."
        ) from None


def gradients_like(params: Any) -> Any:
    """The tree whose structure ``init`` takes for the gradients'.

    The params, except where a wrapper's params are not shaped like its
    gradients: optax.lookahead's ``LookaheadParams`` hold the fast and the
    slow params, and the gradients are those of the fast ones.
    """
    if isinstance(params, optax.LookaheadParams):
        return params.fast
    return params


def _check_report_size(state: LossScaledState, plan: _Plan) -> None:
    size = None if state.nonfinite is None else jnp.shape(state.nonfinite)
    if size != (plan.report_size,):
        raise ValueError(
            "report_nonfinite=True records one flag per leaf (or None) of "
            f"the gradients: they have {plan.report_size}, but the state has "
            f"room for {size}. init sizes it from the params it is given "
            "(their fast params for optax.lookahead's LookaheadParams), so "
            "they must have the gradients' structure; or the state comes "
            "from a checkpoint of another transformation (built without "
            "report_nonfinite=True, or for other params)."
        )


def _inner_update(
    spec: _Spec,
    plan: _Plan,
    unscaled: _Unscaled,
    state: LossScaledState,
    params: optax.Params | None,
    extra_args: dict[str, Any],
) -> tuple[optax.Updates, optax.OptState]:
    grads = plan.treedef.unflatten(unscaled.all())
    try:
        return spec.inner.update(grads, state.inner_state, params, **extra_args)
    except (ValueError, TypeError) as err:
        err.add_note(
            "lossscale.loss_scaled: the inner optimizer's update failed. Do "
            "the gradients have the structure of the params given to init, "
            "and does the state come from this optimizer's init?"
        )
        raise


def _adjust(groups: Groups, group_finite: jax.Array) -> Groups:
    """Each group's next loss scale, from its own finiteness."""
    return {
        label: scale.adjust(group_finite[i])
        for i, (label, scale) in enumerate(groups.items())
    }


def _next_counters(
    state: LossScaledState, finite: jax.Array
) -> LossScaledState:
    """The wrapper's own counters after a step (finite or skipped)."""
    skipped = jnp.logical_not(finite)
    return state._replace(
        grads_finite=jnp.asarray(finite, jnp.bool_),
        skipped_steps=jnp.where(
            skipped,
            optax.safe_increment(state.skipped_steps),
            state.skipped_steps,
        ).astype(jnp.int32),
        consecutive_skips=jnp.where(
            skipped, optax.safe_increment(state.consecutive_skips), 0
        ).astype(jnp.int32),
        # safe_increment returns a jax.Array, but is annotated ArrayLike.
        steps=cast(jax.Array, optax.safe_increment(state.steps)).astype(
            jnp.int32
        ),
        last_skip_step=jnp.where(
            skipped, state.steps, state.last_skip_step
        ).astype(jnp.int32),
    )


def _min_scale_alarm(
    groups: Groups,
    group_finite: jax.Array,
    same_scale: Any,
    state: LossScaledState,
    patience: int | None,
) -> tuple[jax.Array, jax.Array]:
    """Counts skips at the minimum and skips on a stale scale; raises once
    either count reaches ``patience`` (never if ``patience`` is ``None``:
    ``on_min_scale="count"``).

    A skipped step counts as one at the minimum when a group whose
    gradients were not finite was already at its minimum scale when the
    step ran: lowering that scale no longer helps. It counts as stale when
    its gradients were scaled by another scale than the state's
    (``same_scale`` false): the scale is not adjusted by such a step, so
    nothing ends the skips but a change to the train step. Any other step
    resets the count. One conditional serves both.
    """
    if state.min_scale_skips is None or state.stale_scale_skips is None:
        missing = (
            "min_scale_skips"
            if state.min_scale_skips is None
            else "stale_scale_skips"
        )
        raise ValueError(
            'on_min_scale="error" (or "count") needs a state made by this '
            f"transformation's init (its {missing} is None: a checkpoint "
            'saved with on_min_scale="ignore", or by lossscale 0.2?).'
        )
    at_min = jnp.stack(
        [jnp.asarray(_metrics_of(s)["at_min_scale"]) for s in groups.values()]
    )
    hit = jnp.any(jnp.logical_not(group_finite) & at_min)
    count = jnp.where(hit, optax.safe_increment(state.min_scale_skips), 0)
    count = count.astype(jnp.int32)
    stale = jnp.zeros((), jnp.int32)
    if same_scale is not None:
        stale = jnp.where(
            same_scale, 0, optax.safe_increment(state.stale_scale_skips)
        ).astype(jnp.int32)
    if patience is None:
        return count, stale
    stuck = (count >= patience) | (stale >= patience)
    scales = jnp.stack([jnp.asarray(s.loss_scale) for s in groups.values()])
    if not _compat.is_tracer(stuck):
        _raise_stuck(stuck, count, stale, scales, patience)
    else:
        lax.cond(
            stuck,
            lambda: jax.debug.callback(
                functools.partial(_raise_stuck, patience=patience),
                stuck,
                count,
                stale,
                scales,
            ),
            lambda: None,
        )
    return count, stale


def _raise_stuck(
    stuck: jax.Array | np.ndarray,
    skips: jax.Array | np.ndarray,
    stale: jax.Array | np.ndarray,
    scales: jax.Array | np.ndarray,
    patience: int,
) -> None:
    if not stuck:
        return
    values = ", ".join(f"{float(s):g}" for s in scales)
    if int(stale) >= patience:
        raise FloatingPointError(
            f"lossscale: {int(stale)} consecutive steps were skipped because "
            "their gradients were scaled by another loss scale than the "
            f"state's ({values}): lossscale.value_and_grad was given another "
            "opt_state than tx.update (an earlier one, or another "
            "optimizer's), or scaled_by is not the scale the loss was "
            "multiplied by. Such a skip leaves the scale as it is, so they "
            "never end. Give value_and_grad the opt_state the step passes "
            "to tx.update."
        )
    raise FloatingPointError(
        f"lossscale: {int(skips)} consecutive steps had non-finite "
        f"gradients with the loss scale at its minimum ({values}). Lowering "
        "the scale no longer helps: the loss or the gradients themselves "
        "are inf or NaN. Check the inputs and labels for NaN/inf, the "
        "learning rate and any division or log in the loss; or lower "
        "min_loss_scale if the gradients are genuinely that large."
    )
