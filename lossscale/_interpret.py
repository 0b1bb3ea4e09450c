"""Evaluating a jaxpr equation by equation: the core shared by the skip and
by autocast.

:func:`run` walks a jaxpr once, in order, and hands every equation with its
input values to a function of the caller's (``apply``), which binds it as
it is (:func:`lossscale._compat.bind_equation`), binds it changed, or
recurses into the equation's own jaxprs. Run under an outer trace (``jit``,
``grad``, ``vmap``), everything bound is staged into that trace, so the
result composes with every transformation as the original function would.

- The copy-free skip (:mod:`lossscale._skip`) binds every equation as it is
  and substitutes values as they are written (``write``).
- Autocast (:mod:`lossscale._autocast`) carries a precision class with each
  value and decides each equation's dtypes from a table of rules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lossscale import _compat

Apply = Callable[[Any, list[Any]], Sequence[Any]]


def run(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    *,
    apply: Apply,
    literal: Callable[[Any], Any] = _compat.literal_value,
    write: Callable[[Any, Any], Any] | None = None,
    groups: Mapping[int, int] | None = None,
    apply_group: Callable[[Sequence[Any], Callable[[Any], Any]], Sequence[Any]]
    | None = None,
) -> list[Any]:
    """Evaluates ``jaxpr`` on ``consts`` and ``args``; returns its outputs.

    Args:
        jaxpr: an open jaxpr (``closed.jaxpr``).
        consts: one value per constant variable.
        args: one value per input variable.
        apply: ``apply(eqn, invals)`` returns the equation's output values.
        literal: the value a literal operand stands for.
        write: if given, ``write(var, value)`` returns what is stored for
            ``var`` (the skip's substitution); by default ``value`` itself.
        groups: runs of consecutive equations evaluated together, from the
            index of the first to the index after the last (autocast's
            float32 islands): ``apply_group(eqns, read)`` returns the
            values of every output of the run's equations, in order.

    Returns:
        One value per output of ``jaxpr``.
    """
    env: dict[Any, Any] = {}

    def store(var: Any, value: Any) -> None:
        env[var] = value if write is None else write(var, value)

    def read(atom: Any) -> Any:
        return literal(atom) if _compat.is_literal(atom) else env[atom]

    for var, value in zip(jaxpr.constvars, consts, strict=True):
        store(var, value)
    for var, value in zip(jaxpr.invars, args, strict=True):
        store(var, value)
    eqns = jaxpr.eqns
    groups = groups or {}
    i = 0
    while i < len(eqns):
        end = groups.get(i)
        if end is not None and apply_group is not None:
            run = eqns[i:end]
            outvars = [v for eqn in run for v in eqn.outvars]
            outs = apply_group(run, read)
            i = end
        else:
            outvars = eqns[i].outvars
            outs = apply(eqns[i], [read(atom) for atom in eqns[i].invars])
            i += 1
        for var, value in zip(outvars, outs, strict=True):
            store(var, value)
    return [read(atom) for atom in jaxpr.outvars]
