"""The function :func:`lossscale.autocast` returns, and its eager calls.

:class:`Autocast` wraps a function and a configuration. Two wrappers of
the same function and configuration compare and hash equal, and
``autocast(f)`` returns the same wrapper each time while ``f`` lives (for
plain functions and ``functools.partial``), so that JAX's caches, keyed on
the function, hit: ``jax.jit(autocast(loss))`` written inline compiles
once, as ``jax.jit(loss)`` does.

Under a trace (``jit``, ``grad``, ``vmap``) a call evaluates the function
by :func:`._run.call`. Called eagerly, it is compiled once per argument
structure and non-array values, as a ``jax.jit`` of it would be: arrays
are traced, and every other leaf (a Python number, a string, a flag) is
static, as in equinox's ``filter_jit``, keyed by its value (a float by
its bits: ``0.0`` and ``-0.0`` differ, ``nan`` is one value). A new value
compiles again; the 64 most recently used compilations are kept, and a
warning says so, once, when one structure has been compiled for
:data:`RECOMPILES_WARNED` different values. NNX state among the arguments
(written back after the call) traces every call. The bookkeeping is
thread-safe.
"""

from __future__ import annotations

import collections
import functools
import struct
import threading
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from lossscale import _compat, _interop
from lossscale._autocast import _run
from lossscale._autocast._config import Config

# Eager calls compiled per static arguments: the least recently used are
# dropped past this many.
COMPILED_LIMIT = 64
# A warning, once per function, when one argument structure has been
# compiled for this many different static values.
RECOMPILES_WARNED = 5

_ATTRIBUTE = "__lossscale_autocast__"
_INTERN_LOCK = threading.Lock()


def wrap(fun: Callable[..., Any], config: Config, out_dtype: Any) -> Autocast:
    """``fun`` under autocast: the wrapper made before for the same
    function and configuration, if it lives, else a new one."""
    key = (config, out_dtype)
    table = _table_of(fun)
    with _INTERN_LOCK:
        cache = table.get(_ATTRIBUTE) if table is not None else None
        hit = cache.get(key) if isinstance(cache, _Interned) else None
        if hit is not None and hit.__wrapped__ is fun:
            return hit
        wrapper = Autocast(fun, config, out_dtype)
        if table is not None:
            if not isinstance(cache, _Interned) or any(
                w.__wrapped__ is not fun for w in cache.values()
            ):
                # None yet, or one copied from another function by
                # functools.wraps.
                cache = table[_ATTRIBUTE] = _Interned()
            cache[key] = wrapper
        return wrapper


def _table_of(fun: Any) -> dict[str, Any] | None:
    """Where the wrappers of ``fun`` are kept, so that they live exactly as
    long as it does (a reference cycle, which the collector clears): its
    ``__dict__``, for a function, a ``functools.partial``, a ``jax.jit``-ed
    function or a callable object; ``None`` for a bound method (a new
    object each time) and a pytree (a flax NNX or equinox module, whose
    attributes are its structure)."""
    if isinstance(fun, types.MethodType | types.BuiltinFunctionType | type):
        return None
    table = getattr(fun, "__dict__", None)
    if not isinstance(table, dict):
        return None
    if isinstance(fun, types.FunctionType | functools.partial):
        return table
    if not jax.tree_util.treedef_is_leaf(jax.tree.structure(fun)):
        return None
    return table


class _Interned(dict):
    """A function's wrappers, by configuration: not copied or serialised with
    the function (a wrapper holds locks and compiled programs)."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _Interned, ()

    def __copy__(self) -> _Interned:
        return _Interned()

    def __deepcopy__(self, memo: Any) -> _Interned:
        return _Interned()


class Autocast:
    """A function under :func:`lossscale.autocast`: call it as the
    function itself."""

    def __init__(
        self, fun: Callable[..., Any], config: Config, out_dtype: Any
    ) -> None:
        functools.update_wrapper(self, fun, updated=())
        self.__wrapped__ = fun
        self._config = config
        self._out_dtype = out_dtype
        self._lock = threading.RLock()
        self._compiled: collections.OrderedDict[Any, Any] = (
            collections.OrderedDict()
        )
        self._compiles: collections.Counter[Any] = collections.Counter()
        self._recompiles_warned = False
        self._used: set[tuple[str, Any]] = set()
        self._warned: set[tuple[str, Any]] = set()

    # Equal to another wrapper of the same function and configuration,
    # as jax.tree_util.Partial is: JAX's caches are keyed on functions.
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Autocast):
            return NotImplemented
        return (
            self.__wrapped__ == other.__wrapped__
            and self._config == other._config
            and self._out_dtype == other._out_dtype
        )

    def __hash__(self) -> int:
        return hash((self.__wrapped__, self._config, self._out_dtype))

    def __repr__(self) -> str:
        return f"lossscale.autocast({self.__wrapped__!r}, {self._config!r})"

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        # A method: bound as the function it wraps would be.
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _compat.tracing():
            return self._uncompiled(*args, **kwargs)
        split = _split_static((args, kwargs))
        if split is None:
            return self._uncompiled(*args, **kwargs)
        key, arrays = split
        run = self._compiled_for(key, arrays)
        if run is None:
            # It closes over device arrays (a model's weights): a program
            # compiled once would keep the values of its first call.
            return self._uncompiled(*args, **kwargs)
        return run(*arrays)

    def _uncompiled(self, *args: Any, **kwargs: Any) -> Any:
        return self._result(args, kwargs).value

    def _result(self, args: Any, kwargs: Any) -> _run.Result:
        result = _run.call(
            self._config, self._out_dtype, self.__wrapped__, args, kwargs
        )
        with self._lock:
            self._used |= result.used
            _run.warn_unused(
                self._config,
                frozenset(self._used),
                result.functions,
                self._warned,
            )
            _run.warn_no_float8(
                self._config, result.float8_summary, self._warned
            )
        return result

    def _compiled_for(
        self, key: Any, arrays: list[Any]
    ) -> Callable[..., Any] | None:
        """The program compiled for ``key`` (``None``: the function is
        traced on every call)."""
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)  # the most recently used
                run = self._compiled[key]
                return None if run is _CLOSES_OVER else run
            if len(self._compiled) >= COMPILED_LIMIT:
                self._compiled.popitem(last=False)  # the least recently used
            # Traced first (the call then reuses the trace), to learn which
            # arguments a jax.jit of the program donates (those the eager
            # call donates too, as the jit called eagerly would), and
            # whether it closes over device arrays.
            found: list[_run.Result] = []
            fun = _with_static(self._result, key, found)
            run = jax.jit(fun)
            run.trace(*arrays)
            (first,) = found
            if first.donated:
                run = jax.jit(fun, donate_argnums=tuple(sorted(first.donated)))
            # Traced on every call if it closes over device arrays, the
            # first too: its rounding is then the same on every call (the
            # compiled program's fusions round otherwise, a bfloat16 loss
            # 2e-3 apart).
            self._compiled[key] = _CLOSES_OVER if first.captures else run
            structure = (key[0], tuple(i for i, _ in key[2]))
            self._compiles[structure] += 1
            if (
                self._compiles[structure] >= RECOMPILES_WARNED
                and not self._recompiles_warned
            ):
                self._recompiles_warned = True
                _warn_recompiles(self.__wrapped__, key)
        return None if first.captures else run


def _warn_recompiles(fun: Callable[..., Any], key: Any) -> None:
    name = getattr(fun, "__name__", repr(fun))
    kinds = sorted({type(s.value).__name__ for _, s in key[2]})
    warnings.warn(
        f"lossscale.autocast({name}) called eagerly has been compiled for "
        f"{RECOMPILES_WARNED} different values of its non-array arguments "
        f"({', '.join(kinds)}): each new value compiles again, as with "
        "jax.jit's static_argnums. Pass a value that changes between "
        "calls as an array (jnp.asarray(x)) to trace it instead, or call "
        "the function under jax.jit.",
        UserWarning,
        stacklevel=4,
    )


class _Static:
    """A static leaf, compared by value; a float by its bits (``0.0`` and
    ``-0.0`` compile differently, and ``nan`` equals itself)."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any) -> None:
        self.value = value
        if isinstance(value, float):
            self._key: Any = struct.pack("<d", value)
        elif isinstance(value, complex):
            self._key = struct.pack("<dd", value.real, value.imag)
        else:
            self._key = value
        # The type too: True == 1 == 1.0, but they trace differently.
        self._key = (type(value), self._key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


# A key's entry when the function closes over device arrays.
_CLOSES_OVER = object()

_ARRAY_TYPES: set[type] = {np.ndarray}
_STRUCTURES: collections.OrderedDict[Any, bool] = collections.OrderedDict()
_STRUCTURES_LIMIT = 256
_STRUCTURES_LOCK = threading.Lock()


def _is_array_type(kind: type) -> bool:
    if kind in _ARRAY_TYPES:
        return True
    if issubclass(kind, jax.Array | np.ndarray | np.generic):
        _ARRAY_TYPES.add(kind)
        return True
    return False


def _holds_variables(tree: Any, treedef: Any) -> bool:
    """Whether NNX Variables are among ``tree``'s nodes: read once per
    structure (it is part of the structure)."""
    with _STRUCTURES_LOCK:
        hit = _STRUCTURES.get(treedef)
        if hit is not None:
            _STRUCTURES.move_to_end(treedef)
            return hit
    found = any(
        _interop.is_variable(x)
        for x in jax.tree.leaves(tree, is_leaf=_interop.is_variable)
    )
    with _STRUCTURES_LOCK:
        _STRUCTURES[treedef] = found
        if len(_STRUCTURES) > _STRUCTURES_LIMIT:
            _STRUCTURES.popitem(last=False)
    return found


def _split_static(tree: Any) -> tuple[Any, list[Any]] | None:
    """An eager call's arguments as (a hashable key of everything but the
    arrays, the arrays), as equinox's ``filter_jit`` splits them; None
    where that cannot be compiled and cached (NNX state, which is written
    back; an unhashable leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays, static = [], []
    for i, leaf in enumerate(leaves):
        if _is_array_type(type(leaf)):
            arrays.append(leaf)
        elif _interop.is_variable(leaf):
            return None  # a Variable that is not a pytree (flax 0.11)
        else:
            static.append((i, _Static(leaf)))
    if _holds_variables(tree, treedef):
        return None
    # The structure's text too: its node data (an equinox static field)
    # compare with ==, for which 0.0 and -0.0 are one value.
    key = (treedef, len(leaves), tuple(static), str(treedef))
    try:
        hash(key)
    except TypeError:
        return None
    return key, arrays


def _with_static(
    result: Callable[[Any, Any], _run.Result],
    key: Any,
    traces: list[_run.Result],
) -> Callable[..., Any]:
    """The value of ``result`` of the arrays, the static leaves of ``key``
    put back; each trace's result appended to ``traces``."""
    treedef, n, static, _ = key
    fixed = {i: s.value for i, s in static}
    dynamic = [i for i in range(n) if i not in fixed]

    def run(*arrays: Any) -> Any:
        leaves = [fixed.get(i) for i in range(n)]
        for i, array in zip(dynamic, arrays, strict=True):
            leaves[i] = array
        args, kwargs = jax.tree.unflatten(treedef, leaves)
        out = result(args, kwargs)
        traces.append(out)
        return out.value

    return run
