"""Helpers shared by the tests, and the version shims only they need
(the library's own are in ``lossscale/_compat.py``)."""

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import lossscale
from lossscale import _transform

__all__ = [
    "assert_trees_bitwise_equal",
    "count_compiles",
    "data_model_mesh",
    "enable_x64",
    "equations",
    "explicit_mesh",
    "loss_scaled",
    "normal",
    "operand_dtypes",
    "relative_error",
    "set_mesh",
    "sharded_sum",
]


# --- shims across the supported JAX versions ---------------------------


def enable_x64() -> contextlib.AbstractContextManager[Any]:
    """A context with float64 enabled."""
    # Each branch exists in only some supported JAX versions, and pyright
    # checks against the one installed: the ignores are for the other one.
    if hasattr(jax, "enable_x64"):  # jax >= 0.8
        return jax.enable_x64(True)  # pyright: ignore[reportAttributeAccessIssue]
    from jax.experimental import enable_x64 as legacy  # pyright: ignore[reportAttributeAccessIssue]

    return legacy(True)


def explicit_mesh(
    shape: Sequence[int],
    names: Sequence[str],
    devices: Sequence[Any] | None = None,
) -> Any:
    """``jax.make_mesh`` with every axis ``AxisType.Explicit``.

    The default changed in jax 0.9 (Auto axes before, Explicit since; 0.8
    warns where it is left to the default), so the tests spell it out.
    """
    explicit = jax.sharding.AxisType.Explicit
    return jax.make_mesh(
        tuple(shape),
        tuple(names),
        axis_types=(explicit,) * len(shape),
        devices=devices,
    )


@contextlib.contextmanager
def set_mesh(mesh: Any) -> Iterator[None]:
    """``jax.set_mesh(mesh)`` (``jax.sharding.use_mesh`` before jax 0.8)."""
    # jax.sharding.use_mesh is gone from the newest JAX (pyright checks
    # against the installed one), but it is all that jax 0.7 has.
    setter = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh  # pyright: ignore[reportAttributeAccessIssue]
    with setter(mesh):
        yield


def normal(seed, shape, scale=1.0):
    """float32 normal values from NumPy's generator (no JAX operation to
    compile for the test data)."""
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(values, jnp.float32)


def relative_error(a, b):
    """``|a - b| / |b|`` in float64, Frobenius norms."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def assert_trees_bitwise_equal(a, b):
    """Same structure, and every leaf the same dtype, shape and bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype
        assert x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def data_model_mesh(axis_type):
    """A 4 x 2 ("data", "model") mesh of "explicit" or "auto" axes."""
    if axis_type == "explicit":
        return explicit_mesh((4, 2), ("data", "model"))
    auto = jax.sharding.AxisType.Auto
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto))


def loss_scaled(inner, loss_scale, *, impl="select", **kwargs):
    """``lossscale.loss_scaled`` with the skip made by ``impl``."""
    with _transform.skip_impl(impl):
        return lossscale.loss_scaled(inner, loss_scale, **kwargs)


def equations(jaxpr, platform="cpu"):
    """Every equation of a jaxpr and of the jaxprs in its params, in order.

    Of a ``lax.platform_dependent`` (a ``cond`` with ``branches_platforms``)
    only the branch that ``platform`` lowers (its own, else the default):
    the program the tests run. ``platform=None``: every branch.
    """
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        params = dict(eqn.params)
        chosen = params.pop("branches_platforms", None)
        if chosen is not None and platform is not None:
            index = next(
                (i for i, ps in enumerate(chosen) if ps and platform in ps),
                chosen.index(None) if None in chosen else None,
            )
            params["branches"] = (params["branches"][index],)
        for value in params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                    yield from equations(sub, platform)


def operand_dtypes(jaxpr, primitive, *, prefix=False):
    """The float operand dtypes of every ``primitive`` equation (of every
    equation whose name starts so, with ``prefix``)."""
    return [
        tuple(
            np.dtype(v.aval.dtype)
            for v in eqn.invars
            if jnp.issubdtype(v.aval.dtype, jnp.floating)
        )
        for eqn in equations(jaxpr)
        if (
            eqn.primitive.name.startswith(primitive)
            if prefix
            else eqn.primitive.name == primitive
        )
    ]


def sharded_sum(body):
    """``sum(body(w, x))`` with ``body`` under ``jax.shard_map`` over 4
    devices, ``w`` replicated and ``x`` split by rows (axis ``"x"``), for
    the tests of collectives inside autocast; skips on fewer devices."""
    import pytest
    from jax.sharding import PartitionSpec as P

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (conftest asks for 8 CPU devices)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P("x")
    )

    def loss(w, x):
        return jnp.sum(sharded(w, x))

    return loss


_COMPILE = "/jax/core/compile/backend_compile_duration"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"


@contextlib.contextmanager
def count_compiles():
    """JAX's own statistics of the block: ``{"compiles": n, "traces": m}``,
    the XLA compilations and the jaxpr traces JAX made (its caches'
    misses), counted from its monitoring events."""
    counts = {"compiles": 0, "traces": 0}

    def listener(event, *args, **kwargs):
        if event == _COMPILE:
            counts["compiles"] += 1
        elif event == _TRACE:
            counts["traces"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        from jax._src import monitoring  # no public way out before 0.8

        remove = getattr(
            monitoring,
            "unregister_event_duration_listener",
            getattr(
                monitoring,
                "_unregister_event_duration_listener_by_callback",
                None,
            ),
        )
        remove(listener)
