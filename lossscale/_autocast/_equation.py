"""The first pass's rule for one equation: its node (the dtype it runs
in) and its results' classes, from its operands' classes and what the
backward rounds learned of its results.

A first-order equation goes by its record's kind (:data:`KINDS`, one
function a kind of :mod:`._rules`; a matmul's are :mod:`._matmul`'s), an
explicit cast is kept, small constants are folded (:mod:`._fold`), and a
higher-order one goes by :data:`HIGHER`, which the handlers of
higher-order primitives register into: its handler plans its jaxprs with
:func:`._infer.infer`, so the recursion passes through the table and no
import runs upwards.
:class:`Planning` is the state of the plan being made that each rule
reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from lossscale._autocast import _matmul, _weights
from lossscale._autocast import _rules as R
from lossscale._autocast._classes import (
    Cls,
    Info,
    is_float,
    of_conversion,
    of_value,
)
from lossscale._autocast._config import Config
from lossscale._autocast._fold import fold
from lossscale._autocast._plan import (
    JaxprFacts,
    KindArgs,
    Mode,
    Node,
    make_node,
    traced,
)

# --- the table of higher-order primitives ----------------------------------

InferHigher = Callable[[Config, Any, list[Info], list[bool], list[bool]], Node]


class Higher(NamedTuple):
    """A higher-order primitive's inference rule. ``island``: a call
    (``jit``, ``custom_jvp_call``) that may be part of a float32 island
    when its jaxprs are elementwise only."""

    infer: InferHigher
    island: bool = False


HIGHER: dict[Any, Higher] = {}


def register(primitive: Any, infer: InferHigher, *, island: bool) -> None:
    """Registers a higher-order primitive's inference rule."""
    HIGHER[primitive] = Higher(infer, island)


# --- the state of the plan being made ----------------------------------------


class Planning:
    """What one plan's making reads (the configuration, the jaxpr's facts,
    each matmul's role) and collects (the overrides it applied)."""

    def __init__(
        self,
        config: Config,
        facts: JaxprFacts,
        analysis: _weights.Analysis,
    ) -> None:
        self.config = config
        self.facts = facts
        # Under a float8 recipe: each matmul's role, and the sources each
        # higher-order equation reaches its jaxprs with.
        self.roles = analysis.roles
        self.sites = analysis.sites
        self.used: set[tuple[str, Any]] = set()
        self.as_traced: frozenset[Any] = frozenset()


def function_rule(config: Config, name: str | None) -> R.FunctionRule | None:
    """The rule of the function a call equation calls, if it has one."""
    return None if name is None else config.function_rule(name)


# --- the rules of the kinds of first-order primitives ------------------------


def _bounded(a: KindArgs) -> tuple[Node, list[Info]]:
    # Computed in float32 from a float32 operand, and kept in float32
    # where a float32 operation reads it.
    if any(a.demanded):
        return a.result(Mode.FLOAT32, Cls.F32)
    if Cls.F32 in a.floats:
        return a.result(Mode.FLOAT32, Cls.LOW)
    return a.result(Mode.COMPUTE, Cls.LOW)


def _float32(a: KindArgs) -> tuple[Node, list[Info]]:
    remat = a.record.remat and Cls.LOW in a.floats
    return a.result(Mode.FLOAT32, Cls.F32, remat)


def _promote(a: KindArgs) -> tuple[Node, list[Info]]:
    # PyTorch's promotion, and float32 where only float32 reads. Moving or
    # selecting 16-bit values is exact: no reason to widen it (what the
    # backward rounds learn sees through it: ``_infer._use``); nor a
    # collective, which moves 16 bits between devices where 32 would cost
    # twice the bytes (a tensor-parallel all-reduce).
    exact = (a.record.moves or a.record.collective) and a.floats <= {
        Cls.LOW,
        Cls.CONST16,
    }
    # A result every use rounds anyway is rounded here, once.
    float_unrounded = [
        u for u, f in zip(a.unrounded, a.float_outs, strict=True) if f
    ]
    rounded = bool(float_unrounded) and not any(float_unrounded)
    if (
        rounded
        and a.record.gathers
        and a.floats == {Cls.F32}
        and len(a.eqn.invars) == 1
        and a.compute.itemsize < 4
    ):
        # Rounded before it moves, since rounding commutes with moving:
        # an FSDP weight is gathered in 16 bits, not gathered in float32
        # and then rounded (half the bytes), and its gradient is moved
        # back (reduce-scattered) in float32 all the same, as today.
        node, infos = a.result(Mode.COMPUTE, Cls.LOW)
        return node._replace(narrow=True), infos
    if Cls.F32 in a.floats or (a.float_outs and all(a.only32) and not exact):
        if Cls.LOW in a.floats and rounded:
            return a.result(Mode.FLOAT32, Cls.LOW)
        return a.result(Mode.FLOAT32, Cls.F32)
    return a.result(Mode.COMPUTE, Cls.LOW)


def _convert(a: KindArgs) -> tuple[Node, list[Info]]:
    """An explicit cast the traced program shows: kept."""
    eqn, infos, compute = a.eqn, a.infos, a.compute
    (info,) = infos
    new = np.dtype(eqn.params["new_dtype"])
    values = fold(
        a.folded, eqn, infos, lambda v: [np.asarray(v[0]).astype(new)]
    )
    value = None if values is None else values[0]
    if not is_float(new):
        out = Cls.KEEP
    elif new == compute:
        out = Cls.LOW
    elif new == np.float32:
        if info.cls == Cls.CONST16:
            out = Cls.CONST16
        else:
            held = of_conversion(eqn.invars[0].aval.dtype, new, compute)
            out = Cls.F32 if held is None else held
    else:
        out = Cls.KEEP
    node = Node(Mode.CONVERT, (info.cls,), (out,), (False,))
    return node, [Info(out, value)]


KINDS: dict[R.Kind, Callable[[KindArgs], tuple[Node, list[Info]]]] = {
    R.Kind.MATMUL: _matmul.matmul_rule,
    R.Kind.FLOAT8: _matmul.float8_rule,
    R.Kind.BOUNDED: _bounded,
    R.Kind.FLOAT32: _float32,
    R.Kind.PROMOTE: _promote,
    R.Kind.CONVERT: _convert,
}
"""This pass's rule for each kind of :mod:`._rules`."""


# --- one equation ------------------------------------------------------------


def forward(
    planning: Planning,
    eqn: Any,
    infos: list[Info],
    only32: list[bool],
    demanded: list[bool],
    unrounded: list[bool],
) -> tuple[Node, list[Info]]:
    """An equation's node and its results' classes (with their values
    where folded), from its operands' classes and what was learned of its
    results: at its traced dtypes where a scope, a function rule or a
    float8 exclusion says so, by its handler where it is higher-order,
    else by its record's kind."""
    config = planning.config
    compute = config.compute
    ef = planning.facts.of[eqn]
    if ef.scoped or eqn in planning.as_traced:
        if config.float8 is not None and ef.matmul:
            # Kept in float32 all the same: an exclude naming it matched.
            role = planning.roles.get(eqn)
            entry = _matmul.excluded_by(eqn, config.float8, role)
            if entry is not None:
                planning.used.add(("exclude", entry))
        return traced(eqn, infos, compute, ef)
    higher = HIGHER.get(eqn.primitive)
    if higher is not None or ef.function is not None:
        rule = function_rule(config, ef.function)
        if ef.function is not None and (
            ("function", ef.function) in config.overrides
        ):
            planning.used.add(("function", ef.function))
        if rule in ("float32", "original") or higher is None:
            return traced(eqn, infos, compute, ef)  # custom_vjp: run whole
        if rule == "compute" or (
            _matmul.kept_out(eqn, config.float8, planning.used) is not None
        ):
            config = config.sixteen_bit
        with _weights.at(planning.sites.get(eqn, {})), _matmul.inside(eqn):
            node = higher.infer(config, eqn, infos, only32, demanded)
        return node, [Info(c) for c in node.outs]
    floats = {i.cls for i, f in zip(infos, ef.float_in, strict=True) if f}
    if Cls.KEEP in floats:
        return traced(eqn, infos, compute, ef)
    record, override = config.record(eqn.primitive)

    def args(record: R.Record) -> KindArgs:
        return KindArgs(
            eqn,
            record,
            infos,
            floats,
            list(ef.float_out),
            only32,
            demanded,
            unrounded,
            compute,
            config.float8,
            ef,
            planning.roles.get(eqn),
            planning.used,
            planning.facts.folded,
        )

    if record is not None and record.kind is R.Kind.CONVERT:
        # Before the folding below: it keeps the program's dtype, and
        # folds with its own cast (autocast refuses a rule for it).
        return KINDS[record.kind](args(record))
    if override is not None:
        planning.used.add(("primitive", override))
    if record is None:
        return traced(eqn, infos, compute, ef)
    if floats <= {Cls.CONST16}:
        foldable = record.foldable and any(ef.float_out)
        values = fold(planning.facts.folded, eqn, infos) if foldable else None
        if values is not None:
            outs = [
                of_value(v, a.aval.dtype, compute)
                for v, a in zip(values, eqn.outvars, strict=True)
            ]
            node = make_node(eqn, Mode.TRACED, infos, outs, ef=ef)
            return node, [Info(c, v) for c, v in zip(outs, values, strict=True)]
        if floats and ef.moves:
            outs = [Cls.CONST16 if f else Cls.KEEP for f in ef.float_out]
            node = make_node(eqn, Mode.TRACED, infos, outs, ef=ef)
            return node, [Info(c) for c in outs]
        return traced(eqn, infos, compute, ef)
    return KINDS[record.kind](args(record))
