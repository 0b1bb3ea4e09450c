"""autocast's tables against the installed JAX's primitives.

A primitive JAX renames would silently fall to the "original" rule, and a
param JAX adds to a higher-order primitive could be dropped when autocast
rebuilds it: these tests fail instead, on the JAX they run on.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax._src.interpreters import mlir  # the registry of lowered primitives

import lossscale
from lossscale import _compat
from lossscale._autocast import _handlers
from lossscale._autocast import _rules as R


def installed_primitives():
    return {getattr(p, "name", None) for p in mlir._lowerings}


def test_every_rule_names_a_primitive_of_this_jax():
    installed = installed_primitives()
    assert "dot_general" in installed and "tanh" in installed  # premise
    missing = sorted(
        name
        for name in R.PRIMITIVE_RULES
        if name not in installed and name not in R.ONLY_IN_SOME_VERSIONS
    )
    assert missing == []


def test_a_misspelt_table_entry_would_be_caught():
    # The negative control: a name no JAX has is not "installed".
    assert "tanhh" not in installed_primitives()


def _program(w, x):
    @jax.custom_vjp
    def doubled(a):
        return a * 2

    doubled.defvjp(lambda a: (a * 2, None), lambda _, g: (g * 2,))

    @jax.jit
    def block(h):
        return jnp.tanh(h @ w)

    def loss(w):
        h = lax.scan(lambda c, xi: (block(c + xi), None), x[0], x)[0]
        h = jax.checkpoint(jnp.sin)(h)
        h = lax.cond(h.sum() > 0, lambda a: a + 1, lambda a: a - 1, h)
        h = lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 0.5), (0, h)
        )[1]
        h = lax.platform_dependent(h, cpu=jnp.sin, default=jnp.cos)
        return jnp.sum(jax.nn.relu(doubled(h)))

    return jax.grad(loss)(w)


def _higher_order(jaxpr, found):
    for eqn in jaxpr.eqns:
        subs = []
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if hasattr(sub, "eqns"):
                    subs.append(sub)
                elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    subs.append(sub.jaxpr)
        if subs:
            found.setdefault(eqn.primitive.name, set()).update(eqn.params)
        for sub in subs:
            _higher_order(sub, found)
    return found


def test_every_higher_order_param_of_this_jax_is_known():
    w, x = jnp.full((4, 4), 0.1), jnp.ones((3, 4))
    found = _higher_order(jax.make_jaxpr(_program)(w, x).jaxpr, {})
    mesh = jax.make_mesh(
        (1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,),
        devices=jax.devices()[:1],
    )  # fmt: skip
    mapped = jax.shard_map(
        lambda a: a * 2, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d")
    )
    _higher_order(jax.make_jaxpr(mapped)(x).jaxpr, found)
    assert {"scan", "while", "cond", "shard_map"} <= set(found)  # premise
    for name, params in found.items():
        if name == "custom_vjp_call":  # runs whole at its traced dtypes
            continue
        assert name in _handlers.HANDLED, name
        unknown = params - _compat.HIGHER_ORDER_PARAMS[name]
        assert not unknown, (name, unknown)


def test_an_unknown_param_runs_the_equation_as_traced_and_warns(monkeypatch):
    known = _compat.HIGHER_ORDER_PARAMS["scan"] - {"unroll"}
    monkeypatch.setitem(_compat.HIGHER_ORDER_PARAMS, "scan", known)

    def f(w, xs):
        return lax.scan(lambda c, x: (jnp.tanh(c @ w + x), None), xs[0], xs)[0]

    w, xs = jnp.full((4, 4), 0.1), jnp.ones((3, 2, 4))
    with pytest.warns(RuntimeWarning, match="scan.*unroll"):
        jaxpr = jax.make_jaxpr(lossscale.autocast(f))(w, xs)
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert {np.dtype(v.aval.dtype) for v in scan.outvars} == {
        np.dtype(np.float32)
    }
