"""python -m lossscale.demo: runs, reports, plots, and shows the effect."""

import subprocess
import sys

import pytest

from lossscale import demo

pytestmark = pytest.mark.standard_promotion


def test_demo_shows_the_effect(tmp_path, capsys):
    results = demo.main(
        ["--steps", "300", "--seed", "1", "--out", str(tmp_path)]
    )
    by_mode = {r.mode: r for r in results}
    assert list(by_mode) == list(demo.MODES)
    f32, f16 = by_mode["f32"], by_mode["f16"]
    static, dynamic = by_mode["static"], by_mode["dynamic"]

    # float16 without scaling stalls: many gradients underflow to zero...
    assert f16.zero_fraction.mean() > 0.2
    assert f32.zero_fraction.mean() < 1e-3
    # ...and it ends clearly worse than float32,
    assert f16.final_loss > f32.final_loss + 0.1
    assert f16.test_accuracy < f32.test_accuracy - 0.1
    # while both loss scales match float32 closely and underflow nothing.
    for scaled in (static, dynamic):
        assert abs(scaled.final_loss - f32.final_loss) < 0.02
        assert abs(scaled.test_accuracy - f32.test_accuracy) < 0.02
        assert scaled.zero_fraction.mean() < 1e-3
    assert dynamic.scales[-1] > 2.0**15

    out = capsys.readouterr().out
    assert "| mode | final train loss" in out
    lines = (tmp_path / "results.md").read_text().splitlines()
    assert sum(line.startswith("| ") for line in lines) == 1 + len(demo.MODES)
    png = tmp_path / "lossscale_demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "3"], "--steps must be at least 10"),
        (["--steps", "many"], "invalid int value"),
        (["--modes", "f32,bf16"], "--modes must be distinct names"),
        (["--modes", "f32,f32"], "--modes must be distinct names"),
        (["--seed", "-1"], "--seed must be >= 0"),
    ],
)
def test_bad_flags_give_a_message_not_a_traceback(args, message):
    proc = subprocess.run(
        [sys.executable, "-m", "lossscale.demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_no_plot(tmp_path):
    demo.main(
        ["--steps", "10", "--modes", "f16", "--no-plot", "--out", str(tmp_path)]
    )
    assert (tmp_path / "results.md").exists()
    assert not (tmp_path / "lossscale_demo.png").exists()
