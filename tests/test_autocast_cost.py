"""What autocast costs at trace time and when called again (issue 32):
constants folded without computing large ones, nothing re-traced or
re-compiled that JAX would not re-trace, inline wrappers JAX's caches
recognise, and eager bookkeeping that is thread-safe. Traces and compiles
are counted with chex and with JAX's own monitoring events."""

from __future__ import annotations

import contextlib
import math
import threading
import time
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles, equations

import lossscale
from lossscale import _compat
from lossscale._autocast import _fold

F16 = jnp.float16


def _spy_folds(monkeypatch):
    """The output sizes of every equation autocast folds at trace time."""
    folded = []
    real = _compat.bind_equation

    def spy(eqn, invals, params=None):
        outs = real(eqn, invals, params)
        if not any(_compat.is_tracer(x) for x in outs):
            folded.append((eqn, max(math.prod(np.shape(x)) for x in outs)))
        return outs

    monkeypatch.setattr(_compat, "bind_equation", spy)
    return folded


def test_large_constants_are_not_computed_at_trace_time(monkeypatch):
    # A long-context mask or a KV cache made by jnp.full/jnp.zeros was
    # computed (258 MiB for 8192 x 8192) before its size was checked.
    def f(w, x):
        mask = jnp.full((512, 512), 0.5)
        small = jnp.full((4, 4), 0.25) * 2
        return jnp.sum(x @ w) + jnp.sum(mask) + jnp.sum(small)

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    folded = _spy_folds(monkeypatch)
    jax.make_jaxpr(lossscale.autocast(f, jnp.float16))(w, x)
    assert folded, "the premise: small constants are still folded"
    assert max(size for _, size in folded) <= _fold.FOLD_SIZE


def test_each_equation_is_folded_once_per_plan(monkeypatch):
    # The fixed point iterates its rounds over the jaxpr: a constant was
    # computed again in every round.
    def f(w, x):
        c = jnp.full((8,), 2.0) * 3.0 + 1.0
        h = jnp.tanh(x @ w) * c[:4]
        return jnp.sum(jnp.exp(h - jnp.max(h)))

    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    folded = _spy_folds(monkeypatch)
    jax.make_jaxpr(lossscale.autocast(f, jnp.float16))(w, x)
    eqns = [id(eqn) for eqn, _ in folded]
    assert eqns and len(eqns) == len(set(eqns))


@pytest.fixture
def blocks():
    @jax.jit
    def block(h, w):
        return jax.nn.gelu(h @ w) + h

    def loss(w, x):
        for _ in range(3):
            x = block(x, w)
        return jnp.mean(x**2)

    return loss, jnp.full((8, 8), 0.1), jnp.ones((4, 8))


def test_eager_grad_of_an_autocast_function_compiles_nothing_again(blocks):
    # The plan caches were emptied after each call: every inner jax.jit
    # was re-emitted as a new jaxpr and compiled again on every call
    # (4 compiles and 2.2 s a call, against none for plain JAX).
    loss, w, x = blocks
    grad = jax.grad(lossscale.autocast(loss, jnp.float16))
    plain = jax.grad(loss)
    grad(w, x), plain(w, x)  # warm
    with count_compiles() as ours:
        for _ in range(3):
            grad(w, x)
    with count_compiles() as theirs:
        for _ in range(3):
            plain(w, x)
    assert theirs["compiles"] == 0  # the premise: plain JAX compiles none
    assert ours["compiles"] == 0


def test_autocast_written_inline_compiles_once(blocks):
    # autocast(f) was a new, incomparable function every call, so
    # jax.jit(autocast(loss))(...) compiled on every call.
    loss, w, x = blocks
    counted = chex.assert_max_traces(loss, n=1)
    for _ in range(3):
        jax.jit(lossscale.autocast(counted, jnp.float16))(w, x)


def test_autocast_wrappers_compare_by_function_and_configuration(blocks):
    loss, _, _ = blocks
    a = lossscale.autocast(loss, jnp.float16)
    b = lossscale.autocast(loss, "float16")
    assert a == b and hash(a) == hash(b)
    assert a is b  # the same wrapper while loss lives
    assert a != lossscale.autocast(loss, jnp.bfloat16)
    assert a != lossscale.autocast(loss, jnp.float16, output_dtype=jnp.float16)
    assert a != lossscale.autocast(loss, rules={"tanh": "float32"})
    assert a != lossscale.autocast(lambda w, x: loss(w, x))
    # Equal wrappers of a function that cannot be interned (a bound
    # method) compare equal too.

    class Model:
        def loss(self, w, x):
            return loss(w, x)

    model = Model()
    c, d = lossscale.autocast(model.loss), lossscale.autocast(model.loss)
    assert c == d and hash(c) == hash(d) and c is not d


def _eager_calls_from_threads(locked):
    """Eight threads calling one autocast function eagerly, 100 times each
    with two values of a static argument: the values each trace saw, and
    the results."""
    traces = []
    lock = threading.Lock()

    def loss(w, x, t):
        with lock:
            traces.append(t)
        # Tracing takes a while (a real model's does): the window between
        # a thread's cache miss and its compiled program's store, where
        # another thread would miss too and compile again.
        time.sleep(0.02)
        return jnp.sum(jnp.tanh(x @ w) / t)

    f = lossscale.autocast(loss, jnp.float16)
    if not locked:  # the negative control: the eager layer without its lock
        f._lock = contextlib.nullcontext()
    w, x = jnp.full((8, 8), 0.1), jnp.ones((4, 8))
    results, errors = {}, []

    def work(k):
        try:
            for i in range(100):
                t = (1.0, 2.0)[i % 2]
                results[(k, t)] = np.asarray(f(w, x, t))
        except Exception as err:  # pragma: no cover - the failure shown
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if locked:  # unlocked, a race may as well raise as compile again
        assert not errors
    return sorted(traces), results


def test_eager_calls_from_threads_share_one_compilation():
    # The eager layer's bookkeeping was not thread-safe: a cached
    # compilation was taken out and put back on every call, and a thread
    # calling in between missed it and compiled again. Its lock holds a
    # key's entry from the miss to the store, so each value of the static
    # argument is traced once, whichever thread comes first.
    traces, results = _eager_calls_from_threads(locked=True)
    assert traces == [1.0, 2.0]
    for (_, t), value in results.items():
        np.testing.assert_array_equal(value, results[(0, t)])
    # Without the lock, threads that miss together each trace (and the
    # eager layer warns of the recompilations).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        traces, _ = _eager_calls_from_threads(locked=False)
    assert len(traces) > 2 and set(traces) == {1.0, 2.0}, traces


def test_many_static_values_warn_once_that_each_compiles():
    def loss(x, t):
        return jnp.sum(x / t)

    f = lossscale.autocast(loss, jnp.float16)
    x = jnp.ones(4)
    for t in (1.0, 2.0, 3.0, 4.0):  # no warning yet (errors in tests)
        f(x, t)
    with pytest.warns(UserWarning, match="compiled for 5 different values"):
        f(x, 5.0)
    f(x, 6.0)  # once
    # The negative control: the same values again compile nothing.
    with count_compiles() as counts:
        for t in (3.0, 4.0, 5.0, 6.0):
            f(x, t)
    assert counts["compiles"] == 0


def test_an_eager_call_donates_what_the_program_donates():
    # Eager calls were compiled by a jax.jit of their own, inside which an
    # inner jit's donation is ignored: the buffer the user gave up stayed.
    @jax.jit
    def plain(x, y):
        return x * 2 + y

    donating = jax.jit(plain, donate_argnums=0)
    x, y = jnp.ones((64, 64)), jnp.ones((64, 64))
    donating(x, y)
    assert x.is_deleted()  # the premise: plain JAX donates here

    def f(x, y):
        return donating(x, y)

    x = jnp.ones((64, 64))
    np.testing.assert_array_equal(
        lossscale.autocast(f, jnp.float16)(x, y), jnp.full((64, 64), 3.0)
    )
    assert x.is_deleted() and not y.is_deleted()
    # The negative control: nothing donated, nothing deleted.
    x = jnp.ones((64, 64))
    lossscale.autocast(lambda x, y: plain(x, y), jnp.float16)(x, y)
    assert not x.is_deleted()


# --- float32 islands under jax.grad ----------------------------------------


def _island_checkpoints(fn, *args):
    """The checkpoints autocast put around float32 islands in ``fn``'s
    jaxpr (JAX's remat equations under the islands' name scope)."""
    from lossscale._autocast._islands import SCOPE

    return [
        eqn
        for eqn in equations(jax.make_jaxpr(fn)(*args))
        if "prevent_cse" in eqn.params and SCOPE in _compat.name_stack(eqn)
    ]


def _layer_args(layers=4, width=32):
    keys = jax.random.split(jax.random.key(0), 3)
    p = {
        "w": jax.random.normal(keys[0], (layers, width, width)) / width**0.5,
        "b": jax.random.normal(keys[1], (layers, width)),
    }
    return p, jax.random.normal(keys[2], (8, width))


def test_a_float32_run_that_keeps_nothing_gets_no_checkpoint():
    # A bias add and a scaling of a float16 matmul's result, read in
    # float32: their derivative keeps nothing, so a checkpoint would only
    # cost trace time (it cost 48 of the 120 checkpoints of the trace
    # benchmark's 24 transformer layers). A tanh keeps its result: that
    # island keeps its checkpoint (the negative control).
    def linear(p, x):
        return jnp.sum(((x @ p["w"][0]) + p["b"][0]) * 0.5)

    def bounded(p, x):
        return jnp.sum(jnp.tanh(((x @ p["w"][0]) + p["b"][0]) * 0.5))

    p, x = _layer_args()
    assert _island_checkpoints(lossscale.autocast(linear, F16), p, x) == []
    assert len(_island_checkpoints(lossscale.autocast(bounded, F16), p, x)) == 1
    want = jax.grad(linear)(p, x)
    got = jax.grad(lossscale.autocast(linear, F16))(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)


def test_each_layer_of_stacked_parameters_shares_one_island():
    # Unrolled layers over stacked parameters (p["b"][i]): the slice of
    # each layer's bias used to be recomputed inside that layer's island,
    # making every layer's island a jaxpr of its own (its own trace and
    # derivative: 23 of the 29 island transposes of the trace benchmark).
    # Bound before the checkpoint, it leaves one island jaxpr for all.
    def layers(p, x):
        for i in range(p["w"].shape[0]):
            x = jnp.tanh(x @ p["w"][i] + p["b"][i])
        return jnp.sum(x)

    p, x = _layer_args()
    found = _island_checkpoints(lossscale.autocast(layers, F16), p, x)
    assert len(found) == 4
    # The last layer's island takes the loss's sum in too: one of its own.
    assert len({id(eqn.params["jaxpr"]) for eqn in found[:-1]}) == 1
    want = jax.grad(layers)(p, x)
    got = jax.grad(lossscale.autocast(layers, F16))(p, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


def _jvp_rule_calls(monkeypatch, primitive):
    """How many times JAX runs ``primitive``'s JVP rule."""
    from jax.interpreters import ad

    calls = []
    real = ad.primitive_jvps[primitive]

    def spy(*args, **kwargs):
        calls.append(primitive)
        return real(*args, **kwargs)

    monkeypatch.setitem(ad.primitive_jvps, primitive, spy)
    return calls


@pytest.mark.parametrize(
    "primitive", [jax.lax.dot_general_p, jax.lax.convert_element_type_p]
)
def test_a_deep_model_linearizes_its_matmuls_and_casts_once_per_shape(
    monkeypatch, primitive
):
    # jnp.matmul is an inline jax.jit: under jax.grad JAX linearizes its
    # jaxpr once and keeps it. Autocast traced it inlined, and bound each
    # layer's dot_general (and the casts of its operands) bare, which JAX
    # linearized at every layer: twice plain JAX's linearizations on the
    # Mamba-2 blocks of benchmarks/autocast_trace.py. They are bound as
    # inline calls of their own now: linearized once per shape, however
    # deep the model, and the program is the same equations.
    def layers(p, x):
        for i in range(p["w"].shape[0]):
            x = jnp.tanh(x @ p["w"][i] + p["b"][i])
        return jnp.sum(x)

    calls = _jvp_rule_calls(monkeypatch, primitive)

    def linearized(fn, depth):
        calls.clear()
        jax.clear_caches()
        jax.jit(jax.grad(fn)).lower(*_layer_args(layers=depth))
        return len(calls)

    auto = lossscale.autocast(layers, F16)
    counts = {depth: linearized(auto, depth) for depth in (4, 8)}
    assert counts[4] == counts[8], counts
    if primitive is jax.lax.dot_general_p:
        # Two: the first layer's input has no tangent, the others' have.
        assert counts[4] == linearized(layers, 8) == 2
    else:
        assert linearized(layers, 8) == 0, (
            "the premise: plain JAX casts nothing"
        )
        assert counts[4] > 0
    # Inlined where staged: no call of autocast's own is left, and plain
    # JAX's trace is the same after autocast's (JAX's caches hold nothing
    # of autocast's).
    p, x = _layer_args()
    jax.clear_caches()
    plain_jaxpr = str(jax.make_jaxpr(jax.grad(layers))(p, x))
    jaxpr = jax.make_jaxpr(jax.grad(auto))(p, x)
    names = {e.params.get("name") for e in equations(jaxpr)}
    assert not names & {"dot_general", "convert_element_type"}
    assert str(jax.make_jaxpr(jax.grad(layers))(p, x)) == plain_jaxpr
