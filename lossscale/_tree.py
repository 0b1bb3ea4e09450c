"""Tree utilities: dtype rules, a checked select, leaf masks."""

from __future__ import annotations

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


def leaves_and_nones(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in order, with its ``None`` nodes among them.

    Gradients hold ``None`` where the params hold an array whose gradient
    is not taken (equinox's integer arrays, frozen leaves): counting the
    ``None`` keeps the two lists aligned.
    """
    return jax.tree.leaves(tree, is_leaf=lambda x: x is None)


def narrower_range_than_float32(dtype: Any) -> bool:
    """Whether a real floating dtype overflows below float32's maximum.

    float16 (max 65504) and the float8 types do; bfloat16 has float32's
    range.
    """
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return False
    return int(jnp.finfo(dtype).maxexp) < int(jnp.finfo(jnp.float32).maxexp)


def multiply_keep_dtype(x: Any, factor: jax.Array) -> Any:
    """``x * factor`` computed in :func:`compute_dtype`, cast back to x's.

    Non-floating leaves pass through untouched.
    """
    if not is_float(x):
        return x
    x = jnp.asarray(x)
    dtype = compute_dtype(x.dtype)
    return (x.astype(dtype) * jnp.asarray(factor).astype(dtype)).astype(x.dtype)


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
