"""Higher-order primitives: their jaxprs inferred and emitted with the rules.

One table, :data:`HANDLERS`, from a primitive's name to its
:class:`Handler`: ``infer`` plans the equation from its operands'
classes (recursing into its jaxprs with :func:`._infer.infer`, memoised),
``emit`` binds it from that plan.

Each is re-bound as itself where JAX allows it, with every parameter kept
and only its jaxprs replaced (``jit``, ``cond``, ``while``,
``checkpoint``): a ``jax.jit``-ed block called many times is re-emitted
once, as one jaxpr that JAX's caches see as one function. ``scan`` and
``shard_map`` are rebuilt through ``lax.scan`` and ``jax.shard_map``,
whose parameters are checked first (:func:`lossscale._compat.
scan_options`): one autocast does not know runs the equation at its
traced dtypes, with a warning naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import numpy as np
from jax import lax

from lossscale import _compat
from lossscale._autocast import _emit, _infer
from lossscale._autocast._classes import (
    Cls,
    Info,
    is_float,
    join,
    of_dtype,
    of_value,
)
from lossscale._autocast._infer import Ctx, Node, Plan

_FITS_SIZE = 1 << 16


class Handler(NamedTuple):
    infer: Callable[..., Node]
    emit: Callable[..., list[Any]]


class _Data(NamedTuple):
    """What a handler's node keeps: the plans of its jaxprs, and which
    operands reach a float32 operation inside (``demanded``)."""

    plans: tuple[Plan, ...]
    demanded: tuple[bool, ...]
    extra: Any = None


def const_infos(ctx: Ctx, consts: Sequence[Any]) -> list[Info]:
    """A closed jaxpr's constants: classed by their values where they are
    known and small enough to read."""
    infos = []
    for c in consts:
        dtype = _emit.dtype_of(c)
        cls = of_dtype(dtype, ctx.compute)
        if (
            cls == Cls.F32
            and not _compat.is_tracer(c)
            and int(np.size(c)) <= _FITS_SIZE
        ):
            value = np.asarray(c)
            cls = of_value(value, dtype, ctx.compute)
            infos.append(Info(cls, value if value.size <= 4096 else None))
        else:
            infos.append(Info(cls))
    return infos


def _node(
    ins: Sequence[Info],
    outs: Sequence[Cls],
    reads32: Sequence[bool],
    plans: Sequence[Plan],
    demanded: Sequence[bool],
    extra: Any = None,
) -> Node:
    return Node(
        "higher",
        tuple(i.cls for i in ins),
        tuple(outs),
        tuple(reads32),
        _Data(tuple(plans), tuple(demanded), extra),
    )


def _args(
    ctx: Ctx, xs: Sequence[Any], classes: Sequence[Cls], atoms: Sequence[Any]
) -> list[Any]:
    """Operands stored for the classes a jaxpr is planned for."""
    return [
        _emit.as_class(ctx, x, c, a.aval.dtype)
        for x, c, a in zip(xs, classes, atoms, strict=True)
    ]


def _trace(fun: Callable[..., list[Any]], args: Sequence[Any]) -> Any:
    """``fun`` traced to a closed jaxpr on ``args``' abstract values."""
    return jax.make_jaxpr(lambda *xs: fun(*xs))(*args)


def _memo(ctx: Ctx, key: Any, make: Callable[[], Any]) -> Any:
    hit = ctx.emitted.get(key)
    if hit is None:
        hit = ctx.emitted[key] = make()
    return hit


def _avals(xs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(jax.typeof(x) for x in xs)


# --- calls: jit ---------------------------------------------------------------


def _call_infer(
    ctx: Ctx, eqn: Any, ins: list[Info], only32: list[bool], demanded: list
) -> Node:
    plan = _closed_plan(ctx, _compat.call_jaxpr(eqn), ins, only32, demanded)
    return _node(ins, plan.outs, plan.reads32, [plan], plan.demanded)


def _closed_plan(
    ctx: Ctx, closed: Any, ins: list[Info], only32: list, demanded: list
) -> Plan:
    """The plan of a closed jaxpr called on operands of these classes."""
    return _infer.infer(
        ctx,
        closed.jaxpr,
        const_infos(ctx, closed.consts),
        [i.cls for i in ins],
        only32,
        demanded,
    )


def _call_emit(ctx: Ctx, eqn: Any, node: Node, invals: list[Any]) -> list:
    """A ``jax.jit`` re-bound with its jaxpr evaluated by its plan, once
    per plan and operand types: called 48 times, it is one function."""
    closed = _compat.call_jaxpr(eqn)
    (plan,) = node.data.plans
    args = _args(ctx, invals, plan.ins, eqn.invars)
    consts = _emit.store(ctx, closed.consts, plan.consts)

    def body(*xs: Any) -> list[Any]:
        return _emit.emit(ctx, closed.jaxpr, plan, consts, xs)

    if not _compat.is_jit(eqn):
        return body(*args)
    new = _memo(
        ctx,
        ("call", id(plan), _avals(args)),
        lambda: (plan, _trace(body, args)),
    )[1]
    return _compat.rebind(eqn, args, jaxpr=new)


# --- loops ---------------------------------------------------------------


def _carry_start(ins: Sequence[Info]) -> list[Cls]:
    """A carry that starts float32 (an accumulator, a statistic, a
    counter) stays float32; an activation carry starts in its class."""
    return [Cls.F32 if i.cls == Cls.CONST else i.cls for i in ins]


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
    raise AssertionError(  # pragma: no cover - the join is monotone
        "lossscale.autocast: a loop's carry classes did not converge."
    )


def _scan_infer(
    ctx: Ctx, eqn: Any, ins: list[Info], only32: list[bool], demanded: list
) -> Node:
    p = eqn.params
    closed = p["jaxpr"]
    n_consts, n_carry = _compat.scan_counts(p)
    consts = [i.cls for i in ins[:n_consts]]
    xs = [i.cls for i in ins[n_consts + n_carry :]]
    jconsts = const_infos(ctx, closed.consts)
    n_ys = len(closed.jaxpr.outvars) - n_carry

    def body(carry: list[Cls]) -> tuple[Plan, Sequence[Cls]]:
        f32 = [c == Cls.F32 for c in carry]
        plan = _infer.infer(
            ctx,
            closed.jaxpr,
            jconsts,
            [*consts, *carry, *xs],
            [*f32, *only32[n_carry:]],
            [*f32, *demanded[n_carry:]],
        )
        return plan, plan.outs[:n_carry]

    carry, plan = _carry_fixed_point(
        _carry_start(ins[n_consts : n_consts + n_carry]), body
    )
    outs = [*carry, *plan.outs[n_carry:]]
    assert len(outs) == n_carry + n_ys
    return _node(ins, outs, plan.reads32, [plan], plan.demanded)


def _scan_emit(ctx: Ctx, eqn: Any, node: Node, invals: list[Any]) -> list:
    """A ``scan`` re-bound with its body replaced (every param kept), or,
    where its body cannot be re-traced without constants, rebuilt through
    ``lax.scan`` with the params it takes."""
    p = eqn.params
    closed = p["jaxpr"]
    (plan,) = node.data.plans
    n_consts, n_carry = _compat.scan_counts(p)
    atoms = closed.jaxpr.invars
    args = _args(ctx, invals, plan.ins, atoms)
    jconsts = _emit.store(ctx, closed.consts, plan.consts)
    carry_classes = plan.ins[n_consts : n_consts + n_carry]
    carry_dtypes = [a.aval.dtype for a in atoms[n_consts : n_consts + n_carry]]

    def body(*xs: Any) -> list[Any]:
        outs = _emit.emit(ctx, closed.jaxpr, plan, jconsts, xs)
        new = [
            _emit.as_class(ctx, v, k, t)
            for v, k, t in zip(
                outs[:n_carry], carry_classes, carry_dtypes, strict=True
            )
        ]
        return [*new, *outs[n_carry:]]

    # The body's abstract operands: the constants and carries as given,
    # one slice of each scanned array.
    slices = [
        _compat.retyped(a.aval, _emit.dtype_of(x))
        for a, x in zip(
            atoms[n_consts + n_carry :], args[n_consts + n_carry :], strict=True
        )
    ]
    new = _memo(
        ctx,
        ("scan", id(plan), _avals(args[: n_consts + n_carry]), tuple(slices)),
        lambda: (plan, _trace(body, [*args[: n_consts + n_carry], *slices])),
    )[1]
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


def _cond_reads_floats(eqn: Any) -> bool:
    """Whether a ``while``'s condition reads a floating carry."""
    cond = eqn.params["cond_jaxpr"].jaxpr
    n = eqn.params["cond_nconsts"]
    used = set()
    for e in cond.eqns:
        used.update(a for a in e.invars if _compat.is_var(a))
    used.update(a for a in cond.outvars if _compat.is_var(a))
    return any(v in used and is_float(v.aval.dtype) for v in cond.invars[n:])


def _while_infer(
    ctx: Ctx, eqn: Any, ins: list[Info], only32: list[bool], demanded: list
) -> Node:
    p = eqn.params
    if _cond_reads_floats(eqn):
        # A loop that stops on a float value (a tolerance, a counter of
        # float steps) runs as traced: it stops where float32 stops.
        outs = [of_dtype(v.aval.dtype, ctx.compute) for v in eqn.outvars]
        reads32 = [
            is_float(a.aval.dtype) and i.cls != Cls.KEEP
            for a, i in zip(eqn.invars, ins, strict=True)
        ]
        return Node(
            "traced", tuple(i.cls for i in ins), tuple(outs), tuple(reads32)
        )
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    body_closed, cond_closed = p["body_jaxpr"], p["cond_jaxpr"]
    bconsts = [i.cls for i in ins[n_cond : n_cond + n_body]]
    cconsts = [i.cls for i in ins[:n_cond]]

    def body(carry: list[Cls]) -> tuple[Plan, Sequence[Cls]]:
        f32 = [c == Cls.F32 for c in carry]
        plan = _infer.infer(
            ctx,
            body_closed.jaxpr,
            const_infos(ctx, body_closed.consts),
            [*bconsts, *carry],
            f32,
            f32,
        )
        return plan, plan.outs

    carry, plan = _carry_fixed_point(_carry_start(ins[n_cond + n_body :]), body)
    cond_plan = _infer.infer(
        ctx,
        cond_closed.jaxpr,
        const_infos(ctx, cond_closed.consts),
        [*cconsts, *carry],
        [False],
        [False],
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
    return _node(ins, carry, reads32, [cond_plan, plan], dem)


def _while_emit(ctx: Ctx, eqn: Any, node: Node, invals: list[Any]) -> list:
    p = eqn.params
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_plan, plan = node.data.plans
    body_closed, cond_closed = p["body_jaxpr"], p["cond_jaxpr"]
    carry_atoms = body_closed.jaxpr.invars[n_body:]
    cconsts = _args(
        ctx,
        invals[:n_cond],
        cond_plan.ins[:n_cond],
        cond_closed.jaxpr.invars[:n_cond],
    )
    bconsts = _args(
        ctx,
        invals[n_cond : n_cond + n_body],
        plan.ins[:n_body],
        body_closed.jaxpr.invars[:n_body],
    )
    carry_classes = plan.ins[n_body:]
    carry = _args(ctx, invals[n_cond + n_body :], carry_classes, carry_atoms)
    dtypes = [a.aval.dtype for a in carry_atoms]
    bjc = _emit.store(ctx, body_closed.consts, plan.consts)
    cjc = _emit.store(ctx, cond_closed.consts, cond_plan.consts)

    def body_fn(*xs: Any) -> list[Any]:
        outs = _emit.emit(ctx, body_closed.jaxpr, plan, bjc, xs)
        return [
            _emit.as_class(ctx, v, k, t)
            for v, k, t in zip(outs, carry_classes, dtypes, strict=True)
        ]

    def cond_fn(*xs: Any) -> list[Any]:
        return _emit.emit(ctx, cond_closed.jaxpr, cond_plan, cjc, xs)

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
    ctx: Ctx, eqn: Any, ins: list[Info], only32: list[bool], demanded: list
) -> Node:
    branches = eqn.params["branches"]
    operands = [i.cls for i in ins[1:]]
    outs: list[Cls] | None = None
    plans: list[Plan] = []
    for _ in range(len(Cls) + 1):
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
                ctx,
                closed.jaxpr,
                const_infos(ctx, closed.consts),
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
        assert joined is not None
        if joined == outs:
            break
        outs = joined
    assert outs is not None
    reads32 = [False] + [
        any(p.reads32[k] for p in plans) for k in range(len(operands))
    ]
    dem_in = [False] + [
        any(p.demanded[k] for p in plans) for k in range(len(operands))
    ]
    return _node(ins, outs, reads32, plans, dem_in)


def _cond_emit(ctx: Ctx, eqn: Any, node: Node, invals: list[Any]) -> list:
    """A ``cond`` re-bound with its branches replaced, so that every param
    (``branches_platforms`` of ``lax.platform_dependent``) is kept."""
    branches = eqn.params["branches"]
    plans = node.data.plans
    index, operands = invals[0], invals[1:]
    args = _args(ctx, operands, plans[0].ins, eqn.invars[1:])
    traced = [v.aval.dtype for v in eqn.outvars]
    new = []
    for closed, plan in zip(branches, plans, strict=True):
        consts = _emit.store(ctx, closed.consts, plan.consts)

        def branch(*xs: Any, closed=closed, plan=plan, consts=consts) -> list:
            outs = _emit.emit(ctx, closed.jaxpr, plan, consts, xs)
            return [
                _emit.as_class(ctx, v, k, t)
                for v, k, t in zip(outs, node.outs, traced, strict=True)
            ]

        jaxpr = _trace(branch, args)
        if jaxpr.consts:
            raise _compat.UnknownParams("constants in a re-traced branch")
        new.append(jaxpr)
    return _compat.rebind(eqn, [index, *args], branches=tuple(new))


# --- checkpoint, custom_jvp, shard_map ---------------------------------


def _open_infer(
    ctx: Ctx, eqn: Any, ins: list[Info], only32: list[bool], demanded: list
) -> Node:
    plan = _infer.infer(
        ctx, eqn.params["jaxpr"], [], [i.cls for i in ins], only32, demanded
    )
    return _node(ins, plan.outs, plan.reads32, [plan], plan.demanded)


def _checkpoint_emit(ctx: Ctx, eqn: Any, node: Node, invals: list) -> list:
    """``checkpoint`` re-bound with its jaxpr replaced: its policy,
    ``prevent_cse`` and ``differentiated`` are kept."""
    (plan,) = node.data.plans
    jaxpr = eqn.params["jaxpr"]
    args = _args(ctx, invals, plan.ins, jaxpr.invars)
    new = _memo(
        ctx,
        ("remat", id(plan), _avals(args)),
        lambda: (
            plan,
            _trace(lambda *xs: _emit.emit(ctx, jaxpr, plan, [], xs), args),
        ),
    )[1]
    if new.consts:
        raise _compat.UnknownParams("constants in a re-traced checkpoint")
    return _compat.rebind(eqn, args, jaxpr=new.jaxpr)


def _shard_map_emit(ctx: Ctx, eqn: Any, node: Node, invals: list) -> list:
    """``shard_map``: its body evaluated per shard, with the same specs."""
    p = eqn.params
    (plan,) = node.data.plans
    jaxpr = p["jaxpr"]
    args = _args(ctx, invals, plan.ins, jaxpr.invars)
    mapped = jax.shard_map(
        lambda *xs: _emit.emit(ctx, jaxpr, plan, [], xs),
        **_compat.shard_map_options(p),
    )
    return list(cast(list[Any], mapped(*args)))


def _custom_jvp_infer(
    ctx: Ctx, eqn: Any, ins: list[Info], only32: list[bool], demanded: list
) -> Node:
    closed = eqn.params["call_jaxpr"]
    plan = _closed_plan(ctx, closed, ins, only32, demanded)
    return _node(
        ins, plan.outs, plan.reads32, [plan], plan.demanded, (only32, demanded)
    )


def _custom_jvp_emit(ctx: Ctx, eqn: Any, node: Node, invals: list) -> list:
    """The function and its JVP rule, both evaluated with the rules.

    The rule's jaxpr was traced at the original dtypes; it is planned with
    the function's classes, and its outputs are cast to the dtypes the
    function returns, so that the primal and tangent types agree whether
    or not the call is differentiated.
    """
    closed = eqn.params["call_jaxpr"]
    n_consts = eqn.params["num_consts"]
    (plan,) = node.data.plans
    only32, demanded = node.data.extra
    atoms = closed.jaxpr.invars
    args = _args(ctx, invals, plan.ins, atoms)
    consts = _emit.store(ctx, closed.consts, plan.consts)
    traced = [v.aval.dtype for v in closed.jaxpr.outvars]
    classes = plan.ins[n_consts:]

    def fun(*xs: Any) -> list[Any]:
        outs = _emit.emit(ctx, closed.jaxpr, plan, consts, xs)
        return [
            _emit.as_class(ctx, v, k, t)
            for v, k, t in zip(outs, plan.outs, traced, strict=True)
        ]

    def jvp(*xs: Any) -> list[Any]:
        n = len(xs) // 2
        primals, tangents = xs[n_consts:n], xs[n + n_consts :]
        zeros = [_compat.is_symbolic_zero(t) for t in tangents]
        jaxpr, jvp_consts, out_zeros = _compat.jvp_jaxpr(eqn, zeros)
        tangent_classes = [
            k for k, z in zip(classes, zeros, strict=True) if not z
        ]
        n_out = len(plan.outs)
        jplan = _infer.infer(
            ctx,
            jaxpr,
            const_infos(ctx, jvp_consts),
            [*classes, *tangent_classes],
            [*only32, *([False] * (len(jaxpr.outvars) - n_out))],
            [*demanded, *([False] * (len(jaxpr.outvars) - n_out))],
        )
        jargs = _args(
            ctx,
            [
                *primals,
                *(t for t, z in zip(tangents, zeros, strict=True) if not z),
            ],
            jplan.ins,
            jaxpr.invars,
        )
        outs = _emit.emit(
            ctx,
            jaxpr,
            jplan,
            _emit.store(ctx, jvp_consts, jplan.consts),
            jargs,
        )
        out_primals = [
            _emit.as_class(ctx, v, k, t)
            for v, k, t in zip(outs[:n_out], plan.outs, traced, strict=True)
        ]
        it = iter(outs[n_out:])
        out_tangents = []
        for p, z in zip(out_primals, out_zeros, strict=True):
            if z:
                out_tangents.append(_compat.symbolic_zero_like(p))
            else:
                t = next(it)
                dtype = _emit.dtype_of(p)
                out_tangents.append(
                    _emit.strong(t, dtype) if is_float(dtype) else t
                )
        return [*out_primals, *out_tangents]

    return _compat.bind_with_subfuns(
        eqn,
        [fun, jvp],
        args,
        drop=("call_jaxpr", "num_consts", "jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
    )


HANDLERS: dict[str, Handler] = {
    **{
        name: Handler(_call_infer, _call_emit)
        for name in ("jit", "pjit", "closed_call", "core_call")
    },
    "scan": Handler(_scan_infer, _scan_emit),
    "while": Handler(_while_infer, _while_emit),
    "cond": Handler(_cond_infer, _cond_emit),
    "remat2": Handler(_open_infer, _checkpoint_emit),
    "checkpoint": Handler(_open_infer, _checkpoint_emit),
    "custom_jvp_call": Handler(_custom_jvp_infer, _custom_jvp_emit),
    "shard_map": Handler(_open_infer, _shard_map_emit),
}
