"""The documentation's Python examples run as written, page by page.

Every ```python block of a page runs, in order, in one namespace per page
(so a page may build on its earlier blocks); ```py blocks are illustrations
that are not run (none so far). The site itself is built with warnings as
errors by .ci/run (``mkdocs build --strict``).
"""

import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").rglob("*.md"))


def blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_the_guide_has_examples():
    with_examples = {p.name for p in PAGES if blocks(p)}
    assert {"index.md", "semantics.md", "distributed.md"} <= with_examples


@pytest.mark.standard_promotion
@pytest.mark.parametrize(
    "path",
    [p for p in PAGES if blocks(p)],
    ids=lambda p: str(p.relative_to(ROOT / "docs")),
)
def test_page_examples_run(path, monkeypatch):
    if not hasattr(jax, "set_mesh"):  # jax < 0.8 calls it use_mesh
        monkeypatch.setattr(
            jax, "set_mesh", jax.sharding.use_mesh, raising=False
        )
    namespace: dict = {"__name__": f"docs_{path.stem}"}
    for block in blocks(path):
        exec(compile(block, str(path), "exec"), namespace)


def test_docs_link_to_existing_pages():
    for page in PAGES:
        for target in re.findall(
            r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()
        ):
            assert (page.parent / target).resolve().exists(), (page, target)
