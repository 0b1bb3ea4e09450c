"""The README's Python snippets run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


@pytest.mark.standard_promotion
def test_readme_python_blocks_run(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "the README has no python snippet"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert "loss_scale" in capsys.readouterr().out
    metrics = namespace["lossscale"].metrics(namespace["opt_state"])
    # float16 compute with the default 2**16 start: the weight gradient is
    # 8 * 2 * S / 8 = 2S in float16, which overflows (> 65504) at S = 2**16
    # and 2**15; both steps are skipped, the third applies at S = 2**14.
    assert int(metrics["skipped_steps"]) == 2
    assert float(metrics["loss_scale"]) == 2.0**14
    assert namespace["params"]["w"].ravel().tolist() != [0.0] * 4


def test_readme_links_exist_and_fit_in_15_kb():
    text = README.read_text()
    assert len(text.encode()) <= 15 * 1024
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (README.parent / target).exists(), target


def test_readme_speaks_of_float16_parameters_and_the_guarantees():
    guarantees = (
        README.parent / "docs" / "guide" / "guarantees.md"
    ).read_text()
    assert "float32 master weights" in guarantees
    assert "What is not checked" in guarantees


def test_ci_runs_the_readme_test_command():
    text = README.read_text()
    quick_start = text[text.index("## Quick start") :]
    block = re.search(r"```bash\n(.*?)```", quick_start, re.S).group(1)
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2  # one for the demo, one for the tests
    assert "python -m lossscale.demo" in commands[0]
    assert "python -m pytest" in commands[1]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci
