"""The first pass: the precision class of every value, without binding.

:func:`infer` walks a jaxpr forwards and backwards until nothing changes,
and returns a :class:`Plan`: for each equation the dtype it runs in
(:class:`Node`, whose :class:`Mode` says how its operands are cast) and
the classes of its results. Nothing is traced here: a loop's carry
classes are found by iterating this pass over the loop's body, and the
plan of a jaxpr is kept, per configuration and input classes, as long as
the jaxpr lives (:class:`._config.JaxprCache`): a ``jax.jit``-ed block
called many times, in one call or many, is planned once.

This pass owns its tables: first-order equations go by their record's
kind (:data:`KINDS`, one function a kind of :mod:`._rules`), higher-order
ones by :data:`HIGHER`, which :mod:`._higher` registers into.

Forwards, each equation's rule picks its dtype from its operands'
classes: the result is float32 where a float operand is float32
(PyTorch's promotion), so a float32 value is never rounded to 16 bits
except as a matmul's or convolution's operand. Backwards, three facts
flow from readers to writers, each only ever turning from false to true
(so the iteration ends):

- *only read in float32*: an elementwise equation whose every reader runs
  in float32 runs in float32 itself (``exp(x - max)`` subtracts in
  float32), at no cost, since its result is not stored in 16 bits. The
  fact passes through moves and selections (softmax's ``reduce_max``),
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

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from lossscale import _compat
from lossscale._autocast import _islands, _matmul, _weights
from lossscale._autocast import _rules as R
from lossscale._autocast._classes import (
    Cls,
    Info,
    is_float,
    of_conversion,
    of_value,
)
from lossscale._autocast._config import Config, JaxprCache
from lossscale._autocast._plan import (
    CONVERT,
    NARROW_MOVE,
    ROUNDING,
    EqnFacts,
    KindArgs,
    Mode,
    Node,
    Plan,
    eqn_facts,
    make_node,
    traced,
)

# Constants larger than this are not computed at trace time.
FOLD_SIZE = 4096
_NAMED = _compat.primitives_named(["mul", "div"])
# A product with a literal, or a quotient by one, keeps nothing for the
# backward pass (its derivative is the same scaling of the tangent).
_SCALINGS = {_NAMED["mul"]: (0, 1), _NAMED["div"]: (1,)}


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


# --- what a jaxpr's equations are, whatever the classes --------------------


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
_PLANS = JaxprCache()


def facts(jaxpr: Any) -> JaxprFacts:
    """The facts of ``jaxpr`` (computed once while it lives)."""
    return _FACTS.get(jaxpr, None, lambda: JaxprFacts(jaxpr))


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


class _Planning:
    """What one plan's making collects: the overrides it applied."""

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


class _Facts(NamedTuple):
    """The backward facts of each variable (each only turns true)."""

    only32: dict[Any, bool]
    demanded: dict[Any, bool]
    unrounded: dict[Any, bool]

    def of(self, eqn: Any) -> tuple[list[bool], list[bool], list[bool]]:
        """The facts of an equation's results, in the order ``_forward``
        takes them."""
        return (
            [self.only32.get(v, False) for v in eqn.outvars],
            [self.demanded.get(v, False) for v in eqn.outvars],
            [self.unrounded.get(v, False) for v in eqn.outvars],
        )

    def merged(self, new: _Facts) -> _Facts:
        """These facts or-ed with ``new``'s."""
        return _Facts(
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
    planning = _Planning(config, jf, analysis)
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
            )
    raise RuntimeError(  # pragma: no cover - each fact changes once
        "lossscale.autocast: the inference pass did not converge."
    )


def _same(a: Info, b: Info | None) -> bool:
    return b is not None and a.cls == b.cls and a.value is b.value


class _Rounds:
    """The fixed point of one plan, round by round. Each round goes
    forwards (every equation's node from its operands' classes and its
    results' facts) and backwards (what each variable's readers make of
    it); after the first, a round revisits only what changed: the
    equations whose operands' classes or results' facts changed, and the
    variables whose readers' nodes or results' facts did."""

    def __init__(
        self,
        planning: _Planning,
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
        self.known = _Facts({}, {}, {})  # the facts, merged over rounds
        self.new = _Facts({}, {}, {})  # the last backward round's
        self.first = True
        self.stale: set[Any] = set()  # variables whose facts just changed
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
            node, outs = _forward(
                self.planning, eqn, infos, *self.known.of(eqn)
            )
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
        """This round's facts, and per input of the jaxpr, whether it is
        read in float32 and whether it reaches a float32 operation."""
        new = self.new
        self.changed_new = set()
        for eqn in reversed(self.jf.eqns):
            for var in eqn.outvars:
                if not (self.first or self._dirty(var)):
                    continue
                u = self._uses(var)
                reads = [r for r, _ in u if r is not None]
                facts = (
                    bool(reads) and all(reads),
                    any(d for _, d in u),
                    _unrounded(self.jf, self.nodes, new, var),
                )
                old = (
                    new.only32.get(var),
                    new.demanded.get(var),
                    new.unrounded.get(var),
                )
                if facts != old:
                    self.changed_new.add(var)
                    new.only32[var], new.demanded[var], new.unrounded[var] = (
                        facts
                    )
        used = [self._uses(var) for var in self.jaxpr.invars]
        return (
            tuple(any(r for r, _ in u) for u in used),
            tuple(any(d for _, d in u) for u in used),
        )

    def merge(self) -> bool:
        """Or this round's facts into the known ones; whether any changed
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
    jf: JaxprFacts, nodes: dict[Any, Node], new: _Facts, eqn: Any, i: int
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
    jf: JaxprFacts, nodes: dict[Any, Node], new: _Facts, var: Any
) -> bool:
    """Whether some use of ``var`` does not round it to the compute dtype
    anyway (every use is a matmul's operand, through exact operations: a
    relu, max pooling, a reshape, which commute with the rounding)."""
    if var in jf.outputs:
        return True
    found = False
    for eqn, _ in jf.readers.get(var, ()):
        node = nodes[eqn]
        ef = jf.of[eqn]
        if node.mode in ROUNDING and ef.matmul:
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
    planning: _Planning,
    nodes: dict[Any, Node],
    consts: tuple[Cls, ...],
    ins: tuple[Cls, ...],
    outs: tuple[Cls, ...],
    reads32: tuple[bool, ...],
    demanded: tuple[bool, ...],
) -> Plan:
    jf = planning.facts
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
    )


def _member(jf: JaxprFacts, eqn: Any, node: Node) -> bool:
    """Whether an equation may be part of a float32 island: elementwise
    equations and data movement (no matmul), and calls of such only
    (``jax.nn.relu`` is a ``custom_jvp`` of a ``jax.jit``)."""
    ef = jf.of[eqn]
    if ef.scoped:
        return False
    if node.mode is Mode.HIGHER:
        return HIGHER[eqn.primitive].island and all(
            p.pure for p in node.data.plans
        )
    if eqn.primitive is CONVERT:
        return True
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
    if eqn.primitive is CONVERT:
        return False
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


# --- one equation -----------------------------------------------------------


def function_rule(config: Config, name: str | None) -> R.FunctionRule | None:
    """The rule of the function a call equation calls, if it has one."""
    return None if name is None else config.function_rule(name)


def _broadcast_in_dim(x: Any, shape: Any, broadcast_dimensions: Any, **_: Any):
    expanded = np.reshape(
        x,
        [
            np.shape(x)[broadcast_dimensions.index(d)]
            if d in broadcast_dimensions
            else 1
            for d in range(len(shape))
        ],
    )
    return np.broadcast_to(expanded, shape)


def _numpy_folds() -> dict[Any, Callable[..., Any]]:
    """NumPy for the equations most often folded (a ``jnp.full``, a
    scalar constant's arithmetic), by primitive: folding by binding runs
    an XLA computation, which compiles once per shape (tens of ms), to
    compute a value that only decides a class."""
    unary = {
        "neg": np.negative,
        "abs": np.abs,
        "sqrt": np.sqrt,
        "exp": np.exp,
        "log": np.log,
        "tanh": np.tanh,
        "sign": np.sign,
    }
    binary = {
        "add": np.add,
        "sub": np.subtract,
        "mul": np.multiply,
        "div": np.divide,
        "max": np.maximum,
        "min": np.minimum,
    }
    table: dict[str, Callable[..., Any]] = {
        "broadcast_in_dim": lambda x, **p: _broadcast_in_dim(x, **p),
        "reshape": lambda x, new_sizes, **_: np.reshape(x, new_sizes),
        "squeeze": lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions)),
        "transpose": lambda x, permutation, **_: np.transpose(x, permutation),
        "integer_pow": lambda x, y, **_: np.power(x, y),
        "square": lambda x, **_: np.square(x),
        "rsqrt": lambda x, **_: 1 / np.sqrt(x),
    }
    for name, f in unary.items():
        table[name] = lambda x, f=f, **_: f(x)
    for name, f in binary.items():
        table[name] = lambda x, y, f=f, **_: f(x, y)
    return {
        primitive: table[name]
        for name, primitive in _compat.primitives_named(table).items()
    }


FOLDS = _numpy_folds()


def _foldable_size(shape: Any) -> bool:
    """Whether a value of ``shape`` is small enough to fold: at most
    ``FOLD_SIZE`` elements, and of static size (a symbolic dimension of
    ``jax.export`` is not folded)."""
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        return False
    return math.prod(shape) <= FOLD_SIZE


def _fold(
    planning: _Planning,
    eqn: Any,
    infos: Sequence[Info],
    compute: Callable[[list[Any]], list[Any]] | None = None,
) -> Any:
    """The equation's results computed now (by binding it, or by
    ``compute`` of its operands' values), if its operands are known and
    its results small (checked before anything is computed); once while
    its jaxpr lives, so that each round of the fixed point, and each plan
    of the jaxpr, sees the same values."""
    if any(i.value is None for i in infos):
        return None
    key = tuple(id(i.value) for i in infos)
    folded = planning.facts.folded
    hit = folded.get(eqn)
    if hit is not None and hit[0] == key:
        return hit[1]
    values = None
    operands = [i.value for i in infos]
    numpy = FOLDS.get(eqn.primitive)
    if all(_foldable_size(v.aval.shape) for v in eqn.outvars):
        try:
            if compute is not None:
                values = compute(operands)
            elif numpy is not None:
                with np.errstate(all="ignore"):
                    out = numpy(*map(np.asarray, operands), **eqn.params)
                dtype = eqn.outvars[0].aval.dtype
                values = [np.asarray(out).astype(dtype)]
            else:
                with jax.ensure_compile_time_eval():
                    outs = _compat.bind_equation(eqn, operands)
                values = [np.asarray(o) for o in outs]
        except Exception:  # folding is only an optimisation
            values = None
    folded[eqn] = (key, values, operands)
    return values


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
    # selecting 16-bit values is exact: no reason to widen it (the
    # backward facts see through it instead: see ``uses``); nor a
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
        return node._replace(data=NARROW_MOVE), infos
    if Cls.F32 in a.floats or (a.float_outs and all(a.only32) and not exact):
        if Cls.LOW in a.floats and rounded:
            return a.result(Mode.FLOAT32, Cls.LOW)
        return a.result(Mode.FLOAT32, Cls.F32)
    return a.result(Mode.COMPUTE, Cls.LOW)


KINDS: dict[R.Kind, Callable[[KindArgs], tuple[Node, list[Info]]]] = {
    R.Kind.MATMUL: _matmul.matmul_rule,
    R.Kind.FLOAT8: _matmul.float8_rule,
    R.Kind.BOUNDED: _bounded,
    R.Kind.FLOAT32: _float32,
    R.Kind.PROMOTE: _promote,
}
"""This pass's rule for each kind of :mod:`._rules`."""


def _forward(
    planning: _Planning,
    eqn: Any,
    infos: list[Info],
    only32: list[bool],
    demanded: list[bool],
    unrounded: list[bool],
) -> tuple[Node, list[Info]]:
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
    if eqn.primitive is CONVERT:
        return _convert(planning, eqn, infos, compute)
    record, override = config.record(eqn.primitive)
    if override is not None:
        planning.used.add(("primitive", override))
    if record is None:
        return traced(eqn, infos, compute, ef)
    if floats <= {Cls.CONST16}:
        foldable = record.foldable and any(ef.float_out)
        values = _fold(planning, eqn, infos) if foldable else None
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
    args = KindArgs(
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
    )
    return KINDS[record.kind](args)


def _convert(
    planning: _Planning, eqn: Any, infos: Sequence[Info], compute: np.dtype
) -> tuple[Node, list[Info]]:
    """An explicit cast the traced program shows: kept."""
    (info,) = infos
    new = np.dtype(eqn.params["new_dtype"])
    values = _fold(
        planning, eqn, infos, lambda v: [np.asarray(v[0]).astype(new)]
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
