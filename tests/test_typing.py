"""The package is typed: pyright finds no error in it, and it says so."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import lossscale

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = pathlib.Path(lossscale.__file__).resolve().parent


def _pyright() -> pathlib.Path:
    # The console script of the environment running the tests (the test
    # extra installs it), not whichever pyright is first on PATH.
    scripts = pathlib.Path(sys.executable).parent
    name = "pyright.exe" if os.name == "nt" else "pyright"
    path = scripts / name
    assert path.is_file(), (
        f"pyright is not installed next to {sys.executable}: "
        'pip install -e ".[test]"'
    )
    return path


@pytest.mark.slow
def test_pyright_finds_no_error_in_the_package():
    # The project's [tool.pyright] (pyproject.toml) says what to check and
    # how; imports resolve in this interpreter's environment.
    result = subprocess.run(
        [
            str(_pyright()),
            "--outputjson",
            "--pythonpath",
            sys.executable,
            "--project",
            str(ROOT),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"},
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr
    report = json.loads(result.stdout)
    errors = [
        f"{d['file']}:{d['range']['start']['line'] + 1}: {d['message']}"
        f" ({d.get('rule', '')})"
        for d in report["generalDiagnostics"]
        if d["severity"] == "error"
    ]
    assert errors == []
    assert report["summary"]["errorCount"] == 0
    # Every module was checked (the include still names the package).
    modules = list((ROOT / "lossscale").rglob("*.py"))
    assert report["summary"]["filesAnalyzed"] == len(modules)


def test_the_package_ships_its_py_typed_marker():
    # PEP 561: without it, type checkers ignore the package's annotations.
    marker = PACKAGE / "py.typed"
    assert marker.is_file()
    assert marker.read_text() == ""
