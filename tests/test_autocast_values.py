"""Values autocast got wrong where float32 is right (issue 32), against
plain JAX's, with the dtypes read from the jaxprs."""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import equations
from jax import lax

import lossscale

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)


def _dots(jaxpr):
    return [e for e in equations(jaxpr) if e.primitive.name == "dot_general"]


def test_a_matmul_asking_for_a_float32_result_of_16_bit_operands_keeps_it():
    # Hand-written mixed-precision attention: scores of 16-bit q and k
    # accumulated to float32 (102400 here). Autocast re-bound the einsum
    # with a float16 result: inf.
    def scores(x, wq, wk):
        q = (x @ wq).astype(jnp.float16)
        k = (x @ wk).astype(jnp.float16)
        s = jnp.einsum("bqd,bkd->bqk", q, k, preferred_element_type=jnp.float32)
        return jnp.max(s)

    x = jnp.ones((2, 4, 64))
    wq = wk = jnp.full((64, 64), 40.0 / 64)
    expected = jax.jit(scores)(x, wq, wk)
    assert float(expected) == 102400.0  # the premise: float16 cannot hold it
    f = lossscale.autocast(scores, jnp.float16)
    np.testing.assert_array_equal(jax.jit(f)(x, wq, wk), expected)
    *_, einsum = _dots(jax.make_jaxpr(f)(x, wq, wk))
    assert [np.dtype(v.aval.dtype) for v in einsum.invars] == [F16, F16]
    assert einsum.params["preferred_element_type"] == F32
    # The negative control: a plain einsum of the same 16-bit operands is
    # rounded to the compute dtype, as every matmul is.

    def plain(x, wq, wk):
        q = (x @ wq).astype(jnp.float16)
        return jnp.einsum("bqd,bkd->bqk", q, q)

    *_, einsum = _dots(jax.make_jaxpr(lossscale.autocast(plain))(x, wq, wk))
    assert einsum.params["preferred_element_type"] == F16


class _Count(NamedTuple):
    t: jax.Array
    done: jax.Array
    i: jax.Array


def _count_to(s, step, cap):
    """Steps of ``step`` from ``s`` until ``t >= s + 1``, the stopping flag
    computed in the body (the condition reads no float)."""

    def cond(c):
        return ~c.done & (c.i < cap)

    def body(c):
        t = c.t + step
        return _Count(t, t >= s + 1, c.i + 1)

    out = lax.while_loop(cond, body, _Count(s, jnp.array(False), 0))
    return out.i, out.t


@pytest.mark.parametrize("start", [1.0, 0.0])
def test_a_loop_stopping_on_a_flag_its_body_computes_stops_where_float32_does(
    start,
):
    # Issue 32: t += 1e-3 from an activation s = 4.5 toward s + 1 never
    # stopped in float16 (4.5 + 1e-3 rounds to 4.5); from 0 it took 512
    # iterations instead of 1001.
    def f(x, w):
        s = (x @ w)[0, 0] * start  # an activation (start is a constant)
        return _count_to(s, 1e-3, 2000)

    x, w = jnp.ones((1, 3)), jnp.full((3, 1), 1.5)
    n, t = jax.jit(f)(x, w)
    n16, t16 = jax.jit(lossscale.autocast(f, jnp.float16))(x, w)
    assert int(n) < 2000  # the premise: float32 stops by itself
    assert int(n16) == int(n)
    np.testing.assert_array_equal(t16, t)


def test_a_newton_solve_with_a_converged_flag_takes_float32_s_steps():
    # Newton's method for sqrt(a), a from a matmul, stopping when the step
    # falls below a tolerance float16 cannot resolve: a flag the body sets.
    class State(NamedTuple):
        x: jax.Array
        converged: jax.Array
        i: jax.Array

    def solve(w, v):
        a = (w @ v)[0, 0]

        def body(s):
            step = (s.x * s.x - a) / (2 * s.x)
            return State(s.x - step, jnp.abs(step) < 1e-6 * a, s.i + 1)

        out = lax.while_loop(
            lambda s: ~s.converged & (s.i < 100),
            body,
            State(a, jnp.array(False), 0),
        )
        return out.x, out.i

    w, v = jnp.full((1, 4), 300.0), jnp.full((4, 1), 0.83)
    x, n = jax.jit(solve)(w, v)
    x16, n16 = jax.jit(lossscale.autocast(solve, jnp.float16))(w, v)
    assert int(n) < 100
    assert int(n16) == int(n)
    np.testing.assert_array_equal(x16, x)


def test_only_the_stopping_decision_of_a_loop_widens():
    # The carries the decision does not depend on are cast as everywhere:
    # an activation carried through a fixed number of layers stays 16-bit.
    class State(NamedTuple):
        h: jax.Array
        t: jax.Array
        done: jax.Array

    def f(w, x):
        def body(s):
            t = s.t + 1e-3
            return State(jnp.tanh(s.h @ w), t, t >= 1.0)

        h0 = x @ w
        out = lax.while_loop(
            lambda s: ~s.done, body, State(h0, h0[0, 0] * 0, jnp.array(False))
        )
        return jnp.sum(out.h), out.t

    w, x = jnp.full((4, 4), 0.1), jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(lossscale.autocast(f, jnp.float16))(w, x)
    (loop,) = [e for e in equations(jaxpr) if e.primitive.name == "while"]
    n = loop.params["cond_nconsts"] + loop.params["body_nconsts"]
    h, t, _ = (np.dtype(v.aval.dtype) for v in loop.invars[n:])
    assert (h, t) == (F16, F32)
    _, t16 = jax.jit(lossscale.autocast(f, jnp.float16))(w, x)
    np.testing.assert_array_equal(t16, jax.jit(f)(w, x)[1])


def test_eager_calls_tell_minus_zero_from_zero_and_hit_on_nan():
    # Python floats were keyed with ==: after f(x, 0.0), f(x, -0.0) reused
    # the program compiled for 0.0 (inf where plain JAX gives -inf), and a
    # nan argument never hit the cache.
    traces = []

    def f(x, s):
        traces.append(s)
        return 1 / (x * s)

    g = lossscale.autocast(f, jnp.float16)
    x = jnp.ones(2)
    assert np.all(np.isposinf(g(x, 0.0)))
    assert np.all(np.isneginf(g(x, -0.0)))
    assert len(traces) == 2
    g(x, float("nan"))
    g(x, float("nan"))
    assert len(traces) == 3  # nan is one value


def test_a_boolean_mask_as_a_multiply_keeps_the_activation_16_bit():
    # Dropout written as a multiply: the mask converted to float32 held
    # only 0 and 1, but was classed float32, and the activation with it.
    def f(w, x, key):
        h = x @ w
        keep = jax.random.bernoulli(key, 0.9, h.shape)
        h = h * keep.astype(jnp.float32) / 0.9
        return jnp.sum(h @ w)

    w, x, key = jnp.full((4, 4), 0.1), jnp.ones((2, 4)), jax.random.key(0)
    jaxpr = jax.make_jaxpr(lossscale.autocast(f, jnp.float16))(w, x, key)
    # (bernoulli's own, inside its jit, are not the mask's multiply)
    muls = [e for e in jaxpr.eqns if e.primitive.name in ("mul", "div")]
    assert [np.dtype(e.outvars[0].aval.dtype) for e in muls] == [F16, F16]
    np.testing.assert_allclose(
        lossscale.autocast(f, jnp.float16)(w, x, key),
        f(w, x, key),
        rtol=2e-3,
    )
    # The negative control: int32 values (positions) converted to float32
    # may not fit float16, and widen the product.

    def g(w, x, positions):
        h = x @ w
        return jnp.sum(h * positions.astype(jnp.float32))

    positions = jnp.arange(4)
    jaxpr = jax.make_jaxpr(lossscale.autocast(g, jnp.float16))(w, x, positions)
    (mul,) = [e for e in equations(jaxpr) if e.primitive.name == "mul"]
    assert np.dtype(mul.outvars[0].aval.dtype) == F32


class JittedOrNot(chex.TestCase):
    """The same values and dtypes called eagerly and under jax.jit (the
    eager path compiles a program of its own: it must be the same one)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_gradients_are_float32_s_within_bfloat16_rounding(self):
        def loss(params, x):
            h = jax.nn.gelu(x @ params["w1"] + params["b1"])
            return jnp.mean((h @ params["w2"]) ** 2)

        keys = jax.random.split(jax.random.key(0), 3)
        params = {
            "w1": jax.random.normal(keys[0], (16, 32)) / 4,
            "b1": jnp.zeros(32),
            "w2": jax.random.normal(keys[1], (32, 8)) / 6,
        }
        x = jax.random.normal(keys[2], (8, 16))
        grads = self.variant(jax.grad(lossscale.autocast(loss, jnp.bfloat16)))
        got, want = grads(params, x), jax.grad(loss)(params, x)
        chex.assert_trees_all_equal_dtypes(got, want)
        chex.assert_trees_all_close(got, want, rtol=3e-2, atol=2e-3)
