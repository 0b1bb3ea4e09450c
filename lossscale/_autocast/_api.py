"""The public functions :func:`autocast`, :func:`float32_scope` and
:func:`compute_scope`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np

from lossscale import _policy
from lossscale._autocast import _eager, _float8, _handlers, _plan
from lossscale._autocast import _rules as R
from lossscale._autocast._classes import F32_DTYPE
from lossscale._autocast._config import Config, frozen_items

F = TypeVar("F", bound=Callable[..., Any])

FLOAT32_SCOPE = _plan.FLOAT32_SCOPE
COMPUTE_SCOPE = _plan.COMPUTE_SCOPE


def autocast(
    fun: F,
    compute_dtype: Any = jnp.float16,
    *,
    output_dtype: Any = None,
    rules: Mapping[str, str] | None = None,
    function_rules: Mapping[str, str] | None = None,
) -> F:
    """Runs ``fun`` in mixed precision: matmuls in 16 bits, the rest safely.

    The returned function has ``fun``'s signature. Called, it traces ``fun``
    at the dtypes of its arguments (float32 parameters and data, say),
    plans the dtype of every operation from these rules, and evaluates the
    traced operations again at those dtypes:

    - matmuls and convolutions (``dot_general``, ``conv_general_dilated``)
      run with ``compute_dtype`` operands and results, in the forward pass
      and in the backward pass that ``jax.grad`` derives from it, unless
      they ask for ``precision=HIGHEST`` (or ``HIGH``), or for a result
      wider than their operands (``preferred_element_type=jnp.float32`` on
      operands the program made 16-bit, which keeps its float32 result);
      with a :class:`lossscale.Float8` recipe, the linear layers' matmuls
      run in float8 (see ``compute_dtype``);
    - exponentials and logarithms, powers, ``rsqrt``, sums and products
      (hence means, variances, norms), cumulative sums, ``log_softmax``,
      ``softmax`` and ``logsumexp`` run in float32, as do losses built on
      them;
    - everything else follows PyTorch's type promotion: activations stay in
      ``compute_dtype`` between matmuls (so the backward pass stores half
      as much), an operation that meets a float32 value (a parameter, a
      statistic, an input, a constant the compute dtype cannot hold, such
      as a ``-1e9`` mask fill or ``finfo(float32).tiny``) is float32, and
      a constant the compute dtype holds takes its partner's dtype;
    - bounded functions (``tanh``, ``sigmoid``, ``erf``, ``sin``, ``cos``)
      are rounded to ``compute_dtype`` only where no float32 operation
      reads them (``log(sigmoid(z))`` stays float32).

    So autocast never rounds a float32 value to 16 bits except as a
    matmul's or a convolution's operand: a result that float16 cannot hold
    overflows only inside a matmul, as in every AMP.

    Integers, booleans and PRNG keys are never touched, and neither are
    float64 values or an explicit cast the traced program shows (to float8,
    say). Parameters stay float32 outside: ``jax.grad`` of an autocast loss
    returns float32 gradients with the parameters' structure. Outputs have
    the dtypes ``fun`` returns without autocast, unless ``output_dtype`` is
    given.

    The traced program's own jaxprs are planned and evaluated with the same
    rules, each re-bound with all its parameters: ``jax.jit``-ed functions
    (once per input classes: a block called 48 times stays one function),
    ``lax.scan``, ``lax.while_loop``, ``lax.cond`` (and
    ``lax.platform_dependent``), ``jax.checkpoint``, ``shard_map`` and the
    functions of ``jax.custom_jvp`` (whose rule is evaluated with the same
    rules); a ``custom_vjp`` function runs whole at the dtypes it was traced
    with. A loop's carry takes one dtype for every iteration, float32 if it
    starts float32 (an accumulator); a ``while_loop``'s stopping decision
    (the carries it depends on, through the body at any remove, and the
    operations computing them) runs at its traced dtypes, so that the loop
    stops where float32 stops; its other carries are cast as everywhere.

    Two calls of ``autocast`` with the same function and configuration
    return equal functions (the same one, for a plain function or a
    ``functools.partial``, while it lives), so ``jax.jit(autocast(loss))``
    written inline compiles once, and plans are kept as long as the traced
    program they were made for (a ``jax.jit``-ed block is re-traced and
    compiled once, under ``jax.grad`` called eagerly too). Called eagerly
    (outside any trace), it is compiled once per argument structure, as a
    ``jax.jit`` of it would be: arrays are traced, and every other leaf (a
    Python number, a string, a flag) is static, as in equinox's
    ``filter_jit``, so that Python code may branch on it and a constant's
    value decides its precision: a new value compiles again (a float is
    keyed by its bits), the 64 most recently used are kept, and a
    ``UserWarning`` says so once, after 5 values (pass a value that
    changes every call as an array). With NNX state or an unhashable leaf
    among the arguments, it traces on every call.

    Args:
        fun: the function to run, e.g. a loss ``loss_fn(params, batch)``.
        compute_dtype: ``jnp.float16`` (the default) or ``jnp.bfloat16``,
            or their names; or a :class:`lossscale.Policy` (or its string,
            ``"p=f32,c=bf16,o=f32"``, jmp's grammar): compute in its
            ``compute_dtype``, with every floating output cast to its
            ``output_dtype``. Its ``param_dtype`` must be float32: autocast
            takes parameters in the dtype they come in. Keras's names
            (``"mixed_float16"``, ``"mixed_bfloat16"``) compute in their
            16-bit dtype and keep the outputs' dtypes, as Keras computes
            losses in float32. Or a :class:`lossscale.Float8` recipe:
            matmuls (``dot_general``) without batch dimensions whose sizes are
            multiples of 16 (linear layers) run in float8 with current
            scaling, forward and backward; everything else as with the
            recipe's 16-bit ``compute_dtype``
            (:func:`lossscale.matmuls` lists which went where).
        output_dtype: ``None`` (each output keeps the dtype ``fun`` gives
            it without autocast), or a float dtype to cast every floating
            output to.
        rules: overrides of the primitive rules, from a primitive's name
            (``"tanh"``, ``"dot_general"``, as ``jax.make_jaxpr`` prints
            them) to ``"compute"``, ``"float32"``, ``"promote"`` or
            ``"original"`` (run at the traced dtypes); with a
            :class:`lossscale.Float8` recipe, ``{"dot_general": "compute"}``
            keeps every matmul 16-bit, and ``"float8"`` is its default.
            :data:`lossscale.AUTOCAST_RULES` lists the defaults.
        function_rules: overrides of the function rules, from the name of a
            ``jax.jit``-ed, ``custom_jvp`` or ``custom_vjp`` function to
            ``"float32"`` (it runs whole at its traced dtypes),
            ``"autocast"`` (it is evaluated with the rules) or ``"compute"``
            (evaluated with the rules, its matmuls 16-bit, none float8).
            :data:`lossscale.AUTOCAST_FUNCTION_RULES` lists the defaults;
            :func:`float32_scope` keeps any region in float32. A key of
            either mapping that no equation of the traced program matches
            raises a ``UserWarning`` naming it, once.

    Returns:
        A function with ``fun``'s signature.

    Raises:
        TypeError: if ``fun`` is not callable (or is a dtype: the arguments
            swapped), ``compute_dtype`` is not a 16-bit float type, a
            policy or a float8 recipe, or ``rules`` is malformed.
        ValueError: if a rule is unknown, a function's name is given as a
            primitive's, ``"float8"`` is given without a float8 recipe or
            to another primitive than ``dot_general``, or a policy's
            ``param_dtype`` is not float32.

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
    if not callable(fun) or _looks_like_dtype(fun):
        hint = ""
        if (
            _looks_like_dtype(fun)
            and callable(compute_dtype)
            and not _looks_like_dtype(compute_dtype)
        ):
            hint = (
                " (the arguments are swapped: autocast(fun, compute_dtype), "
                "e.g. autocast(loss_fn, jnp.float16))"
            )
        if not hint and callable(fun):
            hint = " (a dtype, not a function)"
        raise TypeError(
            f"fun must be callable, got fun={fun!r} of type "
            f"{type(fun).__name__}{hint}."
        )
    if isinstance(compute_dtype, str) and _is_policy_string(compute_dtype):
        keras = compute_dtype.strip().startswith("mixed_")
        compute_dtype = _policy.get_policy(compute_dtype)
        if keras:
            # Keras computes losses and metrics in float32 under its
            # mixed policies: the outputs keep the dtypes fun gives them.
            compute_dtype = compute_dtype.compute_dtype
    if isinstance(compute_dtype, _policy.Policy):
        if output_dtype is not None:
            raise TypeError(
                "output_dtype must be None when compute_dtype is a Policy "
                "(its output dtype is used), got "
                f"output_dtype={output_dtype!r}."
            )
        param = compute_dtype.param_dtype
        if param is not None and np.dtype(param) != F32_DTYPE:
            raise ValueError(
                "autocast takes parameters in the dtype they come in and "
                "keeps float32 master weights: a Policy's param_dtype must "
                f"be float32, got param_dtype={np.dtype(param).name} (cast "
                "the parameters with policy.cast_to_param first to store "
                "them in 16 bits)."
            )
        output_dtype = compute_dtype.output_dtype
        compute_dtype = compute_dtype.compute_dtype
    float8 = None
    if isinstance(compute_dtype, _float8.Float8):
        float8, compute_dtype = compute_dtype, compute_dtype.compute_dtype
    rules_items, function_items = _tables(rules, function_rules, float8)
    config = Config(
        compute=check_compute_dtype(compute_dtype),
        rules=rules_items,
        function_rules=function_items,
        float8=float8,
    )
    out_dtype = None if output_dtype is None else _float_dtype(output_dtype)
    return cast(F, _eager.wrap(fun, config, out_dtype))


def _looks_like_dtype(x: Any) -> bool:
    """A dtype or a scalar type (``jnp.float16`` is callable)."""
    if isinstance(x, np.dtype):
        return True
    return isinstance(x, type) and (
        issubclass(x, np.generic)
        or isinstance(getattr(x, "dtype", None), np.dtype)
    )


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


def _check_table(
    name: str, overrides: Mapping[str, str] | None, accepted: tuple[str, ...]
) -> dict[str, str]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise TypeError(
            f"{name} must be a mapping from a name to a rule, got "
            f"{name}={overrides!r}."
        )
    for key, rule in overrides.items():
        if not isinstance(key, str):
            raise TypeError(
                f"{name} keys must be names (str), got {key!r} in {name}."
            )
        if rule not in accepted:
            raise ValueError(
                f"{name}[{key!r}] must be one of {accepted}, got {rule!r}."
            )
    return dict(overrides)


def _tables(
    rules: Mapping[str, str] | None,
    function_rules: Mapping[str, str] | None,
    float8: Any,
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    primitive = _check_table("rules", rules, R.RULES_ACCEPTED)
    function = _check_table(
        "function_rules", function_rules, R.FUNCTION_RULES_ACCEPTED
    )
    for key, rule in primitive.items():
        if rule != "float8":
            continue
        record = R.RECORDS.get(key)
        if record is None or not record.quantizable:
            able = sorted(n for n, r in R.RECORDS.items() if r.quantizable)
            raise ValueError(
                f"rules[{key!r}]: only {', '.join(able)} can run in float8, "
                f"got rules[{key!r}]='float8'."
            )
        if float8 is None:
            raise ValueError(
                f"rules[{key!r}]='float8' needs a float8 recipe: "
                "compute_dtype=lossscale.Float8(...)."
            )
    for key in primitive:
        record = R.RECORDS.get(key)
        if record is not None and record.kind is R.Kind.CONVERT:
            raise ValueError(
                f"rules[{key!r}]: autocast keeps the program's own casts "
                "as they are, so convert_element_type takes no rule; give "
                "the rule to the operations that read the cast value, or "
                f"keep them in float32_scope(). Got rules={dict(primitive)!r}."
            )
        if key in R.FUNCTION_RULES or key in _handlers.HANDLED:
            raise ValueError(
                f"rules[{key!r}]: {key!r} is "
                + (
                    "a function: give it in function_rules="
                    if key in R.FUNCTION_RULES
                    else "a higher-order primitive, whose jaxprs autocast "
                    "evaluates with the rules: use float32_scope() or "
                    "function_rules= for the function it calls"
                )
                + "."
            )
    return frozen_items(primitive), frozen_items(function)


@contextlib.contextmanager
def float32_scope() -> Iterator[None]:
    """Keeps what is traced inside it at the dtypes it is traced with.

    A context manager and a decorator: operations traced in it (a mixture
    of experts' router, a loss of your own) run under :func:`autocast` as
    they would without it, as PyTorch's ``autocast(enabled=False)`` does,
    and so do their derivatives and what ``jax.vmap`` makes of them. It is
    a ``jax.named_scope``, so it costs nothing outside autocast and shows
    in profiles.

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


@contextlib.contextmanager
def compute_scope() -> Iterator[None]:
    """Keeps the matmuls traced inside it out of float8.

    Under :func:`autocast` with a :class:`lossscale.Float8` recipe, the
    matmuls traced in it (an output head, the first or last layer) run in
    the recipe's 16-bit ``compute_dtype`` instead of float8, forward and
    backward, as :func:`float32_scope` keeps a region in float32;
    everything else in it follows autocast's rules as outside it. Without
    a float8 recipe it changes nothing. A context manager and a decorator;
    a ``jax.named_scope``, so it costs nothing outside autocast.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> def loss(w, x):
        ...     h = x @ w
        ...     with lossscale.compute_scope():
        ...         return jnp.mean(h @ w)
        >>> f = lossscale.autocast(loss, lossscale.Float8())
        >>> w, x = jnp.full((32, 32), 0.1), jnp.ones((16, 32))
        >>> [(m.dtype, m.why) for m in lossscale.matmuls(f, w, x)]
        [('float8_e4m3fn', 'float8'), ('bfloat16', 'compute_scope')]
    """
    with jax.named_scope(COMPUTE_SCOPE):
        yield
