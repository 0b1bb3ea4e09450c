"""What a plan is made of: the modes, nodes and plans of the inference
pass (:mod:`._infer`), the facts of an equation and of a jaxpr whatever
the classes (:class:`JaxprFacts`, kept while the jaxpr lives), and the
argument of a kind's rule (:class:`KindArgs`).

Below both the inference pass and the matmul rules (:mod:`._matmul`),
which build these.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from lossscale import _compat
from lossscale._autocast import _rules as R
from lossscale._autocast import _weights
from lossscale._autocast._classes import Cls, Info, is_float, of_dtype, of_value
from lossscale._autocast._config import JaxprCache

FLOAT32_SCOPE = "lossscale_float32"
COMPUTE_SCOPE = "lossscale_compute"


def _scope_re(name: str) -> re.Pattern[str]:
    """A named scope in a name stack, under any transformation."""
    return re.compile(r"(?:^|[/(])" + name + r"(?:$|[/)])")


_SCOPE_RE = _scope_re(FLOAT32_SCOPE)
_COMPUTE_RE = _scope_re(COMPUTE_SCOPE)


class Mode(enum.Enum):
    """How an equation's float operands are cast before it is bound."""

    COMPUTE = "compute"  # to the compute dtype
    FLOAT8 = "float8"  # a matmul: quantised to float8 (._fp8)
    FLOAT32 = "float32"  # to float32
    TRACED = "traced"  # to the dtypes it was traced with
    CONVERT = "convert"  # an explicit cast of the program: kept
    HIGHER = "higher"  # from ``data``, by its handler (._higher, ._control)


# The modes in which a matmul rounds its operands (to the compute dtype,
# or to float8 from whatever dtype they have).
ROUNDING = frozenset({Mode.COMPUTE, Mode.FLOAT8})


class SubPlans(NamedTuple):
    """What a higher-order equation's node keeps: the plans of its
    jaxprs, which operands reach a float32 operation inside
    (``demanded``), and what its handler adds (``extra``)."""

    plans: tuple[Plan, ...]
    demanded: tuple[bool, ...]
    extra: Any = None
    # Per operand, every use inside rounds it to the compute dtype (a
    # matmul's operand, through exact moves): a float32 value gathered for
    # a scan of layers may then be gathered rounded. Empty: none is.
    rounded: tuple[bool, ...] = ()


# A first-order equation's node's data: no jaxprs.
NO_PLANS = SubPlans((), ())


class Node(NamedTuple):
    """The plan of one equation.

    ``outs``: the classes of its results, which the emitted values are
    stored in. ``reads32``: per operand, whether the equation reads it in
    float32. ``data``: a higher-order equation's plans, made by its
    handler (:mod:`._higher` for calls, :mod:`._control` for ``scan``,
    ``while`` and ``cond``; the table is :mod:`._handlers`'s); a
    first-order one's has none. ``remat``: its derivative is recomputed
    from its operands. ``role``: a float8 matmul's (which operand is its
    weight). ``reason``: why a matmul of the float8 kind is kept 16-bit.
    ``narrow``: a move of a float32 value that every reader rounds
    (``_rules.Record.gathers``): rounded first, then moved (an FSDP
    all-gather in 16 bits), its derivative moved back in float32.
    ``quantized``: a narrow move whose every reader is a float8 matmul
    taking it as its weight, cast once per tensor: quantised first, then
    moved in float8 (its result float32, ``._scaling.quantized_move``).
    ``carries_copy``: a rearrangement (``_rules.Record.rearranges``: a
    transpose, a reshape) of such a weight whose every reader is again a
    float8 matmul's weight or such a rearrangement: bound in float32, it
    rearranges the weight's float8 copy too, which its matmuls take.
    """

    mode: Mode
    ins: tuple[Cls, ...]
    outs: tuple[Cls, ...]
    reads32: tuple[bool, ...]
    data: SubPlans = NO_PLANS
    remat: bool = False
    role: _weights.Role | None = None
    reason: str | None = None
    narrow: bool = False
    quantized: bool = False
    carries_copy: bool = False


class Plan(NamedTuple):
    nodes: Mapping[Any, Node]
    consts: tuple[Cls, ...]
    ins: tuple[Cls, ...]
    outs: tuple[Cls, ...]
    reads32: tuple[bool, ...]  # per input: read in float32 inside
    demanded: tuple[bool, ...]  # per input: reaches a float32 operation
    islands: Mapping[int, int]  # float32 islands: first index -> end
    pure: bool  # only elementwise equations: may be part of an island
    exact: bool  # only data movement, selection and max/min
    # The user's overrides it applied, and the functions it called (by
    # name), its sub-plans' included.
    used: frozenset[tuple[str, Any]] = frozenset()
    functions: frozenset[str] = frozenset()
    # The equations of islands bound before their checkpoint.
    outside: frozenset[Any] = frozenset()
    # Under a float8 recipe, what the dataflow says each matmul is.
    roles: Mapping[Any, _weights.Role] = {}
    # Per input: every use of it rounds it to the compute dtype.
    rounded: tuple[bool, ...] = ()
    # Under a float8 recipe, each move of a float32 weight rounded before
    # it moves (``Node.narrow``): why it moves in the compute dtype, or
    # None where it moves float8 (``Node.quantized``); and each gather
    # that moves float32 a weight float8 matmuls read: why.
    gathers: Mapping[Any, str | None] = {}


class EqnFacts(NamedTuple):
    scoped: bool  # traced inside float32_scope
    function: str | None  # the name of the function it calls
    record: R.Record | None  # its default record
    matmul: bool
    moves: bool  # moves or selects values (an explicit cast included)
    float_in: tuple[bool, ...]  # per operand: a float
    float32_in: tuple[bool, ...]  # per operand: traced in float32
    float_out: tuple[bool, ...]  # per result: a float


def in_float32_scope(eqn: Any) -> bool:
    """Traced inside :func:`lossscale.float32_scope`, under any
    transformation (``vmap(lossscale_float32)``, ``transpose(jvp(...))``)."""
    return _SCOPE_RE.search(_compat.name_stack(eqn)) is not None


def in_compute_scope(eqn: Any) -> bool:
    """Traced inside :func:`lossscale.compute_scope`."""
    return _COMPUTE_RE.search(_compat.name_stack(eqn)) is not None


def eqn_facts(eqn: Any) -> EqnFacts:
    """What an equation is, whatever the classes."""
    record = R.TABLE.get(eqn.primitive)
    return EqnFacts(
        scoped=in_float32_scope(eqn),
        function=_compat.function_name(eqn),
        record=record,
        matmul=record is not None and record.kind is R.Kind.MATMUL,
        moves=record is not None and record.moves,
        float_in=tuple(is_float(a.aval.dtype) for a in eqn.invars),
        float32_in=tuple(
            is_float(a.aval.dtype) and np.dtype(a.aval.dtype) == np.float32
            for a in eqn.invars
        ),
        float_out=tuple(is_float(v.aval.dtype) for v in eqn.outvars),
    )


class JaxprFacts:
    """A jaxpr's readers and outputs, and its equations' facts."""

    def __init__(self, jaxpr: Any) -> None:
        self.eqns: list[Any] = list(jaxpr.eqns)
        self.readers: dict[Any, list[tuple[Any, int]]] = {}
        for eqn in self.eqns:
            for i, atom in enumerate(eqn.invars):
                if _compat.is_var(atom):
                    self.readers.setdefault(atom, []).append((eqn, i))
        self.outputs: dict[Any, list[int]] = {}
        for j, atom in enumerate(jaxpr.outvars):
            if _compat.is_var(atom):
                self.outputs.setdefault(atom, []).append(j)
        self.of: dict[Any, EqnFacts] = {e: eqn_facts(e) for e in self.eqns}
        self.functions = frozenset(
            f.function for f in self.of.values() if f.function is not None
        )
        self._literals: dict[Any, Info] = {}
        self._jaxpr_outvars = list(jaxpr.outvars)
        # The constants computed at trace time, by equation: each is
        # computed once while the jaxpr lives (the operands are kept with
        # the key of their ids, so that the ids are not reused).
        self.folded: dict[Any, tuple[tuple[int, ...], Any, Any]] = {}

    def cone(self, outputs: Sequence[bool]) -> frozenset[Any]:
        """The equations the flagged outputs depend on, at any remove."""
        writer = {v: e for e in self.eqns for v in e.outvars}
        todo = [
            a
            for a, flag in zip(self._jaxpr_outvars, outputs, strict=True)
            if flag and _compat.is_var(a)
        ]
        found: set[Any] = set()
        while todo:
            eqn = writer.get(todo.pop())
            if eqn is not None and eqn not in found:
                found.add(eqn)
                todo.extend(a for a in eqn.invars if _compat.is_var(a))
        return frozenset(found)

    def literal(self, atom: Any, compute: np.dtype) -> Info:
        # By id: literals are unhashable, and this object's equations
        # keep them alive.
        key = (id(atom), compute)
        hit = self._literals.get(key)
        if hit is None:
            value = _compat.literal_value(atom)
            hit = Info(of_value(value, atom.aval.dtype, compute), value)
            self._literals[key] = hit
        return hit


_FACTS = JaxprCache()


def facts(jaxpr: Any) -> JaxprFacts:
    """The facts of ``jaxpr`` (computed once while it lives)."""
    return _FACTS.get(jaxpr, None, lambda: JaxprFacts(jaxpr))


def make_node(
    eqn: Any,
    mode: Mode,
    infos: Sequence[Info],
    outs: Sequence[Cls],
    remat: bool = False,
    ef: EqnFacts | None = None,
) -> Node:
    """A first-order equation's node: which operands it reads in float32
    follows from its mode."""
    ef = eqn_facts(eqn) if ef is None else ef
    classes = tuple(i.cls for i in infos)
    if mode is Mode.FLOAT32:
        flags = ef.float_in
    elif mode is Mode.TRACED:
        flags = ef.float32_in
    else:
        flags = None
    if flags is None:
        reads32 = (False,) * len(infos)
    else:
        reads32 = tuple(
            f and c != Cls.KEEP for f, c in zip(flags, classes, strict=True)
        )
    return Node(mode, classes, tuple(outs), reads32, remat=remat)


def traced(
    eqn: Any,
    infos: Sequence[Info],
    compute: np.dtype,
    ef: EqnFacts | None = None,
) -> tuple[Node, list[Info]]:
    """The equation at the dtypes it was traced with."""
    outs = [of_dtype(v.aval.dtype, compute) for v in eqn.outvars]
    node = make_node(eqn, Mode.TRACED, infos, outs, ef=ef)
    return node, [Info(c) for c in outs]


class KindArgs(NamedTuple):
    """What a kind's rule decides from: the equation, its operands'
    classes, which results are floats, what the backward rounds learned
    of its results (``only32``, ``demanded``, ``unrounded``) and its
    facts."""

    eqn: Any
    record: R.Record
    infos: list[Info]
    floats: set[Cls]
    float_outs: list[bool]
    only32: list[bool]
    demanded: list[bool]
    unrounded: list[bool]
    compute: np.dtype
    float8: Any
    facts: EqnFacts
    role: _weights.Role | None  # a matmul's, under a float8 recipe
    used: set[tuple[str, Any]]  # the overrides the plan applied
    # The jaxpr's folded values (a cast folds its constant operand).
    folded: dict[Any, Any]

    def result(
        self, mode: Mode, cls: Cls, remat: bool = False
    ) -> tuple[Node, list[Info]]:
        outs = [cls if f else Cls.KEEP for f in self.float_outs]
        node = make_node(self.eqn, mode, self.infos, outs, remat, self.facts)
        return node, [Info(c) for c in outs]
