"""Float32 islands: runs of elementwise equations recomputed, not stored.

Where a 16-bit activation is read in float32 by a run of consecutive
elementwise equations (a bias add and the GELU after it, a norm's output,
a bias, relu and max pooling), the backward pass would keep the float32
values the run computes. :func:`find` picks such runs from a plan, and
:func:`emit` binds each under ``jax.checkpoint``: the backward pass keeps
the 16-bit activation the run starts from, and recomputes the rest, which
is cheap. The checkpoint keeps JAX's barrier against common-subexpression
elimination (``prevent_cse=True``): without it XLA merged the
recomputation with the forward computation, and kept the island's float32
values alive after all (Hugging Face's FlaxGPT2 used more temporary memory
under autocast than in float32). An island is traced once per structure
and operand types, so
the same island in every layer of a model is one jaxpr, whose derivative
JAX caches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lossscale import _compat
from lossscale._autocast._cast import cast_cache

# The name of the checkpoints autocast adds around float32 islands, as
# profiles (and tests telling them from the program's own) see them.
SCOPE = "lossscale_island"


def find(
    eqns: Sequence[Any],
    upcasts: Sequence[bool],
    members: Sequence[bool],
    keeps: Sequence[bool],
) -> tuple[dict[int, int], frozenset[Any]]:
    """The islands of a jaxpr, and the equations bound before them.

    An island is a run of at least two ``members`` (equations that may be
    recomputed) of which one ``upcasts`` (reads a 16-bit activation in
    float32) and one ``keeps`` a value for the backward pass. A run that
    keeps nothing (a bias add, a scaling, a reshape) stores no float32
    value, and a checkpoint around it would only cost trace time under
    ``jax.grad``.

    Equations of a run that read nothing the island computes, keep
    nothing and do not grow their operand (a layer's slice of a stacked
    parameter, ``w[i]``) are bound before the checkpoint, not in it: each
    layer's island is then the same jaxpr, traced and differentiated once.

    Returns:
        The islands, from the index of the first equation to the index
        after the last, and the equations of islands bound before them.
    """
    islands: dict[int, int] = {}
    outside: set[Any] = set()
    i = 0
    while i < len(eqns):
        if not members[i]:
            i += 1
            continue
        j = i
        while j < len(eqns) and members[j]:
            j += 1
        hoisted = _hoisted(eqns, upcasts, keeps, i, j)
        core = [k for k in range(i, j) if k not in hoisted]
        if (
            len(core) >= 2
            and any(upcasts[k] for k in core)
            and any(keeps[k] for k in core)
        ):
            islands[i] = j
            outside.update(eqns[k] for k in hoisted)
        i = j
    return islands, frozenset(outside)


def _hoisted(
    eqns: Sequence[Any],
    upcasts: Sequence[bool],
    keeps: Sequence[bool],
    start: int,
    end: int,
) -> set[int]:
    """The equations of a run that may be bound before its checkpoint."""
    core_vars: set[Any] = set()
    hoisted = set()
    for k in range(start, end):
        eqn = eqns[k]
        reads = [a for a in eqn.invars if _compat.is_var(a)]
        if (
            upcasts[k]
            or keeps[k]
            or any(a in core_vars for a in reads)
            or _grows(eqn.outvars, reads)
        ):
            core_vars.update(eqn.outvars)
        else:
            hoisted.add(k)
    return hoisted


def _grows(outs: Sequence[Any], reads: Sequence[Any]) -> bool:
    """Whether an equation's largest output has more elements than its
    largest input; where symbolic sizes (``jax.export``) cannot tell, it
    is taken to (and is not hoisted: a saved output could be larger)."""
    try:
        return bool(_size(outs) > _size(reads))
    except _compat.InconclusiveDimensionOperation:
        return True


def _size(atoms: Sequence[Any]) -> Any:
    """The largest element count of ``atoms`` (symbolic under shape
    polymorphism)."""
    return max((math.prod(a.aval.shape) for a in atoms), default=0)


Equation = Callable[[Any, Any, list[Any]], list[Any]]


def emit(
    cache: dict[Any, Any],
    nodes: Any,
    run: Sequence[Any],
    read: Callable[[Any], Any],
    equation: Equation,
    outside: frozenset[Any] = frozenset(),
) -> list[Any]:
    """Binds the island ``run`` under a checkpoint (its ``outside``
    equations before it); returns the values of every output of its
    equations, in order.

    Args:
        cache: the islands traced in this evaluation, by structure.
        nodes: the plan's nodes, by equation.
        run: the island's equations.
        read: the value of an atom outside the island.
        equation: ``equation(eqn, node, invals)`` binds one equation.
        outside: the equations of islands bound before the checkpoint.
    """
    before = [eqn for eqn in run if eqn in outside]
    if before:
        bound: dict[Any, Any] = {}

        def read_outer(atom: Any) -> Any:
            if _compat.is_var(atom) and atom in bound:
                return bound[atom]
            return read(atom)

        for eqn in before:
            invals = [read_outer(a) for a in eqn.invars]
            bound.update(
                zip(eqn.outvars, equation(eqn, nodes[eqn], invals), strict=True)
            )
        core = [eqn for eqn in run if eqn not in outside]
        values = iter(emit(cache, nodes, core, read_outer, equation))
        return [
            bound[v] if eqn in outside else next(values)
            for eqn in run
            for v in eqn.outvars
        ]
    defined = {v for eqn in run for v in eqn.outvars}
    inputs: list[Any] = []
    for eqn in run:
        for atom in eqn.invars:
            if (
                _compat.is_var(atom)
                and atom not in defined
                and atom not in inputs
            ):
                inputs.append(atom)
    values = [read(a) for a in inputs]
    dynamic = [i for i, x in enumerate(values) if _compat.is_tracer(x)]

    def body(*xs: Any) -> list[Any]:
        env = dict(zip(inputs, values, strict=True))
        for i, x in zip(dynamic, xs, strict=True):
            env[inputs[i]] = x
        outs = []
        with cast_cache():
            for eqn in run:
                invals = [
                    _compat.literal_value(a)
                    if _compat.is_literal(a)
                    else env[a]
                    for a in eqn.invars
                ]
                node = nodes[eqn]._replace(remat=False)
                results = equation(eqn, node, invals)
                env.update(zip(eqn.outvars, results, strict=True))
                outs.extend(results)
        return outs

    args = [values[i] for i in dynamic]
    with jax.named_scope(SCOPE), _compat.source_context(run[0]):
        key = _key(nodes, run, inputs, values, dynamic)
        if key is not None:
            hit = cache.get(key)
            if hit is None:
                closed = jax.make_jaxpr(body)(*args)
                hit = cache[key] = None if closed.consts else closed.jaxpr
            if hit is not None:
                return _compat.bind_remat(hit, args)
        return list(_compat.checkpoint(body, prevent_cse=True)(*args))


def _key(
    nodes: Any,
    run: Sequence[Any],
    inputs: Sequence[Any],
    values: Sequence[Any],
    dynamic: Sequence[int],
) -> Any:
    """What an island computes, from its structure and its operands'
    types (``None``: not hashable, or with concrete operands)."""
    if len(dynamic) != len(values):
        return None
    position: dict[Any, tuple[Any, ...]] = {
        v: ("in", k) for k, v in enumerate(inputs)
    }
    parts: list[Any] = []
    for n, eqn in enumerate(run):
        refs = []
        for atom in eqn.invars:
            if _compat.is_literal(atom):
                value = np.asarray(_compat.literal_value(atom))
                refs.append(("lit", str(value.dtype), value.tobytes()))
            else:
                refs.append(position[atom])
        for m, var in enumerate(eqn.outvars):
            position[var] = ("out", n, m)
        node = nodes[eqn]
        parts.append(
            (
                eqn.primitive,
                tuple(sorted(eqn.params.items())),
                tuple(refs),
                node.mode,
                node.ins,
                node.outs,
            )
        )
    key = ("island", tuple(parts), tuple(jax.typeof(x) for x in values))
    try:
        hash(key)
    except TypeError:
        return None
    return key
