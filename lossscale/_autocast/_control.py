"""Control flow: ``scan``, ``while`` and ``cond``, inferred and emitted
with the rules.

A loop's carry classes are a fixed point, found by planning its body
until the classes it returns are those it is given
(:func:`_carry_fixed_point`); a ``while_loop``'s stopping decision is
computed in float32, as the loop traced it (:func:`_deciding_carries`);
a ``cond``'s outputs are joined over its branches.

``while`` and ``cond`` are re-bound as themselves, every parameter kept
and only their jaxprs replaced; ``scan`` too, unless its re-traced body
has constants: then it is rebuilt through ``lax.scan`` with the
parameters it takes (:func:`lossscale._compat.scan_options`, which
refuses one it cannot pass). The handlers are registered by
:mod:`._handlers`; what they share is in :mod:`._higher`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jax import lax

from lossscale import _compat
from lossscale._autocast import _emit, _infer
from lossscale._autocast._cast import dtype_of, store
from lossscale._autocast._classes import Cls, Info, join, of_dtype
from lossscale._autocast._config import Call, Config
from lossscale._autocast._higher import (
    _args,
    _avals,
    _emitted,
    _higher_node,
    _outs,
    _trace,
    closed_consts,
)
from lossscale._autocast._plan import Node, Plan

# --- loops ---------------------------------------------------------------


def _carry_start(ins: Sequence[Info]) -> list[Cls]:
    """A carry that starts float32 (an accumulator, a statistic, a
    counter) stays float32; an activation carry starts in its class."""
    return [Cls.F32 if i.cls == Cls.CONST16 else i.cls for i in ins]


def _carry_fixed_point(
    carry: list[Cls], body: Callable[[list[Cls]], tuple[Plan, Sequence[Cls]]]
) -> tuple[list[Cls], Plan]:
    """The carry classes the body returns as it is given them (the join
    only goes up a finite lattice, so this ends)."""
    for _ in range(len(Cls) * (len(carry) + 1)):
        plan, returned = body(carry)
        joined = [join(a, b) for a, b in zip(carry, returned, strict=True)]
        if joined == carry:
            return carry, plan
        carry = joined
    raise RuntimeError(  # pragma: no cover - the join is monotone
        "lossscale.autocast: a loop's carry classes did not converge."
    )


def _scan_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    p = eqn.params
    closed = p["jaxpr"]
    n_consts, n_carry = _compat.scan_counts(p)
    consts = [i.cls for i in ins[:n_consts]]
    xs = [i.cls for i in ins[n_consts + n_carry :]]
    jconsts = closed_consts(config, closed)

    def body(carry: list[Cls]) -> tuple[Plan, Sequence[Cls]]:
        f32 = [c == Cls.F32 for c in carry]
        plan = _infer.infer(
            config,
            closed.jaxpr,
            jconsts,
            [*consts, *carry, *xs],
            [*f32, *only32[n_carry:]],
            [*f32, *demanded[n_carry:]],
        )
        return plan, plan.outs[:n_carry]

    carry_ins = ins[n_consts : n_consts + n_carry]
    carry, plan = _carry_fixed_point(_carry_start(carry_ins), body)
    outs = [*carry, *plan.outs[n_carry:]]
    # A carry's class is the loop's fixed point, not its start's: only
    # the consts and xs may come in rounded.
    rounded = list(plan.rounded)
    rounded[n_consts : n_consts + n_carry] = [False] * n_carry
    return _higher_node(
        ins, outs, plan.reads32, [plan], plan.demanded, rounded=rounded
    )


def _scan_emit(call: Call, eqn: Any, node: Node, invals: list[Any]) -> list:
    """A ``scan`` re-bound with its body replaced (every param kept), or,
    where its body cannot be re-traced without constants, rebuilt through
    ``lax.scan`` with the params it takes."""
    p = eqn.params
    closed = p["jaxpr"]
    (plan,) = node.data.plans
    n_consts, n_carry = _compat.scan_counts(p)
    atoms = closed.jaxpr.invars
    args = _args(call, invals, plan.ins, atoms)
    jconsts = store(closed.consts, plan.consts, call.compute)
    carry_classes = plan.ins[n_consts : n_consts + n_carry]
    carry_dtypes = [a.aval.dtype for a in atoms[n_consts : n_consts + n_carry]]

    def body(*xs: Any) -> list[Any]:
        outs = _emit.emit(call, closed.jaxpr, plan, jconsts, xs)
        new = _outs(call, outs[:n_carry], carry_classes, carry_dtypes)
        return [*new, *outs[n_carry:]]

    # The body's abstract operands: the constants and carries as given,
    # one slice of each scanned array.
    slices = [
        _compat.retyped(a.aval, dtype_of(x))
        for a, x in zip(
            atoms[n_consts + n_carry :], args[n_consts + n_carry :], strict=True
        )
    ]
    new = _emitted(
        closed.jaxpr,
        ("scan", id(plan), _avals(args[: n_consts + n_carry]), tuple(slices)),
        lambda: _trace(body, [*args[: n_consts + n_carry], *slices]),
    )
    if not new.consts:
        return _compat.rebind(eqn, args, jaxpr=new)
    consts = args[:n_consts]
    carry, ys = lax.scan(
        lambda c, x: _split(body(*consts, *c, *x), n_carry),
        args[n_consts : n_consts + n_carry],
        args[n_consts + n_carry :],
        **_compat.scan_options(p),
    )
    return [*carry, *ys]


def _split(outs: list[Any], n: int) -> tuple[list[Any], list[Any]]:
    return outs[:n], outs[n:]


def _dependencies(jaxpr: Any) -> list[frozenset[int]]:
    """For each output of ``jaxpr``, the indices of the inputs it depends
    on (through any equation: a higher-order one's outputs are taken to
    depend on all its operands)."""
    deps: dict[Any, frozenset[int]] = {
        v: frozenset((k,)) for k, v in enumerate(jaxpr.invars)
    }

    def of(atom: Any) -> frozenset[int]:
        return (
            deps.get(atom, frozenset()) if _compat.is_var(atom) else frozenset()
        )

    for eqn in jaxpr.eqns:
        found = frozenset().union(*(of(a) for a in eqn.invars))
        for v in eqn.outvars:
            deps[v] = found
    return [of(a) for a in jaxpr.outvars]


def _deciding_carries(eqn: Any) -> list[bool]:
    """Per carry of a ``while``, whether the loop's stopping decision
    depends on it: its condition reads it, or the body computes such a
    carry from it, at any remove (a ``converged`` flag computed from a
    float iterate, a counter ``t += 1e-3`` its condition compares)."""
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond = p["cond_jaxpr"].jaxpr
    body = p["body_jaxpr"].jaxpr
    (decision,) = _dependencies(cond)
    deciding = {k - n_cond for k in decision if k >= n_cond}
    by_body = [
        {k - n_body for k in d if k >= n_body} for d in _dependencies(body)
    ]
    todo = list(deciding)
    while todo:
        for k in by_body[todo.pop()] - deciding:
            deciding.add(k)
            todo.append(k)
    return [k in deciding for k in range(len(by_body))]


def _while_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    """A ``while_loop``'s stopping decision is computed as float32 would
    compute it: the carries it depends on, and every operation of the body
    computing them, run at their traced dtypes (float32), so that the loop
    stops where float32 stops; its other carries are cast as everywhere
    else."""
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    body_closed, cond_closed = p["body_jaxpr"], p["cond_jaxpr"]
    bconsts = [i.cls for i in ins[n_cond : n_cond + n_body]]
    cconsts = [i.cls for i in ins[:n_cond]]
    deciding = _deciding_carries(eqn)
    carry_ins = ins[n_cond + n_body :]
    start = [
        of_dtype(v.aval.dtype, config.compute) if d else c
        for v, d, c in zip(
            body_closed.jaxpr.invars[n_body:],
            deciding,
            _carry_start(carry_ins),
            strict=True,
        )
    ]

    def body(carry: list[Cls]) -> tuple[Plan, Sequence[Cls]]:
        f32 = [c == Cls.F32 for c in carry]
        plan = _infer.infer(
            config,
            body_closed.jaxpr,
            closed_consts(config, body_closed),
            [*bconsts, *carry],
            f32,
            f32,
            deciding,
        )
        return plan, plan.outs

    carry, plan = _carry_fixed_point(start, body)
    cond_plan = _infer.infer(
        config,
        cond_closed.jaxpr,
        closed_consts(config, cond_closed),
        [*cconsts, *carry],
        [False],
        [False],
        [True],
    )
    reads32 = [
        *cond_plan.reads32[:n_cond],
        *plan.reads32[:n_body],
        *(c == Cls.F32 for c in carry),
    ]
    dem = [
        *cond_plan.demanded[:n_cond],
        *plan.demanded[:n_body],
        *(c == Cls.F32 for c in carry),
    ]
    return _higher_node(ins, carry, reads32, [cond_plan, plan], dem)


def _while_emit(call: Call, eqn: Any, node: Node, invals: list[Any]) -> list:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_plan, plan = node.data.plans
    body_closed, cond_closed = p["body_jaxpr"], p["cond_jaxpr"]
    carry_atoms = body_closed.jaxpr.invars[n_body:]
    cconsts = _args(
        call,
        invals[:n_cond],
        cond_plan.ins[:n_cond],
        cond_closed.jaxpr.invars[:n_cond],
    )
    bconsts = _args(
        call,
        invals[n_cond : n_cond + n_body],
        plan.ins[:n_body],
        body_closed.jaxpr.invars[:n_body],
    )
    carry_classes = plan.ins[n_body:]
    carry = _args(call, invals[n_cond + n_body :], carry_classes, carry_atoms)
    dtypes = [a.aval.dtype for a in carry_atoms]
    bjc = store(body_closed.consts, plan.consts, call.compute)
    cjc = store(cond_closed.consts, cond_plan.consts, call.compute)

    def body_fn(*xs: Any) -> list[Any]:
        outs = _emit.emit(call, body_closed.jaxpr, plan, bjc, xs)
        return _outs(call, outs, carry_classes, dtypes)

    def cond_fn(*xs: Any) -> list[Any]:
        return _emit.emit(call, cond_closed.jaxpr, cond_plan, cjc, xs)

    new_body = _trace(body_fn, [*bconsts, *carry])
    new_cond = _trace(cond_fn, [*cconsts, *carry])
    if new_body.consts or new_cond.consts:
        raise _compat.UnknownParams("constants in a re-traced while body")
    return _compat.rebind(
        eqn,
        [*cconsts, *bconsts, *carry],
        cond_jaxpr=new_cond,
        body_jaxpr=new_body,
    )


# --- cond ----------------------------------------------------------------


def _cond_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    branches = eqn.params["branches"]
    operands = [i.cls for i in ins[1:]]
    outs: list[Cls] | None = None
    plans: list[Plan] = []
    # Each round only joins upwards, in a lattice of len(Cls) classes.
    for _ in range(len(Cls) * (len(eqn.outvars) + 1)):
        plans = []
        joined: list[Cls] | None = None
        # A branch output another branch returns in float32 is float32:
        # each branch is planned knowing its outputs are read so.
        read = list(only32)
        dem = list(demanded)
        if outs is not None:
            read = [r or c == Cls.F32 for r, c in zip(read, outs, strict=True)]
            dem = [d or c == Cls.F32 for d, c in zip(dem, outs, strict=True)]
        for closed in branches:
            plan = _infer.infer(
                config,
                closed.jaxpr,
                closed_consts(config, closed),
                operands,
                read,
                dem,
            )
            plans.append(plan)
            joined = (
                list(plan.outs)
                if joined is None
                else [
                    join(a, b) for a, b in zip(joined, plan.outs, strict=True)
                ]
            )
        if joined == outs:
            break
        outs = joined
    else:
        raise RuntimeError(  # pragma: no cover - the join is monotone
            "lossscale.autocast: a conditional's output classes did not "
            "converge."
        )
    assert outs is not None  # the loop ran at least once
    reads32 = [False] + [
        any(p.reads32[k] for p in plans) for k in range(len(operands))
    ]
    dem_in = [False] + [
        any(p.demanded[k] for p in plans) for k in range(len(operands))
    ]
    return _higher_node(ins, outs, reads32, plans, dem_in)


def _cond_emit(call: Call, eqn: Any, node: Node, invals: list[Any]) -> list:
    """A ``cond`` re-bound with its branches replaced, so that every param
    (``branches_platforms`` of ``lax.platform_dependent``) is kept."""
    branches = eqn.params["branches"]
    plans = node.data.plans
    index, operands = invals[0], invals[1:]
    args = _args(call, operands, plans[0].ins, eqn.invars[1:])
    traced = [v.aval.dtype for v in eqn.outvars]
    new = []
    for closed, plan in zip(branches, plans, strict=True):
        consts = store(closed.consts, plan.consts, call.compute)

        def branch(*xs: Any, closed=closed, plan=plan, consts=consts) -> list:
            outs = _emit.emit(call, closed.jaxpr, plan, consts, xs)
            return _outs(call, outs, node.outs, traced)

        jaxpr = _trace(branch, args)
        if jaxpr.consts:
            raise _compat.UnknownParams("constants in a re-traced branch")
        new.append(jaxpr)
    return _compat.rebind(eqn, [index, *args], branches=tuple(new))
