"""Check the built documentation site in headless Chromium (``make docs-check``).

Opens every page of the built HTML with selenium, at a desktop width (1400 px) and a phone
width (420 px), and fails when, on any page:

* a table from a cell shows as raw pipes (``| a | b |`` text instead of a table);
* directive text shows raw (``.. dropdown::``, a ```` ```{literalinclude} ```` fence): markup
  that was fed to the wrong parser;
* math shows as raw TeX (MathJax missing offline, or never rendered);
* an image did not load;
* a code or output block, or a displayed formula, is wider than the content column at 1400 px
  (hidden behind a scrollbar), or a table scrolls in its container at 1400 px (a column cut
  off: at that width every table must fit), folded blocks measured open;
* a word is broken inside a table cell (``nativ/e``): cells break only at spaces, hyphens and
  slashes, and a table too wide for the column scrolls in its own container;
* the page is wider than a 420 px viewport (the reader would scroll sideways);
* a previous/next link's title is cut off at the link's edge;
* a figure's smallest text is under 9 pt (12 CSS px) at 1400 px; figures made with
  :func:`xla_permute_tools.figures.new_figure` record their smallest text in the PNG, and a figure
  that does not is reported too;
* a tutorial or reference page lacks the previous/next links or the page's table of contents;
* a cell shows stderr output (a raw log under a trimmed error: print what the reader needs);
* a caption names panels "(left)"/"(right)" where the figure's panels are stacked, or
  "(top)"/"(bottom)" where they stand side by side, found from blank bands across the PNG
  (:func:`panel_layout`);
* a page's "You need first" names a page that comes later in the tour (the order of the
  sidebar, which is docs/index.md's toctree);
* a cell tagged ``demonstrates-failure`` (a cell meant to show an error) shows no error in its
  output: the failure it demonstrates did not happen in this build;
* the page makes a network request (a script, style sheet or image not served from the
  build: MathJax must come from ``_static/mathjax``);
* at 420 px a code cell wraps instead of scrolling in its own box (outputs may wrap);
* a figure does not open at full size (a link to its image, docs/_static/wrap.js);
* the page is taller than ``MAX_PAGE_PX`` at 1400 px (split it, or fold what is not the point);
* the page loads more than :data:`ASSET_BUDGET` of scripts and style sheets, the theme's icon
  script, or (outside the search page) the search index (:func:`weight_problems`);
* an internal link leads nowhere: its page does not exist, or its ``#anchor`` is on no
  element of the page it names (:func:`link_problems`, read from the HTML files);

and when a hardware caveat is shown in full more than once on the site (:func:`caveat_problems`:
each is shown once, under its anchor on the hardware caveats page, and linked elsewhere), or
when the search page finds nothing for ``collective_permute``, or a search for
``all_gather_matmul`` lists the tests page or no API or tutorial page (:data:`SEARCHES`), or no
page shows a rendered formula, or the pipeline bubble calculator shows another bubble than
its page asserts (:func:`check_calculator`). Full-page screenshots of
each page at both widths go to ``--screenshots`` (a page taller than one PNG may be is cut into
``name.png``, ``name-2.png``, ...), and a screenshot set that does not cover the whole page
fails the check. ``--self-test`` first checks pages made here to fail each check, and fails
unless every one is caught by its own check. Pages are checked two at a time (``--browsers``),
one headless Chromium each, the tallest first: their screenshots take most of the time.
"""

from __future__ import annotations

import argparse
import base64
import queue
import re
import struct
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from notebook_cells import FAILURE_WORDS

WIDE, NARROW, HEIGHT = 1400, 420, 1000
#: The smallest text a figure may show at page width: 9 pt = 12 CSS px.
MIN_FIGURE_TEXT_PX = 12.0
#: The PNG text key where xla_permute_tools.figures records the figure's smallest text, in pixels.
FONT_KEY = "xla-permute smallest text px"
#: The tallest PNG one capture makes; taller pages are saved as several files.
TILE = 12000
#: The tallest a page may be at WIDE, in CSS px: a longer page is split or folded.
MAX_PAGE_PX = 15_500
#: Each checked page's height in CSS px at (WIDE, NARROW), by URL: printed beside its verdict.
HEIGHTS: dict[str, tuple[int, int]] = {}
_HEIGHT_JS = "return document.documentElement.scrollHeight"

#: JavaScript run on each page at the desktop width: problems found in the rendered DOM.
_PROBLEMS_JS = r"""
const out = [];
const main = document.querySelector("article.bd-article") || document.body;
const right = main.getBoundingClientRect().right + 1;
for (const img of document.querySelectorAll("img")) {
  if (!img.complete || img.naturalWidth === 0) out.push("image did not load: " + img.src);
}
const blocks = "pre, div.highlight, div.cell_output, table, div.math, mjx-container[display]";
// What a fold hides is measured open (a reader opens it), then the folds close again.
const folded = Array.from(main.querySelectorAll("details:not([open])"));
folded.forEach(d => { d.open = true; });
for (const found of main.querySelectorAll(blocks)) {
  // A table in the theme's scroll container scrolls inside it (docs/_static/wrap.css): the
  // container is what must fit the column.
  const el = found.closest(".pst-scrollable-table-container") || found;
  const r = el.getBoundingClientRect();
  if (r.width === 0) continue;
  const hidden = el.scrollWidth > el.clientWidth + 1;
  const text = (el.innerText || "").split("\n")[0].slice(0, 60);
  if (el !== found && hidden) {
    // At this width every table fits: one that scrolls hides part of a column.
    out.push(`table scrolls at ${window.innerWidth}px, ${el.scrollWidth - el.clientWidth}px ` +
             `hidden (${el.scrollWidth}px in ${el.clientWidth}px): "${text}"`);
  } else if (hidden || r.right > right) {
    out.push(`${el.tagName.toLowerCase()} wider than the column ` +
             `(${el.scrollWidth}px in ${el.clientWidth}px): "${text}"`);
  }
}
folded.forEach(d => { d.open = false; });
for (const el of main.querySelectorAll("div.cell_output, div.output, p")) {
  const lines = (el.innerText || "").split("\n").map(s => s.trim());
  if (lines.some(s => /^\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)+\|?$/.test(s))) {
    out.push("raw markdown table: " + lines.find(s => s.startsWith("|")).slice(0, 60));
  }
}
const directive = /^\s*(\.\. [\w:-]+::|(```+|:::+)\s*\{[\w:-]+\})/;
for (const line of (main.innerText || "").split("\n")) {
  if (directive.test(line)) out.push("raw directive text: " + line.trim().slice(0, 60));
}
for (const el of main.querySelectorAll(".math")) {
  if (!el.querySelector("mjx-container, svg, img, math")) {
    out.push("math left as raw TeX: " + (el.textContent || "").trim().slice(0, 60));
  }
}
for (const el of main.querySelectorAll("div.output.stderr, div.stderr")) {
  out.push("stderr output on the page: " + (el.innerText || "").trim().split("\n")[0].slice(0, 60));
}
for (const cell of main.querySelectorAll("div.cell.tag_demonstrates-failure")) {
  const shown = Array.from(cell.querySelectorAll("div.cell_output, div.output"))
    .map(e => e.innerText || "").join("\n");
  if (!/FAILURE_WORDS/i.test(shown)) {
    const code = (cell.querySelector("div.cell_input") || cell).innerText.trim().split("\n")[0];
    out.push("demonstrated failure did not happen (no error in its output): " +
             code.slice(0, 60));
  }
}
const here = location.href.split("#")[0];
const tour = Array.from(document.querySelectorAll("nav.bd-docs-nav a.reference.internal"))
  .map(a => a.href.split("#")[0]);
const at = tour.indexOf(here);
for (const li of main.querySelectorAll("li, p")) {
  const text = (li.innerText || "").trim();
  if (!/^You need first\b/.test(text) || at < 0) continue;
  for (const a of li.querySelectorAll("a[href]")) {
    const i = tour.indexOf(a.href.split("#")[0]);
    if (i > at) out.push(`prerequisite later in the tour: "${a.innerText.trim()}" ` +
                         `(${i + 1} of the tour, this page ${at + 1})`);
  }
}
const remote = new Set();
for (const el of document.querySelectorAll("script[src], link[href], img[src], iframe[src]")) {
  const url = el.src || el.href;
  if (el.tagName === "LINK" && !/stylesheet|preload|icon|modulepreload/.test(el.rel)) continue;
  if (/^(https?:)?\/\//.test(el.getAttribute("src") || el.getAttribute("href") || "")
      || /^https?:/.test(url)) remote.add(url);
}
for (const entry of performance.getEntriesByType("resource")) {
  if (/^https?:/.test(entry.name)) remote.add(entry.name);
}
for (const url of remote) out.push("network request: " + url.slice(0, 80));
for (const img of main.querySelectorAll("div.cell_output img, figure img")) {
  const link = img.closest("a[href]");
  if (!link || link.href.split("#")[0] !== (img.currentSrc || img.src)) {
    out.push("figure does not open at full size (no link to its image): " +
             (img.src || "").split("/").pop().slice(0, 60));
  }
}
const tex = /(\$\$|\\\(|\\\[|\\(frac|partial|text|qquad|sum)\b)/;
for (const el of main.querySelectorAll("p, li, td, th, dd")) {
  if (el.closest("pre, code, .math, .highlight")) continue;
  const text = Array.from(el.childNodes).filter(n => n.nodeType === 3)
    .map(n => n.textContent).join(" ");
  if (tex.test(text)) out.push("math left as raw TeX: " + text.trim().slice(0, 60));
}
return out;
""".replace("FAILURE_WORDS", FAILURE_WORDS)  # the words notebook_cells checks too

#: Words broken inside a table cell, and whether the page scrolls sideways (any width).
_LAYOUT_JS = r"""
const out = [];
const main = document.querySelector("article.bd-article") || document.body;
const token = /[^\s\-\/\u200b]{2,}/g;
let broken = 0, first = "";
for (const cell of main.querySelectorAll("td, th")) {
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  let node, found = false;
  while (!found && (node = walker.nextNode())) {
    const text = node.textContent;
    let m;
    token.lastIndex = 0;
    while ((m = token.exec(text))) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const tops = new Set(Array.from(range.getClientRects())
        .filter(r => r.width > 0).map(r => Math.round(r.top)));
      if (tops.size > 1) { found = true; if (!first) first = m[0]; break; }
    }
  }
  if (found) broken += 1;
}
if (broken) out.push(`${broken} table cell(s) with a word broken mid-word, e.g. "${first}"`);
for (const link of document.querySelectorAll(".prev-next-area a")) {
  if (link.scrollWidth > link.clientWidth + 1) {
    out.push("previous/next link cut off: " + (link.innerText || "").trim().split("\n").pop());
  }
}
const doc = document.documentElement;
if (doc.scrollWidth > window.innerWidth + 1) {
  let widest = "", right = 0;
  for (const el of main.querySelectorAll("*")) {
    const r = el.getBoundingClientRect();
    if (el.closest(".pst-scrollable-table-container, div.cell_output")) continue;
    if (r.right >= right && r.right > window.innerWidth + 1) {
      right = r.right;
      widest = el.tagName.toLowerCase() + ": " + (el.innerText || "").split("\n")[0].slice(0, 40);
    }
  }
  out.push(`page wider than the ${window.innerWidth}px viewport ` +
           `(${doc.scrollWidth}px; e.g. ${widest})`);
}
return out;
"""

#: At the phone width: code cells that wrap instead of scrolling sideways in their own box.
_PHONE_CODE_JS = r"""
const out = [];
const main = document.querySelector("article.bd-article") || document.body;
for (const pre of main.querySelectorAll("div.highlight pre")) {
  if (pre.closest("div.cell_output, div.output")) continue;  // outputs may wrap
  const style = getComputedStyle(pre);
  const wraps = !["pre", "nowrap"].includes(style.whiteSpace) &&
    !(style.whiteSpaceCollapse === "preserve" && style.textWrapMode === "nowrap");
  const hides = pre.scrollWidth > pre.clientWidth + 1 &&
    !["auto", "scroll"].includes(style.overflowX);
  if (wraps || hides) {
    out.push(`code ${wraps ? "wraps" : "is cut off"} instead of scrolling: ` +
             (pre.innerText || "").split("\n")[0].slice(0, 60));
  }
}
return out;
"""

#: Each figure with a caption: its image file and the caption's text.
_CAPTIONS_JS = r"""
const main = document.querySelector("article.bd-article") || document.body;
const out = [];
for (const fig of main.querySelectorAll("figure, div.figure")) {
  const img = fig.querySelector("img");
  const cap = fig.querySelector("figcaption, p.caption");
  if (img && cap && img.naturalWidth) out.push({src: img.src, caption: cap.innerText || ""});
}
return out;
"""

#: Each figure image in the article: its file, natural and shown width.
_FIGURES_JS = r"""
const main = document.querySelector("article.bd-article") || document.body;
return Array.from(main.querySelectorAll("div.cell_output img, figure img")).map(img => ({
  src: img.src, natural: img.naturalWidth, shown: img.getBoundingClientRect().width,
}));
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
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={WIDE},{HEIGHT}",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    options.binary_location = "/usr/bin/chromium"
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def _set_width(driver, width: int) -> None:
    """Lay the page out at ``width`` CSS px (a window can be no narrower than ~500 px)."""
    metrics = {"width": width, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": False}
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, from its header."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    return struct.unpack(">II", data[16:24])


def png_text(data: bytes) -> dict[str, str]:
    """The tEXt/zTXt/iTXt entries of a PNG."""
    out, pos = {}, 8
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, value = body.partition(b"\0")
            out[key.decode("latin-1")] = zlib.decompress(value[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")  # language
            _, _, value = rest.partition(b"\0")  # translated key
            value = zlib.decompress(value) if compressed else value
            out[key.decode("latin-1")] = value.decode("utf-8")
        elif kind == b"IEND":
            break
    return out


#: CSS transitions off: a capture beyond the viewport resizes it, and the theme's sidebars,
#: caught mid-transition, overlapped the article in the screenshots (the page itself was fine).
_NO_TRANSITIONS_JS = """
if (!document.getElementById("check-site-still")) {
  const style = document.createElement("style");
  style.id = "check-site-still";
  style.textContent = "*, *::before, *::after {transition: none !important; "
    + "animation: none !important}";
  document.head.appendChild(style);
}
"""


def screenshot(driver, path: Path, tile: int = TILE) -> list[str]:
    """Save the whole page at the current width (several PNGs if it is taller than ``tile``);
    problems: the saved PNGs do not cover the page."""
    driver.execute_script(_NO_TRANSITIONS_JS)
    width = driver.execute_script("return window.innerWidth")
    height = driver.execute_script("return document.documentElement.scrollHeight")
    for old in [path, *path.parent.glob(f"{path.stem}-[0-9]*.png")]:
        old.unlink(missing_ok=True)
    covered, part = 0, 1
    while covered < height:
        clip = {"x": 0, "y": covered, "width": width, "height": min(tile, height - covered)}
        shot = driver.execute_cdp_cmd(
            "Page.captureScreenshot",
            {"format": "png", "captureBeyondViewport": True, "clip": {**clip, "scale": 1}},
        )
        data = base64.b64decode(shot["data"])
        name = path if part == 1 else path.with_name(f"{path.stem}-{part}.png")
        name.write_bytes(data)
        covered += png_size(data)[1]
        part += 1
    return screenshot_problems(path, height)


def screenshot_problems(path: Path, height: int) -> list[str]:
    """Problems: the PNGs of ``path`` (``name.png``, ``name-2.png``, ...) are shorter than the
    page's ``height``."""
    parts = [path, *sorted(path.parent.glob(f"{path.stem}-[0-9]*.png"))]
    shot = sum(png_size(p.read_bytes())[1] for p in parts if p.exists())
    if shot + 1 < height:
        return [f"screenshot cut short: {shot}px of a {height}px page ({path.name})"]
    return []


def figure_problems(driver) -> list[str]:
    """Figures whose smallest text is under 9 pt as shown, or that do not record it."""
    out = []
    for fig in driver.execute_script(_FIGURES_JS):
        if not fig["natural"] or not fig["src"].startswith("file:"):
            continue
        data = Path(unquote(urlparse(fig["src"]).path)).read_bytes()
        name = fig["src"].rsplit("/", 1)[-1]
        text = png_text(data).get(FONT_KEY) if data[:4] == b"\x89PNG" else None
        if text is None:
            out.append(f"figure without its smallest text size (use figures.new_figure): {name}")
            continue
        shown = float(text) * fig["shown"] / fig["natural"]
        if shown < MIN_FIGURE_TEXT_PX - 0.05:
            out.append(
                f"figure text {shown * 0.75:.1f} pt at page width, under 9 pt "
                f"({float(text):.1f}px drawn, shown at {fig['shown'] / fig['natural']:.0%}): "
                f"{name}"
            )
    return out


#: Caption words that name panels by place: "A (left) and B (right)", "A (top) and B (bottom)".
_SIDE_WORDS = re.compile(r"\((left|right)\)")
_STACK_WORDS = re.compile(r"\((top|bottom|above|below)\)")


def _runs(filled) -> list[tuple[int, int, bool]]:
    """(start, end, inked) runs of a boolean profile."""
    out, start = [], 0
    for i in range(1, len(filled) + 1):
        if i == len(filled) or filled[i] != filled[start]:
            out.append((start, i, bool(filled[start])))
            start = i
    return out


def panel_layout(data: bytes, min_gap: int = 10) -> tuple[bool, bool]:
    """(side by side, stacked): whether a PNG's content falls into panels next to each other,
    or above each other. Along each direction the inked bands are found; bands thinner than a
    text line (12 px or 4% of the content) count as blank, so titles and tick labels do not
    make panels; a gap between panels is one at least ``min_gap`` px and twice the median gap
    (rows of a grid inside one panel are evenly spaced), and every panel spans 15% of the
    content. Evenly spaced panels read as one grid: a caption is failed only when the figure
    is found laid out the other way (``caption_problems``)."""
    import io

    import numpy as np
    from PIL import Image

    mask = np.asarray(Image.open(io.BytesIO(data)).convert("L")) < 235
    found = [False, False]
    if not mask.any():
        return False, False
    for axis in (0, 1):  # axis 0: a cut through blank columns (side by side); 1: rows
        filled = mask.any(axis=axis)
        idx = np.flatnonzero(filled)
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        span = hi - lo
        thin = max(12.0, 0.04 * span)
        blocks = [(a, b) for a, b, ink in _runs(filled[lo:hi]) if ink and b - a >= thin]
        if len(blocks) < 2:
            continue
        gaps = [blocks[i + 1][0] - blocks[i][1] for i in range(len(blocks) - 1)]
        median = float(np.median(gaps))
        cuts = [i for i, g in enumerate(gaps)
                if g >= min_gap and (len(gaps) == 1 or g >= 2 * median)]  # fmt: skip
        starts = [0] + [blocks[i + 1][0] for i in cuts]
        ends = [blocks[i][1] for i in cuts] + [span]
        parts = [e - a for a, e in zip(starts, ends, strict=True) if e - a >= 0.15 * span]
        found[axis] = len(parts) >= 2
    return found[0], found[1]


def caption_problems(driver) -> list[str]:
    """Captions that name panels left/right where the figure's panels are stacked, or
    top/bottom where they stand side by side."""
    out = []
    for fig in driver.execute_script(_CAPTIONS_JS):
        if not fig["src"].startswith("file:"):
            continue
        caption = " ".join(fig["caption"].split())
        wants_side, wants_stack = _SIDE_WORDS.search(caption), _STACK_WORDS.search(caption)
        if not (wants_side or wants_stack):
            continue
        side, stack = panel_layout(Path(unquote(urlparse(fig["src"]).path)).read_bytes())
        name = fig["src"].rsplit("/", 1)[-1]
        if wants_side and stack and not side:
            out.append(
                f'caption says "{wants_side.group(0)}" but the figure\'s panels are '
                f"stacked top and bottom: {name}"
            )
        if wants_stack and side and not stack:
            out.append(
                f'caption says "{wants_stack.group(0)}" but the figure\'s panels stand '
                f"side by side: {name}"
            )
    return out


def _wait_for_math(driver, seconds: float = 5.0) -> None:
    """Give MathJax (when a page has math) time to typeset it."""
    script = "return Array.from(document.querySelectorAll('.math'))"
    script += ".filter(e => !e.querySelector('mjx-container, svg, img, math')).length"
    deadline = time.monotonic() + seconds
    while driver.execute_script(script) and time.monotonic() < deadline:
        time.sleep(0.2)


class _Links(HTMLParser):
    """The ids (and ``<a name>``) of an HTML page, and the targets of its links."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.assets: list[str] = []  # the scripts and style sheets it loads

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        for key in ("id", "name") if tag == "a" else ("id",):
            if named.get(key):
                self.ids.add(named[key])
        if tag == "a" and named.get("href"):
            self.links.append(named["href"])
        if tag == "script" and named.get("src"):
            self.assets.append(named["src"])
        if tag == "link" and named.get("href") and "stylesheet" in (named.get("rel") or ""):
            self.assets.append(named["href"])


_PARSED: dict[Path, _Links] = {}


def _parsed(page: Path) -> _Links:
    if page not in _PARSED:
        found = _Links()
        found.feed(page.read_text(errors="replace"))
        _PARSED[page] = found
    return _PARSED[page]


def link_problems(page: Path) -> list[str]:
    """Internal links of ``page`` (a built HTML file) that lead nowhere: to a file that does
    not exist, or to an ``#anchor`` that no element of the page they name carries."""
    out: list[str] = []
    for href in dict.fromkeys(_parsed(page).links):
        url = urlparse(href)
        if url.scheme or url.netloc or href.startswith(("mailto:", "javascript:")):
            continue
        target = (page.parent / unquote(url.path)).resolve() if url.path else page
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            out.append(f"link to a missing page: {href}")
        elif (
            url.fragment
            and target.suffix == ".html"
            and unquote(url.fragment) not in _parsed(target).ids
        ):
            out.append(f"link to a missing anchor: {href}")
    return out


#: The most a page may load of scripts and style sheets (MathJax aside, on pages with math):
#: about 600 KB of the theme's and the extensions'; the theme's icon script alone was 1.56 MB
#: (docs/_templates/layout.html leaves it out).
ASSET_BUDGET = 800_000


def weight_problems(page: Path) -> list[str]:
    """The page loads more than :data:`ASSET_BUDGET` bytes of scripts and style sheets, or the
    theme's icon script, or the search index outside the search page."""
    out, total = [], 0
    for src in dict.fromkeys(_parsed(page).assets):
        url = urlparse(src)
        if url.scheme or url.netloc:
            continue  # a network request: the page check reports it
        path = (page.parent / unquote(url.path)).resolve()
        if "mathjax" in path.parts or not path.exists():
            continue
        total += path.stat().st_size
        if path.name == "fontawesome.js":
            out.append(f"loads the theme's icon script ({path.stat().st_size:,} bytes)")
        if path.name == "searchindex.js" and page.name != "search.html":
            out.append("loads the search index outside the search page")
    if total > ASSET_BUDGET:
        out.append(f"loads {total:,} bytes of scripts and style sheets (over {ASSET_BUDGET:,})")
    return out


def check_page(driver, url: str, *, navigation: bool, shots: Path | None = None) -> list[str]:
    """Problems of one page (empty: none), at both widths; screenshots into ``shots``."""
    _set_width(driver, WIDE)
    driver.get(url)
    time.sleep(0.2)
    _wait_for_math(driver)
    problems = list(driver.execute_script(_PROBLEMS_JS))
    problems += driver.execute_script(_LAYOUT_JS)
    problems += figure_problems(driver)
    problems += caption_problems(driver)
    if url.startswith("file:"):
        page = Path(unquote(urlparse(url).path))
        problems += link_problems(page) + weight_problems(page)
    if navigation:
        nav = driver.execute_script(_NAV_JS)
        if not (nav["prev"] or nav["next"]):
            problems.append("no previous/next links")
        if nav["sections"] >= 2 and nav["toc"] == 0:
            problems.append("no table of contents of the page")
    if shots:
        problems += screenshot(driver, shots.with_name(f"{shots.name}.png"))
    wide = driver.execute_script(_HEIGHT_JS)
    if wide > MAX_PAGE_PX:
        problems.append(f"page is {wide:,} px tall at {WIDE}px (at most {MAX_PAGE_PX:,}): split it")
    _set_width(driver, NARROW)
    time.sleep(0.2)
    HEIGHTS[url] = (wide, driver.execute_script(_HEIGHT_JS))
    problems += [f"at {NARROW}px: {p}" for p in driver.execute_script(_LAYOUT_JS)]
    problems += [f"at {NARROW}px: {p}" for p in driver.execute_script(_PHONE_CODE_JS)]
    if shots:
        problems += screenshot(driver, shots.with_name(f"{shots.name}.{NARROW}px.png"))
    _set_width(driver, WIDE)
    return problems


#: Searches and what each must list: (term, pages to be listed (any one of these globs), pages
#: never listed). The tests page (its sources make it 1.6 MB) is out of the search index
#: (docs/tests.md's ``nosearch``): it came up in nearly every search, above the pages.
SEARCHES = (
    ("collective_permute", ("*",), ()),
    ("all_gather_matmul", ("api/*.html", "tutorials/*.html"), ("tests.html",)),
)

_HITS_JS = """
const items = document.querySelectorAll('#search-results li, ul.search li');
const done = document.querySelector('#search-results p.search-summary, #search-results > p');
return {done: !!(done && /found|did not match/i.test(done.innerText || '')),
        pages: Array.from(items).map(li => (li.querySelector('a') || {}).href || '')};
"""


def check_search(driver, root: Path) -> list[str]:
    """Problems: a search of :data:`SEARCHES` lists none of the pages it must, or a page it
    must not."""
    out = []
    for term, wanted, unwanted in SEARCHES:
        driver.get((root / "search.html").as_uri() + f"?q={term}")
        found: dict = {"done": False, "pages": []}
        for _ in range(150):
            found = driver.execute_script(_HITS_JS)
            if found["done"]:
                break
            time.sleep(0.1)
        listed = [
            Path(unquote(urlparse(url).path)).relative_to(root)
            for url in found["pages"]
            if url.startswith("file:")
        ]
        if not any(page.match(glob) for page in listed for glob in wanted):
            out.append(f"search for {term!r} lists none of {', '.join(wanted)} ({listed})")
        for page in listed:
            if any(page.match(glob) for glob in unwanted):
                out.append(f"search for {term!r} lists {page}")
    return out


def check_math(driver, root: Path) -> list[str]:
    """Problems unless some page holds math and MathJax, served from the build, typesets it
    (each page's own check fails math left raw and any network request)."""
    with_math = [p for p in pages(root) if 'class="math' in p.read_text(errors="replace")]
    if not with_math:
        return ["no page shows a formula (math markup missing from the tutorials)"]
    page = with_math[0]
    driver.get(page.as_uri())
    _wait_for_math(driver)
    found = driver.execute_script(
        "return [document.querySelectorAll('.math mjx-container').length,"
        " Array.from(document.scripts).map(s => s.src).filter(s => /mathjax/i.test(s))]"
    )
    if not found[0]:
        return [f"{page.relative_to(root)}: no formula rendered (MathJax: {found[1]})"]
    if not all(src.startswith("file:") for src in found[1]):
        return [f"{page.relative_to(root)}: MathJax not served from the build: {found[1]}"]
    return []


class _Text(HTMLParser):
    """The text of an HTML page, a line per block (paragraph, list item, table cell)."""

    BLOCKS = frozenset({"p", "li", "td", "th", "tr", "div", "dt", "dd", "br", "pre", "section"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip = max(0, self._skip - 1)
        elif tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data.replace("\n", " "))


#: A caveat shown in full (xla_permute_tools.tables.caveat_entries, or a caveat's rows as a
#: table): the text of its "what goes wrong" entry, the line after the label or on it.
_CAVEAT_BODY = re.compile(r"^[ \t]*what goes wrong:?\s*([^\n]{20,})\n\s*this package", re.I | re.M)


def caveat_problems(files: list[Path], root: Path) -> list[str]:
    """Problems: a caveat shown in full more than once on the site (on two pages, or twice on
    one). Each is shown once, on the hardware caveats page, under its anchor
    ``caveat-<id>``; other pages link to it with ``{ref}`caveat-<id>```."""
    shown: dict[str, list[str]] = {}
    for page in files:
        parser = _Text()
        parser.feed(page.read_text(errors="replace"))
        for body in _CAVEAT_BODY.findall("".join(parser.parts)):
            key = " ".join(body.split()).lower()
            shown.setdefault(key, []).append(str(page.relative_to(root)))
    return [
        f"a caveat shown in full {len(where)} times ({', '.join(where)}): show it once, on the "
        f"hardware caveats page, and link to it with {{ref}}`caveat-<id>`: "
        f'"{key[:60]}"'
        for key, where in shown.items()
        if len(where) > 1
    ]


def site_caveats(driver, root: Path) -> list[str]:
    """:func:`caveat_problems` of the built pages; ``driver`` is unused."""
    return caveat_problems(pages(root), root)


def other_links(driver, root: Path) -> list[str]:
    """Broken internal links of the HTML files no page check opens (the highlighted sources
    under ``_modules``, the index, the search page); ``driver`` is unused."""
    checked = set(pages(root))
    return [
        f"{page.relative_to(root)}: {problem}"
        for page in sorted(root.rglob("*.html"))
        if page not in checked and "_static" not in page.parts and "_sources" not in page.parts
        for problem in link_problems(page)
    ]


#: The pipeline bubble calculator (``div#bubble-calculator``, on the schedules page): for each
#: of these schedules at (ranks, micro-batches) it must show the bubble its page asserts.
CALCULATOR_SCHEDULES = ("gpipe", "1f1b", "zbv", "dualpipev")
CALCULATOR_SIZE = (4, 8)

_CALCULATOR_JS = r"""
const [name, ranks, micro] = arguments;
const box = document.getElementById("bubble-calculator");
const set = (choice, value) => {
  const select = box.querySelector(`select[data-choice="${choice}"]`);
  if (select) select.value = String(value);
  return !!select && select.value === String(value);
};
if (!(set("schedule", name) && set("ranks", ranks) && set("micro-batches", micro))) {
  return {error: `cannot choose ${name}, ${ranks} ranks, ${micro} micro-batches`};
}
box.querySelector("select").dispatchEvent(new Event("change", {bubbles: true}));
const result = box.querySelector(".result");
// The page's own figure: the "bubble" column of the last table before the calculator.
let asserted = null;
for (const table of document.querySelectorAll("article table")) {
  if (!(table.compareDocumentPosition(box) & Node.DOCUMENT_POSITION_FOLLOWING)) continue;
  const heads = Array.from(table.querySelectorAll("thead th")).map((th) => th.innerText.trim());
  const col = heads.indexOf("bubble");
  if (col < 0) continue;
  asserted = null;
  for (const tr of table.querySelectorAll("tbody tr")) {
    const cells = Array.from(tr.children).map((td) => td.innerText.trim());
    if (cells[0] === name) asserted = cells[col];
  }
}
return {shown: result.dataset.bubble || "", text: result.innerText, asserted,
        idle: Number(result.dataset.idle), drawn: box.querySelectorAll(".grid .idle").length};
"""


def check_calculator(driver, root: Path) -> list[str]:
    """Problems unless exactly one page holds the bubble calculator and, for each of
    :data:`CALCULATOR_SCHEDULES` at :data:`CALCULATOR_SIZE`, it shows the bubble of the
    "bubble" column in the last table before it (the page's cell counts those from
    ``xp.make_schedule`` and asserts them), and draws as many idle cells as it counts."""
    found = [p for p in pages(root) if 'id="bubble-calculator"' in p.read_text(errors="replace")]
    if len(found) != 1:
        where = [str(p.relative_to(root)) for p in found]
        return [f"the bubble calculator is on {len(found)} pages, not one: {where}"]
    rel = found[0].relative_to(root)
    _set_width(driver, WIDE)
    driver.get(found[0].as_uri())
    out = []
    for name in CALCULATOR_SCHEDULES:
        got = driver.execute_script(_CALCULATOR_JS, name, *CALCULATOR_SIZE)
        case = f"{rel}: bubble calculator, {name} at {CALCULATOR_SIZE} (ranks, micro-batches)"
        if "error" in got:
            out.append(f"{case}: {got['error']}")
        elif got["asserted"] is None:
            out.append(f"{case}: no table with a 'bubble' column and a row {name!r} before it")
        elif got["shown"] != got["asserted"] or got["shown"] not in got["text"]:
            out.append(f"{case}: shows {got['text']!r}, the page asserts {got['asserted']!r}")
        elif got["idle"] != got["drawn"]:
            out.append(f"{case}: counts {got['idle']} idle cells, draws {got['drawn']}")
        else:
            print(f"calculator: {name} at {CALCULATOR_SIZE}: {got['shown']} as the page asserts")
    return out


def pages(root: Path) -> list[Path]:
    skip = {"search.html", "genindex.html", "py-modindex.html"}
    return sorted(
        p
        for p in root.rglob("*.html")
        if p.name not in skip
        and "_modules" not in p.parts
        and "_static" not in p.parts
        and "_sources" not in p.parts
    )


def _small_text_figure() -> str:
    """A figure from xla_permute_tools.figures with 6 pt text, shown at its natural size."""
    from xla_permute_tools.figures import new_figure

    fig = new_figure(figsize=(3, 1))
    fig.text(0.5, 0.5, "six-point text", fontsize=6)
    return base64.b64encode(fig._repr_png_()).decode()


def _stacked_figure() -> bytes:
    """Two panels, one above the other, from xla_permute_tools.figures."""
    from xla_permute_tools.figures import new_figure

    fig = new_figure(figsize=(6, 5))
    for row, title in enumerate(("contiguous", "zigzag")):
        ax = fig.add_subplot(2, 1, row + 1)
        ax.plot([0, 1, 2], [row, 2, 1])
        ax.set_title(title, fontsize=12)
    fig.tight_layout()
    return fig._repr_png_()


#: Pages made to fail one check each: name -> (body, what the problem message must say).
_BAD_PAGES = {
    "raw_table.html": (
        "<div class='cell_output'><pre>| a | b |\n|---|---|\n| 1 | 2 |</pre></div>",
        "raw markdown table",
    ),
    "wide_block.html": ("<pre style='white-space:pre'>" + "x" * 400 + "</pre>", "wider than"),
    "wide_formula.html": (
        "<div class='math'><mjx-container display='true' style='display:block;"
        "overflow-x:auto;white-space:nowrap'>" + "T_{mm} + " * 60 + "</mjx-container></div>",
        "mjx-container wider than the column",
    ),
    "raw_directive.html": (
        "<p>Source:</p><pre>   .. literalinclude:: /../tests/test_x.py\n   :language: python</pre>",
        "raw directive text",
    ),
    "raw_fence.html": ("<p>```{dropdown} Source</p>", "raw directive text"),
    "raw_tex.html": (
        "<p>The backward: <span class='math notranslate nohighlight'>"
        "\\(\\frac{\\partial L}{\\partial x}\\)</span></p>",
        "math left as raw TeX",
    ),
    "scrolled_table.html": (  # nine columns, as the bench's peak memory table had
        "<div class='pst-scrollable-table-container' style='overflow-x:auto'><table><tr>"
        "<th>program</th>"
        + "<th>x computed, no token</th><th>vs baseline</th>" * 4
        + "</tr><tr><td>matmul_reduce_scatter/baseline</td>"
        + "<td>2.41 MiB</td><td>1 (baseline)</td>" * 4
        + "</tr></table></div>",
        f"table scrolls at {WIDE}px",
    ),
    "folded_table.html": (  # the same, in a fold the reader opens
        "<details><summary>The whole report</summary><div class='pst-scrollable-table-container'"
        " style='overflow-x:auto'><table><tr><td>matmul_reduce_scatter/baseline</td>"
        + "<td>x computed, no token</td><td>1 (baseline)</td>" * 4
        + "</tr></table></div></details>",
        f"table scrolls at {WIDE}px",
    ),
    "broken_word.html": (
        "<table><tr><td style='width:3em;overflow-wrap:anywhere'>baseline native</td>"
        "<td>ok</td></tr></table>",
        "broken mid-word",
    ),
    "wide_page.html": (
        "<p><code style='white-space:nowrap'>" + "xp.all_gather_matmul(x, w) " * 3 + "</code></p>",
        f"at {NARROW}px: page wider than",
    ),
    "small_figure.html": ("<div class='cell_output'><img src='small.png'></div>", "under 9 pt"),
    "stderr.html": (
        "<div class='cell_output'><div class='output stderr'><pre>2026-12-02 07:00:00.1 E0000 "
        "rendezvous.cc:42] This thread has been waiting for 10 s</pre></div></div>",
        "stderr output on the page",
    ),
    "caption_left_right.html": (
        "<figure><a href='stacked.png'><img src='stacked.png'></a><figcaption>Contiguous (left)"
        " and zigzag (right).</figcaption></figure>",
        'caption says "(left)" but the figure\'s panels are stacked',
    ),
    "later_prerequisite.html": (
        "<nav class='bd-docs-nav'><a class='reference internal' href='later_prerequisite.html'>"
        "this page</a> <a class='reference internal' href='raw_table.html'>a later page</a>"
        "</nav><ul><li>You need first <a href='raw_table.html'>a later page</a>.</li></ul>",
        "prerequisite later in the tour",
    ),
    "failure_not_shown.html": (
        "<div class='cell tag_demonstrates-failure'><div class='cell_input'><pre>"
        "xp.run_on_mesh(bare_wait, x, n=N)</pre></div><div class='cell_output'><pre>"
        "In this run the mesh finished.</pre></div></div>",
        "demonstrated failure did not happen",
    ),
    "network.html": (
        "<script src='http://127.0.0.1:9/mathjax/tex-chtml.js'></script><p>a formula</p>",
        "network request",
    ),
    "figure_no_link.html": (
        "<div class='cell_output'><img src='small.png'></div>",
        "does not open at full size",
    ),
    "wrapping_code.html": (
        "<div class='highlight'><pre style='white-space:pre-wrap'>"
        + "y = xp.all_gather_matmul(x, w, groups=groups) " * 4
        + "</pre></div>",
        f"at {NARROW}px: code wraps instead of scrolling",
    ),
    "broken_anchor.html": (
        "<h2 id='a-section'>A section</h2><p><a href='#a-section'>here</a>, "
        "<a href='broken_anchor.html#no-such-section'>gone</a></p>",
        "link to a missing anchor: broken_anchor.html#no-such-section",
    ),
    "missing_page.html": (
        "<p><a href='api/no_such_page.html#x'>a page never built</a></p>",
        "link to a missing page",
    ),
    "heavy_page.html": (
        "<script src='heavy.js'></script><p>a page with a 900 KB script</p>",
        "bytes of scripts and style sheets (over",
    ),
    "cut_next_link.html": (
        "<div class='prev-next-area'><a class='right-next' href='#' style='display:flex;"
        "max-width:45%;overflow-x:hidden'><div class='prev-next-info'><p class='prev-next-title'>"
        + "CollectivePermute" * 4
        + "</p></div></a></div>",
        "previous/next link cut off",
    ),
    "tall_page.html": ("<div style='height:30000px'>tall</div>", "screenshot cut short"),
    "long_page.html": ("<div style='height:20000px'>long</div>", "px tall at"),
}


def self_test(driver) -> list[str]:
    """Check that every check catches the page made to fail it."""
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        # The figures: real PNGs from xla_permute_tools.figures.
        Path(tmp, "small.png").write_bytes(base64.b64decode(_small_text_figure()))
        Path(tmp, "stacked.png").write_bytes(_stacked_figure())
        Path(tmp, "heavy.js").write_text("// " + "x" * 900_000 + "\n")
        for name, (body, expected) in _BAD_PAGES.items():
            page = Path(tmp, name)
            page.write_text(
                "<html><body><article class='bd-article' style='max-width:600px'>"
                f"{body}</article></body></html>"
            )
            shots = None
            if name == "tall_page.html":  # a screenshot of the first 16000 px only
                shots = Path(tmp, "shots")
                shots.mkdir()
                _set_width(driver, WIDE)
                driver.get(page.as_uri())
                shot = driver.execute_cdp_cmd(
                    "Page.captureScreenshot",
                    {
                        "format": "png",
                        "captureBeyondViewport": True,
                        "clip": {"x": 0, "y": 0, "width": WIDE, "height": 16000, "scale": 1},
                    },
                )
                Path(shots, "tall.png").write_bytes(base64.b64decode(shot["data"]))
                height = driver.execute_script("return document.documentElement.scrollHeight")
                problems = screenshot_problems(Path(shots, "tall.png"), height)
                # ... and the screenshots check_page takes cover it all.
                whole = check_page(driver, page.as_uri(), navigation=False, shots=shots / "t")
                if any("screenshot" in p for p in whole):
                    failures.append(f"self-test: full screenshots of {name} fall short: {whole}")
            else:
                problems = check_page(driver, page.as_uri(), navigation=False)
            if not any(expected in p for p in problems):
                failures.append(f"self-test: the check did not catch {name} ({problems})")
            else:
                print(f"self-test: {name} caught: {[p for p in problems if expected in p][0]}")
        failures += _self_test_caveats(Path(tmp))
    return failures


def _self_test_caveats(tmp: Path) -> list[str]:
    """The same caveat in full on two pages (as the caveats' rows, a table), and a page that
    only links to it: the first two are caught, the link is not."""
    from xla_permute_tools.catalog import caveats

    caveat = next(c for c in caveats() if c.id == "collective-token")
    rows = "".join(f"<tr><td>{label}</td><td>{text}</td></tr>" for label, text in caveat.rows())
    table = f"<table><thead><tr><th>{caveat.id}</th><th>{caveat.severity}</th></tr></thead>"
    files = []
    for name, body in (
        ("caveat_page_a.html", table + f"<tbody>{rows}</tbody></table>"),
        ("caveat_page_b.html", table + f"<tbody>{rows}</tbody></table>"),
        ("caveat_link.html", f"<p>The caveat <a href='a.html#caveat-{caveat.id}'>link</a>.</p>"),
    ):
        files.append(tmp / name)
        files[-1].write_text(
            f"<html><body><article class='bd-article'>{body}</article></body></html>"
        )
    problems = caveat_problems(files, tmp)
    caught = [p for p in problems if "caveat_page_a.html, caveat_page_b.html" in p]
    if len(problems) != 1 or not caught:
        return [f"self-test: the caveat shown on two pages was not caught alone ({problems})"]
    print(f"self-test: caveat_page_a/b.html caught: {caught[0]}")
    return []


def _check_site(driver, root: Path, rel: Path, shots: Path | None) -> list[str]:
    navigation = rel.parts[0] in ("tutorials", "api", "api.html") or rel.name == "index.html"
    problems = check_page(driver, (root / rel).as_uri(), navigation=navigation, shots=shots)
    return [f"{rel}: {p}" for p in problems]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built HTML (docs/_build/html)")
    parser.add_argument("--screenshots", type=Path, help="write PNGs of each page here")
    parser.add_argument("--self-test", action="store_true", help="first check broken pages")
    parser.add_argument(
        "--browsers", type=int, default=2, help="pages checked at once, one Chromium each"
    )
    parser.add_argument(
        "--pages", default="*", help="check only the pages matching this glob (tutorials/05*)"
    )
    args = parser.parse_args(argv)
    root = args.site.resolve()
    if not (root / "index.html").exists():
        parser.error(f"{root} holds no index.html; build the docs first (make docs)")
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)
    # Jobs, the tallest pages first (their screenshots take most of the time): each takes
    # a driver and returns its problems. The self-test runs in one of the browsers too.
    jobs: list[tuple[str, Callable[[Any], list[str]]]] = []
    for page in sorted(pages(root), key=lambda p: -p.stat().st_size):
        rel = page.relative_to(root)
        if not rel.match(args.pages) and not rel.with_suffix("").match(args.pages):
            continue
        shots = None
        if args.screenshots:
            shots = args.screenshots / str(rel.with_suffix("")).replace("/", "__")
        jobs.append((str(rel), partial(_check_site, root=root, rel=rel, shots=shots)))
    if args.self_test:
        jobs.insert(1, ("self-test", self_test))
    jobs.append(("search", partial(check_search, root=root)))
    jobs.append(("math", partial(check_math, root=root)))
    jobs.append(("links", partial(other_links, root=root)))
    jobs.append(("caveats", partial(site_caveats, root=root)))
    jobs.append(("calculator", partial(check_calculator, root=root)))

    drivers: queue.Queue = queue.Queue()

    def run(job: Callable[[Any], list[str]]) -> list[str]:
        try:
            driver = drivers.get_nowait()  # a browser another job left
        except queue.Empty:
            driver = _driver()
        try:
            return job(driver)
        finally:
            drivers.put(driver)

    results: dict[str, list[str]] = {}
    try:
        with ThreadPoolExecutor(max_workers=max(1, args.browsers)) as pool:
            futures = {name: pool.submit(run, job) for name, job in jobs}
            for name, future in futures.items():
                results[name] = future.result()
    finally:
        while not drivers.empty():
            drivers.get_nowait().quit()
    failures: list[str] = []
    for name, problems in sorted(results.items()):
        if name.endswith(".html"):
            wide, narrow = HEIGHTS.get((root / name).as_uri(), (0, 0))
            print(
                f"{'ok ' if not problems else 'BAD'} {name:44} {wide:>7,} px at {WIDE}, "
                f"{narrow:>7,} at {NARROW}"
            )
        failures += problems
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{len(failures)} problem(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
