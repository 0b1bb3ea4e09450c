"""The package metadata and CI's oldest-versions run agree, and the
package's modules import one another without a circle."""

import ast
import graphlib
import pathlib
import re
import tomllib
from collections.abc import Iterator

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


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(
    tree: ast.Module,
) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements run when a module is imported (also those under
    a module-level ``if``, ``try`` or ``with``), not those in a function."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            todo.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports at module level:
    ``from p import x`` imports the module ``p.x`` if there is one, else
    ``p`` itself."""
    found = set()
    for node in _module_level_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        base = node.module or ""
        if node.level:
            package = name.split(".")
            if path.name != "__init__.py":
                package.pop()
            package = package[: len(package) - node.level + 1]
            base = ".".join([*package, base] if base else package)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            found.add(sub if sub in modules else base)
    return (found & modules) - {name}


def test_lossscale_modules_import_no_circle():
    modules = {_module_name(f): f for f in (ROOT / "lossscale").rglob("*.py")}
    graph = {n: _imports(n, p, set(modules)) for n, p in modules.items()}
    # The walk sees imports at all: a known one.
    assert "lossscale._scales" in graph["lossscale._transform"]
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(
            "lossscale's modules import each other in a circle: "
            + " -> ".join(error.args[1])
        ) from None
