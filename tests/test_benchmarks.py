"""The benchmark runs (--quick). A smoke test: timings are not asserted."""

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
    ratios = [float(r) for r in re.findall(r"\| ([0-9.]+)x \|", report)]
    assert len(ratios) == len(names) + 1 and all(r > 0 for r in ratios)
