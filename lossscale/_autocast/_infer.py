"""The first pass: the precision class of every value, without binding.

:func:`infer` walks a jaxpr forwards and backwards until nothing changes,
and returns a :class:`Plan`: for each equation the dtype it runs in
(:class:`Node`) and the classes of its results. Nothing is traced here:
a loop's carry classes are found by iterating this pass over the loop's
body, and the plan of a jaxpr is memoised per input classes, so a
function called many times (a ``jax.jit``-ed block, a scan's body) is
inferred once.

Forwards, each equation's rule (:mod:`._rules`) picks its dtype from its
operands' classes: the result is float32 where a float operand is float32
(PyTorch's promotion), so a float32 value is never rounded to 16 bits
except as a matmul's or convolution's operand. Backwards, two facts flow
from readers to writers:

- *only read in float32*: an elementwise equation whose every reader runs
  in float32 runs in float32 itself (``exp(x - max)`` subtracts in
  float32), at no cost, since its result is not stored in 16 bits. The
  fact passes through moves and selections (softmax's ``reduce_max``),
  which stay 16-bit for a 16-bit operand (they are exact) but not through
  pooling; comparisons (``is_finite``) are not counted as readers;
- *demanded*: a bounded function (``sigmoid``, ``tanh``) whose result
  reaches a float32 operation, directly or through elementwise equations,
  keeps its result in float32 (``log(sigmoid(z))``, ``clip(p, eps,
  1 - eps)`` before a log).

Both only ever add float32, so the iteration ends.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from lossscale import _compat
from lossscale._autocast import _higher
from lossscale._autocast import _rules as R
from lossscale._autocast._classes import Cls, Info, is_float, of_dtype, of_value

FLOAT32_SCOPE = "lossscale_float32"
_SCOPE_RE = re.compile(r"(?:^|[/(])" + FLOAT32_SCOPE + r"(?:$|[/)])")
_FOLD_SIZE = 4096

# The rule autocast had before issue 28, for the tests' negative control
# only: an activation meeting a float32 value computed in float32 and
# rounded back to the compute dtype (-1e9 became -inf there), with no
# backward facts to catch it.
ROUND_MIXED = False


@dataclasses.dataclass(frozen=True, eq=False)
class Ctx:
    """One autocast function's configuration, and its caches."""

    compute: np.dtype
    rules: Mapping[str, R.Rule]
    function_rules: Mapping[str, R.FunctionRule]
    overrides: frozenset[tuple[str, str]] = frozenset()
    used: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    plans: dict[Any, Any] = dataclasses.field(default_factory=dict)
    # Facts about an equation or a literal that do not depend on classes,
    # by id (the plans keep the jaxprs, hence the ids, alive).
    facts: dict[int, Any] = dataclasses.field(default_factory=dict)
    functions: set[str] = dataclasses.field(default_factory=set)
    emitted: dict[Any, Any] = dataclasses.field(default_factory=dict)


class Node(NamedTuple):
    """The plan of one equation.

    ``mode``: ``"compute"`` (float operands cast to the compute dtype),
    ``"float32"`` (to float32), ``"traced"`` (to the dtypes the equation
    was traced with) or ``"higher"`` (a handler of :mod:`._higher` emits
    it from ``data``). ``outs``: the classes of its results, which the
    emitted values are stored in. ``reads32``: per operand, whether the
    equation reads it in float32.
    """

    mode: str
    ins: tuple[Cls, ...]
    outs: tuple[Cls, ...]
    reads32: tuple[bool, ...]
    data: Any = None
    remat: bool = False


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


def in_float32_scope(eqn: Any) -> bool:
    """Traced inside :func:`lossscale.float32_scope`, under any
    transformation (``vmap(lossscale_float32)``, ``transpose(jvp(...))``)."""
    return _SCOPE_RE.search(_compat.name_stack(eqn)) is not None


class _EqnFacts(NamedTuple):
    scoped: bool
    function: str | None


def _facts(ctx: Ctx, eqn: Any) -> _EqnFacts:
    hit = ctx.facts.get(id(eqn))
    if hit is None or hit[0] is not eqn:
        name = _compat.function_name(eqn)
        hit = (eqn, _EqnFacts(in_float32_scope(eqn), name))
        ctx.facts[id(eqn)] = hit
        if name is not None:
            ctx.functions.add(name)
    return hit[1]


def _literal(ctx: Ctx, atom: Any) -> Info:
    hit = ctx.facts.get(id(atom))
    if hit is None or hit[0] is not atom:
        value = _compat.literal_value(atom)
        info = Info(of_value(value, atom.aval.dtype, ctx.compute), value)
        hit = ctx.facts[id(atom)] = (atom, info)
    return hit[1]


def infer(
    ctx: Ctx,
    jaxpr: Any,
    consts: Sequence[Info],
    ins: Sequence[Cls],
    only32: Sequence[bool],
    demanded: Sequence[bool],
) -> Plan:
    """The plan of an open ``jaxpr`` for these classes (memoised)."""
    key = (
        id(jaxpr),
        tuple(c.cls for c in consts),
        tuple(ins),
        tuple(only32),
        tuple(demanded),
    )
    hit = ctx.plans.get(key)
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    plan = _infer(ctx, jaxpr, consts, tuple(ins), only32, demanded)
    # The jaxpr is kept with its plan, so that its id is not reused.
    ctx.plans[key] = (jaxpr, plan)
    return plan


def _infer(
    ctx: Ctx,
    jaxpr: Any,
    consts: Sequence[Info],
    ins: tuple[Cls, ...],
    out_only32: Sequence[bool],
    out_demanded: Sequence[bool],
) -> Plan:
    eqns = list(jaxpr.eqns)
    readers: dict[Any, list[tuple[Any, int]]] = {}
    for eqn in eqns:
        for i, atom in enumerate(eqn.invars):
            if _compat.is_var(atom):
                readers.setdefault(atom, []).append((eqn, i))
    outputs: dict[Any, list[int]] = {}
    for j, atom in enumerate(jaxpr.outvars):
        if _compat.is_var(atom):
            outputs.setdefault(atom, []).append(j)

    only32: dict[Any, bool] = {}
    demanded: dict[Any, bool] = {}
    rounded: dict[Any, bool] = {}
    n_vars = sum(len(e.outvars) for e in eqns)
    for round_ in range(3 * n_vars + 2):
        env: dict[Any, Info] = {}
        for var, info in zip(jaxpr.constvars, consts, strict=True):
            env[var] = info
        for var, cls in zip(jaxpr.invars, ins, strict=True):
            env[var] = Info(cls)

        def read(atom: Any, env: dict[Any, Info] = env) -> Info:
            if _compat.is_literal(atom):
                return _literal(ctx, atom)
            return env[atom]

        nodes: dict[Any, Node] = {}
        for eqn in eqns:
            infos = [read(a) for a in eqn.invars]
            node, outs = _forward(
                ctx,
                eqn,
                infos,
                [only32.get(v, False) for v in eqn.outvars],
                [demanded.get(v, False) for v in eqn.outvars],
                # "Rounded anyway" starts true and only becomes false:
                # the other facts only become true, from float32 a first
                # round would otherwise see where no float32 remains (a
                # bias add before a relu, pooling and a conv).
                [rounded.get(v, round_ == 0) for v in eqn.outvars],
            )
            nodes[eqn] = node
            for var, info in zip(eqn.outvars, outs, strict=True):
                env[var] = info
        out_classes = tuple(read(a).cls for a in jaxpr.outvars)

        # Backwards: what each variable's readers make of it.
        new_only32: dict[Any, bool] = {}
        new_demanded: dict[Any, bool] = {}
        new_rounded: dict[Any, bool] = {}

        def rounded_by(
            var: Any,
            nodes: dict[Any, Node] = nodes,
            new_rounded: dict[Any, bool] = new_rounded,
        ) -> bool:
            """Every use rounds it to the compute dtype anyway: a matmul's
            operand, through exact operations (a relu, max pooling, a
            reshape), which commute with the rounding."""
            if var in outputs:
                return False
            found = False
            for eqn, _ in readers.get(var, ()):
                node = nodes[eqn]
                name = eqn.primitive.name
                if node.mode == "compute" and name in R.MATMULS:
                    found = True
                    continue
                exact = (
                    name in R.RANGE_PRESERVING and node.mode != "convert"
                ) or (
                    node.mode == "higher"
                    and name in _ISLAND_CALLS
                    and all(p.exact for p in node.data.plans)
                )
                floats = [v for v in eqn.outvars if is_float(v.aval.dtype)]
                if not (exact and floats):
                    return False
                if not all(new_rounded.get(v, False) for v in floats):
                    return False
                found = True
            return found

        def uses(
            var: Any,
            nodes: dict[Any, Node] = nodes,
            new_demanded: dict[Any, bool] = new_demanded,
            new_only32: dict[Any, bool] = new_only32,
        ) -> list[tuple[bool | None, bool]]:
            """(reads it in float32, makes it demanded) per use; None for
            a comparison (``is_finite(m)``, ``h > 0``), which reads it at
            whatever dtype it has: it neither widens it nor keeps it 16-bit."""
            result: list[tuple[bool | None, bool]] = []
            for eqn, i in readers.get(var, ()):
                node = nodes[eqn]
                name = eqn.primitive.name
                float_outs = [v for v in eqn.outvars if is_float(v.aval.dtype)]
                if (
                    node.mode == "compute"
                    and name not in R.MATMULS
                    and not float_outs
                ):
                    result.append((None, False))
                    continue
                # A matmul rounds its operands whatever reads its result.
                passes = name not in R.MATMULS and any(
                    new_demanded.get(v, False) for v in eqn.outvars
                )
                if node.mode == "higher":
                    passes = bool(node.data.demanded[i])
                reads32 = node.reads32[i] or (
                    # A move or selection whose results only float32 reads
                    # is seen through: it stays 16-bit for a 16-bit operand
                    # (exact), and is float32 for a float32 one, so that
                    # softmax's max subtraction does not keep the scores
                    # 16-bit (``softmax((x @ w) * 1e3)`` scales in float32).
                    node.mode == "compute"
                    and name in R.RANGE_PRESERVING
                    and name not in R.POOLING
                    and all(new_only32.get(v, False) for v in float_outs)
                )
                result.append((reads32, node.reads32[i] or passes))
            for j in outputs.get(var, ()):
                result.append((out_only32[j], out_demanded[j]))
            return result

        for eqn in reversed(eqns):
            for var in eqn.outvars:
                u = uses(var)
                reads = [r for r, _ in u if r is not None]
                new_only32[var] = bool(reads) and all(reads)
                new_demanded[var] = any(d for _, d in u)
                new_rounded[var] = rounded_by(var)
        in_reads32 = []
        in_demanded = []
        for var in jaxpr.invars:
            u = uses(var)
            in_reads32.append(any(r for r, _ in u))
            in_demanded.append(any(d for _, d in u))
        # Each fact changes at most once (float32 facts only become true,
        # "rounded anyway" only false), so the iteration ends.
        first = round_ == 0
        acc_only32 = {
            v: f or only32.get(v, False) for v, f in new_only32.items()
        }
        acc_demanded = {
            v: f or demanded.get(v, False) for v, f in new_demanded.items()
        }
        acc_rounded = {
            v: f and (first or rounded.get(v, False))
            for v, f in new_rounded.items()
        }
        if (
            acc_only32 == only32
            and acc_demanded == demanded
            and acc_rounded == rounded
        ):
            members = _members(ctx, eqns, nodes)
            return Plan(
                nodes,
                tuple(c.cls for c in consts),
                ins,
                out_classes,
                tuple(in_reads32),
                tuple(in_demanded),
                _islands(eqns, nodes, members),
                all(members),
                _exact(eqns, nodes),
            )
        only32, demanded, rounded = acc_only32, acc_demanded, acc_rounded

    raise AssertionError(  # pragma: no cover - each fact changes once
        "lossscale.autocast: the inference pass did not converge."
    )


def _members(
    ctx: Ctx, eqns: Sequence[Any], nodes: Mapping[Any, Node]
) -> list[bool]:
    """Which equations may be part of a float32 island: elementwise ones
    and data movement (no matmul), and calls of such only (``jax.nn.relu``
    is a ``custom_jvp`` of a ``jax.jit``)."""

    def member(eqn: Any) -> bool:
        node = nodes[eqn]
        name = eqn.primitive.name
        if _facts(ctx, eqn).scoped:
            return False
        if node.mode == "higher":
            return name in _ISLAND_CALLS and all(
                p.pure for p in node.data.plans
            )
        return (
            node.mode in ("compute", "float32", "traced", "convert")
            and name not in R.MATMULS
            and (name in R.PRIMITIVE_RULES or name == "convert_element_type")
        )

    return [member(e) for e in eqns]


_ISLAND_CALLS = frozenset({"jit", "pjit", "custom_jvp_call"})


def _exact(eqns: Sequence[Any], nodes: Mapping[Any, Node]) -> bool:
    """Whether a jaxpr only moves, selects and compares values (a relu):
    rounding its operands or its results gives the same values."""
    for eqn in eqns:
        node = nodes[eqn]
        name = eqn.primitive.name
        if node.mode == "higher":
            if name not in _ISLAND_CALLS or not all(
                p.exact for p in node.data.plans
            ):
                return False
        elif not (
            name in R.RANGE_PRESERVING
            or not any(is_float(v.aval.dtype) for v in eqn.outvars)
        ):
            return False
    return True


def _islands(
    eqns: Sequence[Any], nodes: Mapping[Any, Node], members: Sequence[bool]
) -> dict:
    """Runs of consecutive elementwise equations that read a compute-dtype
    activation in float32 (a bias add and the GELU after it, a norm's
    output, a bias, relu and max pooling): each is emitted under
    ``jax.checkpoint``, so that the backward pass keeps the 16-bit
    activation it starts from, not the float32 values it computes, and
    recomputes them (they are cheap)."""

    def upcast(eqn: Any) -> bool:
        node = nodes[eqn]
        return node.mode == "float32" and Cls.LOW in node.ins

    islands = {}
    i = 0
    while i < len(eqns):
        if not members[i]:
            i += 1
            continue
        j = i
        while j < len(eqns) and members[j]:
            j += 1
        if j - i >= 2 and any(upcast(e) for e in eqns[i:j]):
            islands[i] = j
        i = j
    return islands


# --- one equation -----------------------------------------------------------


def _traced(ctx: Ctx, eqn: Any, infos: Sequence[Info]) -> tuple[Node, list]:
    """The equation at the dtypes it was traced with."""
    outs = [of_dtype(v.aval.dtype, ctx.compute) for v in eqn.outvars]
    return _node(ctx, eqn, "traced", infos, outs), [Info(c) for c in outs]


def _node(
    ctx: Ctx,
    eqn: Any,
    mode: str,
    infos: Sequence[Info],
    outs: Sequence[Cls],
    remat: bool = False,
) -> Node:
    reads32 = []
    for atom, info in zip(eqn.invars, infos, strict=True):
        float_in = is_float(atom.aval.dtype) and info.cls != Cls.KEEP
        if mode == "float32":
            reads32.append(float_in)
        elif mode == "traced":
            reads32.append(float_in and np.dtype(atom.aval.dtype) == np.float32)
        else:
            reads32.append(False)
    return Node(
        mode,
        tuple(i.cls for i in infos),
        tuple(outs),
        tuple(reads32),
        None,
        remat,
    )


def _rule(ctx: Ctx, name: str) -> R.Rule | None:
    if ("primitive", name) in ctx.overrides:
        ctx.used.add(("primitive", name))
    return ctx.rules.get(name)


def function_rule(ctx: Ctx, eqn: Any) -> R.FunctionRule | None:
    """The function rule of a call equation, if its function has one."""
    name = _facts(ctx, eqn).function
    if name is None or name not in ctx.function_rules:
        return None
    if ("function", name) in ctx.overrides:
        ctx.used.add(("function", name))
    return ctx.function_rules[name]


def _fold(eqn: Any, infos: Sequence[Info]) -> list[Any] | None:
    """The equation's results computed now, if its operands are known."""
    if any(i.value is None for i in infos):
        return None
    try:
        with jax.ensure_compile_time_eval():
            outs = _compat.bind_equation(eqn, [i.value for i in infos])
        values = [np.asarray(o) for o in outs]
    except Exception:  # folding is only an optimisation
        return None
    if any(v.size > _FOLD_SIZE for v in values):
        return None
    return values


def _forward(
    ctx: Ctx,
    eqn: Any,
    infos: list[Info],
    only32: list[bool],
    demanded: list[bool],
    rounded: list[bool],
) -> tuple[Node, list[Info]]:
    name = eqn.primitive.name
    facts = _facts(ctx, eqn)
    if facts.scoped:
        return _traced(ctx, eqn, infos)
    handler = _higher.HANDLERS.get(name)
    if handler is not None or facts.function is not None:
        if function_rule(ctx, eqn) in ("float32", "original"):
            return _traced(ctx, eqn, infos)
        if handler is None:
            return _traced(ctx, eqn, infos)  # custom_vjp: run whole
        node = handler.infer(ctx, eqn, infos, only32, demanded)
        return node, [Info(c) for c in node.outs]
    if any(
        i.cls == Cls.KEEP and is_float(a.aval.dtype)
        for i, a in zip(infos, eqn.invars, strict=True)
    ):
        return _traced(ctx, eqn, infos)
    if name == "convert_element_type":
        return _convert(ctx, eqn, infos)
    rule = _rule(ctx, name)
    floats = {
        i.cls
        for i, a in zip(infos, eqn.invars, strict=True)
        if is_float(a.aval.dtype)
    }
    float_outs = [is_float(v.aval.dtype) for v in eqn.outvars]

    def result(mode: str, cls: Cls, remat: bool = False) -> tuple[Node, list]:
        outs = [cls if f else Cls.KEEP for f in float_outs]
        return _node(ctx, eqn, mode, infos, outs, remat), [
            Info(c) for c in outs
        ]

    if rule is None or rule == "original":
        return _traced(ctx, eqn, infos)
    if not floats <= {Cls.CONST}:
        pass
    elif (values := _constant(eqn, rule, infos)) is not None:
        outs = [
            of_value(v, a.aval.dtype, ctx.compute)
            for v, a in zip(values, eqn.outvars, strict=True)
        ]
        return _node(ctx, eqn, "traced", infos, outs), [
            Info(c, v) for c, v in zip(outs, values, strict=True)
        ]
    elif floats and name in R.RANGE_PRESERVING:
        return result("traced", Cls.CONST)
    else:
        return _traced(ctx, eqn, infos)

    if rule == "compute":
        if name in R.MATMULS:
            if _compat.explicit_precision(eqn):
                # precision=HIGHEST (or HIGH) asks for float32 products.
                return _traced(ctx, eqn, infos)
            return result("compute", Cls.LOW)
        # A bounded function: computed in float32 from a float32 operand,
        # and kept in float32 where a float32 operation reads it.
        if any(demanded):
            return result("float32", Cls.F32)
        if Cls.F32 in floats:
            return result("float32", Cls.LOW)
        return result("compute", Cls.LOW)
    if rule == "float32":
        remat = name in R.REMATERIALIZED and Cls.LOW in floats
        return result("float32", Cls.F32, remat)
    # "promote": PyTorch's promotion, and float32 where only float32 reads.
    if ROUND_MIXED and Cls.LOW in floats:
        return result("float32", Cls.LOW)
    # Moving or selecting 16-bit values is exact: no reason to widen it
    # (the backward pass inference sees through it instead: see ``uses``);
    # nor a collective, which moves 16 bits between devices where 32
    # would cost twice the bytes (a tensor-parallel all-reduce).
    exact = (
        name in R.RANGE_PRESERVING or name in R.COLLECTIVES
    ) and floats <= {Cls.LOW, Cls.CONST}
    if Cls.F32 in floats or (float_outs and all(only32) and not exact):
        # A result every use rounds anyway (a bias add before a relu and
        # the next matmul) is rounded here, once: the same values, and
        # 16 bits for the backward pass to keep.
        float_rounded = [
            r for r, f in zip(rounded, float_outs, strict=True) if f
        ]
        if Cls.LOW in floats and float_rounded and all(float_rounded):
            return result("float32", Cls.LOW)
        return result("float32", Cls.F32)
    return result("compute", Cls.LOW)


def _constant(eqn: Any, rule: str, infos: Sequence[Info]) -> list | None:
    if eqn.primitive.name not in R.FOLDABLE:
        return None
    return _fold(eqn, infos)


def _convert(
    ctx: Ctx, eqn: Any, infos: Sequence[Info]
) -> tuple[Node, list[Info]]:
    """An explicit cast the traced program shows: kept."""
    (info,) = infos
    new = np.dtype(eqn.params["new_dtype"])
    value = None
    if info.value is not None:
        value = np.asarray(info.value).astype(new)
    if not is_float(new):
        out = Cls.KEEP
    elif new == ctx.compute:
        out = Cls.LOW
    elif new == np.float32:
        out = Cls.CONST if info.cls == Cls.CONST else Cls.F32
    else:
        out = Cls.KEEP
    node = Node("convert", (info.cls,), (out,), (False,))
    return node, [Info(out, value)]
