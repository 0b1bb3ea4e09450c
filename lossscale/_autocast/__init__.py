"""Automatic mixed precision for any JAX function: :func:`autocast`.

``autocast(fun, jnp.float16)`` traces ``fun`` to a jaxpr at the dtypes it
is called with (float32 master weights, float32 data), then makes two
passes over that jaxpr:

1. :mod:`._infer` gives every value a precision class (:mod:`._classes`)
   from the rules, without binding anything: forwards by PyTorch's type
   promotion, backwards so that what only float32 reads is float32. Loops
   iterate there, and a jaxpr's plans are kept as long as the jaxpr lives
   (:class:`._config.JaxprCache`), like JAX's own traces.
2. :mod:`._emit` binds every equation once, at the dtypes planned, under
   the caller's trace, with :func:`lossscale._interpret.run` (the core the
   copy-free skip shares), so ``jax.grad`` of an autocast function
   differentiates the casts too: the backward pass of a float16 matmul is
   float16 matmuls, and the gradient of a float32 parameter, through the
   cast that made it float16, is float32. Runs of elementwise float32
   work on 16-bit activations are recomputed in the backward pass, not
   stored (:mod:`._islands`).

Where things are, from the ground up (each module imports only modules
listed before it; ``tests/test_autocast_table.py`` checks it):

1. :mod:`._classes`: the precision classes; :mod:`._rules`: **the rule
   table, one record per primitive: adding a rule for a new primitive is
   one line there**; :mod:`._recipes`: **the float8 recipes, one row
   each: a new recipe is one row there**.
2. :mod:`._cast`: casting values to their classes; :mod:`._config`: the
   configuration and the caches; :mod:`._float8`: the :class:`Float8`
   configuration (eligibility, filters); :mod:`._fold`: constant folding
   of small known values at trace time.
3. :mod:`._scaling`: current scaling (a tensor's float8 scale, its
   quantisation, a weight quantised before it is gathered);
   :mod:`._fp8`: the float8 matmul kernel; :mod:`._islands`: float32
   islands; :mod:`._weights`: which operand of a matmul is its weight,
   from the dataflow (float8 recipes).
4. :mod:`._plan`: what a plan is made of (modes, nodes, an equation's
   and a jaxpr's facts); :mod:`._matmul`: what autocast does with a
   matmul, in one place (its rules, float8 eligibility and reasons,
   layers kept out, the float8 emission).
5. :mod:`._equation`: the first pass's rule for one equation, with the
   pass's tables (:data:`._equation.KINDS`, one rule per kind, and
   :data:`._equation.HIGHER`, which higher-order handlers register into).
   :mod:`._infer`: the first pass over a jaxpr (the fixed point of its
   equations' rules, its float32 islands).
6. :mod:`._emit`: the second pass, with its table (:data:`._emit.HIGHER`).
7. :mod:`._higher`: what every handler of a higher-order primitive is
   made of, and the handlers of calls (``jit``, ``checkpoint``,
   ``custom_jvp_call``, ``shard_map``).
8. :mod:`._control`: the handlers of control flow (``scan``, ``while``,
   ``cond``).
9. :mod:`._handlers`: the table of higher-order primitives, registered
   into both passes' tables: **a handler for a new higher-order
   primitive is one row there** (with its known params in
   :data:`lossscale._compat.HIGHER_ORDER_PARAMS`).
10. :mod:`._run`: one call (trace, plan, emit, write NNX state back).
11. :mod:`._eager`: the wrapper, comparable, and its eager compilation.
12. :mod:`._api`: :func:`autocast`, :func:`float32_scope` and
   :func:`compute_scope`;
   :mod:`._report`: :func:`matmuls`, which lists each matmul's dtype.

Every JAX internal they read is in :mod:`lossscale._compat`.
"""

from lossscale._autocast._api import (
    autocast,
    check_compute_dtype,
    compute_scope,
    float32_scope,
)
from lossscale._autocast._float8 import Float8
from lossscale._autocast._matmul import MatmulInfo
from lossscale._autocast._recipes import Cast as Float8Cast
from lossscale._autocast._recipes import Recipe as Float8Recipe
from lossscale._autocast._report import Matmul, matmuls
from lossscale._autocast._rules import FUNCTION_RULES, PRIMITIVE_RULES

__all__ = [
    "FUNCTION_RULES",
    "PRIMITIVE_RULES",
    "Float8",
    "Float8Cast",
    "Float8Recipe",
    "Matmul",
    "MatmulInfo",
    "autocast",
    "check_compute_dtype",
    "compute_scope",
    "float32_scope",
    "matmuls",
]
