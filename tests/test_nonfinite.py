"""report_nonfinite: which gradient leaves overflowed, agreed across devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
from tests.helpers import data_model_mesh, explicit_mesh, loss_scaled, set_mesh

pytestmark = pytest.mark.standard_promotion

N = 8


def params():
    return {
        "embed": jnp.ones((8, 4)),
        "layers": [
            {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)} for _ in range(2)
        ],
        "step": jnp.int32(0),  # not floating: never reported
        "head": {"w": jnp.ones((4, 2))},
    }


def poisoned(tree, *paths):
    """``tree`` with an inf at the first element of each leaf in ``paths``."""

    def leaf(path, x):
        if jax.tree_util.keystr(path) in paths:
            return x.at[(0,) * x.ndim].set(jnp.inf)
        return x

    return jax.tree_util.tree_map_with_path(leaf, tree)


@pytest.mark.parametrize("impl", ["select", "cond"])
def test_names_the_leaves_that_overflowed(impl):
    p = params()
    tx = loss_scaled(
        optax.sgd(1e-3),  # takes the None gradient of the int leaf
        lossscale.DynamicLossScale(2.0**4),
        report_nonfinite=True,
        impl=impl,
        require_scaled_by=False,
    )
    step = jax.jit(tx.update)
    state = tx.init(p)
    grads = jax.tree.map(lambda x: x if x.dtype == jnp.int32 else x * 2, p)
    grads["step"] = None
    assert lossscale.nonfinite_paths(state, p) == []
    _, state = step(grads, state, p)
    assert lossscale.nonfinite_paths(state, p) == []
    assert int(lossscale.metrics(state)["nonfinite_leaves"]) == 0

    bad = poisoned(grads, "['layers'][1]['w']", "['head']['w']")
    _, state = step(bad, state, p)
    assert not bool(state.grads_finite)
    assert lossscale.nonfinite_paths(state, p) == [
        "['head']['w']",
        "['layers'][1]['w']",
    ]
    m = lossscale.metrics(state)
    assert m["nonfinite_leaves"].dtype == jnp.int32
    assert int(m["nonfinite_leaves"]) == 2

    # The next finite step clears the report.
    _, state = step(grads, state, p)
    assert lossscale.nonfinite_paths(state, p) == []


def test_off_by_default_changes_nothing():
    p = params()
    plain = lossscale.loss_scaled(
        optax.adam(1e-3), lossscale.NoOpLossScale(), require_scaled_by=False
    )
    state = plain.init(p)
    assert state.nonfinite is None
    assert "nonfinite_leaves" not in lossscale.metrics(state)
    with pytest.raises(ValueError, match="report_nonfinite=True"):
        lossscale.nonfinite_paths(state, p)

    # The same compiled program as without the option.
    def hlo(tx):
        grads = jax.tree.map(jnp.ones_like, p)
        return jax.jit(tx.update).lower(grads, tx.init(p), p).as_text()

    off = lossscale.loss_scaled(
        optax.adam(1e-3),
        lossscale.NoOpLossScale(),
        report_nonfinite=False,
        require_scaled_by=False,
    )
    on = lossscale.loss_scaled(
        optax.adam(1e-3),
        lossscale.NoOpLossScale(),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    assert hlo(off) == hlo(plain)
    assert hlo(on) != hlo(plain)  # control: the option does change it


def test_masked_leaves_are_not_reported():
    p = {"a": jnp.ones(3), "meta": jnp.ones(2)}
    tx = lossscale.loss_scaled(
        optax.sgd(0.1),
        lossscale.StaticLossScale(1.0),
        mask={"a": True, "meta": False},
        report_nonfinite=True,
        require_scaled_by=False,
    )
    bad = {"a": jnp.array([1.0, jnp.nan, 1.0]), "meta": jnp.full(2, jnp.inf)}
    _, state = jax.jit(tx.update)(bad, tx.init(p), p)
    assert lossscale.nonfinite_paths(state, p) == ["['a']"]


def test_groups_report_across_groups():
    p = {"enc": jnp.ones(3), "dec": jnp.ones(2)}
    tx = lossscale.loss_scaled_by_group(
        optax.sgd(0.1),
        {
            "e": lossscale.StaticLossScale(2.0),
            "d": lossscale.StaticLossScale(8.0),
        },
        param_labels={"enc": "e", "dec": "d"},
        report_nonfinite=True,
        require_scaled_by=False,
    )
    bad = {"enc": jnp.ones(3) * 2, "dec": jnp.array([8.0, jnp.inf])}
    _, state = jax.jit(tx.update)(bad, tx.init(p), p)
    assert lossscale.nonfinite_paths(state, p) == ["['dec']"]


def test_wrong_tree_is_a_clear_error():
    p = {"a": jnp.ones(3), "b": jnp.ones(2)}
    tx = lossscale.loss_scaled(
        optax.sgd(0.1),
        lossscale.NoOpLossScale(),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    state = tx.init(p)
    with pytest.raises(ValueError, match="1 leaves, but the gradients had 2"):
        lossscale.nonfinite_paths(state, {"a": jnp.ones(3)})
    with pytest.raises(ValueError, match="room for"):
        tx.update({"a": jnp.ones(3)}, state)


def reporting_sgd(axis_name=None):
    """sgd under a scale of 1, reporting which leaves overflowed."""
    return lossscale.loss_scaled(
        optax.sgd(0.1),
        lossscale.StaticLossScale(1.0),
        axis_name=axis_name,
        report_nonfinite=True,
        require_scaled_by=False,
    )


def local_bad_grads():
    """Per-device gradients: device 3 overflows in 'b', device 6 in 'w'."""
    w = jnp.ones((N, 4))
    b = jnp.ones((N, 2))
    return {"w": w.at[6, 1].set(jnp.inf), "b": b.at[3, 0].set(jnp.nan)}


def test_pmap_every_replica_reports_every_device_s_leaves():
    p = {"w": jnp.ones(4), "b": jnp.ones(2)}
    tx = reporting_sgd(axis_name="i")

    @functools.partial(jax.pmap, axis_name="i")
    def step(state, grads):
        return tx.update(grads, state)[1]

    state = jax.tree.map(lambda x: jnp.stack([x] * N), tx.init(p))
    state = step(state, local_bad_grads())
    flags = np.asarray(state.nonfinite)
    assert flags.shape == (N, 2)
    assert (flags == flags[:1]).all()  # every replica agrees
    assert lossscale.nonfinite_paths(state, p) == ["['b']", "['w']"]
    assert lossscale.metrics(state)["nonfinite_leaves"].tolist() == [2] * N


def test_shard_map_every_device_reports_every_device_s_leaves():
    mesh = explicit_mesh((N,), ("d",), devices=jax.devices()[:N])
    p = {"w": jnp.ones(4), "b": jnp.ones(2)}
    tx = reporting_sgd(axis_name="d")
    state = tx.init(p)
    specs = jax.tree.map(lambda _: P(), state)

    def step(state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)  # this device's row
        return tx.update(grads, state)[1]

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(specs, P("d")), out_specs=specs
        )
    )
    grads = jax.device_put(local_bad_grads(), NamedSharding(mesh, P("d")))
    state = f(jax.device_put(state, NamedSharding(mesh, P())), grads)
    assert lossscale.nonfinite_paths(state, p) == ["['b']", "['w']"]
    for shard in state.nonfinite.addressable_shards:
        assert np.asarray(shard.data).tolist() == [True, True]


@pytest.mark.parametrize("axis_type", ["explicit", "auto"])
def test_sharded_jit_reports_a_leaf_bad_in_one_shard(axis_type):
    mesh = data_model_mesh(axis_type)
    p = {"w": jnp.ones((8, 4)), "b": jnp.ones(4), "c": jnp.ones(4)}
    specs = {"w": P("data", "model"), "b": P("model"), "c": P()}
    tx = reporting_sgd()
    with set_mesh(mesh):
        placed = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k]))
            for k, v in p.items()
        }
        host = {k: np.array(v) for k, v in p.items()}
        host["w"][7, 3] = np.inf  # in one device's shard only
        grads = {
            k: jax.device_put(v, placed[k].sharding) for k, v in host.items()
        }
        _, state = jax.jit(tx.update)(grads, jax.jit(tx.init)(placed), placed)
    assert lossscale.nonfinite_paths(state, p) == ["['w']"]


def test_a_float_param_with_a_none_gradient():
    """A frozen leaf's gradient is None: the flags still line up."""
    p = {"w": jnp.ones(2), "frozen": jnp.ones(3), "b": jnp.ones(2)}
    tx = lossscale.loss_scaled(
        optax.sgd(0.1),
        lossscale.StaticLossScale(2.0),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    bad = {"w": jnp.ones(2), "frozen": None, "b": jnp.array([1.0, jnp.inf])}
    _, state = jax.jit(tx.update)(bad, tx.init(p), p)
    assert lossscale.nonfinite_paths(state, p) == ["['b']"]
    assert lossscale.nonfinite_paths(state, bad) == ["['b']"]


def test_vmapped_ensemble_counts_per_member():
    p = {"w": jnp.ones(3)}
    tx = reporting_sgd()
    states = jax.vmap(lambda _: tx.init(p))(jnp.arange(3))
    grads = {"w": jnp.ones((3, 3)).at[1, 0].set(jnp.nan)}  # member 1 only
    _, states = jax.vmap(lambda g, s: tx.update(g, s))(grads, states)
    counts = lossscale.metrics(states)["nonfinite_leaves"]
    assert counts.tolist() == [0, 1, 0]
    with pytest.raises(ValueError, match="one member's state"):
        lossscale.nonfinite_paths(states, p)
    member = jax.tree.map(lambda x: x[1], states)
    assert lossscale.nonfinite_paths(member, p) == ["['w']"]
