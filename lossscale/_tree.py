"""Tree utilities: the finiteness check, a checked select, leaf masks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale import _checks

PyTree = Any
MaskOrFn = PyTree | Callable[[PyTree], PyTree] | None


def is_float(x: Any) -> bool:
    """Whether a leaf holds inexact (real or complex floating) values.

    Integer, boolean and other leaves are never scaled or checked, so that
    step counters, PRNG keys and integer buffers stored next to gradients
    pass through untouched.
    """
    try:
        dtype = jnp.result_type(x)
    except TypeError:
        return False
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def compute_dtype(dtype: Any) -> np.dtype:
    """float32 for float16/bfloat16/float8; wider dtypes stay as they are.

    Written out rather than ``jnp.promote_types``, which refuses float8 and
    (under strict promotion) any mixed pair.
    """
    dtype = np.dtype(dtype)
    if dtype.itemsize < 4 and not jnp.issubdtype(dtype, jnp.complexfloating):
        return np.dtype(np.float32)
    return dtype


def multiply_keep_dtype(x: Any, factor: jax.Array) -> Any:
    """``x * factor`` computed in :func:`compute_dtype`, cast back to x's.

    Non-floating leaves pass through untouched.
    """
    if not is_float(x):
        return x
    x = jnp.asarray(x)
    dtype = compute_dtype(x.dtype)
    return (x.astype(dtype) * jnp.asarray(factor).astype(dtype)).astype(x.dtype)


# On CPU XLA splits a reduction over a whole leaf into a windowed
# pre-reduction whose input it materialises: the check would write a
# gradient-sized temporary (a byte per element) and read it back. Reducing
# blocks of _BLOCK elements first fuses the ``isfinite`` into the reduction
# and writes 1/_BLOCK of a byte per element instead: rows of 16 for a vector
# (16 measured fastest on x86), 16 x 16 tiles of the last two axes for
# anything wider. Tiles read whole cache lines whichever of the two axes is
# minor in memory: XLA often lays a matmul's weight gradient out transposed,
# and logical rows of it are read with a stride (measured: 2 ms per 4 MB,
# 30% of a small float16 train step).
_BLOCK = 16
# Leaves of at most _SMALL elements are reduced together, _CHUNK at a time
# (XLA fuses a concatenation of 8 with the isfinite, not one of 16).
_SMALL = 1024
_CHUNK = 8


def _flags_finite(ok: jax.Array) -> jax.Array:
    """``jnp.all`` of a boolean array, by blocks first; see _BLOCK."""
    if ok.size <= _SMALL:
        return jnp.all(ok)
    if ok.ndim >= 2 and min(ok.shape[-2:]) >= _BLOCK:
        *lead, a, b = ok.shape
        a_in, b_in = a // _BLOCK * _BLOCK, b // _BLOCK * _BLOCK
        tiles = ok[..., :a_in, :b_in].reshape(
            *lead, a_in // _BLOCK, _BLOCK, b_in // _BLOCK, _BLOCK
        )
        blocks = jnp.all(tiles, axis=(len(lead) + 1, len(lead) + 3))
        rest = jnp.all(ok[..., a_in:, :]) & jnp.all(ok[..., :a_in, b_in:])
    else:
        ok = jnp.ravel(ok)
        rows = ok.size // _BLOCK * _BLOCK
        blocks = jnp.all(ok[:rows].reshape(-1, _BLOCK), axis=1)
        rest = jnp.all(ok[rows:])
    # The barrier keeps XLA from merging the two reductions back into one.
    return jnp.all(lax.optimization_barrier(blocks)) & rest


def _all(flags: list[jax.Array]) -> jax.Array:
    """The conjunction of boolean scalars (``True`` for none)."""
    return functools.reduce(jnp.logical_and, flags, jnp.ones((), jnp.bool_))


def all_finite(tree: PyTree, *, axis_name: Any = None) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (no inf, no NaN).

    Non-floating leaves (integers, booleans, PRNG keys) and ``None`` are
    ignored; an empty tree is finite.

    Args:
        tree: a pytree of arrays, e.g. gradients.
        axis_name: ``None``, or the name (or a tuple of names) of mapped axes
            (``jax.pmap``, ``jax.shard_map``) over which to agree: the result
            is then ``True`` on every device iff every device's ``tree`` is
            finite. Only the boolean is reduced across devices (one scalar
            all-reduce), whatever the caller does with the gradients. Under
            plain ``jax.jit`` with globally sharded arrays no axis name is
            needed: the reduction is global by construction.

    Returns:
        A boolean scalar array.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> lossscale.all_finite({"w": jnp.ones(3), "step": jnp.int32(7)})
        Array(True, dtype=bool)
        >>> lossscale.all_finite([jnp.array([1.0, jnp.inf])])
        Array(False, dtype=bool)
    """
    axis_name = _checks.axis_name(axis_name)
    return finite_by_group([jax.tree.leaves(tree)], axis_name=axis_name)[0]


def finite_by_group(
    groups: list[list[Any]], *, axis_name: Any = None
) -> jax.Array:
    """One finiteness flag per group of leaves, in a single collective.

    Args:
        groups: a list of lists of leaves; non-floating leaves are ignored.
        axis_name: as in :func:`all_finite`, already validated.

    Returns:
        A boolean array of shape ``(len(groups),)``.
    """
    groups = [[jnp.asarray(x) for x in g if is_float(x)] for g in groups]

    def blocked(group):
        flags = [
            _flags_finite(jnp.isfinite(x)) for x in group if x.size > _SMALL
        ]
        small = [jnp.ravel(jnp.isfinite(x)) for x in group if x.size <= _SMALL]
        for i in range(0, len(small), _CHUNK):
            # Small leaves share one reduction over their concatenated flags
            # (materialised, at most _SMALL bytes per leaf): one kernel to
            # compile rather than two per leaf. The barrier keeps XLA from
            # splitting it back into one reduction per leaf.
            both = jnp.concatenate(small[i : i + _CHUNK])
            flags.append(_flags_finite(lax.optimization_barrier(both)))
        return _all(flags)

    def direct(group):
        return _all([jnp.all(jnp.isfinite(x)) for x in group])

    # One platform switch for the whole check (not one per leaf: each is a
    # conditional until XLA folds it, and they add up in compile time).
    finite = lax.platform_dependent(
        cpu=lambda: jnp.stack([blocked(g) for g in groups]),
        default=lambda: jnp.stack([direct(g) for g in groups]),
    )
    if axis_name is not None:
        nonfinite = jnp.logical_not(finite).astype(jnp.int32)
        finite = lax.psum(nonfinite, axis_name) == 0
    return finite


def select_tree(
    pred: jax.typing.ArrayLike, on_true: PyTree, on_false: PyTree
) -> PyTree:
    """Selects ``on_true`` if ``pred`` else ``on_false``, leaf by leaf.

    Branch-free (an elementwise select), so it is cheap inside ``jit`` and
    works under ``vmap``. Unlike ``jnp.where`` it refuses to promote: both
    trees must have the same structure and each pair of leaves the same
    shape and dtype, so a selected state keeps its dtypes exactly.

    Args:
        pred: a boolean scalar.
        on_true: the tree returned where ``pred`` is true.
        on_false: the tree returned where ``pred`` is false.

    Returns:
        A tree with the structure of ``on_true``.

    Raises:
        TypeError: if ``pred`` is not a boolean scalar, or two leaves differ
            in dtype.
        ValueError: if the structures or two leaves' shapes differ.
    """
    pred = _checks.scalar_bool("pred", pred)
    true_def = jax.tree.structure(on_true)
    false_def = jax.tree.structure(on_false)
    if true_def != false_def:
        raise ValueError(
            "on_true and on_false must have the same tree structure, got "
            f"{true_def} and {false_def}."
        )
    paths_and_leaves = jax.tree_util.tree_leaves_with_path(on_true)
    for (path, a), b in zip(
        paths_and_leaves, jax.tree.leaves(on_false), strict=True
    ):
        a_dtype, b_dtype = jnp.result_type(a), jnp.result_type(b)
        if a_dtype != b_dtype:
            raise TypeError(
                f"select_tree needs equal dtypes, got {a_dtype} and {b_dtype} "
                f"at {jax.tree_util.keystr(path)}."
            )
        if np.shape(a) != np.shape(b):
            raise ValueError(
                f"select_tree needs equal shapes, got {np.shape(a)} and "
                f"{np.shape(b)} at {jax.tree_util.keystr(path)}."
            )
    return jax.tree.map(lambda a, b: lax.select(pred, a, b), on_true, on_false)


def check_mask(mask: MaskOrFn) -> MaskOrFn:
    """Eager check of a mask argument: ``None``, a callable, or bool leaves."""
    if mask is None or callable(mask):
        return mask
    _check_mask_leaves(mask)
    return mask


def _check_mask_leaves(mask_tree: PyTree) -> None:
    leaves = jax.tree_util.tree_leaves_with_path(mask_tree)
    for path, leaf in leaves:
        if not isinstance(leaf, bool | np.bool_):
            raise TypeError(
                "mask leaves must be Python bools (True: loss-scale this leaf; "
                f"False: leave it alone), got {leaf!r} at "
                f"mask{jax.tree_util.keystr(path)}."
            )


def broadcast_prefix(prefix: PyTree, tree: PyTree, name: str) -> PyTree:
    """``prefix`` (a tree prefix of ``tree``) with each leaf repeated over
    the subtree of ``tree`` it covers; a ``ValueError`` naming ``name`` if
    it is not a prefix."""
    try:
        return jax.tree.map(
            lambda p, sub: jax.tree.map(lambda _: p, sub), prefix, tree
        )
    except ValueError as err:
        raise ValueError(
            f"{name} must have the structure of the gradients (or a prefix "
            f"of it), got {name} structure {jax.tree.structure(prefix)} for "
            f"gradients with structure {jax.tree.structure(tree)}."
        ) from err


def resolve_mask(mask: MaskOrFn, tree: PyTree) -> PyTree:
    """A tree of bools with the structure of ``tree``.

    ``mask`` may be a callable (called on ``tree``, as in ``optax.masked``),
    a tree with the structure of ``tree``, or a prefix of it (one bool then
    covers a whole subtree).
    """
    if mask is None:
        return jax.tree.map(lambda _: True, tree)
    mask_tree = mask(tree) if callable(mask) else mask
    _check_mask_leaves(mask_tree)
    return broadcast_prefix(jax.tree.map(bool, mask_tree), tree, "mask")
