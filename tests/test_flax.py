"""flax NNX and linen integration."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import lossscale
from tests.helpers import assert_trees_bitwise_equal

pytestmark = pytest.mark.standard_promotion


class MLP(nnx.Module):
    """float16 compute, float32 master weights."""

    def __init__(self, rngs):
        kw = dict(dtype=jnp.float16, param_dtype=jnp.float32, rngs=rngs)
        self.l1 = nnx.Linear(4, 16, **kw)
        self.l2 = nnx.Linear(16, 1, **kw)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def data(seed=0, n=64):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [0.0]], np.float32)).astype(
        np.float32
    )
    return jnp.asarray(x), jnp.asarray(y)


def pure(tree):
    """The arrays of a tree of nnx Variables (nnx.as_pure where it exists)."""
    return lossscale._interop.unwrap_variables(tree)


def nnx_params(model):
    return jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))


class TestNNX:
    def make(self):
        model = MLP(nnx.Rngs(0))
        tx = lossscale.loss_scaled(
            optax.adamw(1e-2), lossscale.DynamicLossScale(2.0**12)
        )
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    @staticmethod
    @nnx.jit
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            pred = model(x).astype(jnp.float32)
            return jnp.mean((pred - y) ** 2)

        # The marked gradients pass through nnx.Optimizer.update.
        loss, grads = lossscale.value_and_grad(
            loss_fn, optimizer.opt_state, via=nnx.value_and_grad
        )(model)
        optimizer.update(model, grads)
        return loss, lossscale.metrics(optimizer.opt_state)

    def test_trains_in_float16(self):
        model, optimizer = self.make()
        assert model.l1.kernel.dtype == jnp.float32
        x, y = data()
        losses = [float(self.train_step(model, optimizer, x, y)[0])]
        for _ in range(60):
            loss, m = self.train_step(model, optimizer, x, y)
            losses.append(float(loss))
        assert losses[-1] < 0.2 * losses[0]
        assert int(m["skipped_steps"]) == 0
        scale = lossscale.get_loss_scale(optimizer.opt_state)
        assert isinstance(scale.loss_scale, jax.Array)  # not an nnx.Variable
        assert scale.loss_scale.dtype == jnp.float32

    def test_skipped_step_is_bitwise_noop(self):
        model, optimizer = self.make()
        x, y = data()
        self.train_step(model, optimizer, x, y)
        before = nnx_params(model)
        inner_before = jax.tree.map(
            jnp.copy, pure(optimizer.opt_state.inner_state)
        )
        _, m = self.train_step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
        assert not bool(m["grads_finite"])
        assert_trees_bitwise_equal(nnx_params(model), before)
        assert_trees_bitwise_equal(
            pure(optimizer.opt_state.inner_state), inner_before
        )
        # The contract: nnx.Optimizer.step advances on a skipped update,
        # the inner optax count does not; metrics tells them apart.
        assert int(optimizer.step[...]) == 2
        assert int(optimizer.opt_state.inner_state[0].count[...]) == 1
        applied = int(optimizer.step[...]) - int(m["skipped_steps"])
        assert applied == 1
        # Control: the next clean step changes the params.
        self.train_step(model, optimizer, x, y)
        changed = nnx_params(model)
        assert not np.array_equal(
            changed["l1"]["kernel"], before["l1"]["kernel"]
        )


def test_linen_train_state():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x)

    x, y = data()
    net = Net()
    tx = lossscale.loss_scaled(
        optax.sgd(0.05), lossscale.DynamicLossScale(2.0**12)
    )
    state = train_state.TrainState.create(
        apply_fn=net.apply, params=net.init(jax.random.key(0), x), tx=tx
    )

    @jax.jit
    def step(state, x, y):
        def loss_fn(params):
            pred = state.apply_fn(params, x).astype(jnp.float32)
            return jnp.mean((pred - y) ** 2)

        # The marked gradients pass through TrainState.apply_gradients.
        _, grads = lossscale.value_and_grad(loss_fn, state.opt_state)(
            state.params
        )
        return state.apply_gradients(grads=grads)

    state = step(state, x, y)
    before = state.params
    state = step(state, x.at[3, 1].set(jnp.nan), y)
    assert_trees_bitwise_equal(state.params, before)
    m = lossscale.metrics(state.opt_state)
    assert int(state.step) == 2 and int(m["skipped_steps"]) == 1
    assert float(m["loss_scale"]) == 2.0**11
    for _ in range(20):
        state = step(state, x, y)
    assert not np.array_equal(
        state.params["params"]["Dense_0"]["kernel"],
        before["params"]["Dense_0"]["kernel"],
    )
