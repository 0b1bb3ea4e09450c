"""The site as a browser lays it out: no code line cut, no code name broken.

A code block whose longest line is wider than the page hides the end of
that line behind a horizontal scroll bar (at 1400 px, the migration page's
first line lost its ``=8``), and a table that lets its cells wrap anywhere
breaks code names mid-word (``apply_if_fini`` / ``te``). Both are matters
of layout, which only a browser computes. docs/_static/tables.css holds the
fix: code blocks wrap their long lines, a table's code keeps each name on
one line, code in running text wraps only a word longer than the line,
and the migration page's comparison and float8 map become one card per
row where their columns no longer fit side by side.

Two checks, two costs:

- ``test_the_stylesheet_*`` reads the stylesheet the site ships and
  asserts those rules. It runs everywhere.
- ``test_pages_lay_out_*`` lays the built pages out in headless Chromium
  at 1400 px and at a phone's 390 px, and asks the page itself, through a
  script injected into a copy of it: which ``pre`` is wider than its box
  (``scrollWidth > clientWidth``: a line is cut); which code word is on
  two lines (in a table, ever; in running text, unless the word alone is
  longer than the line) or sticks out of its table cell; which text runs
  off the page (outside the scroll boxes of wide tables); and whether the
  comparison or the float8 map is wider than its box. It needs a Chromium
  (``apt-get install chromium``; ``$CHROMIUM`` names another binary) and
  a site build (about half a minute): it is marked slow and skips where
  there is no Chromium, as in CI.

The same, by hand, with screenshots to look at::

    sphinx-build -W --keep-going -b html docs /tmp/site
    python tests/test_docs_rendering.py /tmp/site --screenshots /tmp/shots

prints every problem found on the checked pages (``--pages`` names
others, e.g. every page of the site) at both widths, exits with status 1
if there is one, and writes ``/tmp/shots/guide-migration-1400.png`` and
``...-390.png``. Headless Chromium will not make its window narrower than
500 px, so each page is laid out in an iframe of the exact width (the
390 px screenshot is 500 px wide, the page in its left 390).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSS = ROOT / "docs" / "_static" / "tables.css"
WIDTHS = (1400, 390)
# The pages with wide code blocks or tables (migration.md's comparison and
# float8 map, float8.md's recipe tables, the benchmarks' figures) and the
# API reference (long code words in its parameter lists, a grid).
PAGES = (
    "guide/migration.html",
    "guide/float8.html",
    "guide/autocast.html",
    "benchmarks.html",
    "api.html",
)
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")

# Runs in the page, once it has loaded; posts what is wrong to the frame
# around it, which the test reads from the dumped DOM.
PROBE = """
<script>
window.addEventListener("load", function () {
  var problems = [];
  var article = document.querySelector(".bd-article") || document.body;
  article.querySelectorAll("pre").forEach(function (pre) {
    if (pre.scrollWidth > pre.clientWidth + 1) {
      problems.push("code line cut (" + pre.scrollWidth + " px in " +
        pre.clientWidth + "): " +
        pre.textContent.split("\\n").reduce(function (a, b) {
          return b.length > a.length ? b : a;
        }, "").trim());
    }
  });
  // A code word on two lines: never in a table; in running text only
  // where the word alone is longer than the line (then its box is as wide
  // as the line).
  article.querySelectorAll("code .pre").forEach(function (word) {
    if (word.closest("pre")) return;
    var range = document.createRange();
    range.selectNodeContents(word);
    var tops = {};
    Array.from(range.getClientRects()).forEach(function (r) {
      if (r.width > 0) tops[Math.round(r.top)] = true;
    });
    if (Object.keys(tops).length < 2) return;
    var block = word.closest("p, li, dd, dt, td, th, div");
    var line = block ? block.clientWidth : article.clientWidth;
    if (word.closest("table") ||
        word.getBoundingClientRect().width < 0.9 * line) {
      problems.push("code name broken: " + word.textContent);
    }
  });
  article.querySelectorAll("table code").forEach(function (code) {
    var cell = code.closest("td, th");
    if (cell && code.getBoundingClientRect().right >
        cell.getBoundingClientRect().right + 1) {
      problems.push("code sticks out of its cell: " + code.textContent.trim());
    }
  });
  // Any text wider than the page (a code word, a heading's long word),
  // but what a scroll box of its own holds (a wide table's).
  var right = article.getBoundingClientRect().right;
  var walker = document.createTreeWalker(article, NodeFilter.SHOW_TEXT);
  var offPage = 0;
  for (var text = walker.nextNode(); text && offPage < 10;
       text = walker.nextNode()) {
    var range = document.createRange();
    range.selectNodeContents(text);
    if (!text.textContent.trim() ||
        range.getBoundingClientRect().right <= right + 1) {
      continue;
    }
    var clipped = false;
    for (var up = text.parentElement; up && up !== article;
         up = up.parentElement) {
      if (getComputedStyle(up).overflowX !== "visible") clipped = true;
    }
    if (!clipped) {
      offPage += 1;
      var where = text.parentElement.closest("code") ? "code" :
        text.parentElement.tagName;
      problems.push(where + " runs off the page: " +
        text.textContent.trim().slice(0, 100));
    }
  }
  // The tables meant to fit at any width (the others may scroll).
  article.querySelectorAll(".comparison table, .mapping table")
    .forEach(function (table) {
      var box = table.parentElement;
      if (box.scrollWidth > box.clientWidth + 1) {
        var kind = table.closest(".comparison") ? "comparison" : "mapping";
        problems.push(kind + " table scrolls (" + box.scrollWidth + " px in " +
          box.clientWidth + ")");
      }
    });
  parent.postMessage(JSON.stringify({
    width: window.innerWidth, problems: problems
  }), "*");
});
</script>
"""

FRAME = """<!doctype html>
<html><body style="margin:0">
<iframe id="page" src="{src}"
  style="border:0;width:{width}px;height:{height}px"></iframe>
<script>
window.addEventListener("message", function (event) {{
  document.body.setAttribute("data-rendered", event.data);
}});
</script>
</body></html>
"""


def find_browser() -> str | None:
    for name in (os.environ.get("CHROMIUM"), *BROWSERS):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _chromium(browser: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def lay_out(
    browser: str,
    site: pathlib.Path,
    page: str,
    width: int,
    screenshot: pathlib.Path | None = None,
    height: int = 2400,
) -> list[str]:
    """What is cut or broken on ``page`` of ``site`` at ``width`` px."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = pathlib.Path(tmp) / "site"
        shutil.copytree(site, copy)
        original = copy / page
        probed = original.with_name(original.stem + "-probed.html")
        probed.write_text(
            original.read_text(encoding="utf-8").replace(
                "</body>", PROBE + "</body>"
            ),
            encoding="utf-8",
        )
        frame = original.with_name(original.stem + "-frame.html")
        frame.write_text(
            FRAME.format(src=probed.name, width=width, height=height)
        )
        window = f"--window-size={max(width, 500)},{height}"
        dom = _chromium(
            browser,
            window,
            "--virtual-time-budget=10000",
            "--dump-dom",
            frame.as_uri(),
        )
        found = re.search(r'data-rendered="([^"]*)"', dom)
        assert found, f"{page}: the probe did not report"
        report = json.loads(html.unescape(found[1]))
        assert report["width"] == width, report
        if screenshot is not None:
            # The page itself (not the probed copy): the iframe is its
            # viewport, so a 390 px page is laid out at 390 px.
            frame.write_text(
                FRAME.format(src=original.name, width=width, height=height)
            )
            _chromium(
                browser,
                window,
                "--virtual-time-budget=5000",
                f"--screenshot={screenshot}",
                frame.as_uri(),
            )
    return [f"{page} at {width} px: {p}" for p in report["problems"]]


# The stylesheet.


def _rules(css: str) -> dict[str, str]:
    """Selector -> declarations, outside and inside at-rules alike."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    rules: dict[str, str] = {}
    for selectors, body in re.findall(r"([^{}@]+)\{([^{}]*)\}", css):
        for selector in selectors.split(","):
            key = " ".join(selector.split())
            rules[key] = rules.get(key, "") + body
    return rules


def _declares(rules: dict[str, str], selector: str, declaration: str) -> bool:
    want = " ".join(declaration.split())
    body = " ".join(rules.get(selector, "").split())
    return want in body.replace(" ;", ";")


def stylesheet_problems(css: str) -> list[str]:
    """The rules a code line or a code name depends on, where missing."""
    rules, problems = _rules(css), []
    expected = [
        # Code blocks wrap a line longer than the page.
        (".bd-article pre", "white-space: pre-wrap"),
        (".bd-article pre", "overflow-wrap: anywhere"),
        # Code in running text too, where one word is longer than a line.
        (".bd-article code.literal .pre", "display: inline-block"),
        (".bd-article code.literal .pre", "max-width: 100%"),
        (".bd-article code.literal .pre", "white-space: normal"),
        (".bd-article code.literal .pre", "overflow-wrap: anywhere"),
        # And the API's signatures, words without spaces between them.
        (".bd-article .sig .pre", "display: inline-block"),
        # In tables, a code name is never split, and cells wrap at spaces
        # (overflow-wrap: anywhere would let a cell break names again).
        (".bd-article table code.literal .pre", "display: inline"),
        (".bd-article table code.literal .pre", "white-space: nowrap"),
        (".bd-article table code.literal .pre", "overflow-wrap: normal"),
        (".bd-article .comparison td", "overflow-wrap: normal"),
        # The comparison's columns take their width from their content, and
        # it turns into cards by its own width, not the window's.
        (".bd-article .comparison table", "table-layout: auto"),
        (".bd-article .comparison", "container-type: inline-size"),
        # So does the float8 map of equivalents.
        (".bd-article .mapping", "container-type: inline-size"),
    ]
    for selector, declaration in expected:
        if not _declares(rules, selector, declaration):
            problems.append(f"{selector} lacks {declaration}")
    for selector, body in rules.items():
        in_a_table = re.search(
            r"\b(table|td|th)\b|comparison|mapping", selector
        )
        if "anywhere" in body and in_a_table:
            problems.append(f"{selector} breaks anywhere: {body.strip()}")
    if "@container" not in css:
        problems.append("no @container query for the cards")
    return problems


def test_the_stylesheet_wraps_code_blocks_and_keeps_code_names_whole():
    assert stylesheet_problems(CSS.read_text()) == []


def test_the_stylesheet_check_finds_the_old_rules():
    # The negative control: the stylesheet as it was before the fix (code
    # blocks that scroll, comparison cells that break anywhere).
    old = """
    .bd-article .comparison table { table-layout: fixed; width: 100%; }
    .bd-article .comparison td { overflow-wrap: anywhere; hyphens: auto; }
    .bd-article .comparison code,
    .bd-article .comparison code .pre {
      white-space: normal;
      overflow-wrap: anywhere;
    }
    """
    problems = "\n".join(stylesheet_problems(old))
    assert ".bd-article pre lacks white-space: pre-wrap" in problems
    assert "table code.literal .pre lacks white-space: nowrap" in problems
    assert ".bd-article .comparison code breaks anywhere" in problems


# The layout, in a browser.


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("sphinx")
    if find_browser() is None:
        pytest.skip("no Chromium: apt-get install chromium, or set $CHROMIUM")
    from test_docs import _build_site

    out = tmp_path_factory.mktemp("rendered") / "site"
    proc = _build_site(out)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("page", PAGES)
def test_pages_lay_out_without_cut_lines_or_broken_names(site, page, width):
    browser = find_browser()
    assert browser is not None
    assert lay_out(browser, site, page, width) == []


@pytest.mark.slow
def test_the_layout_check_sees_a_cut_line_and_a_broken_name(site, tmp_path):
    # The negative control: the built site with the old stylesheet's rules.
    browser = find_browser()
    assert browser is not None
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    (broken / "_static" / "tables.css").write_text(
        ".bd-article .comparison table { table-layout: fixed; width: 100%; }"
        " .bd-article .comparison code, .bd-article .comparison code .pre"
        " { white-space: normal; overflow-wrap: anywhere; }"
    )
    page = "guide/migration.html"
    wide = "\n".join(lay_out(browser, broken, page, 1400))
    assert "code name broken: apply_if_finite" in wide
    narrow = "\n".join(lay_out(browser, broken, page, 390))
    assert "code line cut" in narrow
    assert "code runs off the page" in narrow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", type=pathlib.Path, help="a built site")
    parser.add_argument(
        "--screenshots",
        type=pathlib.Path,
        help="a folder for PNGs of the migration page at each width",
    )
    parser.add_argument("--pages", nargs="*", default=list(PAGES))
    args = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print("no Chromium: apt-get install chromium, or set $CHROMIUM")
        return 2
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    problems = []
    for page in args.pages:
        for width in WIDTHS:
            shot = None
            if args.screenshots and page == "guide/migration.html":
                name = page.removesuffix(".html").replace("/", "-")
                shot = args.screenshots / f"{name}-{width}.png"
            problems += lay_out(browser, args.site, page, width, shot)
            if shot:
                print(f"wrote {shot}")
    print("\n".join(problems) or "no code line cut, no code name broken")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
