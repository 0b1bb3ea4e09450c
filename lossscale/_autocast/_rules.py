"""Autocast's rules, as data: which dtype each primitive or function runs in.

**Adding a rule for a new primitive is one line here**: its name in one of
the tuples below. Higher-order primitives (whose params hold jaxprs) are
not rules but handlers, registered in one table in
:mod:`lossscale._autocast._higher`.

Primitive rules (:data:`PRIMITIVE_RULES`, public as
:data:`lossscale.AUTOCAST_RULES`), from a primitive's name as
``jax.make_jaxpr`` prints it to one of:

- ``"compute"``: float operands are cast to the compute dtype. For the
  matmuls and convolutions (:data:`MATMULS`) always, and their result is
  in the compute dtype, as in every AMP. For the bounded functions (tanh,
  logistic, erf, sin, cos: their result lies in [-1, 1] whatever the
  input) the function is computed in float32 when its operand is float32,
  and its result is rounded to the compute dtype only where no float32
  operation reads it (``log(sigmoid(z))`` keeps the sigmoid in float32).
- ``"float32"``: float operands are cast to float32 and the result stays
  float32: what overflows or loses its precision in 16 bits (exponentials
  and logarithms, powers, reciprocal square roots, sums and products),
  PyTorch's CUDA float32 list mapped to JAX.
- ``"promote"``: arithmetic and data movement, PyTorch's type promotion:
  the result is float32 where a float operand is float32 (a parameter, an
  input, a statistic, a constant that the compute dtype cannot hold), else
  the compute dtype where an operand is in it; a constant whose value the
  compute dtype holds (``0.5``, a mask fill of ``-1e4``) takes its
  partner's dtype.
- ``"original"``: the equation runs at the dtypes it was traced with.
  Every primitive that is not listed gets this rule, which is always
  correct (callbacks, custom calls, sorting, scatters, ...).

Function rules (:data:`FUNCTION_RULES`, public as
:data:`lossscale.AUTOCAST_FUNCTION_RULES`), from the name of a
``jax.jit``-ed, ``custom_jvp`` or ``custom_vjp`` function to
``"float32"`` (the whole function runs at the dtypes it was traced with,
its derivative rule included) or ``"autocast"`` (it is evaluated with the
rules, which is what every function without an entry gets).
"""

from __future__ import annotations

import types
from typing import Literal

Rule = Literal["compute", "float32", "promote", "original"]
FunctionRule = Literal["float32", "original", "autocast"]
RULES_ACCEPTED: tuple[Rule, ...] = ("compute", "float32", "promote", "original")
FUNCTION_RULES_ACCEPTED: tuple[FunctionRule, ...] = (
    "float32",
    "original",
    "autocast",
)

# Matmuls and convolutions: their operands and result in the compute dtype.
MATMULS = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot_general"}
)

# Bounded results: rounding them to 16 bits cannot overflow, and it halves
# what the backward pass keeps of them (GELU's tanh).
_BOUNDED = ("tanh", "logistic", "erf", "erfc", "sin", "cos")

_FLOAT32 = (
    # Exponentials, logarithms and powers: PyTorch's exp, expm1, log, log2,
    # log10, log1p, pow, rsqrt, reciprocal, softplus.
    "exp",
    "exp2",
    "expm1",
    "log",
    "log1p",
    "pow",
    "integer_pow",
    "square",
    "rsqrt",
    # PyTorch's acos, asin, cosh, sinh, tan, erfinv.
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    "erf_inv",
    "lgamma",
    "digamma",
    "igamma",
    "igammac",
    "polygamma",
    "bessel_i0e",
    "bessel_i1e",
    # Sums and products: PyTorch's sum, prod, cumsum, cumprod (and so the
    # means, variances and norms built on them), and sum pooling.
    "reduce_sum",
    "reduce_prod",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
    "reduce_window_sum",
)

# Data movement and selection: the result holds operand values (or their
# negation), so a constant that fits the compute dtype still fits after it.
RANGE_PRESERVING = frozenset(
    {
        "reshape",
        "broadcast_in_dim",
        "transpose",
        "squeeze",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "gather",
        "concatenate",
        "pad",
        "rev",
        "split",
        "select_n",
        "reduce_max",
        "reduce_min",
        "max",
        "min",
        "clamp",
        "neg",
        "abs",
        "copy",
        "stop_gradient",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "convert_element_type",
        "cummax",
        "cummin",
        "reduce_window_max",
        "reduce_window_min",
    }
)

# Max and min pooling keep their operand's dtype, even where only float32
# reads their result: their backward pass (select_and_scatter_add) keeps
# the operand, which would be float32 (a conv stack's feature maps).
POOLING = frozenset(
    {"reduce_window_max", "reduce_window_min", "cummax", "cummin"}
)

# Collectives move (or add) values between devices: at the dtype the
# activation has, as Megatron-LM's tensor-parallel all-reduce does.
COLLECTIVES = (
    "psum",
    "psum_invariant",
    "pvary",
    "all_gather",
    "all_gather_invariant",
    "ppermute",
    "all_to_all",
    "ragged_all_to_all",
    "reduce_scatter",
    "pmax",
    "pmin",
)

_PROMOTE = (
    # Elementwise arithmetic.
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "rem",
    "neg",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "sqrt",
    "cbrt",
    "atan2",
    "atan",
    "nextafter",
    "is_finite",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "real",
    "imag",
    "conj",
    "name",
    # Reductions that pick a value, and max/min pooling and its derivative.
    "argmax",
    "argmin",
    "select_and_gather_add",
    "select_and_scatter_add",
    *COLLECTIVES,
    *sorted(RANGE_PRESERVING - {"convert_element_type"}),
)

# Names in the tables that only some supported JAX versions have (the
# tests check that every other name is a primitive of the installed JAX,
# so that a rename is caught, not silently left "original").
ONLY_IN_SOME_VERSIONS = frozenset({"mesh_cast"})

# Functions that run whole at the dtypes they were traced with: PyTorch's
# log_softmax, softmax and logsumexp (run as a unit, so that the
# subtraction of the maximum happens in float32 too), and jax.nn's
# standardize.
_FUNCTIONS_FLOAT32 = (
    "log_softmax",
    "softmax",
    "_softmax",
    "logsumexp",
    "standardize",
)


def _table() -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    lists: tuple[tuple[tuple[str, ...], Rule], ...] = (
        (tuple(sorted(MATMULS)), "compute"),
        (_BOUNDED, "compute"),
        (_FLOAT32, "float32"),
        (_PROMOTE, "promote"),
    )
    for names, rule in lists:
        for name in names:
            table[name] = rule
    return table


PRIMITIVE_RULES: types.MappingProxyType[str, Rule] = types.MappingProxyType(
    _table()
)
FUNCTION_RULES: types.MappingProxyType[str, FunctionRule] = (
    types.MappingProxyType(dict.fromkeys(_FUNCTIONS_FLOAT32, "float32"))
)

# "float32" entries whose derivative is recomputed from their compute-dtype
# operand rather than stored in float32 (elementwise and cheap).
REMATERIALIZED = frozenset({"integer_pow", "square", "pow", "exp"})

# Primitives whose value autocast may compute at trace time when every
# operand is a small constant (to know whether the result fits).
FOLDABLE = (
    frozenset(
        name
        for name, rule in _table().items()
        if rule in ("float32", "promote") and name not in MATMULS
    )
    - set(COLLECTIVES)
    - {
        "name",
        "sharding_constraint",
        "mesh_cast",
        "reshard",
        "select_and_gather_add",
        "select_and_scatter_add",
    }
) | set(_BOUNDED)
