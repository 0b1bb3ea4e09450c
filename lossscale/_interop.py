"""Interoperation with flax, without depending on it.

flax is optional and never imported here: the package works the same
without it, and ``import lossscale`` stays as cheap as ``import optax``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Mapping
from typing import Any

import jax


def _is_variable(x: Any) -> bool:
    # flax.nnx.Variable (e.g. the OptState/OptArray leaves that
    # nnx.Optimizer wraps its opt_state in) exposes its array as
    # get_value() (flax >= 0.12) or as .value (flax 0.11).
    if isinstance(x, jax.Array):
        return False
    # A flax object is only there if flax.nnx is imported; its class then
    # decides. Duck typing alone takes a module with an attribute `value`
    # (nnx.MultiHeadAttention's value projection) or nnx.Rngs (any
    # attribute is a stream) for a Variable.
    nnx = sys.modules.get("flax.nnx")
    variable = getattr(nnx, "Variable", None)
    if isinstance(variable, type) and type(x).__module__.startswith("flax."):
        return isinstance(x, variable)
    if callable(getattr(x, "get_value", None)):
        return True
    return type(x).__module__.startswith("flax.") and hasattr(x, "value")


def is_variable(x: Any) -> bool:
    """Whether ``x`` is a flax ``nnx.Variable`` (a mutable array holder)."""
    return _is_variable(x)


def is_trace_context_error(err: BaseException) -> bool:
    """Whether ``err`` is flax's refusal to update state from an inner
    trace (``flax.errors.TraceContextError``)."""
    return type(err).__name__ == "TraceContextError" and type(
        err
    ).__module__.startswith("flax")


def set_variable(x: Any, value: Any) -> None:
    """Sets the array a flax ``nnx.Variable`` holds."""
    set_value = getattr(x, "set_value", None)
    if callable(set_value):
        set_value(value)
    else:  # flax 0.11
        x.value = value


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
    """Teaches ``flax.serialization`` the loss-scale classes, once imported.

    lossscale does not import flax (that would cost every user the import
    of a model library). If ``flax.serialization`` is already imported, the
    classes are registered now; otherwise as soon as it is, by a one-shot
    import hook. The state dict of a loss scale holds its leaves (the scale
    and the counters) by field name; restoring takes the configuration from
    the target, as for every flax/optax state.

    Returns:
        Whether the classes were registered now (else on flax's import).
    """
    module = sys.modules.get("flax.serialization")
    if module is not None:
        _register(module, classes)
        return True
    sys.meta_path.insert(0, _AfterImport("flax.serialization", classes))
    return False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Registers ``classes`` right after ``name`` is first imported."""

    def __init__(self, name: str, classes: tuple[type, ...]) -> None:
        self.name = name
        self.classes = classes

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot, and no recursion below
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        classes = self.classes

        class Loader(importlib.abc.Loader):
            def create_module(
                self, spec: importlib.machinery.ModuleSpec
            ) -> types.ModuleType | None:
                return loader.create_module(spec)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                _register(module, classes)

        spec.loader = Loader()
        return spec


def _register(serialization: Any, classes: tuple[type, ...]) -> None:
    for cls in classes:
        fields: tuple[str, ...] = cls._data_fields  # type: ignore[attr-defined]

        def to_state_dict(
            obj: Any, fields: tuple[str, ...] = fields
        ) -> dict[str, Any]:
            return {
                name: serialization.to_state_dict(getattr(obj, name))
                for name in fields
            }

        def from_state_dict(
            target: Any,
            state: Mapping[str, Any],
            fields: tuple[str, ...] = fields,
        ) -> Any:
            missing = set(fields) - set(state)
            unknown = set(state) - set(fields)
            if missing or unknown:
                raise ValueError(
                    f"the state dict does not fit {type(target).__name__} "
                    f"(fields {list(fields)}): it lacks {sorted(missing)} and "
                    f"has unknown {sorted(unknown)}. Was it saved from another "
                    "kind of loss scale?"
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
