"""The finiteness check: one flag per group of leaves, agreed across devices."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale import _checks, _compat, _tree

AxisName = Hashable | tuple[Hashable, ...] | None


def leaf_finite(x: jax.Array) -> jax.Array:
    """Whether every element of one floating leaf is finite.

    A plain reduction of ``isfinite``: it works on any sharding (a local
    reduction plus a scalar all-reduce where the leaf is split), and it is
    exact, with no overflow of its own. GPUs and TPUs fuse it into one
    pass; see :func:`_cpu_flags` for the CPU.
    """
    return jnp.all(jnp.isfinite(x))


# On CPU XLA rewrites a reduction over a whole leaf into a windowed
# pre-reduction whose input it materialises: `jnp.all(jnp.isfinite(x))`
# writes a byte per element of every gradient and reads it back (a
# quarter of the gradients' size in temporaries, and a slower step). It
# leaves variadic reductions (several operands, one result each) alone,
# and those fuse the `isfinite` into one pass. So on CPU, leaves of one
# shape and sharding are checked by one variadic reduction: up to _OPERANDS
# large leaves at a time (measured on 20M parameters: 4 read fastest, 1.4
# ms; 16 took 2.3 ms, the plain reduction 3.2 ms), up to _OPERANDS_SMALL
# small ones (whose time is negligible, but whose kernels each cost
# compile time). A leaf alone reduces `isfinite` and `isnan` together:
# XLA would merge two copies of one operand back into a plain reduction.
_OPERANDS = 4
_OPERANDS_SMALL = 16
_SMALL = 4096  # elements


def _and_each(
    a: Sequence[jax.Array], b: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
    return tuple(x & y for x, y in zip(a, b, strict=True))


def _alone(x: jax.Array) -> jax.Array:
    finite, nan = lax.reduce(
        [jnp.isfinite(x), jnp.isnan(x)],
        [np.bool_(True), np.bool_(False)],
        lambda a, b: (a[0] & b[0], a[1] | b[1]),
        tuple(range(x.ndim)),
    )
    return finite & ~nan  # both results used, so neither is dropped


def _together(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    out = lax.reduce(
        [jnp.isfinite(x) for x in leaves],
        [np.bool_(True)] * len(leaves),
        _and_each,
        tuple(range(leaves[0].ndim)),
    )
    return list(out)


def _cpu_flags(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """One finiteness flag per leaf, by variadic reductions; see above.

    Only leaves whose type shows that each device holds them whole (under
    explicit mesh axes, inside ``shard_map``, or on one device) are reduced
    together: operands of one reduction must share a sharding, or XLA
    reshards (moves) some of them first. Any other leaf (sharded, or under
    automatic axes, or on a host of several devices with no mesh in
    context, where the type does not show the sharding) is reduced alone;
    the partitioner then moves one flag per device, not the leaf.
    """
    hidden = _compat.shardings_hidden()
    flags: list[Any] = [None] * len(leaves)
    by_key: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        if hidden or any(entry is not None for entry in _compat.spec(x)):
            flags[i] = _alone(x)
        else:
            by_key.setdefault((x.shape, _compat.vma(x)), []).append(i)
    for idx in by_key.values():
        step = _OPERANDS_SMALL if leaves[idx[0]].size <= _SMALL else _OPERANDS
        for start in range(0, len(idx), step):
            chunk = idx[start : start + step]
            if len(chunk) == 1:
                out = [_alone(leaves[chunk[0]])]
            else:
                out = _together([leaves[i] for i in chunk])
            for i, flag in zip(chunk, out, strict=True):
                flags[i] = flag
    return flags


def _conjunction(flags: Sequence[jax.Array]) -> jax.Array:
    # A reduction over the stacked flags, not a chain of `and`s: XLA
    # duplicates cheap scalar chains into every consumer of the result (one
    # select per state leaf), which can make compile time quadratic.
    if not flags:
        return jnp.ones((), jnp.bool_)
    return jnp.all(jnp.stack(flags))


def _default_flags(leaves: Sequence[jax.Array]) -> list[jax.Array]:
    """One finiteness flag per leaf on GPU, TPU and other backends."""
    return [leaf_finite(x) for x in leaves]


# On a GPU every reduction is a kernel launch (two for a large one, which
# XLA splits), and one reduction per leaf, as flax's DynamicScale and
# optax.apply_if_finite make, was 80 of the loss-scaled adam step's 133
# kernels for 40 leaves compiled for an H200
# (benchmarks/RESULTS-gpu-hlo-before.md). Leaves whose type shows that
# each device holds them whole are ravelled, concatenated and reduced
# once: XLA fuses the concatenation into the reduction's input, so no copy
# is made and each gradient is still read once (RESULTS-gpu-hlo.md: 12
# kernels added in all). A fusion takes a bounded number of operands
# (compiled for an H200, the concatenation of 80 leaves fused into the
# reduction, that of 96 was written out first), so at most _GPU_OPERANDS
# leaves go into one reduction. Leaves of 16 bits or
# fewer are widened to float32 (exactly: inf and NaN stay so), wider ones
# keep their dtype (a float64 past float32's range is finite); see
# _exact_dtype.
_GPU_OPERANDS = 64


def _exact_dtype(x: jax.Array) -> np.dtype:
    """float32 for a real leaf of 16 bits or fewer (float16, bfloat16,
    float8, float4: float32 holds each of their values, inf and NaN), else
    the leaf's own dtype. Chosen by width, not by ``jnp.promote_types``,
    which refuses float8 (and any promotion under strict promotion)."""
    dtype = np.dtype(x.dtype)
    if dtype.itemsize <= 2 and dtype.kind != "c":
        return np.dtype(np.float32)
    return dtype


def _gpu_all_finite(leaves: Sequence[jax.Array]) -> jax.Array:
    """Whether every leaf is finite, in a few kernels on a GPU; see above.

    A leaf whose type does not show that each device holds it whole
    (sharded, or under automatic mesh axes, or on a host of several
    devices with no mesh in context) is reduced alone: concatenating it
    would move it between devices first.
    """
    hidden = _compat.shardings_hidden()
    flags = []
    by_key: dict[Any, list[jax.Array]] = {}
    for x in leaves:
        if hidden or any(entry is not None for entry in _compat.spec(x)):
            flags.append(leaf_finite(x))
        else:
            # 8-bit (and narrower) floats are concatenated with their own
            # format only: one fusion widening several such formats of
            # distinct shapes took XLA 10 to 40 times as long to compile
            # for an H200 (64 float8 leaves, e4m3 with e5m2: 98 s against
            # 2.5 s grouped by format; e4m3 with bfloat16: 53 s).
            own = np.dtype(x.dtype) if np.dtype(x.dtype).itemsize < 2 else None
            key = (_exact_dtype(x), own, _compat.vma(x))
            by_key.setdefault(key, []).append(x)
    for (dtype, _, _), group in by_key.items():
        for start in range(0, len(group), _GPU_OPERANDS):
            chunk = group[start : start + _GPU_OPERANDS]
            if len(chunk) == 1:
                flags.append(leaf_finite(chunk[0]))
            else:
                flat = [jnp.ravel(x).astype(dtype) for x in chunk]
                flags.append(leaf_finite(jnp.concatenate(flat)))
    return _conjunction(flags)


def _axes(axis_name: AxisName) -> tuple[Hashable, ...]:
    if axis_name is None:
        return ()
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def refuse_disagreement(flags: jax.Array, axis_name: AxisName) -> None:
    """Raises if devices could disagree on ``flags`` after the all-reduce.

    Under ``shard_map`` a value may differ between the devices along a
    mapped axis; a skip decided differently on two devices tears the model
    apart, so every such axis must be named in ``axis_name``. With
    ``check_vma=False`` (and under ``pmap`` where JAX builds it on such a
    ``shard_map``) JAX does not track which values differ, so every mapped
    axis must be named.
    """
    named = set(_axes(axis_name))
    manual = _compat.manual_axes()
    unknown = named - manual
    if manual and unknown:
        raise ValueError(
            f"axis_name={axis_name!r} names {sorted(unknown, key=repr)}, "
            "which are not mapped axes here; the mapped axes are "
            f"{sorted(manual, key=repr)}."
        )
    varying = _compat.vma(flags) - named
    unchecked = _compat.unchecked_manual_axes() - named
    if varying:
        raise ValueError(
            "the gradients' finiteness differs across the mapped axes "
            f"{sorted(varying, key=repr)}: devices would disagree on "
            "skipping the step. Pass "
            f"axis_name={tuple(sorted(named | varying, key=repr))!r} to "
            "loss_scaled (every mapped axis over which the gradients or "
            "their shards differ) so that one all-reduced flag decides."
        )
    if unchecked:
        raise ValueError(
            "under shard_map(..., check_vma=False) (or jax.pmap) JAX does not "
            "track which values differ between devices, so lossscale cannot "
            "tell whether they would agree on skipping a step. Pass "
            f"axis_name={tuple(sorted(named | unchecked, key=repr))!r} "
            "(the mapped axes of this computation); the all-reduce is of "
            "one int32 flag per group."
        )


def check(
    groups: Sequence[Sequence[jax.Array]],
    *,
    axis_name: AxisName = None,
    per_leaf: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
    """Finiteness flags for groups of leaves, in one collective at most.

    Args:
        groups: lists of floating leaves.
        axis_name: mapped axes to agree over (already validated).
        per_leaf: also return one flag per leaf.

    Returns:
        ``(group_finite, leaf_nonfinite)``: a bool array of shape
        ``(len(groups),)``, and, if ``per_leaf``, a bool array with one
        entry per leaf (groups concatenated in order) that is ``True`` where
        the leaf held an inf or NaN, else ``None``. Both agree over
        ``axis_name``: a leaf bad on one device is bad on all.
    """
    groups = [[jnp.asarray(x) for x in group] for group in groups]
    if axis_name is None and not _compat.tracing():
        return _check_concrete(groups, per_leaf=per_leaf)
    return _check(groups, axis_name=axis_name, per_leaf=per_leaf)


def _check_concrete(
    groups: Sequence[Sequence[jax.Array]], *, per_leaf: bool
) -> tuple[jax.Array, jax.Array | None]:
    """The check called eagerly (``all_finite`` on arrays, an eager update).

    One compiled program per tree signature, cached, instead of one dispatch
    (and a first-time compile) per operation per leaf; under
    ``jax.disable_jit`` the operations run one by one, as asked. Leaves on
    different devices (or laid out by an old ``pmap``), which one program
    would first have to move, are checked each where it lives, and the flags
    combined on the host.
    """
    leaves = [x for group in groups for x in group]
    if not any(_compat.pmap_laid_out(x) for x in leaves) and (
        len({frozenset(x.sharding.device_set) for x in leaves}) <= 1
    ):
        try:
            return _check_compiled(groups, per_leaf=per_leaf)
        except ValueError:
            # jit's refusal of inputs it cannot place together (one device
            # set in two orders, two meshes); the check itself raises no
            # ValueError outside shard_map. Checked leaf by leaf below.
            pass
    bad = np.asarray(
        [
            not bool(
                _check([[x]], axis_name=None, per_leaf=False)[0][0]
                if _compat.pmap_laid_out(x)
                else _check_compiled([[x]], per_leaf=False)[0][0]
            )
            for x in leaves
        ],
        dtype=np.bool_,
    )
    bounds = np.cumsum([0] + [len(group) for group in groups])
    group_finite = np.asarray(
        [not bad[a:b].any() for a, b in itertools.pairwise(bounds)],
        dtype=np.bool_,
    )
    return jnp.asarray(group_finite), jnp.asarray(bad) if per_leaf else None


def _all_reduce(ok: jax.Array, axis_name: AxisName) -> jax.Array:
    """``ok`` agreed over ``axis_name``: true where true on every device."""
    try:
        bad = lax.psum(jnp.logical_not(ok).astype(jnp.int32), axis_name)
    except NameError as err:
        # JAX's "unbound axis name": no shard_map, pmap or vmap maps it here
        # (plain jit, eager code, or an axis_name kept from a pmap).
        raise ValueError(
            f"axis_name={axis_name!r} names an axis that is not mapped here "
            f"({err}): axis_name is for code inside jax.shard_map, jax.pmap "
            "or jax.vmap(..., axis_name=...). Under plain jax.jit (any "
            "sharding) or eagerly, pass axis_name=None: the check is "
            "global there."
        ) from None
    return bad == 0


def _check(
    groups: Sequence[Sequence[jax.Array]],
    *,
    axis_name: AxisName,
    per_leaf: bool,
) -> tuple[jax.Array, jax.Array | None]:
    sizes = [len(group) for group in groups]

    def flags(
        platform_flags: Callable[[Sequence[jax.Array]], list[jax.Array]],
        platform_all: Callable[[Sequence[jax.Array]], jax.Array] | None = None,
    ) -> jax.Array:
        # Per-leaf flags (concatenated) if per_leaf, else per-group ones.
        if not per_leaf and platform_all is not None:
            return jnp.stack([platform_all(group) for group in groups])
        out = [platform_flags(group) for group in groups]
        if per_leaf:
            flat = [flag for group in out for flag in group]
            return jnp.stack(flat) if flat else jnp.ones((0,), jnp.bool_)
        return jnp.stack([_conjunction(group) for group in out])

    def gpu() -> jax.Array:
        # Per-leaf flags (report_nonfinite) take a reduction per leaf.
        return flags(_default_flags, _gpu_all_finite)

    # One platform switch for the whole check (not one per leaf: each is a
    # conditional until XLA folds it, and they add up in compile time).
    ok = lax.platform_dependent(
        cpu=lambda: flags(_cpu_flags),
        cuda=gpu,
        rocm=gpu,
        default=lambda: flags(_default_flags),
    )
    refuse_disagreement(ok, axis_name)
    if axis_name is not None:
        ok = _all_reduce(ok, axis_name)
    if not per_leaf:
        return ok, None
    group_finite, start = [], 0
    for size in sizes:
        group_finite.append(jnp.all(ok[start : start + size]))
        start += size
    return jnp.stack(group_finite), jnp.logical_not(ok)


_check_compiled = jax.jit(
    functools.partial(_check, axis_name=None), static_argnames="per_leaf"
)


def all_finite(tree: Any, *, axis_name: AxisName = None) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (no inf, no NaN).

    Non-floating leaves (integers, booleans, PRNG keys) and ``None`` are
    ignored; an empty tree is finite. Leaves that are not arrays or Python
    numbers (a string, another object) are refused: skipping them would
    make ``True`` a vacuous answer. It runs on arrays of any sharding,
    under ``jax.jit`` with explicit or automatic mesh axes, ``shard_map`` and
    ``pmap``: each device reduces what it holds and only a scalar crosses
    between devices.

    Args:
        tree: a pytree of arrays, e.g. gradients.
        axis_name: ``None``, or the name (or a tuple of names) of mapped axes
            (``jax.shard_map``, ``jax.pmap``) over which to agree: the result
            is then ``True`` on every device iff every device's ``tree`` is
            finite. Only the flag is reduced across devices (one int32
            all-reduce). Under plain ``jax.jit`` with globally sharded arrays
            no axis name is needed: the reduction is global by construction.

    Returns:
        A boolean scalar array.

    Raises:
        TypeError: if ``axis_name`` is malformed, or a leaf of ``tree`` is
            neither an array nor a Python number.
        ValueError: if ``axis_name`` names an axis that is not mapped where
            it is called (under plain ``jit`` or eagerly); under
            ``shard_map``, if the result would differ between devices along
            a mapped axis that ``axis_name`` does not name.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> lossscale.all_finite({"w": jnp.ones(3), "step": jnp.int32(7)})
        Array(True, dtype=bool)
        >>> lossscale.all_finite([jnp.array([1.0, jnp.inf])])
        Array(False, dtype=bool)
    """
    axis_name = _checks.axis_name(axis_name)
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if not _is_array_like(leaf):
            raise TypeError(
                "all_finite takes a pytree of arrays (and Python numbers), "
                f"got a leaf of type {type(leaf).__name__} at "
                f"tree{jax.tree_util.keystr(path)}: {leaf!r:.60}. A string or "
                "another object would otherwise be skipped, and the answer "
                "True would be vacuous."
            )
    leaves = [
        jnp.asarray(x) for x in jax.tree.leaves(tree) if _tree.is_float(x)
    ]
    return check([leaves], axis_name=axis_name)[0][0]


def _is_array_like(x: Any) -> bool:
    """An array (of any dtype: PRNG keys too), a tracer, or a number."""
    if isinstance(x, jax.Array | np.ndarray | np.generic):
        return True
    if isinstance(x, bool | int | float | complex):
        return True
    return hasattr(x, "dtype") and hasattr(x, "shape")
