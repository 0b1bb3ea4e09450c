"""Constant folding for the inference pass: an equation whose operands
are known small constants (a ``jnp.full``, a scalar's arithmetic) is
computed at trace time, since its value, not its dtype, decides its
class (:func:`._classes.of_value`).

Each equation is folded once while its jaxpr lives (the cache is the
jaxpr's facts', :attr:`._plan.JaxprFacts.folded`), by NumPy where it can
(:data:`FOLDS`), else by binding it at compile time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from lossscale import _compat
from lossscale._autocast._classes import Info

# Constants larger than this are not computed at trace time.
FOLD_SIZE = 4096


def _broadcast_in_dim(x: Any, shape: Any, broadcast_dimensions: Any, **_: Any):
    expanded = np.reshape(
        x,
        [
            np.shape(x)[broadcast_dimensions.index(d)]
            if d in broadcast_dimensions
            else 1
            for d in range(len(shape))
        ],
    )
    return np.broadcast_to(expanded, shape)


def _numpy_folds() -> dict[Any, Callable[..., Any]]:
    """NumPy for the equations most often folded (a ``jnp.full``, a
    scalar constant's arithmetic), by primitive: folding by binding runs
    an XLA computation, which compiles once per shape (tens of ms), to
    compute a value that only decides a class."""
    unary = {
        "neg": np.negative,
        "abs": np.abs,
        "sqrt": np.sqrt,
        "exp": np.exp,
        "log": np.log,
        "tanh": np.tanh,
        "sign": np.sign,
    }
    binary = {
        "add": np.add,
        "sub": np.subtract,
        "mul": np.multiply,
        "div": np.divide,
        "max": np.maximum,
        "min": np.minimum,
    }
    table: dict[str, Callable[..., Any]] = {
        "broadcast_in_dim": lambda x, **p: _broadcast_in_dim(x, **p),
        "reshape": lambda x, new_sizes, **_: np.reshape(x, new_sizes),
        "squeeze": lambda x, dimensions, **_: np.squeeze(x, tuple(dimensions)),
        "transpose": lambda x, permutation, **_: np.transpose(x, permutation),
        "integer_pow": lambda x, y, **_: np.power(x, y),
        "square": lambda x, **_: np.square(x),
        "rsqrt": lambda x, **_: 1 / np.sqrt(x),
    }
    for name, f in unary.items():
        table[name] = lambda x, f=f, **_: f(x)
    for name, f in binary.items():
        table[name] = lambda x, y, f=f, **_: f(x, y)
    return {
        primitive: table[name]
        for name, primitive in _compat.primitives_named(table).items()
    }


FOLDS = _numpy_folds()


def _foldable_size(shape: Any) -> bool:
    """Whether a value of ``shape`` is small enough to fold: at most
    ``FOLD_SIZE`` elements, and of static size (a symbolic dimension of
    ``jax.export`` is not folded)."""
    if not all(isinstance(d, (int, np.integer)) for d in shape):
        return False
    return math.prod(shape) <= FOLD_SIZE


def fold(
    folded: dict[Any, tuple[tuple[int, ...], Any, Any]],
    eqn: Any,
    infos: Sequence[Info],
    compute: Callable[[list[Any]], list[Any]] | None = None,
) -> Any:
    """The equation's results computed now (by binding it, or by
    ``compute`` of its operands' values), if its operands are known and
    its results small (checked before anything is computed); once while
    its jaxpr lives (``folded``: its jaxpr's), so that each round of the
    fixed point, and each plan of the jaxpr, sees the same values."""
    if any(i.value is None for i in infos):
        return None
    key = tuple(id(i.value) for i in infos)
    hit = folded.get(eqn)
    if hit is not None and hit[0] == key:
        return hit[1]
    values = None
    operands = [i.value for i in infos]
    numpy = FOLDS.get(eqn.primitive)
    if all(_foldable_size(v.aval.shape) for v in eqn.outvars):
        try:
            if compute is not None:
                values = compute(operands)
            elif numpy is not None:
                with np.errstate(all="ignore"):
                    out = numpy(*map(np.asarray, operands), **eqn.params)
                dtype = eqn.outvars[0].aval.dtype
                values = [np.asarray(out).astype(dtype)]
            else:
                with jax.ensure_compile_time_eval():
                    outs = _compat.bind_equation(eqn, operands)
                values = [np.asarray(o) for o in outs]
        except Exception:  # folding is only an optimisation
            values = None
    folded[eqn] = (key, values, operands)
    return values
