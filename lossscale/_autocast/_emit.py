"""The second pass: binding every equation once, at the dtypes planned.

:func:`emit` evaluates a jaxpr with :func:`lossscale._interpret.run` (the
core the copy-free skip shares) under the caller's trace, casting each
equation's float operands to the dtype its :class:`~._plan.Node`'s mode
names and storing each result in its class's dtype. This pass owns its
table of higher-order primitives (:data:`HIGHER`), which :mod:`._handlers`
registers into; float32 islands are bound by :mod:`._islands`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax

from lossscale import _compat, _interpret
from lossscale._autocast import _islands, _matmul, _scaling
from lossscale._autocast._cast import (
    cast,
    cast_cache,
    quantized_copy,
    remember_quantized,
    store,
)
from lossscale._autocast._classes import F32_DTYPE, Cls, class_dtype, is_float
from lossscale._autocast._config import Call
from lossscale._autocast._plan import Mode, Node, Plan
from lossscale._autocast._rules import TABLE

EmitHigher = Callable[[Call, Any, Node, list[Any]], list[Any]]

HIGHER: dict[Any, EmitHigher] = {}


def register(primitive: Any, emit: EmitHigher) -> None:
    """Registers a higher-order primitive's emission rule."""
    HIGHER[primitive] = emit


def emit(
    call: Call,
    jaxpr: Any,
    plan: Plan,
    consts: Sequence[Any],
    args: Sequence[Any],
) -> list[Any]:
    """Evaluates the open ``jaxpr`` by ``plan``; ``args`` are stored for
    ``plan.ins``. Returns the outputs, stored for ``plan.outs``."""

    def apply(eqn: Any, invals: list[Any]) -> list[Any]:
        return equation(call, eqn, plan.nodes[eqn], invals)

    def apply_group(run: Sequence[Any], read: Any) -> list[Any]:
        return _islands.emit(
            call.islands,
            plan.nodes,
            run,
            read,
            lambda eqn, node, invals: equation(call, eqn, node, invals),
            plan.outside,
        )

    with cast_cache():
        return _interpret.run(
            jaxpr,
            consts,
            args,
            apply=apply,
            groups=plan.islands,
            apply_group=apply_group,
        )


def equation(call: Call, eqn: Any, node: Node, invals: list[Any]) -> list[Any]:
    """Binds one equation by its node; what autocast binds for it (casts,
    a checkpoint) is attributed to the user's line that made it."""
    with _compat.source_context(eqn):
        return _equation(call, eqn, node, invals)


def _equation(call: Call, eqn: Any, node: Node, invals: list[Any]) -> list[Any]:
    compute = call.compute
    if node.mode is Mode.HIGHER:
        try:
            _compat.check_params(eqn)
            outs = HIGHER[eqn.primitive](call, eqn, node, invals)
        except _compat.UnknownParams as err:
            name = eqn.primitive.name
            warnings.warn(
                f"lossscale.autocast: {name} has params autocast does not "
                f"know on this JAX ({jax.__version__}): {err}; it runs at "
                "its traced dtypes. Please report this.",
                RuntimeWarning,
                stacklevel=2,
            )
            outs = bind(eqn, node, invals, None)
        return store(outs, node.outs, compute)
    if node.mode is Mode.CONVERT:
        return _compat.bind_equation(eqn, invals)
    if node.mode is Mode.FLOAT8:
        # float8_rule gives each float8 matmul a role naming its weight.
        assert node.role is not None and node.role.weight is not None
        out = _matmul.emit_float8(call, eqn, invals, node.role.weight)
        return store(out, node.outs, compute)
    if node.quantized:
        return float8_move(call, eqn, invals[0])
    if node.carries_copy:
        return float8_rearrange(eqn, invals[0])
    if node.narrow:
        return store(narrow_move(eqn, invals[0], compute), node.outs, compute)
    dtype = {Mode.COMPUTE: compute, Mode.FLOAT32: F32_DTYPE}.get(node.mode)
    if node.remat:
        # The backward pass of x ** 3 (or exp x) would keep a float32
        # copy of 3 x ** 2 (or exp x): it keeps the compute-dtype x
        # instead, and recomputes the rest, which is elementwise and cheap.
        positions = [i for i, x in enumerate(invals) if _compat.is_tracer(x)]

        def island(*xs: Any) -> list[Any]:
            vals = list(invals)
            for i, x in zip(positions, xs, strict=True):
                vals[i] = x
            return store(bind(eqn, node, vals, dtype), node.outs, compute)

        return list(
            _compat.checkpoint(island, prevent_cse=False)(
                *[invals[i] for i in positions]
            )
        )
    return store(bind(eqn, node, invals, dtype), node.outs, compute)


def narrow_move(eqn: Any, x: Any, compute: Any) -> list[Any]:
    """Binds a move of the float32 ``x`` (an all-gather, a resharding) on
    ``x`` rounded to ``compute``, and its derivative in float32.

    Rounding commutes with a move, so the values are those of the move in
    float32 followed by the rounding, at half the bytes moved. Moving the
    rounded value as it is would move its cotangent back in the compute
    dtype too: an FSDP gradient reduce-scattered in 16 bits, whose sum
    over devices rounds where the float32 program's does not. The tangent
    is moved in float32 and then rounded instead, so that its transpose
    (the backward pass) widens the cotangent first and moves (sums) it in
    float32, as PyTorch FSDP2's ``reduce_dtype`` does.
    """

    def move(value: Any) -> Any:
        return _compat.bind_equation(eqn, [value])[0]

    @jax.custom_jvp
    def moved(value: Any) -> Any:
        return move(value.astype(compute))

    @moved.defjvp
    def _(primals: Any, tangents: Any) -> Any:
        (value,), (tangent,) = primals, tangents
        return move(value.astype(compute)), move(tangent).astype(compute)

    return [moved(x)]


def float8_move(call: Call, eqn: Any, x: Any) -> list[Any]:
    """Binds a move of the float32 ``x``, a weight that only float8
    matmuls read, on its float8 copy (``._scaling.quantized_move``): the
    copy's scale is that of the moved value (an all-gather's is the
    ``pmax`` of the shards' over the axes it gathers), so the matmuls
    quantise as they would the weight moved in float32, at a quarter of
    the bytes; its derivative is moved in float32."""

    def move(value: Any) -> Any:
        return _compat.bind_equation(eqn, [value])[0]

    def global_max(amax: Any) -> Any:
        if not TABLE[eqn.primitive].collective:
            return amax  # a resharding moves the whole array
        return jax.lax.pmax(amax, eqn.params["axis_name"])

    moved, copy = _scaling.quantized_move(
        x, move, call.config.float8, global_max
    )
    remember_quantized(moved, copy)
    return [moved]


def float8_rearrange(eqn: Any, x: Any) -> list[Any]:
    """Binds a rearrangement (a transpose, a reshape) of ``x``, a weight
    moved in float8 (:func:`float8_move`), in float32, and the same
    rearrangement of its float8 copy, which its matmuls then take: a
    per-tensor scale is that of every rearrangement of the values, so the
    copy is what they would make of the rearranged weight."""
    out = _compat.bind_equation(eqn, [x])[0]
    copy = quantized_copy(x)
    if copy is not None:
        q, scale = copy
        remember_quantized(out, (_compat.bind_equation(eqn, [q])[0], scale))
    return [out]


def bind(eqn: Any, node: Node, invals: Sequence[Any], dtype: Any) -> list[Any]:
    """Binds ``eqn`` with its float operands cast to ``dtype`` (``None``:
    to the dtypes it was traced with)."""
    xs = []
    for x, cls, atom in zip(invals, node.ins, eqn.invars, strict=True):
        traced = atom.aval.dtype
        if cls == Cls.KEEP or not is_float(traced):
            xs.append(x)
        else:
            xs.append(cast(x, traced if dtype is None else dtype))
    record = TABLE.get(eqn.primitive)
    if record is not None and record.called:
        return _compat.bind_as_call(eqn, xs, _params(eqn, node, dtype))
    return _compat.bind_equation(eqn, xs, _params(eqn, node, dtype))


def _params(eqn: Any, node: Node, dtype: Any) -> dict[str, Any] | None:
    """The equation's params, with its float result dtype set to ``dtype``
    (or to float32, for a matmul whose program asked for a float32 result
    from 16-bit operands)."""
    if dtype is None:
        return None
    if node.outs and node.outs[0] == Cls.F32 and node.mode is Mode.COMPUTE:
        dtype = class_dtype(Cls.F32, dtype)
    changed = None
    for key in ("preferred_element_type", "out_dtype"):
        value = eqn.params.get(key)
        if value is not None and is_float(value):
            changed = dict(eqn.params) if changed is None else changed
            changed[key] = dtype
    return changed
