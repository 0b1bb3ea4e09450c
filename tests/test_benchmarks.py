"""The benchmark runs (--quick). A smoke test: timings are not asserted."""

import gzip
import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "step_overhead", ROOT / "benchmarks" / "step_overhead.py"
)
step_overhead = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step_overhead)


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_quick_benchmark_writes_every_section(tmp_path):
    out = tmp_path / "RESULTS.md"
    report = step_overhead.main(["--quick", "--out", str(out)])
    assert out.read_text() == report
    for section in (
        "Optimizer-only step",
        "finite path",
        "skip path",
        "Full train step",
        "Compile time",
        "Peak memory",
        "A transformer train step",
        "Kernels in the compiled step",
    ):
        assert section in report
    for variant in step_overhead.OPTIMIZER_VARIANTS:
        assert f"| {variant} |" in report
    assert "| trace ms | lower + compile ms |" in report
    assert "| unscale + all_finite, no skip |" in report
    ratios = [float(r) for r in re.findall(r"\| ([0-9.]+) \|\n", report)]
    assert ratios and all(r > 0 for r in ratios)


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_quick_autocast_benchmark_reports_every_variant(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "autocast_benchmark", ROOT / "benchmarks" / "autocast.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "autocast.md"
    report = bench.main(["--quick", "--out", str(out)])
    assert out.read_text() == report
    for variant in bench.VARIANTS:
        assert f"| {variant} |" in report


@pytest.mark.slow
def test_autocast_trace_benchmark_reports_every_program(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "autocast_trace", ROOT / "benchmarks" / "autocast_trace.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(
        "sys.argv", ["autocast_trace.py", "--repeats", "1", "--small"]
    )
    bench.main()
    report = capsys.readouterr().out
    names = [name for name, _, _ in bench.cases(small=True)]
    for name in [*names, "eager call after the first"]:
        assert f"| {name}" in report
    ratios = [float(r) for r in re.findall(r"\| ([0-9.]+)x (?=\|)", report)]
    # Two a row: of the best times, and the median of the paired runs.
    assert len(ratios) == 2 * (len(names) + 1) and all(r > 0 for r in ratios)


def _load(name):
    spec = importlib.util.spec_from_file_location(
        name, ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_quick_float8_benchmark_reports_every_variant(tmp_path):
    bench = _load("float8")
    out = tmp_path / "float8.md"
    report = bench.main(["--quick", "--width", "32", "--out", str(out)])
    assert out.read_text() == report
    for variant in bench.VARIANTS[:2]:  # the reference and tensorwise
        assert f"| {variant} |" in report
    assert "| trace CPU, ratio | trace, ratio | compile, ratio |" in report
    reference = next(r for r in report.splitlines() if "| autocast b" in r)
    assert reference.endswith("| 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |")
    assert "| trace + lower s | compile s |" in report


# The GPU check of benchmarks/gpu.sh, dry-run on the CPU: its parsing and
# its verdicts, with no GPU.

# A line of a compiled module with a cuBLASLt float8 GEMM, as XLA prints it
# (xla/service/gpu/transforms/gemm_rewriter_test.cc).
CUBLASLT_F8_LINE = (
    "  %cublas-gemm.1 = (bf16[64,32]{1,0}, s8[33554432]{0}) custom-call("
    "f8e4m3fn[64,16]{1,0} %x, f8e4m3fn[32,16]{1,0} %transpose, f32[] "
    '%x_scale, f32[] %y_scale), custom_call_target="__cublas$lt$matmul$f8", '
    'backend_config={"operation_queue_id":"0","gemm_backend_config":'
    '{"alpha_real":1,"beta":0}}'
)


@pytest.mark.standard_promotion
def test_float8_gpu_check_reports_the_cpu_fallback_without_failing(capsys):
    gpu = _load("float8_gpu")
    config = gpu.gpt.Config(layers=1, width=32, heads=2, context=16, batch=4)
    step, args, _ = gpu.bench.build("float8 tensorwise", config)
    found = gpu.check(step, args)
    # The 4 linear layers' matmuls forward, 8 backward (the head's N=97
    # stays bfloat16); XLA:CPU has no float8 GEMM, so none was found.
    assert found.dots == (4, 8, 0)
    assert found.gemms == 0 and not found.ok
    assert found.message.startswith("MISMATCH, SILENT FALLBACK: 0 float8")


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_float8_gpu_script_on_the_cpu_says_mismatch_and_exits_1(
    capsys, tmp_path
):
    # The whole script, as gpu.sh runs it, on a small model: the message
    # in capitals on stderr, status 1, the timing table anyway.
    gpu = _load("float8_gpu")
    hlo = tmp_path / "hlo.txt.gz"
    status = gpu.main(
        ["--layers", "1", "--width", "32", "--heads", "2", "--context",
         "16", "--batch", "4", "--rounds", "1", "--steps", "1",
         "--recipes", "tensorwise", "--remat", "none,nothing_saveable",
         "--hlo", str(hlo)]
    )  # fmt: skip
    assert status == 1
    captured = capsys.readouterr()
    assert "MISMATCH, SILENT FALLBACK" in captured.err
    for remat in ("none", "nothing_saveable"):
        assert f"| autocast bfloat16 | {remat} | " in captured.out
        assert f"| float8 tensorwise | {remat} | " in captured.out
    assert "not float8 GEMMs' time" in captured.out
    # Each float8 step's HLO, under a header naming it.
    with gzip.open(hlo, "rt") as f:
        headers = [line for line in f if line.startswith("=== ")]
    assert headers == [
        "=== float8 tensorwise, remat none\n",
        "=== float8 tensorwise, remat nothing_saveable\n",
    ]


@pytest.mark.parametrize(
    ("flag", "value"), [("--recipes", "tensorwise,bogus"), ("--remat", "dots")]
)
def test_float8_gpu_script_names_what_it_accepts(flag, value, capsys):
    gpu = _load("float8_gpu")
    with pytest.raises(SystemExit):
        gpu.main([flag, value])
    assert f"{flag} must name some of" in capsys.readouterr().err


def test_float8_gpu_check_counts_the_real_custom_call():
    gpu = _load("float8_gpu")
    dots = gpu.fp8_check.Fp8Dots
    hlo = "\n".join([CUBLASLT_F8_LINE] * 3)
    assert gpu.fp8_check.count_fp8_gemms(hlo) == 3
    # A 16-bit cuBLAS GEMM is not one.
    assert gpu.fp8_check.count_fp8_gemms(
        CUBLASLT_F8_LINE.replace("$lt$matmul$f8", "$gemm")
    ) == 0  # fmt: skip
    assert gpu.compare(dots(1, 2, 0), 3).ok
    assert gpu.compare(dots(1, 2, 0), 3).message.startswith("ok: 3 float8")
    fallback = gpu.compare(dots(1, 2, 0), 2)
    assert not fallback.ok and "SILENT FALLBACK" in fallback.message
    assert "1 float8 matmuls did not" in fallback.message
    assert not gpu.compare(dots(1, 2, 0), 4).ok  # more GEMMs than dots
    assert not gpu.compare(dots(1, 1, 1), 3).ok  # e5m2 x e5m2
    assert not gpu.compare(dots(0, 0, 0), 0).ok  # nothing to check


# benchmarks/collectives.py's parsing of compiled HLO: the forms XLA
# prints (synchronous, asynchronous start/done pairs, a combiner's tuple).
SYNC_GATHER = (
    "  %all-gather.3 = f32[512,2048]{1,0} all-gather(f32[128,2048]{1,0} "
    "%p), channel_id=1, replica_groups=[1,4]<=[4], dimensions={0}"
)
ASYNC_GATHER = (
    "  %all-gather-start = (bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) "
    "all-gather-start(bf16[128,2048]{1,0} %c), dimensions={0}\n"
    "  %all-gather-done = bf16[512,2048]{1,0} all-gather-done("
    "(bf16[128,2048]{1,0}, bf16[512,2048]{1,0}) %all-gather-start)"
)
COMBINED_SCATTER = (
    "  ROOT %reduce-scatter.1 = (f32[128,2048]{1,0}, f32[512,512]{1,0}) "
    "reduce-scatter(f32[512,2048]{1,0} %a, f32[2048,512]{1,0} %b), "
    "dimensions={0}, to_apply=%add"
)


def test_collectives_reads_each_form_xla_prints():
    c = _load("collectives")
    found = c.collectives(
        "\n".join([SYNC_GATHER, ASYNC_GATHER, COMBINED_SCATTER])
    )
    assert found == [
        c.Collective("all-gather", "f32", 512 * 2048 * 4),
        c.Collective("all-gather", "bf16", 512 * 2048 * 2),  # the -done's
        c.Collective("reduce-scatter", "f32", 128 * 2048 * 4),
        c.Collective("reduce-scatter", "f32", 512 * 512 * 4),
    ]
    assert c.summary(found)["reduce-scatter", "f32"] == (
        2,
        (128 * 2048 + 512 * 512) * 4,
    )
    # Other instructions, a fusion that merely mentions a gather's name
    # among them, are not collectives.
    assert c.collectives("  %fusion = f32[4]{0} fusion(%all-gather.3)") == []
    with pytest.raises(ValueError, match="unknown HLO element type 'f4e2m1fn'"):
        c.collectives(SYNC_GATHER.replace("f32[512", "f4e2m1fn[512"))


@pytest.mark.standard_promotion
def test_collectives_of_the_fsdp_step_on_four_cpu_devices():
    # Today's program, the reference issue 41 improves on: every variant
    # gathers the float32 weights (8 MiB) and reduce-scatters float32
    # gradients (2 MiB, a quarter each).
    import jax

    c = _load("collectives")
    mesh = jax.sharding.Mesh(jax.devices()[:4], ("fsdp",))
    step, args = c.fsdp_step("float32", mesh)
    table = c.summary(c.collectives(step.lower(*args).compile().as_text()))
    assert table["all-gather", "f32"] == (2, 8 * 2**20)
    assert table["reduce-scatter", "f32"] == (2, 2 * 2**20)
    assert "| float32 | all-gather | f32 | 2 | 8.000 |" in c.report(mesh)


@pytest.mark.slow
@pytest.mark.standard_promotion
def test_float8_trace_benchmark_reports_every_variant_and_layout(tmp_path):
    bench = _load("float8_trace")
    out = tmp_path / "trace.md"
    report = bench.main(
        ["--rounds", "1", "--layers", "1", "--width", "32", "--out", str(out)]
    )
    assert out.read_text() == report
    for layout in ("unrolled", "scanned"):
        for variant in bench.VARIANTS:
            assert f"| {layout} | {variant} | " in report
    # The reference's ratios (trace, trace + lower, compile) are 1 by
    # construction.
    rows = [r for r in report.splitlines() if "| autocast bfloat16 |" in r]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.split("|")]
        assert [cells[i] for i in (4, 6, 8)] == ["1.00"] * 3, row
