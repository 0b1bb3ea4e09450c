"""The first pass: the precision class of every value, without binding.

:func:`infer` walks a jaxpr forwards and backwards until nothing changes,
and returns a :class:`Plan`: for each equation the dtype it runs in
(:class:`Node`, whose :class:`Mode` says how its operands are cast) and
the classes of its results. Nothing is traced here: a loop's carry
classes are found by iterating this pass over the loop's body, and the
plan of a jaxpr is kept, per configuration and input classes, as long as
the jaxpr lives (:class:`._config.JaxprCache`): a ``jax.jit``-ed block
called many times, in one call or many, is planned once.

Here is the fixed point over a jaxpr's equations and what a plan is
finished with (its float32 islands, what it used); each equation's rule,
and the pass's tables (:data:`._equation.KINDS`, one function a kind of
:mod:`._rules`, and :data:`._equation.HIGHER`, which the handlers of
higher-order primitives register into), are :mod:`._equation`'s.

Forwards, each equation's rule picks its dtype from its operands'
classes: the result is float32 where a float operand is float32
(PyTorch's promotion), so a float32 value is never rounded to 16 bits
except as a matmul's or convolution's operand. Backwards, the rounds
learn three things of each value (:class:`_Learned`), which flow from
readers to writers, each only ever turning from false to true (so the
iteration ends):

- *only read in float32*: an elementwise equation whose every reader runs
  in float32 runs in float32 itself (``exp(x - max)`` subtracts in
  float32), at no cost, since its result is not stored in 16 bits. This
  flag passes through moves and selections (softmax's ``reduce_max``),
  which stay 16-bit for a 16-bit operand (they are exact) but not through
  pooling; comparisons (``is_finite``) are not counted as readers;
- *demanded*: a bounded function (``sigmoid``, ``tanh``) whose result
  reaches a float32 operation, directly or through elementwise equations,
  keeps its result in float32 (``log(sigmoid(z))``, ``clip(p, eps,
  1 - eps)`` before a log);
- *unrounded*: some use of the value does not round it to the compute
  dtype. A value every use rounds anyway (a bias add before a relu and
  the next matmul) is rounded where it is made, once: the same values,
  and 16 bits for the backward pass to keep.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from lossscale import _compat
from lossscale._autocast import _islands, _matmul, _weights
from lossscale._autocast._classes import Cls, Info, is_float
from lossscale._autocast._config import Config, JaxprCache
from lossscale._autocast._equation import HIGHER, Planning, forward
from lossscale._autocast._plan import (
    ROUNDING,
    JaxprFacts,
    Mode,
    Node,
    Plan,
    facts,
)

_NAMED = _compat.primitives_named(["mul", "div"])
# A product with a literal, or a quotient by one, keeps nothing for the
# backward pass (its derivative is the same scaling of the tangent).
_SCALINGS = {_NAMED["mul"]: (0, 1), _NAMED["div"]: (1,)}


_PLANS = JaxprCache()


def infer(
    config: Config,
    jaxpr: Any,
    consts: Sequence[Info],
    ins: Sequence[Cls],
    only32: Sequence[bool],
    demanded: Sequence[bool],
    as_traced: Sequence[bool] = (),
) -> Plan:
    """The plan of an open ``jaxpr`` for these classes (kept while the
    jaxpr lives).

    Args:
        config: the configuration.
        jaxpr: an open jaxpr.
        consts: what is known of its constants.
        ins: the classes of its inputs.
        only32: per output, whether only float32 reads it.
        demanded: per output, whether it reaches a float32 operation.
        as_traced: per output (default: none), whether it is computed at
            its traced dtypes, with every equation it depends on (a
            loop's stopping decision).
    """
    # Under a float8 recipe, what its inputs are computed from (the
    # parameters, the data) decides which matmuls are linear layers.
    sources = None if config.float8 is None else _weights.reached_with(jaxpr)
    key = (
        config,
        tuple(c.cls for c in consts),
        tuple(ins),
        tuple(only32),
        tuple(demanded),
        tuple(as_traced),
        sources,
        _matmul.place(config.float8),
    )
    return _PLANS.get(
        jaxpr,
        key,
        lambda: _plan(
            config,
            jaxpr,
            consts,
            tuple(ins),
            only32,
            demanded,
            as_traced,
            sources,
        ),
    )


class _Learned(NamedTuple):
    """What the backward rounds learned of each variable (each flag only
    turns true)."""

    only32: dict[Any, bool]
    demanded: dict[Any, bool]
    unrounded: dict[Any, bool]

    def of(self, eqn: Any) -> tuple[list[bool], list[bool], list[bool]]:
        """What was learned of an equation's results, in the order
        ``forward`` takes them."""
        return (
            [self.only32.get(v, False) for v in eqn.outvars],
            [self.demanded.get(v, False) for v in eqn.outvars],
            [self.unrounded.get(v, False) for v in eqn.outvars],
        )

    def merged(self, new: _Learned) -> _Learned:
        """These flags or-ed with ``new``'s."""
        return _Learned(
            *(
                {v: f or old.get(v, False) for v, f in fresh.items()}
                for old, fresh in zip(self, new, strict=True)
            )
        )


def _plan(
    config: Config,
    jaxpr: Any,
    consts: Sequence[Info],
    ins: tuple[Cls, ...],
    out_only32: Sequence[bool],
    out_demanded: Sequence[bool],
    as_traced: Sequence[bool],
    sources: tuple[_weights.Source, ...] | None,
) -> Plan:
    jf = facts(jaxpr)
    analysis = (
        _weights.EMPTY if sources is None else _weights.analyse(jaxpr, sources)
    )
    planning = Planning(config, jf, analysis)
    if any(as_traced):
        planning.as_traced = jf.cone(as_traced)
    rounds = _Rounds(planning, jaxpr, consts, ins, out_only32, out_demanded)
    n_vars = sum(len(e.outvars) for e in jf.eqns)
    for _ in range(3 * n_vars + 2):
        rounds.forward()
        in_reads32, in_demanded = rounds.backward()
        if not rounds.merge():
            return _finish(
                planning,
                rounds.nodes,
                tuple(c.cls for c in consts),
                ins,
                rounds.out_classes(),
                in_reads32,
                in_demanded,
                rounds.rounded(),
            )
    raise RuntimeError(  # pragma: no cover - each flag changes once
        "lossscale.autocast: the inference pass did not converge."
    )


def _same(a: Info, b: Info | None) -> bool:
    return b is not None and a.cls == b.cls and a.value is b.value


class _Rounds:
    """The fixed point of one plan, round by round. Each round goes
    forwards (every equation's node from its operands' classes and what
    was learned of its results) and backwards (what each variable's
    readers make of it); after the first, a round revisits only what
    changed: the equations whose operands' classes or results' learned
    flags changed, and the variables whose readers' nodes or results'
    learned flags did."""

    def __init__(
        self,
        planning: Planning,
        jaxpr: Any,
        consts: Sequence[Info],
        ins: tuple[Cls, ...],
        out_only32: Sequence[bool],
        out_demanded: Sequence[bool],
    ) -> None:
        self.planning = planning
        self.jf = planning.facts
        self.jaxpr = jaxpr
        self.out_only32, self.out_demanded = out_only32, out_demanded
        self.env: dict[Any, Info] = dict(
            zip(jaxpr.constvars, consts, strict=True)
        )
        self.env.update(
            (v, Info(c)) for v, c in zip(jaxpr.invars, ins, strict=True)
        )
        self.nodes: dict[Any, Node] = {}
        self.known = _Learned({}, {}, {})  # merged over rounds
        self.new = _Learned({}, {}, {})  # the last backward round's
        self.first = True
        self.stale: set[Any] = set()  # variables whose flags just changed
        self.changed_nodes: set[Any] = set()
        self.changed_new: set[Any] = set()

    def read(self, atom: Any) -> Info:
        if _compat.is_literal(atom):
            return self.jf.literal(atom, self.planning.config.compute)
        return self.env[atom]

    def out_classes(self) -> tuple[Cls, ...]:
        return tuple(self.read(a).cls for a in self.jaxpr.outvars)

    def forward(self) -> None:
        changed_env: set[Any] = set()
        self.changed_nodes = set()
        for eqn in self.jf.eqns:
            if not (
                self.first
                or any(v in self.stale for v in eqn.outvars)
                or any(
                    _compat.is_var(a) and a in changed_env for a in eqn.invars
                )
            ):
                continue
            infos = [self.read(a) for a in eqn.invars]
            node, outs = forward(self.planning, eqn, infos, *self.known.of(eqn))
            if self.nodes.get(eqn) != node:
                self.changed_nodes.add(eqn)
                self.nodes[eqn] = node
            for var, info in zip(eqn.outvars, outs, strict=True):
                if not _same(info, self.env.get(var)):
                    changed_env.add(var)
                    self.env[var] = info

    def _uses(self, var: Any) -> list[tuple[bool | None, bool]]:
        jf, nodes, new = self.jf, self.nodes, self.new
        result = [
            _use(jf, nodes, new, e, i) for e, i in jf.readers.get(var, ())
        ]
        for j in jf.outputs.get(var, ()):
            result.append((self.out_only32[j], self.out_demanded[j]))
        return result

    def _dirty(self, var: Any) -> bool:
        return any(
            eqn in self.changed_nodes
            or any(v in self.changed_new for v in eqn.outvars)
            for eqn, _ in self.jf.readers.get(var, ())
        )

    def backward(self) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """This round's flags, and per input of the jaxpr, whether it is
        read in float32 and whether it reaches a float32 operation."""
        new = self.new
        self.changed_new = set()
        for eqn in reversed(self.jf.eqns):
            for var in eqn.outvars:
                if not (self.first or self._dirty(var)):
                    continue
                u = self._uses(var)
                reads = [r for r, _ in u if r is not None]
                learned = (
                    bool(reads) and all(reads),
                    any(d for _, d in u),
                    _unrounded(self.jf, self.nodes, new, var),
                )
                old = (
                    new.only32.get(var),
                    new.demanded.get(var),
                    new.unrounded.get(var),
                )
                if learned != old:
                    self.changed_new.add(var)
                    new.only32[var], new.demanded[var], new.unrounded[var] = (
                        learned
                    )
        used = [self._uses(var) for var in self.jaxpr.invars]
        return (
            tuple(any(r for r, _ in u) for u in used),
            tuple(any(d for _, d in u) for u in used),
        )

    def rounded(self) -> tuple[bool, ...]:
        """Per input of the jaxpr, whether every use rounds it."""
        return tuple(
            not _unrounded(self.jf, self.nodes, self.new, v)
            for v in self.jaxpr.invars
        )

    def merge(self) -> bool:
        """Or this round's flags into the known ones; whether any changed
        (if none did, the plan is found)."""
        known, new = self.known, self.new
        self.stale = set()
        for var in new.only32 if self.first else self.changed_new:
            for mine, theirs in zip(known, new, strict=True):
                if theirs[var] and not mine.get(var, False):
                    mine[var] = True
                    self.stale.add(var)
                elif var not in mine:
                    mine[var] = False
        self.first = False
        return bool(self.stale)


def _use(
    jf: JaxprFacts, nodes: dict[Any, Node], new: _Learned, eqn: Any, i: int
) -> tuple[bool | None, bool]:
    """(reads its operand ``i`` in float32, makes it demanded); None for a
    comparison (``is_finite(m)``, ``h > 0``), which reads it at whatever
    dtype it has: it neither widens it nor keeps it 16-bit."""
    node = nodes[eqn]
    ef = jf.of[eqn]
    float_outs = [v for v in eqn.outvars if is_float(v.aval.dtype)]
    if node.mode is Mode.COMPUTE and not ef.matmul and not float_outs:
        return None, False
    # A matmul rounds its operands whatever reads its result.
    passes = not ef.matmul and any(
        new.demanded.get(v, False) for v in eqn.outvars
    )
    if node.mode is Mode.HIGHER:
        passes = bool(node.data.demanded[i])
    reads32 = node.reads32[i] or (
        # A move or selection whose results only float32 reads is seen
        # through: it stays 16-bit for a 16-bit operand (exact), and is
        # float32 for a float32 one, so that softmax's max subtraction
        # does not keep the scores 16-bit (``softmax((x @ w) * 1e3)``
        # scales in float32).
        node.mode is Mode.COMPUTE
        and ef.moves
        and not (ef.record is not None and ef.record.pooling)
        and all(new.only32.get(v, False) for v in float_outs)
    )
    return reads32, node.reads32[i] or passes


def _unrounded(
    jf: JaxprFacts, nodes: dict[Any, Node], new: _Learned, var: Any
) -> bool:
    """Whether some use of ``var`` does not round it to the compute dtype
    anyway (every use is a matmul's operand, through exact operations: a
    relu, max pooling, a reshape, which commute with the rounding)."""
    if var in jf.outputs:
        return True
    found = False
    for eqn, i in jf.readers.get(var, ()):
        node = nodes[eqn]
        ef = jf.of[eqn]
        if node.mode in ROUNDING and ef.matmul:
            found = True
            continue
        # A higher-order equation that rounds it at every use inside (the
        # layers' weights of a scan, gathered before it).
        rounded = node.data.rounded
        if node.mode is Mode.HIGHER and i < len(rounded) and rounded[i]:
            found = True
            continue
        exact = (ef.moves and node.mode is not Mode.CONVERT) or (
            node.mode is Mode.HIGHER
            and HIGHER[eqn.primitive].island
            and all(p.exact for p in node.data.plans)
        )
        floats = [v for v in eqn.outvars if is_float(v.aval.dtype)]
        if not (exact and floats):
            return True
        if any(new.unrounded.get(v, True) for v in floats):
            return True
        found = True
    return not found


def _finish(
    planning: Planning,
    nodes: dict[Any, Node],
    consts: tuple[Cls, ...],
    ins: tuple[Cls, ...],
    outs: tuple[Cls, ...],
    reads32: tuple[bool, ...],
    demanded: tuple[bool, ...],
    rounded: tuple[bool, ...],
) -> Plan:
    jf = planning.facts
    # After the fixed point: a weight gathered for float8 matmuls only is
    # gathered in float8, which no other equation's plan depends on.
    gathers = _matmul.quantized_gathers(jf, nodes, planning.config)
    members = [_member(jf, e, nodes[e]) for e in jf.eqns]
    upcasts = [
        nodes[e].mode is Mode.FLOAT32 and Cls.LOW in nodes[e].ins
        for e in jf.eqns
    ]
    keeps = [_keeps(jf, e, nodes[e]) for e in jf.eqns]
    islands, outside = _islands.find(jf.eqns, upcasts, members, keeps)
    used = set(planning.used)
    functions = set(jf.functions)
    for node in nodes.values():
        if node.mode is Mode.HIGHER:
            for sub in node.data.plans:
                used |= sub.used
                functions |= sub.functions
    return Plan(
        nodes,
        consts,
        ins,
        outs,
        reads32,
        demanded,
        islands,
        all(members),
        _exact(jf, nodes),
        frozenset(used),
        frozenset(functions),
        outside,
        planning.roles,
        rounded,
        gathers,
    )


def _member(jf: JaxprFacts, eqn: Any, node: Node) -> bool:
    """Whether an equation may be part of a float32 island: elementwise
    equations and data movement (no matmul), and calls of such only
    (``jax.nn.relu`` is a ``custom_jvp`` of a ``jax.jit``)."""
    ef = jf.of[eqn]
    if ef.scoped or node.quantized or node.carries_copy:
        # A weight moved in float8 (and rearranged) is bound where its
        # matmuls read it: they take its float8 copy by the moved value,
        # which an island's checkpoint would hide behind a value of its
        # own.
        return False
    if node.mode is Mode.HIGHER:
        return HIGHER[eqn.primitive].island and all(
            p.pure for p in node.data.plans
        )
    return (
        node.mode is not Mode.HIGHER
        and not ef.matmul
        and ef.record is not None
        and ef.record.island
    )


def _keeps(jf: JaxprFacts, eqn: Any, node: Node) -> bool:
    """Whether an equation's derivative may keep a float value for the
    backward pass (a float32 island without one needs no checkpoint)."""
    if node.mode is Mode.HIGHER:
        return True
    literal = _SCALINGS.get(eqn.primitive)
    if literal is not None:
        return not any(_compat.is_literal(eqn.invars[i]) for i in literal)
    record = jf.of[eqn].record
    return record is None or not record.keeps_nothing


def _exact(jf: JaxprFacts, nodes: Mapping[Any, Node]) -> bool:
    """Whether a jaxpr only moves, selects and compares values (a relu):
    rounding its operands or its results gives the same values."""
    for eqn in jf.eqns:
        node = nodes[eqn]
        if node.mode is Mode.HIGHER:
            if not HIGHER[eqn.primitive].island or not all(
                p.exact for p in node.data.plans
            ):
                return False
        elif not (
            jf.of[eqn].moves
            or not any(is_float(v.aval.dtype) for v in eqn.outvars)
        ):
            return False
    return True
