"""The package metadata, and CI's oldest-versions run, agree."""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ci_tests_the_oldest_versions_pyproject_admits():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    minimums = {}
    for requirement in project["dependencies"]:
        name, version = re.fullmatch(
            r"([\w-]+)>=([\w.]+)", requirement
        ).groups()
        minimums[name] = version
    pins = dict(
        line.split("==")
        for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins == minimums
    assert "-c .ci/oldest.txt" in (ROOT / ".ci" / "run").read_text()
