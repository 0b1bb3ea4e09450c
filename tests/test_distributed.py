"""Every replica makes the same skip decision: pmap, shard_map, sharded jit.

Runs on the 8 simulated CPU devices that conftest.py configures.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
from lossscale import _compat
from tests.helpers import explicit_mesh, loss_scaled

N = 8


@pytest.fixture(autouse=True)
def _need_devices():
    # Fail rather than skip: a skipped distributed suite would pass vacuously.
    assert jax.device_count() >= N, (
        f"needs {N} devices, have {jax.device_count()}: conftest.py sets "
        "jax_num_cpu_devices before JAX initialises; something initialised "
        "it earlier"
    )


def local_grads(bad_device=3):
    """Per-device local gradients (not yet averaged); one device has an inf."""
    g = jnp.tile(jnp.arange(1.0, 5.0), (N, 1)) * 256.0
    if bad_device is not None:
        g = g.at[bad_device, 2].set(jnp.inf)
    return {"w": g}


def replicate(tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (N, *jnp.shape(x))), tree)


def per_device_equal(tree):
    """Whether every leaf is identical across the leading (device) axis."""
    return all(
        bool(np.all(np.asarray(x) == np.asarray(x)[:1]))
        for x in jax.tree.leaves(tree)
    )


@pytest.mark.standard_promotion
@pytest.mark.parametrize("impl", ["select", "cond"])
def test_pmap_every_replica_skips(impl):
    params = {"w": jnp.ones(4)}

    def run(axis_name):
        tx = loss_scaled(
            optax.adam(0.1),
            lossscale.DynamicLossScale(256.0),
            axis_name=axis_name,
            impl=impl,
            require_scaled_by=False,
        )

        # Gradients are all-reduced *after* the optimizer here (or never):
        # only the finiteness flag is synchronised by the wrapper.
        @functools.partial(jax.pmap, axis_name="i")
        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        p, s = replicate(params), replicate(tx.init(params))
        return step(p, s, local_grads())

    p, s = run("i")
    finite = np.asarray(s.grads_finite)
    assert finite.shape == (N,) and not finite.any()  # on every device
    assert np.asarray(s.loss_scale.loss_scale).tolist() == [128.0] * N
    np.testing.assert_array_equal(np.asarray(p["w"]), np.ones((N, 4)))
    assert per_device_equal(p) and per_device_equal(s)
    assert np.asarray(s.inner_state[0].count).tolist() == [0] * N

    # Negative control: without the sync, device 3 would skip and the others
    # step. Where JAX builds pmap on shard_map(check_vma=False), lossscale
    # sees the mapped axis and refuses; on older JAX it cannot see it, and
    # the replicas split.
    if pmap_axes_visible():
        with pytest.raises(ValueError, match=r"axis_name=\('i',\)"):
            run(None)
        return
    p, s = run(None)
    finite = np.asarray(s.grads_finite)
    assert finite.tolist() == [True] * 3 + [False] + [True] * 4
    assert not per_device_equal(p)
    assert not per_device_equal(s.loss_scale)


def pmap_axes_visible():
    """Whether this JAX shows pmap's axis as a manual mesh axis."""
    seen = []

    def probe(x):
        seen.append(bool(_compat.unchecked_manual_axes()))
        return x

    jax.pmap(probe, axis_name="i")(jnp.ones(N))
    return seen[0]


@pytest.mark.standard_promotion
@pytest.mark.parametrize("impl", ["select", "cond"])
def test_pmap_optax_apply_if_finite_diverges(impl):
    """The anchor: apply_if_finite only looks at its own device."""
    tx = optax.apply_if_finite(optax.adam(0.1), max_consecutive_errors=5)

    @functools.partial(jax.pmap, axis_name="i")
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params = {"w": jnp.ones(4)}
    p, _ = step(replicate(params), replicate(tx.init(params)), local_grads())
    assert not per_device_equal(p)


def mesh1d():
    return explicit_mesh((N,), ("d",), devices=jax.devices()[:N])


def put(mesh, tree, specs):
    """Places ``tree`` on ``mesh`` as ``specs`` (a spec or a tree of them)."""
    if isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, tree)
    return jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)),
        tree,
        specs,
    )


@pytest.mark.standard_promotion
@pytest.mark.parametrize("impl", ["select", "cond"])
def test_shard_map_sharded_optimizer_state(impl):
    """ZeRO-style: each device holds and checks only its shard."""
    mesh = mesh1d()
    params = {"w": jnp.ones(4 * N)}
    grads = {"w": jnp.arange(1.0, 4 * N + 1.0).at[4 * 5 + 1].set(jnp.nan)}

    def run(axis_name, scale_spec):
        tx = loss_scaled(
            optax.adam(0.1),
            lossscale.DynamicLossScale(256.0),
            axis_name=axis_name,
            impl=impl,
            require_scaled_by=False,
        )
        state = tx.init(params)
        state_specs = jax.tree.map(lambda _: P(), state)
        state_specs = state_specs._replace(
            inner_state=jax.tree.map(
                lambda x: P("d") if jnp.ndim(x) else P(), state.inner_state
            )
        )
        stacked = scale_spec == P("d")
        if stacked:  # per-device scalars come back stacked, one per device
            out_state_specs = jax.tree.map(lambda _: P("d"), state)
        else:
            out_state_specs = state_specs

        def step(params, state, grads):
            updates, state = tx.update(grads, state, params)
            if stacked:
                state = jax.tree.map(lambda x: jnp.reshape(x, (-1,)), state)
            return optax.apply_updates(params, updates), state

        f = jax.jit(
            jax.shard_map(
                step,
                mesh=mesh,
                in_specs=(P("d"), state_specs, P("d")),
                out_specs=(P("d"), out_state_specs),
            )
        )
        return f(
            put(mesh, params, P("d")),
            put(mesh, state, state_specs),
            put(mesh, grads, P("d")),
        )

    p, s = run("d", P())
    assert not bool(s.grads_finite)
    assert float(s.loss_scale.loss_scale) == 128.0
    np.testing.assert_array_equal(np.asarray(p["w"]), np.ones(4 * N))
    mu = np.asarray(s.inner_state[0].mu["w"])
    np.testing.assert_array_equal(mu, np.zeros(4 * N))

    # Negative control: without axis_name the devices would disagree (only
    # device 5 would skip); lossscale refuses to build that step.
    with pytest.raises(ValueError, match=r"axis_name=\('d',\)"):
        run(None, P("d"))


@pytest.mark.standard_promotion
def test_shard_map_missing_axis_name_fails_loudly():
    """A replicated scale out of shard_map needs the sync: JAX says so."""
    mesh = mesh1d()
    tx = lossscale.loss_scaled(
        optax.sgd(1.0), lossscale.DynamicLossScale(), require_scaled_by=False
    )
    params = jnp.ones(N)
    state = tx.init(params)
    specs = jax.tree.map(lambda _: P(), state)

    def step(params, state, grads):
        return tx.update(grads, state, params)

    f = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P("d"), specs, P("d")),
        out_specs=(P("d"), specs),
    )
    args = (
        put(mesh, params, P("d")),
        put(mesh, state, specs),
        put(mesh, params, P("d")),
    )
    with pytest.raises(ValueError, match=r"axis_name=\('d',\)"):
        jax.jit(f)(*args)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("impl", ["select", "cond"])
def test_sharded_jit_needs_no_axis_name(impl):
    mesh = explicit_mesh((2, 4), ("data", "model"), devices=jax.devices()[:N])
    sharding = NamedSharding(mesh, P("data", "model"))
    params = jax.device_put({"w": jnp.ones((4, 8))}, sharding)
    tx = loss_scaled(
        optax.adam(0.1),
        lossscale.DynamicLossScale(256.0),
        impl=impl,
        require_scaled_by=False,
    )
    state = tx.init(params)
    step = jax.jit(
        lambda p, s, g: (lambda u_s: (optax.apply_updates(p, u_s[0]), u_s[1]))(
            tx.update(g, s, p)
        )
    )

    bad = jax.device_put(
        {"w": jnp.full((4, 8), 256.0).at[3, 7].set(jnp.inf)}, sharding
    )
    # The inf lives in exactly one device's shard.
    holding = [
        shard.device
        for shard in bad["w"].addressable_shards
        if not np.isfinite(np.asarray(shard.data)).all()
    ]
    assert len(holding) == 1
    p, s = step(params, state, bad)
    assert not bool(s.grads_finite)
    np.testing.assert_array_equal(np.asarray(p["w"]), np.ones((4, 8)))
    assert p["w"].sharding.is_equivalent_to(sharding, 2)
    for shard in s.grads_finite.addressable_shards:  # every device agrees
        assert not bool(shard.data)

    # Control: the same step with finite gradients updates every shard.
    good = jax.device_put({"w": jnp.full((4, 8), 256.0)}, sharding)
    p, s = step(params, state, good)
    assert bool(s.grads_finite)
    assert not np.any(np.asarray(p["w"]) == 1.0)


@pytest.mark.standard_promotion
def test_shard_map_without_vma_checks_needs_every_axis_named():
    """check_vma=False: JAX cannot tell which values differ between devices,
    so every mapped axis must be named; named, the devices agree."""
    mesh = mesh1d()
    params = jnp.ones(N)
    grads = (jnp.arange(1.0, N + 1.0) * 256).at[3].set(jnp.inf)

    def run(axis_name):
        tx = lossscale.loss_scaled(
            optax.sgd(1.0),
            lossscale.StaticLossScale(256.0),
            axis_name=axis_name,
            require_scaled_by=False,
        )
        state = tx.init(params)
        specs = jax.tree.map(lambda _: P(), state)

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P("d"), specs, P("d")),
            out_specs=(P("d"), specs),
            check_vma=False,
        )
        return jax.jit(f)(
            put(mesh, params, P("d")),
            put(mesh, state, specs),
            put(mesh, grads, P("d")),
        )

    with pytest.raises(
        ValueError, match=r"check_vma=False.*axis_name=\('d',\)"
    ):
        run(None)
    p, s = run("d")
    assert not bool(s.grads_finite)
    np.testing.assert_array_equal(np.asarray(p), np.ones(N))
