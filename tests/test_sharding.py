"""Sharded training under jit: explicit and automatic mesh axes.

``jax.make_mesh`` makes ``AxisType.Explicit`` axes by default since jax
0.9, and under them the sharding is part of every array's type: an
operation that cannot keep it is refused at trace time. The wrapper must
run wherever plain optax runs, keep every output's sharding, and check
finiteness with a local reduction per device and a scalar all-reduce,
never by gathering a gradient.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
from tests.helpers import (
    assert_trees_bitwise_equal,
    data_model_mesh,
    explicit_mesh,
    loss_scaled,
    set_mesh,
)

pytestmark = pytest.mark.standard_promotion

SHAPES = {
    "w": (64, 32),  # large: a matrix
    "emb": (128, 16),  # large, FSDP-style on the data axis
    "v": (4096,),  # a large vector
    "b": (32,),  # small leaves, on different specs
    "ln": (16,),
    "b2": (32,),
}
LAYOUTS = {
    "replicated": {name: P() for name in SHAPES},
    "data": {
        "w": P("data"),
        "emb": P("data"),
        "v": P("data"),
        "b": P(),
        "ln": P(),
        "b2": P(),
    },
    "model": {
        "w": P(None, "model"),
        "emb": P(None, "model"),
        "v": P("model"),
        "b": P("model"),
        "ln": P(),
        "b2": P("model"),
    },
    "fsdp": {
        "w": P("data", None),
        "emb": P("data", None),
        "v": P(("data", "model")),
        "b": P("data"),
        "ln": P(),
        "b2": P("data"),
    },
    "mixed": {
        "w": P("data", "model"),
        "emb": P("data", None),
        "v": P("model"),
        "b": P("model"),
        "ln": P(),
        "b2": P("data"),
    },
}
SCALE = 2.0**10


def place(mesh, tree, specs):
    return {
        k: jax.device_put(v, NamedSharding(mesh, specs[k]))
        for k, v in tree.items()
    }


def problem(mesh, layout):
    rng = np.random.default_rng(0)
    params = {
        k: jnp.asarray(rng.normal(size=s), jnp.float32)
        for k, s in SHAPES.items()
    }
    grads = {
        k: jnp.asarray(rng.normal(size=s) * SCALE, jnp.float32)
        for k, s in SHAPES.items()
    }
    specs = LAYOUTS[layout]
    return place(mesh, params, specs), place(mesh, grads, specs)


def with_value(x, index, value):
    """A copy of the sharded array ``x`` with one element set, same sharding."""
    host = np.array(x)
    host[index] = value
    return jax.device_put(host, x.sharding)


def specs_of(tree):
    """Each leaf's partition spec, without trailing Nones (P(None) == P())."""
    out = []
    for x in jax.tree.leaves(tree):
        spec = list(getattr(x.sharding, "spec", ()))
        while spec and spec[-1] is None:
            spec.pop()
        out.append(tuple(spec))
    return out


def collectives(compiled):
    """(result type, op) of every cross-device operation in the program.

    The result type may be a tuple (several scalars all-reduced at once).
    """
    return re.findall(
        r"= (.+?) (all-reduce|all-gather|all-to-all|collective-permute|"
        r"reduce-scatter)(?:-start)?\(",
        compiled.as_text(),
    )


def mesh_cases():
    """Every layout under both axis types with both skips; a quick run
    (-m "not slow") keeps the default skip under explicit axes."""
    for axis_type in ("explicit", "auto"):
        for layout in sorted(LAYOUTS):
            for impl in ("select", "cond"):
                quick = axis_type == "explicit" and impl == "select"
                yield pytest.param(
                    axis_type,
                    layout,
                    impl,
                    id=f"{axis_type}-{layout}-{impl}",
                    marks=() if quick else pytest.mark.slow,
                )


@pytest.mark.parametrize("axis_type, layout, impl", list(mesh_cases()))
def test_train_step_on_a_mesh(axis_type, layout, impl):
    mesh = data_model_mesh(axis_type)
    inner = optax.adamw(1e-2, weight_decay=0.1)
    tx = loss_scaled(
        optax.adamw(1e-2, weight_decay=0.1),
        lossscale.StaticLossScale(SCALE),
        impl=impl,
        require_scaled_by=False,
    )

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain_step(params, state, grads):
        grads = jax.tree.map(lambda g: g * (1 / SCALE), grads)
        updates, state = inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with set_mesh(mesh):
        params, grads = problem(mesh, layout)
        state = jax.jit(tx.init)(params)
        assert specs_of(state.inner_state) == specs_of(
            jax.jit(inner.init)(params)
        )
        new_params, new_state = jax.jit(step)(params, state, grads)
        want_params, want_inner = jax.jit(plain_step)(
            params, jax.jit(inner.init)(params), grads
        )
        assert bool(new_state.grads_finite)
        for got, want in zip(
            jax.tree.leaves((new_params, new_state.inner_state)),
            jax.tree.leaves((want_params, want_inner)),
            strict=True,
        ):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        # Every output is sharded as plain optax's is; under explicit axes
        # (where the sharding is part of the type) as its input is.
        assert specs_of(new_params) == specs_of(want_params)
        assert specs_of(new_state.inner_state) == specs_of(want_inner)
        if axis_type == "explicit":
            assert specs_of(new_params) == specs_of(params)
            assert specs_of(new_state.inner_state) == specs_of(
                state.inner_state
            )

        # An inf in one shard of one leaf skips the step on every device.
        bad = dict(grads, w=with_value(grads["w"], (63, 31), np.inf))
        out_params, out_state = jax.jit(step)(new_params, new_state, bad)
        assert not bool(out_state.grads_finite)
        assert_trees_bitwise_equal(out_params, new_params)
        assert_trees_bitwise_equal(out_state.inner_state, new_state.inner_state)

        # Only flags cross devices (at most one per device), never a
        # gradient: a local reduction, then a scalar collective.
        compiled = jax.jit(step).lower(params, state, grads).compile()
        for result, op in collectives(compiled):
            for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", result):
                size = int(np.prod([int(d) for d in dims.split(",") if d]))
                assert dtype in ("pred", "s32") and size <= 8, (op, result)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_all_finite_and_select_tree_on_an_explicit_mesh(layout):
    mesh = data_model_mesh("explicit")
    with set_mesh(mesh):
        params, grads = problem(mesh, layout)
        assert bool(jax.jit(lossscale.all_finite)(grads))
        assert bool(lossscale.all_finite(grads))  # eager, on sharded arrays
        bad = dict(grads, b2=with_value(grads["b2"], (5,), np.nan))
        assert not bool(jax.jit(lossscale.all_finite)(bad))
        chosen = jax.jit(lossscale.select_tree)(jnp.bool_(False), grads, params)
        assert_trees_bitwise_equal(chosen, params)
        assert specs_of(chosen) == specs_of(params)


def test_exports_for_gpu_and_tpu_under_explicit_sharding():
    """Both branches of the check trace under explicit sharding.

    ``lax.platform_dependent`` traces the CPU branch and the default one
    whatever the target, so an export for accelerators from this CPU-only
    machine traces (and lowers) both.
    """
    from jax import export

    mesh = data_model_mesh("explicit")
    tx = lossscale.loss_scaled(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        lossscale.DynamicLossScale(SCALE),
        require_scaled_by=False,
    )

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with set_mesh(mesh):
        params, grads = problem(mesh, "mixed")
        state = jax.jit(tx.init)(params)
        exported = export.export(jax.jit(step), platforms=("cuda", "tpu"))(
            params, state, grads
        )
    assert exported.platforms == ("cuda", "tpu")
    text = exported.mlir_module()
    assert "is_finite" in text


@pytest.mark.parametrize("impl", ["select", "cond"])
def test_state_whose_sharding_changes_in_the_update(impl):
    """ZeRO-style gradients meet a replicated state: the new moments come
    out sharded like the gradients, as in plain optax, and the select (or
    the conditional) between old and new reshards the old ones to match."""
    mesh = explicit_mesh((8,), ("x",))
    inner = optax.adam(1e-2)
    tx = loss_scaled(
        optax.adam(1e-2),
        lossscale.StaticLossScale(2.0),
        impl=impl,
        require_scaled_by=False,
    )

    def make_step(opt):
        def step(params, state, x, poison):
            grads = jax.grad(lambda p: jnp.sum((x @ p["w"]) ** 2))(params)
            grads = jax.tree.map(lambda g: g * poison, grads)
            grads = jax.sharding.reshard(grads, {"w": P("x", None)})
            updates, state = opt.update(grads, state, params)
            updates = jax.sharding.reshard(updates, {"w": P()})
            return optax.apply_updates(params, updates), state

        return jax.jit(step)

    with set_mesh(mesh):
        params = {"w": jax.device_put(jnp.ones((16, 4)) / 4, P())}
        x = jax.device_put(jnp.ones((8, 16)), P("x", None))
        one = jnp.float32(1.0)
        _, plain_state = make_step(inner)(params, inner.init(params), x, one)
        state = tx.init(params)
        new_params, new_state = make_step(tx)(params, state, x, one)
        assert specs_of(new_state.inner_state) == specs_of(plain_state)
        before = jax.tree.map(np.asarray, new_state.inner_state)
        out, skipped = make_step(tx)(
            new_params, new_state, x, jnp.float32(np.inf)
        )
    assert not bool(skipped.grads_finite)
    assert_trees_bitwise_equal(out, new_params)
    assert_trees_bitwise_equal(skipped.inner_state, before)
