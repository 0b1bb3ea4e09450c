"""Everything lossscale reads from JAX's internals, with its version shims.

No other module imports ``jax._src`` or relies on the fields of jaxpr
equations and abstract values: when a JAX release moves them, this is the
one place to look. The supported range is the one ``pyproject.toml`` admits
(jax 0.7.0 to the newest): CI runs the tests on both ends of it (the
newest on the newest Python it finds: jax 0.11 and later need 3.12), and
the quick ones on jax 0.9.

What is used, and what happens if it moves:

- jaxpr evaluation (:func:`bind_equation`, :func:`literal_value`,
  :func:`name_stack`, :func:`function_name`): the copy-free skip re-binds
  the inner update's equations, and autocast all of a function's. If the
  skip's fails with an ``AttributeError``/``TypeError``/``KeyError`` it
  falls back to a ``lax.cond`` with a ``RuntimeWarning``
  (``lossscale/_skip.py``).
- the varying mapped axes of an abstract value (:func:`vma`): used to
  refuse a ``shard_map`` whose replicas would disagree on a skip. Unknown
  fields read as "varies over nothing", which disables that check only.
- whether ``shard_map`` tracks varying axes (:func:`unchecked_manual_axes`):
  an internal config state. If it is missing, nothing is detected.
- the params of higher-order equations (``scan``'s ``jaxpr``,
  ``num_consts``, ``num_carry``; ``while``'s, ``cond``'s, ``remat``'s,
  ``shard_map``'s; :func:`call_jaxpr`, :func:`shard_map_axes`) and the
  pieces of a ``custom_jvp_call`` (:func:`bind_with_subfuns`,
  :func:`jvp_jaxpr`): autocast reads them to evaluate those equations'
  jaxprs with its rules. The params it knows on every supported JAX are
  listed in ``HIGHER_ORDER_PARAMS``: an equation with another runs at its
  traced dtypes, with a ``RuntimeWarning`` (``lossscale/_autocast/
  _emit.py``), and ``tests/test_autocast_primitives.py`` fails on a JAX
  that has one.
- inline calls (:func:`bind_as_call`, :func:`convert`): autocast binds
  its matmuls and casts as ``jax.jit`` calls inlined where they are
  staged, as ``jnp.matmul`` is, so that ``jax.grad`` linearizes each
  shape once (JAX's caches are keyed on the call's jaxpr). jax 0.12's
  ``inline=True`` inlines at lowering: ``jax.Inline.JAX_EARLY`` is used
  where it exists. If the calls stopped being inlined, the programs would
  hold ``jit`` equations named after the primitive, and
  ``tests/test_autocast_cost.py`` fails.
- the class of the error a comparison of symbolic dimensions raises
  (:data:`InconclusiveDimensionOperation`, public in ``jax.errors`` on jax
  0.10 and 0.12, in JAX's core only on 0.7): autocast compares sizes to
  choose what a float32 island saves and which matmuls go float8; under
  ``jax.export``'s shape polymorphism an undecidable comparison takes the
  choice that holds for every size.
- the ``PmapSharding`` class (:func:`pmap_laid_out`), which only jax 0.7's
  ``pmap`` outputs carry. If it is missing, such outputs are checked
  eagerly by one program, which first moves them: correct, but a copy.
- primitives of lossscale's own (:func:`bind_as_dot`,
  :func:`lowered_primitive`): a float8 matmul bound as one equation for
  ``jax.checkpoint``'s policies, and a float8 quantisation whose
  StableHLO :class:`Hlo` emits (a scanned model's trace and lowering
  otherwise cost each of its quantisations a dozen equations). If what
  they need is missing, the same ``lax`` operations are traced instead:
  the same numbers, at the old cost. ``tests/test_fp8_kernel.py`` checks
  the emitted operations against ``lax``'s, in order, and their results
  to the bit.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jex_core
from jax.extend import linear_util as jex_lu
from jax.extend import source_info_util


def _inconclusive() -> type[Exception]:
    # Public in jax.errors on jax 0.10 and 0.12; jax 0.7 has it in its
    # core only.
    public = getattr(jax.errors, "InconclusiveDimensionOperation", None)
    if public is not None:
        return public
    from jax._src import core

    return core.InconclusiveDimensionOperation


InconclusiveDimensionOperation = _inconclusive()


__all__ = [
    "InconclusiveDimensionOperation",
    "bind_as_call",
    "bind_equation",
    "convert",
    "inline_jit",
    "is_literal",
    "is_tracer",
    "is_var",
    "like_sharding",
    "literal_value",
    "manual_axes",
    "shardings_hidden",
    "spec",
    "tracing",
    "unchecked_manual_axes",
    "vma",
]


def is_tracer(value: Any) -> bool:
    """Whether ``value`` is an abstract value being traced (not concrete)."""
    return isinstance(value, jax.core.Tracer)


def is_trace_input(x: Any) -> bool | None:
    """Whether a tracer is an input of its trace (a jitted function's
    argument, a branch's operand) rather than computed in it; ``None``
    where this JAX does not say (its tracers record no ``parent``)."""
    # jax >= 0.8's jaxpr tracers keep the equation that made them (an
    # internal field: if it goes, the refusal's message is less precise).
    parent = getattr(x, "parent", _NO_PARENT)
    return None if parent is _NO_PARENT else parent is None


_NO_PARENT = object()


def tracing() -> bool:
    """Whether a transformation (``jit``, ``vmap``, ``grad``...) traces here.

    Concrete arrays can meet a trace (closed over by a jitted function);
    every operation on them is then staged into it and yields a tracer, so
    the concreteness of the inputs does not tell whether results will be.
    """
    from jax._src import core  # no public equivalent

    clean = getattr(core, "trace_state_clean", None)
    if clean is not None:
        return not clean()
    return is_tracer(jnp.zeros(()))  # staged under any trace


# --- varying mapped axes (shard_map) ----------------------------------------


def aval_vma(aval: Any) -> frozenset[Any]:
    """The mapped axes an abstract value varies over under ``shard_map``."""
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax < 0.10


def vma(value: Any) -> frozenset[Any]:
    """The mapped axes ``value`` varies over under ``shard_map`` (else none)."""
    return aval_vma(jax.typeof(value))


def spec(value: Any) -> tuple[Any, ...]:
    """The partition spec in ``value``'s type, one entry per axis.

    Under a mesh with ``AxisType.Explicit`` axes the sharding is part of
    the type; under ``Auto`` axes (or none) every entry reads ``None``.
    """
    return aval_spec(jax.typeof(value))


def aval_spec(aval: Any) -> tuple[Any, ...]:
    """The partition spec in an abstract value, one entry per axis."""
    sharding = getattr(aval, "sharding", None)
    entries = tuple(getattr(sharding, "spec", ()) or ())
    return entries + (None,) * (len(aval.shape) - len(entries))


def like_sharding(value: Any, reference: Any) -> Any:
    """``value`` resharded to ``reference``'s sharding where types carry it.

    Under explicit mesh axes a new state value can come out of an update
    sharded differently from the old one (gradients sharded ZeRO-style
    meeting a replicated moment); a select between the two needs one
    sharding, the new one's.
    """
    new = getattr(jax.typeof(reference), "sharding", None)
    if spec(value) == spec(reference) or not getattr(new, "spec", None):
        return value
    return jax.sharding.reshard(value, new)


def pmap_laid_out(value: Any) -> bool:
    """Whether a concrete array is laid out by ``jax.pmap``.

    On JAX 0.7 such arrays carry a ``PmapSharding``, which ``jax.jit`` takes
    only by moving the data; from 0.8 ``pmap`` returns ordinary
    ``NamedSharding`` arrays. The class is read from ``jax._src``:
    ``jax.sharding.PmapSharding`` warns (``DeprecationWarning``) on 0.8 and
    0.9 (on every eager check, had it been read there) and is gone in 0.10.
    """
    return _PMAP_SHARDING is not None and isinstance(
        value.sharding, _PMAP_SHARDING
    )


def _pmap_sharding_class() -> type | None:
    try:  # see pmap_laid_out
        from jax._src import sharding_impls
    except ImportError:  # pragma: no cover - present on every JAX tested
        return None
    return getattr(sharding_impls, "PmapSharding", None)


_PMAP_SHARDING = _pmap_sharding_class()


def shardings_hidden() -> bool:
    """Whether arrays may be sharded in ways their types do not show.

    True under a mesh in context with an ``Auto`` axis of more than one
    device, and with no mesh in context on a host of several devices: the
    partitioner decides (or the arrays carry) shardings the trace does not
    see. False under explicit axes, inside ``shard_map`` and on one device.
    """
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is None:  # pragma: no cover - every supported JAX has it
        return True
    mesh = get_mesh()
    if not mesh.axis_names:
        return jax.device_count() > 1
    auto = jax.sharding.AxisType.Auto
    return any(
        kind == auto and size > 1
        for kind, size in zip(mesh.axis_types, mesh.axis_sizes, strict=True)
    )


def manual_axes() -> frozenset[Any]:
    """The mapped axes of the ``shard_map`` being traced (else none)."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is None:
        return frozenset()
    return frozenset(getattr(get_mesh(), "manual_axes", ()))


def _vma_checked() -> bool:
    try:
        from jax._src import config
    except ImportError:  # pragma: no cover - a JAX without the module
        return True
    state = getattr(config, "_check_vma", None)
    return True if state is None else bool(state.value)


def unchecked_manual_axes() -> frozenset[Any]:
    """Mapped axes whose varying values JAX does not track, here and now.

    Inside ``shard_map(..., check_vma=False)`` (and inside ``jax.pmap`` on
    the JAX versions that implement it with such a ``shard_map``) every
    value looks replicated, so nothing can tell whether the gradients'
    finiteness differs between devices. Elsewhere this is empty.
    """
    axes = manual_axes()
    if not axes or _vma_checked():
        return frozenset()
    return axes


# --- primitives by name ------------------------------------------------


def _all_primitives() -> dict[str, Any]:
    """Every primitive the installed JAX registers, by name: those
    ``jax.extend.core.primitives`` exports, and those with a lowering
    (``ragged_dot_general``, ``shard_map``, the varying-axes collectives),
    which no public module lists."""
    from jax.extend.core import primitives as public

    found: dict[str, Any] = {}
    try:
        from jax._src.interpreters import mlir  # no public registry

        lowered = [*mlir._lowerings]
        for table in mlir._platform_specific_lowerings.values():
            lowered.extend(table)
    except (ImportError, AttributeError):  # pragma: no cover - every JAX
        lowered = []
    for primitive in lowered:
        found.setdefault(primitive.name, primitive)
    for value in vars(public).values():
        if isinstance(value, jex_core.Primitive):
            found[value.name] = value
    return found


_PRIMITIVES: dict[str, Any] | None = None


def primitives_named(names: Iterable[str]) -> dict[str, Any]:
    """The ``Primitive`` objects of the installed JAX with these names
    (a name it does not have is left out)."""
    global _PRIMITIVES
    if _PRIMITIVES is None:
        _PRIMITIVES = _all_primitives()
    return {n: _PRIMITIVES[n] for n in names if n in _PRIMITIVES}


# --- jaxpr evaluation ---------------------------------------------------


def is_literal(atom: Any) -> bool:
    return isinstance(atom, jex_core.Literal)


def is_var(atom: Any) -> bool:
    return isinstance(atom, jex_core.Var)


def literal_value(atom: Any) -> Any:
    return atom.val


def bind_equation(
    eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None
) -> list[Any]:
    """Evaluates one jaxpr equation, as ``jax.core.eval_jaxpr`` does.

    ``params``, if given, replace the equation's (e.g. a ``dot_general``'s
    ``preferred_element_type`` when autocast changes its dtypes). The
    equation's source information and name stack are kept, so that
    profiles and HLO metadata name the user's code, not lossscale's.
    """
    subfuns, bind_params = _bind_params(eqn, params)
    with equation_context(eqn):
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _bind_params(
    eqn: Any, params: dict[str, Any] | None
) -> tuple[list[Any], dict[str, Any]]:
    """The sub-functions and params ``eqn``'s primitive is bound with
    (``params``, if given, replacing the equation's)."""
    bind_params = eqn.primitive.get_bind_params(
        eqn.params if params is None else params
    )
    if isinstance(bind_params, tuple):  # jax < 0.8 returned (subfuns, params)
        subfuns, bind_params = bind_params
        return list(subfuns), cast(dict[str, Any], bind_params)
    return [], cast(dict[str, Any], bind_params)


def bind_as_call(
    eqn: Any, invals: Sequence[Any], params: dict[str, Any] | None = None
) -> list[Any]:
    """Evaluates one equation as :func:`bind_equation` does, through a
    ``jax.jit(..., inline=True)`` of its primitive alone, one per params
    (``jax.Inline.JAX_EARLY`` on jax 0.12, where ``True`` inlines late).

    This is how ``jnp.matmul`` and ``jnp.einsum`` bind their
    ``dot_general`` (they are inline jits), and why it is cheap to
    differentiate: under ``jax.grad`` JAX linearizes a call's jaxpr once
    and keeps it (its caches are keyed weakly on the jaxpr), where a bare
    primitive is linearized anew at every binding. A staging trace inlines
    the call, so the program is the same equations, with the same source
    lines and name stacks. Params that cannot be hashed, a primitive with
    several results or with sub-functions are bound directly.
    """
    primitive = eqn.primitive
    subfuns, bind_params = _bind_params(eqn, params)
    if subfuns or primitive.multiple_results:
        return bind_equation(eqn, invals, params)
    try:
        fun = _inline_call(primitive, tuple(bind_params.items()))
    except TypeError:  # an unhashable param
        return bind_equation(eqn, invals, params)
    with equation_context(eqn):
        return [fun(*invals)]


@functools.lru_cache(maxsize=1024)
def _inline_call(primitive: Any, params: tuple[tuple[str, Any], ...]) -> Any:
    kwargs = dict(params)

    def call(*args: Any) -> Any:
        return primitive.bind(*args, **kwargs)

    call.__name__ = call.__qualname__ = primitive.name
    return jax.jit(call, inline=_INLINE)


def inline_jit(fun: Callable[..., Any], **kwargs: Any) -> Any:
    """``jax.jit(fun, inline=True, **kwargs)``, inlined where it is staged
    on every supported JAX (``jax.Inline.JAX_EARLY`` on jax 0.12), as
    ``jnp``'s functions are: traced once per abstract signature, then its
    equations copied into the caller's jaxpr at each call."""
    return jax.jit(fun, inline=_INLINE, **kwargs)


def convert(x: Any, dtype: Any) -> Any:
    """``lax.convert_element_type(x, dtype)``, as an inline call per dtype
    where ``x`` is traced (linearized once per shape under ``jax.grad``,
    as :func:`bind_as_call` says)."""
    if not is_tracer(x):
        return lax.convert_element_type(x, dtype)
    return _converter(np.dtype(dtype))(x)


@functools.lru_cache(maxsize=64)
def _converter(dtype: np.dtype) -> Any:
    return jax.jit(
        functools.partial(lax.convert_element_type, new_dtype=dtype),
        inline=_INLINE,
    )


# Inlined where the call is staged, as jnp's own inline jits are: jax 0.12
# made ``inline=True`` mean "at lowering" (``jax.Inline.JAX_LATE``), which
# would keep the calls in the jaxpr, and gave jnp ``JAX_EARLY``.
_INLINE: Any = getattr(getattr(jax, "Inline", None), "JAX_EARLY", True)


@contextlib.contextmanager
def equation_context(eqn: Any) -> Iterator[None]:
    info = getattr(eqn, "source_info", None)
    ctx = getattr(eqn, "ctx", None)
    with contextlib.ExitStack() as stack:
        if info is not None:
            names = source_info_util.current_name_stack() + info.name_stack
            stack.enter_context(
                source_info_util.user_context(info.traceback, name_stack=names)
            )
        if ctx is not None:
            stack.enter_context(ctx.manager)
        yield


@contextlib.contextmanager
def source_context(eqn: Any) -> Iterator[None]:
    """What is bound inside is attributed to the user's line that made
    ``eqn`` (a cast autocast adds for it, a checkpoint around it), under
    the name stack in place."""
    info = getattr(eqn, "source_info", None)
    if info is None:
        yield
        return
    with source_info_util.user_context(info.traceback):
        yield


def name_stack(eqn: Any) -> str:
    """The named scopes an equation was traced in, ``"outer/inner"``."""
    info = getattr(eqn, "source_info", None)
    return "" if info is None else str(info.name_stack)


def source_line(eqn: Any) -> str:
    """Where the user's code made an equation (``"file.py:12 (loss)"``)."""
    info = getattr(eqn, "source_info", None)
    if info is None:
        return ""
    try:
        return str(source_info_util.summarize(info))
    except Exception:  # pragma: no cover - a change of JAX's format
        return ""


def sub_jaxprs(eqn: Any) -> list[Any]:
    """The open jaxprs in an equation's params (a higher-order one's)."""
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple) else (value,):
            if hasattr(sub, "eqns"):
                found.append(sub)
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                found.append(sub.jaxpr)
    return found


def function_name(eqn: Any) -> str | None:
    """The name of the function an equation calls, if it calls one.

    A ``jax.jit`` equation's ``name`` param; for ``custom_jvp_call`` and
    ``custom_vjp_call``, the name of the decorated function, read from the
    debug information of its jaxpr (``"relu at .../functions.py:71"``).
    """
    if not any(k in eqn.params for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")):
        # Not a call: a "name" param is data (checkpoint_name's label).
        return None
    name = eqn.params.get("name")
    if isinstance(name, str):
        return name
    closed = function_jaxpr(eqn)
    info = getattr(getattr(closed, "jaxpr", None), "debug_info", None)
    func_name = getattr(info, "func_name", None)
    if isinstance(func_name, str):
        return func_name
    src = getattr(info, "func_src_info", None)
    if isinstance(src, str) and src:
        return src.split(" ")[0]
    return None


def function_jaxpr(eqn: Any) -> Any:
    """The jaxpr of a ``custom_jvp_call``'s or ``custom_vjp_call``'s
    function (else ``None``)."""
    return eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")


def call_jaxpr(eqn: Any) -> Any:
    """The closed jaxpr a call equation (``jit``, ``closed_call``) runs."""
    for key in ("jaxpr", "call_jaxpr"):
        jaxpr = eqn.params.get(key)
        if jaxpr is not None:
            if not hasattr(jaxpr, "consts"):  # an open jaxpr
                # jax 0.12's stubs do not re-export ClosedJaxpr (it is there).
                return jex_core.ClosedJaxpr(jaxpr, ())  # pyright: ignore[reportPrivateImportUsage]
            return jaxpr
    raise KeyError(f"no jaxpr in the params of {eqn.primitive.name}")


def bind_with_subfuns(
    eqn: Any,
    subfuns: Sequence[Callable[..., Any]],
    invals: Sequence[Any],
    drop: Sequence[str],
) -> list[Any]:
    """Binds a custom-derivative equation with functions of lossscale's.

    ``subfuns`` replace the functions JAX derives from the equation's params
    (for ``custom_jvp_call``: the function and its JVP rule); ``drop`` are
    the params they replace. Each is wrapped as JAX's ``WrappedFun``, with
    the debug information of the jaxpr it stands for.
    """
    closed = eqn.params["call_jaxpr"]
    info = closed.jaxpr.debug_info
    wrapped = [jex_lu.wrap_init(f, debug_info=info) for f in subfuns]
    params = {k: v for k, v in eqn.params.items() if k not in drop}
    probe = eqn.primitive.get_bind_params(eqn.params)
    with equation_context(eqn):
        if isinstance(probe, tuple):  # jax < 0.8: functions come first
            out = eqn.primitive.bind(*wrapped, *invals, **params)
        else:
            out = eqn.primitive.bind(*invals, subfuns=tuple(wrapped), **params)
    return list(out)


def jvp_jaxpr(
    eqn: Any, zeros: Sequence[bool]
) -> tuple[Any, list[Any], list[bool]]:
    """A ``custom_jvp_call``'s JVP rule traced to a jaxpr, as JAX's
    ``lift_jvp`` does: ``(jaxpr, consts, out_zeros)`` for tangents that are
    symbolic zeros where ``zeros`` says so."""
    fun = eqn.params["jvp_jaxpr_fun"]
    jaxpr, consts, out_zeros = fun.call_wrapped(*zeros)
    return jaxpr, list(consts), list(out_zeros)


def is_symbolic_zero(x: Any) -> bool:
    from jax._src.ad_util import SymbolicZero  # no public name

    return type(x) is SymbolicZero


def symbolic_zero_like(x: Any) -> Any:
    from jax._src.ad_util import SymbolicZero

    return SymbolicZero(jax.typeof(x).to_tangent_aval())


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """A ``scan`` equation's numbers of constants and of carries.

    Its operands are the constants, then the carries, then the scanned
    arrays; jax < 0.12 counts them in ``num_consts`` and ``num_carry``,
    jax 0.12 in ``ft_in``, a flat tree of the three groups.
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    # A FlatTree: unpack() gives its three groups, len() their operands.
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def shard_map_axes(params: dict[str, Any]) -> frozenset[Any]:
    """The mesh axes a ``shard_map`` equation makes manual."""
    for key in ("newly_manual_axes", "manual_axes"):  # jax >= 0.9; before
        if key in params:
            return frozenset(params[key])
    return frozenset(params["mesh"].axis_names)  # pragma: no cover


class UnknownParams(Exception):
    """A higher-order equation autocast cannot rebuild faithfully here."""


# The params of the higher-order equations autocast rebuilds, on every
# supported JAX (0.7 to 0.12; tests/test_autocast_primitives.py reads the
# installed JAX's). A param not listed runs the equation at its traced
# dtypes, with a RuntimeWarning naming it.
HIGHER_ORDER_PARAMS: dict[str, frozenset[str]] = {
    "jit": frozenset(
        {
            "jaxpr", "in_shardings", "out_shardings", "in_layouts",
            "out_layouts", "donated_invars", "ctx_mesh", "name",
            "keep_unused", "inline", "compiler_options_kvs",
            "resource_env",
        }
    ),
    "scan": frozenset(
        {
            "jaxpr", "length", "reverse", "unroll", "num_consts",
            "num_carry", "linear", "_split_transpose", "ft_in", "ft_out",
        }
    ),
    "while": frozenset(
        {"cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"}
    ),
    "cond": frozenset({"branches", "branches_platforms"}),
    # jax's CallPrimitive and ClosedCallPrimitive: the jaxpr only.
    "closed_call": frozenset({"call_jaxpr"}),
    "core_call": frozenset({"call_jaxpr"}),
    "remat2": frozenset({"jaxpr", "prevent_cse", "differentiated", "policy"}),
    "custom_jvp_call": frozenset(
        {"call_jaxpr", "jvp_jaxpr_fun", "jvp_jaxpr_thunk", "num_consts",
         "symbolic_zeros"}
    ),
    "shard_map": frozenset(
        {
            "jaxpr", "mesh", "in_specs", "out_specs", "check_vma",
            "check_rep", "manual_axes", "newly_manual_axes", "auto",
            "rewrite",
        }
    ),
}  # fmt: skip
HIGHER_ORDER_PARAMS["pjit"] = HIGHER_ORDER_PARAMS["jit"]
HIGHER_ORDER_PARAMS["checkpoint"] = HIGHER_ORDER_PARAMS["remat2"]


def check_params(eqn: Any) -> None:
    """Raises :class:`UnknownParams` for a param autocast does not know
    (every higher-order primitive autocast handles has its entry in
    :data:`HIGHER_ORDER_PARAMS`: ``lossscale/_autocast/_handlers.py``
    registers none without one)."""
    known = HIGHER_ORDER_PARAMS[eqn.primitive.name]
    unknown = sorted(set(eqn.params) - known)
    if unknown:
        raise UnknownParams(f"{unknown[0]}={eqn.params[unknown[0]]!r}")


def is_jit(eqn: Any) -> bool:
    """A ``jax.jit`` equation (``pjit`` before jax 0.8, ``jit`` since)."""
    return eqn.primitive.name in ("jit", "pjit")


def rebind(eqn: Any, invals: Sequence[Any], **jaxprs: Any) -> list[Any]:
    """Binds ``eqn``'s own primitive with every param kept but ``jaxprs``
    (its jaxprs, re-traced at new dtypes)."""
    missing = [k for k in jaxprs if k not in eqn.params]
    if missing:
        raise UnknownParams(f"no param {missing[0]!r}")
    return bind_equation(eqn, invals, {**eqn.params, **jaxprs})


def explicit_precision(eqn: Any) -> bool:
    """A matmul given ``precision`` above ``DEFAULT`` (``HIGH``,
    ``HIGHEST``, or a float32 algorithm): it asked for float32 products."""
    precision = eqn.params.get("precision")
    if precision is None:
        return False
    items = precision if isinstance(precision, tuple) else (precision,)
    default = jax.lax.Precision.DEFAULT
    return any(p is not None and p != default for p in items)


# scan's params that lax.scan takes as arguments, and those it sets itself
# to these values (a scan JAX itself made may set them otherwise).
_SCAN_ARGUMENTS = ("reverse", "length", "unroll", "_split_transpose")
_SCAN_STRUCTURE = ("jaxpr", "num_consts", "num_carry", "ft_in", "ft_out")


def scan_options(params: dict[str, Any]) -> dict[str, Any]:
    """``lax.scan``'s keyword arguments for a ``scan`` equation's params;
    raises :class:`UnknownParams` for one it cannot pass."""
    options = {}
    for key, value in params.items():
        if key in _SCAN_ARGUMENTS:
            if key != "_split_transpose" or value:
                options[key] = value
        elif key == "linear":
            if any(value):
                raise UnknownParams(f"linear={value}")
        elif key not in _SCAN_STRUCTURE:
            raise UnknownParams(f"{key}={value!r}")
    return options


def shard_map_options(params: dict[str, Any]) -> dict[str, Any]:
    """``jax.shard_map``'s keyword arguments for a ``shard_map`` equation."""
    return {
        "mesh": params["mesh"],
        "in_specs": tuple(params["in_specs"]),
        "out_specs": list(params["out_specs"]),
        "axis_names": shard_map_axes(params),
        "check_vma": params.get("check_vma", params.get("check_rep", True)),
    }


def bind_remat(jaxpr: Any, args: Sequence[Any]) -> list[Any]:
    """``jax.checkpoint`` of an open ``jaxpr`` already traced (no policy,
    with JAX's CSE barrier, ``prevent_cse=True``): binding the same jaxpr
    again lets JAX's caches of its derivative hit."""
    from jax.extend.core import primitives

    remat_p = getattr(primitives, "remat_p", None)
    if remat_p is None:  # jax < 0.8 does not export it
        from jax._src.ad_checkpoint import remat_p
    return list(
        remat_p.bind(
            *args,
            jaxpr=jaxpr,
            prevent_cse=True,
            differentiated=False,
            policy=None,
        )
    )


def retyped(aval: Any, dtype: Any) -> Any:
    """An abstract value with another dtype, strongly typed."""
    return aval.update(dtype=dtype, weak_type=False)


def checkpoint(fun: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``jax.checkpoint(fun, **options)``."""
    # jax 0.7's stubs do not re-export jax.checkpoint (pyright checks
    # against the installed JAX); it is there, and public, on every one.
    return jax.checkpoint(fun, **options)  # pyright: ignore[reportPrivateImportUsage]


# --- float8 matmuls (lossscale/_autocast/_fp8.py) ---------------------------
#
# Self-contained: nothing above uses it. lax.dot_general takes out_sharding
# on every supported JAX (0.7 to 0.12), so no shim is needed for the
# argument itself; what moved is how a sharding's spec is read.


def transpose_out_sharding(x: Any, axes: Sequence[int]) -> Any:
    """The ``out_sharding`` JAX's transpose rules give the ``dot_general``
    that computes ``x``'s cotangent (``_dot_general_transpose_lhs`` in
    ``jax/_src/lax/lax.py``): ``x``'s sharding with its spec in the order
    ``axes`` (``x``'s axes as that ``dot_general`` lays them out).

    Under a mesh with ``Explicit`` axes, a weight-gradient matmul contracts
    the sharded batch axis and raises ``ShardingTypeError`` without it.
    ``None`` where types carry no sharding (no mesh anywhere).
    """
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is None or spec is None:
        return None
    if getattr(sharding.mesh, "empty", False):
        # jax >= 0.10 then takes the mesh in context (0.7 kept the empty
        # one); without one, None is the same as either.
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.axis_names:
            return None
        return jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(*[None] * len(axes))
        )
    entries = tuple(spec) + (None,) * (jnp.ndim(x) - len(tuple(spec)))
    permuted = tuple(entries[a] for a in axes)
    # PartitionSpec.update keeps unreduced/reduced axes on jax >= 0.8.
    return sharding.update(spec=spec.update(partitions=permuted))


def permuted_sharding(out_sharding: Any, axes: Sequence[int]) -> Any:
    """A ``dot_general``'s ``out_sharding`` (a sharding, a
    ``PartitionSpec`` or ``None``) for its output's axes in the order
    ``axes``."""
    if out_sharding is None:
        return None
    spec = getattr(out_sharding, "spec", out_sharding)
    if not isinstance(spec, jax.sharding.PartitionSpec):
        return out_sharding
    entries = tuple(spec) + (None,) * (len(axes) - len(tuple(spec)))
    permuted = spec.update(partitions=tuple(entries[a] for a in axes))
    if spec is out_sharding:
        return permuted
    return out_sharding.update(spec=permuted)


def vary_over(x: Any, axes: frozenset[Any]) -> Any:
    """``x`` made to vary over the mapped ``axes`` of a ``shard_map`` (as
    ``lax.dot_general`` does implicitly to an operand that meets a varying
    one), so that a ``custom_vjp``'s cotangent for it has its type (its
    transpose is the ``psum`` that the gradient of a replicated weight
    needs)."""
    missing = tuple(sorted(axes - vma(x), key=str))
    if not missing:
        return x
    pcast = getattr(jax.lax, "pcast", None)  # jax >= 0.9
    if pcast is not None:
        return pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # pyright: ignore[reportAttributeAccessIssue]


def sharded_for(x: Any, target: Any) -> Any:
    """``x``, which broadcasts against ``target`` (a scalar, or of the same
    rank), resharded so that each axis it does not broadcast is sharded as
    ``target``'s is, and the others not at all.

    Under explicit mesh axes, ``target * x`` is otherwise sharded as their
    shardings combine, which can differ from ``target``'s (a ``dot_general``
    output given an ``out_sharding``, times row-wise scales). Elsewhere
    (auto axes, ``shard_map``, no mesh) specs read ``None`` and ``x`` comes
    back as it is.
    """
    if jnp.ndim(x) != jnp.ndim(target):  # a scalar
        return x
    want = tuple(
        None if n == 1 else entry
        for n, entry in zip(jnp.shape(x), spec(target), strict=True)
    )
    sharding = getattr(jax.typeof(target), "sharding", None)
    if spec(x) == want or sharding is None:
        return x
    return jax.sharding.reshard(
        x, sharding.update(spec=jax.sharding.PartitionSpec(*want))
    )


# --- a float8 matmul as a remat policy sees it (lossscale/_autocast/_fp8.py)
#
# A policy of ``jax.checkpoint`` is asked about each equation of the
# forward pass. Inlined, a float8 matmul is a ``dot_general`` of float8
# operands with a float32 result, then its scaling and its cast to the
# compute dtype: the dots-saveable policies save that float32 result, 4
# bytes an element where a 16-bit matmul's saved result is 2. Bound as one
# equation of its own (the primitive below), it is saved or recomputed as a
# whole, as the policy decides for the ``dot_general`` inside it: what is
# saved is then its compute-dtype result. It lowers to the same operations
# as the inlined form (XLA sees the same program). A nested checkpoint
# would not do it: JAX's rule for one hands the outer policy its inner
# equations (``jax/_src/ad_checkpoint.py``).
#
# Internals used: ``pe.partial_eval_jaxpr_custom_rules`` (the remat rule),
# ``batching.primitive_batchers``, ``mlir.register_lowering`` and
# ``mlir.lower_fun``, ``dispatch.apply_primitive``, ``pe.ensure_enum`` and
# ``pe.Saveable``. If one is missing, :func:`bind_as_dot` evaluates the
# jaxpr inline: the numbers are the same, and a policy saves the float32
# result again.


def _dot_primitive() -> Any:
    """The primitive, or ``None`` where JAX lacks what it needs."""
    try:
        from jax._src import dispatch
        from jax._src.interpreters import batching, mlir
        from jax._src.interpreters import partial_eval as pe

        ensure_enum, saveable_type = pe.ensure_enum, pe.SaveableType
        rules = pe.partial_eval_jaxpr_custom_rules
    except (ImportError, AttributeError):  # pragma: no cover
        return None

    primitive = jex_core.Primitive("lossscale_float8_dot")

    def evaluate(*args: Any, jaxpr: Any, cuda: Any) -> Any:
        del cuda
        return jex_core.jaxpr_as_fun(jaxpr)(*args)[0]

    def abstract_eval(*args: Any, jaxpr: Any, cuda: Any) -> Any:
        del args, cuda
        return jaxpr.out_avals[0]

    def batch(
        args: Sequence[Any], dims: Sequence[Any], *, jaxpr: Any, cuda: Any
    ) -> Any:
        # The vmapped jaxpr bound again: its dot_general is the one that
        # a 16-bit matmul vmapped the same way would be (a batch axis for
        # a batched operand of each side), for the policy to judge. The
        # CUDA form is for the unbatched shapes: the jaxpr lowers there too.
        fun = jax.vmap(
            functools.partial(evaluate, jaxpr=jaxpr, cuda=cuda),
            in_axes=tuple(dims),
        )
        return bind_as_dot(jax.jit(fun).trace(*args).jaxpr, args), 0

    def lower_for_cuda(ctx: Any, *args: Any, jaxpr: Any, cuda: Any) -> Any:
        if cuda is None:
            fun = functools.partial(evaluate, jaxpr=jaxpr, cuda=None)
        else:
            form, spec = cuda
            fun = functools.partial(form, spec=spec)
        return mlir.lower_fun(fun, multiple_results=False)(ctx, *args)

    def remat_rule(
        saveable: Any, unks_in: Sequence[bool], inst_in: Sequence[bool],
        eqn: Any,
    ) -> tuple[Any, Any, list[bool], list[bool], list[Any]]:  # fmt: skip
        # As partial_eval_jaxpr_custom treats a primitive
        # (jax/_src/interpreters/partial_eval.py), with the policy asked
        # about the dot_general inside: known and saved, known and
        # recomputed where the backward pass needs it, or unknown.
        n = len(eqn.outvars)
        res = [
            v
            for v, inst in zip(eqn.invars, inst_in, strict=True)
            if not inst and is_var(v)
        ]
        if any(unks_in):
            return None, eqn, [True] * n, [True] * n, res
        (dot,) = (
            e for e in eqn.params["jaxpr"].jaxpr.eqns
            if e.primitive is lax.dot_general_p
        )  # fmt: skip
        policy = ensure_enum(
            saveable(dot.primitive, *(v.aval for v in dot.invars), **dot.params)
        )
        if isinstance(policy, saveable_type):
            return eqn, None, [False] * n, [False] * n, []
        # Recomputed (an offloading policy's choice too: what it would
        # move to the host is recomputed instead).
        return eqn, eqn, [False] * n, [True] * n, res

    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    mlir.register_lowering(
        primitive, mlir.lower_fun(evaluate, multiple_results=False)
    )
    # Any: jax 0.7's LoweringRule protocol types the context and params
    # more narrowly than a rule written for every supported JAX.
    mlir.register_lowering(
        primitive, cast(Any, lower_for_cuda), platform="cuda"
    )
    batching.primitive_batchers[primitive] = batch
    rules[primitive] = remat_rule
    return primitive


_DOT = _dot_primitive()


def bind_as_dot(jaxpr: Any, args: Sequence[Any], cuda: Any = None) -> Any:
    """The one result of the closed ``jaxpr`` (which holds one
    ``dot_general``) on ``args``, as one equation that a ``jax.checkpoint``
    policy saves or recomputes as a whole, as it decides for that
    ``dot_general``.

    ``cuda``: ``(form, spec)``, where a CUDA lowering lowers
    ``form(*args, spec=spec)`` in place of the jaxpr (the same result, in
    the form XLA's GPU compiler wants; a module-level function and a
    hashable ``spec``), or ``None``. Not a ``lax.platform_dependent``:
    that traces both forms at every matmul (the float8 step's trace and
    lowering 1.26x bfloat16's, scanned, where the limit is 1.2x).
    """
    if _DOT is None:  # pragma: no cover
        return jex_core.jaxpr_as_fun(jaxpr)(*args)[0]
    return _DOT.bind(*args, jaxpr=jaxpr, cuda=cuda)


# --- a primitive lowered by hand -----------------------------------------
#
# A float8 quantisation is a dozen operations (its largest magnitude, its
# scale, the cast). Traced as JAX operations, each of a scanned model's
# quantisations is traced and lowered anew (the body is traced once), and
# a float8 step traced and lowered at 1.21x-1.28x bfloat16's. Bound as one
# primitive whose output types are computed from its operand's and whose
# StableHLO is emitted directly (:class:`Hlo`), it costs one equation to
# trace and a dozen operations to build; XLA receives the same program.
#
# Internals used: ``mlir.register_lowering``, ``mlir.lower_fun`` (for
# symbolic shapes, under ``jax.export``), ``mlir.dtype_to_ir_type``,
# ``mlir.ir_constant``, ``mlir.dense_int_array``, ``mlir.i32_attr``,
# ``mlir.compare_hlo``, ``mlir.lower_with_sharding_in_types``, the ``hlo``
# dialect's operations, ``batching.primitive_batchers``,
# ``ad.primitive_jvps``, ``ad.instantiate_zeros`` and
# ``dispatch.apply_primitive``. If one is missing, :func:`lowered_primitive`
# returns ``None`` and the caller traces the same operations with ``lax``.


class HloValue:
    """An MLIR value of a lowering, with its abstract value (shape, dtype,
    sharding)."""

    __slots__ = ("aval", "value")

    def __init__(self, value: Any, aval: Any):
        self.value, self.aval = value, aval

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.aval.shape)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.aval.dtype)

    @property
    def ndim(self) -> int:
        return len(self.aval.shape)


class Hlo:
    """The ``lax`` operations a quantisation uses, emitted as StableHLO
    into the lowering ``ctx``, as ``lax``'s own lowering rules emit them
    (``jax/_src/lax/lax.py``).

    Each value carries the sharding ``lax`` would give it (an elementwise
    result its operand's, a reduction's its operand's without the reduced
    axes), with which it is annotated under explicit mesh axes; a scalar
    argument of a binary operation is a constant broadcast to the other
    operand's shape, and a size-1 axis is broadcast as ``lax`` broadcasts
    it."""

    def __init__(self, ctx: Any):
        from jax._src.interpreters import mlir
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import stablehlo

        self._ctx, self._mlir, self._ir, self._hlo = ctx, mlir, ir, stablehlo

    def _type(self, shape: Sequence[int], dtype: Any) -> Any:
        element = self._mlir.dtype_to_ir_type(np.dtype(dtype))
        return self._ir.RankedTensorType.get(list(shape), element)

    def _made(self, op: Any, aval: Any) -> HloValue:
        op = self._mlir.lower_with_sharding_in_types(self._ctx, op, aval)
        return HloValue(op, aval)

    def _like(self, x: HloValue, op: Any, dtype: Any = None) -> HloValue:
        """``op``, of ``x``'s shape and sharding (and ``dtype``)."""
        aval = x.aval if dtype is None else retyped(x.aval, np.dtype(dtype))
        return self._made(op, aval)

    def _broadcast(self, x: Any, shape: tuple[int, ...], dtype: Any) -> Any:
        """``x`` (an ``HloValue`` of ``shape`` or with size-1 axes, or a
        scalar) as an MLIR value of ``shape``."""
        if isinstance(x, HloValue):
            if x.shape == shape:
                return x.value
            value, dims = x.value, list(range(x.ndim))
        else:
            value, dims = self._mlir.ir_constant(np.asarray(x, dtype)), []
            if not shape:
                return value
        return self._hlo.broadcast_in_dim(
            self._type(shape, dtype), value, self._mlir.dense_int_array(dims)
        )

    def _binary(self, op: Any, a: Any, b: Any) -> HloValue:
        values = [v for v in (a, b) if isinstance(v, HloValue)]
        # A size-1 axis takes the other operand's size (0 included); the
        # result is sharded as the operand of its shape.
        ranked = [v.shape for v in values if v.ndim] or [()]
        shape = functools.reduce(
            lambda s, t: tuple(
                m if n == 1 else n for n, m in zip(s, t, strict=True)
            ),
            ranked,
        )
        like = next(v for v in values if v.shape == shape)
        out = op(
            self._broadcast(a, shape, like.dtype),
            self._broadcast(b, shape, like.dtype),
        )
        return self._like(like, out)

    def convert(self, x: HloValue, dtype: Any) -> HloValue:
        if x.dtype == np.dtype(dtype):  # lax binds nothing
            return x
        out = self._hlo.convert(self._type(x.shape, dtype), x.value)
        return self._like(x, out, dtype)

    def reduce_precision(
        self, x: HloValue, exponent_bits: int, mantissa_bits: int
    ) -> HloValue:
        out = self._hlo.reduce_precision(
            x.value,
            self._mlir.i32_attr(exponent_bits),
            self._mlir.i32_attr(mantissa_bits),
        )
        return self._like(x, out)

    def abs(self, x: HloValue) -> HloValue:
        return self._like(x, self._hlo.abs(x.value))

    def reduce_max(self, x: HloValue, axes: Sequence[int] | None) -> HloValue:
        """The largest element over ``axes`` (all of them if ``None``, a
        scalar), the reduced axes kept with size 1 otherwise."""
        reduced = list(range(x.ndim)) if axes is None else list(axes)
        kept = [d for d in range(x.ndim) if d not in reduced]
        aval = dropped_axes_aval(x.aval, reduced)
        lowest = self._mlir.ir_constant(np.array(-np.inf, x.dtype))
        op = self._hlo.ReduceOp(
            [self._type(aval.shape, x.dtype)],
            [x.value],
            [lowest],
            self._mlir.dense_int_array(reduced),
        )
        scalar = self._type((), x.dtype)
        block = op.regions[0].blocks.append(scalar, scalar)
        with self._ir.InsertionPoint(block):
            self._hlo.return_([self._hlo.maximum(*block.arguments)])
        out = self._made(op.result, aval)
        if axes is None or not reduced:  # no axis to restore (as lax)
            return out
        keepdims = reduced_aval(x.aval, reduced, x.dtype)
        value = self._hlo.broadcast_in_dim(
            self._type(keepdims.shape, x.dtype),
            out.value,
            self._mlir.dense_int_array(kept),
        )
        return self._made(value, keepdims)

    def max(self, a: Any, b: Any) -> HloValue:
        return self._binary(self._hlo.maximum, a, b)

    def min(self, a: Any, b: Any) -> HloValue:
        return self._binary(self._hlo.minimum, a, b)

    def div(self, a: Any, b: Any) -> HloValue:
        return self._binary(self._hlo.divide, a, b)

    def mul(self, a: Any, b: Any) -> HloValue:
        return self._binary(self._hlo.multiply, a, b)

    def bitwise_and(self, a: Any, b: Any) -> HloValue:
        return self._binary(self._hlo.and_, a, b)

    def bitcast(self, x: HloValue, dtype: Any) -> HloValue:
        out = self._hlo.bitcast_convert(self._type(x.shape, dtype), x.value)
        return self._like(x, out, dtype)

    def ne(self, a: HloValue, b: HloValue) -> HloValue:
        out = self._mlir.compare_hlo(a.value, b.value, "NE", "FLOAT")
        return self._like(a, out, np.bool_)

    def select(
        self, pred: HloValue, on_true: HloValue, on_false: HloValue
    ) -> HloValue:
        out = self._hlo.select(pred.value, on_true.value, on_false.value)
        return self._like(on_true, out)


def lowered_primitive(
    name: str,
    *,
    abstract_eval: Callable[..., Sequence[Any]],
    lower: Callable[..., Sequence[HloValue]],
    traced: Callable[..., Sequence[Any]],
    batch: Callable[..., Any],
) -> Any:
    """A primitive of several results whose output types
    ``abstract_eval(aval, **params)`` computes, and whose lowering
    ``lower(Hlo(ctx), HloValue, ..., **params)`` emits; ``traced`` is the
    same function in ``lax`` operations (lowered in its place for symbolic
    shapes); ``batch`` is its ``vmap`` rule. ``None`` where JAX lacks
    what it needs."""
    try:
        from jax._src import dispatch
        from jax._src.interpreters import ad, batching, mlir
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import stablehlo as hlo

        needed = (
            ir.RankedTensorType,
            mlir.dtype_to_ir_type, mlir.ir_constant, mlir.dense_int_array,
            mlir.i32_attr, mlir.compare_hlo, mlir.lower_with_sharding_in_types,
            hlo.ReduceOp, hlo.bitcast_convert, hlo.reduce_precision, hlo.and_,
        )  # fmt: skip
        del needed
    except (ImportError, AttributeError):  # pragma: no cover
        return None

    primitive = jex_core.Primitive(name)
    primitive.multiple_results = True

    def lowering(ctx: Any, *args: Any, **params: Any) -> Any:
        avals = ctx.avals_in
        if not all(
            isinstance(d, int) for a in avals for d in a.shape
        ):  # symbolic (jax.export): lax's own lowering rules
            fun = functools.partial(traced, **params)
            return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)
        values = [HloValue(x, a) for x, a in zip(args, avals, strict=True)]
        return [v.value for v in lower(Hlo(ctx), *values, **params)]

    def jvp(primals: Sequence[Any], tangents: Sequence[Any], **params: Any):
        # Differentiated as the lax operations are (the float8 kernel never
        # differentiates it: its custom_vjp stands in front).
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        fun = functools.partial(traced, **params)
        return jax.jvp(fun, tuple(primals), tuple(tangents))

    primitive.def_impl(functools.partial(dispatch.apply_primitive, primitive))
    primitive.def_abstract_eval(abstract_eval)
    mlir.register_lowering(primitive, lowering)
    batching.primitive_batchers[primitive] = batch
    ad.primitive_jvps[primitive] = jvp
    return primitive


def _spec(aval: Any) -> tuple[Any, ...]:
    """``aval``'s partition spec, one entry an axis; unreduced (partial
    sum) values are refused, as ``lax``'s elementwise rules refuse them."""
    if getattr(aval.sharding.spec, "unreduced", None):
        raise NotImplementedError(
            f"a float8 quantisation of an unreduced value: {aval}"
        )
    return aval_spec(aval)


def dropped_axes_aval(aval: Any, axes: Sequence[int]) -> Any:
    """The abstract value of a reduction of ``aval`` over ``axes``, the
    axes dropped (as ``lax.reduce_max``'s)."""
    entries = [e for d, e in enumerate(_spec(aval)) if d not in axes]
    shape = tuple(n for d, n in enumerate(aval.shape) if d not in axes)
    sharding = aval.sharding.update(spec=jax.sharding.PartitionSpec(*entries))
    return aval.update(shape=shape, weak_type=False, sharding=sharding)


def reduced_aval(aval: Any, axes: Sequence[int] | None, dtype: Any) -> Any:
    """The abstract value of a reduction of ``aval`` over ``axes`` (all of
    them if ``None``: a scalar), the reduced axes kept with size 1
    otherwise; a reduced axis is not sharded (as ``lax``'s reductions'
    are not)."""
    old = _spec(aval)
    if axes is None:
        shape: tuple[Any, ...] = ()
        entries: list[Any] = []
    else:
        shape = tuple(1 if d in axes else n for d, n in enumerate(aval.shape))
        entries = [None if d in axes else old[d] for d in range(aval.ndim)]
    sharding = aval.sharding.update(spec=jax.sharding.PartitionSpec(*entries))
    return aval.update(
        shape=shape, dtype=np.dtype(dtype), weak_type=False, sharding=sharding
    )
