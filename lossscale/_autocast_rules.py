"""Autocast's rules, as data: which dtype each primitive or function runs in.

Each entry maps the name of a JAX primitive (``jax.make_jaxpr`` prints
them) or of a function (the ``name`` of a ``jax.jit`` equation, the name
of a ``jax.custom_jvp``/``jax.custom_vjp`` function) to one of:

- ``"compute"``: float operands are cast to the compute dtype, and so is
  the result (matmuls and convolutions, whose backward passes are
  matmuls and convolutions too; and the activations whose result lies in
  [-1, 1] whatever the input, which PyTorch's autocast leaves in the input
  dtype as well).
- ``"float32"``: float operands are cast to float32 and the result stays
  float32: what overflows or loses its precision in 16 bits (exponentials
  and logarithms, powers, reciprocal square roots, sums and products, the
  log-softmax), PyTorch's CUDA float32 list mapped to JAX. A function
  entry runs the whole function at the dtypes it was traced with, its
  custom derivative rule included.
- ``"promote"``: arithmetic and data movement. The result is float32
  where an operand is a value that must stay float32, else the compute
  dtype where an operand is an activation in it (computed in float32 first
  where another operand is float32: a norm's output or a bias add is then
  rounded once), else float32.
- ``"original"``: the equation runs at the dtypes it was traced with.
  Every primitive that is not listed gets this rule, which is always
  correct (collectives, callbacks, custom calls, sorting, scatters, ...).

Higher-order primitives (``jit``, ``scan``, ``while``, ``cond``,
``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``) are not rules but
recursions: autocast evaluates their jaxprs with these same rules.
"""

from __future__ import annotations

import types
from typing import Literal

Rule = Literal["compute", "float32", "promote", "original"]
RULES_ACCEPTED: tuple[Rule, ...] = ("compute", "float32", "promote", "original")

_COMPUTE = (
    "dot_general",
    "conv_general_dilated",
    "ragged_dot",
    "ragged_dot_general",
    # Bounded results: rounding them to 16 bits cannot overflow, and it
    # halves what the backward pass keeps of them (GELU's tanh).
    "tanh",
    "logistic",
    "erf",
    "erfc",
    "sin",
    "cos",
)

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
    # means, variances and norms built on them).
    "reduce_sum",
    "reduce_prod",
    "cumsum",
    "cumprod",
    "cumlogsumexp",
)

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

_PROMOTE = (
    # Elementwise arithmetic.
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "rem",
    "max",
    "min",
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
    "clamp",
    "select_n",
    "is_finite",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "copy",
    "copy_p",
    "real",
    "imag",
    "conj",
    # Data movement and the reductions that pick a value.
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "squeeze",
    "expand_dims",
    "slice",
    "dynamic_slice",
    "dynamic_update_slice",
    "gather",
    "concatenate",
    "pad",
    "rev",
    "split",
    "reduce_max",
    "reduce_min",
    "argmax",
    "argmin",
    "cummax",
    "cummin",
    "stop_gradient",
    "sharding_constraint",
    "mesh_cast",
    "reshard",
    "name",
)


def _table() -> dict[str, Rule]:
    table: dict[str, Rule] = {}
    lists: tuple[tuple[tuple[str, ...], Rule], ...] = (
        (_COMPUTE, "compute"),
        (_FLOAT32, "float32"),
        (_FUNCTIONS_FLOAT32, "float32"),
        (_PROMOTE, "promote"),
    )
    for names, rule in lists:
        for name in names:
            table[name] = rule
    return table


DEFAULT_RULES: types.MappingProxyType[str, Rule] = types.MappingProxyType(
    _table()
)

# Reductions whose result is a statistic (a sum, a product): it stays
# float32, and an activation it meets is handed on in the compute dtype.
STATISTICS = frozenset({"reduce_sum", "reduce_prod"})

# The "compute" entries that always run in the compute dtype, whatever their
# operands (the others do so only for activations).
MATMULS = frozenset(
    {"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"}
)

# "float32" entries whose derivative is recomputed from their compute-dtype
# operand rather than stored in float32 (elementwise and cheap).
REMATERIALIZED = frozenset({"integer_pow", "square", "pow"})
