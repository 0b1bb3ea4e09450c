"""The table of higher-order primitives: each one's handlers, registered
into both passes' tables with its known params.

**Adding a higher-order primitive is one row of** :data:`_HANDLERS`
(its ``infer`` and ``emit``, from :mod:`._higher` or :mod:`._control`),
**with its known params in** :data:`lossscale._compat.HIGHER_ORDER_PARAMS`,
without which this module refuses to register it: every param of an
equation is checked against them before it is emitted, and one autocast
does not know runs the equation at its traced dtypes, with a warning
naming it. Importing this module (:mod:`._api` does) registers the table
into :data:`._equation.HIGHER` and :data:`._emit.HIGHER`, by ``Primitive``.
"""

from __future__ import annotations

from lossscale import _compat
from lossscale._autocast import _emit, _equation
from lossscale._autocast._control import (
    _cond_emit,
    _cond_infer,
    _scan_emit,
    _scan_infer,
    _while_emit,
    _while_infer,
)
from lossscale._autocast._higher import (
    _call_emit,
    _call_infer,
    _checkpoint_emit,
    _custom_jvp_emit,
    _custom_jvp_infer,
    _open_infer,
    _shard_map_emit,
)

# name: (infer, emit, a call that may be part of a float32 island)
_HANDLERS: dict[str, tuple[_equation.InferHigher, _emit.EmitHigher, bool]] = {
    "jit": (_call_infer, _call_emit, True),
    "pjit": (_call_infer, _call_emit, True),
    "closed_call": (_call_infer, _call_emit, False),
    "core_call": (_call_infer, _call_emit, False),
    "scan": (_scan_infer, _scan_emit, False),
    "while": (_while_infer, _while_emit, False),
    "cond": (_cond_infer, _cond_emit, False),
    "remat2": (_open_infer, _checkpoint_emit, False),
    "checkpoint": (_open_infer, _checkpoint_emit, False),
    "custom_jvp_call": (_custom_jvp_infer, _custom_jvp_emit, True),
    "shard_map": (_open_infer, _shard_map_emit, False),
}

HANDLED = frozenset(_HANDLERS)
"""The names of the higher-order primitives autocast recurses into."""

for _name, _primitive in _compat.primitives_named(_HANDLERS).items():
    _infer_rule, _emit_rule, _island = _HANDLERS[_name]
    if _name not in _compat.HIGHER_ORDER_PARAMS:
        # The params autocast rebuilds an equation from: without them, a
        # param it does not know would go unnoticed.
        raise RuntimeError(  # pragma: no cover - a developer's error
            f"lossscale: the handler of {_name} needs its known params in "
            "lossscale._compat.HIGHER_ORDER_PARAMS."
        )
    _equation.register(_primitive, _infer_rule, island=_island)
    _emit.register(_primitive, _emit_rule)
