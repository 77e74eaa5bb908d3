"""Check the built documentation site in headless Chromium (``make docs-check``).

Opens every page of the built HTML with selenium and fails when, on any page:

* a table from a cell shows as raw pipes (``| a | b |`` text instead of a table);
* an image did not load;
* a code or output block is wider than the content column (hidden behind a scrollbar);
* a tutorial or reference page lacks the previous/next links or the page's table of contents;

and when the search page finds nothing for ``collective_permute``. A screenshot of each page
is written to ``--screenshots``. ``--self-test`` first checks two broken pages made here (a raw
table, an over-wide block) and fails unless both are caught, so the check itself can fail.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

WIDTH, HEIGHT = 1280, 1000

#: JavaScript run on each page: a list of problems found in the rendered DOM.
_PROBLEMS_JS = r"""
const out = [];
const main = document.querySelector("article.bd-article") || document.body;
const right = main.getBoundingClientRect().right + 1;
for (const img of document.querySelectorAll("img")) {
  if (!img.complete || img.naturalWidth === 0) out.push("image did not load: " + img.src);
}
for (const el of main.querySelectorAll("pre, div.highlight, div.cell_output, table")) {
  const r = el.getBoundingClientRect();
  if (r.width === 0) continue;
  const hidden = el.scrollWidth > el.clientWidth + 1;
  if (hidden || r.right > right) {
    const text = (el.innerText || "").split("\n")[0].slice(0, 60);
    out.push(`${el.tagName.toLowerCase()} wider than the column ` +
             `(${el.scrollWidth}px in ${el.clientWidth}px): "${text}"`);
  }
}
for (const el of main.querySelectorAll("div.cell_output, div.output, p")) {
  const lines = (el.innerText || "").split("\n").map(s => s.trim());
  if (lines.some(s => /^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)+\|?$/.test(s))) {
    out.push("raw markdown table: " + lines.find(s => s.startsWith("|")).slice(0, 60));
  }
}
return out;
"""

_NAV_JS = r"""
return {
  prev: !!document.querySelector(".prev-next-area a.left-prev"),
  next: !!document.querySelector(".prev-next-area a.right-next"),
  toc: document.querySelectorAll("#pst-page-toc-nav a, nav.bd-toc-nav a").length,
  sections: document.querySelectorAll("article.bd-article section section").length,
};
"""


def _driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WIDTH},{HEIGHT}", "--hide-scrollbars"):  # fmt: skip
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _screenshot(driver, path: Path) -> None:
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(WIDTH, min(max(height, HEIGHT), 16000))
    driver.save_screenshot(str(path))
    driver.set_window_size(WIDTH, HEIGHT)


def check_page(driver, url: str, *, navigation: bool) -> list[str]:
    """Problems of one page (empty: none)."""
    driver.get(url)
    time.sleep(0.2)
    problems = list(driver.execute_script(_PROBLEMS_JS))
    if navigation:
        nav = driver.execute_script(_NAV_JS)
        if not (nav["prev"] or nav["next"]):
            problems.append("no previous/next links")
        if nav["sections"] >= 2 and nav["toc"] == 0:
            problems.append("no table of contents of the page")
    return problems


def check_search(driver, root: Path, term: str = "collective_permute") -> list[str]:
    driver.get((root / "search.html").as_uri() + f"?q={term}")
    for _ in range(100):
        hits = driver.execute_script(
            "return document.querySelectorAll('#search-results li, ul.search li').length"
        )
        if hits:
            return []
        time.sleep(0.1)
    return [f"search finds nothing for {term!r}"]


def pages(root: Path) -> list[Path]:
    skip = {"search.html", "genindex.html", "py-modindex.html"}
    return sorted(
        p for p in root.rglob("*.html")
        if p.name not in skip and "_modules" not in p.parts and "_static" not in p.parts
        and "_sources" not in p.parts
    )  # fmt: skip


_BAD_PAGES = {
    "raw_table.html": "<div class='cell_output'><pre>| a | b |\n|---|---|\n| 1 | 2 |</pre></div>",
    "wide_block.html": "<pre style='white-space:pre'>" + "x" * 400 + "</pre>",
}


def self_test(driver) -> list[str]:
    """Check that the checks catch a raw table and an over-wide block."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, body in _BAD_PAGES.items():
            page = Path(tmp, name)
            page.write_text(
                "<html><body><article class='bd-article' style='width:600px'>"
                f"{body}</article></body></html>"
            )
            if not check_page(driver, page.as_uri(), navigation=False):
                failures.append(f"self-test: the check did not catch {name}")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built HTML (docs/_build/html)")
    parser.add_argument("--screenshots", type=Path, help="write one PNG per page here")
    parser.add_argument("--self-test", action="store_true", help="first check broken pages")
    args = parser.parse_args(argv)
    root = args.site.resolve()
    if not (root / "index.html").exists():
        parser.error(f"{root} holds no index.html; build the docs first (make docs)")
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    driver = _driver()
    failures: list[str] = []
    try:
        if args.self_test:
            failures += self_test(driver)
        for page in pages(root):
            rel = page.relative_to(root)
            navigation = rel.parts[0] in ("tutorials", "api.html") or rel.name == "index.html"
            problems = check_page(driver, page.as_uri(), navigation=navigation)
            if args.screenshots:
                shot = args.screenshots / (str(rel.with_suffix("")).replace("/", "__") + ".png")
                _screenshot(driver, shot)
            print(f"{'ok ' if not problems else 'BAD'} {rel}")
            failures += [f"{rel}: {p}" for p in problems]
        failures += check_search(driver, root)
    finally:
        driver.quit()
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
