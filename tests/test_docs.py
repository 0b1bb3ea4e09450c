"""The documentation: its examples run as copied, and the built site is sound.

Examples. Every ```python block of docs/**/*.md (and, in test_readme.py,
of the README) runs two ways: alone, in a fresh namespace, unless its first
line says ``# continues the previous block``; and page by page, every block
of a page in order in one namespace. (A slow test runs each stand-alone
block again in a fresh interpreter, with ``XLA_FLAGS`` set only where the
block itself says to set it.) ```py blocks are illustrations that are
not run: code for PyTorch or Keras, which the tests do not install. A
block that imports a library of OPTIONAL (transformers 4.46.3, the last
with Flax models: the ``hf`` extra, not the ``test`` one) is skipped, and
left out of its page's run, where that library is absent.

The site. ``.ci/run`` builds it with ``sphinx-build -W`` (broken
cross-references and links between pages fail the build) and then runs
this file as a script on the built folder: every internal link and anchor
of every page must resolve, and no page may show raw reST (a role, a
double-backtick literal, a reST link) instead of rendering it. The same
checks run under pytest (slow) on a build of their own.
"""

from __future__ import annotations

import dataclasses
import html.parser
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap
import urllib.parse
from collections.abc import Iterable

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)
# The first line of a block that needs an earlier one.
CONTINUES = re.compile(r"# continues the (previous|first) block\b")
DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
# Libraries a block may import that the test extra does not install.
OPTIONAL = ("transformers",)


@dataclasses.dataclass(frozen=True)
class Block:
    path: pathlib.Path
    line: int  # of the opening fence, 1-based
    code: str
    # The blocks it continues, in order (theirs included); empty if it
    # stands alone.
    before: tuple[Block, ...] = ()

    @property
    def continues(self) -> bool:
        return self.code.startswith("# continues")

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def python_blocks(path: pathlib.Path) -> list[Block]:
    """The ```python blocks of a Markdown page, in order."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = re.fullmatch(r"(\s*)```python\s*", lines[i])
        if fence:
            start, body = i, []
            i += 1
            while not re.fullmatch(r"\s*```\s*", lines[i]):
                body.append(lines[i])
                i += 1
            code = textwrap.dedent("\n".join(body)) + "\n"
            before: tuple[Block, ...] = ()
            marker = CONTINUES.match(code)
            if marker and blocks:
                target = blocks[-1 if marker[1] == "previous" else 0]
                before = (*target.before, target)
            blocks.append(Block(path, start + 1, code, before))
        i += 1
    return blocks


def optional_imports(blocks: Iterable[Block]) -> set[str]:
    """The libraries of OPTIONAL that these blocks import."""
    return {
        name
        for b in blocks
        for name in OPTIONAL
        if re.search(rf"^(?:from|import) {name}\b", b.code, re.M)
    }


def absent(blocks: Iterable[Block]) -> set[str]:
    return {
        name
        for name in optional_imports(blocks)
        if importlib.util.find_spec(name) is None
    }


def skip_if_absent(blocks: Iterable[Block]) -> None:
    for name in sorted(absent(blocks)):
        pytest.importorskip(name)


BLOCKS = [b for p in PAGES for b in python_blocks(p)]
WITH_EXAMPLES = [p for p in PAGES if python_blocks(p)]


def _use_mesh_on_old_jax(monkeypatch):
    import jax

    if not hasattr(jax, "set_mesh"):  # jax < 0.8 calls it use_mesh
        monkeypatch.setattr(
            jax, "set_mesh", jax.sharding.use_mesh, raising=False
        )


def run_blocks(blocks: list[Block]) -> dict:
    namespace: dict = {"__name__": "__main__"}
    for block in blocks:
        # Line numbers in a traceback are the page's.
        code = "\n" * block.line + block.code
        exec(compile(code, str(block.path), "exec"), namespace)
    return namespace


def test_the_guide_has_examples():
    with_examples = {p.name for p in WITH_EXAMPLES}
    assert {
        "index.md",
        "semantics.md",
        "distributed.md",
        "migration.md",
    } <= with_examples


def check_markers(blocks: list[Block]) -> None:
    for block in blocks:
        if block.continues:
            # Says which block, in words the reader and this test share.
            assert CONTINUES.match(block.code), block.name
            assert block.before, f"{block.name} continues nothing"
        first = (block.before or (block,))[0]
        uses_devices = any(
            w in b.code
            for b in (*block.before, block)
            for w in ("mesh", "pmap")
        )
        if uses_devices:
            assert DEVICES_FLAG in first.code.splitlines()[0], block.name


def test_blocks_say_what_they_continue_and_need():
    check_markers(BLOCKS)


@pytest.mark.standard_promotion
@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.name)
def test_block_runs_alone(block, monkeypatch):
    # Alone, or after exactly the blocks its first line names.
    skip_if_absent([*block.before, block])
    _use_mesh_on_old_jax(monkeypatch)
    run_blocks([*block.before, block])


@pytest.mark.standard_promotion
@pytest.mark.parametrize(
    "path", WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT))
)
def test_page_runs_in_order(path, monkeypatch):
    _use_mesh_on_old_jax(monkeypatch)
    blocks = python_blocks(path)
    run_blocks([b for b in blocks if not absent([*b.before, b])])


def test_a_block_that_continues_does_not_run_alone():
    # The negative control of test_block_runs_alone: a block marked as a
    # continuation really needs what came before it.
    semantics = python_blocks(DOCS / "guide" / "semantics.md")
    skipped = next(b for b in semantics if "inf" in b.code and b.continues)
    assert [b.line for b in skipped.before] == [semantics[0].line]
    with pytest.raises(NameError):
        run_blocks([skipped])


def run_in_a_fresh_interpreter(
    block: Block, cwd: pathlib.Path
) -> subprocess.CompletedProcess:
    skip_if_absent([*block.before, block])
    code = "\n".join(b.code for b in (*block.before, block))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    env["MPLBACKEND"] = "Agg"
    if DEVICES_FLAG in code.splitlines()[0]:
        env["XLA_FLAGS"] = DEVICES_FLAG
    if "jax.set_mesh" in code:
        pytest.importorskip("jax", minversion="0.8")
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize(
    "block", [b for b in BLOCKS if not b.continues], ids=lambda b: b.name
)
def test_block_runs_alone_in_a_fresh_interpreter(block, tmp_path):
    run_in_a_fresh_interpreter(block, tmp_path)


def test_the_hugging_face_block_exits_quietly(tmp_path):
    # Its gradients, kept in module variables, die at interpreter exit,
    # after lossscale's module globals are cleared: forgetting their marks
    # once printed a traceback per leaf, which reads as a failure.
    page = DOCS / "guide" / "migration.md"
    heading = next(
        i
        for i, line in enumerate(page.read_text().splitlines(), 1)
        if line.startswith("## ") and "Hugging Face" in line
    )
    block = next(b for b in python_blocks(page) if b.line > heading)
    if "transformers" in block.code:
        pytest.importorskip("transformers")
    assert run_in_a_fresh_interpreter(block, tmp_path).stderr == ""


def test_the_hugging_face_block_is_the_one_that_needs_transformers():
    # The control of the skip: only it names an optional library, so a
    # missing transformers skips it and nothing else.
    needing = [b.name for b in BLOCKS if optional_imports([b])]
    assert len(needing) == 1 and "migration.md" in needing[0], needing


def test_docs_link_to_existing_pages():
    # Without a build: docs/notebooks/ is the copy of notebooks/ that
    # docs/conf.py makes for Sphinx, absent from a fresh clone.
    copies = DOCS / "notebooks"
    for page in PAGES:
        for target in re.findall(
            r"\]\(([^)#:]+\.(?:md|ipynb))(?:#[^)]*)?\)", page.read_text()
        ):
            path = (page.parent / target).resolve()
            if path.is_relative_to(copies):
                path = ROOT / "notebooks" / path.relative_to(copies)
            assert path.exists(), (page, target)


def api_names() -> list[str]:
    text = (DOCS / "api.md").read_text()
    return re.findall(r"^\.\. auto\w+:: lossscale\.(\w+)", text, re.M)


def test_the_api_page_documents_every_public_name_once():
    import lossscale

    names = api_names()
    assert sorted(names) == sorted(lossscale.__all__)


PRIVATE = re.compile(r"lossscale[/.]_(?!_)\w+")  # not __all__


def public_docstrings():
    import lossscale

    for name in lossscale.__all__:
        obj = getattr(lossscale, name)
        yield name, obj.__doc__ or ""
        for attr, member in vars(obj).items() if isinstance(obj, type) else ():
            doc = getattr(member, "__doc__", None)
            if doc and not attr.startswith("_"):
                yield f"{name}.{attr}", doc


def test_public_pages_and_docstrings_name_no_private_module():
    for page in PAGES:
        assert not PRIVATE.search(page.read_text()), page
    found = [name for name, doc in public_docstrings() if PRIVATE.search(doc)]
    assert found == []


# The built site.

RAW_MARKUP = [
    re.compile(r":(?:class|func|meth|attr|mod|data|obj|exc|ref):`"),
    re.compile(r"``"),
    re.compile(r"`_\b"),
    re.compile(r"<https?://"),  # a reST link shown as text or code
]


class _Page(html.parser.HTMLParser):
    """The links, the anchors and the visible text of one HTML page."""

    def __init__(self):
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("name"):
            self.ids.add(attrs["name"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def check_site(site: pathlib.Path) -> list[str]:
    """The problems of a built site: broken internal links, raw markup."""
    site = site.resolve()
    pages = {p: _parse(p) for p in site.rglob("*.html")}
    problems = []
    for path, page in pages.items():
        rel = path.relative_to(site)
        for href in page.links:
            url = urllib.parse.urlsplit(href)
            if url.scheme or url.netloc or href.startswith("mailto:"):
                continue  # external: not checked offline
            target = (
                (path.parent / urllib.parse.unquote(url.path)).resolve()
                if url.path
                else path
            )
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                problems.append(f"{rel}: broken link {href}")
            elif (
                url.fragment
                and target.suffix == ".html"
                and url.fragment not in pages[target].ids
            ):
                problems.append(f"{rel}: no anchor for {href}")
        if rel.parts[0] in ("_static", "_sources", "_images"):
            continue
        text = "".join(page.text)
        for pattern in RAW_MARKUP:
            for match in pattern.finditer(text):
                context = text[max(0, match.start() - 40) : match.end() + 40]
                problems.append(f"{rel}: raw markup {context!r}")
    for required in ["index.html", "api.html", "notebooks/quickstart.html"]:
        if site / required not in pages:
            problems.append(f"missing page {required}")
    return problems


def _build_site(out: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "sphinx",
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            str(DOCS),
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_site_builds_without_warnings_and_its_links_resolve(tmp_path):
    pytest.importorskip("sphinx")
    site = tmp_path / "site"
    proc = _build_site(site)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert check_site(site) == []
    api = (site / "api.html").read_text()
    # The docstrings' roles became links to the documented objects.
    assert 'href="#lossscale.DynamicLossScale"' in api
    assert 'href="#lossscale.loss_scaled"' in api
    # The demo's figure and its table are on the home page; the notebooks
    # are pages with their stored figures.
    home = (site / "index.html").read_text()
    assert "lossscale_demo.png" in home and "<table" in home
    quickstart = (site / "notebooks" / "quickstart.html").read_text()
    assert "<img" in quickstart


def test_the_site_check_finds_broken_links_and_raw_markup(tmp_path):
    # The negative control of the site check, on a hand-made site.
    (tmp_path / "index.html").write_text(
        '<a href="api.html#nowhere">x</a><a href="gone.html">y</a>'
        "<p>see :class:`DynamicLossScale` and ``x``</p>"
    )
    (tmp_path / "api.html").write_text('<h1 id="here">API</h1>')
    problems = "\n".join(check_site(tmp_path))
    assert "no anchor for api.html#nowhere" in problems
    assert "broken link gone.html" in problems
    assert ":class:`DynamicLossScale" in problems
    assert "``x``" in problems


if __name__ == "__main__":
    # .ci/run: python tests/test_docs.py <the folder sphinx-build wrote>
    found = check_site(pathlib.Path(sys.argv[1]))
    print("\n".join(found) or f"{sys.argv[1]}: links and markup are clean")
    sys.exit(1 if found else 0)
