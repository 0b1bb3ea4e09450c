"""Skip an optimizer update on non-finite gradients, branch-free, in place.

:func:`apply_if_finite` runs the inner update if the gradients were finite,
and otherwise returns zero updates and the old state, bit for bit. It has
three ways to do that:

- **Concrete flag** (eager mode, ``jax.disable_jit()``): a Python branch.
  A skipped step never runs the inner update, so ``jax_debug_nans`` stays
  quiet and nothing is computed from the non-finite gradients.
- **select** (the default under tracing): :func:`select_update`.
- **cond**: ``lax.cond`` around the inner update; the fallback when
  :func:`select_update` meets JAX internals it does not know.

A branch-free skip keeps ``new if finite else old`` for every leaf of the
inner optimizer's state and zeroes the updates. Written naively around
``inner.update``, that select makes XLA *copy* the state on every step: the
parameter update (say Adam's ``mu_new / sqrt(nu_new)``, fused into
``optax.apply_updates``) recomputes ``mu_new`` from the old ``mu``, while
the selected ``mu`` is written over the old one in place, and XLA cannot
order the read before the write, so it copies ``mu`` first.

:func:`select_update` removes that hazard by construction. It traces the
inner update to a jaxpr and evaluates it with one substitution: every value
that becomes a state leaf is replaced, from the moment it is computed, by its
selected version. Everything downstream (the updates, other state leaves)
then reads the selected state, which is a data dependency XLA respects: the
state is written in place first, and the parameter update reads it after.
When ``finite`` is true the selected values *are* the new values, so the
same operations run on the same values as in ``inner.update``; when it is
false the updates are zeros and the state is the old one, bit for bit,
whatever was computed in between.

Optimizers whose updates read the *old* state (e.g. Lion's
``sign(b1 * mu + ...)``) keep that read, and XLA still copies those leaves:
correct, only slower.

The inner update may return a state whose structure differs from the one it
was given, as long as each of its leaves has a counterpart at the same key
path in the old state (optax's momentum drops the trace of a parameter whose
gradient is ``None``). A skipped step then returns the old values in the new
structure.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from jax import lax

from lossscale import _compat, _interpret

Impl = Literal["select", "cond"]
IMPLS: tuple[Impl, ...] = ("select", "cond")
UpdateFn = Callable[[], tuple[optax.Updates, optax.OptState]]

_NOT_STATE = object()


class UnsupportedJax(RuntimeError):
    """This JAX's internals differ from what :func:`select_update` uses."""


def apply_if_finite(
    finite: jax.Array,
    update: UpdateFn,
    old_state: optax.OptState,
    *,
    impl: Impl,
    like: Any = None,
) -> tuple[optax.Updates, optax.OptState]:
    """``update()`` if ``finite``, else zero updates and ``old_state``.

    Args:
        finite: a boolean scalar, the same on every device.
        update: a function of no arguments returning ``(updates, state)``.
        old_state: the state ``update`` starts from.
        impl: how to skip under tracing, ``"select"`` or ``"cond"``.
        like: a tree (the gradients) whose leaves, matched by key path and
            shape, give a skipped eager step's zero updates their sharding.

    Returns:
        ``(updates, state)``.
    """
    if not _compat.is_tracer(finite):
        if bool(finite):
            return update()
        updates, new_state = jax.eval_shape(update)
        old = _old_in_new_structure(old_state, new_state)
        return _zeros(updates, like), old
    if impl == "select":
        try:
            return select_update(finite, update, old_state)
        except UnsupportedJax as err:
            warnings.warn(
                "lossscale: the copy-free skip does not support this JAX "
                f"version ({jax.__version__}; {err}); using a conditional "
                "skip instead, which is correct but copies the updates. "
                "Please report this.",
                RuntimeWarning,
                stacklevel=3,
            )
    return cond_update(finite, update, old_state)


def _zeros(shapes: Any, like: Any) -> Any:
    """Concrete zeros of ``shapes``, placed like ``like``'s leaves where a
    leaf of the same path and shape exists (a sharded gradient gives its
    zero update its sharding), else on the default device."""
    by_path = {
        jax.tree_util.keystr(path): leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(like)
    }

    def zero(path: Any, s: Any) -> jax.Array:
        leaf = by_path.get(jax.tree_util.keystr(path))
        if leaf is not None and jnp.shape(leaf) == tuple(s.shape):
            return jnp.zeros_like(leaf, dtype=s.dtype)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree_util.tree_map_with_path(zero, shapes)


def _old_in_new_structure(old_state: Any, new_state: Any) -> Any:
    """``old_state``'s leaves, arranged in ``new_state``'s structure.

    Each leaf of ``new_state`` takes the leaf of ``old_state`` at the same
    key path, cast to the new leaf's dtype if they differ.
    """
    return jax.tree.unflatten(
        jax.tree.structure(new_state),
        _old_leaves_for(old_state, new_state),
    )


def _old_leaves_for(old_state: Any, new_state: Any) -> list[Any]:
    new_def = jax.tree.structure(new_state)
    old_leaves, old_def = jax.tree.flatten(old_state)
    if old_def != new_def:
        by_path = {
            jax.tree_util.keystr(path): leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(old_state)
        }
        old_leaves = []
        for path, _ in jax.tree_util.tree_leaves_with_path(new_state):
            key = jax.tree_util.keystr(path)
            if key not in by_path:
                raise ValueError(
                    "the inner optimizer's update returned a state with a "
                    f"leaf at {key} that the state it was given lacks (it "
                    f"returned structure {new_def}, was given {old_def}); "
                    "lossscale needs each new state leaf to have an old "
                    "counterpart to keep on a skipped step."
                )
            old_leaves.append(by_path[key])
    out = []
    for old, new in zip(old_leaves, jax.tree.leaves(new_state), strict=True):
        if jnp.shape(old) != tuple(new.shape):
            raise ValueError(
                "the inner optimizer's update returned a state leaf of shape "
                f"{tuple(new.shape)} where its state had shape "
                f"{jnp.shape(old)}; lossscale needs update to return a state "
                "shaped like the one it was given."
            )
        if jnp.result_type(old) != new.dtype:
            old = lax.convert_element_type(old, new.dtype)
        if _compat.is_tracer(new):  # a value traced in a skip branch
            old = _compat.like_sharding(old, new)
        out.append(old)
    return out


def _select(finite: jax.Array, new: Any, old: Any) -> jax.Array:
    # lax.select, not jnp.where: one primitive per leaf keeps tracing cheap.
    new = jnp.asarray(new)
    return lax.select(finite, new, _compat.like_sharding(old, new))


def select_update(
    finite: jax.Array, update: UpdateFn, old_state: optax.OptState
) -> tuple[optax.Updates, optax.OptState]:
    """``update()`` if ``finite``, else zero updates and ``old_state``.

    Args:
        finite: a boolean scalar, the same on every device.
        update: a function of no arguments returning ``(updates, state)``,
            typically a closure calling ``inner.update``. It is traced once.
        old_state: the state ``update`` starts from, returned unchanged
            (bitwise) when ``finite`` is false.

    Returns:
        ``(updates, state)``: those of ``update()`` where ``finite``;
        zeros of the updates' dtypes and ``old_state`` otherwise.

    Raises:
        ValueError: if a leaf of the new state has no counterpart of the
            same shape at its key path in ``old_state``.
        UnsupportedJax: if evaluating the traced update fails (the JAX
            internals this relies on changed); the caller falls back.
    """
    closed, (updates_shape, state_shape) = jax.make_jaxpr(
        update, return_shape=True
    )()
    jaxpr = closed.jaxpr
    old_leaves = _old_leaves_for(old_state, state_shape)
    n_updates = len(jax.tree.leaves(updates_shape))
    state_atoms = jaxpr.outvars[n_updates:]

    # The old leaf each state variable falls back to. A variable returned
    # as two state leaves is substituted by its first one's selection; the
    # second is selected again below, with its own old leaf.
    fallback: dict[Any, Any] = {}

    def write(var: Any, value: Any) -> Any:
        old = fallback.get(var, _NOT_STATE)
        return value if old is _NOT_STATE else _select(finite, value, old)

    try:
        for atom, old in zip(state_atoms, old_leaves, strict=True):
            if _compat.is_var(atom):
                fallback.setdefault(atom, old)
        outs = _interpret.run(
            jaxpr,
            closed.consts,
            [],
            apply=_compat.bind_equation,
            write=write,
        )
    except (AttributeError, TypeError, KeyError) as err:
        # The update itself was traced without error above, so a failure
        # here is this evaluator meeting JAX internals it does not know.
        raise UnsupportedJax(f"{type(err).__name__}: {err}") from err

    updates = []
    for value in outs[:n_updates]:
        value = jnp.asarray(value)
        updates.append(lax.select(finite, value, lax.full_like(value, 0)))
    state = []
    for atom, old, value in zip(
        state_atoms, old_leaves, outs[n_updates:], strict=True
    ):
        done = _compat.is_var(atom) and fallback[atom] is old
        state.append(value if done else _select(finite, value, old))
    return (
        jax.tree.unflatten(jax.tree.structure(updates_shape), updates),
        jax.tree.unflatten(jax.tree.structure(state_shape), state),
    )


def cond_update(
    finite: jax.Array, update: UpdateFn, old_state: optax.OptState
) -> tuple[optax.Updates, optax.OptState]:
    """:func:`select_update`'s contract, with ``lax.cond``."""

    def skip() -> tuple[optax.Updates, optax.OptState]:
        # Zeros made by zeros_like from the updates themselves carry their
        # varying mapped axes under shard_map, which fresh jnp.zeros would
        # not; zeros_like has no data dependency, so XLA drops the update
        # this branch traces.
        updates, new_state = update()
        zeros = jax.tree.map(jnp.zeros_like, updates)
        return zeros, _old_in_new_structure(old_state, new_state)

    return lax.cond(finite, update, skip)
