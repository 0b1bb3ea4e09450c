"""Automatic mixed precision for any JAX function: :func:`autocast`.

``autocast(fun, jnp.float16)`` traces ``fun`` to a jaxpr at the dtypes it
is called with (float32 master weights, float32 data), then makes two
passes over that jaxpr:

1. :mod:`._infer` gives every value a precision class (:mod:`._classes`)
   from the rules (:mod:`._rules`), without binding anything: forwards by
   PyTorch's type promotion, backwards so that what only float32 reads is
   float32. Loops iterate there, and plans are memoised per jaxpr and
   input classes for the length of one trace (emptied when the call
   ends, so that nothing of an earlier trace is kept alive).
2. :mod:`._emit` binds every equation once, at the dtypes planned, under
   the caller's trace, with :func:`lossscale._interpret.run` (the core the
   copy-free skip shares), so ``jax.grad`` of an autocast function
   differentiates the casts too: the backward pass of a float16 matmul is
   float16 matmuls, and the gradient of a float32 parameter, through the
   cast that made it float16, is float32.

Higher-order primitives (``jit``, ``scan``, ``while``, ``cond``,
``checkpoint``, ``custom_jvp_call``, ``shard_map``) have one handler each,
in one table (:data:`._higher.HANDLERS`). **A rule for a new primitive is
one line in** :mod:`._rules`; a handler for a new higher-order primitive
is one entry in :data:`._higher.HANDLERS`. Every JAX internal they read is
in :mod:`lossscale._compat`.
"""

from lossscale._autocast._api import (
    autocast,
    check_compute_dtype,
    float32_scope,
)
from lossscale._autocast._rules import FUNCTION_RULES, PRIMITIVE_RULES

__all__ = [
    "FUNCTION_RULES",
    "PRIMITIVE_RULES",
    "autocast",
    "check_compute_dtype",
    "float32_scope",
]
