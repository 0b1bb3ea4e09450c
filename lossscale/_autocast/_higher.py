"""Higher-order primitives that call one jaxpr, and what every handler
is made of.

A handler is a pair of functions, registered into the two passes' own
tables by :mod:`._handlers`: ``infer`` plans the equation from its
operands' classes (recursing into its jaxprs with :func:`._infer.infer`),
``emit`` binds it from that plan. Here are the pieces every handler uses
(a handler's node, its operands and results stored for the classes
planned, its jaxprs re-traced and kept while the jaxpr they came from
lives) and the handlers of the calls (``jit``, ``closed_call``,
``checkpoint``, ``custom_jvp_call``, ``shard_map``); loops and
conditionals are in :mod:`._control`.

Each is re-bound as itself where JAX allows it, with every parameter kept
and only its jaxprs replaced (``jit``, ``checkpoint``): a ``jax.jit``-ed
block called many times is re-emitted once, as one jaxpr that JAX's
caches see as one function. ``shard_map`` is rebuilt through
``jax.shard_map``, with the same mesh and specs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from lossscale import _compat
from lossscale._autocast import _emit, _infer, _matmul
from lossscale._autocast._cast import as_class, dtype_of, store, strong
from lossscale._autocast._classes import (
    Cls,
    Info,
    is_float,
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
    rounded: Sequence[bool] = (),
) -> Node:
    """A higher-order equation's node, from the plans of its jaxprs."""
    return Node(
        Mode.HIGHER,
        tuple(i.cls for i in ins),
        tuple(outs),
        tuple(reads32),
        SubPlans(tuple(plans), tuple(demanded), extra, tuple(rounded)),
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
    return _higher_node(
        ins, plan.outs, plan.reads32, [plan], plan.demanded,
        rounded=plan.rounded,
    )  # fmt: skip


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


# --- checkpoint, custom_jvp, shard_map ---------------------------------


def _open_infer(
    config: Config, eqn: Any, ins: list[Info], only32: list, demanded: list
) -> Node:
    plan = _infer.infer(
        config, eqn.params["jaxpr"], [], [i.cls for i in ins], only32, demanded
    )
    return _higher_node(
        ins, plan.outs, plan.reads32, [plan], plan.demanded,
        rounded=plan.rounded,
    )  # fmt: skip


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
