"""Skip an optimizer update on non-finite gradients, branch-free, in place.

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

Measured on CPU (``benchmarks/``): no state copy, no extra buffer, and the
parameter update stays fused into ``optax.apply_updates``. Optimizers whose
updates read the *old* state (e.g. Lion's ``sign(b1 * mu + ...)``) keep
that read, and XLA still copies those leaves: correct, only slower.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

_NOT_STATE = object()


class UnsupportedJax(RuntimeError):
    """This JAX's internals differ from what :func:`select_update` uses."""


def _where(finite: jax.Array, new: Any, old: Any) -> jax.Array:
    new = jnp.asarray(new)  # a literal or a constant may be a NumPy value
    if jnp.shape(old) != new.shape:
        raise ValueError(
            "the inner optimizer's update returned a state leaf of shape "
            f"{new.shape} where its state had shape {jnp.shape(old)}; "
            "lossscale needs update to return a state shaped like the one it "
            "was given."
        )
    if jnp.result_type(old) != new.dtype:
        old = lax.convert_element_type(old, new.dtype)
    # lax.select, not jnp.where: one primitive per leaf keeps tracing cheap.
    return lax.select(finite, new, old)


def _aval_vma(aval: Any) -> frozenset:
    """The mapped axes a value varies over under ``shard_map`` (else none)."""
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def _vma(x: Any) -> frozenset:
    return _aval_vma(jax.typeof(x))


def _bind(eqn: Any, invals: list[Any]) -> list[Any]:
    """Evaluates one jaxpr equation, as ``jax.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(params, tuple):  # jax < 0.8 returned (subfuns, params)
        subfuns, params = params
        invals = [*subfuns, *invals]
    ctx = getattr(eqn, "ctx", None)
    with ctx.manager if ctx is not None else contextlib.nullcontext():
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def select_update(
    finite: jax.Array,
    update: Callable[[], tuple[Any, Any]],
    old_state: Any,
) -> tuple[Any, Any]:
    """``update()`` if ``finite``, else zero updates and ``old_state``.

    Args:
        finite: a boolean scalar.
        update: a function of no arguments returning ``(updates, state)``,
            typically a closure calling ``inner.update``. It is traced once.
        old_state: the state ``update`` starts from, returned unchanged
            (bitwise) when ``finite`` is false. ``update`` must return a
            state of the same structure and shapes.

    Returns:
        ``(updates, state)``: those of ``update()`` where ``finite``;
        zeros of the updates' dtypes and ``old_state`` otherwise.

    Raises:
        UnsupportedJax: if evaluating the traced update fails (the JAX
            internals this relies on changed); the caller falls back.
    """
    closed, (updates_shape, state_shape) = jax.make_jaxpr(
        update, return_shape=True
    )()
    jaxpr = closed.jaxpr
    old_leaves, old_def = jax.tree.flatten(old_state)
    new_def = jax.tree.structure(state_shape)
    if new_def != old_def:
        raise ValueError(
            "the inner optimizer's update returned a state of structure "
            f"{new_def}, but was given one of structure {old_def}; lossscale "
            "needs update to return a state structured like its input."
        )
    n_updates = len(jax.tree.leaves(updates_shape))
    update_atoms = jaxpr.outvars[:n_updates]
    state_atoms = jaxpr.outvars[n_updates:]
    # Under shard_map a selected value varies over the mapped axes `finite`
    # varies over. If the state is replicated over one of them, devices
    # would disagree on whether to skip (and the substituted values would
    # no longer type-check): an error, not a result.
    widened = frozenset().union(
        *(_vma(finite) - _aval_vma(atom.aval) for atom in state_atoms)
    )
    if widened:
        raise ValueError(
            "the gradients' finiteness differs across the mapped axes "
            f"{sorted(widened)}, over which the optimizer state is "
            "replicated: devices would disagree on skipping the step. Pass "
            f"axis_name={tuple(sorted(widened))!r} (with any other data-"
            "parallel axes) to loss_scaled so that they agree."
        )

    # The old leaf each state variable falls back to. A variable returned
    # as two state leaves is substituted by its first one's selection; the
    # second is selected again below, with its own old leaf.
    fallback: dict[Any, Any] = {}
    env: dict[Any, Any] = {}

    def write(var: Any, value: Any) -> None:
        old = fallback.get(var, _NOT_STATE)
        env[var] = value if old is _NOT_STATE else _where(finite, value, old)

    def read(atom: Any) -> Any:
        if isinstance(atom, jex_core.Literal):
            return atom.val  # as eval_jaxpr does; no device_put per literal
        return env[atom]

    try:
        for atom, old in zip(state_atoms, old_leaves, strict=True):
            if isinstance(atom, jex_core.Var):
                fallback.setdefault(atom, old)
        for var, const in zip(jaxpr.constvars, closed.consts, strict=True):
            write(var, const)
        for eqn in jaxpr.eqns:
            outs = _bind(eqn, [read(atom) for atom in eqn.invars])
            for var, out in zip(eqn.outvars, outs, strict=True):
                write(var, out)
    except (AttributeError, TypeError, KeyError) as err:
        # The update itself was traced without error above, so a failure
        # here is this evaluator meeting JAX internals it does not know.
        raise UnsupportedJax(f"{type(err).__name__}: {err}") from err

    updates = []
    for atom in update_atoms:
        value = jnp.asarray(read(atom))
        updates.append(lax.select(finite, value, lax.full_like(value, 0)))
    state = []
    for atom, old in zip(state_atoms, old_leaves, strict=True):
        value = read(atom)
        already = isinstance(atom, jex_core.Var) and fallback[atom] is old
        state.append(value if already else _where(finite, value, old))
    return (
        jax.tree.unflatten(jax.tree.structure(updates_shape), updates),
        jax.tree.unflatten(new_def, state),
    )
