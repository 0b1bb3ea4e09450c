"""FSDP under autocast: float32 master weights gathered in the narrow type,
their gradients reduced in float32 (issue 41, item 1).

An MLP whose float32 weights are sharded on their first axis over four
devices gathers each weight before its matmul, under ``jax.shard_map``
(``all_gather``) and under Explicit mesh axes (``reshard``); so do the
demo GPT's blocks (``lossscale.demo._gpt``), each layer's kernels gathered
in the scan over the layers (see the section at the end). Every reader
of the gathered weight rounds it, so autocast rounds it first and gathers
16 bits (half the bytes), while the gradient's transpose collective stays
float32. The reference for the values is the same sharded program with its
gathers in float32 (today's, kept by ``float32_scope``), not the unsharded
one: rounding commutes with moving, so the two agree to float32 rounding.

The dtypes and bytes are read with ``benchmarks/collectives.py``'s parser:
from the lowered module (what autocast's program asks for) and from the
compiled one (what XLA leaves). XLA's CPU backend widens a bfloat16
collective to float32 (it keeps float16), so the compiled CPU module is
checked with ``autocast(..., float16)``.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import lossscale
from lossscale.demo import _gpt as gpt
from tests.helpers import explicit_mesh, relative_error, set_mesh
from tests.test_benchmarks import _load

pytestmark = pytest.mark.standard_promotion

WIDTH = 128
AXIS = "fsdp"
BATCH = P(AXIS)  # the batch's spec, and every MLP weight's
F32_GATHER = 2 * (WIDTH * 4 * WIDTH) * 4  # both weights, whole, float32


def _mlp(gather):
    def loss(params, x, y):
        w1 = gather(params["w1"])
        w2 = gather(params["w2"])
        h = jax.nn.relu(x @ w1)
        return jnp.mean(jnp.square(h @ w2 - y))

    return loss


def _transposed(gather):
    # x @ w.T, as weights stored [out, in] (PyTorch's layout, a tied
    # embedding's output layer) are read.
    def loss(params, x, y):
        w1, w2 = gather(params["w1"]), gather(params["w2"])
        h = jax.nn.relu(x @ w2.T)
        return jnp.mean(jnp.square(h @ w1.T - y))

    return loss


def _rearranged(gather):
    # A chain of rearrangements between the gather and the matmul.
    def loss(params, x, y):
        w1 = gather(params["w1"])
        w2 = jnp.squeeze(jnp.expand_dims(gather(params["w2"]).T, 0), 0)
        h = jax.nn.relu(x @ w1)
        return jnp.mean(jnp.square(h @ w2.T - y))

    return loss


def _args(devices=4):
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": jax.random.normal(keys[0], (WIDTH, 4 * WIDTH)) / WIDTH**0.5,
        "w2": jax.random.normal(keys[1], (4 * WIDTH, WIDTH)) / WIDTH**0.5,
    }
    x = jax.random.normal(keys[2], (16 * devices, WIDTH))
    y = jax.random.normal(keys[3], (16 * devices, WIDTH))
    return params, x, y


def _all_gather(float32):
    def gather(w):
        if float32:
            with lossscale.float32_scope():
                return jax.lax.all_gather(w, AXIS, tiled=True)
        return jax.lax.all_gather(w, AXIS, tiled=True)

    return gather


def _reshard(float32):
    def gather(w):
        if float32:
            with lossscale.float32_scope():
                return jax.sharding.reshard(w, P())
        return jax.sharding.reshard(w, P())

    return gather


def _shard_map_step(
    dtype,
    *,
    float32_gathers=False,
    model=_mlp,
    args=_args,
    specs=BATCH,
    rules=None,
):
    """A jitted FSDP train step of ``model(gather)`` (a loss of
    ``(params, x, y)``) under ``shard_map``, and its arguments: the params
    sharded by ``specs`` (a prefix of their tree), the batch on ``AXIS``;
    ``rules``: autocast's."""
    mesh = jax.sharding.Mesh(jax.devices()[:4], (AXIS,))
    loss = model(_all_gather(float32_gathers))
    if dtype is not None:
        loss = lossscale.autocast(loss, dtype, rules=rules)

    def body(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.lax.pmean(value, AXIS), grads

    step = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, BATCH, BATCH),
            out_specs=(P(), specs),
        )
    )
    return step, args()


def _explicit_step(
    dtype, *, float32_gathers=False, model=_mlp, args=_args, specs=BATCH
):
    """``_shard_map_step``'s program under Explicit mesh axes: the gathers
    are ``reshard``s, the arguments placed by ``specs`` (the batch on
    ``AXIS``)."""
    mesh = explicit_mesh((4,), (AXIS,), jax.devices()[:4])
    loss = model(_reshard(float32_gathers))
    if dtype is not None:
        loss = lossscale.autocast(loss, dtype)
    shardings = jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        (specs, BATCH, BATCH),
        is_leaf=lambda spec: isinstance(spec, P),
    )
    placed = jax.device_put(args(), shardings)
    return mesh, jax.jit(jax.value_and_grad(loss)), placed


def _table(text):
    c = _load("collectives")
    return c.summary(c.collectives(text))


def _bytes(table, op):
    return sum(b for (o, _), (_, b) in table.items() if o == op)


def _dtypes(table, op):
    return {d for (o, d) in table if o == op}


def _results(jaxpr, name):
    """The dtypes of the results of ``name``'s equations, at any depth of
    ``jaxpr`` (a list: one per result)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            found += [str(v.aval.dtype) for v in eqn.outvars]
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _results(inner, name)
    return found


# --- shard_map + all_gather ------------------------------------------------


def test_float32_program_gathers_float32():
    # The negative control: what the parser reads when nothing is narrowed.
    step, args = _shard_map_step(None)
    lowered = step.lower(*args)
    for text in (lowered.as_text(dialect="hlo"), lowered.compile().as_text()):
        table = _table(text)
        assert _dtypes(table, "all-gather") == {"f32"}
        assert _bytes(table, "all-gather") == F32_GATHER
        assert _dtypes(table, "reduce-scatter") == {"f32"}


@pytest.mark.parametrize(
    "dtype",
    # A row-wise recipe gathers 16 bits (test_rowwise_float8_gathers_16_bits).
    [jnp.bfloat16, jnp.float16, lossscale.Float8("rowwise")],
    ids=str,
)
def test_shard_map_gathers_16_bits_and_reduce_scatters_float32(dtype):
    step, args = _shard_map_step(dtype)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert set(_results(jaxpr, "all_gather")) <= {"bfloat16", "float16"}
    assert set(_results(jaxpr, "reduce_scatter")) == {"float32"}
    table = _table(step.lower(*args).as_text(dialect="hlo"))
    assert _bytes(table, "all-gather") <= 0.5 * F32_GATHER
    assert _dtypes(table, "reduce-scatter") == {"f32"}


def test_shard_map_compiled_on_cpu_keeps_float16_gathers():
    # What XLA leaves (its CPU backend keeps float16 collectives; it
    # widens bfloat16 ones to float32, which a GPU does not).
    step, args = _shard_map_step(jnp.float16)
    table = _table(step.lower(*args).compile().as_text())
    assert _dtypes(table, "all-gather") == {"f16"}
    assert _bytes(table, "all-gather") <= 0.5 * F32_GATHER
    assert _dtypes(table, "reduce-scatter") == {"f32"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_shard_map_values_equal_the_float32_gathers(dtype):
    step, args = _shard_map_step(dtype)
    reference, _ = _shard_map_step(dtype, float32_gathers=True)
    # The reference does gather float32 (else it would prove nothing).
    ref_table = _table(reference.lower(*args).as_text(dialect="hlo"))
    assert _dtypes(ref_table, "all-gather") == {"f32"}
    (value, grads), (ref_value, ref_grads) = step(*args), reference(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for k in grads:
        assert grads[k].dtype == jnp.float32
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7)


def test_float32_reader_keeps_the_float32_gather():
    # A reader that does not round (the gathered weight added in float32)
    # keeps the gather in float32: nothing is rounded that was not before.
    mesh = jax.sharding.Mesh(jax.devices()[:4], (AXIS,))

    def loss(w, x):
        g = jax.lax.all_gather(w, AXIS, tiled=True)
        return jnp.sum(x @ g, axis=0) + jnp.sum(g, axis=0)

    f = jax.shard_map(
        lossscale.autocast(loss, jnp.bfloat16),
        mesh=mesh,
        in_specs=(P(AXIS), P(AXIS)),
        out_specs=P(AXIS),
    )
    w, x = jnp.ones((16, 8)), jnp.ones((8, 16))
    jaxpr = jax.make_jaxpr(f)(w, x).jaxpr
    assert set(_results(jaxpr, "all_gather")) == {"float32"}


# --- Explicit axes + reshard -----------------------------------------------


def _explicit_run(make_step):
    """``make_step``'s float16 program, its float32-gathers reference and
    the plain float32 program under Explicit axes: the float16 step's
    jaxpr, the three compiled modules' collectives, the results of the
    step and of the reference, and the arguments."""
    mesh, step, args = make_step(jnp.float16)
    _, reference, _ = make_step(jnp.float16, float32_gathers=True)
    _, plain, _ = make_step(None)
    with set_mesh(mesh):
        jaxpr = jax.make_jaxpr(step)(*args).jaxpr
        tables = [
            _table(f.lower(*args).compile().as_text())
            for f in (step, reference, plain)
        ]
        results = step(*args), reference(*args)
    return jaxpr, tables, results, args


def test_explicit_reshards_16_bits_and_keeps_the_values():
    run = _explicit_run(_explicit_step)
    jaxpr, (table, ref_table, plain_table), results, args = run
    (value, grads), (ref_value, ref_grads) = results
    # The forward reshard moves float16; its transpose moves float32.
    dtypes = _results(jaxpr, "reshard")
    assert dtypes.count("float16") == 2 and dtypes.count("float32") >= 2
    # Negative controls: float32 programs gather float32.
    for control in (ref_table, plain_table):
        assert _dtypes(control, "all-gather") == {"f32"}
        assert _bytes(control, "all-gather") == F32_GATHER
    assert _dtypes(table, "all-gather") == {"f16"}
    assert _bytes(table, "all-gather") <= 0.5 * F32_GATHER
    # The weight gradient's matmul contracts the sharded batch axis, and
    # JAX all-reduces its partial sums in that matmul's dtype (float16):
    # as the float32 gathers' program does, not changed here.
    assert table.get(("all-reduce", "f16")) == ref_table.get(
        ("all-reduce", "f16")
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for k in grads:
        assert grads[k].dtype == jnp.float32
        assert grads[k].sharding.is_equivalent_to(args[0][k].sharding, 2)
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-7)


# --- float8 -----------------------------------------------------------------
#
# Under a recipe that casts the weight once per tensor (tensorwise), a
# weight that only float8 matmuls read is quantised before its gather,
# with the scale of the gathered weight (a pmax of the shards' amax), and
# gathered in float8: the matmuls take that copy, so the values are those
# of the float32 gathers' program bit for bit. XLA's CPU backend widens a
# float8 collective to float16 when it compiles (float-normalization), so
# the compiled modules are read with that pass off: what the partitioned
# program moves.

F8_UNWIDENED = {"xla_disable_hlo_passes": "float-normalization-f8e4m3fn"}


def _float8_values_equal(results):
    (value, grads), (ref_value, ref_grads) = results
    assert value == ref_value
    for grad, ref_grad in zip(
        jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        assert grad.dtype == jnp.float32
        np.testing.assert_array_equal(grad, ref_grad)


# The gather's reader may be a transpose (a reshape, ...) that only the
# float8 matmul reads: the float8 copy is rearranged with it. (x @ w.T was
# gathered in bfloat16, and the matmul quantised the rounded weight, its
# gradients off by float8 quanta.)
@pytest.mark.parametrize(
    ("model", "pow2"),
    [(_mlp, False), (_mlp, True), (_transposed, False), (_rearranged, False)],
)
def test_float8_shard_map_gathers_float8_and_keeps_the_values(model, pow2):
    recipe = lossscale.Float8(power_of_two_scales=pow2)
    step, args = _shard_map_step(recipe, model=model)
    reference, _ = _shard_map_step(recipe, float32_gathers=True, model=model)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert _results(jaxpr, "all_gather") == ["float8_e4m3fn"] * 2
    assert set(_results(jaxpr, "reduce_scatter")) == {"float32"}
    # One scalar pmax a weight: the gathered weight's amax.
    assert len(_results(jaxpr, "pmax")) == 2
    lowered = step.lower(*args)
    for table in (
        _table(lowered.as_text(dialect="hlo")),
        _table(lowered.compile(F8_UNWIDENED).as_text()),
    ):
        assert _dtypes(table, "all-gather") == {"f8e4m3fn"}
        assert _bytes(table, "all-gather") == F32_GATHER // 4
        assert _dtypes(table, "reduce-scatter") == {"f32"}
        # The amax pmaxes, 4 bytes a weight, with the loss's pmean.
        assert _dtypes(table, "all-reduce") == {"f32"}
    # The reference gathers float32 (else it would prove nothing).
    ref_table = _table(reference.lower(*args).as_text(dialect="hlo"))
    assert _dtypes(ref_table, "all-gather") == {"f32"}
    _float8_values_equal((step(*args), reference(*args)))
    found = _listed_in_shard_map(model(_all_gather(False)), "tensorwise")
    assert [m.why for m in found] == [
        "float8; its weight gathered in float8_e4m3fn"
    ] * 2


@pytest.mark.parametrize("model", [_mlp, _transposed])
def test_float8_explicit_reshards_float8_and_keeps_the_values(model):
    mesh, step, args = _explicit_step(lossscale.Float8(), model=model)
    _, reference, _ = _explicit_step(
        lossscale.Float8(), float32_gathers=True, model=model
    )
    with set_mesh(mesh):
        dtypes = _results(jax.make_jaxpr(step)(*args).jaxpr, "reshard")
        table = _table(step.lower(*args).compile(F8_UNWIDENED).as_text())
        ref_table = _table(reference.lower(*args).compile().as_text())
        results = step(*args), reference(*args)
    # The forward reshards move float8; their transposes float32.
    assert dtypes.count("float8_e4m3fn") == 2 and "bfloat16" not in dtypes
    assert _dtypes(ref_table, "all-gather") == {"f32"}
    assert _dtypes(table, "all-gather") == {"f8e4m3fn"}
    assert _bytes(table, "all-gather") == F32_GATHER // 4
    # The weight gradients' partial sums over the sharded batch are
    # float32 (the float8 matmul's weight gradient is in its weight's
    # dtype), as are the amaxes' maxima.
    assert _dtypes(table, "all-reduce") == {"f32"}
    _float8_values_equal(results)
    grads, params = results[0][1], args[0]
    for k in grads:
        assert grads[k].sharding.is_equivalent_to(params[k].sharding, 2)


def test_float8_gather_between_a_float32_islands_equations():
    # w2's gather is traced between the equations of a float32 island
    # (the bias add and GELU, then ``a * 2``). It was bound inside the
    # island's checkpoint, whose output hid the gathered weight's float8
    # copy from its matmul, which quantised the gathered weight again:
    # w1's gradient then differed from the reference in 128 elements.
    def model(gather):
        def loss(params, x, y):
            w1 = gather(params["w1"])
            a = jax.nn.gelu(x @ w1 + params["b"])
            w2 = gather(params["w2"])
            return jnp.mean(jnp.square((a * 2.0) @ w2 - y))

        return loss

    def args():
        keys = jax.random.split(jax.random.key(0), 5)
        params = {
            "w1": jax.random.normal(keys[0], (WIDTH, WIDTH)) / WIDTH**0.5,
            "w2": jax.random.normal(keys[1], (WIDTH, WIDTH)) * 0.37,
            "b": jax.random.normal(keys[2], (WIDTH,)) * 0.1,
        }
        x = jax.random.normal(keys[3], (64, WIDTH))
        return params, x, jax.random.normal(keys[4], (64, WIDTH))

    specs = {"w1": BATCH, "w2": BATCH, "b": P()}
    step, arguments = _shard_map_step(
        lossscale.Float8(), model=model, args=args, specs=specs
    )
    reference, _ = _shard_map_step(
        lossscale.Float8(),
        float32_gathers=True,
        model=model,
        args=args,
        specs=specs,
    )
    jaxpr = jax.make_jaxpr(step)(*arguments).jaxpr
    assert _results(jaxpr, "all_gather") == ["float8_e4m3fn"] * 2
    _float8_values_equal((step(*arguments), reference(*arguments)))


@pytest.mark.parametrize(
    ("recipe", "why"),
    [
        ("tensorwise", "float8; its weight gathered in float8_e4m3fn"),
        (
            "rowwise",
            "float8; its weight gathered in bfloat16: the recipe scales the "
            "weight by rows, and quantises it again for the input gradient",
        ),
    ],
)
def test_matmuls_say_how_the_weight_was_gathered(recipe, why):
    found = _listed_in_shard_map(_mlp(_all_gather(False)), recipe)
    assert [(m.dtype, m.why) for m in found] == [("float8_e4m3fn", why)] * 2


@pytest.mark.parametrize(
    ("rule", "gathered"),
    [
        ("compute", "bfloat16"),
        ("float32", "float8_e4m3fn"),
        ("promote", "float8_e4m3fn"),
        ("original", "float8_e4m3fn"),
    ],
)
def test_a_transpose_under_a_rule_of_the_user_keeps_its_rule(rule, gathered):
    # rules={"transpose": "compute"}: the transposes run in bfloat16, as
    # asked, so the float8 copy cannot be carried through them (it was:
    # they ran in float32, and the gradients differed from the float32
    # gathers' program, whose matmuls quantise the rounded weight). The
    # weights are gathered rounded, which commutes with the transpose.
    # Under the other rules they run in float32, and carry the copy.
    rules = {"transpose": rule}
    step, args = _shard_map_step(
        lossscale.Float8(), model=_transposed, rules=rules
    )
    reference, _ = _shard_map_step(
        lossscale.Float8(), float32_gathers=True, model=_transposed, rules=rules
    )
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert _results(jaxpr, "all_gather") == [gathered] * 2
    _float8_values_equal((step(*args), reference(*args)))


def test_matmuls_say_why_a_transposed_weight_read_elsewhere_is_16_bits():
    # x @ w.T, and w.T sliced for a matmul too small for float8: the copy
    # cannot reach the slice, so the weight is gathered in bfloat16
    # (rounded), and the float8 matmul's entry names the reader (it said
    # only "float8" for x @ w.T: the gather was looked for as the
    # matmul's operand itself).
    def loss(params, x, y):
        w = jax.lax.all_gather(params["w2"], AXIS, tiled=True).T
        small = jnp.mean(x[:, :8] @ w[:8])
        return jnp.mean(jnp.square(x @ w - jnp.tile(y, (1, 4)))) + small

    found = _listed_in_shard_map(loss, "tensorwise")
    assert sorted((m.dtype, m.why) for m in found) == [
        ("bfloat16", "the weight's N=512, K=8 not both multiples of 16"),
        (
            "float8_e4m3fn",
            "float8; its weight gathered in bfloat16: it is read by slice, "
            "not only as float8 matmuls' weight",
        ),
    ]


def test_matmuls_follow_the_weight_out_of_a_call_to_its_gather():
    # The gather is outside a checkpointed block (a jitted helper) whose
    # matmul takes it: the weight is gathered in bfloat16, since the call
    # reads it, and the matmul's entry says so (it said only "float8":
    # the walk back to the gather stopped at the block's inputs).
    def checkpointed(params, x, y):
        w = jax.lax.all_gather(params["w1"], AXIS, tiled=True)
        block = jax.checkpoint(lambda w, x: jnp.tanh(x @ w))
        return jnp.mean(block(w, x))

    dense = jax.jit(lambda x, w: x @ w)

    def jitted(params, x, y):
        w = jax.lax.all_gather(params["w1"], AXIS, tiled=True)
        return jnp.mean(jnp.tanh(dense(x, w)))

    for loss, call in ((checkpointed, "remat2"), (jitted, "jit")):
        (found,) = _listed_in_shard_map(loss, "tensorwise")
        assert found.why == (
            f"float8; its weight gathered in bfloat16: it is read by {call}, "
            "not only as float8 matmuls' weight"
        )


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_matmuls_say_why_a_float32_weight_is_gathered_in_float32(stored):
    # The gathered weight is also an output: nothing rounds it there, so
    # a float32 weight is gathered in float32, and the matmul's entry says
    # why (it said only "float8"). A bfloat16 weight is gathered as it is
    # stored, for no reason a reader gives: its entry names none.
    def loss(params, x, y):
        w = params["w1"].astype(stored)
        w = jax.lax.all_gather(w, AXIS, tiled=True)
        return jnp.mean(jnp.square(x @ w)), w

    (found,) = _listed_in_shard_map(loss, "tensorwise")
    assert found.why == (
        "float8; its weight gathered in float32: it is read by the "
        "function's output, not only as float8 matmuls' weight"
        if stored == "float32"
        else "float8"
    )


def test_matmuls_follow_loop_inputs_to_the_gather_not_carries():
    # A while loop's body reads the gathered weights as its constants:
    # its matmuls name the gather. A scan whose carry starts as a
    # gathered weight and becomes another: not named (the carry is not
    # the gathered weight after the first step).
    def loss_while(params, x, y):
        w = jax.lax.all_gather(params["w1"], AXIS, tiled=True)

        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w) @ w.T

        return jnp.mean(jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1])

    found = _listed_in_shard_map(loss_while, "tensorwise")
    assert [m.why for m in found] == [
        "float8; its weight gathered in float32: it is read by while, "
        "not only as float8 matmuls' weight"
    ] * 2

    def loss_carry(params, x, y):
        w = jax.lax.all_gather(params["w1"], AXIS, tiled=True)[:, :WIDTH]
        other = params["w2"]  # its local shard, WIDTH x WIDTH

        def body(c, _):
            h, w = c
            return (jnp.tanh(h @ w), other), None

        (h, _), _ = jax.lax.scan(body, (x, w), None, length=3)
        return jnp.mean(h)

    (found,) = _listed_in_shard_map(loss_carry, "tensorwise")
    assert found.why == "float8"


def _listed_in_shard_map(model, recipe):
    """``lossscale.matmuls`` of the autocast ``model`` under shard_map."""
    mesh = jax.sharding.Mesh(jax.devices()[:4], (AXIS,))
    loss = lossscale.autocast(model, lossscale.Float8(recipe))
    found = []

    def body(params, x, y):
        found.extend(lossscale.matmuls(loss, params, x, y))
        return jnp.zeros(())

    jax.make_jaxpr(
        jax.shard_map(
            body, mesh=mesh, in_specs=(BATCH, BATCH, BATCH), out_specs=P()
        )
    )(*_args())
    return found


def test_float8_weight_read_elsewhere_is_gathered_in_16_bits():
    # w1 is also sliced for a matmul too small for float8 (K=8, kept in
    # the compute dtype): not every reader takes the float8 copy, so the
    # gather is bfloat16 (rounded, as every reader rounds it); w2, read by
    # its float8 matmul only, is gathered in float8 (the control).
    def model(gather):
        def loss(params, x, y):
            w1, w2 = gather(params["w1"]), gather(params["w2"])
            h = jax.nn.relu(x @ w1) + jnp.mean(x[:, :8] @ w1[:8])
            return jnp.mean(jnp.square(h @ w2 - y))

        return loss

    step, args = _shard_map_step(lossscale.Float8(), model=model)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert _results(jaxpr, "all_gather") == ["bfloat16", "float8_e4m3fn"]


def test_float8_weight_gathered_before_a_scan_is_gathered_in_16_bits():
    # The scan is the gathers' reader, not the float8 matmuls inside it:
    # the kernels are gathered rounded, in bfloat16 (float8 gathers are
    # made where the gathered weight is the matmuls' operand).
    step, args = _shard_map_step(
        lossscale.Float8(),
        model=_gathered_first(False),
        args=_gpt_args,
        specs=_gpt_specs(),
    )
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert set(_results(jaxpr, "all_gather")) == {"bfloat16"}


def test_rowwise_float8_gathered_in_16_bits_is_as_close_to_float32():
    # Under Float8("rowwise") the weight is gathered in the compute dtype
    # and quantised after (its amax the 16-bit values'), so the values are
    # not the float32 gathers' bit for bit: float8's quanta flip. Its
    # distance to the float32 program is that of the float32 gathers'.
    recipe = lossscale.Float8("rowwise")
    step, args = _shard_map_step(recipe)
    reference, _ = _shard_map_step(recipe, float32_gathers=True)
    plain, _ = _shard_map_step(None)
    (_, grads), (_, ref_grads), (_, exact) = (
        step(*args),
        reference(*args),
        plain(*args),
    )
    for k in grads:
        error = relative_error(grads[k], exact[k])
        assert error <= 1.1 * relative_error(ref_grads[k], exact[k])


# --- the demo GPT's blocks -------------------------------------------------
#
# The demo's forward (``GPT.__call__``) takes no gather hook: it merges the
# whole param tree and ``nnx.scan``s its stacked blocks. So the blocks are
# run as it runs them, with the gather where each layer reads its weights:
# ``lax.scan`` over the stacked Param state of ``make_model(...).blocks``,
# each iteration gathering that layer's kernels and calling the demo's
# ``Block`` on them (FSDP with scanned layers: one layer's weights whole at
# a time). Every 2-D weight of a layer (the kernels of qkv, attn_out, up and
# down) is sharded on its first axis; the biases and the layer norms'
# scales and offsets (1-D) are replicated. Gathering the whole stacked tree
# before the scan instead (FSDP without prefetch, and all the demo's forward
# would allow) keeps every gather float32: see the last test.

GPT = gpt.Config(layers=2, width=64, heads=4, context=8, batch=8)


def _blocks():
    """The demo GPT's blocks: their graphdef and stacked float32 params."""
    nnx = pytest.importorskip("flax.nnx")
    return nnx.split(gpt.make_model(0, GPT).blocks, nnx.Param)


def _kernels(params, gather, ndim=2):
    """``params`` with ``gather`` applied to each weight of ``ndim`` or
    more axes: a layer's kernels (the stacked tree's have ``ndim=3``)."""
    return jax.tree.map(lambda w: gather(w) if w.ndim >= ndim else w, params)


def _scan(graphdef, params, x, y, gather=lambda w: w):
    """The blocks' forward as ``GPT.__call__`` runs it (a scan over the
    stacked layers), ``gather`` applied to each layer's kernels where the
    layer reads them, and a squared error."""
    nnx = pytest.importorskip("flax.nnx")

    def layer(h, weights):
        return nnx.merge(graphdef, _kernels(weights, gather))(h), None

    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(jnp.square(h - y))


def _gpt_blocks(gather):
    graphdef, _ = _blocks()

    def loss(params, x, y):
        return _scan(graphdef, params, x, y, gather)

    return loss


def _gpt_args():
    _, params = _blocks()
    keys = jax.random.split(jax.random.key(1), 2)
    shape = (GPT.batch, GPT.context, GPT.width)
    return (
        params,
        jax.random.normal(keys[0], shape),
        jax.random.normal(keys[1], shape),
    )


def _gpt_specs():
    # A stacked kernel is [layers, in, out]: sharded on its layer's first.
    _, params = _blocks()
    return jax.tree.map(lambda w: P(None, AXIS) if w.ndim >= 3 else P(), params)


def _gpt_f32_gather():
    # One layer's kernels, whole, in float32: the scan's body gathers them
    # (one all-gather instruction per kernel, which the parser counts once
    # however many layers the scan runs).
    _, params = _blocks()
    return sum(w[0].size * 4 for w in jax.tree.leaves(params) if w.ndim >= 3)


def _gpt_shard_map_step(dtype, *, float32_gathers=False):
    return _shard_map_step(
        dtype,
        float32_gathers=float32_gathers,
        model=_gpt_blocks,
        args=_gpt_args,
        specs=_gpt_specs(),
    )


def _gpt_explicit_step(dtype, *, float32_gathers=False):
    return _explicit_step(
        dtype,
        float32_gathers=float32_gathers,
        model=_gpt_blocks,
        args=_gpt_args,
        specs=_gpt_specs(),
    )


def test_gpt_blocks_float32_program_gathers_float32():
    # The negative control: 196,608 bytes (the four kernels of a layer of
    # width 64) gathered in float32, their gradients reduce-scattered and
    # the replicated weights' (biases, layer norms) all-reduced in float32.
    step, args = _gpt_shard_map_step(None)
    lowered = step.lower(*args)
    for text in (lowered.as_text(dialect="hlo"), lowered.compile().as_text()):
        table = _table(text)
        assert _dtypes(table, "all-gather") == {"f32"}
        assert _bytes(table, "all-gather") == _gpt_f32_gather()
        assert _dtypes(table, "reduce-scatter") == {"f32"}
        assert _dtypes(table, "all-reduce") == {"f32"}


def test_gpt_blocks_shard_map_gathers_16_bits_and_reduces_float32():
    step, args = _gpt_shard_map_step(jnp.bfloat16)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert set(_results(jaxpr, "all_gather")) == {"bfloat16"}
    assert set(_results(jaxpr, "reduce_scatter")) == {"float32"}
    table = _table(step.lower(*args).as_text(dialect="hlo"))
    assert _dtypes(table, "all-gather") == {"bf16"}
    assert _bytes(table, "all-gather") <= 0.5 * _gpt_f32_gather()
    # Every gradient collective is float32: the kernels' reduce-scatters
    # and the replicated weights' all-reduces (with the loss's pmean).
    assert _dtypes(table, "reduce-scatter") == {"f32"}
    assert _dtypes(table, "all-reduce") == {"f32"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=str)
def test_gpt_blocks_shard_map_values_equal_the_float32_gathers(dtype):
    step, args = _gpt_shard_map_step(dtype)
    reference, _ = _gpt_shard_map_step(dtype, float32_gathers=True)
    lowered = step.lower(*args)
    ref_lowered = reference.lower(*args)
    # The reference does gather float32 (else it would prove nothing).
    ref_table = _table(ref_lowered.as_text(dialect="hlo"))
    assert _dtypes(ref_table, "all-gather") == {"f32"}
    assert _bytes(ref_table, "all-gather") == _gpt_f32_gather()
    if dtype == jnp.float16:
        # What XLA leaves: its CPU backend keeps float16 collectives (it
        # widens bfloat16 ones to float32, which a GPU does not).
        table = _table(lowered.compile().as_text())
        assert _dtypes(table, "all-gather") == {"f16"}
        assert _bytes(table, "all-gather") <= 0.5 * _gpt_f32_gather()
        assert _dtypes(table, "reduce-scatter") == {"f32"}
        assert _dtypes(table, "all-reduce") == {"f32"}
    (value, grads), (ref_value, ref_grads) = step(*args), reference(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for grad, ref_grad in zip(
        jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        assert grad.dtype == jnp.float32
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_gpt_blocks_explicit_reshards_16_bits_and_keeps_the_values():
    run = _explicit_run(_gpt_explicit_step)
    jaxpr, (table, ref_table, plain_table), results, args = run
    (value, grads), (ref_value, ref_grads) = results
    # The forward reshards (a layer's four kernels) move float16; their
    # transposes move float32.
    dtypes = _results(jaxpr, "reshard")
    assert dtypes.count("float16") == 4 and dtypes.count("float32") >= 4
    # Negative controls: float32 programs gather float32.
    for control in (ref_table, plain_table):
        assert _dtypes(control, "all-gather") == {"f32"}
        assert _bytes(control, "all-gather") == _gpt_f32_gather()
    assert _dtypes(table, "all-gather") == {"f16"}
    assert _bytes(table, "all-gather") <= 0.5 * _gpt_f32_gather()
    # As for the MLP, each kernel's gradient matmul contracts the sharded
    # batch axis and JAX all-reduces its partial sums in that matmul's
    # dtype (float16), as the float32 gathers' program does: not changed
    # here. The replicated weights' gradients are all-reduced in float32.
    assert table.get(("all-reduce", "f16")) == ref_table.get(
        ("all-reduce", "f16")
    )
    assert table.get(("all-reduce", "f32")) == ref_table.get(
        ("all-reduce", "f32")
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    pairs = zip(
        jax.tree.leaves(grads),
        jax.tree.leaves(ref_grads),
        jax.tree.leaves(args[0]),
        strict=True,
    )
    for grad, ref_grad, param in pairs:
        assert grad.dtype == jnp.float32
        assert grad.sharding.is_equivalent_to(param.sharding, param.ndim)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_gpt_blocks_float8_gathers_float8_and_keeps_the_values():
    # Each layer's four kernels gathered in float8 in the scan's body, at a
    # quarter of float32's bytes (and one scalar pmax each), under
    # shard_map and under Explicit axes; the values are the float32
    # gathers' bit for bit; every gradient collective is float32.
    step, args = _gpt_shard_map_step(lossscale.Float8())
    reference, _ = _gpt_shard_map_step(lossscale.Float8(), float32_gathers=True)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert set(_results(jaxpr, "all_gather")) == {"float8_e4m3fn"}
    table = _table(step.lower(*args).as_text(dialect="hlo"))
    assert _dtypes(table, "all-gather") == {"f8e4m3fn"}
    assert _bytes(table, "all-gather") == _gpt_f32_gather() // 4
    assert _dtypes(table, "reduce-scatter") == {"f32"}
    assert _dtypes(table, "all-reduce") == {"f32"}
    ref_table = _table(reference.lower(*args).as_text(dialect="hlo"))
    assert _dtypes(ref_table, "all-gather") == {"f32"}
    _float8_values_equal((step(*args), reference(*args)))

    mesh, step, args = _gpt_explicit_step(lossscale.Float8())
    _, reference, _ = _gpt_explicit_step(
        lossscale.Float8(), float32_gathers=True
    )
    with set_mesh(mesh):
        table = _table(step.lower(*args).compile(F8_UNWIDENED).as_text())
        results = step(*args), reference(*args)
    assert _dtypes(table, "all-gather") == {"f8e4m3fn"}
    assert _bytes(table, "all-gather") == _gpt_f32_gather() // 4
    assert _dtypes(table, "all-reduce") == {"f32"}
    _float8_values_equal(results)


def _gathered_first(float32):
    """The blocks' loss with the whole stacked kernels gathered before the
    scan over the layers (FSDP without prefetch; the demo's forward takes
    no gather hook): the scan is the gathered kernels' reader, and every
    use inside it is a matmul's operand. ``float32``: the gathers kept
    float32 (the reference)."""
    graphdef, _ = _blocks()

    def gather(w):
        with lossscale.float32_scope() if float32 else contextlib.nullcontext():
            return jax.lax.all_gather(w, AXIS, axis=1, tiled=True)

    def model(_):
        def loss(params, x, y):
            return _scan(graphdef, _kernels(params, gather, ndim=3), x, y)

        return loss

    return model


def test_gpt_blocks_gathered_before_the_scan_gather_16_bits():
    # Autocast looks through the scan: its body rounds the kernels at
    # every use, so they are gathered rounded (before, they were gathered
    # in float32: 393,216 bytes, as the reference below still does).
    def step(float32):
        return _shard_map_step(
            jnp.float16,
            model=_gathered_first(float32),
            args=_gpt_args,
            specs=_gpt_specs(),
        )

    (step16, args), (reference, _) = step(False), step(True)
    whole = 2 * _gpt_f32_gather()  # both layers' kernels, float32
    jaxpr = jax.make_jaxpr(step16)(*args).jaxpr
    assert set(_results(jaxpr, "all_gather")) == {"float16"}
    assert set(_results(jaxpr, "reduce_scatter")) == {"float32"}
    ref_table = _table(reference.lower(*args).as_text(dialect="hlo"))
    assert _dtypes(ref_table, "all-gather") == {"f32"}
    assert _bytes(ref_table, "all-gather") == whole
    table = _table(step16.lower(*args).compile().as_text())
    assert _dtypes(table, "all-gather") == {"f16"}
    assert _bytes(table, "all-gather") == whole // 2
    assert _dtypes(table, "reduce-scatter") == {"f32"}
    (value, grads), (ref_value, ref_grads) = step16(*args), reference(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for grad, ref_grad in zip(
        jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True
    ):
        assert grad.dtype == jnp.float32
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-7)


def test_a_weight_passed_twice_to_a_jit_keeps_its_float32_use():
    # One operand of the jit is only multiplied (rounded), the other adds
    # the weight to a float32 value: the gather must stay float32. (It was
    # gathered rounded: the operand's rounded position was found among
    # the jit's operands for both of its uses.)
    @jax.jit
    def inner(a, b, x):
        return jnp.sum(x @ a) + jnp.sum(b * jnp.float32(1e-3))

    def loss(params, x, y):
        w = jax.lax.all_gather(params["w1"], AXIS, tiled=True)
        return inner(w, w, x) + jnp.sum(y) * 0

    step, args = _shard_map_step(jnp.bfloat16, model=lambda _: loss)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert set(_results(jaxpr, "all_gather")) == {"float32"}

    # The negative control: used once, by the matmul only, it is gathered
    # rounded.
    def rounded_only(params, x, y):
        w = jax.lax.all_gather(params["w1"], AXIS, tiled=True)
        return inner(w, jnp.zeros_like(w), x) + jnp.sum(y) * 0

    step, args = _shard_map_step(jnp.bfloat16, model=lambda _: rounded_only)
    jaxpr = jax.make_jaxpr(step)(*args).jaxpr
    assert "bfloat16" in _results(jaxpr, "all_gather")
