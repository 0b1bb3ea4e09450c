"""Loss-scale states: no-op, static and dynamic.

Each state is an immutable pytree. Values that change while training (the
scale, the counters) are leaves with pinned dtypes (float32, int32); the
configuration is static pytree metadata, so it survives ``jax.jit``,
``jax.tree.map``, flatten/unflatten and checkpoint restore unchanged and is
never traced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import (
    TYPE_CHECKING,
    Any,
    ParamSpec,
    Protocol,
    TypeVar,
    cast,
    runtime_checkable,
)

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale import _checks, _slips, _tree

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
S = TypeVar("S", bound="LossScale")
D = TypeVar("D", bound="DataclassInstance")

_MARK = "lossscale_static"


def _static(**kwargs: Any) -> Any:
    return dataclasses.field(metadata={_MARK: True}, **kwargs)


def _register(cls: type[T]) -> type[T]:
    """Registers a frozen dataclass as a pytree with keyed leaves.

    Fields marked with :func:`_static` are treedef metadata; every other
    field is a leaf. Unflattening bypasses ``__init__`` (and therefore its
    validation), because leaves are not always arrays: ``jax.tree.map``,
    ``vmap`` and ``eval_shape`` rebuild states out of tracers, shape structs
    or ``None``.
    """
    # A dataclass: _register is applied on top of @dataclasses.dataclass.
    # pyright does not see the fields that decorator synthesizes while it
    # evaluates the next one, hence the cast.
    fields = dataclasses.fields(cast("type[DataclassInstance]", cls))
    data = tuple(f.name for f in fields if not f.metadata.get(_MARK))
    meta = tuple(f.name for f in fields if f.metadata.get(_MARK))
    keys = tuple(jax.tree_util.GetAttrKey(name) for name in data)

    def flatten_with_keys(
        obj: T,
    ) -> tuple[tuple[tuple[Any, Any], ...], tuple[Any, ...]]:
        children = tuple(
            (k, getattr(obj, n)) for k, n in zip(keys, data, strict=True)
        )
        return children, tuple(getattr(obj, n) for n in meta)

    def flatten(obj: T) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        return (
            tuple(getattr(obj, n) for n in data),
            tuple(getattr(obj, n) for n in meta),
        )

    def unflatten(aux: tuple[Any, ...], children: Iterable[Any]) -> T:
        obj = object.__new__(cls)
        for name, value in zip(data, children, strict=True):
            object.__setattr__(obj, name, value)
        for name, value in zip(meta, aux, strict=True):
            object.__setattr__(obj, name, value)
        return obj

    jax.tree_util.register_pytree_with_keys(
        cls, flatten_with_keys, unflatten, flatten
    )
    cls._data_fields = data  # type: ignore[attr-defined]
    cls._static_fields = meta  # type: ignore[attr-defined]
    return cls


def _replace(obj: D, **changes: Any) -> D:
    """A copy of ``obj`` with some fields changed, without re-validation."""
    new = object.__new__(type(obj))
    for field in dataclasses.fields(obj):
        value = changes.pop(field.name, getattr(obj, field.name))
        object.__setattr__(new, field.name, value)
    if changes:
        raise TypeError(f"unknown fields {sorted(changes)}")
    return new


def _clamp(
    scale: jax.Array, low: float, high: float, nan: float | None = None
) -> jax.Array:
    """``scale`` clipped to ``[low, high]`` in float32; NaN becomes ``nan``
    (default ``low``), so that no traced value makes a scale NaN."""
    scale = jnp.asarray(scale, jnp.float32)
    clipped = jnp.clip(scale, np.float32(low), np.float32(high))
    fill = np.float32(low if nan is None else nan)
    return jnp.where(jnp.isnan(scale), fill, clipped).astype(jnp.float32)


def _host_in_range(x: Any, low: float, high: float) -> bool:
    """Whether ``x`` is a host (numpy) value known to lie in ``[low, high]``.

    A fresh state's leaves are numpy values: they are returned as they are,
    without a device round-trip or a change of type.
    """
    if not isinstance(x, np.ndarray | np.generic | float | int):
        return False
    value = np.asarray(x)  # any shape: vmap-ped ensembles have a batch axis
    with np.errstate(invalid="ignore"):
        return bool(np.all((value >= low) & (value <= high)))  # NaN: False


def _scale_in_range(
    scale: Any, low: float, high: float, nan: float | None = None
) -> Any:
    """The scale leaf, clamped into ``[low, high]`` (NaN becomes ``nan``).

    A state's leaves can disagree with its static configuration: restored
    from a checkpoint of another configuration (the checkpoint holds the
    leaves, the configuration comes from the target) or set by hand. They
    are never trusted: every use clamps them.
    """
    if _host_in_range(scale, low, high):
        return scale
    return _clamp(scale, low, high, nan)


def _counter_in_range(counter: Any, low: int, high: int) -> Any:
    """An int32 counter leaf clamped into ``[low, high]``."""
    if _host_in_range(counter, low, high):
        return counter
    counter = jnp.asarray(counter, jnp.int32)
    return jnp.clip(counter, np.int32(low), np.int32(high)).astype(jnp.int32)


def in_range(scale: Any) -> Any:
    """``scale`` with its leaves clamped into what its configuration allows.

    For the built-in scales; any other policy is returned unchanged (its
    leaves are its own to keep in range).
    """
    reconcile = getattr(scale, "_in_range", None)
    return reconcile() if callable(reconcile) else scale


def clamps_on_use(scale: Any) -> bool:
    """Whether ``scale`` is a built-in loss scale, whose leaves every use
    clamps into its configuration (a policy of your own may not)."""
    return isinstance(scale, NoOpLossScale | StaticLossScale | DynamicLossScale)


# A float32 significand (24 bits) and a float64 one (53 bits) are multiplied
# exactly in base-2**12 limbs of uint32: each partial product is below
# 2**24, so no uint32 operation overflows.
_LIMB = 12
_LIMB_MASK = (1 << _LIMB) - 1


def _u32(x: int) -> np.uint32:
    return np.uint32(x)


def _bit(limbs: list[jax.Array], i: int) -> jax.Array:
    return (limbs[i // _LIMB] >> _u32(i % _LIMB)) & _u32(1)


def _any_below(limbs: list[jax.Array], i: int) -> jax.Array:
    """Whether any of the bits ``[0, i)`` is set, as a uint32 0 or 1."""
    acc = jnp.zeros((), jnp.uint32)
    for j in range(i // _LIMB):
        acc = acc | limbs[j]
    if i % _LIMB:
        acc = acc | (limbs[i // _LIMB] & _u32((1 << (i % _LIMB)) - 1))
    return (acc != 0).astype(jnp.uint32)


def _round_half_even(limbs: list[jax.Array], d: int) -> list[jax.Array]:
    """The number rounded to a multiple of ``2**d``, ties to even."""
    up = _bit(limbs, d - 1) & (_any_below(limbs, d - 1) | _bit(limbs, d))
    out = list(limbs)
    for j in range(d // _LIMB):
        out[j] = jnp.zeros((), jnp.uint32)
    k = d // _LIMB
    out[k] = out[k] & _u32(_LIMB_MASK & ~((1 << (d % _LIMB)) - 1))
    carry = up << _u32(d % _LIMB)
    for j in range(k, len(out)):
        total = out[j] + carry
        out[j] = total & _u32(_LIMB_MASK)
        carry = total >> _u32(_LIMB)
    return [*out, carry]


def _extract(limbs: list[jax.Array], lo: int, n: int) -> jax.Array:
    """Bits ``[lo, lo + n)`` as a uint32 (``n <= 31``)."""
    acc = jnp.zeros((), jnp.uint32)
    for j, limb in enumerate(limbs):
        offset = j * _LIMB - lo
        if offset >= n or offset + _LIMB <= 0:
            continue
        # Bits shifted past the window wrap away in uint32 or are masked.
        part = limb << _u32(offset) if offset >= 0 else limb >> _u32(-offset)
        acc = acc | part
    return acc & _u32((1 << n) - 1)


def _times(scale: jax.Array, factor: float) -> jax.Array:
    """``scale * factor`` rounded as ``torch.amp.GradScaler`` rounds it.

    PyTorch's ``_amp_update_scale_`` kernels (CPU and CUDA) multiply the
    float32 scale by the factor as a C++ ``double`` and store the result in
    float32: ``float(double(scale) * factor)``, two roundings (to 53 bits,
    then to 24). A factor that float32 holds exactly leaves a product of at
    most 48 bits, which the double holds exactly, so the float32 multiply
    (correctly rounded) gives the same. Any other factor (0.9, say) is
    multiplied here exactly in integer limbs and rounded twice, as the
    double arithmetic does, with no float64 in the traced program.

    ``scale`` must be a positive normal float32 (the callers clamp it); a
    product below ``2**-126`` comes out as 0 and one above float32's range
    as inf, for the clamp that follows.
    """
    factor32 = np.float32(factor)
    if float(factor32) == factor:
        return scale * factor32
    mantissa, exponent = math.frexp(factor)  # factor = mantissa * 2**exponent
    mant_f = int(mantissa * 2**53)  # exactly: a double has 53 bits
    exp_f = exponent - 53
    bits = lax.bitcast_convert_type(scale.astype(jnp.float32), jnp.uint32)
    biased = (bits >> _u32(23)) & _u32(0xFF)
    mant_s = (bits & _u32(0x7FFFFF)) | _u32(0x800000)
    s_limbs = [mant_s & _u32(_LIMB_MASK), mant_s >> _u32(_LIMB)]
    f_limbs = [(mant_f >> (_LIMB * j)) & _LIMB_MASK for j in range(5)]
    columns: list[Any] = [jnp.zeros((), jnp.uint32) for _ in range(7)]
    for i, s_limb in enumerate(s_limbs):
        for j, f_limb in enumerate(f_limbs):
            if f_limb:
                columns[i + j] = columns[i + j] + s_limb * _u32(f_limb)
    limbs, carry = [], jnp.zeros((), jnp.uint32)
    for column in columns:
        total = column + carry
        limbs.append(total & _u32(_LIMB_MASK))
        carry = total >> _u32(_LIMB)
    # The product has 76 or 77 bits (2**75 <= mant_s * mant_f < 2**77).
    results = []
    for length in (77, 76):
        as_double = _round_half_even(limbs, length - 53)
        as_float = _round_half_even(as_double, length - 24)
        q = _extract(as_float, length - 24, 25)
        overflowed = q >> _u32(24)  # rounding carried into a new bit
        q = jnp.where(overflowed == 1, q >> _u32(1), q)
        shift = (length - 24) + overflowed.astype(jnp.int32)
        results.append((q, shift))
    long = _bit(limbs, 76) == 1
    q = jnp.where(long, results[0][0], results[1][0])
    shift = jnp.where(long, results[0][1], results[1][1])
    # value = q * 2**(shift + exp_f) * 2**(biased - 150), q in [2**23, 2**24)
    out_biased = biased.astype(jnp.int32) + shift + np.int32(exp_f)
    out_bits = (out_biased.astype(jnp.uint32) << _u32(23)) | (
        q & _u32(0x7FFFFF)
    )
    out = lax.bitcast_convert_type(out_bits, jnp.float32)
    out = jnp.where(out_biased < 1, np.float32(0.0), out)
    return jnp.where(out_biased > 254, np.float32(np.inf), out)


def _scale_leaf(x: Any, scale: jax.Array) -> Any:
    if not _tree.is_float(x):
        return x
    x = jnp.asarray(x)
    dtype = _tree.compute_dtype(x.dtype)
    return x.astype(dtype) * jnp.asarray(scale).astype(dtype)


def _scale_tree(tree: T, loss_scale: Any) -> T:
    _slips.refuse_double_scaling()
    return jax.tree.map(lambda x: _scale_leaf(x, loss_scale), tree)


def _unscale_tree(tree: T, loss_scale: Any) -> T:
    inv_scale = jnp.reciprocal(jnp.asarray(loss_scale, jnp.float32))
    out = jax.tree.map(lambda x: _tree.multiply_keep_dtype(x, inv_scale), tree)
    _slips.note_unscaled(out)  # for tx.update's refusal, if they reach it
    return out


# Keyword arguments of jmp, flax, PyTorch and Keras, and lossscale's names.
_OTHER_NAMES = {
    "period": "growth_interval (jmp's period)",
    "factor": (
        "growth_factor and backoff_factor (jmp's factor is both: "
        "growth_factor=factor, backoff_factor=1 / factor)"
    ),
    "counter": "growth_tracker (jmp's counter)",
    "minimum_scale": "min_loss_scale (flax's minimum_scale)",
    "scale": "loss_scale, the first argument (flax's scale)",
    "fin_steps": "growth_tracker (flax's fin_steps)",
    "init_scale": "loss_scale, the first argument (PyTorch's init_scale)",
    "initial_scale": "loss_scale, the first argument (Keras's initial_scale)",
    "dynamic_growth_steps": "growth_interval (Keras's dynamic_growth_steps)",
    "enabled": "none: use NoOpLossScale() for PyTorch's enabled=False",
}

P = ParamSpec("P")
R = TypeVar("R")


def _name_other_libraries(init: Callable[P, R]) -> Callable[P, R]:
    """Refuses another library's keyword with a ``TypeError`` naming the
    argument lossscale calls it (Python's own error names neither)."""

    @functools.wraps(init)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for name in kwargs:
            if name in _OTHER_NAMES:
                raise TypeError(
                    f"DynamicLossScale has no argument {name!r}: its name "
                    f"here is {_OTHER_NAMES[name]}."
                )
        return init(*args, **kwargs)

    return checked


@runtime_checkable
class LossScale(Protocol):
    """The loss-scale protocol that :func:`lossscale.loss_scaled` accepts.

    Any immutable pytree with these members is a loss scale: the built-in
    :class:`NoOpLossScale`, :class:`StaticLossScale` and
    :class:`DynamicLossScale`, or a policy of your own. Values that change
    from step to step must be pytree leaves with fixed dtypes; configuration
    should be static metadata. A ``metrics()`` method returning a dict of
    scalar arrays is optional and, when present, is merged into
    :func:`lossscale.metrics`.
    """

    @property
    def loss_scale(self) -> jax.Array:
        """The current scale, a float32 scalar."""
        ...

    def scale(self, tree: T) -> T:
        """Multiplies the floating leaves of ``tree`` by the scale."""
        ...

    def unscale(self, tree: T) -> T:
        """Divides the floating leaves of ``tree`` by the scale."""
        ...

    def adjust(self: S, grads_finite: jax.typing.ArrayLike) -> S:
        """The state for the next step, given this step's finiteness."""
        ...


@_register
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale:
    """A loss scale that does nothing: the scale is 1 and never changes.

    ``scale`` and ``unscale`` return their argument itself (no copy, no
    cast), so a train step written for loss scaling runs unchanged, and at
    no cost, in float32 or bfloat16. Wrapped in :func:`loss_scaled` it still
    skips non-finite steps.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> ls = lossscale.NoOpLossScale()
        >>> ls.loss_scale
        Array(1., dtype=float32)
        >>> ls.scale(jnp.float32(3.0))
        Array(3., dtype=float32)
    """

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> NoOpLossScale:
        _checks.scalar_bool("grads_finite", grads_finite)
        return self

    def metrics(self) -> dict[str, jax.Array]:
        """``{"at_min_scale": True}``: this scale can never go lower."""
        return {"at_min_scale": jnp.ones((), jnp.bool_)}


@_register
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class StaticLossScale:
    """A fixed loss scale.

    The scale is a float32 pytree leaf, not static configuration: a jitted
    step that takes the state as an argument is traced once, whatever value
    the scale has (jmp's ``StaticLossScale`` retraces for every value).

    Args:
        loss_scale: the scale, a number in ``[2**-126, 2**126]`` (stored
            as float32), so that it and its reciprocal are normal float32
            numbers. A power of two makes unscaling exact. A traced value
            (a scale built inside ``jit``) cannot be checked: it is clamped
            into that range, and NaN becomes 1. So is a leaf that never
            went through this check (restored from a checkpoint, set by
            hand): every use clamps it.

    Raises:
        TypeError: if ``loss_scale`` is not a real number.
        ValueError: if it is not a scalar in that range.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> ls = lossscale.StaticLossScale(2.0**10)
        >>> ls.scale(jnp.float16(2.0))  # scaled in float32
        Array(2048., dtype=float32)
        >>> ls.unscale(jnp.array([2048.0], jnp.float16))  # dtype kept
        Array([2.], dtype=float16)
    """

    loss_scale: jax.Array

    def __init__(self, loss_scale: jax.typing.ArrayLike) -> None:
        value = _checks.scale_value("loss_scale", loss_scale)
        if not _checks.is_concrete(value):
            value = _clamp(value, _checks.MIN_SCALE, _checks.MAX_SCALE, 1.0)
        object.__setattr__(self, "loss_scale", value)

    def _in_range(self) -> StaticLossScale:
        # A leaf set by hand or restored (never validated) is clamped into
        # the range __init__ enforces, NaN to 1.
        scale = _scale_in_range(
            self.loss_scale, _checks.MIN_SCALE, _checks.MAX_SCALE, 1.0
        )
        return (
            self
            if scale is self.loss_scale
            else _replace(self, loss_scale=scale)
        )

    def scale(self, tree: T) -> T:
        return _scale_tree(tree, self._in_range().loss_scale)

    def unscale(self, tree: T) -> T:
        return _unscale_tree(tree, self._in_range().loss_scale)

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> StaticLossScale:
        _checks.scalar_bool("grads_finite", grads_finite)
        return self._in_range()

    def metrics(self) -> dict[str, jax.Array]:
        """``{"at_min_scale": True}``: this scale can never go lower."""
        return {"at_min_scale": jnp.ones((), jnp.bool_)}


@_register
@dataclasses.dataclass(frozen=True, eq=False, init=False)
class DynamicLossScale:
    r"""A loss scale that backs off on overflow and grows after clean runs.

    With ``hysteresis=1`` this is PyTorch's ``torch.amp.GradScaler``; with
    ``hysteresis=h > 1`` it is Megatron-LM's ``DynamicGradScaler``. Given the
    finiteness of a step's gradients, :meth:`adjust` does exactly::

        if finite:
            growth_tracker += 1
            if growth_tracker == growth_interval:   # steps N, 2N, 3N, ...
                scale *= growth_factor
                growth_tracker = 0
                hysteresis_tracker = hysteresis
        else:
            growth_tracker = 0
            hysteresis_tracker = max(hysteresis_tracker - 1, 0)
            if hysteresis_tracker == 0:
                scale *= backoff_factor
        scale = clip(scale, min_loss_scale, max_loss_scale)  # NaN -> min

    So with interval 2 and only finite steps the scale grows on steps 2, 4,
    6, ...; with ``hysteresis=2`` the first overflow after a growth (or
    after the start) leaves the scale alone and every further overflow
    backs it off, until the next growth refills the tracker. Overflowing
    steps are skipped by :func:`lossscale.loss_scaled` whatever the
    hysteresis. The scale always stays in ``[min_loss_scale,
    max_loss_scale]``, which lies in ``[2**-126, 2**126]``: it and its
    reciprocal are normal float32 numbers, never 0, inf or NaN, whatever
    the inputs (a NaN scale, from a traced initial value or a corrupted
    checkpoint, becomes ``min_loss_scale``). With a power-of-two initial
    scale, factors and bounds, every scale is a power of two, so unscaling
    is exact. The configuration reads back exactly as given
    (``backoff_factor=0.8`` stays ``0.8``), and each factor is applied as
    ``torch.amp.GradScaler`` applies it: ``float32(float64(scale) *
    factor)``, bit for bit, computed without float64.

    A state whose leaves disagree with its configuration (restored from a
    checkpoint saved under another configuration: the checkpoint holds the
    leaves, the configuration comes from the target; or set by hand) is
    never trusted: every use (``scale``, ``unscale``, ``adjust``,
    ``metrics``, :func:`lossscale.loss_scaled`'s update,
    :func:`lossscale.get_loss_scale`) clamps the scale into
    ``[min_loss_scale, max_loss_scale]`` (NaN to the minimum),
    ``growth_tracker`` into ``[0, growth_interval - 1]`` and
    ``hysteresis_tracker`` into ``[0, hysteresis]``, which is what this
    configuration can reach. :func:`lossscale.compare_config` lists such
    disagreements.

    Leaves (float32/int32 scalars): ``loss_scale``, ``growth_tracker``
    (consecutive finite steps since the last growth or overflow) and
    ``hysteresis_tracker`` (overflows still tolerated). Static: every
    keyword argument below.

    Args:
        loss_scale: the initial scale, in ``[min_loss_scale,
            max_loss_scale]``. Default ``2**16``, PyTorch's. A traced value
            is clamped into the bounds instead of checked.
        growth_interval: consecutive finite steps before the scale grows.
        growth_factor: the factor applied on growth, > 1 (and finite in
            float32).
        backoff_factor: the factor applied on overflow, in (0, 1) (also
            once rounded to float32).
        min_loss_scale: the floor, in ``[2**-126, 2**126]``. Default 1, as
            in jmp and Megatron-LM. Below 1, float16 gradients can overflow
            when they are unscaled: :func:`lossscale.loss_scaled` refuses
            that combination.
        max_loss_scale: the ceiling, in ``[2**-126, 2**126]``. Default
            ``2**24``, as in Apex: beyond it float16 gradients of typical
            models overflow on every step anyway.
        hysteresis: overflows tolerated before the first backoff, as in
            Megatron-LM (which defaults to 2). Default 1: back off on every
            overflow.
        growth_tracker: the initial count of finite steps, in ``[0,
            growth_interval - 1]``. Default 0. With ``hysteresis_tracker``,
            it rebuilds a state by hand (and makes
            ``dataclasses.replace`` work, validated like any other
            argument). A traced value is clamped instead of checked.
        hysteresis_tracker: the initial count of overflows still
            tolerated, in ``[0, hysteresis]``. Default ``hysteresis``.

    The integer arguments take any concrete integer scalar (a Python int,
    a numpy integer, a 0-d integer array of numpy or JAX), the factors and
    bounds any concrete real scalar; booleans and traced values are
    refused.

    Raises:
        TypeError: if an argument has the wrong type (e.g. a float
            ``growth_interval``), or is named as jmp, flax, PyTorch or
            Keras name it (``period``, ``factor``, ``minimum_scale``,
            ``init_scale``, ...): the message gives lossscale's name.
        ValueError: if a value is out of range, ``min_loss_scale >
            max_loss_scale`` or the initial scale is outside them.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> ls = lossscale.DynamicLossScale(2.0**15, growth_interval=2)
        >>> ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
        >>> ls.loss_scale
        Array(65536., dtype=float32)
        >>> ls.adjust(jnp.bool_(False)).loss_scale
        Array(32768., dtype=float32)

    References:
        Micikevicius et al., `Mixed Precision Training
        <https://arxiv.org/abs/1710.03740>`_, 2017.
    """

    loss_scale: jax.Array
    growth_tracker: jax.Array
    hysteresis_tracker: jax.Array
    growth_interval: int = _static()
    growth_factor: float = _static()
    backoff_factor: float = _static()
    min_loss_scale: float = _static()
    max_loss_scale: float = _static()
    hysteresis: int = _static()

    @_name_other_libraries
    def __init__(
        self,
        loss_scale: jax.typing.ArrayLike = 2.0**16,
        *,
        growth_interval: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_loss_scale: float = 1.0,
        max_loss_scale: float = 2.0**24,
        hysteresis: int = 1,
        growth_tracker: jax.typing.ArrayLike = 0,
        hysteresis_tracker: jax.typing.ArrayLike | None = None,
    ) -> None:
        growth_interval = _checks.positive_int(
            "growth_interval", growth_interval
        )
        hysteresis = _checks.positive_int("hysteresis", hysteresis)
        growth_factor = _checks.open_interval(
            "growth_factor", growth_factor, low=1.0, high=np.inf
        )
        backoff_factor = _checks.open_interval(
            "backoff_factor", backoff_factor, low=0.0, high=1.0
        )
        min_loss_scale = _checks.scale_bound("min_loss_scale", min_loss_scale)
        max_loss_scale = _checks.scale_bound("max_loss_scale", max_loss_scale)
        if min_loss_scale > max_loss_scale:
            raise ValueError(
                "min_loss_scale must be <= max_loss_scale, got "
                f"min_loss_scale={min_loss_scale!r} > "
                f"max_loss_scale={max_loss_scale!r}."
            )
        scale = _checks.scale_value("loss_scale", loss_scale)
        if not _checks.is_concrete(scale):
            scale = _clamp(scale, min_loss_scale, max_loss_scale)
        elif not min_loss_scale <= float(scale) <= max_loss_scale:
            raise ValueError(
                "loss_scale must be in [min_loss_scale, max_loss_scale] = "
                f"[{min_loss_scale!r}, {max_loss_scale!r}], got "
                f"loss_scale={loss_scale!r}."
            )
        if hysteresis_tracker is None:
            hysteresis_tracker = hysteresis
        growth = _checks.counter(
            "growth_tracker", growth_tracker, growth_interval - 1
        )
        hyst = _checks.counter(
            "hysteresis_tracker", hysteresis_tracker, hysteresis
        )
        if not _checks.is_concrete(growth):
            growth = _counter_in_range(growth, 0, growth_interval - 1)
        if not _checks.is_concrete(hyst):
            hyst = _counter_in_range(hyst, 0, hysteresis)
        set_ = object.__setattr__
        set_(self, "loss_scale", scale)
        set_(self, "growth_tracker", growth)
        set_(self, "hysteresis_tracker", hyst)
        set_(self, "growth_interval", growth_interval)
        set_(self, "growth_factor", growth_factor)
        set_(self, "backoff_factor", backoff_factor)
        set_(self, "min_loss_scale", min_loss_scale)
        set_(self, "max_loss_scale", max_loss_scale)
        set_(self, "hysteresis", hysteresis)

    def _in_range(self) -> DynamicLossScale:
        """This state with every leaf clamped into what the configuration
        allows: the scale into ``[min_loss_scale, max_loss_scale]`` (NaN to
        the minimum), ``growth_tracker`` into ``[0, growth_interval - 1]``,
        ``hysteresis_tracker`` into ``[0, hysteresis]``."""
        scale = _scale_in_range(
            self.loss_scale, self.min_loss_scale, self.max_loss_scale
        )
        growth = _counter_in_range(
            self.growth_tracker, 0, self.growth_interval - 1
        )
        hyst = _counter_in_range(self.hysteresis_tracker, 0, self.hysteresis)
        if (
            scale is self.loss_scale
            and growth is self.growth_tracker
            and hyst is self.hysteresis_tracker
        ):
            return self
        return _replace(
            self,
            loss_scale=scale,
            growth_tracker=growth,
            hysteresis_tracker=hyst,
        )

    def scale(self, tree: T) -> T:
        return _scale_tree(tree, self._in_range().loss_scale)

    def unscale(self, tree: T) -> T:
        return _unscale_tree(tree, self._in_range().loss_scale)

    def adjust(self, grads_finite: jax.typing.ArrayLike) -> DynamicLossScale:
        finite = _checks.scalar_bool("grads_finite", grads_finite)
        current = self._in_range()
        scale = jnp.asarray(current.loss_scale, jnp.float32)
        growth = jnp.asarray(current.growth_tracker, jnp.int32) + 1
        hyst = jnp.asarray(current.hysteresis_tracker, jnp.int32)

        grow = finite & (growth >= self.growth_interval)
        hyst_after_overflow = jnp.maximum(hyst - 1, 0)
        backoff = ~finite & (hyst_after_overflow == 0)
        new_scale = jnp.where(
            grow,
            _times(scale, self.growth_factor),
            jnp.where(backoff, _times(scale, self.backoff_factor), scale),
        )
        new_scale = _clamp(new_scale, self.min_loss_scale, self.max_loss_scale)
        new_growth = jnp.where(finite & ~grow, growth, 0)
        new_hyst = jnp.where(
            grow,
            self.hysteresis,
            jnp.where(finite, hyst, hyst_after_overflow),
        )
        return _replace(
            self,
            loss_scale=new_scale.astype(jnp.float32),
            growth_tracker=new_growth.astype(jnp.int32),
            hysteresis_tracker=new_hyst.astype(jnp.int32),
        )

    def metrics(self) -> dict[str, jax.Array]:
        current = self._in_range()
        return {
            "growth_tracker": jnp.asarray(current.growth_tracker, jnp.int32),
            "hysteresis_tracker": jnp.asarray(
                current.hysteresis_tracker, jnp.int32
            ),
            "at_min_scale": jnp.asarray(current.loss_scale, jnp.float32)
            <= self.min_loss_scale,
        }
