"""What autocast does with a matmul, in one place: its 16-bit rule, its
float8 eligibility and the reasons it gives (read by
:func:`lossscale.matmuls`), the layers kept out, the refusal of a
derivative traced inside, the float8 emission and its forward-mode
error, and how many float8 matmuls a plan runs.

The kinds' rules (:func:`matmul_rule`, :func:`float8_rule`) are the
inference pass's (:data:`._equation.KINDS`); which operand is the weight is
:mod:`._weights`'s; the float8 kernel is :mod:`._fp8`'s.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from lossscale import _compat
from lossscale._autocast import _fp8, _weights
from lossscale._autocast._cast import quantized_copy
from lossscale._autocast._classes import Cls, Info, is_float, of_dtype
from lossscale._autocast._plan import (
    JaxprFacts,
    KindArgs,
    Mode,
    Node,
    Plan,
    in_compute_scope,
    traced,
)


def matmul_rule(a: KindArgs) -> tuple[Node, list[Info]]:
    """A matmul's (or convolution's) rule: in the 16-bit compute dtype,
    unless its traced precision or result type asks for float32."""
    eqn = a.eqn
    if _compat.explicit_precision(eqn):
        # precision=HIGHEST (or HIGH) asks for float32 products.
        return traced(eqn, a.infos, a.compute)
    if wide_result(eqn):
        # The program asked for a result wider than its operands (16-bit
        # attention scores accumulated to float32): kept.
        out = of_dtype(eqn.params["preferred_element_type"], a.compute)
        if out != Cls.F32:
            return traced(eqn, a.infos, a.compute)
        return a.result(Mode.COMPUTE, Cls.F32)
    return a.result(Mode.COMPUTE, Cls.LOW)


def wide_result(eqn: Any) -> bool:
    """A matmul whose traced ``preferred_element_type`` is wider than its
    float operands."""
    wanted = eqn.params.get("preferred_element_type")
    if wanted is None or not is_float(wanted):
        return False
    widths = [
        np.dtype(v.aval.dtype).itemsize
        for v in eqn.invars
        if is_float(v.aval.dtype)
    ]
    return bool(widths) and np.dtype(wanted).itemsize > max(widths)


def _parts(name: str) -> list[str]:
    return [p for p in re.split(r"[./()]", name) if p]


def matches(pattern: str, names: Sequence[str]) -> bool:
    """Whether ``pattern``'s parts (``"layers.1"``: ``layers``, ``1``) are
    consecutive parts of one of ``names`` (a weight's path, a named scope
    ``"outer/inner"``): ``"layers.1"`` is in ``"layers.1.kernel"``, not in
    ``"layers.10.kernel"``; ``"head"`` not in ``"lm_head"``."""
    want = _parts(pattern)
    n = len(want)
    for name in names:
        parts = _parts(name)
        if any(parts[i : i + n] == want for i in range(len(parts) - n + 1)):
            return True
    return False


class MatmulInfo(NamedTuple):
    """A matmul as a callable in :attr:`lossscale.Float8.exclude` sees it.

    :func:`lossscale.autocast` builds one for each matmul that a float8
    recipe could run (each ``dot_general``) while it plans the traced
    program, before it decides the matmul's dtype; the fields it shares
    with :class:`lossscale.Matmul` read as :func:`lossscale.matmuls`
    shows them, so that a filter can be written from its listing.

    Attributes:
        where: the named scopes and ``jax.jit``-ed functions it was traced
            in, ``"outer/inner"`` (as :attr:`lossscale.Matmul.where`).
        weight: the path of the parameter its weight operand is computed
            from (``"head.kernel"``; several joined by ``", "``),
            ``"<constant>"`` for a weight the function closes over, ``""``
            for a matmul that is not a linear layer (as
            :attr:`lossscale.Matmul.weight`).
        shapes: the shapes of its two operands, ``(lhs, rhs)``.
        weight_operand: which operand is the weight (0: lhs, 1: rhs);
            ``None`` for a matmul that is not a linear layer.
        in_features: the weight's contracted size (K: an ``nn.Linear``'s
            ``in_features``); ``None`` where ``weight_operand`` is.
        out_features: the weight's other sizes, multiplied (N: an
            ``nn.Linear``'s ``out_features``; ``None`` where
            ``weight_operand`` is). Sizes are symbolic under
            ``jax.export``'s shape polymorphism.
    """

    where: str
    weight: str
    shapes: tuple[tuple[int, ...], ...]
    weight_operand: int | None
    in_features: int | None
    out_features: int | None


_WHERE: contextvars.ContextVar[str] = contextvars.ContextVar(
    "lossscale_matmul_where", default=""
)


def join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def scopes(eqn: Any) -> str:
    """What a higher-order equation adds to the place of its jaxprs'
    equations: its named scopes and the name of the function it calls."""
    return join(_compat.name_stack(eqn), _compat.function_name(eqn) or "")


@contextlib.contextmanager
def inside(eqn: Any) -> Iterator[None]:
    """While planning a higher-order equation's jaxprs: the scopes and
    functions above them, which a callable ``exclude`` reads
    (:attr:`MatmulInfo.where`)."""
    token = _WHERE.set(join(_WHERE.get(), scopes(eqn)))
    try:
        yield
    finally:
        _WHERE.reset(token)


def place(float8: Any) -> str | None:
    """Where a jaxpr is being planned, for its plan's key: a callable
    ``exclude`` may decide otherwise at each place, so that a layer called
    under two scopes is planned at each (``None``: no callable reads it,
    and one plan serves every place)."""
    if float8 is None or not any(callable(e) for e in float8.exclude):
        return None
    return _WHERE.get()


def describe(eqn: Any, role: _weights.Role | None) -> MatmulInfo:
    """The :class:`MatmulInfo` of a ``dot_general`` where it is planned."""
    shapes = tuple(tuple(v.aval.shape) for v in eqn.invars)
    weight, path, k, n = None, "", None, None
    if role is not None and role.weight is not None:
        weight = role.weight
        path = ", ".join(sorted(role.leaves)) or "<constant>"
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        contract, batch = (lc, lb) if weight == 0 else (rc, rb)
        k = math.prod(shapes[weight][d] for d in contract)
        n = math.prod(
            size
            for d, size in enumerate(shapes[weight])
            if d not in (*contract, *batch)
        )
    where = join(_WHERE.get(), _compat.name_stack(eqn))
    return MatmulInfo(where, path, shapes, weight, k, n)


def label(entry: str | Callable[..., Any]) -> str:
    """An ``exclude`` entry as messages name it: a name quoted, a
    callable by its qualified name."""
    if isinstance(entry, str):
        return repr(entry)
    return getattr(entry, "__qualname__", None) or repr(entry)


def excluded_by(
    eqn: Any, float8: Any, role: _weights.Role | None, *, matmul: bool = True
) -> Any:
    """The first of ``float8.exclude`` that keeps the equation out of
    float8: a name of the matmul's weight path, a scope it was traced in,
    or the function it calls, or (for a ``matmul``) a callable that
    returns ``True`` for its :class:`MatmulInfo`; ``None``: none. A
    callable's exception propagates."""
    if not float8.exclude:
        return None
    names = [_compat.name_stack(eqn), _compat.function_name(eqn) or ""]
    if role is not None and role.weight is not None:
        names.extend(role.leaves)
    info = None
    for entry in float8.exclude:
        if isinstance(entry, str):
            if matches(entry, names):
                return entry
        elif matmul:
            info = describe(eqn, role) if info is None else info
            if entry(info):
                return entry
    return None


def kept_out(eqn: Any, float8: Any, used: set[tuple[str, Any]]) -> str | None:
    """Why a higher-order equation's matmuls are kept out of float8
    (``float8``: the recipe, or ``None``), as :func:`lossscale.matmuls`
    says it: traced in :func:`lossscale.compute_scope`, or a function or
    scope that an ``exclude`` name names (noted in ``used``; a callable
    decides on each matmul inside instead); ``None``: not."""
    if float8 is None:
        return None
    if in_compute_scope(eqn):
        return "compute_scope"
    entry = excluded_by(eqn, float8, None, matmul=False)
    if entry is None:
        return None
    used.add(("exclude", entry))
    return f"Float8(exclude=...): {label(entry)}"


def float8_ineligible(
    eqn: Any, float8: Any, role: _weights.Role | None, excluded: Any
) -> str | None:
    """Why a ``dot_general`` of the float8 kind runs in the 16-bit
    compute dtype instead (``None``: it runs in float8). ``role``: what
    the dataflow says it is (``None``: not known, and the weight is taken
    to be the rhs); ``excluded``: what :func:`excluded_by` found."""
    if not all(is_float(v.aval.dtype) for v in eqn.invars):
        return "an operand that is not floating point"
    if _compat.explicit_precision(eqn):
        return "precision above DEFAULT"
    if wide_result(eqn):
        return "a preferred_element_type wider than its operands"
    if in_compute_scope(eqn):
        return "compute_scope"
    if excluded is not None:
        return f"Float8(exclude=...): {label(excluded)}"
    weight = None
    if role is not None:
        weight = role.weight
        both = role.reason == "both" and float8.batched
        if weight is None and not both:
            return _weights.REASONS[str(role.reason)]
    lhs, rhs = (v.aval.shape for v in eqn.invars)
    return float8.ineligible(
        lhs, rhs, eqn.params["dimension_numbers"], weight=weight
    )


DERIVATIVE_INSIDE = (
    "lossscale.autocast with a Float8 recipe traced a derivative's matmul "
    "(autocast(jax.grad(f), Float8(...)), jax.jacfwd, or a jax.grad "
    "inside the function): it would run as a forward matmul, without the "
    "recipe's backward formats (tensorwise's e5m2 output gradient, "
    "rowwise_with_gw_hp's 16-bit weight gradient). Differentiate the "
    "autocast function instead: jax.grad(lossscale.autocast(f, "
    "lossscale.Float8(...))); or keep those matmuls 16-bit: "
    "lossscale.compute_scope() around them, or "
    "rules={'dot_general': 'compute'} for the whole function."
)
TRANSPOSED = re.compile(r"(?:^|[/(])(?:transpose|jvp)\(")


def float8_rule(a: KindArgs) -> tuple[Node, list[Info]]:
    """A ``dot_general``'s rule under a float8 recipe: float8 where it is
    a linear layer the recipe takes (its node's ``role``), else
    :func:`matmul_rule` with the reason (its node's ``reason``);
    refused where it is a derivative's."""
    entry = excluded_by(a.eqn, a.float8, a.role)
    if entry is not None:
        a.used.add(("exclude", entry))
    if (
        TRANSPOSED.search(_compat.name_stack(a.eqn))
        and entry is None
        and not in_compute_scope(a.eqn)
    ):
        # Whether it would run in float8 or not: its format would not be
        # the recipe's backward one either way.
        raise TypeError(DERIVATIVE_INSIDE)
    reason = float8_ineligible(a.eqn, a.float8, a.role, entry)
    if reason is not None:
        node, outs = matmul_rule(a)
        return node._replace(reason=reason), outs
    node, outs = a.result(Mode.FLOAT8, Cls.LOW)
    role = a.role
    if role is None or role.weight is None:  # by position: x @ w
        role = _weights.Role(1)
    return node._replace(role=role), outs


def float8_summary(plan: Plan) -> tuple[int, list[str]]:
    """How many float8 matmuls a plan runs (its sub-plans' included), and
    why each matmul of the float8 kind it keeps 16-bit does."""
    count, reasons = 0, []
    for node in plan.nodes.values():
        if node.mode is Mode.FLOAT8:
            count += 1
        elif node.mode is Mode.HIGHER:
            for sub in node.data.plans:
                n, why = float8_summary(sub)
                count += n
                reasons.extend(why)
        elif node.reason is not None:
            reasons.append(node.reason)
    return count, reasons


def quantized_gathers(
    jf: JaxprFacts, nodes: dict[Any, Node], config: Any
) -> dict[Any, str | None]:
    """Marks ``quantized`` each narrow move (a float32 weight gathered in
    the compute dtype) that can move float8 instead: its record says its
    result's largest magnitude is known before it moves, and its every
    reader is a float8 matmul taking it as its weight, or a rearrangement
    (a transpose, a reshape: ``x @ w.T``) whose readers are so in turn,
    under a recipe that casts the weight once per tensor (a row-wise
    recipe quantises the weight again along other axes for the input
    gradient, so it is gathered in 16 bits: :func:`gathered_why`). Its
    result is then the float32 weight that the matmuls' gradients flow
    through, and each such rearrangement is marked ``carries_copy``: bound
    in float32, it rearranges the float8 copy too (not one that a rule of
    the user's asks to run in the compute dtype: ``rules={"transpose":
    "compute"}``). ``config``: the autocast configuration. Returns,
    per narrow move, why it moves 16 bits (None: it moves float8), and
    per gather that moves float32 a weight float8 matmuls read, why (a
    reader that does not round it)."""
    whys: dict[Any, str | None] = {}
    if config.float8 is None:
        return whys
    for eqn in jf.eqns:
        node, ef = nodes[eqn], jf.of[eqn]
        # A float32 weight gathered as it is (a reader does not round
        # it): only why, for lossscale.matmuls' float8 matmuls.
        as_stored = (
            not node.narrow
            and ef.record is not None
            and ef.record.gathers
            and node.outs == (Cls.F32,)
            and ef.float32_in == (True,)
        )
        if not (node.narrow or as_stored):
            continue
        carriers, others = _copy_readers(jf, nodes, eqn.outvars[0], config)
        if as_stored:
            if others:
                whys[eqn] = _read_by(others)
            continue
        whys[eqn] = why = gathered_why(jf, eqn, config.float8, others)
        if why is None:
            nodes[eqn] = node._replace(quantized=True, outs=(Cls.F32,))
            for carrier in carriers:
                nodes[carrier] = nodes[carrier]._replace(
                    mode=Mode.FLOAT32,
                    ins=(Cls.F32,),
                    outs=(Cls.F32,),
                    reads32=(True,),
                    carries_copy=True,
                )
    return whys


def gathered_why(
    jf: JaxprFacts, eqn: Any, float8: Any, others: list[str]
) -> str | None:
    """Why the narrow move ``eqn`` moves its float32 weight in the compute
    dtype, not in float8 (None: it can move float8); ``others``: the
    readers its float8 copy cannot reach (:func:`_copy_readers`)."""
    record = jf.of[eqn].record
    name = eqn.primitive.name
    row = float8.row
    if not row.weight_cast_once:
        if row.weight.rowwise:
            return (
                "the recipe scales the weight by rows, and quantises it "
                "again for the input gradient"
            )
        return "the recipe casts the weight again for the input gradient"
    if record is None or not record.gathers_float8:
        return f"a {name} moves a part of the weight, not a whole one"
    if eqn.params.get("axis_index_groups") is not None:
        return f"a {name} with axis_index_groups"
    return _read_by(others) if others else None


def _read_by(others: list[str]) -> str:
    return (
        f"it is read by {', '.join(others)}, not only as float8 matmuls' weight"
    )


def _copy_readers(
    jf: JaxprFacts, nodes: Any, var: Any, config: Any
) -> tuple[list[Any], list[str]]:
    """Where the float8 copy of the weight ``var`` would go: the
    rearrangements that carry it to float8 matmuls taking it as their
    weight, and the readers it cannot reach (their names, and the
    function's output), which keep the weight 16-bit."""
    carriers: list[Any] = []
    others: set[str] = set()
    output = False
    pending = [var]
    while pending:
        value = pending.pop()
        output = output or value in jf.outputs
        for reader, i in jf.readers.get(value, ()):
            node = nodes[reader]
            if (
                node.mode is Mode.FLOAT8
                and node.role is not None
                and node.role.weight == i
            ):
                continue
            record = jf.of[reader].record
            name = reader.primitive.name
            if (
                record is not None
                and record.rearranges
                and len(reader.invars) == 1
            ):
                override = config.record(reader.primitive)[1]
                if dict(config.rules).get(override) == "compute":
                    # Asked to run in the compute dtype: it rounds (the
                    # other rules keep a float32 operand float32).
                    others.add(f"{name} (its rule overridden)")
                    continue
                carriers.append(reader)
                pending.append(reader.outvars[0])
            else:
                others.add(name)
    names = sorted(others)
    if output:
        names.append("the function's output")
    return carriers, names


def emit_float8(call: Any, eqn: Any, invals: list[Any], weight: int) -> list:
    """A matmul in float8: its operands are quantised from the dtypes they
    are stored in (a float32 weight directly, not through 16 bits);
    ``weight``: which operand is its weight."""
    lhs, rhs = invals
    with float8_forward_mode(), _compat.equation_context(eqn):
        return [
            _fp8.dot_general(
                lhs,
                rhs,
                eqn.params["dimension_numbers"],
                call.config.float8,
                out_sharding=eqn.params.get("out_sharding"),
                weight=weight,
                # Moved in float8 (quantized_gathers): its copy is taken.
                quantized_weight=quantized_copy(invals[weight]),
            )
        ]


@contextlib.contextmanager
def float8_forward_mode() -> Iterator[None]:
    """JAX's refusal to differentiate a float8 matmul in forward mode,
    raised inside, as autocast explains it (JAX's ``TypeError`` chained
    below; any other error unchanged). A ``jax.jit`` of the user's
    holding one is refused where it is bound, so its emission is wrapped
    too."""
    try:
        yield
    except TypeError as err:
        if "forward-mode" not in str(err):
            raise
        raise TypeError(
            "lossscale.autocast with a Float8 recipe: forward-mode "
            "differentiation (jax.jvp, jax.jacfwd, jax.linearize) of a "
            "float8 matmul is not supported, since its gradient is a "
            "jax.custom_vjp (JAX's message is chained below). Keep the "
            "matmuls 16-bit where you need it: "
            "lossscale.autocast(fun, lossscale.Float8(...), "
            "rules={'dot_general': 'compute'}), or use reverse mode "
            "(jax.grad, jax.vjp, jax.jacrev)."
        ) from err
