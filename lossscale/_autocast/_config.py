"""What an autocast function is configured with, and where work is kept.

- :class:`Config`: the configuration (compute dtype, rule overrides,
  float8), frozen, hashable and comparable: two autocast functions of the
  same function and configuration are equal, and the plans made for one
  serve the other.
- :class:`JaxprCache`: values computed from a jaxpr (its plans, the
  jaxprs emitted from them), kept exactly as long as the jaxpr lives, as
  JAX's own ``weakref_lru_cache`` keeps traces: a ``jax.jit``-ed block
  called again, in this call or the next, is planned and re-traced once,
  and nothing outlives the jaxpr it was made for.
- :class:`Call`: what one evaluation keeps for its own length (the float32
  islands it traced, shared by every layer of a model).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from lossscale import _compat
from lossscale._autocast import _rules as R

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Config:
    """One autocast function's configuration.

    Attributes:
        compute: the 16-bit compute dtype.
        rules: the user's primitive rules, ``(name, rule)`` pairs.
        function_rules: the user's function rules, ``(name, rule)`` pairs.
        float8: a :class:`lossscale.Float8` recipe for the matmuls it
            makes eligible, or ``None``.
    """

    compute: np.dtype
    rules: tuple[tuple[str, R.Rule], ...] = ()
    function_rules: tuple[tuple[str, R.FunctionRule], ...] = ()
    float8: Any = None

    @functools.cached_property
    def _records(self) -> tuple[dict[Any, Any], dict[str, Any]]:
        """The overridden records, by primitive (resolved once) and by
        name (for a primitive this JAX does not list)."""
        names = dict(self.rules)
        resolved = _compat.primitives_named(names)
        by_primitive = {
            p: (R.overridden(R.TABLE.get(p), names[n]), n)
            for n, p in resolved.items()
        }
        by_name = {
            n: (R.overridden(None, rule), n)
            for n, rule in names.items()
            if n not in resolved
        }
        return by_primitive, by_name

    def record(self, primitive: Any) -> tuple[R.Record | None, str | None]:
        """A primitive's record under this configuration, and the name of
        the override that gave it (``None``: the default)."""
        if self.rules:
            by_primitive, by_name = self._records
            hit = by_primitive.get(primitive) or by_name.get(primitive.name)
            if hit is not None:
                return hit
        record = R.TABLE.get(primitive)
        if (
            self.float8 is not None
            and record is not None
            and record.quantizable
        ):
            return R.in_float8(record), None
        return record, None

    @functools.cached_property
    def sixteen_bit(self) -> Config:
        """This configuration without float8 (a function whose rule is
        ``"compute"``): its matmuls in the 16-bit compute dtype."""
        if self.float8 is None:
            return self
        rules = tuple((n, r) for n, r in self.rules if r != "float8")
        return dataclasses.replace(self, rules=rules, float8=None)

    @functools.cached_property
    def _function_rules(self) -> dict[str, R.FunctionRule]:
        return {**R.FUNCTION_RULES, **dict(self.function_rules)}

    def function_rule(self, name: str) -> R.FunctionRule | None:
        """A function's rule (``None``: evaluated with the rules)."""
        return self._function_rules.get(name)

    @functools.cached_property
    def overrides(self) -> frozenset[tuple[str, Any]]:
        """The user's overrides, as ``("primitive" | "function" |
        "exclude", name)`` (``"exclude"``: a float8 recipe's)."""
        excluded = () if self.float8 is None else self.float8.exclude
        return frozenset(
            [("primitive", n) for n, _ in self.rules]
            + [("function", n) for n, _ in self.function_rules]
            + [("exclude", n) for n in excluded]
        )


class JaxprCache:
    """Values computed from a jaxpr, by key, while the jaxpr lives.

    Thread-safe: two threads may compute the same value, and the first
    stored is kept.
    """

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def get(self, jaxpr: Any, key: Any, make: Callable[[], T]) -> T:
        """The value for ``(jaxpr, key)``, made by ``make`` if missing.

        ``make`` runs outside the lock (it may plan nested jaxprs); the
        value must not refer to ``jaxpr`` itself, which would keep it
        alive.
        """
        with self._lock:
            entries = self._entries.get(jaxpr)
            if entries is not None and key in entries:
                return entries[key]
        value = make()
        with self._lock:
            entries = self._entries.setdefault(jaxpr, {})
            return entries.setdefault(key, value)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(e) for e in self._entries.values())


@dataclasses.dataclass
class Call:
    """One evaluation of an autocast function: its configuration, and the
    float32 islands traced in it, by structure (every layer's same
    island is one jaxpr, whose derivative JAX caches)."""

    config: Config
    islands: dict[Any, Any] = dataclasses.field(default_factory=dict)

    @property
    def compute(self) -> np.dtype:
        return self.config.compute


def frozen_items(mapping: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """A mapping's items, sorted: hashable and order-free."""
    return tuple(sorted((mapping or {}).items()))
