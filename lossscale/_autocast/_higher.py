"""Higher-order primitives: their jaxprs inferred and emitted with the rules.

Each handler is a pair of functions registered at the end of this module
into the two passes' own tables (:data:`._equation.HIGHER`,
:data:`._emit.HIGHER`), by ``Primitive``: ``infer`` plans the equation
from its operands' classes (recursing into its jaxprs with
:func:`._infer.infer`), ``emit`` binds it from that plan. **A handler for
a new higher-order primitive is one entry in** :data:`_HANDLERS`.

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
from typing import Any, cast

import jax
import numpy as np
from jax import lax

from lossscale import _compat
from lossscale._autocast import _emit, _equation, _infer, _matmul
from lossscale._autocast._cast import as_class, dtype_of, store, strong
from lossscale._autocast._classes import (
    Cls,
    Info,
    is_float,
    join,
    of_dtype,
    of_value,
)
from lossscale._autocast._config import Call, Config, JaxprCache
from lossscale._autocast._fold import FOLD_SIZE
from lossscale._autocast._plan import Mode, Node, Plan, SubPlans

_FITS_SIZE = 1 << 16

# The jaxprs emitted for a jaxpr's plan (a jitted block's, a scan's
# body), kept while the jaxpr they were emitted from lives: called again,
# in this call or the next, the block is the same function to JAX, whose
# caches then hit (no re-tracing, no re-compiling).
_EMITTED = JaxprCache()


_CONSTS = JaxprCache()


def closed_consts(config: Config, closed: Any) -> list[Info]:
    """What is known of a closed jaxpr's constants (read once while its
    jaxpr lives: their values are the operands of the constants folded
    from them)."""
    return _CONSTS.get(
        closed.jaxpr,
        ("consts", config.compute),
        lambda: const_infos(config, closed.consts),
    )


def const_infos(config: Config, consts: Sequence[Any]) -> list[Info]:
    """Constants classed by their values where they are known and small
    enough to read."""
    infos = []
    for c in consts:
        dtype = dtype_of(c)
        cls = of_dtype(dtype, config.compute)
        if (
            cls == Cls.F32
            and not _compat.is_tracer(c)
            and int(np.size(c)) <= _FITS_SIZE
        ):
            value = np.asarray(c)
            cls = of_value(value, dtype, config.compute)
            keep = value.size <= FOLD_SIZE
            infos.append(Info(cls, value if keep else None))
        else:
            infos.append(Info(cls))
    return infos


def _higher_node(
    ins: Sequence[Info],
    outs: Sequence[Cls],
    reads32: Sequence[bool],
    plans: Sequence[Plan],
    demanded: Sequence[bool],
    extra: Any = None,
) -> Node:
    """A higher-order equation's node, from the plans of its jaxprs."""
    return Node(
        Mode.HIGHER,
        tuple(i.cls for i in ins),
        tuple(outs),
        tuple(reads32),
        SubPlans(tuple(plans), tuple(demanded), extra),
    )


def _args(
    call: Call, xs: Sequence[Any], classes: Sequence[Cls], atoms: Sequence[Any]
) -> list[Any]:
    """Operands stored for the classes a jaxpr is planned for."""
    return [
        as_class(x, c, a.aval.dtype, call.compute)
        for x, c, a in zip(xs, classes, atoms, strict=True)
    ]


def _outs(
    call: Call,
    outs: Sequence[Any],
    classes: Sequence[Cls],
    traced: Sequence[Any],
) -> list[Any]:
    """A body's results stored for the classes its caller expects."""
    return [
        as_class(v, k, t, call.compute)
        for v, k, t in zip(outs, classes, traced, strict=True)
    ]


def _trace(fun: Callable[..., list[Any]], args: Sequence[Any]) -> Any:
    """``fun`` traced to a closed jaxpr on ``args``' abstract values."""
    return jax.make_jaxpr(lambda *xs: fun(*xs))(*args)


def _avals(xs: Sequence[Any]) -> tuple[Any, ...]:
    return tuple(jax.typeof(x) for x in xs)


def _emitted(jaxpr: Any, key: Any, make: Callable[[], Any]) -> Any:
    """The jaxpr emitted from ``jaxpr`` for ``key`` (a plan's id and the
    operand types), made once while ``jaxpr`` lives."""
    return _EMITTED.get(jaxpr, key, make)


# --- calls: jit ---------------------------------------------------------------


def _call_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    plan = _closed_plan(config, _compat.call_jaxpr(eqn), ins, only32, demanded)
    return _higher_node(ins, plan.outs, plan.reads32, [plan], plan.demanded)


def _closed_plan(
    config: Config, closed: Any, ins: list[Info], only32: list, demanded: list
) -> Plan:
    """The plan of a closed jaxpr called on operands of these classes."""
    return _infer.infer(
        config,
        closed.jaxpr,
        closed_consts(config, closed),
        [i.cls for i in ins],
        only32,
        demanded,
    )


def _call_emit(call: Call, eqn: Any, node: Node, invals: list[Any]) -> list:
    """A ``jax.jit`` re-bound with its jaxpr evaluated by its plan, once
    per plan and operand types while its jaxpr lives: called 48 times, or
    in every call of an autocast function, it is one function to JAX."""
    closed = _compat.call_jaxpr(eqn)
    (plan,) = node.data.plans
    args = _args(call, invals, plan.ins, eqn.invars)
    consts = store(closed.consts, plan.consts, call.compute)

    def body(*xs: Any) -> list[Any]:
        return _emit.emit(call, closed.jaxpr, plan, consts, xs)

    if not _compat.is_jit(eqn):
        return body(*args)
    new = _emitted(
        closed.jaxpr,
        ("call", id(plan), _avals(args)),
        lambda: _trace(body, args),
    )
    if call.config.float8 is None:
        return _compat.rebind(eqn, args, jaxpr=new)
    with _matmul.float8_forward_mode():
        return _compat.rebind(eqn, args, jaxpr=new)


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
    return _higher_node(ins, outs, plan.reads32, [plan], plan.demanded)


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


# --- checkpoint, custom_jvp, shard_map ---------------------------------


def _open_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    plan = _infer.infer(
        config, eqn.params["jaxpr"], [], [i.cls for i in ins], only32, demanded
    )
    return _higher_node(ins, plan.outs, plan.reads32, [plan], plan.demanded)


def _checkpoint_emit(call: Call, eqn: Any, node: Node, invals: list) -> list:
    """``checkpoint`` re-bound with its jaxpr replaced: its policy,
    ``prevent_cse`` and ``differentiated`` are kept."""
    (plan,) = node.data.plans
    jaxpr = eqn.params["jaxpr"]
    args = _args(call, invals, plan.ins, jaxpr.invars)
    new = _emitted(
        jaxpr,
        ("remat", id(plan), _avals(args)),
        lambda: _trace(lambda *xs: _emit.emit(call, jaxpr, plan, [], xs), args),
    )
    if new.consts:
        raise _compat.UnknownParams("constants in a re-traced checkpoint")
    return _compat.rebind(eqn, args, jaxpr=new.jaxpr)


def _shard_map_emit(call: Call, eqn: Any, node: Node, invals: list) -> list:
    """``shard_map``: its body evaluated per shard, with the same specs."""
    p = eqn.params
    (plan,) = node.data.plans
    jaxpr = p["jaxpr"]
    args = _args(call, invals, plan.ins, jaxpr.invars)
    mapped = jax.shard_map(
        lambda *xs: _emit.emit(call, jaxpr, plan, [], xs),
        **_compat.shard_map_options(p),
    )
    return list(cast(list[Any], mapped(*args)))


def _custom_jvp_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    closed = eqn.params["call_jaxpr"]
    plan = _closed_plan(config, closed, ins, only32, demanded)
    return _higher_node(
        ins, plan.outs, plan.reads32, [plan], plan.demanded, (only32, demanded)
    )


def _custom_jvp_emit(call: Call, eqn: Any, node: Node, invals: list) -> list:
    """The function and its JVP rule, both evaluated with the rules.

    The rule's jaxpr was traced at the original dtypes; it is planned with
    the function's classes, and its outputs are cast to the dtypes the
    function returns, so that the primal and tangent types agree whether
    or not the call is differentiated.
    """
    config = call.config
    closed = eqn.params["call_jaxpr"]
    n_consts = eqn.params["num_consts"]
    (plan,) = node.data.plans
    only32, demanded = node.data.extra
    atoms = closed.jaxpr.invars
    args = _args(call, invals, plan.ins, atoms)
    consts = store(closed.consts, plan.consts, call.compute)
    traced = [v.aval.dtype for v in closed.jaxpr.outvars]
    classes = plan.ins[n_consts:]

    def fun(*xs: Any) -> list[Any]:
        outs = _emit.emit(call, closed.jaxpr, plan, consts, xs)
        return _outs(call, outs, plan.outs, traced)

    def jvp(*xs: Any) -> list[Any]:
        n = len(xs) // 2
        primals, tangents = xs[n_consts:n], xs[n + n_consts :]
        zeros = [_compat.is_symbolic_zero(t) for t in tangents]
        jaxpr, jvp_consts, out_zeros = _compat.jvp_jaxpr(eqn, zeros)
        tangent_classes = [
            k for k, z in zip(classes, zeros, strict=True) if not z
        ]
        n_out = len(plan.outs)
        extra = [False] * (len(jaxpr.outvars) - n_out)
        # No float8 in a JVP rule: its tangent matmuls would be float8
        # custom_vjps, which JAX can differentiate but not transpose.
        jplan = _infer.infer(
            config.sixteen_bit,
            jaxpr,
            const_infos(config, jvp_consts),
            [*classes, *tangent_classes],
            [*only32, *extra],
            [*demanded, *extra],
        )
        jargs = _args(
            call,
            [
                *primals,
                *(t for t, z in zip(tangents, zeros, strict=True) if not z),
            ],
            jplan.ins,
            jaxpr.invars,
        )
        outs = _emit.emit(
            call,
            jaxpr,
            jplan,
            store(jvp_consts, jplan.consts, call.compute),
            jargs,
        )
        out_primals = _outs(call, outs[:n_out], plan.outs, traced)
        it = iter(outs[n_out:])
        out_tangents = []
        for p, z in zip(out_primals, out_zeros, strict=True):
            if z:
                out_tangents.append(_compat.symbolic_zero_like(p))
            else:
                t = next(it)
                dtype = dtype_of(p)
                out_tangents.append(strong(t, dtype) if is_float(dtype) else t)
        return [*out_primals, *out_tangents]

    return _compat.bind_with_subfuns(
        eqn,
        [fun, jvp],
        args,
        drop=("call_jaxpr", "num_consts", "jvp_jaxpr_fun", "jvp_jaxpr_thunk"),
    )


# name: (infer, emit, a call that may be part of a float32 island)
_HANDLERS: dict[str, tuple[_equation.InferHigher, _emit.EmitHigher, bool]] = {
    "jit": (_call_infer, _call_emit, True),
    "pjit": (_call_infer, _call_emit, True),
    "closed_call": (_call_infer, _call_emit, False),
    "core_call": (_call_infer, _call_emit, False),
    "scan": (_scan_infer, _scan_emit, False),
    "while": (_while_infer, _while_emit, False),
    "cond": (_cond_infer, _cond_emit, False),
    "remat2": (_open_infer, _checkpoint_emit, False),
    "checkpoint": (_open_infer, _checkpoint_emit, False),
    "custom_jvp_call": (_custom_jvp_infer, _custom_jvp_emit, True),
    "shard_map": (_open_infer, _shard_map_emit, False),
}

HANDLED = frozenset(_HANDLERS)
"""The names of the higher-order primitives autocast recurses into."""

for _name, _primitive in _compat.primitives_named(_HANDLERS).items():
    _infer_rule, _emit_rule, _island = _HANDLERS[_name]
    if _name not in _compat.HIGHER_ORDER_PARAMS:
        # The params autocast rebuilds an equation from: without them, a
        # param it does not know would go unnoticed.
        raise RuntimeError(  # pragma: no cover - a developer's error
            f"lossscale: the handler of {_name} needs its known params in "
            "lossscale._compat.HIGHER_ORDER_PARAMS."
        )
    _equation.register(_primitive, _infer_rule, island=_island)
    _emit.register(_primitive, _emit_rule)
