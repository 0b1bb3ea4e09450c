"""Values recorded against arrays and tracers by identity, held weakly.

Gradient leaves are arrays eagerly and tracers under a transformation:
neither is hashable, so a record is keyed by ``id``, and keeps a weak
reference to tell its leaf from a new object that took a dead one's
``id``. An entry lives as long as its leaf, and no longer.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class LeafRecord(Generic[V]):
    """A value per live leaf, the latest record last."""

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], V]] = {}

    def remember(self, leaf: Any, value: V) -> None:
        """Records ``value`` for ``leaf``, replacing an earlier record (a
        leaf that cannot be referenced weakly is not recorded)."""
        key = id(leaf)
        # The callback holds _forget itself, not its global name: a leaf
        # kept in a module variable dies at interpreter exit, after the
        # globals of this module are cleared to None.
        forget = functools.partial(_forget, self._entries, key)
        try:
            ref = weakref.ref(leaf, forget)
        except TypeError:
            return
        self._entries.pop(key, None)  # re-recorded: now the latest
        self._entries[key] = (ref, value)

    def recall(self, leaf: Any) -> V | None:
        """The value recorded for ``leaf`` itself, or ``None``."""
        entry = self._entries.get(id(leaf))
        if entry is None or entry[0]() is not leaf:
            return None
        return entry[1]

    def alive(self) -> list[tuple[Any, V]]:
        """Each live leaf with its value, the latest record last."""
        pairs = [(ref(), value) for ref, value in list(self._entries.values())]
        return [(leaf, value) for leaf, value in pairs if leaf is not None]


def _forget(
    entries: dict[int, tuple[weakref.ref[Any], Any]],
    key: int,
    ref: weakref.ref[Any],
) -> None:
    entry = entries.get(key)
    if entry is not None and entry[0] is ref:
        del entries[key]
