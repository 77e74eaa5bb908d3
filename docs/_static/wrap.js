// Each line of a code cell becomes a block (span.code-line), so that wrap.css can mark where
// a long line wraps: its continuation is indented and carries an arrow. The text, its
// highlighting and what the copy button copies stay the same.
document.addEventListener("DOMContentLoaded", () => {
  for (const pre of document.querySelectorAll("div.highlight pre")) {
    const lines = [[]];
    const walk = (node, wrap) => {
      for (const child of Array.from(node.childNodes)) {
        if (child.nodeType === Node.TEXT_NODE) {
          child.textContent.split("\n").forEach((part, i) => {
            if (i > 0) lines.push([]);
            if (part) lines[lines.length - 1].push(wrap(document.createTextNode(part)));
          });
        } else if (child.nodeType === Node.ELEMENT_NODE) {
          walk(child, (inner) => {
            const copy = child.cloneNode(false);
            copy.appendChild(inner);
            return wrap(copy);
          });
        }
      }
    };
    walk(pre, (inner) => inner);
    if (lines.length > 1 && lines[lines.length - 1].length === 0) lines.pop();
    pre.textContent = "";
    for (const nodes of lines) {
      const line = document.createElement("span");
      line.className = "code-line";
      if (nodes.length === 0) line.style.minHeight = "1lh";
      for (const n of nodes) line.appendChild(n);
      const indent = line.textContent.length - line.textContent.trimStart().length;
      if (indent) line.style.setProperty("--indent", `${indent}ch`);
      pre.appendChild(line);
    }
  }
});

// Every figure (a cell's image output or a figure directive's image) opens at full size: it
// becomes a link to its own image file, which a phone can zoom.
document.addEventListener("DOMContentLoaded", () => {
  const article = document.querySelector("article.bd-article") || document.body;
  for (const img of article.querySelectorAll("div.cell_output img, figure img")) {
    if (img.closest("a[href]")) continue;
    const link = document.createElement("a");
    link.href = img.currentSrc || img.src;
    link.className = "figure-full-size";
    link.title = "Open the figure at full size";
    img.replaceWith(link);
    link.appendChild(img);
  }
});

// A link to an anchor inside a folded output (each caveat's entry on the hardware caveats
// page is one) opens the folds around it and scrolls to it, on load and on a link in the page.
const openFoldsAroundTarget = () => {
  const id = decodeURIComponent(location.hash.slice(1));
  const target = id && document.getElementById(id);
  if (!target) return;
  let opened = false;
  for (let fold = target.closest("details"); fold; fold = fold.parentElement.closest("details")) {
    if (!fold.open) {
      fold.open = true;
      opened = true;
    }
  }
  if (opened) target.scrollIntoView();
};
document.addEventListener("DOMContentLoaded", openFoldsAroundTarget);
window.addEventListener("hashchange", openFoldsAroundTarget);

// In a table (the API pages' tables of names aside, wrap.css) a literal may break after an
// opening bracket, a "=", a "," or a ".": RowwiseParallel(<wbr>output_layouts=<wbr>Shard(1))
// would otherwise set its column's width and push the table past the column; so may any
// text after a "/" (the bench's program names: matmul_reduce_scatter/<wbr>baseline). A <wbr>
// is an element, not a character: what a reader copies stays the same.
document.addEventListener("DOMContentLoaded", () => {
  const article = document.querySelector("article.bd-article") || document.body;
  const breakAfter = (node, at) => {
    const parts = node.textContent.split(at);
    if (parts.length < 2) return;
    const pieces = document.createDocumentFragment();
    parts.forEach((part, i) => {
      if (i > 0) pieces.appendChild(document.createElement("wbr"));
      pieces.appendChild(document.createTextNode(part));
    });
    node.replaceWith(pieces);
  };
  for (const cell of article.querySelectorAll("table:not(.autosummary) :is(td, th)")) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    const texts = [];
    for (let node; (node = walker.nextNode()); ) texts.push(node);
    for (const node of texts) {
      if (node.parentElement.closest(".math, mjx-container")) continue;  // MathJax's TeX
      const literal = node.parentElement.closest("code.literal");
      breakAfter(node, literal ? /(?<=[(=,.\/])(?=.)/ : /(?<=\/)(?=\S)/);
    }
  }
});
