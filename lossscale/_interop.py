"""Interoperation with flax, without depending on it.

flax is optional: nothing here imports it unless it is installed, and the
package works the same without it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import jax


def _is_variable(x: Any) -> bool:
    # flax.nnx.Variable (e.g. the OptState/OptArray leaves that
    # nnx.Optimizer wraps its opt_state in) exposes its array as
    # get_value() (flax >= 0.12) or as .value (flax 0.11).
    if isinstance(x, jax.Array):
        return False
    if callable(getattr(x, "get_value", None)):
        return True
    return type(x).__module__.startswith("flax.") and hasattr(x, "value")


def _value(x: Any) -> Any:
    get_value = getattr(x, "get_value", None)
    return get_value() if callable(get_value) else x.value


def unwrap_variables(tree: Any) -> Any:
    """Replaces flax ``nnx.Variable`` leaves by the arrays they hold."""
    return jax.tree.map(
        lambda x: _value(x) if _is_variable(x) else x,
        tree,
        is_leaf=_is_variable,
    )


def register_flax_serialization(classes: tuple[type, ...]) -> bool:
    """Teaches ``flax.serialization`` the loss-scale classes, if flax exists.

    The state dict of a loss scale holds its leaves (the scale and the
    counters) by field name; restoring takes the configuration from the
    target, as for every flax/optax state.

    Returns:
        Whether flax was found and the classes registered.
    """
    if importlib.util.find_spec("flax") is None:
        return False
    try:
        from flax import serialization
    except Exception:  # a broken flax install must not break lossscale
        return False

    for cls in classes:
        fields = cls._data_fields

        def to_state_dict(obj, fields=fields):
            return {
                name: serialization.to_state_dict(getattr(obj, name))
                for name in fields
            }

        def from_state_dict(target, state, fields=fields):
            missing = set(fields) - set(state)
            if missing:
                raise ValueError(
                    f"state dict for {type(target).__name__} lacks "
                    f"{sorted(missing)}; got keys {sorted(state)}."
                )
            leaves = [
                serialization.from_state_dict(
                    getattr(target, name), state[name]
                )
                for name in fields
            ]
            return jax.tree.unflatten(jax.tree.structure(target), leaves)

        serialization.register_serialization_state(
            cls, to_state_dict, from_state_dict, override=True
        )
    return True
