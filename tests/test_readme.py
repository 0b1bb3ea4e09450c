"""The README's Python snippets run as copied: alone, and in order.

The same rules as the guide's (tests/test_docs.py): a block runs alone in a
fresh namespace unless its first line says which block it continues.
"""

import pathlib
import re

import pytest

from tests.test_docs import (
    check_markers,
    python_blocks,
    run_blocks,
    run_in_a_fresh_interpreter,
)

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = python_blocks(README)


def test_readme_blocks_say_what_they_continue_and_need():
    assert BLOCKS, "the README has no python snippet"
    assert not BLOCKS[0].continues
    check_markers(BLOCKS)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_readme_block_runs_alone(block):
    run_blocks([*block.before, block])


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if not b.continues], ids=lambda b: b.name
)
def test_readme_block_runs_alone_in_a_fresh_interpreter(block, tmp_path):
    run_in_a_fresh_interpreter(block, tmp_path)


@pytest.mark.standard_promotion
def test_readme_python_blocks_run_in_order(capsys):
    namespace = run_blocks(BLOCKS)
    out = capsys.readouterr().out
    assert "loss_scale" in out
    # The float8 block prints what its comment says it prints.
    block = next(b for b in BLOCKS if "Float8" in b.code)
    promised = [
        line.removeprefix("# ")
        for line in block.code.splitlines()
        if line.startswith("# float8_e4m3fn")
    ]
    assert len(promised) == 2
    for line in promised:
        assert line in out.splitlines()
    metrics = namespace["lossscale"].metrics(namespace["opt_state"])
    # float16 compute with the default 2**16 start: the weight gradient is
    # 8 * 2 * S / 8 = 2S in float16, which overflows (> 65504) at S = 2**16
    # and 2**15; both steps are skipped, the third applies at S = 2**14.
    assert int(metrics["skipped_steps"]) == 2
    assert float(metrics["loss_scale"]) == 2.0**14
    assert namespace["params"]["w"].ravel().tolist() != [0.0] * 4


def test_readme_links_exist_and_fit_in_6_kb():
    # A page a newcomer reads in two minutes; CI's times and the test
    # count are on docs/development.md.
    text = README.read_text()
    assert len(text.encode()) <= 6 * 1024
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


def test_the_development_page_runs_what_ci_runs():
    # The page that quotes the test count and CI's times names the
    # commands they were measured with: those .ci/run runs.
    page = (README.parent / "docs" / "development.md").read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", page, re.S)
    pytest_lines = [
        line
        for block in blocks
        for line in block.splitlines()
        if line.startswith("python -m pytest")
    ]
    assert pytest_lines == [
        "python -m pytest -n auto",
        'python -m pytest -m "not slow" -n auto',
    ]
    for line in pytest_lines:
        assert line in ci.splitlines() or f"&& {line}" in ci
    assert "sphinx-build -W --keep-going -b html docs" in ci
    assert "python tests/test_docs.py" in ci
    # The suite's size and CI's times are there, dated, and not in the
    # README.
    assert re.search(r"\(\d+ tests, `-n auto`", page)
    assert re.search(r"\d+ min \d+ s on 20\d\d-\d\d-\d\d", page)
    readme = README.read_text()
    assert not re.search(r"\d+ tests\b|\d+ min \d+ s", readme)
