"""Which matmuls an autocast function runs in which dtype, and why."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np

from lossscale import _compat
from lossscale._autocast import _eager, _plan, _run, _weights
from lossscale._autocast import _matmul as _matmul_rules
from lossscale._autocast._classes import Cls, class_dtype


class Matmul(NamedTuple):
    """One matmul of an autocast function's traced program (forward).

    Attributes:
        primitive: ``"dot_general"`` or ``"conv_general_dilated"``, ...
        shapes: the shapes of its two operands.
        dtype: the dtype its operands are cast to: ``"float8_e4m3fn"``,
            the 16-bit compute dtype, or ``"float32"`` (at the dtypes the
            program traced).
        why: why that dtype, in words. A float8 matmul whose weight an
            FSDP gather moves (through moves such as a transpose, and
            out of the calls and loop bodies it is passed to) says how it
            was gathered: ``"float8; its weight gathered in
            float8_e4m3fn"``, or in the compute dtype or float32 with the
            reason.
        where: the named scopes (and jitted functions) it was traced in.
        line: the line of the user's code that made it (``file:line``).
        weight: under a :class:`lossscale.Float8` recipe, the path of the
            parameter its weight operand is computed from, in the
            arguments ``params_argnums`` names (``"head.kernel"`` in an
            NNX model, ``"['w1']"`` in a dict; several joined by ``", "``),
            ``"<constant>"`` for a weight the function closes over, and
            ``""`` for a matmul that is not a linear layer.
    """

    primitive: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    why: str
    where: str
    line: str
    weight: str = ""


def matmuls(fun: Any, *args: Any, **kwargs: Any) -> list[Matmul]:
    """The matmuls of an autocast function called on these arguments.

    Traces ``fun`` (nothing runs) and lists, in program order, every
    matmul and convolution of the forward pass with the dtype autocast
    runs it in and why: with a :class:`lossscale.Float8` recipe, which ones
    go float8 and which stay 16-bit (a matmul that is not a linear layer,
    such as attention's, a weight whose sizes are not multiples of 16, a
    rule, ``float32_scope``), and the parameter each linear layer's weight
    comes from (:attr:`Matmul.weight`). The backward
    pass of each runs in the same format (float8: an ``e5m2`` gradient by
    an ``e4m3`` operand). A matmul inside a loop or a function called
    several times is listed once per place in the program.

    Args:
        fun: a function returned by :func:`lossscale.autocast`.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        A list of :class:`Matmul`.

    Raises:
        TypeError: if ``fun`` is not an autocast function.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> def loss(w, x):
        ...     return jnp.mean(x @ w)
        >>> f = lossscale.autocast(loss, lossscale.Float8())
        >>> [(m.dtype, m.why) for m in lossscale.matmuls(
        ...     f, jnp.ones((32, 16)), jnp.ones((64, 32)))]
        [('float8_e4m3fn', 'float8')]
        >>> [(m.dtype, m.why) for m in lossscale.matmuls(
        ...     f, jnp.ones((30, 16)), jnp.ones((64, 30)))]
        [('bfloat16', "the weight's N=16, K=30 not both multiples of 16")]
    """
    if not isinstance(fun, _eager.Autocast):
        raise TypeError(
            "fun must be a function returned by lossscale.autocast, got "
            f"fun={fun!r}."
        )
    config = fun._config
    with _weights.naming():  # each linear layer's weight, by its path
        planned = _run.trace(
            config, fun._out_dtype, fun.__wrapped__, args, kwargs
        )
    # A rule or filter that matches nothing warns here too: this is where
    # a rule is checked before training.
    _run.warn_unused(config, planned.plan.used, planned.plan.functions, set())
    return list(_walk(planned.plan, _Place(config)))


class _Place(NamedTuple):
    """Where the walk is: the configuration in force, the scopes and
    functions above, and the function rule that made matmuls 16-bit."""

    config: Any
    where: str = ""
    rule: str | None = None


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


# How a float8 matmul's weight was gathered, for a variable of the jaxpr
# a walk is in (None: not by a gather this walk can see).
Gathered = Callable[[Any], "str | None"]


def _walk(
    plan: Any, place: _Place, outer: Gathered | None = None
) -> Iterator[Matmul]:
    made_by = {v: e for e in plan.nodes for v in e.outvars}

    def gathered(var: Any) -> str | None:
        return _gathered(plan, made_by, var, place.config, outer)

    for eqn, node in plan.nodes.items():
        if node.mode is _plan.Mode.HIGHER:
            inner = _inside(eqn, place)
            for sub in node.data.plans:
                yield from _walk(sub, inner, _through(eqn, sub, gathered))
        elif node.mode is _plan.Mode.TRACED and _compat.sub_jaxprs(eqn):
            yield from _as_traced(
                eqn, _why_traced(eqn, place.config), _inside(eqn, place)
            )
        elif _plan.eqn_facts(eqn).matmul:
            if node.mode is _plan.Mode.FLOAT8:
                note = gathered(eqn.invars[node.role.weight])
                why = "float8" if note is None else f"float8; {note}"
            else:
                why = _why(eqn, node, place)
            yield _listed(
                eqn,
                _dtype(eqn, node, place.config),
                why,
                place,
                _weight(plan.roles.get(eqn)),
            )


def _weight(role: Any) -> str:
    if role is None or role.weight is None:
        return ""
    if not role.leaves:
        return "<constant>"
    return ", ".join(sorted(role.leaves))


def _inside(eqn: Any, place: _Place) -> _Place:
    """The place inside a higher-order equation: its scopes and, for a
    call, its function's name, and the function rule that applies."""
    name = _compat.function_name(eqn)
    where = _join(place.where, _compat.name_stack(eqn), name or "")
    rule = None if name is None else place.config.function_rule(name)
    float8 = place.config.float8
    if float8 is None:
        return place._replace(where=where)
    why = None
    if rule == "compute":
        why = f"function_rules[{name!r}]: 'compute'"
    else:
        why = _matmul_rules.kept_out(eqn, float8, set())
    if why is None:
        return place._replace(where=where)
    return _Place(place.config.sixteen_bit, where, why)


def _as_traced(eqn: Any, why: str, place: _Place) -> Iterator[Matmul]:
    """The matmuls of a higher-order equation run at its traced dtypes."""
    for sub in _compat.sub_jaxprs(eqn):
        for inner in sub.eqns:
            if _compat.sub_jaxprs(inner):
                yield from _as_traced(inner, why, _inside(inner, place))
            elif _plan.eqn_facts(inner).matmul:
                dtype = str(np.dtype(inner.invars[0].aval.dtype))
                yield _listed(inner, dtype, why, place)


def _listed(
    eqn: Any, dtype: str, why: str, place: _Place, weight: str = ""
) -> Matmul:
    return Matmul(
        eqn.primitive.name,
        tuple(tuple(v.aval.shape) for v in eqn.invars),
        dtype,
        why,
        _join(place.where, _compat.name_stack(eqn)),
        _compat.source_line(eqn),
        weight,
    )


def _dtype(eqn: Any, node: Any, config: Any) -> str:
    if node.mode is _plan.Mode.FLOAT8:
        return str(config.float8.row.input.dtype)  # the forward operands
    if node.mode is _plan.Mode.COMPUTE:
        return str(np.dtype(config.compute))
    return str(np.dtype(eqn.invars[0].aval.dtype))


def _why_traced(eqn: Any, config: Any) -> str:
    if _plan.eqn_facts(eqn).scoped:
        return "float32_scope"
    name = _compat.function_name(eqn)
    rule = None if name is None else config.function_rule(name)
    if rule is not None:
        return f"function_rules[{name!r}]: {rule!r}"
    return "at its traced dtypes"


def _gathered(
    plan: Any, made_by: dict[Any, Any], var: Any, config: Any,
    outer: Gathered | None,
) -> str | None:  # fmt: skip
    """How the weight ``var`` was gathered, where an FSDP gather moved it
    (``made_by``: each variable's equation in ``plan``): back through
    moves (a transpose, a reshape) to the gather, and out of a call or a
    loop body to its operand (``outer``)."""
    while var in made_by:
        move = made_by[var]
        if move in plan.gathers:
            why = plan.gathers[move]  # None: moved in float8
            if why is None:
                dtype = config.float8.row.weight.dtype
                return f"its weight gathered in {np.dtype(dtype)}"
            # Moved in the dtype of its result's class (a narrow move's:
            # the compute dtype).
            cls = plan.nodes[move].outs[0]
            dtype = class_dtype(cls, np.dtype(config.compute))
            dtype = var.aval.dtype if dtype is None else dtype
            return f"its weight gathered in {np.dtype(dtype)}: {why}"
        if not (_plan.eqn_facts(move).moves and len(move.invars) == 1):
            return None
        var = move.invars[0]
    return None if outer is None else outer(var)


def _through(eqn: Any, sub: Any, gathered: Gathered) -> Gathered | None:
    """``gathered`` seen from inside the higher-order ``eqn`` whose jaxpr
    ``sub`` plans, for the inputs that are one of ``eqn``'s operands on
    every iteration (:func:`_operands`); None where none is."""
    first = next(iter(sub.nodes), None)
    jaxpr = next(
        (j for j in _compat.sub_jaxprs(eqn) if any(e is first for e in j.eqns)),
        None,
    )
    if jaxpr is None:
        return None
    # A closed jaxpr on some JAX versions (sub_jaxprs finds its eqns).
    by_inner = _operands(eqn, getattr(jaxpr, "jaxpr", jaxpr))

    def outer(var: Any) -> str | None:
        atom = by_inner.get(var)
        return (
            None if atom is None or not _compat.is_var(atom) else gathered(atom)
        )

    return outer


def _operands(eqn: Any, jaxpr: Any) -> dict[Any, Any]:
    """The inputs of ``eqn``'s ``jaxpr`` that are its operands: all, in
    order, for a call (a jit, a checkpoint); a cond's branches take all
    but the index; a scan's body its consts and its stacked inputs (a
    slice of each), not its carry, which the body replaces; a while
    loop's body its consts only. Empty where the layout is another."""
    operands = list(eqn.invars)
    name = eqn.primitive.name
    inner = list(jaxpr.invars)
    if name == "cond":
        operands = operands[1:]
    elif name == "scan":
        start, carry = _compat.scan_counts(eqn.params)
        end = start + carry
        operands = operands[:start] + operands[end:]
        inner = inner[:start] + inner[end:]
    elif name == "while":
        if jaxpr is not eqn.params["body_jaxpr"].jaxpr:  # the cond's
            return {}
        start = eqn.params["cond_nconsts"]
        count = eqn.params["body_nconsts"]
        operands = operands[start : start + count]
        inner = inner[:count]
    if len(inner) != len(operands):
        return {}
    return dict(zip(inner, operands, strict=True))


def _why(eqn: Any, node: Any, place: _Place) -> str:
    config = place.config
    if node.reason is not None:
        return node.reason  # a float8 matmul that could not be
    if node.mode is _plan.Mode.TRACED:
        if _plan.eqn_facts(eqn).scoped:
            return "float32_scope"
        if _compat.explicit_precision(eqn):
            return "precision above DEFAULT"
        return "at its traced dtypes"
    record, override = config.record(eqn.primitive)
    if override is not None:
        return f"rules[{override!r}]: {dict(config.rules)[override]!r}"
    if node.outs and node.outs[0] == Cls.F32:
        return "a preferred_element_type wider than its operands"
    if place.rule is not None:
        return place.rule
    if (
        config.float8 is not None
        and record is not None
        and not record.quantizable
    ):
        return f"{eqn.primitive.name} does not run in float8"
    return "the compute dtype"
