"""Float8 matmuls with current scaling: :class:`Float8` and :func:`dot_general`.

A leaf module (it imports JAX, numpy and :mod:`lossscale._compat` only):
:func:`dot_general` is what autocast binds in place of a matmul it would
run in its compute dtype, with the equation's dimension numbers.

XLA:CPU runs a ``dot_general`` of float8 operands exactly (it converts them
to float32), so the tests check the numerics on CPU; on a GPU of compute
capability 8.9 or more, XLA rewrites it into a cuBLASLt float8 GEMM
(``benchmarks/fp8_check.py`` counts those in compiled HLO).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lossscale import _compat

__all__ = [
    "EPS",
    "MAX_SCALE",
    "RECIPES",
    "Cast",
    "Float8",
    "Recipe",
    "dot_general",
    "round_down_to_power_of_two",
]

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
F32 = np.dtype(np.float32)
_MAX = {E4M3: 448.0, E5M2: 57344.0}

# The floor under an amax: float32's smallest normal, so that every
# finite non-zero amax above it is scaled to float8's range. torchao's
# floor, 1e-12 (torchao/float8/float8_utils.py), scales a gradient below
# it (a loss scaled by 2**-60) by less than it needs, and breaks the
# absorption of a power-of-two loss scale. Below 448 / float32's max
# (2**-119 for e4m3, 2**-111 for e5m2) the scale overflows: it is capped
# at float32's largest finite value (:data:`MAX_SCALE`), which still maps
# the amax to at least 4 (e4m3) or 2**-1 (e5m2), normal numbers of the
# format, and keeps a tensor of zeros zero (0 * inf would be NaN).
EPS = float(np.finfo(np.float32).tiny)
MAX_SCALE = float(np.finfo(np.float32).max)


class Cast(NamedTuple):
    """How one operand of one of a linear layer's three GEMMs is cast:
    torchao's ``CastConfig``.

    Attributes:
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``, or ``None``: the 16-bit
        compute dtype, unscaled (torchao's ``ScalingType.DISABLED``).
      rowwise: one scale per row, along the axes this GEMM contracts
        (torchao's ``AXISWISE``), else one per tensor.
    """

    dtype: np.dtype | None
    rowwise: bool = False


class Recipe(NamedTuple):
    """A float8 recipe, as data: how each operand of each of a linear
    layer's GEMMs is cast, in the shape of torchao's ``Float8LinearConfig``
    (its ``cast_config_*`` fields). With ``y = x @ w``:

    - ``y = input @ weight`` (the forward GEMM);
    - ``dx = grad_output @ weight_for_grad_input.T``;
    - ``dw = input_for_grad_weight.T @ grad_output_for_grad_weight``.

    Each GEMM accumulates in float32. A GEMM's two operands are both
    float8 or both in the compute dtype. An operand whose backward cast is
    its forward one, per tensor, is kept quantised for the backward pass
    (one byte an element); otherwise the operand is kept as it came and
    cast again. ``power_of_two_scales`` is the recipe's default for
    :attr:`Float8.power_of_two_scales`.
    """

    input: Cast
    weight: Cast
    grad_output: Cast
    weight_for_grad_input: Cast
    input_for_grad_weight: Cast
    grad_output_for_grad_weight: Cast
    power_of_two_scales: bool = False

    @property
    def symmetric(self) -> bool:
        """Whether swapping the input and the weight gives the same
        numbers (then which operand is the weight does not matter)."""
        return (
            self.input == self.weight
            and self.weight_for_grad_input == self.input_for_grad_weight
            and self.grad_output == self.grad_output_for_grad_weight
        )


_E4, _E4_ROWS = Cast(E4M3), Cast(E4M3, rowwise=True)
_HIGH = Cast(None)

RECIPES: Mapping[str, Recipe] = types.MappingProxyType(
    {
        # torchao/float8/config.py, Float8LinearConfig.from_recipe_name
        # (its default config for "tensorwise": e5m2 output gradients,
        # TransformerEngine's HYBRID format).
        "tensorwise": Recipe(_E4, _E4, Cast(E5M2), _E4, _E4, Cast(E5M2), False),
        "rowwise": Recipe(
            _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4_ROWS, True
        ),
        "rowwise_with_gw_hp": Recipe(
            _E4_ROWS, _E4_ROWS, _E4_ROWS, _E4, _HIGH, _HIGH, True
        ),
    }
)
"""The named recipes, one row each (torchao's names and casts)."""


@dataclasses.dataclass(frozen=True)
class Float8:
    """A float8 recipe: how a matmul runs in float8 (current scaling).

    Passed to :func:`lossscale.autocast` as its ``compute_dtype``
    (``autocast(loss_fn, lossscale.Float8())``), it runs the eligible
    matmuls in float8 and everything else in its 16-bit ``compute_dtype``.

    Each operand is quantised with a scale computed from its own values, in
    this step (*current*, or *dynamic*, scaling: no state, no amax
    history), as torchao's float8 training does:

    .. code-block:: none

        amax  = max(|x|)                  # per tensor, or per row (below)
        scale = min(fp8_max / max(amax, EPS), MAX_SCALE)  # float32;
                                          # rounded DOWN to a power of two
                                          # if power_of_two_scales
        q     = float8(float32(x) * scale)   # no clip: nothing overflows
        out   = dot(q_lhs, q_rhs, accumulate=float32) / (scale_lhs * scale_rhs)

    The quantised operands go straight into one ``lax.dot_general`` with
    ``preferred_element_type=float32`` ("direct" quantisation, which XLA
    rewrites into a cuBLASLt float8 GEMM on GPUs of compute capability 8.9
    and newer); its result is multiplied by the inverse scales and cast to
    ``compute_dtype``. Gradients come back in their operands' dtypes.

    A recipe is a row of :data:`RECIPES` (a :class:`Recipe`, exported as
    ``lossscale.Float8Recipe``): for each operand of each of a linear
    layer's three GEMMs (the forward product, the input's gradient, the
    weight's gradient), its dtype and whether it is scaled per tensor or
    per row, in the shape of torchao's cast configs (``CastConfig``). The
    named ones are torchao's (``Float8LinearConfig.from_recipe_name``):

    - ``"tensorwise"``: one scale per tensor; ``e4m3`` operands forward,
      and backward the output gradient in ``float8_e5m2`` (max 57344) by
      an ``e4m3`` operand (the "HYBRID" format; TransformerEngine's
      ``Float8CurrentScaling``). The backward pass reuses the forward's
      ``e4m3`` operands (one byte per element is all it keeps).
    - ``"rowwise"``: one scale per row of each operand of each GEMM, along
      the axes that GEMM contracts, all ``e4m3`` (the output gradient too:
      with a scale per row it has the range it needs), scales rounded
      down to powers of two. Each backward GEMM contracts other axes, so
      it quantises its operands again from the operands kept in their
      own dtype.
    - ``"rowwise_with_gw_hp"``: as ``"rowwise"``, except that the input
      gradient's weight is scaled per tensor, and that the **weight
      gradient is computed in** ``compute_dtype`` (no float8; as
      autocast's 16-bit matmuls, whose GEMMs accumulate in float32 on
      GPUs).

    Under :func:`lossscale.autocast` the weight is the operand computed
    from the parameters (:attr:`params_argnums`), whichever side of the
    matmul it is on; called directly, :func:`dot_general` takes it as an
    argument (the rhs by default, as in ``x @ w``).

    A non-finite value is never hidden: an inf or NaN in an operand (or in
    the output gradient) makes its amax inf or NaN, its scale 0 or NaN,
    and every result that depends on it NaN (no clip before the cast, no
    "keep the previous scale" guard). A power-of-two loss scale is absorbed
    exactly: scaling the output gradient by ``2**k`` scales its amax and its
    inverse scale by ``2**k`` and leaves its float8 values unchanged, so the
    gradients unscaled afterwards are bitwise those computed without it
    (with or without power-of-two scales, for any scale that keeps the
    gradients normal float32 numbers: ``2**-60`` to ``2**60`` is tested).
    ``EPS`` is float32's smallest normal, not torchao's ``1e-12``, so that
    a small gradient is scaled up to float8's range too.

    How it maps to other libraries:

    - TransformerEngine's ``Float8CurrentScaling`` recipe (``HYBRID``
      format) is ``Float8("tensorwise")``;
    - torchao's ``Float8LinearConfig.from_recipe_name(name)`` is
      ``Float8(name)``, with the same casts and ``power_of_two_scales``
      default; its ``module_filter_fn`` is :attr:`exclude` with a callable
      that returns the opposite (or a name, or
      :func:`lossscale.compute_scope`);
    - flax's ``Fp8DotGeneral`` (``flax.linen.fp8_ops``) uses *delayed*
      scaling: scales from an amax history kept as state and passed through
      the gradients. There is no such state here.

    Args:
      recipe: ``"tensorwise"``, ``"rowwise"`` or ``"rowwise_with_gw_hp"``,
        or a :class:`Recipe` of your own (one row: a new recipe is one).
      compute_dtype: the dtype of the forward result (``jnp.bfloat16`` or
        ``jnp.float16``, or their names); under :func:`lossscale.autocast`,
        the 16-bit dtype of everything that is not a float8 matmul.
      power_of_two_scales: round every scale down to a power of two (so
        that scaling is exact). By default, as torchao's recipe: ``False``
        for ``"tensorwise"``, ``True`` for the row-wise ones.
      batched: under :func:`lossscale.autocast`, run the matmuls whose
        operands both depend on the data (attention's) in float8 too
        (default ``False``).
      multiple: under :func:`lossscale.autocast`, run in float8 only the
        linear layers whose weight's N and K are multiples of this
        (default 16; M too for an activation-by-activation matmul under
        ``batched``).
      params_argnums: under :func:`lossscale.autocast`, the positional
        arguments that hold the parameters, as ``jax.grad``'s ``argnums``;
        a matmul's operand computed from them (or from constants) alone is
        its weight. ``()``: none, the weights are closed over (then what
        the function closes over is a parameter, concrete or traced).
        By default (``None``) the first argument, or none where the
        function is a model holding its own weights (an equinox or NNX
        module: ``autocast(model)(x)``); a traced value the function
        closes over (the batch of ``loss_fn(params)`` inside a jitted
        step) is then data.
      exclude: under :func:`lossscale.autocast`, names and callables (or
        one of either) that keep a matmul in the 16-bit ``compute_dtype``,
        as torchao's ``module_filter_fn`` and torchtitan's ``filter_fqns``
        do. A name keeps out each matmul whose weight's path (as
        :attr:`lossscale.Matmul.weight` shows it, ``"head.kernel"``), named
        scope, or calling ``jax.jit``-ed function has the name's parts
        among its own, in a row (``"layers.1"`` names
        ``"layers.1.kernel"``, not ``"layers.10.kernel"``). A callable
        ``fn(matmul) -> bool`` is called at trace time with each matmul's
        :class:`lossscale.MatmulInfo` (its scopes, weight path, shapes,
        ``in_features`` and ``out_features``) and keeps it out where it
        returns ``True`` (the opposite of torchao's ``module_filter_fn``,
        whose ``True`` converts); its exceptions propagate. It may be
        called more than once for a matmul, so it should depend on its
        argument only. It must be hashable (a function is), and is part
        of the recipe's identity: a new ``lambda`` at each step is a new
        recipe, traced again. The entries are tried in order, and the
        first that keeps a matmul out is the reason
        :func:`lossscale.matmuls` gives. A name that matches no matmul,
        or a callable that returns ``True`` for none, warns.
      auto_filter: keep in ``compute_dtype`` the linear layers too small
        to gain from float8, by torchao's size thresholds
        (``_auto_filter_for_recipe``, measured on an H100; default
        ``False``): ``"tensorwise"`` and ``"rowwise"`` only.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> import lossscale
      >>> config = lossscale.Float8()
      >>> config.recipe, config.compute_dtype, config.power_of_two_scales
      ('tensorwise', dtype(bfloat16), False)
      >>> lossscale.Float8("rowwise", "float16").power_of_two_scales
      True
      >>> def loss(w, x):  # written in float32
      ...     return jnp.mean((x @ w) ** 2)
      >>> f8_loss = lossscale.autocast(loss, lossscale.Float8())
      >>> w, x = jnp.full((32, 16), 0.1), jnp.ones((64, 32))
      >>> jax.grad(f8_loss)(w, x).dtype  # the master weights' dtype
      dtype('float32')
      >>> [m.dtype for m in lossscale.matmuls(f8_loss, w, x)]
      ['float8_e4m3fn']

    References:
      Micikevicius et al., `FP8 Formats for Deep Learning
      <https://arxiv.org/abs/2209.05433>`_, 2022.

      torchao, `float8 training
      <https://github.com/pytorch/ao/tree/main/torchao/float8>`_.
    """

    recipe: str | Recipe = "tensorwise"
    compute_dtype: Any = jnp.bfloat16
    power_of_two_scales: bool | None = dataclasses.field(
        default=None, kw_only=True
    )
    batched: bool = dataclasses.field(default=False, kw_only=True)
    multiple: int = dataclasses.field(default=16, kw_only=True)
    params_argnums: int | tuple[int, ...] | None = dataclasses.field(
        default=None, kw_only=True
    )
    # A callable takes a ``lossscale.MatmulInfo`` (``_matmul``'s, a module
    # above this leaf one).
    exclude: (
        str | Callable[[Any], bool] | Sequence[str | Callable[[Any], bool]]
    ) = dataclasses.field(default=(), kw_only=True)
    auto_filter: bool = dataclasses.field(default=False, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe) and (
            not isinstance(self.recipe, str) or self.recipe not in RECIPES
        ):
            raise ValueError(
                f"recipe must be one of {tuple(RECIPES)} or a "
                f"lossscale.Float8Recipe, got recipe={self.recipe!r}."
            )
        if isinstance(self.recipe, Recipe):
            object.__setattr__(self, "recipe", _normalised(self.recipe))
        object.__setattr__(
            self, "compute_dtype", _check_compute_dtype(self.compute_dtype)
        )
        pow2 = self.power_of_two_scales
        if pow2 is None:
            pow2 = self.row.power_of_two_scales
        elif not isinstance(pow2, bool | np.bool_):
            raise TypeError(
                "power_of_two_scales must be a bool (or None for the "
                f"recipe's default), got power_of_two_scales={pow2!r}."
            )
        object.__setattr__(self, "power_of_two_scales", bool(pow2))
        if not isinstance(self.batched, bool | np.bool_):
            raise TypeError(
                f"batched must be a bool, got batched={self.batched!r}."
            )
        object.__setattr__(self, "batched", bool(self.batched))
        if (
            isinstance(self.multiple, bool)
            or not isinstance(self.multiple, int | np.integer)
            or self.multiple < 1
        ):
            raise ValueError(
                "multiple must be a positive int, got "
                f"multiple={self.multiple!r}."
            )
        object.__setattr__(self, "multiple", int(self.multiple))
        argnums = self.params_argnums
        many = () if argnums is None else argnums
        many = many if isinstance(many, tuple) else (many,)
        if not all(
            isinstance(a, int | np.integer)
            and not isinstance(a, bool)
            and a >= 0
            for a in many
        ):
            raise TypeError(
                "params_argnums must be a non-negative int or a tuple of "
                "them (() where no argument holds parameters: the weights "
                f"are closed over), got params_argnums={argnums!r}."
            )
        exclude = self.exclude
        if isinstance(exclude, str) or callable(exclude):
            exclude = (exclude,)
        try:
            exclude = tuple(exclude)
        except TypeError:
            exclude = (exclude,)
        # A callable is hashed with the recipe, a static jit argument.
        bad = [
            e
            for e in exclude
            if not (isinstance(e, str) and e)
            and not (callable(e) and type(e).__hash__ is not None)
        ]
        if bad:
            raise TypeError(
                "exclude must be a non-empty name (parts of a weight's path "
                "or scope), a hashable callable (fn(lossscale.MatmulInfo) -> "
                "bool, True to keep a matmul out of float8), or a sequence "
                f"of them, got {bad[0]!r} in exclude={self.exclude!r}."
            )
        object.__setattr__(self, "exclude", exclude)
        if not isinstance(self.auto_filter, bool | np.bool_):
            raise TypeError(
                "auto_filter must be a bool, got "
                f"auto_filter={self.auto_filter!r}."
            )
        object.__setattr__(self, "auto_filter", bool(self.auto_filter))
        if self.auto_filter and self.recipe not in _AUTO_FILTERED:
            raise ValueError(
                "auto_filter has sizes for the recipes torchao has them for, "
                f"{_AUTO_FILTERED}, got recipe={self.recipe!r} (torchao's "
                "_auto_filter_for_recipe refuses rowwise_with_gw_hp too)."
            )
        if argnums is not None:
            object.__setattr__(
                self,
                "params_argnums",
                tuple(int(a) for a in many)
                if isinstance(argnums, tuple)
                else int(argnums),
            )

    @property
    def row(self) -> Recipe:
        """The recipe's row: how each operand of each GEMM is cast."""
        if isinstance(self.recipe, Recipe):
            return self.recipe
        return RECIPES[self.recipe]

    def ineligible(
        self, lhs: Any, rhs: Any, dims: Any, weight: int | None = None
    ) -> str | None:
        """Why a matmul of these operand shapes and dimension numbers
        does not run in float8 by default (``None``: it does).

        ``weight``: the position of its weight operand (0: lhs, 1: rhs),
        as autocast finds it from the dataflow. A linear layer runs in
        float8 where its weight's output features (N) and input features
        (K) are multiples of ``multiple``, as torchao converts an
        ``nn.Linear`` from its weight's shape alone: the rows (M) are the
        batch, which XLA's GPU rewrite pads to a multiple of 16 itself
        (``PadOperandToMultipleOf16`` in
        ``xla/service/gpu/transforms/gemm_rewriter.cc``), so a per-example
        gradient of one row runs in float8 too.

        ``weight=None`` (an activation-by-activation matmul under
        ``batched``): a matmul with batch dimensions (attention's scores
        and their product with the values) stays in the 16-bit compute
        dtype unless ``batched``, as TransformerEngine keeps attention out
        of float8; one whose M, N or K are not multiples of ``multiple``
        too.
        """
        (lc, rc), (lb, rb) = dims
        k = math.prod(lhs[d] for d in lc)
        if weight is not None:
            shape, contract, batch = (
                (lhs, lc, lb) if weight == 0 else (rhs, rc, rb)
            )
            n = _size(shape, (*contract, *batch))
            if not all(_multiple(size, self.multiple) for size in (n, k)):
                return (
                    f"the weight's N={n}, K={k} not both multiples of "
                    f"{self.multiple}"
                )
            if self.auto_filter and _too_small(str(self.recipe), n, k):
                return (
                    f"auto_filter: N={n}, K={k} below torchao's sizes for "
                    f"{self.recipe} (slower than bfloat16 on an H100)"
                )
            return None
        if (lb or rb) and not self.batched:
            return "batch dimensions (attention)"
        m = _size(lhs, (*lc, *lb))
        n = _size(rhs, (*rc, *rb))
        if not all(_multiple(size, self.multiple) for size in (m, n, k)):
            return f"M={m}, N={n}, K={k} not all multiples of {self.multiple}"
        return None


_AUTO_FILTERED = ("tensorwise", "rowwise")


def _too_small(recipe: str, n: Any, k: Any) -> bool:
    """Whether a linear layer with N output and K input features is one
    torchao's auto filter leaves in bfloat16 for ``recipe``, where float8
    was slower on an H100 (torchao/float8/float8_linear_utils.py,
    ``_auto_filter_for_tensorwise`` and ``_auto_filter_for_rowwise``; their
    ``K, N = weight.shape`` names an ``nn.Linear``'s output features K and
    its input features N, so their thresholds are restated here)."""
    if not all(isinstance(d, (int, np.integer)) for d in (n, k)):
        return False  # symbolic: no threshold holds for every size
    if recipe == "tensorwise":
        return n <= 4096 and k <= 1024
    return k <= 2048 or n <= 1024 or (k <= 4096 and n <= 2048)


def _size(shape: Sequence[Any], removed: Sequence[int]) -> Any:
    """The product of ``shape``'s sizes but those at ``removed`` (symbolic
    under ``jax.export``'s shape polymorphism)."""
    gone = set(removed)
    return math.prod(n for d, n in enumerate(shape) if d not in gone)


def _multiple(size: Any, multiple: int) -> bool:
    """Whether ``size`` is a multiple of ``multiple``: for a symbolic size,
    whatever its dimensions' values (``32*b`` of 16, not ``b``)."""
    remainder = size % multiple
    return isinstance(remainder, (int, np.integer)) and remainder == 0


def _float8_dtype(dtype: Any) -> np.dtype | bool | None:
    """A float8 dtype as a NumPy dtype, ``None`` as it is, else False."""
    if dtype is None:
        return None
    try:
        result = np.dtype(dtype)
    except TypeError:
        return False
    return result if result in (E4M3, E5M2) else False


def _normalised(row: Recipe) -> Recipe:
    """``row`` with each cast's dtype a NumPy dtype (``jnp.float8_e4m3fn``
    is a scalar type), checked: float8 or None, and each GEMM's operands
    both float8 or both None."""
    casts: list[Cast] = []
    for name, one in zip(Recipe._fields, row[:6], strict=False):
        dtype = _float8_dtype(getattr(one, "dtype", ()))
        if not isinstance(one, Cast) or isinstance(dtype, bool):
            raise TypeError(
                f"Float8Recipe.{name} must be a Float8Cast of "
                f"float8_e4m3fn, float8_e5m2 or None, got {name}={one!r}."
            )
        casts.append(Cast(dtype, bool(one.rowwise)))
    row = Recipe(*casts[:6], power_of_two_scales=bool(row.power_of_two_scales))
    gemms = {
        "the forward GEMM": (row.input, row.weight),
        "the input gradient's GEMM": (
            row.grad_output,
            row.weight_for_grad_input,
        ),
        "the weight gradient's GEMM": (
            row.input_for_grad_weight,
            row.grad_output_for_grad_weight,
        ),
    }
    for gemm, (a, b) in gemms.items():
        if (a.dtype is None) != (b.dtype is None):
            raise ValueError(
                f"Float8Recipe: {gemm} has one float8 operand and one in "
                f"the compute dtype ({a!r}, {b!r}): both are float8, or "
                "both None."
            )
    if row.input.dtype is None:
        raise ValueError(
            "Float8Recipe: the forward GEMM's operands must be float8, got "
            f"input={row.input!r}."
        )
    return row


def _check_compute_dtype(dtype: Any) -> np.dtype:
    try:
        result = np.dtype(dtype)
    except TypeError:
        result = None
    if result is None or result not in (
        np.dtype(jnp.bfloat16),
        np.dtype(jnp.float16),
    ):
        raise TypeError(
            "compute_dtype must be jnp.bfloat16 or jnp.float16 (or their "
            f"names), got compute_dtype={dtype!r}."
        )
    return result


Axes = tuple[int, ...]
# ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))
Dims = tuple[tuple[Axes, Axes], tuple[Axes, Axes]]


def dot_general(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    dimension_numbers: Any,
    config: Float8,
    *,
    out_sharding: Any = None,
    weight: int = 1,
) -> jax.Array:
    """``lax.dot_general(lhs, rhs, dimension_numbers)`` in float8.

    Quantises both operands to ``float8_e4m3fn`` with current scaling
    (:class:`Float8` says how), runs one float8 ``dot_general`` with float32
    accumulation, and returns its result times the inverse scales, in
    ``config.compute_dtype``. Differentiable once, in reverse mode (a
    ``jax.custom_vjp``; a second derivative raises :data:`SECOND_ORDER`):
    the backward matmuls are float8 too, ``e5m2`` gradient by ``e4m3`` operand,
    with the dimension numbers and output shardings of JAX's own transpose
    rules for ``dot_general``.

    Args:
      lhs: a real floating-point array, of any float dtype.
      rhs: likewise.
      dimension_numbers: as ``lax.dot_general``'s,
        ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
      config: a :class:`Float8`.
      out_sharding: as ``lax.dot_general``'s (the equation's
        ``out_sharding`` param), for the forward matmul.
      weight: which operand is the layer's weight, 0 (lhs: equinox's
        ``weight @ x``) or 1 (rhs: ``x @ w``, flax's ``Dense``); only
        ``"rowwise_with_gw_hp"`` reads it, whose weight gradient is
        16-bit.

    Returns:
      The product, in ``config.compute_dtype``; its gradients with respect
      to ``lhs`` and ``rhs`` are in their dtypes.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from lossscale._autocast import _fp8
      >>> x, w = jnp.ones((4, 8)), jnp.full((8, 2), 0.5)
      >>> dims = (((1,), (0,)), ((), ()))  # x @ w
      >>> y = _fp8.dot_general(x, w, dims, _fp8.Float8())
      >>> y.dtype, float(y[0, 0])
      (dtype(bfloat16), 4.0)
      >>> def loss(x, w):
      ...     y = _fp8.dot_general(x, w, dims, _fp8.Float8())
      ...     return jnp.sum(y.astype(jnp.float32))
      >>> dx, dw = jax.grad(loss, (0, 1))(x, w)
      >>> dx.dtype, round(float(dx[0, 0]), 4), round(float(dw[0, 0]), 4)
      (dtype('float32'), 1.0, 4.0)
    """
    if not isinstance(config, Float8):
        raise TypeError(
            f"config must be a lossscale Float8, got config={config!r}."
        )
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"{name} must be a real floating-point array, got {name} of "
                f"dtype {x.dtype}."
            )
    if weight not in (0, 1) or isinstance(weight, bool):
        raise ValueError(f"weight must be 0 or 1, got weight={weight!r}.")
    dims = _canonical(dimension_numbers)
    # Under shard_map, a replicated weight meeting a sharded activation is
    # made varying first, as lax.dot_general would (its cotangent is then
    # the psum of the per-device ones).
    varying = _compat.vma(lhs) | _compat.vma(rhs)
    dtypes = (np.dtype(lhs.dtype), np.dtype(rhs.dtype))
    lhs, rhs = _compat.vary_over(lhs, varying), _compat.vary_over(rhs, varying)
    if weight == 1 or config.row.symmetric:
        return _fp8_dot(lhs, rhs, dims, config, out_sharding, dtypes)
    # The rules below take the rhs for the weight: it is put there, and
    # the product's axes (batch, weight free, input free) back in lhs's
    # order.
    (lc, rc), (lb, rb) = dims
    nb = len(lb)
    w_free = np.ndim(lhs) - len(lc) - nb
    x_free = np.ndim(rhs) - len(rc) - nb
    back = (
        *range(nb),
        *range(nb + x_free, nb + x_free + w_free),
        *range(nb, nb + x_free),
    )
    order = tuple(int(a) for a in np.argsort(back))
    sharding = _compat.permuted_sharding(out_sharding, order)
    swapped: Dims = ((rc, lc), (rb, lb))
    out = _fp8_dot(rhs, lhs, swapped, config, sharding, dtypes[::-1])
    return lax.transpose(cast(jax.Array, out), back)


def _canonical(dimension_numbers: Any) -> Dims:
    (lc, rc), (lb, rb) = dimension_numbers
    return (
        (tuple(int(d) for d in lc), tuple(int(d) for d in rc)),
        (tuple(int(d) for d in lb), tuple(int(d) for d in rb)),
    )


# --- scales -----------------------------------------------------------------


def round_down_to_power_of_two(scale: jax.Array) -> jax.Array:
    """Each float32 of ``scale`` rounded down to a power of two, exactly.

    torchao computes ``exp2(floor(log2(scale)))``; JAX's ``log2`` is
    ``log(x) / log(2)``, which is off at most powers of two (the floor then
    halves the scale). Clearing the mantissa bits of a positive normal
    float is exact; 0 and inf are kept, and NaN is kept NaN (clearing a
    NaN's mantissa would make it inf).
    """
    bits = lax.bitcast_convert_type(scale, np.uint32)
    mask = np.uint32(0xFF800000)
    rounded = lax.bitcast_convert_type(lax.bitwise_and(bits, mask), F32)
    return lax.select(lax.ne(scale, scale), scale, rounded)  # NaN kept


def _scale(
    x: jax.Array, dtype: np.dtype, axes: Sequence[int] | None, pow2: bool
) -> jax.Array:
    """float32 scale(s) of ``x`` for ``dtype``: one (a scalar) if ``axes``
    is ``None``, else one per position of the other axes (``keepdims``)."""
    # lax, not jnp: each jnp function is a jit call of its own to trace,
    # and a float8 step quantises a few hundred times (its trace took
    # 1.3x to 1.8x bfloat16's). ``x`` is float32 (_quantize).
    reduced = tuple(range(x.ndim)) if axes is None else tuple(axes)
    # The max with 0: an operand of size 0 has an amax too (then its scale
    # is finite, and its product zeros), as an empty sum is 0; a NaN stays.
    amax = lax.max(lax.reduce_max(lax.abs(x), reduced), np.float32(0))
    if axes is not None:
        amax = lax.expand_dims(amax, reduced)
    # lax.min and lax.max keep a NaN (a NaN amax), and an inf amax gives 0.
    scale = lax.div(np.float32(_MAX[dtype]), lax.max(amax, np.float32(EPS)))
    scale = lax.min(scale, np.float32(MAX_SCALE))
    return round_down_to_power_of_two(scale) if pow2 else scale


def _as_float32(x: jax.Array) -> jax.Array:
    """``x``'s values in float32, a 16-bit ``x``'s rounding kept.

    ``x.astype(float32)`` of a 16-bit value that XLA computed in float32
    (its default ``xla_allow_excess_precision`` removes the
    float32 -> 16-bit -> float32 pair) would quantise the unrounded value:
    jitted and eager float8 gradients then differed by 5-12% of their
    largest element on a 4-layer tanh net (an output gradient's rounding
    to bfloat16 lost just before ``e5m2``, whose steps are a quarter of a
    value, turns into whole-quantum flips). ``reduce_precision`` says the
    rounding in a form XLA keeps, and costs one elementwise operation in
    the quantisation's fusion."""
    wide = lax.convert_element_type(x, F32)
    if np.dtype(x.dtype).itemsize != 2:  # float8 and float32 convert
        return wide  # exactly; float64 rounds, as its matmul would
    info = jnp.finfo(x.dtype)
    return lax.reduce_precision(
        wide, exponent_bits=info.nexp, mantissa_bits=info.nmant
    )


@functools.partial(_compat.inline_jit, static_argnums=(1, 2, 3))
def _quantize(
    x: jax.Array, dtype: np.dtype, axes: tuple[int, ...] | None, pow2: bool
) -> tuple[jax.Array, jax.Array]:
    # An inline jit: the layers of a model quantise operands of a few
    # shapes, each traced once and inlined at every other call (a
    # dozen-odd operations a quantisation, bound once each otherwise).
    x = _as_float32(x)
    scale = _scale(x, dtype, axes, pow2)
    return lax.convert_element_type(lax.mul(x, scale), dtype), scale


def _inverse_in_output(
    scale: jax.Array, contract: Sequence[int], batch: Sequence[int],
    ndim: int, other_free: int, lhs_side: bool,
) -> jax.Array:  # fmt: skip
    """``1 / scale`` laid out for a ``dot_general`` output, whose axes are
    (batch, lhs free, rhs free): the operand's batch axes in the order the
    dimension numbers give, its free axes in order, and size-1 axes for the
    other operand's free axes."""
    inverse = lax.div(np.float32(1), scale)
    if inverse.ndim == 0:
        return inverse
    free = [d for d in range(ndim) if d not in contract and d not in batch]
    inverse = lax.squeeze(inverse, tuple(contract))
    kept = sorted([*batch, *free])
    inverse = lax.transpose(
        inverse, tuple(kept.index(d) for d in [*batch, *free])
    )
    start = len(batch) + len(free) if lhs_side else len(batch)
    return lax.expand_dims(inverse, tuple(range(start, start + other_free)))


@functools.partial(_compat.inline_jit, static_argnums=(4, 5))
def _scaled_dot(
    qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array,
    dims: Dims, out_sharding: Any,
) -> jax.Array:  # fmt: skip
    """``dot(qa, qb) / (sa * sb)`` in float32: one float8 matmul, then its
    output times the inverse scales (first ``qa``'s, then ``qb``'s)."""
    (ac, bc), (ab, bb) = dims
    out = lax.dot_general(
        qa,
        qb,
        dims,
        preferred_element_type=F32,
        out_sharding=out_sharding,
    )
    a_free = qa.ndim - len(ac) - len(ab)
    b_free = qb.ndim - len(bc) - len(bb)
    inv_a = _inverse_in_output(sa, ac, ab, qa.ndim, b_free, True)
    inv_b = _inverse_in_output(sb, bc, bb, qb.ndim, a_free, False)
    # Row-wise scales are sharded as their operands: they must not reshard
    # the product (explicit mesh axes) away from its out_sharding.
    out = out * _compat.sharded_for(inv_a, out)
    return out * _compat.sharded_for(inv_b, out)


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _product(
    qa: jax.Array, sa: jax.Array, qb: jax.Array, sb: jax.Array,
    dims: Dims, out_sharding: Any, dtype: np.dtype,
) -> jax.Array:  # fmt: skip
    """The forward product in ``dtype``: :func:`_scaled_dot`, then the
    cast. Traced (``_product.trace``), never called: a jit traces once per
    signature."""
    return _scaled_dot(qa, sa, qb, sb, dims, out_sharding).astype(dtype)


# --- the matmul and its derivative -----------------------------------------


def _cast(
    x: jax.Array, cast: Cast, axes: Sequence[int], config: Float8
) -> tuple[jax.Array, jax.Array | None]:
    """``x`` cast for a GEMM that contracts its ``axes``: quantised, with
    its scale(s), or in the compute dtype (scale ``None``)."""
    if cast.dtype is None:
        return x.astype(config.compute_dtype), None
    rows = tuple(axes) if cast.rowwise else None
    return _quantize(x, cast.dtype, rows, bool(config.power_of_two_scales))


def _forward(
    lhs: jax.Array, rhs: jax.Array, dims: Dims, config: Float8,
    out_sharding: Any,
) -> tuple[jax.Array, tuple[Any, Any]]:  # fmt: skip
    """The product, and what the backward pass keeps of each operand: its
    float8 copy and scale where its backward cast is its forward one per
    tensor, else the operand itself."""
    row = config.row
    (lc, rc), _ = dims
    # float8 both (_check_recipe): each has its scale(s).
    q_lhs, s_lhs = _cast(lhs, row.input, lc, config)
    q_rhs, s_rhs = _cast(rhs, row.weight, rc, config)
    s_lhs, s_rhs = cast(jax.Array, s_lhs), cast(jax.Array, s_rhs)
    # One equation, for jax.checkpoint's policies (_compat.bind_as_dot):
    # a dots-saveable policy saves its compute-dtype result, not the
    # float32 accumulator inside.
    args = (q_lhs, s_lhs, q_rhs, s_rhs)
    jaxpr = _product.trace(
        *args, dims, out_sharding, np.dtype(config.compute_dtype)
    ).jaxpr
    out = _compat.bind_as_dot(jaxpr, args)
    keep_lhs = _reused(row.input, row.input_for_grad_weight)
    keep_rhs = _reused(row.weight, row.weight_for_grad_input)
    return out, (
        (q_lhs, s_lhs) if keep_lhs else lhs,
        (q_rhs, s_rhs) if keep_rhs else rhs,
    )


def _reused(forward: Cast, backward: Cast) -> bool:
    """Whether the backward GEMM can take the forward's quantised operand:
    the same cast, per tensor (a row-wise one scales along the axes of
    another contraction)."""
    return forward == backward and not forward.rowwise


SECOND_ORDER = (
    "lossscale.autocast with a Float8 recipe: a float8 matmul is "
    "differentiated once, in reverse mode (jax.grad, jax.vjp, jax.jacrev). "
    "A derivative of its gradient (jax.hessian, jax.grad or jax.jacrev of a "
    "gradient, jax.jvp of one) would differentiate its quantisation to "
    "float8, where the tangents underflow to zero or overflow: not "
    "supported. Keep the matmuls 16-bit where you need it: "
    "lossscale.autocast(fun, lossscale.Float8(...), "
    "rules={'dot_general': 'compute'}), or a 16-bit compute_dtype."
)


@jax.custom_jvp
def _differentiated_once(xs: Any) -> Any:
    """``xs`` itself; differentiating it raises :data:`SECOND_ORDER`.

    Around what the float8 matmul's derivative rules read (the operands
    in the forward rule, the cotangent in the backward): a first
    derivative never differentiates those rules, a second one would, and
    its tangents would go through the casts to float8 unscaled (a
    Hessian of NaNs and zeros, measured)."""
    return xs


@_differentiated_once.defjvp
def _differentiated_once_jvp(primals: Any, tangents: Any) -> Any:
    del primals, tangents
    raise TypeError(SECOND_ORDER)


# The static arguments: the dimension numbers, the config, the forward's
# out_sharding, and the operands' dtypes (the float8 residuals lose them).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_dot(
    lhs: jax.Array, rhs: jax.Array, dims: Dims, config: Float8,
    out_sharding: Any, dtypes: tuple[np.dtype, np.dtype],
) -> jax.Array:  # fmt: skip
    del dtypes
    return _forward(lhs, rhs, dims, config, out_sharding)[0]


def _fp8_dot_fwd(
    lhs: jax.Array, rhs: jax.Array, dims: Dims, config: Float8,
    out_sharding: Any, dtypes: tuple[np.dtype, np.dtype],
) -> tuple[jax.Array, tuple[Any, Any]]:  # fmt: skip
    del dtypes
    lhs, rhs = _differentiated_once((lhs, rhs))
    return _forward(lhs, rhs, dims, config, out_sharding)


def _transpose(
    dims: Dims, x_ndim: int, y_ndim: int, swap_ans: bool
) -> tuple[Dims, list[int], tuple[int, ...]]:
    """JAX's ``_dot_general_transpose_lhs`` (jax/_src/lax/lax.py): the
    dimension numbers of ``dot_general(g, y)`` giving x's cotangent, the
    order of x's axes in its output, and the permutation back to x's."""
    (x_contract, y_contract), (x_batch, y_batch) = dims
    x_kept = _remaining(x_ndim, x_contract, x_batch)
    y_kept = _remaining(y_ndim, y_contract, y_batch)
    nb = len(x_batch)
    ans_batch = tuple(range(nb))
    if swap_ans:
        ans_y = tuple(range(nb, nb + len(y_kept)))
    else:
        start = nb + len(x_kept)
        ans_y = tuple(range(start, start + len(y_kept)))
    new_dims = ((ans_y, tuple(y_kept)), (ans_batch, tuple(y_batch)))
    by_y = [int(d) for d in np.take(x_contract, np.argsort(y_contract))]
    unsorted = [*x_batch, *x_kept, *by_y]
    return new_dims, unsorted, tuple(int(d) for d in np.argsort(unsorted))


def _remaining(ndim: int, *removed: Sequence[int]) -> list[int]:
    gone = {d for axes in removed for d in axes}
    return [d for d in range(ndim) if d not in gone]


def _cotangent(
    g: jax.Array, gs: jax.Array, qy: jax.Array, ys: jax.Array, x_ref: Any,
    x_dtype: Any, dims: Dims, swap_ans: bool,
) -> jax.Array:  # fmt: skip
    """x's cotangent from float8 ``g`` and ``y`` (scales ``gs``, ``ys``), as
    JAX's transpose rule computes it; ``x_ref`` has x's shape and sharding
    (x itself, or its float8 copy)."""
    new_dims, unsorted, out_axes = _transpose(
        dims, x_ref.ndim, qy.ndim, swap_ans
    )
    sharding = _compat.transpose_out_sharding(x_ref, unsorted)
    out = _scaled_dot(g, gs, qy, ys, new_dims, sharding)
    return lax.transpose(out, out_axes).astype(x_dtype)


def _fp8_dot_bwd(
    dims: Dims, config: Float8, out_sharding: Any,
    dtypes: tuple[np.dtype, np.dtype], saved: Any, g: jax.Array,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    del out_sharding  # the cotangents take their operands' shardings
    g = _differentiated_once(g)
    row = config.row
    lhs_dtype, rhs_dtype = dtypes
    kept_lhs, kept_rhs = saved
    (lc, rc), (lb, rb) = dims
    swapped: Dims = ((rc, lc), (rb, lb))
    ndims = tuple(_ndim(k) for k in (kept_lhs, kept_rhs))
    # lhs's (the input's) cotangent: dot(g, rhs), contracting g's
    # rhs-free axes and rhs's free ones.
    l_dims, _, _ = _transpose(dims, ndims[0], ndims[1], False)
    (g_axes, r_axes), _ = l_dims
    dlhs = _gemm(
        (g, row.grad_output, g_axes),
        (kept_rhs, row.weight_for_grad_input, r_axes),
        (kept_lhs, lhs_dtype, dims, False),
        config,
    )
    # rhs's (the weight's) cotangent: dot(g, lhs).
    r_dims, _, _ = _transpose(swapped, ndims[1], ndims[0], True)
    (g_axes, l_axes), _ = r_dims
    drhs = _gemm(
        (g, row.grad_output_for_grad_weight, g_axes),
        (kept_lhs, row.input_for_grad_weight, l_axes),
        (kept_rhs, rhs_dtype, swapped, True),
        config,
    )
    return dlhs, drhs


def _ndim(kept: Any) -> int:
    return kept[0].ndim if isinstance(kept, tuple) else kept.ndim


def _gemm(
    g_side: tuple[jax.Array, Cast, Sequence[int]],
    y_side: tuple[Any, Cast, Sequence[int]],
    x_side: tuple[Any, Any, Dims, bool],
    config: Float8,
) -> jax.Array:
    """x's cotangent, ``dot(g, y)`` as JAX's transpose rule computes it,
    each operand cast as the recipe says (``y`` may be kept quantised
    from the forward pass); ``x_side``: what x was kept as, x's dtype,
    the dimension numbers with x first, and whether x is the rhs."""
    g, g_cast, g_axes = g_side
    y, y_cast, y_axes = y_side
    x_kept, x_dtype, dims, swap_ans = x_side
    x_ref = x_kept[0] if isinstance(x_kept, tuple) else x_kept
    if g_cast.dtype is None:  # and y_cast's (_check_recipe)
        return _high_precision_cotangent(
            g, y, x_ref, x_dtype, dims, swap_ans, config
        )
    # y was kept quantised by the forward pass, or is quantised here.
    qy, ys = y if isinstance(y, tuple) else _cast(y, y_cast, y_axes, config)
    q_g, s_g = _cast(g, g_cast, g_axes, config)
    return _cotangent(
        q_g, cast(jax.Array, s_g), qy, cast(jax.Array, ys), x_ref, x_dtype,
        dims, swap_ans,
    )  # fmt: skip


def _high_precision_cotangent(
    g: jax.Array, y: jax.Array, x_ref: jax.Array, x_dtype: Any, dims: Dims,
    swap_ans: bool, config: Float8,
) -> jax.Array:  # fmt: skip
    """x's cotangent ``dot(g, y)`` from ``config.compute_dtype`` operands,
    accumulated in float32 and rounded to the compute dtype once, as a
    GPU's 16-bit GEMM does on every backend (with a bfloat16 result type,
    XLA:CPU on jax 0.12 strayed past that rounding on the tests' shapes).

    On CPU the 16-bit operands are multiplied as float32 (their products
    are exact in float32, so the result is the same): XLA:CPU runs some
    16-bit dots with a float32 result outside its fast kernels, whose
    ``DotThunk`` refuses them (``Unsupported element type for
    DotThunk::Execute: BF16 x BF16 = F32``, jax 0.10.2, on the weight
    gradient of ``einsum("mhd,hdn->mn")``, a flax ``DenseGeneral``)."""
    new_dims, unsorted, out_axes = _transpose(
        dims, x_ref.ndim, y.ndim, swap_ans
    )
    dtype = config.compute_dtype
    sharding = _compat.transpose_out_sharding(x_ref, unsorted)

    def dot(wide: bool) -> jax.Array:
        a, b = g.astype(dtype), y.astype(dtype)
        if wide:
            a, b = _as_float32(a), _as_float32(b)
        return lax.dot_general(
            a,
            b,
            new_dims,
            precision=lax.Precision.HIGHEST if wide else None,
            preferred_element_type=F32,
            out_sharding=sharding,
        )

    out = lax.platform_dependent(
        cpu=lambda: dot(True), default=lambda: dot(False)
    )
    return lax.transpose(out.astype(dtype), out_axes).astype(x_dtype)


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)
