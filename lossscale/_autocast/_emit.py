"""The second pass: binding every equation once, at the dtypes planned.

:func:`emit` evaluates a jaxpr with :func:`lossscale._interpret.run` (the
core the copy-free skip shares) under the caller's trace, casting each
equation's float operands to the dtype its :class:`~._infer.Node` names
and storing each result in its class's dtype. Higher-order equations are
emitted by their handlers (:mod:`._higher`), from the plans the first
pass made of their jaxprs.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax import lax

from lossscale import _compat, _interpret
from lossscale._autocast import _higher
from lossscale._autocast._classes import F32_DTYPE, Cls, class_dtype, is_float
from lossscale._autocast._infer import Ctx, Node, Plan


def dtype_of(x: Any) -> Any:
    """``x``'s dtype: a numpy dtype, or an extended one (PRNG keys)."""
    dtype = getattr(x, "dtype", None)
    return np.asarray(x).dtype if dtype is None else dtype


def cast(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype`` (one conversion per value and dtype per
    evaluation)."""
    # Compared before np.dtype, which refuses extended dtypes: a PRNG key
    # is "cast" to its own dtype, which is no cast at all.
    if dtype_of(x) == dtype:
        return x
    dtype = np.dtype(dtype)
    if isinstance(x, np.ndarray | np.generic) or not hasattr(x, "dtype"):
        return np.asarray(x).astype(dtype)
    cache = _CASTS.get()
    if cache is None:
        return lax.convert_element_type(x, dtype)
    key = (id(x), dtype)
    hit = cache.get(key)
    if hit is None or hit[0] is not x:
        # The value is kept with its cast, so that its id is not reused.
        hit = (x, lax.convert_element_type(x, dtype))
        cache[key] = hit
    return hit[1]


def strong(x: Any, dtype: Any) -> Any:
    """``x`` in ``dtype``, strongly typed (a loop carry, a branch output,
    a call's operand must have one type)."""
    if not is_float(dtype_of(x)) and not is_float(dtype):
        return x
    if isinstance(x, np.ndarray | np.generic) or not hasattr(x, "dtype"):
        return np.asarray(x).astype(dtype)
    if dtype_of(x) == dtype and not getattr(jax.typeof(x), "weak_type", False):
        return x
    return lax.convert_element_type(x, dtype)


def as_class(ctx: Ctx, x: Any, cls: Cls, traced: Any) -> Any:
    """``x`` stored for ``cls``, strongly typed; a constant or a value
    autocast keeps in the dtype it was traced with (``traced``)."""
    dtype = class_dtype(cls, ctx.compute)
    if dtype is None:
        if not is_float(traced):
            return x
        dtype = traced
    return strong(x, dtype)


# One cast of a value to a dtype per trace level: an activation read in
# float32 by several equations is converted once. A cache belongs to the
# evaluation that opened it (a loop body's values must not leak out).
_CASTS: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar(
    "lossscale_autocast_casts", default=None
)


@contextlib.contextmanager
def _cast_cache() -> Iterator[None]:
    token = _CASTS.set({})
    try:
        yield
    finally:
        _CASTS.reset(token)


def emit(
    ctx: Ctx,
    jaxpr: Any,
    plan: Plan,
    consts: Sequence[Any],
    args: Sequence[Any],
) -> list[Any]:
    """Evaluates the open ``jaxpr`` by ``plan``; ``args`` are stored for
    ``plan.ins``. Returns the outputs, stored for ``plan.outs``."""

    def apply(eqn: Any, invals: list[Any]) -> list[Any]:
        return equation(ctx, eqn, plan.nodes[eqn], invals)

    def apply_group(run: Sequence[Any], read: Any) -> list[Any]:
        return _island(ctx, plan, run, read)

    with _cast_cache():
        return _interpret.run(
            jaxpr,
            consts,
            args,
            apply=apply,
            groups=plan.islands,
            apply_group=apply_group,
        )


def _island(ctx: Ctx, plan: Plan, run: Sequence[Any], read: Any) -> list[Any]:
    """A float32 island (:func:`._infer._islands`) under ``checkpoint``:
    its inputs are what the backward pass keeps of it."""
    defined = {v for eqn in run for v in eqn.outvars}
    inputs: list[Any] = []
    for eqn in run:
        for atom in eqn.invars:
            if (
                _compat.is_var(atom)
                and atom not in defined
                and atom not in inputs
            ):
                inputs.append(atom)
    values = [read(a) for a in inputs]
    traced = [i for i, x in enumerate(values) if _compat.is_tracer(x)]

    def body(*xs: Any) -> list[Any]:
        env = dict(zip(inputs, values, strict=True))
        for i, x in zip(traced, xs, strict=True):
            env[inputs[i]] = x
        outs = []
        with _cast_cache():
            for eqn in run:
                invals = [
                    _compat.literal_value(a)
                    if _compat.is_literal(a)
                    else env[a]
                    for a in eqn.invars
                ]
                node = plan.nodes[eqn]._replace(remat=False)
                results = equation(ctx, eqn, node, invals)
                env.update(zip(eqn.outvars, results, strict=True))
                outs.extend(results)
        return outs

    args = [values[i] for i in traced]
    with jax.named_scope(ISLAND_SCOPE):
        return _island_bind(ctx, plan, run, inputs, values, traced, body, args)


# The name of the checkpoints autocast adds around float32 islands, as
# profiles (and tests telling them from the program's own) see them.
ISLAND_SCOPE = "lossscale_island"


def _island_bind(
    ctx: Ctx,
    plan: Plan,
    run: Sequence[Any],
    inputs: Sequence[Any],
    values: Sequence[Any],
    traced: Sequence[int],
    body: Any,
    args: list[Any],
) -> list[Any]:
    key = _island_key(plan, run, inputs, values, traced)
    if key is not None:
        # The same island in every layer of a model is traced once: JAX
        # caches its derivative per jaxpr.
        hit = ctx.emitted.get(key)
        if hit is None:
            closed = jax.make_jaxpr(body)(*args)
            hit = ctx.emitted[key] = None if closed.consts else closed.jaxpr
        if hit is not None:
            return _compat.bind_remat(hit, args)
    return list(_compat.checkpoint(body, prevent_cse=False)(*args))


def _island_key(
    plan: Plan,
    run: Sequence[Any],
    inputs: Sequence[Any],
    values: Sequence[Any],
    traced: Sequence[int],
) -> Any:
    """What an island computes, from its structure and its operands'
    types (``None``: not hashable, or with concrete operands)."""
    if len(traced) != len(values):
        return None
    position: dict[Any, tuple[Any, ...]] = {
        v: ("in", k) for k, v in enumerate(inputs)
    }
    parts: list[Any] = []
    for n, eqn in enumerate(run):
        refs = []
        for atom in eqn.invars:
            if _compat.is_literal(atom):
                value = np.asarray(_compat.literal_value(atom))
                refs.append(("lit", str(value.dtype), value.tobytes()))
            else:
                refs.append(position[atom])
        for m, var in enumerate(eqn.outvars):
            position[var] = ("out", n, m)
        node = plan.nodes[eqn]
        parts.append(
            (
                eqn.primitive,
                tuple(sorted(eqn.params.items())),
                tuple(refs),
                node.mode,
                node.ins,
                node.outs,
            )
        )
    key = ("island", tuple(parts), tuple(jax.typeof(x) for x in values))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def store(ctx: Ctx, outs: Sequence[Any], classes: Sequence[Cls]) -> list:
    result = []
    for x, cls in zip(outs, classes, strict=True):
        dtype = class_dtype(cls, ctx.compute)
        if dtype is not None and is_float(dtype_of(x)):
            x = cast(x, dtype)
        result.append(x)
    return result


def equation(ctx: Ctx, eqn: Any, node: Node, invals: list[Any]) -> list[Any]:
    if node.mode == "higher":
        name = eqn.primitive.name
        try:
            _compat.check_params(eqn)
            outs = _higher.HANDLERS[name].emit(ctx, eqn, node, invals)
        except _compat.UnknownParams as err:
            warnings.warn(
                f"lossscale.autocast: {name} has params autocast does not "
                f"know on this JAX ({jax.__version__}): {err}; it runs at "
                "its traced dtypes. Please report this.",
                RuntimeWarning,
                stacklevel=2,
            )
            outs = bind(ctx, eqn, node, invals, None)
        return store(ctx, outs, node.outs)
    if node.mode == "convert":
        return _compat.bind_equation(eqn, invals)
    dtype = {"compute": ctx.compute, "float32": F32_DTYPE}.get(node.mode)
    if node.remat:
        # The backward pass of x ** 3 (or exp x) would keep a float32
        # copy of 3 x ** 2 (or exp x): it keeps the compute-dtype x
        # instead, and recomputes the rest, which is elementwise and cheap.
        positions = [i for i, x in enumerate(invals) if _compat.is_tracer(x)]

        def island(*xs: Any) -> list[Any]:
            vals = list(invals)
            for i, x in zip(positions, xs, strict=True):
                vals[i] = x
            return store(ctx, bind(ctx, eqn, node, vals, dtype), node.outs)

        return list(
            _compat.checkpoint(island, prevent_cse=False)(
                *[invals[i] for i in positions]
            )
        )
    return store(ctx, bind(ctx, eqn, node, invals, dtype), node.outs)


def bind(
    ctx: Ctx, eqn: Any, node: Node, invals: Sequence[Any], dtype: Any
) -> list[Any]:
    """Binds ``eqn`` with its float operands cast to ``dtype`` (``None``:
    to the dtypes it was traced with)."""
    xs = []
    for x, cls, atom in zip(invals, node.ins, eqn.invars, strict=True):
        traced = atom.aval.dtype
        if cls == Cls.KEEP or not is_float(traced):
            xs.append(x)
        else:
            xs.append(cast(x, traced if dtype is None else dtype))
    return _compat.bind_equation(eqn, xs, _params(eqn, dtype))


def _params(eqn: Any, dtype: Any) -> dict[str, Any] | None:
    """The equation's params, with its float result dtype set to ``dtype``."""
    if dtype is None:
        return None
    changed = None
    for key in ("preferred_element_type", "out_dtype"):
        value = eqn.params.get(key)
        if value is not None and is_float(value):
            changed = dict(eqn.params) if changed is None else changed
            changed[key] = dtype
    return changed
