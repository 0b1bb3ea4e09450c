"""Mixed-precision casting policies, compatible with jmp's.

A :class:`Policy` names three dtypes: the parameters' (``param_dtype``,
usually float32 master weights), the computation's (``compute_dtype``,
float16 or bfloat16) and the outputs' (``output_dtype``). The string grammar
of :func:`get_policy` is jmp's (``"p=f32,c=bf16,o=f32"``), so configuration
files written for jmp, Haiku or Levanter parse unchanged; ``str(policy)``
writes it back.

``"half"`` is kept as the name ``"half"`` and resolved each time the policy
is used (a cast, or reading a dtype attribute): to bfloat16 if the first
local device is a TPU, else to float16, as jmp's :func:`half_dtype` does.
jmp resolves it when the string is parsed, which may be at import time,
before ``jax.distributed.initialize`` or before the backend is chosen.
"""

from __future__ import annotations

from typing import Any, Final, TypeVar, cast, final

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

_HALF: Final = "half"

# The dtypes of jmp's grammar, each with its names; the first is the one
# str() writes (jmp's choice: float32 is written "full").
_NAMES: Final[dict[np.dtype, tuple[str, ...]]] = {
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(jnp.float16): ("f16", "float16"),
    np.dtype(jnp.float32): ("full", "f32", "float32"),
    np.dtype(jnp.float64): ("f64", "float64"),
}
_BY_NAME: Final[dict[str, np.dtype]] = {
    name: dtype for dtype, names in _NAMES.items() for name in names
}
_ACCEPTED_NAMES: Final = (*_BY_NAME, _HALF)
_KEYS: Final = {
    "p": 0,
    "params": 0,
    "c": 1,
    "compute": 1,
    "o": 2,
    "output": 2,
}
# Keras's mixed policies: float32 variables, half compute; Keras layers
# return their outputs in the compute dtype, as jmp's default does.
_KERAS: Final = {
    "mixed_float16": "p=f32,c=f16,o=f16",
    "mixed_bfloat16": "p=f32,c=bf16,o=bf16",
}

# A dtype in a policy: a numpy dtype, or "half" (resolved when used).
_Spec = np.dtype | str


def half_dtype() -> np.dtype:
    """The half-precision dtype for the current backend, as in jmp.

    Returns:
        bfloat16 if the first local device is a TPU, else float16 (as a
        numpy dtype).
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    return np.dtype(jnp.bfloat16 if on_tpu else jnp.float16)


def _resolve(spec: _Spec) -> np.dtype:
    return half_dtype() if isinstance(spec, str) else spec


def _dtype_spec(value: Any, name: str) -> _Spec:
    """A policy dtype from a name (``"bf16"``, ``"half"``) or a dtype."""
    if isinstance(value, str):
        value = value.strip()
        if value == _HALF:
            return _HALF
        # Only jmp's names: numpy's codes would read "f8" as float64.
        dtype = _BY_NAME.get(value)
    else:
        try:
            dtype = np.dtype(value)
        except TypeError:
            dtype = None
    if dtype is None or dtype not in _NAMES:
        raise ValueError(
            f"{name} must be one of float16, bfloat16, float32, float64 (a "
            "dtype, or one of the names "
            f"{', '.join(repr(n) for n in _ACCEPTED_NAMES)}), got "
            f"{name}={value!r}."
        )
    return dtype


def _cast_floating_to(tree: T, dtype: np.dtype) -> T:
    """Casts the floating jax and numpy array leaves of ``tree``."""

    def cast_leaf(x: Any) -> Any:
        if (
            isinstance(x, jax.Array | np.ndarray)
            and jnp.issubdtype(x.dtype, jnp.floating)
            and x.dtype != dtype
        ):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast_leaf, tree)


@final
class Policy:
    """Which dtypes parameters, computation and outputs use.

    jmp's ``Policy``, with the same attributes and methods. Immutable and
    hashable, with equality by value: it can be a static argument of
    ``jax.jit`` (``static_argnums``) or a field of a module's static
    configuration. It is not a pytree.

    The ``cast_to_*`` methods cast the floating-point array leaves of a
    tree (``jax.Array``, tracers and numpy arrays, as jmp does; numpy
    arrays stay numpy arrays, on the host) and return every other leaf
    unchanged: integer and boolean arrays, PRNG keys, Python and numpy
    scalars, and any non-array object. A leaf that already has the dtype
    is returned itself.

    A dtype given as ``"half"`` stays ``"half"`` in the policy (and in its
    ``str()``), and is resolved with :func:`half_dtype` each time it is read
    or used for a cast: bfloat16 on TPU, float16 elsewhere.

    Args:
        param_dtype: the parameters' dtype: a dtype (``jnp.float32``,
            ``"float32"``) or a jmp name (``"f32"``, ``"full"``, ``"half"``,
            ...). One of float16, bfloat16, float32, float64 or ``"half"``.
        compute_dtype: the dtype of the computation, likewise.
        output_dtype: the dtype of the outputs, likewise.

    Raises:
        ValueError: if a dtype is not one of those.

    Examples:
        >>> import jax.numpy as jnp
        >>> import lossscale
        >>> policy = lossscale.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        >>> str(policy)
        'p=full,c=bf16,o=full'
        >>> lossscale.get_policy(str(policy)) == policy
        True
        >>> x = {"w": jnp.ones(2), "step": jnp.int32(3)}
        >>> policy.cast_to_compute(x)["w"].dtype, policy.cast_to_compute(
        ...     x)["step"].dtype
        (dtype(bfloat16), dtype('int32'))
    """

    __slots__ = ("_specs",)
    _specs: tuple[_Spec, _Spec, _Spec]

    def __init__(
        self,
        param_dtype: jax.typing.DTypeLike | str,
        compute_dtype: jax.typing.DTypeLike | str,
        output_dtype: jax.typing.DTypeLike | str,
    ) -> None:
        specs = (
            _dtype_spec(param_dtype, "param_dtype"),
            _dtype_spec(compute_dtype, "compute_dtype"),
            _dtype_spec(output_dtype, "output_dtype"),
        )
        object.__setattr__(self, "_specs", specs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"Policy is immutable (cannot set {name!r}); build a new one, "
            "e.g. with with_output_dtype or get_policy."
        )

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Policy is immutable (cannot delete {name!r}).")

    def __reduce__(self) -> tuple[type[Policy], tuple[_Spec, _Spec, _Spec]]:
        return (Policy, self._specs)

    def _key(self) -> tuple[str, str, str]:
        # By name: a numpy dtype compares equal to strings it parses
        # (np.dtype("float16") == "half"), which "half" must not be.
        return cast(
            tuple[str, str, str],
            tuple(s if isinstance(s, str) else s.name for s in self._specs),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Policy):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((Policy, self._key()))

    def __str__(self) -> str:
        names = [
            spec if isinstance(spec, str) else _NAMES[spec][0]
            for spec in self._specs
        ]
        return "p={},c={},o={}".format(*names)

    def __repr__(self) -> str:
        p, c, o = self._key()
        return (
            f"Policy(param_dtype={p!r}, compute_dtype={c!r}, "
            f"output_dtype={o!r})"
        )

    @property
    def param_dtype(self) -> np.dtype:
        """The parameters' dtype (``"half"`` resolved now)."""
        return _resolve(self._specs[0])

    @property
    def compute_dtype(self) -> np.dtype:
        """The computation's dtype (``"half"`` resolved now)."""
        return _resolve(self._specs[1])

    @property
    def output_dtype(self) -> np.dtype:
        """The outputs' dtype (``"half"`` resolved now)."""
        return _resolve(self._specs[2])

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating array leaves of ``tree`` to ``param_dtype``."""
        return _cast_floating_to(tree, self.param_dtype)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating array leaves of ``tree`` to ``compute_dtype``."""
        return _cast_floating_to(tree, self.compute_dtype)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating array leaves of ``tree`` to ``output_dtype``."""
        return _cast_floating_to(tree, self.output_dtype)

    def with_output_dtype(
        self, output_dtype: jax.typing.DTypeLike | str
    ) -> Policy:
        """This policy with another output dtype (a dtype or a name)."""
        return Policy(self._specs[0], self._specs[1], output_dtype)


def get_policy(spec: str | Policy) -> Policy:
    """Parses a policy string in jmp's grammar (a :class:`Policy` passes).

    The grammar is jmp's:

    - ``"key=name,key=name,..."`` with keys ``p``/``params``,
      ``c``/``compute`` and ``o``/``output``. Parameters default to
      float32, computation to the parameters' dtype and outputs to the
      computation's: ``"c=f16"`` is ``"p=f32,c=f16,o=f16"``.
    - a single name, which sets all three: ``"bf16"``.
    - names: ``f16``/``float16``, ``bf16``/``bfloat16``,
      ``f32``/``float32``/``full``, ``f64``/``float64`` and ``half``
      (bfloat16 on TPU, float16 elsewhere, resolved when the policy is
      used; see :class:`Policy`).

    and, beyond jmp: spaces around names, ``,`` and ``=`` are ignored;
    Keras's policy names are accepted (``"mixed_float16"`` is
    ``"p=f32,c=f16,o=f16"``, ``"mixed_bfloat16"`` is
    ``"p=f32,c=bf16,o=bf16"``: float32 variables, outputs in the compute
    dtype as Keras layers return them); and a key given twice is an error
    (jmp keeps the last).

    Args:
        spec: the policy string, or a :class:`Policy` (returned as is).

    Returns:
        The :class:`Policy`; ``get_policy(str(policy)) == policy``.

    Raises:
        ValueError: for an unknown key or dtype name, a key given twice, or
            a malformed part; the message lists what is accepted.
        TypeError: if ``spec`` is neither a string nor a :class:`Policy`.

    Examples:
        >>> import lossscale
        >>> policy = lossscale.get_policy("p=f32, c=bf16, o=f32")
        >>> policy.param_dtype, policy.compute_dtype, policy.output_dtype
        (dtype('float32'), dtype(bfloat16), dtype('float32'))
        >>> str(lossscale.get_policy("mixed_float16"))
        'p=full,c=f16,o=f16'
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            "spec must be a policy string such as 'p=f32,c=bf16,o=f32' or a "
            f"lossscale.Policy, got spec={spec!r} of type "
            f"{type(spec).__name__}."
        )
    text = _KERAS.get(spec.strip(), spec)
    if "=" not in text:
        dtype = _parse_name(text, spec)
        return Policy(dtype, dtype, dtype)
    found: list[_Spec | None] = [None, None, None]
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or "=" in value:
            raise ValueError(
                f"each part of a policy must be key=name, got {part!r} in "
                f"spec={spec!r}; e.g. 'p=f32,c=bf16,o=f32'."
            )
        if key not in _KEYS:
            raise ValueError(
                f"unknown key {key!r} in policy spec={spec!r}: the keys are "
                "'p' or 'params', 'c' or 'compute', 'o' or 'output'."
            )
        slot = _KEYS[key]
        if found[slot] is not None:
            which = ("params", "compute", "output")[slot]
            raise ValueError(
                f"policy spec={spec!r} sets the {which} dtype twice."
            )
        found[slot] = _parse_name(value, spec)
    param = np.dtype(jnp.float32) if found[0] is None else found[0]
    compute = param if found[1] is None else found[1]
    output = compute if found[2] is None else found[2]
    return Policy(param, compute, output)


def _parse_name(value: str, spec: str) -> _Spec:
    name = value.strip()
    if name == _HALF:
        return _HALF
    if name in _BY_NAME:
        return _BY_NAME[name]
    raise ValueError(
        f"unknown dtype {name!r} in policy spec={spec!r}: the names are "
        f"{', '.join(repr(n) for n in _ACCEPTED_NAMES)} (and the Keras "
        f"policies {', '.join(repr(k) for k in _KERAS)} as a whole spec)."
    )


def cast_to_full(tree: T) -> T:
    """Casts the floating array leaves of ``tree`` to float32, as in jmp."""
    return _cast_floating_to(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
    """Casts the floating array leaves of ``tree`` to :func:`half_dtype`."""
    return _cast_floating_to(tree, half_dtype())
