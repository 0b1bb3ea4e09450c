"""The :class:`Float8` configuration: which recipe, which matmuls run in
float8 (eligibility, filters), and how its scales are rounded.

The kernel that runs one float8 matmul is :mod:`._fp8`; the recipes it
reads are rows of :mod:`._recipes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ._recipes import RECIPES, Recipe, _normalised

__all__ = ["Float8"]


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
