"""Autocast's rules, as data: one record per primitive, and the functions
that run whole.

**Adding a rule for a new primitive is one line in** :data:`_SPEC` below:
its name, its kind, and its facts. The names are resolved once, at import,
to the ``Primitive`` objects JAX binds (:func:`lossscale._compat.
primitives_named`), and the two passes look records up by primitive
(:data:`TABLE`). A name no installed JAX has is skipped. Higher-order
primitives (whose params hold jaxprs) are not rules but handlers,
registered into each pass's own table by :mod:`._handlers`.

The kinds (:class:`Kind`), and the public rule each one is
(:data:`PRIMITIVE_RULES`, public as :data:`lossscale.AUTOCAST_RULES`):

- ``MATMUL`` (``"compute"``): float operands in the compute dtype, and the
  result too, as in every AMP, unless the program asked for a wider
  result (``preferred_element_type=float32`` over 16-bit operands) or for
  ``precision=HIGHEST``.
- ``FLOAT8`` (``"float8"``): under a :class:`lossscale.Float8`
  configuration, a matmul of the ``quantizable`` fact (``dot_general``)
  runs in float8 where :meth:`lossscale.Float8.ineligible` allows (no batch
  dimensions, sizes multiples of 16), else as ``MATMUL``: its default
  there, and a rule a user may give it.
- ``BOUNDED`` (``"compute"``): tanh, logistic, erf, sin, cos: their result
  lies in [-1, 1] whatever the operand, so it is computed in float32 from
  a float32 operand and rounded to the compute dtype only where no float32
  operation reads it (``log(sigmoid(z))`` keeps the sigmoid in float32).
- ``FLOAT32`` (``"float32"``): float operands cast to float32, the result
  float32: what overflows or loses its precision in 16 bits (exponentials
  and logarithms, powers, reciprocal square roots, sums and products),
  PyTorch's CUDA float32 list mapped to JAX.
- ``PROMOTE`` (``"promote"``): arithmetic and data movement, PyTorch's
  type promotion: float32 where a float operand is float32 (a parameter,
  an input, a statistic, a constant the compute dtype cannot hold), else
  the compute dtype; a constant the compute dtype holds (``0.5``, a mask
  fill of ``-1e4``) takes its partner's dtype.
- ``CONVERT`` (``"original"``): ``convert_element_type``, a cast the
  program itself makes (``x.astype(jnp.float32)``), kept as it is: its
  result has the dtype the program asked for. It takes no user rule.
- A primitive with no record runs at the dtypes it was traced with
  (``"original"``), which is always correct (callbacks, custom calls,
  sorting, scatters, ...).

The facts of a record (:class:`Record`): ``moves`` (it moves, selects or
negates values: exact, so it commutes with rounding, and a constant keeps
its range through it), ``pooling`` (max or min pooling, whose backward
pass keeps its operand), ``collective``, ``gathers`` (it moves values
between devices or shardings and adds none: an all-gather, a resharding;
a float32 value that every reader rounds is rounded first and moved in
the compute dtype, its derivative moved back in float32),
``gathers_float8`` (a move whose result's largest magnitude is known
before it moves: a resharding moves a whole array, and an all-gather's is
the ``pmax`` of its operand's over the axes it gathers; a float32 weight
that only per-tensor float8 matmuls read is quantised first and moved in
float8, with the scale its gathered copy would have had), ``rearranges``
(it moves every value of one array and adds none, on one device: a
transpose, a reshape; a per-tensor float8 copy and its scale stay those
of its result, so a weight moved in float8 keeps its copy through it),
``remat`` (its
derivative is recomputed from its 16-bit operand, not stored in float32),
``foldable`` (autocast may compute it at trace time on small constants),
``island`` (it may be recomputed inside a float32 island:
:mod:`._islands`), ``keeps_nothing`` (its derivative reads none of its
float operands: a linear map, a comparison, a rounding; a float32 island
of such equations alone keeps nothing in float32 for the backward pass,
so it is bound without a checkpoint), ``quantizable`` (a matmul a
:class:`lossscale.Float8` recipe may quantise to float8) and ``called``
(it is bound as a ``jax.jit(inline=True)`` call of its own, as
``jnp.matmul`` binds it: under ``jax.grad``, JAX linearizes a call's
jaxpr once, where it linearizes a bare primitive at every binding; the
call is inlined where it is staged, so the program is the same:
:func:`lossscale._compat.bind_as_call`).

Function rules (:data:`FUNCTION_RULES`, public as
:data:`lossscale.AUTOCAST_FUNCTION_RULES`), from the name of a
``jax.jit``-ed, ``custom_jvp`` or ``custom_vjp`` function to
``"float32"`` (the whole function runs at the dtypes it was traced with,
its derivative rule included), ``"autocast"`` (it is evaluated with the
rules, which is what every function without an entry gets) or
``"compute"`` (evaluated with the rules, its matmuls in the 16-bit
compute dtype, none in float8).
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Any, Literal, cast

from lossscale import _compat

Rule = Literal["compute", "float8", "float32", "promote", "original"]
FunctionRule = Literal["float32", "original", "autocast", "compute"]
RULES_ACCEPTED: tuple[Rule, ...] = (
    "compute",
    "float8",
    "float32",
    "promote",
    "original",
)
FUNCTION_RULES_ACCEPTED: tuple[FunctionRule, ...] = (
    "float32",
    "original",
    "autocast",
    "compute",
)


class Kind(enum.Enum):
    """What a primitive does to precision (see the module docstring)."""

    MATMUL = "compute"
    FLOAT8 = "float8"
    BOUNDED = "bounded"
    FLOAT32 = "float32"
    PROMOTE = "promote"
    CONVERT = "convert"

    @property
    def rule(self) -> Rule:
        """The public rule of this kind."""
        if self is Kind.CONVERT:
            return "original"  # the program's own cast, kept as it is
        return "compute" if self is Kind.BOUNDED else self.value


@dataclasses.dataclass(frozen=True)
class Record:
    """One primitive's record: its kind (the rule it follows) and its
    facts."""

    kind: Kind
    moves: bool = False
    pooling: bool = False
    collective: bool = False
    gathers: bool = False
    gathers_float8: bool = False
    rearranges: bool = False
    remat: bool = False
    foldable: bool = True
    island: bool = True
    keeps_nothing: bool = False
    quantizable: bool = False
    called: bool = False


M, B, F, P = Kind.MATMUL, Kind.BOUNDED, Kind.FLOAT32, Kind.PROMOTE
_MOVE = {"moves": True}
# Exact data movement whose derivative is the same movement of the
# tangent (it keeps nothing; max, abs and their kin keep a mask).
_LINEAR_MOVE = {"moves": True, "keeps_nothing": True}
_REARRANGE = {**_LINEAR_MOVE, "rearranges": True}
_NOTHING = {"keeps_nothing": True}
_COLLECTIVE = {"collective": True, "foldable": False}
# Moves between devices that add nothing: rounding commutes with them, so
# a float32 value that every reader rounds (an FSDP weight before its
# matmul) is gathered in the compute dtype, at half the bytes.
_GATHER = {**_COLLECTIVE, "gathers": True}
_RESHARD = {**_MOVE, "foldable": False, "gathers": True, "gathers_float8": True}
# An all-gather's float8 scale is its gathered value's: the pmax, over the
# axes it gathers, of its operand's largest magnitude.
_ALL_GATHER = {**_GATHER, "gathers_float8": True}

# One line a primitive: (name, kind, facts). Names as jax.make_jaxpr
# prints them; the ones only some supported JAX versions have are
# skipped where absent (tests/test_autocast_primitives.py lists them).
_SPEC: tuple[tuple[str, Kind, dict[str, bool]], ...] = (
    # The program's own casts: kept (its moves fact: a constant keeps its
    # range through it; it keeps nothing for its derivative).
    ("convert_element_type", Kind.CONVERT, _LINEAR_MOVE),
    # Matmuls and convolutions.
    (
        "dot_general",
        M,
        {"foldable": False, "quantizable": True, "called": True},
    ),
    ("conv_general_dilated", M, {"foldable": False}),
    ("ragged_dot_general", M, {"foldable": False}),
    # Bounded results: rounding them cannot overflow, and it halves what
    # the backward pass keeps of them (GELU's tanh).
    ("tanh", B, {}),
    ("logistic", B, {}),
    ("erf", B, {}),
    ("erfc", B, {}),
    ("sin", B, {}),
    ("cos", B, {}),
    # Exponentials, logarithms and powers: PyTorch's exp, expm1, log,
    # log2, log10, log1p, pow, rsqrt, reciprocal, softplus. The powers and
    # exp are recomputed from their 16-bit operand in the backward pass.
    ("exp", F, {"remat": True}),
    ("exp2", F, {}),
    ("expm1", F, {}),
    ("log", F, {}),
    ("log1p", F, {}),
    ("pow", F, {"remat": True}),
    ("integer_pow", F, {"remat": True}),
    ("square", F, {"remat": True}),
    ("rsqrt", F, {}),
    # PyTorch's acos, asin, cosh, sinh, tan, erfinv.
    ("acos", F, {}),
    ("asin", F, {}),
    ("cosh", F, {}),
    ("sinh", F, {}),
    ("tan", F, {}),
    ("erf_inv", F, {}),
    ("lgamma", F, {}),
    ("digamma", F, {}),
    ("igamma", F, {}),
    ("igammac", F, {}),
    ("polygamma", F, {}),
    ("bessel_i0e", F, {}),
    ("bessel_i1e", F, {}),
    # Sums and products: PyTorch's sum, prod, cumsum, cumprod (and so the
    # means, variances and norms built on them), and sum pooling.
    ("reduce_sum", F, _NOTHING),
    ("reduce_prod", F, {}),
    ("cumsum", F, _NOTHING),
    ("cumprod", F, {}),
    ("cumlogsumexp", F, {}),
    ("reduce_window_sum", F, _NOTHING),
    # Elementwise arithmetic and comparisons.
    ("add", P, _NOTHING),
    ("add_any", P, _NOTHING),
    ("sub", P, _NOTHING),
    ("mul", P, {}),
    ("div", P, {}),
    ("rem", P, {}),
    ("sign", P, _NOTHING),
    ("floor", P, _NOTHING),
    ("ceil", P, _NOTHING),
    ("round", P, _NOTHING),
    ("sqrt", P, {}),
    ("cbrt", P, {}),
    ("atan2", P, {}),
    ("atan", P, {}),
    ("nextafter", P, {}),
    ("is_finite", P, _NOTHING),
    ("eq", P, _NOTHING),
    ("ne", P, _NOTHING),
    ("lt", P, _NOTHING),
    ("le", P, _NOTHING),
    ("gt", P, _NOTHING),
    ("ge", P, _NOTHING),
    ("real", P, _NOTHING),
    ("imag", P, _NOTHING),
    ("conj", P, _NOTHING),
    # checkpoint_name's label: what a checkpoint policy saves by name, so
    # never recomputed inside a float32 island.
    ("name", P, {"foldable": False, "island": False}),
    ("argmax", P, _NOTHING),
    ("argmin", P, _NOTHING),
    # Max and min pooling's derivatives.
    ("select_and_gather_add", P, {"foldable": False}),
    ("select_and_scatter_add", P, {"foldable": False}),
    # Data movement and selection: exact, and a constant that fits the
    # compute dtype still fits after it.
    ("reshape", P, _REARRANGE),
    ("broadcast_in_dim", P, _REARRANGE),
    ("transpose", P, _REARRANGE),
    ("squeeze", P, _REARRANGE),
    ("slice", P, _LINEAR_MOVE),
    ("dynamic_slice", P, _LINEAR_MOVE),
    ("dynamic_update_slice", P, _LINEAR_MOVE),
    ("gather", P, _LINEAR_MOVE),
    ("concatenate", P, _LINEAR_MOVE),
    ("pad", P, _LINEAR_MOVE),
    ("rev", P, _REARRANGE),
    ("split", P, _LINEAR_MOVE),
    ("select_n", P, _LINEAR_MOVE),
    ("reduce_max", P, _MOVE),
    ("reduce_min", P, _MOVE),
    ("max", P, _MOVE),
    ("min", P, _MOVE),
    ("clamp", P, _MOVE),
    ("neg", P, _LINEAR_MOVE),
    ("abs", P, _MOVE),
    ("copy", P, _REARRANGE),
    ("stop_gradient", P, _LINEAR_MOVE),
    ("sharding_constraint", P, _RESHARD),
    ("mesh_cast", P, _RESHARD),
    ("reshard", P, _RESHARD),
    # Max and min pooling keep their operand's dtype, even where only
    # float32 reads their result: their backward pass
    # (select_and_scatter_add) keeps the operand, which would be float32
    # (a conv stack's feature maps).
    ("cummax", P, {**_MOVE, "pooling": True}),
    ("cummin", P, {**_MOVE, "pooling": True}),
    ("reduce_window_max", P, {**_MOVE, "pooling": True}),
    ("reduce_window_min", P, {**_MOVE, "pooling": True}),
    # Collectives move (or add) values between devices, at the dtype the
    # activation has, as Megatron-LM's tensor-parallel all-reduce does.
    ("psum", P, _COLLECTIVE),
    ("psum_invariant", P, _COLLECTIVE),
    ("pvary", P, _COLLECTIVE),
    ("all_gather", P, _ALL_GATHER),
    ("all_gather_invariant", P, _ALL_GATHER),
    ("ppermute", P, _GATHER),
    ("all_to_all", P, _GATHER),
    ("ragged_all_to_all", P, _COLLECTIVE),
    ("reduce_scatter", P, _COLLECTIVE),
    ("pmax", P, _COLLECTIVE),
    ("pmin", P, _COLLECTIVE),
)

# The names of the spec that only some supported JAX versions have (the
# tests check that every other name is a primitive of the installed JAX,
# so that a rename is caught, not silently left "original").
ONLY_IN_SOME_VERSIONS = frozenset({"mesh_cast"})


def _records() -> dict[str, Record]:
    return {name: Record(kind, **facts) for name, kind, facts in _SPEC}


RECORDS: types.MappingProxyType[str, Record] = types.MappingProxyType(
    _records()
)
"""Every record of the spec, by name (including names this JAX lacks)."""

TABLE: types.MappingProxyType[Any, Record] = types.MappingProxyType(
    {
        primitive: RECORDS[name]
        for name, primitive in _compat.primitives_named(RECORDS).items()
    }
)
"""The records of the installed JAX's primitives, by ``Primitive``."""

PRIMITIVE_RULES: types.MappingProxyType[str, Rule] = types.MappingProxyType(
    {name: record.kind.rule for name, record in RECORDS.items()}
)

# Functions that run whole at the dtypes they were traced with: PyTorch's
# log_softmax, softmax and logsumexp (run as a unit, so that the
# subtraction of the maximum happens in float32 too), and jax.nn's
# standardize.
FUNCTION_RULES: types.MappingProxyType[str, FunctionRule] = (
    types.MappingProxyType(
        dict.fromkeys(
            ("log_softmax", "softmax", "_softmax", "logsumexp", "standardize"),
            "float32",
        )
    )
)

# What a user's rule makes of a primitive: the kind that rule stands for
# (a "compute" rule on a primitive that is not a matmul: the bounded
# kind, computed in the compute dtype from a 16-bit operand).
_KIND_OF_RULE: Mapping[str, Kind] = {
    "float32": Kind.FLOAT32,
    "promote": Kind.PROMOTE,
}


def in_float8(record: Record) -> Record:
    """A record of the ``quantizable`` fact, as a float8 configuration has
    it: of the ``FLOAT8`` kind."""
    return _FLOAT8_VARIANTS.setdefault(
        record, dataclasses.replace(record, kind=Kind.FLOAT8)
    )


_FLOAT8_VARIANTS: dict[Record, Record] = {}


def overridden(record: Record | None, rule: Rule) -> Record | None:
    """``record`` with its kind replaced by a user's ``rule`` (``None``:
    the primitive runs at its traced dtypes)."""
    if rule == "original":
        return None
    if rule == "float8":
        # autocast accepts the rule only for a primitive of the quantizable
        # fact (lossscale/_autocast/_api.py's _tables).
        return in_float8(cast(Record, record))
    if rule == "compute":
        kind = (
            Kind.MATMUL
            if record is not None and record.kind is Kind.MATMUL
            else Kind.BOUNDED
        )
    else:
        kind = _KIND_OF_RULE[rule]
    if record is None:
        return Record(kind, foldable=False)
    return dataclasses.replace(record, kind=kind)
