"""The notebooks execute without error (so they never rot)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

spec = importlib.util.spec_from_file_location(
    "execute_notebooks", ROOT / "notebooks" / "execute.py"
)
execute_notebooks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(execute_notebooks)


def test_there_are_notebooks():
    names = {p.name for p in NOTEBOOKS}
    assert {"quickstart.ipynb", "underflow.ipynb"} <= names


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_stores_outputs(path):
    import nbformat

    stored = nbformat.read(path, as_version=4)
    code = [c for c in stored.cells if c.cell_type == "code"]
    # Stored with outputs, so that they read on a repository page.
    assert all(c.execution_count is not None for c in code)
    assert any(
        "image/png" in o.get("data", {}) for c in code for o in c.outputs
    )
    executed = execute_notebooks.execute(path, timeout=300)
    errors = [
        o
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.output_type == "error"
    ]
    assert not errors
