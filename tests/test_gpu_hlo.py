"""What loss scaling adds to a step on a GPU, read without one.

Two levels. The StableHLO that ``jax.export`` lowers for CUDA on this CPU
machine needs nothing but JAX: its reductions are the finiteness check's.
The kernels of XLA's optimized GPU module (``benchmarks/gpu_hlo.py``)
need the CUDA plugin of this jaxlib (CI's ``.venv-gpu-hlo`` stage has it);
without it those tests skip, saying so.
"""

import importlib.util
import math
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import export

import lossscale
from lossscale import _finite
from tests.helpers import explicit_mesh, set_mesh

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "gpu_hlo", ROOT / "benchmarks" / "gpu_hlo.py"
)
gpu_hlo = importlib.util.module_from_spec(spec)
sys.modules["gpu_hlo"] = gpu_hlo  # its dataclass looks its module up
spec.loader.exec_module(gpu_hlo)

# adam's bias correction is not written for strict promotion.
adam = pytest.mark.standard_promotion


def _params(leaves, dtypes=(jnp.float32,)):
    # 128 to 192 elements a leaf: more than the flags any check combines.
    return {
        f"w{i:03d}": jnp.full((16, 8 + i % 5), 0.5, dtypes[i % len(dtypes)])
        for i in range(leaves)
    }


def _update(**kwargs):
    tx = lossscale.loss_scaled(
        optax.adam(1e-3),
        lossscale.DynamicLossScale(),
        require_scaled_by=False,
        **kwargs,
    )

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return tx, step


_REDUCE = re.compile(
    r"stablehlo\.reduce\(.*?\) applies .*?: \(tensor<((?:\d+x)*)[a-z]\w*>"
)


def _reduced(text):
    """The element counts of every ``stablehlo.reduce``'s first operand
    whose operand has more than 64 elements (the gradients' checks, not the
    combining of their flags)."""
    counts = [
        math.prod(int(d) for d in dims.split("x") if d)
        for dims in _REDUCE.findall(text)
    ]
    return [n for n in counts if n > 64]


def one_device():
    """A one-device mesh in context: as on a machine with one GPU, where
    leaves are concatenated (with no mesh, the tests' eight simulated CPUs
    hide the leaves' sharding and each leaf is reduced alone)."""
    return set_mesh(jax.make_mesh((1,), ("x",), devices=jax.devices()[:1]))


def gpu_check(leaves):
    """``_gpu_all_finite(leaves)`` jitted on one device, after checking that
    it concatenates (so that a test of it cannot pass on per-leaf checks)."""
    with one_device():
        jaxpr = jax.make_jaxpr(_finite._gpu_all_finite)(leaves)
        assert "concatenate" in str(jaxpr)
        return bool(jax.jit(_finite._gpu_all_finite)(leaves))


def _reductions(platform, leaves, dtypes=(jnp.float32,), **kwargs):
    """The gradient checks of the update lowered for ``platform`` on a
    one-device mesh (as on a machine with one GPU), and the gradients'
    total element count."""
    tx, step = _update(**kwargs)
    params = _params(leaves, dtypes)
    with one_device():
        exported = export.export(jax.jit(step), platforms=(platform,))(
            params, tx.init(params), params
        )
    size = sum(x.size for x in jax.tree.leaves(params))
    return _reduced(exported.mlir_module()), size


@adam
@pytest.mark.parametrize("leaves", [1, 4, 40, 64, 65, 160])
def test_gpu_checks_every_leaf_in_one_reduction_per_64(leaves):
    """On CUDA the check concatenates the gradients into one reduction per
    _GPU_OPERANDS leaves: 1 for up to 64 leaves, where flax's DynamicScale
    and optax.apply_if_finite reduce each leaf (2 kernels each on GPU)."""
    assert _finite._GPU_OPERANDS == 64
    for platform in ("cuda", "rocm"):
        reduced, size = _reductions(platform, leaves)
        assert len(reduced) == math.ceil(leaves / 64)
        assert sum(reduced) == size  # every gradient element checked once


@adam
def test_gpu_concatenates_16_and_32_bit_leaves_together():
    """bfloat16 and float16 gradients are widened to float32 (exactly) and
    checked with the float32 ones: still one reduction."""
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    reduced, size = _reductions("cuda", 30, dtypes)
    assert reduced == [size]


@adam
def test_negative_controls_reduce_per_leaf():
    """The count sees per-leaf checks where they are: per-leaf flags
    (report_nonfinite) take a reduction per leaf on CUDA, and so does a
    leaf whose sharding the trace cannot see."""
    reduced, size = _reductions("cuda", 40, report_nonfinite=True)
    assert len(reduced) == 40
    assert sum(reduced) == size
    # Eight devices and no mesh in context: the types do not say which
    # leaves are split, and each is reduced alone.
    assert jax.device_count() > 1
    tx, step = _update()
    params = _params(40)
    exported = export.export(jax.jit(step), platforms=("cuda",))(
        params, tx.init(params), params
    )
    assert len(_reduced(exported.mlir_module())) == 40


def test_gpu_check_is_exact_for_every_leaf_and_dtype():
    """The concatenated check, run (on CPU, from the CUDA branch's own
    function), finds one inf or NaN in any leaf of any dtype, and calls a
    float64 leaf beyond float32's range finite (it is not narrowed)."""
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    leaves = [jnp.full((4, 2 + i), 1.0, dtypes[i % 3]) for i in range(70)]
    assert gpu_check(leaves)
    for i in (0, 1, 2, 63, 64, 69):
        for bad in (jnp.inf, -jnp.inf, jnp.nan):
            poisoned = list(leaves)
            poisoned[i] = poisoned[i].at[1, 1].set(bad)
            assert not gpu_check(poisoned), (i, bad)
    with jax.enable_x64(True) if hasattr(jax, "enable_x64") else _x64():
        big = [jnp.full((3,), 1e300, jnp.float64)] * 2 + [jnp.ones(2)]
        assert gpu_check(big)
        big[1] = big[1].at[0].set(jnp.inf)
        assert not gpu_check(big)


def test_gpu_check_concatenates_each_8_bit_format_apart():
    """float8 leaves are widened and concatenated with their own format
    only (XLA compiled one fusion of several such formats 10 to 40 times
    slower); 16-bit leaves go with the float32 ones."""
    formats = (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16, jnp.float32)
    leaves = [
        jnp.ones((16, 8 + i), formats[i % len(formats)]) for i in range(40)
    ]
    with one_device():
        exported = export.export(
            jax.jit(_finite._gpu_all_finite), platforms=("cuda",)
        )(leaves)
    sizes = {
        dtype: sum(x.size for x in leaves if x.dtype == dtype)
        for dtype in formats
    }
    assert sorted(_reduced(exported.mlir_module())) == sorted(
        [
            sizes[jnp.float8_e4m3fn],
            sizes[jnp.float8_e5m2],
            sizes[jnp.bfloat16] + sizes[jnp.float32],
        ]
    )


def test_gpu_check_takes_8_bit_floats_under_strict_promotion():
    """float8 (and float4) gradients are widened to float32 explicitly:
    ``jnp.promote_types`` refuses them, and strict promotion (these tests'
    default) refuses any implicit promotion, bfloat16's too. A float8 NaN
    (e4m3fn has no inf) is found, a finite float8 leaf passes."""
    small = [jnp.float8_e4m3fn, jnp.float8_e5m2]
    if hasattr(jnp, "float4_e2m1fn"):
        small.append(jnp.float4_e2m1fn)
    for dtype in small:
        ok = jnp.ones((3, 2), dtype)
        assert gpu_check([ok, ok, jnp.ones(4, jnp.bfloat16), jnp.ones(2)])
    for dtype in (jnp.float8_e4m3fn, jnp.float8_e5m2):
        bad = jnp.ones((3, 2), dtype).at[2, 1].set(jnp.nan)
        assert not gpu_check([jnp.ones((3, 2), dtype), bad])
    ok = jnp.ones((4,), jnp.float8_e5m2)
    bad = jnp.ones((3, 2), jnp.float8_e5m2).at[0, 0].set(jnp.inf)
    assert not gpu_check([ok, bad, jnp.ones(5)])


def _x64():
    from jax.experimental import enable_x64

    return enable_x64()


def test_gpu_check_keeps_sharded_leaves_apart():
    """A leaf sharded in its type (explicit axes) is reduced alone, not
    concatenated (which would move it between devices); the replicated
    ones still share one reduction."""
    from jax.sharding import PartitionSpec as P

    mesh = explicit_mesh((8,), ("x",))
    with set_mesh(mesh):
        sharded = jax.device_put(jnp.ones((16, 8)), P("x", None))
        replicated = [
            jax.device_put(jnp.ones((13, i + 1)), P()) for i in range(5)
        ]
        exported = export.export(
            jax.jit(_finite._gpu_all_finite), platforms=("cuda",)
        )([sharded, *replicated])
    assert sorted(_reduced(exported.mlir_module())) == sorted(
        [sum(x.size for x in replicated), sharded.size]
    )


# --- the optimized GPU module (needs the CUDA plugin) -----------------------

WHY = gpu_hlo.unavailable("h200")
needs_plugin = pytest.mark.skipif(WHY is not None, reason=f"{WHY}")

HLO = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %f = f32[8]{0} fusion(%x), kind=kLoop, calls=%c
  %g = f32[8]{0} custom-call(%f, %f), custom_call_target="__cublas$gemm"
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %g)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] fusion(%p), kind=kLoop, calls=%d
}

%dsf (w: f8e4m3fn[4,8], x: f8e4m3fn[8,8]) -> (f32[8,8], s8[64]) {
  %w = f8e4m3fn[4,8]{1,0} parameter(0)
  %x = f8e4m3fn[8,8]{1,0} parameter(1)
  %slice = f8e4m3fn[1,8]{1,0} dynamic-slice(%w), dynamic_slice_sizes={1,8}
  ROOT %gemm = (f32[8,8]{1,0}, s8[64]{0}) custom-call(%slice, %x), \
custom_call_target="__cublas$lt$matmul$f8", \
backend_config={"gemm_backend_config":\
{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"]}}}
}

%fused_dynamic_update_slice (b: f32[4,8], i: s32[], a: f32[8]) -> f32[4,8] {
  %b = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %a = f32[8]{0} parameter(2)
  %row = f32[1,8]{1,0} bitcast(%a)
  %zero = s32[] constant(0)
  ROOT %u = f32[4,8]{1,0} dynamic-update-slice(%b, %row, %i, %zero)
}

%fused_slice_tanh (b: f32[4,8], i: s32[]) -> f32[1,8] {
  %b = f32[4,8]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = f32[1,8]{1,0} dynamic-slice(%b, %i, %zero), dynamic_slice_sizes={1,8}
  ROOT %t = f32[1,8]{1,0} tanh(%row)
}

%yes (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %y = f32[8]{0} custom-call(%p, %p), custom_call_target="__cublas$gemm"
}

%no (p: f32[8]) -> f32[8] {
  ROOT %p = f32[8]{0} parameter(0)
}

ENTRY %main (a: f32[8], b: f32[4,8], i: s32[], p: pred[]) -> (s32[], f32[8]) {
  %a = f32[8]{0} parameter(0)
  %b = f32[4,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %r = pred[] fusion(%a), kind=kInput, calls=%e
  %s = ((f32[4,8]{1,0}, s32[], f32[8]{0}), f32[4,8]{1,0}, u32[]) \
fusion-start(%b, %i, %a), kind=kLoop, calls=%fused_dynamic_update_slice
  %d = f32[4,8]{1,0} fusion-done(%s)
  %q = (f32[8,8]{1,0}, s8[64]{0}) fusion(%b, %a), kind=kCustom, calls=%dsf
  %t = f32[1,8]{1,0} fusion(%b, %i), kind=kLoop, calls=%fused_slice_tanh
  %p = pred[] parameter(3)
  %k = f32[8]{0} conditional(%p, %a, %a), true_computation=%yes, \
false_computation=%no
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, \
backend_config={"known_trip_count":{"n":"12"}}
  ROOT %c = f32[8]{0} copy(%a)
}
"""


def test_census_counts_a_loop_body_per_iteration():
    """A hand-written module: the reduction, the asynchronous in-place
    update (one kernel, its -done launches none), a float8 GEMM on a
    dynamic slice (a fusion around a cuBLASLt call: the GEMM), a fusion
    that slices a row of a buffer, a boolean conditional (its true
    branch's GEMM counted, as if taken), the copy, and the loop's body (a
    fusion and a GEMM) 12 times and its condition 13."""
    found = gpu_hlo.census(HLO)
    assert dict(found.kinds) == {
        "fusion:kInput": 1,
        "copy": 1,
        "fusion:kLoop": 1 + 1 + 12 + 13,
        "custom-call:__cublas$lt$matmul$f8": 1,
        "custom-call:__cublas$gemm": 1 + 12,
        "conditional": 1,
    }
    assert (found.total, found.static, found.gemms, found.loops) == (
        44, 10, 14, [12],
    )  # fmt: skip
    assert found.fp8_gemms == 1
    # Its multiply-adds: an 8 x 8 result, each over the slice's 8 columns.
    assert dict(found.flops) == {"f8": 2 * 8 * 8 * 8}
    # The reduction reads 32 bytes and writes 1; the update reads its
    # index and row (4 + 32) and writes the row (32), not the 128-byte
    # buffer; the slicing fusion reads its index and a row (4 + 32) and
    # writes a row (32); the copy 32 and 32; each loop fusion 32 + 32 (the
    # condition's reads its tuple: 36 + 1).
    assert found.bytes == 33 + 68 + 68 + 64 + 12 * 64 + 13 * 37


@needs_plugin
def test_census_of_a_compiled_matmul():
    """``tanh(a @ b).sum()`` compiles for the H200 into GEMMs and
    reductions that the census sees; nothing ran on a GPU."""
    a = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    hlo, compiled = gpu_hlo.compile_hlo(
        lambda a, b: jnp.tanh(a @ b).sum(), a, a
    )
    found = gpu_hlo.census(hlo)
    assert found.gemms == 1
    assert found.reductions >= 1
    assert gpu_hlo.device_kind() == "NVIDIA H200"
    assert compiled.memory_analysis() is not None


@adam
@needs_plugin
def test_loss_scaling_adds_a_constant_number_of_gpu_kernels():
    """What the loss-scaled adam step adds to plain optax's kernels on the
    H200 does not grow with the leaves (4, 40, 64), and flax's
    DynamicScale, which reduces each leaf (in two kernels: leaves of 25_000
    elements, as the benchmark's 1M parameters in 40 leaves, are large
    enough that XLA splits their reductions), adds two kernels per leaf:
    the negative control, the census sees them."""
    names = ("plain optax", "lossscale", "flax DynamicScale")
    added, flax_added = {}, {}
    for leaves in (4, 40, 64):
        rows = gpu_hlo.optimizer_census(25_000 * leaves, leaves, "h200", names)
        base = rows["plain optax"].total
        added[leaves] = rows["lossscale"].total - base
        flax_added[leaves] = rows["flax DynamicScale"].total - base
        assert rows["lossscale"].reductions == 2  # one split reduction
        assert rows["flax DynamicScale"].reductions == 2 * leaves
    assert added[4] == added[40] == added[64] <= 16, added
    assert flax_added[64] - added[64] > 100, (flax_added, added)


def _has_cudnn():
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        fa.check_cudnn_version()
    except Exception:  # no plugin, or no cuDNN library beside it
        return False
    return True


@needs_plugin
@pytest.mark.skipif(
    WHY is not None or not _has_cudnn(),
    reason="cuDNN's library (nvidia-cudnn-cu13, which jax[cuda13] brings; "
    "CI's .venv-gpu-hlo has it) is not installed beside the CUDA plugin",
)
def test_autocast_keeps_cudnn_flash_attention():
    """The autocast guide's recipe: q, k and v rounded to bfloat16 by hand
    into ``jax.nn.dot_product_attention(implementation="cudnn")``; under
    autocast the compiled gradient (for the H200) holds cuDNN's fused
    attention, forward and backward, and no [time, time] tensor."""

    def attention(q, k, v):
        half = jnp.bfloat16
        out = jax.nn.dot_product_attention(
            q.astype(half), k.astype(half), v.astype(half),
            is_causal=True, implementation="cudnn",
        )  # fmt: skip
        return out.astype(q.dtype)

    def loss(w, x):
        q = jnp.einsum("btd,dhk->bthk", x, w)
        return jnp.mean(attention(q, q, q) ** 2)

    w = jax.ShapeDtypeStruct((64, 4, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((2, 256, 64), jnp.float32)
    grad = jax.grad(lossscale.autocast(loss, jnp.bfloat16))
    hlo, _ = gpu_hlo.compile_hlo(grad, w, x, compiler_options=gpu_hlo.CUBLAS)
    kinds = gpu_hlo.census(hlo).kinds
    assert kinds["custom-call:__cudnn$fmhaSoftmax"] == 1
    assert kinds["custom-call:__cudnn$fmhaSoftmaxBackward"] == 1
    assert "256,256]" not in hlo  # no scores written out


@needs_plugin
@pytest.mark.xfail(
    jax.__version_info__[:2] == (0, 11),
    reason="jax 0.11's XLA:GPU (dynamic-slice fusion on by default) "
    "computes a GEMM twice where its result is both used in the scan's "
    "body and stacked as a residual (the demo GPT's autocast step: two "
    "a layer; cast by hand: none); openxla/xla#45799 (in jax 0.12) "
    "reroutes the other users instead",
    strict=True,
)
@pytest.mark.standard_promotion  # flax's layers and optax's loss
def test_autocast_adds_no_gemm_to_the_model_cast_by_hand():
    """The demo GPT's bfloat16 train step (two scanned layers) compiled
    for the H200: autocast's cuBLAS GEMMs are those of the model cast by
    hand (flax's ``dtype=``), as many and with the same FLOPs (jax 0.10.2
    and 0.12.1: 39 each; jax 0.11.2: 43 against 39, the xfail's reason)."""
    bench = gpu_hlo._sibling("float8")
    config = bench.gpt.Config(layers=2, width=128, heads=4, context=64, batch=2)

    def gemms(**kwargs):
        step, args, _ = bench.build(bench.REFERENCE, config, **kwargs)
        hlo, _ = gpu_hlo.compile_hlo(
            step, *args, compiler_options=gpu_hlo.CUBLAS
        )
        found = gpu_hlo.census(hlo)
        return found.gemms, dict(found.flops)

    auto, by_hand = gemms(), gemms(hand_cast=jnp.bfloat16)
    assert by_hand[0] >= 6 * config.layers  # the census saw the GEMMs
    assert auto == by_hand


@needs_plugin
@pytest.mark.standard_promotion  # optax's cross-entropy
def test_autocast_lm_head_memory_on_the_gpu_compile():
    """tests/test_autocast_memory.py's language-model head, compiled for
    the H200: autocast's gradient holds no more than the hand-cast one's
    temporary memory (1.1x is the target) and less than float32's, with
    XLA:GPU's fusions (jax 0.12.1: 49.2 MB each against float32's 65.5;
    jax 0.10.2: 32.8 against 49.2 and 65.5)."""
    from tests import test_autocast_memory as head

    embedding = jax.ShapeDtypeStruct((head.VOCAB, head.WIDTH), jnp.float32)
    h = jax.ShapeDtypeStruct((head.TOKENS, head.WIDTH), jnp.float32)

    def temp(loss):
        _, compiled = gpu_hlo.compile_hlo(
            jax.grad(loss), embedding, h, compiler_options=gpu_hlo.CUBLAS
        )
        return compiled.memory_analysis().temp_size_in_bytes

    f32, by_hand = temp(head.lm_head), temp(head.lm_head_by_hand)
    auto = temp(lossscale.autocast(head.lm_head, jnp.float16))
    assert auto <= 1.10 * by_hand, (auto / 1e6, by_hand / 1e6, f32 / 1e6)
    assert auto < f32, (auto / 1e6, f32 / 1e6)


_STABLEHLO_DOT = re.compile(
    r"stablehlo.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> "
    r"(tensor<[^>]*>)"
)


def _dense_float8_grad(recipe, compute_dtype=jnp.bfloat16):
    """A float8 dense layer's loss and gradients, and its arguments' shapes
    (a bfloat16 input, a float32 weight)."""
    from lossscale._autocast import _fp8

    dims = (((1,), (0,)), ((), ()))
    config = lossscale.Float8(recipe, compute_dtype=compute_dtype)

    def loss(x, w):
        y = _fp8.dot_general(x, w, dims, config)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    x = jax.ShapeDtypeStruct((256, 128), compute_dtype)
    w = jax.ShapeDtypeStruct((128, 512), jnp.float32)
    return jax.value_and_grad(loss, argnums=(0, 1)), (x, w)


def _stablehlo_dots(recipe, platform):
    step, args = _dense_float8_grad(recipe)
    exported = export.export(jax.jit(step), platforms=(platform,))(*args)
    return [
        tuple(re.sub(r"tensor<[\dx]*x", "", t).rstrip(">") for t in types)
        for types in _STABLEHLO_DOT.findall(exported.mlir_module())
    ]


def test_cuda_lowers_per_tensor_float8_products_dequantised():
    """Lowered for CUDA (on any machine), a per-tensor float8 product is
    one matmul in its result's dtype of operands dequantised into it (what
    XLA rewrites into a cuBLASLt float8 GEMM that writes that dtype): the
    forward's and the bfloat16 input's gradient in bfloat16, the float32
    weight's in float32. Lowered for CPU, the same program is written with
    float8 operands and float32 results; row-wise scales are written so on
    CUDA too (the negative control)."""
    bf16, f32, e4, e5 = "bf16", "f32", "f8E4M3FN", "f8E5M2"
    assert _stablehlo_dots("tensorwise", "cuda") == [
        (bf16, bf16, bf16), (bf16, bf16, bf16), (f32, f32, f32),
    ]  # fmt: skip
    assert _stablehlo_dots("tensorwise", "cpu") == [
        (e4, e4, f32), (e5, e4, f32), (e5, e4, f32),
    ]  # fmt: skip
    assert _stablehlo_dots("rowwise", "cuda") == [(e4, e4, f32)] * 3


_FP8_GEMM = re.compile(
    r"= \((\w+)\[([\d,]*)\]\{[^}]*\}, s8\[\d+\]\{0\}\) "
    r"custom-call\(([^)]*)\), custom_call_target=\"__cublas\$lt\$matmul\$f8\""
)


def _fp8_gemms(recipe, compute_dtype=jnp.bfloat16):
    """The cuBLASLt float8 GEMMs of a float8 dense layer's gradient
    compiled for the H200: (result type, operands) of each."""
    step, (x, w) = _dense_float8_grad(recipe, compute_dtype)
    hlo, _ = gpu_hlo.compile_hlo(step, x, w, compiler_options=gpu_hlo.CUBLAS)
    return sorted(
        (f"{dtype}[{shape}]", [a.strip() for a in operands.split(",")])
        for dtype, shape, operands in _FP8_GEMM.findall(hlo)
    )


@needs_plugin
def test_per_tensor_float8_gemms_take_both_scales_and_write_the_result():
    """On CUDA a per-tensor float8 product is written as XLA's rewriter
    wants it (each operand dequantised into the result's dtype): each
    cuBLASLt GEMM takes both operands' inverse scales (no constant 1
    among its scale operands) and writes the product's dtype itself (the
    forward's and the bfloat16 input's gradient in bfloat16, the float32
    weight's in float32), with no float32 result cast by another kernel.
    The negative controls: per-row scales cannot be a GEMM's, and those
    GEMMs write float32 for a kernel to scale; nor do float16 products'
    (their inverse scales would flush in float16 where a GPU has no
    float8 GEMM), but the float32 weight's gradient."""
    gemms = _fp8_gemms("tensorwise")
    assert [result for result, _ in gemms] == [
        "bf16[256,128]", "bf16[256,512]", "f32[128,512]",
    ]  # fmt: skip
    for _, operands in gemms:
        assert len(operands) == 4, operands  # a, b, a's scale, b's scale
        assert not any(o.startswith("%constant") for o in operands), operands
    rowwise = _fp8_gemms("rowwise")
    assert len(rowwise) == 3
    assert all(result.startswith("f32[") for result, _ in rowwise), rowwise
    half = _fp8_gemms("tensorwise", jnp.float16)
    assert [result for result, _ in half] == [
        "f32[128,512]", "f32[256,128]", "f32[256,512]",
    ]  # fmt: skip
