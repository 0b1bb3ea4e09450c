"""Executes the notebooks in this folder in place (outputs stored).

Usage: python notebooks/execute.py [NOTEBOOK ...]

The tests run the same function on copies, so that a notebook that no longer
runs fails CI.
"""

from __future__ import annotations

import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOKS = sorted(HERE.glob("*.ipynb"))


def execute(path: pathlib.Path, *, timeout: int = 600) -> nbformat.NotebookNode:
    """Runs every cell of ``path`` (in its folder); raises on any error."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    return nb


def main(argv: list[str]) -> None:
    paths = [pathlib.Path(a) for a in argv] or NOTEBOOKS
    for path in paths:
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"executed {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
