"""Automatic mixed precision for any JAX function: :func:`autocast`.

``autocast(fun, jnp.float16)`` traces ``fun`` to a jaxpr at the dtypes it
is called with (float32 master weights, float32 data) and evaluates that
jaxpr again (:func:`lossscale._interpret.run`), equation by equation, with
each value carrying a precision class:

- ``LOW``: an activation in the compute dtype;
- ``FULL``: an activation that must stay float32 (the result of an
  exponential, a power, a cumulative sum, or what is computed from one);
- ``WIDE``: a float32 value that is no activation: a parameter, an input,
  a constant, a statistic (a sum, a mean, a variance);
- ``KEEP``: a value autocast never touches (integers, booleans, keys,
  float64, and any float dtype other than float32 and the compute dtype,
  e.g. float8 from an explicit cast);
- ``WEAK``: a weakly typed scalar, which takes its partner's dtype.

The rule of each equation (``_autocast_rules``) decides the dtype it runs in
and the class of its results. Matmuls run in the compute dtype, so an
activation is in the compute dtype from the first matmul on; an
exponential or a sum reads it in float32; arithmetic between an activation
and a statistic or a parameter is computed in float32 and rounded once to
the compute dtype (a norm's output, a bias add); and float32 spreads only
from values that need it. One more rule runs backwards first
(:func:`_widened`): an elementwise equation whose results are read only by
float32 equations runs in float32 itself, so that ``exp(x - max(x))``
subtracts in float32 and ``log(p + 1e-8)`` does not lose its ``1e-8``.

Because the evaluation runs under the caller's trace, ``jax.grad`` of an
autocast function differentiates the casts too: the backward pass of a
float16 matmul is float16 matmuls, and the gradient of a float32
parameter, through the cast that made it float16, is float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale import _autocast_rules as rules_data
from lossscale import _compat, _interop, _interpret, _policy
from lossscale._autocast_rules import Rule

F = TypeVar("F", bound=Callable[..., Any])

LOW, FULL, WIDE, KEEP, WEAK = "low", "full", "wide", "keep", "weak"
_F32 = np.dtype(np.float32)
FLOAT32_SCOPE = "lossscale_float32"


class _Val(NamedTuple):
    x: Any  # an array, a tracer, or a literal's value
    cls: str


@dataclasses.dataclass(frozen=True, eq=False)
class _Ctx:
    compute: np.dtype
    rules: Mapping[str, Rule]


# --- the public function ------------------------------------------------


def autocast(
    fun: F,
    compute_dtype: Any = jnp.float16,
    *,
    output_dtype: Any = None,
    rules: Mapping[str, str] | None = None,
) -> F:
    """Runs ``fun`` in mixed precision: matmuls in 16 bits, the rest safely.

    The returned function has ``fun``'s signature. Called, it traces ``fun``
    at the dtypes of its arguments (float32 parameters and data, say) and
    evaluates the traced operations again with these rules:

    - matmuls and convolutions (``dot_general``, ``conv_general_dilated``)
      run with ``compute_dtype`` operands and results, in the forward pass
      and in the backward pass that ``jax.grad`` derives from it;
    - exponentials and logarithms, powers, ``rsqrt``, sums and products
      (hence means, variances, norms), cumulative sums, ``log_softmax``,
      ``softmax`` and ``logsumexp`` run in float32, as do losses built on
      them;
    - everything else follows its operands: activations stay in
      ``compute_dtype`` between matmuls (so the backward pass stores half
      as much), an operation that meets float32 statistics or parameters
      (a norm's output, a bias) is computed in float32 and rounded once,
      and float32 spreads only from the values that need it.

    Weakly typed constants take their partner's dtype; integers, booleans
    and PRNG keys are never touched, and neither are float64 values or an
    explicit cast the traced program shows (to float8, say). Parameters
    stay float32 outside: ``jax.grad`` of an autocast loss returns float32
    gradients with the parameters' structure. Outputs have the dtypes
    ``fun`` returns without autocast, unless ``output_dtype`` is given.

    The traced program's own jaxprs are evaluated with the same rules:
    ``jax.jit``-ed functions, ``lax.scan``, ``lax.while_loop``,
    ``lax.cond``, ``jax.checkpoint`` (its policy kept), ``shard_map`` (its
    specs kept) and the functions
    of ``jax.custom_jvp`` and ``jax.custom_vjp`` (whose derivative rules
    are kept: a ``custom_jvp`` rule is evaluated with the same rules; a
    ``custom_vjp`` function runs whole at the dtypes it was traced with).
    A loop's carry takes one dtype for every iteration, and a conditional's
    branches one dtype per output.

    Called eagerly it traces ``fun`` on every call; inside ``jax.jit`` it
    traces once, with the step.

    Args:
        fun: the function to run, e.g. a loss ``loss_fn(params, batch)``.
        compute_dtype: ``jnp.float16`` (the default) or ``jnp.bfloat16``,
            or their names; or a :class:`lossscale.Policy` (or its string,
            ``"p=f32,c=bf16,o=f32"``, jmp's grammar): compute in its
            ``compute_dtype``, with every floating output cast to its
            ``output_dtype``.
        output_dtype: ``None`` (each output keeps the dtype ``fun`` gives
            it without autocast), or a float dtype to cast every floating
            output to.
        rules: overrides of the default rules, from a primitive's name
            (``"tanh"``, ``"dot_general"``, as ``jax.make_jaxpr`` prints
            them) or a function's (a ``jax.jit``-ed function's name, a
            ``custom_jvp``/``custom_vjp`` function's) to ``"compute"``,
            ``"float32"``, ``"promote"`` or ``"original"`` (run at the
            traced dtypes). :data:`lossscale.AUTOCAST_RULES` lists the
            defaults; :func:`float32_scope` keeps a region in float32.

    Returns:
        A function with ``fun``'s signature.

    Raises:
        TypeError: if ``fun`` is not callable, ``compute_dtype`` is not a
            16-bit float type, or ``rules`` is malformed.
        ValueError: if a rule is unknown.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> import lossscale
        >>> def loss_fn(w, x):
        ...     return jnp.mean(jnp.exp(x @ w))
        >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
        >>> f16_loss = lossscale.autocast(loss_fn, jnp.float16)
        >>> f16_loss(w, x).dtype  # as without autocast
        dtype('float32')
        >>> jax.grad(f16_loss)(w, x).dtype  # the master weights' dtype
        dtype('float32')
        >>> jaxpr = jax.make_jaxpr(jax.grad(f16_loss))(w, x).jaxpr
        >>> def dtypes(name):  # of each equation's first operand
        ...     return {str(e.invars[0].aval.dtype)
        ...             for e in jaxpr.eqns if e.primitive.name == name}
        >>> dtypes("dot_general"), dtypes("exp")  # forward and backward
        ({'float16'}, {'float32'})

    References:
        Micikevicius et al., `Mixed Precision Training
        <https://arxiv.org/abs/1710.03740>`_, 2017; PyTorch's
        `autocast op reference
        <https://docs.pytorch.org/docs/stable/amp.html#autocast-op-reference>`_.
    """
    if not callable(fun):
        raise TypeError(
            f"fun must be callable, got fun={fun!r} of type "
            f"{type(fun).__name__}."
        )
    if isinstance(compute_dtype, str) and _is_policy_string(compute_dtype):
        compute_dtype = _policy.get_policy(compute_dtype)
    if isinstance(compute_dtype, _policy.Policy):
        if output_dtype is not None:
            raise TypeError(
                "output_dtype must be None when compute_dtype is a Policy "
                "(its output dtype is used), got "
                f"output_dtype={output_dtype!r}."
            )
        output_dtype = compute_dtype.output_dtype
        compute_dtype = compute_dtype.compute_dtype
    ctx = _Ctx(compute=check_compute_dtype(compute_dtype), rules=_rules(rules))
    out_dtype = None if output_dtype is None else _float_dtype(output_dtype)

    @functools.wraps(fun)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        return _call(ctx, out_dtype, fun, args, kwargs)

    return wrapped  # type: ignore[return-value]


def _is_policy_string(spec: str) -> bool:
    """A jmp policy string (``"p=f32,c=f16"``, ``"mixed_float16"``), not a
    dtype's name; jmp's ``"half"`` counts as a policy too, so that it means
    what it means in jmp (bfloat16 on TPU, float16 elsewhere)."""
    spec = spec.strip()
    return "=" in spec or spec.startswith("mixed_") or spec == "half"


def check_compute_dtype(dtype: Any, name: str = "compute_dtype") -> np.dtype:
    """A 16-bit float dtype (float16 or bfloat16), from a dtype or name."""
    try:
        result = np.dtype(dtype)
    except TypeError:
        result = None
    if result is None or not (
        jnp.issubdtype(result, jnp.floating) and result.itemsize == 2
    ):
        raise TypeError(
            f"{name} must be a 16-bit float type (jnp.float16 or "
            f"jnp.bfloat16, or their names), got {name}={dtype!r}."
        )
    return result


def _float_dtype(dtype: Any) -> np.dtype:
    try:
        result = np.dtype(dtype)
    except TypeError:
        result = None
    if result is None or not jnp.issubdtype(result, jnp.floating):
        raise TypeError(
            "output_dtype must be None or a float dtype, got "
            f"output_dtype={dtype!r}."
        )
    return result


def _rules(overrides: Mapping[str, str] | None) -> Mapping[str, Rule]:
    if overrides is None:
        return rules_data.DEFAULT_RULES
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "rules must be a mapping from a primitive's or function's name "
            f"to a rule, got rules={overrides!r}."
        )
    table: dict[str, Rule] = dict(rules_data.DEFAULT_RULES)
    for name, rule in overrides.items():
        if not isinstance(name, str):
            raise TypeError(
                f"rules keys must be names (str), got {name!r} in rules."
            )
        if rule not in rules_data.RULES_ACCEPTED:
            raise ValueError(
                f"rules[{name!r}] must be one of {rules_data.RULES_ACCEPTED}, "
                f"got {rule!r}."
            )
        table[name] = rule  # type: ignore[assignment]
    return table


@contextlib.contextmanager
def float32_scope() -> Iterator[None]:
    """Keeps what is traced inside it at the dtypes it is traced with.

    A context manager and a decorator: operations traced in it (a mixture
    of experts' router, a loss of your own) run under :func:`autocast` as
    they would without it, as PyTorch's ``autocast(enabled=False)`` does.
    It is a ``jax.named_scope``, so it costs nothing outside autocast and
    shows in profiles.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> @lossscale.float32_scope()
        ... def router(x, w):
        ...     return x @ w
        >>> f = lossscale.autocast(lambda x, w: router(x, w) + x @ w)
        >>> f(jnp.ones((2, 2)), jnp.ones((2, 2))).dtype
        dtype('float32')
    """
    with jax.named_scope(FLOAT32_SCOPE):
        yield


# --- tracing and evaluating ---------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic) or (
        _compat.is_tracer(x)
    )


def _call(
    ctx: _Ctx,
    out_dtype: np.dtype | None,
    fun: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    leaves, treedef = jax.tree.flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]
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
    closed, (out_shape, _) = jax.make_jaxpr(flat, return_shape=True)(*arrays)
    inputs = [_Val(x, _input_class(ctx, x)) for x in arrays]
    consts = [_Val(c, _input_class(ctx, c)) for c in closed.consts]
    # Outputs read in float32 (their traced dtype, or output_dtype) let
    # the last elementwise operations before them run in float32 too.
    wide_out = out_dtype is None or out_dtype.itemsize >= 4
    outs = _evaluate(
        ctx,
        closed.jaxpr,
        consts,
        inputs,
        out_widened=[wide_out] * len(closed.jaxpr.outvars),
    )
    n_out = len(jax.tree.leaves(out_shape))
    results = []
    for val, aval in zip(outs[:n_out], closed.jaxpr.outvars, strict=False):
        dtype = _aval(aval).dtype
        if out_dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            dtype = out_dtype
        x = val.x
        if not isinstance(x, jax.Array):
            # A constant output is a literal of the jaxpr (jax's own int
            # and float subclasses): an array, as jax.jit returns it.
            x = jnp.asarray(x)
        results.append(_cast(x, dtype))
    for j, val in zip(record["changed"], outs[n_out:], strict=True):
        _interop.set_variable(
            holders[dynamic[j]], _cast(val.x, _dtype(arrays[j]))
        )
    return jax.tree.unflatten(jax.tree.structure(out_shape), results)


def _aval(atom: Any) -> Any:
    return atom.aval


def _dtype(x: Any) -> Any:
    """``x``'s dtype: a numpy dtype, or an extended one (PRNG keys)."""
    dtype = getattr(x, "dtype", None)
    return np.asarray(x).dtype if dtype is None else dtype


def _is_float(dtype: Any) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.floating))


def _input_class(ctx: _Ctx, x: Any) -> str:
    dtype = _dtype(x)
    if isinstance(x, np.ndarray | np.generic):
        # JAX reads a NumPy array in its own dtype for it: a float64 batch
        # (what data loaders give) is float32 unless x64 is enabled.
        dtype = cast(Any, jax.typeof(x)).dtype
    if not _is_float(dtype) or np.dtype(dtype).itemsize > 4:
        return KEEP
    if getattr(jax.typeof(x), "weak_type", False):
        return WEAK
    if dtype == _F32:
        return WIDE
    if dtype == ctx.compute:
        return LOW
    return KEEP


def _cast(x: Any, dtype: Any) -> Any:
    # Compared before np.dtype, which refuses extended dtypes: a PRNG key
    # the function returns (or an NNX RngKey written back) is cast to its
    # own dtype, which is no cast at all.
    if _dtype(x) == dtype:
        return x
    dtype = np.dtype(dtype)
    if _dtype(x) == dtype:
        return x
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


def _class_dtype(ctx: _Ctx, cls: str) -> np.dtype | None:
    """The dtype a class is stored in (``None``: the value's own)."""
    if cls == LOW:
        return ctx.compute
    if cls in (FULL, WIDE):
        return _F32
    return None


def _store(ctx: _Ctx, x: Any, cls: str) -> _Val:
    dtype = _class_dtype(ctx, cls)
    if dtype is not None and _is_float(_dtype(x)):
        x = _cast(x, dtype)
    return _Val(x, cls)


def _literal(atom: Any) -> _Val:
    value = _compat.literal_value(atom)
    if not _is_float(_aval(atom).dtype):
        return _Val(value, KEEP)
    return _Val(value, WEAK if np.ndim(value) == 0 else WIDE)


def _evaluate(
    ctx: _Ctx,
    jaxpr: Any,
    consts: Sequence[_Val],
    args: Sequence[_Val],
    *,
    out_widened: Sequence[bool],
) -> list[_Val]:
    widened = _widened(ctx, jaxpr, out_widened)

    def apply(eqn: Any, invals: list[_Val]) -> list[_Val]:
        return _equation(ctx, eqn, invals, widened)

    with _cast_cache():
        return _interpret.run(
            jaxpr, consts, args, apply=apply, literal=_literal
        )


# --- the backward rule: float32 reaches back through what only feeds it ---


def _rule_of(ctx: _Ctx, eqn: Any) -> Rule | None:
    """The eqn's rule from the table (``None``: a recursion or no rule)."""
    name = _compat.function_name(eqn)
    if name is not None and name in ctx.rules:
        return ctx.rules[name]
    return ctx.rules.get(eqn.primitive.name)


_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})


def _widened(
    ctx: _Ctx, jaxpr: Any, out_widened: Sequence[bool]
) -> frozenset[Any]:
    """The equations of ``jaxpr`` that run in float32 whatever their inputs.

    The float32 equations, and, backwards, every ``promote`` equation (or
    inlined call) whose floating results are read only by such equations
    (or are outputs of ``jaxpr`` that the caller reads in float32): making
    it float32 costs nothing downstream, and keeps its own rounding out of
    the float32 computation (``exp(x - max)``, ``log(p + eps)``, a loss's
    elementwise part before its mean).
    """
    readers: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
        for atom in eqn.invars:
            if _compat.is_var(atom):
                readers.setdefault(atom, []).append(eqn)
    outputs = {
        atom: widen
        for atom, widen in zip(jaxpr.outvars, out_widened, strict=True)
        if _compat.is_var(atom)
    }
    result: set[Any] = set()
    for eqn in reversed(jaxpr.eqns):
        rule = _rule_of(ctx, eqn)
        if rule == "float32" and not _in_float32_scope(eqn):
            result.add(eqn)
            continue
        if rule != "promote" and eqn.primitive.name not in _INLINED:
            continue
        floats = [v for v in eqn.outvars if _is_float(_aval(v).dtype)]
        if floats and all(
            _read_in_float32(v, readers, outputs, result) for v in floats
        ):
            result.add(eqn)
    return frozenset(result)


def _read_in_float32(
    var: Any,
    readers: Mapping[Any, list[Any]],
    outputs: Mapping[Any, bool],
    widened: set[Any],
) -> bool:
    users = readers.get(var, [])
    if var in outputs and not outputs[var]:
        return False
    if not users and var not in outputs:
        return False
    return all(eqn in widened for eqn in users)


def _in_float32_scope(eqn: Any) -> bool:
    return FLOAT32_SCOPE in _compat.name_stack(eqn).split("/")


# --- one equation ---------------------------------------------------------


def _equation(
    ctx: _Ctx, eqn: Any, invals: list[_Val], widened: frozenset[Any]
) -> list[_Val]:
    if _in_float32_scope(eqn):
        return _original(ctx, eqn, invals)
    name = eqn.primitive.name
    rule = ctx.rules.get(name)
    function = _compat.function_name(eqn)
    if function is not None and function in ctx.rules:
        # A function-level rule decides for the whole call.
        rule = ctx.rules[function]
        if rule == "float32" or rule == "original":
            return _original(ctx, eqn, invals)
        if name in _RECURSIONS:
            # "compute" and "promote" are primitives' rules: a call cannot
            # be bound at other dtypes than its jaxpr's, so a function that
            # shares a primitive's name (jnp.round is a jit named "round")
            # is evaluated with the rules, as any call is.
            return _RECURSIONS[name](ctx, eqn, invals, eqn in widened)
        if _compat.function_jaxpr(eqn) is not None:
            return _original(ctx, eqn, invals)  # custom_vjp: run whole
    elif name in _RECURSIONS:
        try:
            return _RECURSIONS[name](ctx, eqn, invals, eqn in widened)
        except (AttributeError, KeyError) as err:
            # The params of a higher-order primitive are JAX internals: on a
            # JAX that moved them, the equation runs as traced (correct, in
            # float32), and says so.
            warnings.warn(
                f"lossscale.autocast: cannot evaluate {name} on this JAX "
                f"({jax.__version__}; {type(err).__name__}: {err}); it runs "
                "at its traced dtypes. Please report this.",
                RuntimeWarning,
                stacklevel=2,
            )
            return _original(ctx, eqn, invals)
    if name == "convert_element_type":
        return _convert(ctx, eqn, invals)
    if any(v.cls == KEEP and _is_float(_dtype(v.x)) for v in invals):
        return _original(ctx, eqn, invals)
    if rule == "compute":
        return _compute(ctx, eqn, invals)
    if rule == "float32":
        return _float32(ctx, eqn, invals)
    if rule == "promote":
        return _promote(ctx, eqn, invals, eqn in widened)
    return _original(ctx, eqn, invals)


def _floats(invals: Sequence[_Val]) -> list[_Val]:
    return [v for v in invals if v.cls in (LOW, FULL, WIDE)]


def _bind(
    ctx: _Ctx,
    eqn: Any,
    invals: Sequence[_Val],
    dtype: np.dtype | None,
    out_cls: str,
) -> list[_Val]:
    """Binds ``eqn`` with its float operands cast to ``dtype`` (``None``:
    to the dtypes it was traced with); float results become ``out_cls``."""
    xs = []
    for val, atom in zip(invals, eqn.invars, strict=True):
        if val.cls == KEEP or not _is_float(_aval(atom).dtype):
            xs.append(val.x)
        else:
            xs.append(
                _cast(val.x, _aval(atom).dtype if dtype is None else dtype)
            )
    params = _params(eqn, dtype)
    outs = _compat.bind_equation(eqn, xs, params)
    return [
        _store(ctx, out, out_cls) if _is_float(_dtype(out)) else _Val(out, KEEP)
        for out in outs
    ]


def _params(eqn: Any, dtype: np.dtype | None) -> dict[str, Any] | None:
    """The equation's params, with its float result dtype set to ``dtype``."""
    if dtype is None:
        return None
    changed = None
    for key in ("preferred_element_type", "out_dtype"):
        value = eqn.params.get(key)
        if value is not None and _is_float(value):
            changed = dict(eqn.params) if changed is None else changed
            changed[key] = dtype
    return changed


def _original(ctx: _Ctx, eqn: Any, invals: Sequence[_Val]) -> list[_Val]:
    """The equation at the dtypes it was traced with."""
    activation = any(v.cls in (LOW, FULL) for v in invals)
    outs = _compat.bind_equation(
        eqn,
        [
            v.x
            if v.cls == KEEP or not _is_float(_aval(a).dtype)
            else _cast(v.x, _aval(a).dtype)
            for v, a in zip(invals, eqn.invars, strict=True)
        ],
    )
    result = []
    for out in outs:
        dtype = _dtype(out)
        if dtype == _F32:
            result.append(_Val(out, FULL if activation else WIDE))
        else:
            result.append(_Val(out, KEEP))
    return result


def _compute(ctx: _Ctx, eqn: Any, invals: Sequence[_Val]) -> list[_Val]:
    floats = _floats(invals)
    matmul = eqn.primitive.name in rules_data.MATMULS
    if matmul or any(v.cls in (LOW, FULL) for v in floats):
        return _bind(ctx, eqn, invals, ctx.compute, LOW)
    return _bind(ctx, eqn, invals, _F32, WIDE)


def _float32(ctx: _Ctx, eqn: Any, invals: Sequence[_Val]) -> list[_Val]:
    floats = _floats(invals)
    activation = any(v.cls in (LOW, FULL) for v in floats)
    statistic = eqn.primitive.name in rules_data.STATISTICS
    out_cls = FULL if activation and not statistic else WIDE
    if eqn.primitive.name in rules_data.REMATERIALIZED and any(
        v.cls == LOW for v in floats
    ):
        # The backward pass of x ** 3 (or exp x) would keep a float32
        # copy of 3 x ** 2 (or exp x): it keeps the compute-dtype x
        # instead, and recomputes the rest, which is elementwise and cheap.
        positions = [i for i, v in enumerate(invals) if v.cls != KEEP]

        def island(*xs: Any) -> list[Any]:
            vals = list(invals)
            for i, x in zip(positions, xs, strict=True):
                vals[i] = _Val(x, invals[i].cls)
            return [v.x for v in _bind(ctx, eqn, vals, _F32, out_cls)]

        outs = _compat.checkpoint(island, prevent_cse=False)(
            *[invals[i].x for i in positions]
        )
        return [_Val(x, out_cls) for x in outs]
    return _bind(ctx, eqn, invals, _F32, out_cls)


def _promote(
    ctx: _Ctx, eqn: Any, invals: Sequence[_Val], widened: bool
) -> list[_Val]:
    classes = {v.cls for v in _floats(invals)}
    if not classes:  # only weak scalars (or no floats): as traced
        return _bind(ctx, eqn, invals, None, WIDE)
    if FULL in classes or (widened and LOW in classes):
        return _bind(ctx, eqn, invals, _F32, FULL)
    if LOW in classes and not widened:
        # An activation meeting float32 values (a statistic, a parameter)
        # is computed in float32 and rounded once.
        dtype = _F32 if WIDE in classes else ctx.compute
        return _bind(ctx, eqn, invals, dtype, LOW)
    return _bind(ctx, eqn, invals, _F32, WIDE)


def _convert(ctx: _Ctx, eqn: Any, invals: Sequence[_Val]) -> list[_Val]:
    """An explicit cast the traced program shows: kept."""
    (val,) = invals
    new = np.dtype(eqn.params["new_dtype"])
    out = _compat.bind_equation(eqn, [val.x])[0]
    if not _is_float(new):
        return [_Val(out, KEEP)]
    if new == ctx.compute:
        return [_Val(out, LOW)]
    if new == _F32:
        activation = val.cls in (LOW, FULL)
        weak = eqn.params.get("weak_type", False)
        return [_Val(out, WEAK if weak else FULL if activation else WIDE)]
    return [_Val(out, KEEP)]


# --- higher-order primitives ----------------------------------------------


def _call_primitive(
    ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool
) -> list[_Val]:
    """``jit`` and other calls: their jaxpr is evaluated inline.

    The shardings a ``jax.jit`` was given (``in_shardings``,
    ``out_shardings``) under automatic mesh axes are kept as sharding
    constraints, which is what they are once the call is inlined.
    """
    closed = _compat.call_jaxpr(eqn)
    in_shardings, out_shardings = _compat.auto_call_shardings(eqn)
    invals = [
        v if s is None else _Val(lax.with_sharding_constraint(v.x, s), v.cls)
        for v, s in zip(invals, in_shardings, strict=True)
    ]
    outs = _evaluate(
        ctx,
        closed.jaxpr,
        [_Val(c, _input_class(ctx, c)) for c in closed.consts],
        invals,
        out_widened=[widened] * len(closed.jaxpr.outvars),
    )
    return [
        v if s is None else _Val(lax.with_sharding_constraint(v.x, s), v.cls)
        for v, s in zip(outs, out_shardings, strict=True)
    ]


# Loop carries and branch outputs take one class: the join of what enters
# and what the body returns (float32 wins over the compute dtype, which
# wins over a float32 value that is no activation).
_ORDER = {WEAK: 0, WIDE: 1, LOW: 2, FULL: 3}


def _join(a: str, b: str) -> str:
    if KEEP in (a, b):
        return KEEP
    return a if _ORDER[a] >= _ORDER[b] else b


def _carry_class(val: _Val) -> str:
    return WIDE if val.cls == WEAK else val.cls


def _as_class(ctx: _Ctx, val: _Val, cls: str, traced: Any) -> Any:
    """``val``'s array in the dtype of ``cls`` (a strong type), or, for
    ``KEEP``, in the dtype it was traced with."""
    dtype = _class_dtype(ctx, cls)
    if dtype is None:
        dtype = traced
    if not _is_float(dtype):
        return val.x
    x = val.x
    if not hasattr(x, "dtype") or isinstance(x, np.ndarray | np.generic):
        return np.asarray(x).astype(dtype)
    # convert_element_type also makes a weakly typed value strong.
    return lax.convert_element_type(x, dtype)


def _fixed_point(
    classes: list[str], probe: Callable[[list[str]], list[str]]
) -> list[str]:
    """Carry classes that the body returns as it is given them."""
    for _ in range(len(_ORDER) + 1):
        returned = probe(classes)
        joined = [_join(a, b) for a, b in zip(classes, returned, strict=True)]
        if joined == classes:
            return classes
        classes = joined
    return classes  # pragma: no cover - the join is monotone


def _scan(ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool) -> list[_Val]:
    p = eqn.params
    closed = p["jaxpr"]
    n_consts, n_carry = _compat.scan_counts(p)
    consts = invals[:n_consts]
    init = invals[n_consts : n_consts + n_carry]
    xs = invals[n_consts + n_carry :]
    traced = [_aval(v).dtype for v in closed.jaxpr.outvars]
    jaxpr_consts = [_Val(c, _input_class(ctx, c)) for c in closed.consts]
    n_out = len(closed.jaxpr.outvars)

    def body_fn(classes: list[str], record: dict[str, Any]) -> Callable:
        def body(carry: Any, x: Any) -> Any:
            outs = _evaluate(
                ctx,
                closed.jaxpr,
                jaxpr_consts,
                [
                    *consts,
                    *(_Val(c, k) for c, k in zip(carry, classes, strict=True)),
                    *(_Val(xi, v.cls) for xi, v in zip(x, xs, strict=True)),
                ],
                out_widened=[False] * n_carry + [widened] * (n_out - n_carry),
            )
            record["carry"] = [_carry_class(v) for v in outs[:n_carry]]
            record["ys"] = [v.cls for v in outs[n_carry:]]
            new_carry = [
                _as_class(ctx, v, k, t)
                for v, k, t in zip(
                    outs[:n_carry], classes, traced[:n_carry], strict=True
                )
            ]
            return new_carry, [v.x for v in outs[n_carry:]]

        return body

    def carry_in(classes: list[str]) -> list[Any]:
        return [
            _as_class(ctx, v, k, _aval(a).dtype)
            for v, k, a in zip(
                init,
                classes,
                eqn.invars[n_consts : n_consts + n_carry],
                strict=True,
            )
        ]

    def probe(classes: list[str]) -> list[str]:
        record: dict[str, Any] = {}
        if p["length"] == 0:
            # An empty scan has no slice to take: its body is traced on
            # the shape of one.
            jax.eval_shape(
                body_fn(classes, record),
                carry_in(classes),
                [
                    jax.ShapeDtypeStruct(jnp.shape(v.x)[1:], _dtype(v.x))
                    for v in xs
                ],
            )
            return record["carry"]
        jax.eval_shape(
            # One iteration's slices, taken inside the trace of the probe.
            lambda c, x: body_fn(classes, record)(c, [xi[0] for xi in x]),
            carry_in(classes),
            [v.x for v in xs],
        )
        return record["carry"]

    classes = _fixed_point([_carry_class(v) for v in init], probe)
    record: dict[str, Any] = {}
    carry, ys = lax.scan(
        body_fn(classes, record),
        carry_in(classes),
        [v.x for v in xs],
        length=p["length"],
        reverse=p["reverse"],
        unroll=p["unroll"],
    )
    return [
        *(_Val(c, k) for c, k in zip(carry, classes, strict=True)),
        *(_Val(y, k) for y, k in zip(ys, record["ys"], strict=True)),
    ]


def _while(
    ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool
) -> list[_Val]:
    p = eqn.params
    cond_closed, body_closed = p["cond_jaxpr"], p["body_jaxpr"]
    n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
    cond_consts = invals[:n_cond]
    body_consts = invals[n_cond : n_cond + n_body]
    init = invals[n_cond + n_body :]
    traced = [_aval(v).dtype for v in body_closed.jaxpr.outvars]

    def consts_of(closed: Any) -> list[_Val]:
        return [_Val(c, _input_class(ctx, c)) for c in closed.consts]

    def cond_fn(classes: list[str]) -> Callable:
        def cond(carry: Any) -> Any:
            (out,) = _evaluate(
                ctx,
                cond_closed.jaxpr,
                consts_of(cond_closed),
                [
                    *cond_consts,
                    *(_Val(c, k) for c, k in zip(carry, classes, strict=True)),
                ],
                out_widened=[False],
            )
            return out.x

        return cond

    def body_fn(classes: list[str], record: dict[str, Any]) -> Callable:
        def body(carry: Any) -> Any:
            outs = _evaluate(
                ctx,
                body_closed.jaxpr,
                consts_of(body_closed),
                [
                    *body_consts,
                    *(_Val(c, k) for c, k in zip(carry, classes, strict=True)),
                ],
                out_widened=[False] * len(init),
            )
            record["carry"] = [_carry_class(v) for v in outs]
            return [
                _as_class(ctx, v, k, t)
                for v, k, t in zip(outs, classes, traced, strict=True)
            ]

        return body

    def carry_in(classes: list[str]) -> list[Any]:
        return [
            _as_class(ctx, v, k, t)
            for v, k, t in zip(init, classes, traced, strict=True)
        ]

    def probe(classes: list[str]) -> list[str]:
        record: dict[str, Any] = {}
        jax.eval_shape(body_fn(classes, record), carry_in(classes))
        return record["carry"]

    classes = _fixed_point([_carry_class(v) for v in init], probe)
    outs = lax.while_loop(
        cond_fn(classes), body_fn(classes, {}), carry_in(classes)
    )
    return [_Val(x, k) for x, k in zip(outs, classes, strict=True)]


def _cond(ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool) -> list[_Val]:
    branches = eqn.params["branches"]
    index, operands = invals[0], invals[1:]
    n_out = len(branches[0].jaxpr.outvars)
    traced = [_aval(v).dtype for v in branches[0].jaxpr.outvars]

    def branch_fn(
        closed: Any, classes: list[str] | None, record: dict
    ) -> Callable:
        def branch(*xs: Any) -> Any:
            outs = _evaluate(
                ctx,
                closed.jaxpr,
                [_Val(c, _input_class(ctx, c)) for c in closed.consts],
                [_Val(x, v.cls) for x, v in zip(xs, operands, strict=True)],
                out_widened=[widened] * n_out,
            )
            record["out"] = [_carry_class(v) for v in outs]
            kinds = record["out"] if classes is None else classes
            return [
                _as_class(ctx, v, k, t)
                for v, k, t in zip(outs, kinds, traced, strict=True)
            ]

        return branch

    classes = None
    for closed in branches:
        record: dict[str, Any] = {}
        jax.eval_shape(
            branch_fn(closed, None, record), *[v.x for v in operands]
        )
        classes = (
            record["out"]
            if classes is None
            else [
                _join(a, b) for a, b in zip(classes, record["out"], strict=True)
            ]
        )
    assert classes is not None
    outs = lax.switch(
        index.x,
        [branch_fn(closed, classes, {}) for closed in branches],
        *[v.x for v in operands],
    )
    return [_Val(x, k) for x, k in zip(outs, classes, strict=True)]


def _open_body(
    ctx: _Ctx,
    jaxpr: Any,
    invals: Sequence[_Val],
    widened: bool,
    record: dict[str, Any],
) -> Callable[..., list[Any]]:
    """An open jaxpr (``checkpoint``'s, ``shard_map``'s) as a function of
    arrays, evaluated with the rules; its outputs' classes go to
    ``record["out"]`` when it is traced."""

    def body(*xs: Any) -> list[Any]:
        outs = _evaluate(
            ctx,
            jaxpr,
            [],
            [_Val(x, v.cls) for x, v in zip(xs, invals, strict=True)],
            out_widened=[widened] * len(jaxpr.outvars),
        )
        record["out"] = [v.cls for v in outs]
        return [v.x for v in outs]

    return body


def _checkpoint(
    ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool
) -> list[_Val]:
    p = eqn.params
    record: dict[str, Any] = {}
    fn = _open_body(ctx, p["jaxpr"], invals, widened, record)
    outs = _compat.checkpoint(
        fn, prevent_cse=p["prevent_cse"], policy=p["policy"]
    )(*[v.x for v in invals])
    return [_Val(x, k) for x, k in zip(outs, record["out"], strict=True)]


def _custom_jvp(
    ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool
) -> list[_Val]:
    """The function and its JVP rule, both evaluated with the rules.

    The rule's jaxpr was traced at the original dtypes; it is evaluated at
    the function's new ones, and its outputs are cast to the dtypes the
    function returns, so that the primal and tangent types agree whether or
    not the call is differentiated.
    """
    closed = eqn.params["call_jaxpr"]
    n_consts = eqn.params["num_consts"]
    consts = [_Val(c, _input_class(ctx, c)) for c in closed.consts]
    n_out = len(closed.jaxpr.outvars)
    traced = [_aval(v).dtype for v in closed.jaxpr.outvars]
    in_classes = [v.cls for v in invals]

    def primal(*xs: Any) -> list[_Val]:
        return _evaluate(
            ctx,
            closed.jaxpr,
            consts,
            [_Val(x, k) for x, k in zip(xs, in_classes, strict=True)],
            out_widened=[widened] * n_out,
        )

    record: dict[str, Any] = {}

    def shapes(*xs: Any) -> list[Any]:
        outs = primal(*xs)
        record["out"] = [v.cls for v in outs]
        return [v.x for v in outs]

    jax.eval_shape(shapes, *[v.x for v in invals])
    out_classes: list[str] = record["out"]

    def fun(*xs: Any) -> list[Any]:
        return [
            _as_class(ctx, v, k, t)
            for v, k, t in zip(primal(*xs), out_classes, traced, strict=True)
        ]

    def jvp(*xs: Any) -> list[Any]:
        n = len(xs) // 2
        primals, tangents = xs[n_consts:n], xs[n + n_consts :]
        zeros = [_compat.is_symbolic_zero(t) for t in tangents]
        jaxpr, jvp_consts, out_zeros = _compat.jvp_jaxpr(eqn, zeros)
        classes = in_classes[n_consts:]
        nonzero = [
            _Val(t, k)
            for t, k, z in zip(tangents, classes, zeros, strict=True)
            if not z
        ]
        outs = _evaluate(
            ctx,
            jaxpr,
            [_Val(c, _input_class(ctx, c)) for c in jvp_consts],
            [
                *(_Val(x, k) for x, k in zip(primals, classes, strict=True)),
                *nonzero,
            ],
            out_widened=[widened] * len(jaxpr.outvars),
        )
        out_primals = [
            _as_class(ctx, v, k, t)
            for v, k, t in zip(outs[:n_out], out_classes, traced, strict=True)
        ]
        it = iter(outs[n_out:])
        out_tangents = []
        for p, z in zip(out_primals, out_zeros, strict=True):
            if z:
                out_tangents.append(_compat.symbolic_zero_like(p))
            else:
                t = next(it).x
                out_tangents.append(
                    _cast(t, _dtype(p)) if _is_float(_dtype(p)) else t
                )
        return [*out_primals, *out_tangents]

    outs = _compat.bind_with_subfuns(
        eqn,
        [fun, jvp],
        [v.x for v in invals],
        drop=("call_jaxpr", "num_consts", "jvp_jaxpr_fun"),
    )
    return [_Val(x, k) for x, k in zip(outs, out_classes, strict=True)]


def _shard_map(
    ctx: _Ctx, eqn: Any, invals: list[_Val], widened: bool
) -> list[_Val]:
    """``shard_map``: its body evaluated per shard, with the same specs."""
    p = eqn.params
    record: dict[str, Any] = {}
    mapped = jax.shard_map(
        _open_body(ctx, p["jaxpr"], invals, widened, record),
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=list(p["out_specs"]),
        axis_names=_compat.shard_map_axes(p),
        check_vma=p["check_vma"],
    )
    outs = cast(list[Any], mapped(*[v.x for v in invals]))
    return [_Val(x, k) for x, k in zip(outs, record["out"], strict=True)]


_RECURSIONS: dict[str, Callable[..., list[_Val]]] = {
    **{name: _call_primitive for name in _INLINED},
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "remat2": _checkpoint,
    "checkpoint": _checkpoint,
    "custom_jvp_call": _custom_jvp,
    "shard_map": _shard_map,
}
