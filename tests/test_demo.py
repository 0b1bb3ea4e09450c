"""python -m lossscale.demo: runs, reports, plots, and shows the effect."""

import contextlib
import dataclasses
import io
import os
import pathlib
import platform
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

import lossscale
from lossscale import demo
from lossscale.demo import _common as _demo_common
from lossscale.demo import _gpt as _demo_gpt
from lossscale.demo import _text as _demo_text

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.standard_promotion


@pytest.mark.slow
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
    # The README's and the docs' copy is drawn by this demo as it is today
    # (a figure of another layout has other dimensions).
    shown = pathlib.Path(__file__).parent.parent / "docs" / "images"
    assert png_size(png) == png_size(shown / "lossscale_demo.png")


def png_size(path):
    """A PNG's width and height, from its header."""
    header = path.read_bytes()[:24]
    return int.from_bytes(header[16:20], "big"), int.from_bytes(
        header[20:24], "big"
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "3"], "--steps must be at least 10"),
        (["--steps", "many"], "invalid int value"),
        (["--modes", "f32,bf16"], "--modes must be distinct names"),
        (["--modes", "f32,f32"], "--modes must be distinct names"),
        (["--seed", "-1"], "--seed must be >= 0"),
        (["--model", "gpt", "--modes", "f32,int8"], "--modes must be distinct"),
        (["--model", "cnn"], "invalid choice: 'cnn'"),
        (["--modes", "fp8"], "--modes must be distinct names"),  # gpt only
        (["--width", "128"], "--width is for --model gpt"),
        (["--model", "gpt", "--width", "66"], "--width must be a positive"),
        (["--model", "gpt", "--width", "0"], "--width must be a positive"),
    ],
)
def test_bad_flags_give_a_message_not_a_traceback(args, message, capsys):
    # In process (argparse exits with status 2 and a usage message); the
    # command line itself is exercised once below.
    with pytest.raises(SystemExit) as exit_info:
        demo.parse_args(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flag_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "lossscale.demo", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--steps must be at least 10" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_out_folder_that_cannot_be_written_fails_before_training(
    tmp_path, capsys, monkeypatch
):
    # A folder under a file cannot be created; main must stop before it
    # trains anything (train is replaced by a function that fails).
    def no_training(*args, **kwargs):
        raise AssertionError("trained before checking --out")

    monkeypatch.setitem(
        demo.MODELS,
        "mlp",
        dataclasses.replace(demo.MODELS["mlp"], train=no_training),
    )
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--out", str(blocker / "results")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--out must be a folder that can be created and written to" in err
    assert str(blocker / "results") in err


def test_an_unwritable_out_folder_from_the_command_line():
    proc = subprocess.run(
        [sys.executable, "-m", "lossscale.demo", "--out", "/proc/nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--out must be a folder that can be created" in proc.stderr
    assert "/proc/nope" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Training" not in proc.stdout


# A mode's line: the table's figures, named, then the times.
MODE_LINE = re.compile(
    r"  (?P<mode>[\w-]+) done: final train loss (?P<train>\d+\.\d{4}), "
    r"test loss (?P<test>\d+\.\d{4}), test accuracy (?P<accuracy>[\d.]+), "
    r"zero-gradient fraction [\d.]+, skipped steps \d+, final scale \S+; "
    r"(?P<seconds>\d+\.\d) s training, \d+\.\d s in all"
)


def fake_result(mode, index):
    """A Result whose losses have more than 4 decimals."""
    steps = 20
    return _demo_common.Result(
        mode=mode,
        losses=np.full(steps, 2.09846 + index),
        scales=np.full(steps, 2.0**15),
        skipped=np.zeros(steps, bool),
        zero_fraction=np.zeros(steps),
        test_loss=2.23851 + index,
        test_accuracy=0.5,
        seconds=1.25 + index,
    )


def test_each_mode_reports_before_the_next_starts(
    tmp_path, capsys, monkeypatch
):
    # What was printed when each mode started training.
    printed_at_start = []
    printed = []

    def train(mode, steps, seed, progress=True):
        printed.append(capsys.readouterr().out)
        printed_at_start.append("".join(printed))
        return fake_result(mode, len(printed_at_start) - 1)

    monkeypatch.setitem(
        demo.MODELS,
        "mlp",
        dataclasses.replace(demo.MODELS["mlp"], train=train),
    )
    modes = ["f32", "f16", "dynamic"]
    args = ["--modes", ",".join(modes), "--no-plot", "--out", str(tmp_path)]
    demo.main(args)
    out = "".join(printed) + capsys.readouterr().out

    lines = [m for m in map(MODE_LINE.fullmatch, out.splitlines()) if m]
    assert [m["mode"] for m in lines] == modes
    for i in range(len(modes)):
        # Before mode i trained, the modes before it had their line, and
        # it had none.
        seen = [m["mode"] for m in MODE_LINE.finditer(printed_at_start[i])]
        assert seen == modes[:i]
        # 4 decimals, rounded: 2.09846 + i and 2.23851 + i.
        assert lines[i]["train"] == f"{2.0985 + i:.4f}"
        assert lines[i]["test"] == f"{2.2385 + i:.4f}"
    # The final table's rows say the same, to the same decimals.
    table = (tmp_path / "results.md").read_text()
    for m in lines:
        row = f"| {m['mode']} | {m['train']} | {m['test']} | {m['accuracy']} |"
        assert row in table
        assert f"| {m['seconds']} |" in table


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize(
    "stderr, progress, shown",
    [
        (_Terminal, True, True),
        (_Terminal, False, False),
        (io.StringIO, True, False),  # a log, a pipe, pytest's capture
    ],
    ids=["terminal", "no-progress", "not-a-terminal"],
)
def test_the_progress_bar_shows_on_a_terminal_only(
    stderr, progress, shown, monkeypatch
):
    def step(params, opt_state, key, data):
        record = (np.float32(2.5), np.float32(1), np.False_, np.float32(0))
        return params, opt_state, record

    err = stderr()
    monkeypatch.setattr(sys, "stderr", err)
    _, (losses, *_), _ = _demo_common.run_steps(
        step, {}, (), None, np.arange(20), "f32", progress
    )
    assert losses.tolist() == [2.5] * 20
    text = err.getvalue()
    if shown:
        # The bar names the mode, counts the steps and shows the loss.
        assert "f32:" in text and "/20" in text and "loss=2.5000" in text
    else:
        assert text == ""


@pytest.mark.slow
def test_the_command_reports_each_mode_as_it_ends(tmp_path):
    # A real run through a pipe, as in a log: each mode's line comes while
    # the demo is still running (flushed, not held in the pipe's buffer),
    # and stderr, not a terminal, gets no progress bar.
    modes = ["f32", "dynamic"]
    command = [sys.executable, "-m", "lossscale.demo", "--steps", "10"]
    command += ["--modes", ",".join(modes), "--no-plot", "--out", str(tmp_path)]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    lines = []
    running_at_first_line = None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if running_at_first_line is None and MODE_LINE.fullmatch(lines[-1]):
            running_at_first_line = proc.poll() is None
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert running_at_first_line
    assert err == ""
    found = [m for m in map(MODE_LINE.fullmatch, lines) if m]
    assert [m["mode"] for m in found] == modes
    table = (tmp_path / "results.md").read_text()
    for m in found:
        assert f"| {m['mode']} | {m['train']} | {m['test']} |" in table


@pytest.mark.slow
def test_no_plot(tmp_path):
    demo.main(
        ["--steps", "10", "--modes", "f16", "--no-plot", "--out", str(tmp_path)]
    )
    assert (tmp_path / "results.md").exists()
    assert not (tmp_path / "lossscale_demo.png").exists()


@pytest.mark.slow
def test_gpt_runs_reports_and_plots(tmp_path, capsys):
    results = demo.main(
        [
            "--model",
            "gpt",
            "--steps",
            "10",
            "--modes",
            "static,bf16",
            "--out",
            str(tmp_path),
        ]
    )
    assert [r.mode for r in results] == ["static", "bf16"]
    for r in results:
        assert len(r.losses) == 10
        assert np.isfinite(r.losses).all() and np.isfinite(r.test_loss)
        # From uniform guessing (ln 97 = 4.57 nats per character) down.
        assert r.losses[0] > 4.4 > r.losses[-1]
        assert r.test_accuracy is None
        assert not r.skipped.any()
    static, bf16 = results
    assert (static.scales == _demo_gpt.STATIC_SCALE).all()
    assert (bf16.scales == 1).all()

    out = capsys.readouterr().out
    assert "| mode | final train loss | held-out loss | zero-gradient" in out
    assert "accuracy" not in out
    lines = (tmp_path / "gpt_results.md").read_text().splitlines()
    assert sum(line.startswith("| ") for line in lines) == 1 + len(results)
    png = tmp_path / "gpt_demo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "results.md").exists()  # the MLP's


def test_float8_modes_are_opt_in():
    # Not in the default run (XLA:CPU emulates float8), accepted by name.
    assert demo.parse_args(["--model", "gpt"]).modes == list(_demo_gpt.MODES)
    named = demo.parse_args(
        ["--model", "gpt", "--modes", ",".join(_demo_gpt.FLOAT8_MODES)]
    )
    assert named.modes == list(_demo_gpt.FLOAT8_MODES)
    for mode, recipe in _demo_gpt.FLOAT8_MODES.items():
        # The tied output head kept out by name, as torchao users do.
        assert _demo_gpt.compute_dtype(mode) == lossscale.Float8(
            recipe, exclude="tokens.embedding"
        )
        assert isinstance(
            _demo_gpt.loss_scale_for(mode), lossscale.NoOpLossScale
        )


@pytest.mark.slow
def test_gpt_float8_modes_train(tmp_path, capsys):
    # 10 steps of per-tensor scaling and of the row-wise recipe with a
    # 16-bit weight gradient, the two ends of the recipes (each compile
    # takes 10 to 30 s on 2 cores); the 300-step figures of all three are
    # in docs/transformer.md.
    modes = ["fp8", "fp8-rowwise-gw-hp"]
    results = demo.main(
        [
            "--model",
            "gpt",
            "--steps",
            "10",
            "--modes",
            ",".join(modes),
            "--out",
            str(tmp_path),
        ]
    )
    assert [r.mode for r in results] == modes
    for r in results:
        assert np.isfinite(r.losses).all() and np.isfinite(r.test_loss)
        assert r.losses[0] > 4.4 > r.losses[-1]  # it learns
        assert not r.skipped.any() and (r.scales == 1).all()
    # The recipes round differently: close, not equal.
    tensorwise, rowwise = results
    assert abs(tensorwise.final_loss - rowwise.final_loss) < 0.05
    assert np.abs(tensorwise.losses - rowwise.losses).max() > 0
    # The run the pages quote (benchmarks/RESULTS-demo-gpt.md) was made by
    # this code: its 10-step losses, recorded beside it, come back to the
    # last bit with the JAX and on the CPU they were recorded with
    # (tests/test_figures.py checks the pages against the run). A change
    # to float8's numbers fails here until the run is made again. The bits
    # are the CPU's: the vector code XLA emits for it and the threads it
    # splits a matmul over change them (the same 10 steps end up to 0.07%
    # apart with SSE4.2, AVX or AVX2 code, or on one core), so elsewhere
    # the losses are held to a tolerance three times that spread.
    recorded = _recorded_ten_steps()
    if jax.__version__ == recorded["jax"]:
        for r in results:
            if _cpu() == recorded["cpu"]:
                assert repr(float(r.final_loss)) == recorded[r.mode], r.mode
            else:
                want = float(recorded[r.mode])
                assert abs(r.final_loss - want) < 2e-3 * want, r.mode
    out = capsys.readouterr().out
    assert "| fp8-rowwise-gw-hp |" in out
    assert (tmp_path / "gpt_demo.png").read_bytes()[:4] == b"\x89PNG"


def _cpu() -> str:
    """This machine's CPU as RESULTS-demo-gpt.md names the one its 10-step
    losses were recorded on: vendor, family and model, and the CPUs this
    process may run on."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count()
    return (
        f"{platform.machine()} {fields.get('vendor_id', '?')} family "
        f"{fields.get('cpu family', '?')} model {fields.get('model', '?')}, "
        f"{cpus} CPUs"
    )


def _recorded_ten_steps() -> dict[str, str]:
    """The 10-step final losses recorded with the demo GPT's float8 run,
    and the JAX version and CPU they were recorded with
    (benchmarks/RESULTS-demo-gpt.md)."""
    text = (ROOT / "benchmarks" / "RESULTS-demo-gpt.md").read_text()
    check = text[text.index("## The 10-step check") :]
    found = dict(re.findall(r"^- `([\w.-]+)`: `([\d.]+)`$", check, re.M))
    found["jax"] = re.search(r"^jax ([\d.]+),", text, re.M)[1]
    found["cpu"] = re.search(r"recorded on\s+`([^`]+)`", check)[1]
    return found


def test_gpt_width_flag_reaches_the_model(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_train(mode, steps, seed, progress=True, config=None):
        seen.append(config)
        raise SystemExit(0)

    monkeypatch.setattr(_demo_gpt, "train", fake_train)
    args = ["--model", "gpt", "--width", "32", "--out", str(tmp_path)]
    with pytest.raises(SystemExit):
        demo.main([*args, "--modes", "fp8"])
    assert seen == [_demo_gpt.Config(width=32)]
    assert "(width 32, context 64, batch 64)" in capsys.readouterr().out


def _expected_dynamic_scales(skipped, initial, interval):
    """The scale after each step, by DynamicLossScale's documented rule."""
    scale, clean, scales = initial, 0, []
    for skip in skipped:
        clean = 0 if skip else clean + 1
        if skip:
            scale /= 2
        elif clean == interval:
            scale, clean = scale * 2, 0
        scales.append(scale)
    return np.array(scales)


@pytest.mark.slow
def test_gpt_dynamic_scaling_tracks_float32(tmp_path):
    # A fifth of the default run: the same model, batch and data.
    f32, f16, dynamic = demo.main(
        [
            "--model",
            "gpt",
            "--steps",
            "60",
            "--modes",
            "f32,f16,dynamic",
            "--out",
            str(tmp_path),
        ]
    )
    assert (tmp_path / "gpt_demo.png").read_bytes()[:4] == b"\x89PNG"
    for r in (f32, f16, dynamic):
        assert np.isfinite(r.losses).all() and np.isfinite(r.test_loss)
    assert f32.final_loss < 3.0 and f32.test_loss < 3.0  # it learns

    # The acceptance criterion of the default run holds on this one.
    assert abs(dynamic.final_loss - f32.final_loss) < 0.05
    assert abs(dynamic.test_loss - f32.test_loss) < 0.05

    # Without scaling float16 strays further from float32 than with it (the
    # mean gap between the loss curves; not the final losses alone, which on
    # jax 0.8.3 both end within 0.002 of float32 after 60 steps, unscaled
    # float16 the closer). Under autocast the margin is smaller than it was
    # cast by hand (3-8x on jax 0.7 to 0.10): 1.54x on jax 0.12.0.1
    # (0.0068 against 0.0044), hence no factor here...
    def strays(r):
        return float(np.mean(np.abs(r.losses - f32.losses)))

    assert strays(f16) > strays(dynamic)
    # ...and early on, while attention is still near uniform, a visible
    # share of its gradient elements underflows to zero; with the dynamic
    # scale (and in float32) next to none do.
    assert f16.zero_fraction.max() > 0.01
    assert dynamic.zero_fraction.max() < 1e-3
    assert f32.zero_fraction.max() < 1e-3

    # The recorded skips and scales agree with each other, step by step.
    expected = _expected_dynamic_scales(
        dynamic.skipped, 2.0**16, _demo_gpt.GROWTH_INTERVAL
    )
    np.testing.assert_array_equal(dynamic.scales, expected)
    assert dynamic.scales[-1] > 2.0**16  # it grew on the clean steps


def test_stdlib_files_skip_what_depends_on_the_machine(tmp_path):
    for name in [
        "os.py",
        "json/decoder.py",
        "notes.txt",
        "site-packages/numpy/core.py",
        "dist-packages/apt.py",
        "test/test_os.py",
        "idlelib/idle_test/test_x.py",
        "_sysconfigdata__linux_x86_64-linux-gnu.py",
        "config-3.11-x86_64-linux-gnu/python-config.py",
        "abc.py",
    ]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("pass\n")
    found = _demo_text.stdlib_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in found] == [
        "abc.py",
        "json/decoder.py",
        "os.py",
    ]


def test_corpus_is_reproducible_and_split_by_file():
    corpus = _demo_text.load_corpus(50_000, 10_000, seed=0)
    again = _demo_text.load_corpus.__wrapped__(50_000, 10_000, seed=0)
    other = _demo_text.load_corpus.__wrapped__(50_000, 10_000, seed=1)
    assert again.train_files == corpus.train_files
    np.testing.assert_array_equal(again.train, corpus.train)
    np.testing.assert_array_equal(again.heldout, corpus.heldout)
    assert other.train_files != corpus.train_files
    assert set(corpus.train_files).isdisjoint(corpus.heldout_files)
    assert len(corpus.train) >= 50_000 and len(corpus.heldout) >= 10_000
    assert corpus.train.max() < _demo_text.VOCAB


def test_text_encoding():
    source = 'def f(x):\n    return {"x": x ** 2}  # ok\n'
    assert _demo_text.decode(_demo_text.encode(source)) == source
    # Tabs and non-ASCII characters share one id.
    ids = _demo_text.encode("\té€")
    assert (ids == _demo_text.VOCAB - 1).all() and len(ids) == 3


def test_gpt_remat_policy_reaches_every_block():
    # Config.remat (the GPU benchmark's remat rows): each block under
    # nnx.remat with the named jax.checkpoint_policies policy.
    import flax.nnx as nnx

    def saved(remat):
        config = _demo_gpt.Config(layers=2, width=16, heads=2, context=8,
                                  batch=2, remat=remat)  # fmt: skip
        model = _demo_gpt.make_model(0, config)
        graphdef, params = nnx.split(model, nnx.Param)
        ids = np.zeros((2, 8), np.int32)

        def loss(params):
            logits = nnx.merge(graphdef, params)(ids)
            return _demo_gpt.cross_entropy(logits, ids)

        jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            print_saved_residuals(loss, params)
        residuals = printed.getvalue().strip().splitlines()
        return "checkpoint[" in jaxpr or "remat" in jaxpr, len(residuals)

    plain, nothing = saved(None), saved("nothing_saveable")
    assert plain[0] is False and nothing[0] is True
    # Saving nothing inside the blocks keeps fewer residuals.
    assert nothing[1] < plain[1]
    with pytest.raises(ValueError, match=r"config.remat must be one of .*'x'"):
        _demo_gpt.make_model(0, _demo_gpt.Config(remat="x"))
