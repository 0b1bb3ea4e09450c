"""Which operand of a matmul is the weight: read from the dataflow.

A float8 recipe treats a linear layer's weight and its activation
differently (``rowwise_with_gw_hp`` keeps the weight's gradient 16-bit,
eligibility reads the weight's N and K), and only linear layers run in
float8. TransformerEngine and torchao know a linear layer from their
modules; autocast knows it from what each operand is computed from:

- the **weight** is the operand computed from the parameters (the
  arguments :attr:`lossscale.Float8.params_argnums` names) and constants
  alone: a parameter leaf, its cast or transpose, the slice of a stacked
  weight inside ``scan``, a weight norm, a merged LoRA product;
- the **activation** is the operand that depends on floating-point data.

A matmul is not a linear layer, and stays in the 16-bit compute dtype
with its reason (:data:`REASONS`), where both operands depend on the data
(attention's scores, a Gram matrix), where neither does, or where the
data reaches the activation through integers and booleans only (a
one-hot product, which is an exact gather).

The flow crosses calls, ``scan``, ``while``, ``cond``, ``remat``,
``shard_map`` and custom derivatives (by their primal function). Each
plan analyses its own jaxpr (:func:`analyse`) for the sources its inputs
have where it is planned, and hands each higher-order equation's jaxprs
the sources they have at that equation (:func:`at`): a ``jax.jit``-ed
layer called with three weights is planned at each call with its own. A
loop's body is planned for its carry's sources at their fixed point.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from lossscale import _compat
from lossscale._autocast import _rules as R
from lossscale._autocast._classes import is_float
from lossscale._autocast._config import JaxprCache

_NAMED = _compat.primitives_named(["dot_general", "scan", "while", "cond"])
_DOT = _NAMED["dot_general"]


class Src(enum.IntEnum):
    """What a value is computed from (the join is the larger)."""

    PARAM = 0  # parameters and constants only
    INDEX = 1  # data too, through integers and booleans only
    DATA = 2  # floating-point data


class Source(NamedTuple):
    """A value's :class:`Src`, and for a ``PARAM`` one the paths of the
    parameters it is computed from (``"head.kernel"``; none for a
    constant)."""

    src: Src
    leaves: frozenset[str] = frozenset()


PARAM = Source(Src.PARAM)
INDEX = Source(Src.INDEX)
DATA = Source(Src.DATA)


def join(a: Source, b: Source) -> Source:
    src = max(a.src, b.src)
    if src is not Src.PARAM:
        return Source(src)
    return Source(src, a.leaves | b.leaves)


def _join_all(sources: Sequence[Source]) -> Source:
    out = PARAM
    for s in sources:
        out = join(out, s)
    return out


REASONS: Mapping[str, str] = {
    "both": "both operands depend on the data (attention, a Gram matrix)",
    "neither": "neither operand depends on the data",
    "gather": (
        "an exact gather: the data reaches it through integers or booleans "
        "only (a one-hot product)"
    ),
}
"""Why a matmul is not a linear layer, by key."""


class Role(NamedTuple):
    """What a matmul is: ``weight`` is the position of its weight operand
    (0: lhs, 1: rhs), ``None`` if it is not a linear layer, and then
    ``reason`` (a key of :data:`REASONS`) says why; ``leaves``: the
    paths of the parameters the weight is computed from."""

    weight: int | None
    leaves: frozenset[str] = frozenset()
    reason: str | None = None


def role(lhs: Source, rhs: Source) -> Role:
    """A matmul's role from its operands' sources."""
    data = (lhs.src is not Src.PARAM, rhs.src is not Src.PARAM)
    if all(data):
        return Role(None, reason="both")
    if not any(data):
        return Role(None, reason="neither")
    weight = 1 if data[0] else 0
    activation = (lhs, rhs)[1 - weight]
    if activation.src is Src.INDEX:
        return Role(None, reason="gather")
    return Role(weight, (lhs, rhs)[weight].leaves)


# --- the flow ------------------------------------------------------------


def _eqn_sources(eqn: Any, ins: list[Source]) -> list[Source]:
    """A first-order equation's results' sources."""
    joined = _join_all(ins)
    floats_out = [is_float(v.aval.dtype) for v in eqn.outvars]
    if joined.src is Src.INDEX and any(floats_out):
        # Integers become floats exactly through a conversion, and stay
        # exact through moves of such floats only; arithmetic (random
        # bits to normal numbers) or a table's values (an embedding
        # lookup) make data of them.
        record = R.TABLE.get(eqn.primitive)
        float_ins = [
            s
            for s, a in zip(ins, eqn.invars, strict=True)
            if is_float(a.aval.dtype)
        ]
        # (A cast between floats rounds: not exact.)
        convert = record is not None and record.kind is R.Kind.CONVERT
        exact = (convert and not float_ins) or (
            record is not None
            and record.moves
            and not convert
            and all(s.src is Src.INDEX for s in float_ins)
        )
        if not exact:
            return [DATA if f else joined for f in floats_out]
    return [joined] * len(eqn.outvars)


class _Flow:
    """The sources of a jaxpr's values, from those of its inputs; and,
    for each higher-order equation of that jaxpr, the sources each of its
    jaxprs is reached with there (a loop's carry at its fixed point)."""

    def __init__(self) -> None:
        self.depth = 0
        self.eqn: Any = None  # the higher-order equation being read
        self.sites: dict[Any, dict[Any, tuple[Source, ...]]] = {}
        self.roles: dict[Any, Role] = {}

    def run(self, jaxpr: Any, ins: Sequence[Source]) -> list[Source]:
        """``jaxpr``'s outputs' sources for inputs (constants first, then
        the inputs proper) of these sources."""
        env: dict[Any, Source] = dict(
            zip([*jaxpr.constvars, *jaxpr.invars], ins, strict=True)
        )

        def read(atom: Any) -> Source:
            return env[atom] if _compat.is_var(atom) else PARAM

        self.depth += 1
        for eqn in jaxpr.eqns:
            eqn_ins = [read(a) for a in eqn.invars]
            if self.depth == 1 and eqn.primitive is _DOT:
                self.roles[eqn] = role(*eqn_ins)
            outer, self.eqn = self.eqn, eqn
            outs = self._higher(eqn, eqn_ins)
            self.eqn = outer
            if outs is None:
                outs = _eqn_sources(eqn, eqn_ins)
            env.update(zip(eqn.outvars, outs, strict=True))
        self.depth -= 1
        return [read(a) for a in jaxpr.outvars]

    def _sub(self, jaxpr: Any, ins: Sequence[Source]) -> list[Source]:
        """A jaxpr of the equation being read, run on ``ins``: recorded as
        that equation's site where the equation is the analysed jaxpr's
        own (the last run of a loop's body has its fixed point)."""
        if self.depth == 1:
            self.sites.setdefault(self.eqn, {})[jaxpr] = tuple(ins)
        return self.run(jaxpr, ins)

    def _closed(self, closed: Any, ins: Sequence[Source]) -> list[Source]:
        jaxpr = getattr(closed, "jaxpr", closed)
        consts = [PARAM] * len(jaxpr.constvars)
        return self._sub(jaxpr, [*consts, *ins])

    def _higher(self, eqn: Any, ins: list[Source]) -> list[Source] | None:
        p, prim = eqn.params, eqn.primitive
        if prim is _NAMED.get("scan"):
            return self._scan(eqn, ins)
        if prim is _NAMED.get("while"):
            return self._while(eqn, ins)
        if prim is _NAMED.get("cond"):
            outs = [self._closed(b, ins[1:]) for b in p["branches"]]
            return [_join_all(col) for col in zip(*outs, strict=True)]
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
            sub = p.get(key)
            jaxpr = getattr(sub, "jaxpr", sub)
            if hasattr(jaxpr, "eqns") and len(jaxpr.invars) == len(ins):
                # A call, remat, shard_map, custom_jvp_call or
                # custom_vjp_call: its operands are its jaxpr's inputs.
                return self._closed(sub, ins)
        subs = _compat.sub_jaxprs(eqn)
        if not subs:
            return None
        # Another higher-order primitive: each jaxpr in it is reached with
        # what all its operands have in common.
        joined = _join_all(ins)
        for sub in subs:
            self._sub(sub, [joined] * (len(sub.constvars) + len(sub.invars)))
        return [joined] * len(eqn.outvars)

    def _scan(self, eqn: Any, ins: list[Source]) -> list[Source]:
        n_consts, n_carry = _compat.scan_counts(eqn.params)
        consts = ins[:n_consts]
        carry = ins[n_consts : n_consts + n_carry]
        xs = ins[n_consts + n_carry :]
        body = eqn.params["jaxpr"]
        while True:  # the join only goes up a finite lattice
            outs = self._closed(body, [*consts, *carry, *xs])
            new = [join(a, b) for a, b in zip(carry, outs, strict=False)]
            if new == carry:
                return outs
            carry = new

    def _while(self, eqn: Any, ins: list[Source]) -> list[Source]:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cconsts, bconsts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        while True:
            self._closed(p["cond_jaxpr"], [*cconsts, *carry])
            outs = self._closed(p["body_jaxpr"], [*bconsts, *carry])
            new = [join(a, b) for a, b in zip(carry, outs, strict=True)]
            if new == carry:
                return carry
            carry = new


class Analysis(NamedTuple):
    """A jaxpr's matmuls' roles, and where each of its higher-order
    equations reaches its jaxprs from (by equation, then jaxpr)."""

    roles: Mapping[Any, Role]
    sites: Mapping[Any, Mapping[Any, tuple[Source, ...]]]


EMPTY = Analysis({}, {})
_ANALYSES = JaxprCache()


def analyse(jaxpr: Any, ins: tuple[Source, ...]) -> Analysis:
    """The :class:`Analysis` of ``jaxpr`` reached with ``ins`` (constants
    first; kept while the jaxpr lives). Its jaxprs are analysed in their
    turn, each for the sources it is reached with at each place: a layer
    called twice with other weights is two sites, with the weights of
    each."""

    def make() -> Analysis:
        flow = _Flow()
        flow.run(jaxpr, ins)
        return Analysis(flow.roles, flow.sites)

    return _ANALYSES.get(jaxpr, ins, make)


# --- what the planning reads ----------------------------------------------

_SITE: contextvars.ContextVar[Mapping[Any, tuple[Source, ...]] | None] = (
    contextvars.ContextVar("lossscale_weights_site", default=None)
)


@contextlib.contextmanager
def at(site: Mapping[Any, tuple[Source, ...]]) -> Iterator[None]:
    """While planning the jaxprs of one equation (or the traced program):
    the sources each is reached with there, for :func:`reached_with`."""
    token = _SITE.set(site)
    try:
        yield
    finally:
        _SITE.reset(token)


def reached_with(jaxpr: Any) -> tuple[Source, ...] | None:
    """The sources of ``jaxpr``'s constants and inputs where it is being
    planned (``None``: not known, as for a custom_jvp rule's jaxpr)."""
    site = _SITE.get()
    return None if site is None else site.get(jaxpr)


_NAMING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "lossscale_weights_naming", default=False
)


@contextlib.contextmanager
def naming() -> Iterator[None]:
    """Parameters carry their paths through the flow while in it (for
    :func:`lossscale.matmuls`): otherwise only where a float8 recipe's
    ``exclude`` reads them, so that a layer called with other weights
    keeps one plan."""
    token = _NAMING.set(True)
    try:
        yield
    finally:
        _NAMING.reset(token)


def names_wanted() -> bool:
    return _NAMING.get()
