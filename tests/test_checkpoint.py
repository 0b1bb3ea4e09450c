"""Checkpointing: orbax and flax.serialization, resumed bit-for-bit."""

import pathlib
import subprocess
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import lossscale
from tests.helpers import assert_trees_bitwise_equal

pytestmark = pytest.mark.standard_promotion

STEPS = 8


def make_tx():
    return lossscale.loss_scaled(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        lossscale.DynamicLossScale(
            2.0**8, growth_interval=2, hysteresis=2, min_loss_scale=2.0
        ),
        require_scaled_by=False,
    )


def batches():
    rng = np.random.default_rng(0)
    out = []
    for i in range(STEPS):
        x = rng.normal(size=(16, 3)).astype(np.float32)
        if i in (1, 2, 5):  # overflowing steps exercise every counter
            x[0, 0] = np.inf
        out.append(jnp.asarray(x))
    return out


def init_params(seed):
    return {"w": jnp.asarray(np.random.default_rng(seed).normal(size=(3, 2)))}


@jax.jit
def step(params, opt_state, x):
    tx = make_tx()
    scale = lossscale.get_loss_scale(opt_state)

    def loss_fn(p):
        h = x.astype(jnp.float16) @ p["w"].astype(jnp.float16)
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grads = jax.grad(lambda p: scale.scale(loss_fn(p)))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def train(params, opt_state, xs):
    for x in xs:
        params, opt_state = step(params, opt_state, x)
    return params, opt_state


def straight_and_first_half():
    xs = batches()
    params = init_params(0)
    opt_state = make_tx().init(params)
    straight = train(params, opt_state, xs)
    half = train(params, opt_state, xs[: STEPS // 2])
    m = lossscale.metrics(straight[1])
    assert int(m["skipped_steps"]) == 3  # the run exercised skipping
    return xs, straight, half


def fresh_target():
    """What a new process builds before restoring: other values entirely."""
    params = init_params(1)
    return params, make_tx().init(params)


def test_orbax_resume_is_bitwise(tmp_path: pathlib.Path):
    xs, straight, half = straight_and_first_half()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": half[0], "opt": half[1]})
    target = fresh_target()
    abstract = jax.tree.map(
        ocp.utils.to_shape_dtype_struct,
        {"params": target[0], "opt": target[1]},
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", abstract)
    ls = lossscale.get_loss_scale(restored["opt"])
    assert isinstance(ls, lossscale.DynamicLossScale)
    assert (ls.growth_interval, ls.hysteresis, ls.min_loss_scale) == (2, 2, 2.0)
    assert_trees_bitwise_equal(restored["opt"], half[1])
    resumed = train(restored["params"], restored["opt"], xs[STEPS // 2 :])
    assert_trees_bitwise_equal(resumed, straight)


def test_flax_serialization_resume_is_bitwise():
    xs, straight, half = straight_and_first_half()
    blob = serialization.to_bytes({"params": half[0], "opt": half[1]})
    target = fresh_target()
    restored = serialization.from_bytes(
        {"params": target[0], "opt": target[1]}, blob
    )
    assert_trees_bitwise_equal(restored["opt"], half[1])
    resumed = train(restored["params"], restored["opt"], xs[STEPS // 2 :])
    assert_trees_bitwise_equal(resumed, straight)
    # Control: resuming from the fresh target instead diverges.
    other = train(target[0], target[1], xs[STEPS // 2 :])
    assert not np.array_equal(other[0]["w"], straight[0]["w"])


class StateOf01(NamedTuple):
    """lossscale 0.1's LossScaledState: the fields it had, in its order.

    Checkpoints store field names and leaves, not the class: a state saved
    as this one is byte for byte what 0.1 wrote (checked against 0.1's own
    output when 0.2 was made).
    """

    loss_scale: Any
    inner_state: Any
    grads_finite: Any
    skipped_steps: Any
    consecutive_skips: Any
    steps: Any
    last_skip_step: Any


def as_01(state):
    return StateOf01(*state[: len(StateOf01._fields)])


FIELDS_01 = lossscale.LossScaledState._fields[:7]


def target_01(state):
    """The recipe's restore target: 0.1's fields, as a dict."""
    return {name: getattr(state, name) for name in FIELDS_01}


def test_orbax_restores_a_checkpoint_of_01(tmp_path: pathlib.Path):
    xs, straight, half = straight_and_first_half()
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"params": half[0], "opt": as_01(half[1])})
    params, opt = fresh_target()
    with ocp.StandardCheckpointer() as ckpt, pytest.raises(ValueError):
        ckpt.restore(  # control: the 0.2 state as the target
            tmp_path / "ckpt",
            jax.tree.map(
                ocp.utils.to_shape_dtype_struct, {"params": params, "opt": opt}
            ),
        )
    abstract = jax.tree.map(
        ocp.utils.to_shape_dtype_struct,
        {"params": params, "opt": target_01(opt)},
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", abstract)
    restored["opt"] = lossscale.LossScaledState(**restored["opt"])
    assert_trees_bitwise_equal(restored["opt"], half[1])
    resumed = train(restored["params"], restored["opt"], xs[STEPS // 2 :])
    assert_trees_bitwise_equal(resumed, straight)


def test_flax_bytes_of_01_restore_through_the_same_recipe():
    xs, straight, half = straight_and_first_half()
    blob = serialization.to_bytes({"params": half[0], "opt": as_01(half[1])})
    params, opt = fresh_target()
    with pytest.raises(ValueError, match="field names"):  # control
        serialization.from_bytes({"params": params, "opt": opt}, blob)
    restored = serialization.from_bytes(
        {"params": params, "opt": target_01(opt)}, blob
    )
    restored["opt"] = lossscale.LossScaledState(**restored["opt"])
    assert_trees_bitwise_equal(restored["opt"], half[1])
    resumed = train(restored["params"], restored["opt"], xs[STEPS // 2 :])
    assert_trees_bitwise_equal(resumed, straight)


class StateOf02(NamedTuple):
    """lossscale 0.2's LossScaledState: 0.1's fields, then two more."""

    loss_scale: Any
    inner_state: Any
    grads_finite: Any
    skipped_steps: Any
    consecutive_skips: Any
    steps: Any
    last_skip_step: Any
    nonfinite: Any = None
    min_scale_skips: Any = None


def erroring_tx():
    return lossscale.loss_scaled(
        optax.sgd(0.1),
        lossscale.DynamicLossScale(8.0),
        on_min_scale="error",
        require_scaled_by=False,
    )


@pytest.mark.parametrize("how", ["orbax", "flax"])
def test_a_checkpoint_of_02_with_on_min_scale_error_restores(how, tmp_path):
    # 0.3 added grad_norm and stale_scale_skips (the latter an int32 leaf
    # with on_min_scale="error"): 0.2's checkpoint restores into a dict of
    # its fields, completed by the fresh target's new ones.
    tx = erroring_tx()
    params = init_params(0)
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full((3, 2), jnp.inf)}, state, params)
    saved = StateOf02(*state[: len(StateOf02._fields)])
    target = tx.init(init_params(1))
    fields = {name: getattr(target, name) for name in StateOf02._fields}
    if how == "orbax":
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(tmp_path / "ckpt", {"opt": saved})
        with ocp.StandardCheckpointer() as ckpt, pytest.raises(ValueError):
            ckpt.restore(  # control: the 0.3 state as the target
                tmp_path / "ckpt",
                jax.tree.map(ocp.utils.to_shape_dtype_struct, {"opt": target}),
            )
        with ocp.StandardCheckpointer() as ckpt:
            restored = ckpt.restore(
                tmp_path / "ckpt",
                jax.tree.map(ocp.utils.to_shape_dtype_struct, {"opt": fields}),
            )["opt"]
    else:
        blob = serialization.to_bytes(saved)
        with pytest.raises(ValueError, match="field names"):  # control
            serialization.from_bytes(target, blob)
        restored = serialization.from_bytes(fields, blob)
    restored = target._replace(**restored)
    assert_trees_bitwise_equal(restored, state)
    assert int(restored.stale_scale_skips) == 0
    _, after = tx.update({"w": jnp.ones((3, 2))}, restored, params)
    assert int(after.steps) == 2 and int(after.skipped_steps) == 1


def test_orbax_saves_and_restores_a_state_with_every_option(tmp_path):
    params = init_params(0)
    tx = lossscale.loss_scaled(
        optax.sgd(1.0),
        lossscale.DynamicLossScale(),
        report_nonfinite=True,
        on_min_scale="error",
        require_scaled_by=False,
    )
    state = tx.init(params)
    _, state = jax.jit(tx.update)(
        {"w": jnp.full((3, 2), jnp.inf)}, state, params
    )
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", {"opt": state})
    target = jax.tree.map(
        ocp.utils.to_shape_dtype_struct, {"opt": tx.init(init_params(1))}
    )
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "ckpt", target)
    assert_trees_bitwise_equal(restored["opt"], state)
    assert lossscale.nonfinite_paths(restored["opt"], params) == ["['w']"]


def test_flax_state_dict_names_the_leaves():
    ls = lossscale.DynamicLossScale(8.0)
    state = serialization.to_state_dict(ls)
    assert set(state) == {"loss_scale", "growth_tracker", "hysteresis_tracker"}
    with pytest.raises(ValueError, match="lacks"):
        serialization.from_state_dict(ls, {"loss_scale": np.float32(2.0)})


def test_no_pickle_in_the_package():
    root = pathlib.Path(lossscale.__file__).parent
    for path in root.rglob("*.py"):
        assert "pickle" not in path.read_text(), path


ROUND_TRIP = """
import jax.numpy as jnp
import optax
from flax import serialization
import lossscale
tx = lossscale.loss_scaled(optax.adam(0.1), lossscale.DynamicLossScale(8.0))
state = tx.init({"w": jnp.ones(2)})
state = state._replace(loss_scale=state.loss_scale.adjust(jnp.bool_(False)))
restored = serialization.from_bytes(
    tx.init({"w": jnp.zeros(2)}), serialization.to_bytes(state)
)
assert float(restored.loss_scale.loss_scale) == 4.0, restored
print("ok")
"""


def run_fresh(code):
    """Runs ``code`` in a new Python process; returns its stdout."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=pathlib.Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_lossscale_does_not_import_flax():
    out = run_fresh("import sys, lossscale; print('flax' in sys.modules)")
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "first", ["import lossscale", "import flax.serialization"]
)
def test_flax_serialization_in_either_import_order(first):
    assert run_fresh(first + "\n" + ROUND_TRIP).strip() == "ok"


def test_a_state_dict_of_another_loss_scale_is_refused():
    dynamic = serialization.to_state_dict(lossscale.DynamicLossScale(8.0))
    with pytest.raises(ValueError, match="growth_tracker"):
        serialization.from_state_dict(lossscale.StaticLossScale(1.0), dynamic)
    static = serialization.to_state_dict(lossscale.StaticLossScale(4.0))
    with pytest.raises(ValueError, match="lacks"):
        serialization.from_state_dict(lossscale.DynamicLossScale(), static)
    restored = serialization.from_state_dict(
        lossscale.StaticLossScale(1.0), static
    )
    assert float(restored.loss_scale) == 4.0  # control: the right kind fits


def test_a_target_with_an_option_the_checkpoint_lacks(tmp_path):
    params = init_params(0)
    plain_tx = make_tx()
    plain = plain_tx.init(params)
    reporting = lossscale.loss_scaled(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        lossscale.DynamicLossScale(),
        report_nonfinite=True,
        require_scaled_by=False,
    )
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "plain", {"opt": plain})
        ckpt.save(tmp_path / "reporting", {"opt": reporting.init(params)})
    with ocp.StandardCheckpointer() as ckpt:
        by_orbax = ckpt.restore(
            tmp_path / "plain",
            jax.tree.map(
                ocp.utils.to_shape_dtype_struct,
                {"opt": reporting.init(params)},
            ),
        )["opt"]
        dropped = ckpt.restore(
            tmp_path / "reporting",
            jax.tree.map(ocp.utils.to_shape_dtype_struct, {"opt": plain}),
        )["opt"]
    by_flax = serialization.from_bytes(
        reporting.init(params), serialization.to_bytes(plain)
    )
    # The field comes back as saved, and the first update names the option.
    for restored in (by_orbax, by_flax):
        assert restored.nonfinite is None
        with pytest.raises(ValueError, match="report_nonfinite=True"):
            reporting.update(params, restored, params)
    alarmed = lossscale.loss_scaled(
        optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)),
        lossscale.DynamicLossScale(),
        on_min_scale="error",
        require_scaled_by=False,
    )
    restored = serialization.from_bytes(
        alarmed.init(params), serialization.to_bytes(plain)
    )
    assert restored.min_scale_skips is None
    with pytest.raises(ValueError, match='on_min_scale="error"'):
        alarmed.update(params, restored, params)
    # Dropping the option just works.
    assert dropped.nonfinite is None
    plain_tx.update(params, dropped, params)
