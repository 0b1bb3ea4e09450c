"""One call of an autocast function, under the caller's trace.

:func:`call` traces the function at the dtypes of its arguments, plans
the jaxpr (:mod:`._infer`), evaluates it by that plan (:mod:`._emit`),
casts the outputs to the dtypes the function gives them without autocast
(or to ``output_dtype``), and writes back the flax NNX state the function
updated in place.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _compat, _interop
from lossscale._autocast import _emit, _higher, _infer, _matmul, _weights
from lossscale._autocast._cast import cast as cast_to
from lossscale._autocast._cast import dtype_of, store
from lossscale._autocast._classes import F32_DTYPE, Cls, is_float
from lossscale._autocast._config import Call, Config


class Result(NamedTuple):
    value: Any
    used: frozenset[tuple[str, Any]]  # the overrides that applied
    functions: frozenset[str]  # the functions the program called
    # The positions of the array arguments that a jax.jit called on them
    # directly donates, and an output of the same type could take (so that
    # an eager call may donate them too).
    donated: frozenset[int] = frozenset()
    # Whether the function read device arrays it closes over (a model's
    # weights, a global): a program compiled from this trace holds them.
    captures: bool = False
    # Under a float8 recipe: how many float8 matmuls the program runs, and
    # why the others of the float8 kind stay 16-bit.
    float8_summary: tuple[int, tuple[str, ...]] = (0, ())


def is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or (
        _compat.is_tracer(x)
    )


def input_class(x: Any, compute: np.dtype) -> Cls:
    dtype = dtype_of(x)
    if isinstance(x, np.ndarray | np.generic):
        # JAX reads a NumPy array in its own dtype for it: a float64 batch
        # (what data loaders give) is float32 unless x64 is enabled.
        dtype = cast(Any, jax.typeof(x)).dtype
    if not is_float(dtype) or np.dtype(dtype).itemsize > 4:
        return Cls.KEEP
    if np.dtype(dtype) == F32_DTYPE:
        return Cls.F32
    if np.dtype(dtype) == compute:
        return Cls.LOW
    return Cls.KEEP


class Planned(NamedTuple):
    """A function traced and planned, not yet evaluated."""

    closed: Any  # the closed jaxpr of ``flat``
    plan: Any
    arrays: list[Any]  # its operands
    out_shape: Any
    holders: list[Any]  # NNX Variables among the leaves, where written
    dynamic: list[int]
    changed: list[int]


def trace(
    config: Config,
    out_dtype: np.dtype | None,
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Planned:
    """``fun`` traced at its arguments' dtypes, and planned."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if is_array(leaf)]
    # State that fun updates in place (flax NNX's Variables: BatchNorm's
    # statistics, an RNG's counter) is updated in the copies fun is traced
    # with: it comes out of the trace as extra outputs and is written back.
    holders = jax.tree.leaves((args, kwargs), is_leaf=_interop.is_variable)
    mutable = [
        j
        for j, i in enumerate(dynamic)
        if len(holders) == len(leaves) and _interop.is_variable(holders[i])
    ]
    record: dict[str, Any] = {}

    def flat(*arrays: Any) -> Any:
        full = list(leaves)
        for i, array in zip(dynamic, arrays, strict=True):
            full[i] = array
        a, k = jax.tree.unflatten(treedef, full)
        out = fun(*a, **k)
        after = jax.tree.leaves((a, k))
        changed = [
            j
            for j in mutable
            if len(after) == len(leaves) and after[dynamic[j]] is not arrays[j]
        ]
        record["changed"] = changed
        return out, [after[dynamic[j]] for j in changed]

    arrays = [leaves[i] for i in dynamic]
    try:
        closed, (out_shape, _) = jax.make_jaxpr(flat, return_shape=True)(
            *arrays
        )
    except Exception as err:
        if _interop.is_trace_context_error(err):
            raise _closed_over_state(fun) from err
        raise
    jaxpr = closed.jaxpr
    # Outputs read in float32 (their traced dtype, or output_dtype) let
    # the last elementwise operations before them run in float32 too.
    wide = out_dtype is None or out_dtype.itemsize >= 4
    n = len(jaxpr.outvars)
    analysed = contextlib.nullcontext()
    if config.float8 is not None:
        argnums = params_argnums(config.float8, fun)
        sources = input_sources(
            config.float8, argnums, fun, args, kwargs, dynamic
        )
        consts = const_sources(argnums, closed.consts)
        analysed = _weights.at({jaxpr: (*consts, *sources)})
    with analysed:
        plan = _infer.infer(
            config,
            jaxpr,
            _higher.closed_consts(config, closed),
            [input_class(x, config.compute) for x in arrays],
            [wide] * n,
            [wide] * n,
        )
    return Planned(
        closed, plan, arrays, out_shape, holders, dynamic, record["changed"]
    )


def _own_arrays(fun: Callable[..., Any]) -> bool:
    """Whether ``fun`` holds arrays itself: a model called as the function
    (an equinox or flax NNX module, a bound method of one)."""
    try:
        leaves = jax.tree.leaves(fun)
    except Exception:  # not a pytree JAX can flatten
        return False
    return any(is_array(leaf) for leaf in leaves if leaf is not fun)


def params_argnums(float8: Any, fun: Callable[..., Any]) -> tuple[int, ...]:
    """The positional arguments that hold the parameters: the recipe's
    ``params_argnums``, or by default the first argument, or none where
    ``fun`` is a model holding its own weights (``autocast(model)(x)``)."""
    argnums = float8.params_argnums
    if argnums is None:
        return () if _own_arrays(fun) else (0,)
    return argnums if isinstance(argnums, tuple) else (argnums,)


def input_sources(
    float8: Any,
    argnums: tuple[int, ...],
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dynamic: list,
) -> list[_weights.Source]:
    """What each array argument is to a float8 recipe: a parameter (in
    the positional arguments ``argnums``, from :func:`params_argnums`;
    with its path where a recipe's ``exclude`` or
    :func:`lossscale.matmuls` reads it), integer data, or data."""
    if argnums and max(argnums) >= len(args):
        raise ValueError(
            f"params_argnums={float8.params_argnums!r} of the Float8 recipe "
            f"names an argument the call does not have ({len(args)} "
            "positional arguments): it names the arguments that hold the "
            "parameters, as jax.grad's argnums does."
        )
    paths = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
    names: list[str] = []
    if float8.exclude or _weights.names_wanted():
        names = param_names(fun, paths, dynamic, several=len(argnums) > 1)
    sources = []
    for j, i in enumerate(dynamic):
        path, leaf = paths[i]
        positional = getattr(path[0], "idx", None) == 0
        if positional and getattr(path[1], "idx", None) in argnums:
            leaves = frozenset(names[j : j + 1])
            sources.append(_weights.Source(_weights.Src.PARAM, leaves))
        elif is_float(dtype_of(leaf)):
            sources.append(_weights.DATA)
        else:
            sources.append(_weights.INDEX)
    return sources


def const_sources(
    argnums: tuple[int, ...], consts: list[Any]
) -> list[_weights.Source]:
    """What each value the function closes over is: a constant (a
    parameter) if it is concrete, or where no argument holds parameters
    (``params_argnums=()``, or a model called as the function); else a
    value of an enclosing trace, such as the batch that ``loss_fn(params)``
    closes over inside a jitted step: data."""
    closed_params = not argnums
    return [
        _weights.PARAM
        if closed_params or not _compat.is_tracer(c)
        else (_weights.DATA if is_float(dtype_of(c)) else _weights.INDEX)
        for c in consts
    ]


def param_names(
    fun: Callable[..., Any], paths: list[Any], dynamic: list, several: bool
) -> list[str]:
    """Each array argument's path (``paths``: those of the flattened
    ``(args, kwargs)``), as :class:`lossscale.Matmul` names a weight:
    inside its argument, dotted (``"head.kernel"``), after the argument's
    name where ``several`` arguments hold parameters, or where the
    argument is the array itself (``"w"``)."""
    try:
        arg_names = list(inspect.signature(fun).parameters)
    except (TypeError, ValueError):  # a builtin, a C extension
        arg_names = []
    names = []
    for i in dynamic:
        path = paths[i][0]
        index = getattr(path[1], "idx", None)
        arg = f"args[{index}]"
        if isinstance(index, int) and index < len(arg_names):
            arg = arg_names[index]
        inner = jax.tree_util.keystr(
            tuple(path[2:]), simple=True, separator="."
        )
        # A flax NNX Variable holds its array in "value": the parameter is
        # the Variable ("head.kernel").
        inner = inner.removesuffix(".value") if inner != "value" else inner
        if not inner:
            names.append(arg)
        else:
            names.append(f"{arg}.{inner}" if several else inner)
    return names


def call(
    config: Config,
    out_dtype: np.dtype | None,
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Result:
    """``fun(*args, **kwargs)`` under autocast."""
    t = trace(config, out_dtype, fun, args, kwargs)
    jaxpr = t.closed.jaxpr
    outs = _emit.emit(
        Call(config),
        jaxpr,
        t.plan,
        store(t.closed.consts, t.plan.consts, config.compute),
        t.arrays,
    )
    n_out = len(jax.tree.leaves(t.out_shape))
    results = []
    for x, atom in zip(outs[:n_out], jaxpr.outvars, strict=False):
        # Through dtype_of: jax 0.12 types an outvar's aval as the
        # abstract base class, which has no dtype attribute.
        dtype = dtype_of(atom.aval)
        if out_dtype is not None and is_float(dtype):
            dtype = out_dtype
        if not isinstance(x, jax.Array):
            # A constant output is a literal of the jaxpr (jax's own int
            # and float subclasses): an array, as jax.jit returns it.
            x = jnp.asarray(x)
        results.append(cast_to(x, dtype))
    for j, x in zip(t.changed, outs[n_out:], strict=True):
        _interop.set_variable(
            t.holders[t.dynamic[j]], cast_to(x, dtype_of(t.arrays[j]))
        )
    value = jax.tree.unflatten(jax.tree.structure(t.out_shape), results)
    captures = any(
        isinstance(c, jax.Array) and not _compat.is_tracer(c)
        for c in t.closed.consts
    )
    count, reasons = _matmul.float8_summary(t.plan)
    return Result(
        value,
        t.plan.used,
        t.plan.functions,
        _donated(jaxpr, results),
        captures,
        (count, tuple(reasons)),
    )


def _donated(jaxpr: Any, outs: list[Any]) -> frozenset[int]:
    """The inputs of ``jaxpr`` that a ``jax.jit`` it calls donates, each
    for an output of its type (XLA can only reuse a donated buffer for
    one; plain JAX warns of the others)."""
    position = {v: k for k, v in enumerate(jaxpr.invars)}
    free = [(np.shape(x), dtype_of(x)) for x in outs]
    found = set()
    for eqn in jaxpr.eqns:
        flags = eqn.params.get("donated_invars") or ()
        if not _compat.is_jit(eqn):
            continue
        for atom, donated in zip(eqn.invars, flags, strict=False):
            if not (donated and _compat.is_var(atom) and atom in position):
                continue
            kind = (tuple(atom.aval.shape), atom.aval.dtype)
            if kind in free and position[atom] not in found:
                free.remove(kind)
                found.add(position[atom])
    return frozenset(found)


def _closed_over_state(fun: Callable[..., Any]) -> Exception:
    name = getattr(fun, "__name__", repr(fun))
    return ValueError(
        f"lossscale.autocast({name}): the function updates flax NNX state "
        "(BatchNorm's statistics, Dropout's RNG counter) that it closes "
        "over, and flax refuses an update from inside autocast's trace "
        "(its TraceContextError is chained below). Pass the model as an "
        "argument instead, and autocast writes its updated state back: "
        "lossscale.autocast(loss_fn)(model, x, y), or "
        "nnx.value_and_grad(lossscale.autocast(loss_fn))(model, x, y)."
    )


def warn_unused(
    config: Config,
    used: frozenset[tuple[str, Any]],
    functions: frozenset[str],
    warned: set[tuple[str, Any]],
) -> None:
    """Warns, once each, of the overrides no equation matched; refuses a
    function's name given as a primitive's."""
    unused = config.overrides - used - warned
    for kind, name in sorted(unused, key=lambda o: (o[0], _matmul.label(o[1]))):
        if kind == "primitive" and name in functions:
            raise ValueError(
                f"rules[{name!r}]: {name!r} is a function of the traced "
                "program, not a primitive: give its rule in "
                f"function_rules={{{name!r}: ...}} ('float32' or "
                "'autocast'; a function cannot be bound at other dtypes "
                "than its own, so 'compute' and 'promote' are primitives' "
                "rules only)."
            )
        warned.add((kind, name))
        if kind == "exclude" and callable(name):
            warnings.warn(
                "lossscale.autocast: Float8(exclude=...) callable "
                f"{_matmul.label(name)} returned True for no matmul "
                "(lossscale.matmuls lists each matmul's weight path, "
                "shapes and scopes).",
                UserWarning,
                stacklevel=4,
            )
            continue
        if kind == "exclude":
            warnings.warn(
                f"lossscale.autocast: Float8(exclude=...) entry {name!r} is "
                "part of no matmul's weight path or named scope (a typo? "
                "lossscale.matmuls lists each matmul's weight path and "
                "scopes).",
                UserWarning,
                stacklevel=4,
            )
            continue
        where = "rules" if kind == "primitive" else "function_rules"
        warnings.warn(
            f"lossscale.autocast: {where}[{name!r}] matches no "
            f"{'primitive' if kind == 'primitive' else 'function'} of the "
            "traced program (a typo, or a function that is not jax.jit-ed, "
            "custom_jvp or custom_vjp?).",
            UserWarning,
            stacklevel=4,
        )


def warn_no_float8(
    config: Config, summary: tuple[int, tuple[str, ...]], warned: set
) -> None:
    """Warns, once, that a float8 recipe ran no float8 matmul, and why."""
    count, reasons = summary
    if config.float8 is None or count or ("float8", "none") in warned:
        return
    if dict(config.rules).get("dot_general", "float8") != "float8":
        return  # the user's rule keeps the matmuls out
    warned.add(("float8", "none"))
    if reasons:
        tally: dict[str, int] = {}
        for reason in reasons:
            tally[reason] = tally.get(reason, 0) + 1
        why = "; ".join(f"{r} ({n}x)" for r, n in tally.items())
        why = f"its {len(reasons)} matmuls stayed 16-bit: {why}"
        if _weights.REASONS["neither"] in tally:
            why += (
                " (a function that closes over its weights and takes the "
                "data as its first argument: Float8(params_argnums=()))"
            )
    else:
        why = "it has no matmul that a float8 recipe runs (dot_general)"
    warnings.warn(
        f"lossscale.autocast with {config.float8!r} ran no float8 matmul: "
        f"{why}. lossscale.matmuls lists each matmul and why.",
        UserWarning,
        stacklevel=4,
    )
