"""Sphinx configuration: every tutorial is shown executed; any error fails the build.

The outputs come from the test run when it executed the same page (``make test`` saves each
tutorial whose every cell passed to a jupyter-cache, tests/notebook_cells.py); a page not in the
cache, or cached before the library's last change, is executed here. So ``make docs`` alone
works from a clean tree, and in CI (``make test`` then ``make docs-check``) each tutorial runs
once.
"""

from __future__ import annotations

import inspect
import os
import shutil
import sys
from pathlib import Path

# The notebooks import torch_xla on the host (never touching a device); tell it the platform
# rather than have it log its default choice into every page. The kernels inherit this.
os.environ.setdefault("PJRT_DEVICE", "CPU")

project = "xla-permute"
author = "xla-permute developers"
copyright = "2026, xla-permute developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    # The table of names atop each API page (its directive without :toctree: generates nothing).
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinx_design",
    # MathJax 3 served from the build's _static/mathjax (the build and its readers may be
    # offline): the package sets mathjax_path to its copy and copies it after the build.
    "sphinx-mathjax-offline",
]

source_suffix = {".md": "myst-nb", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "jupyter_execute", "**/.ipynb_checkpoints", "*.py", "**/_templates"]
root_doc = "index"

_ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(_ROOT / "tests"))
from notebook_cells import EXECUTED_CACHE  # noqa: E402


def _drop_stale_outputs(cache_path: Path, sources: Path) -> None:
    """Forget cached outputs older than the newest library file: they may no longer hold."""
    if not cache_path.exists():
        return
    from datetime import timezone

    from jupyter_cache import get_cache

    newest = max(p.stat().st_mtime for p in sources.rglob("*.py"))
    cache = get_cache(str(cache_path))
    for record in cache.list_cache_records():
        created = record.created
        if created.tzinfo is None:  # sqlite keeps the UTC time without its zone
            created = created.replace(tzinfo=timezone.utc)
        if created.timestamp() < newest:
            cache.remove_cache(record.pk)


_drop_stale_outputs(EXECUTED_CACHE, _ROOT / "src" / "xla_permute")

# Execution: every cell, any error fails the build; outputs the test run saved are reused.
nb_execution_mode = "cache"
nb_execution_cache_path = str(EXECUTED_CACHE)
nb_execution_raise_on_error = True
nb_execution_allow_errors = False
nb_execution_excludepatterns: list[str] = []
nb_execution_timeout = 900
nb_execution_show_tb = True
nb_kernel_rgx_aliases = {".*": "python3"}
nb_merge_streams = True
# Markdown from cells (display(Markdown(...))) is parsed as MyST, so pipe tables are tables.
nb_render_markdown_format = "myst"

myst_enable_extensions = ["colon_fence", "dollarmath", "attrs_block"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autosummary_generate = False
autodoc_typehints = "description"
napoleon_google_docstring = True
nitpicky = False

html_theme = "sphinx_book_theme"
html_title = "xla-permute"
html_theme_options = {
    "use_download_button": True,
    "use_source_button": False,
    "use_repository_button": False,
    "show_toc_level": 2,
    "show_prev_next": True,
    "home_page_in_toc": True,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
# Theme weight: the theme's layout less its icon script and, outside the search page, its
# search index (docs/_templates/layout.html says why).
templates_path = ["_templates"]
html_css_files = ["wrap.css"]
html_js_files = ["wrap.js"]
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

# No autodoc_default_options = {"members": True}: a default of True replaces a directive's own
# list (``:members: a, b`` would document every member). Each directive says what it documents.
autodoc_inherit_docstrings = False  # torch/matplotlib docstrings use roles we do not load
# No intersphinx (CI has no network): references to other projects' types stay plain text.
nitpick_ignore_regex = [
    ("py:.*", r"(torch|torch_xla|pathlib|collections|typing|argparse|subprocess|fractions|os)\b.*"),
    ("py:.*", r"(nn|nbclient|numpy|matplotlib|cloudpickle)\b.*"),
    ("py:.*", r"(Path|Tensor|Callable|Sequence|Any|NotebookNode|Module|Figure|Self)"),
    ("py:.*", r"(Groups|GroupsLike|Pairs|PairsLike|Pair|Backend|Tick|MatmulOp|Layout|Strategy)"),
    ("py:.*", r"(PositionFn|Act|Gate)"),
]


def _notebook_download(app, pagename, templatename, context, doctree) -> None:
    """Offer each executed tutorial as ``.ipynb`` in the theme's download menu.

    myst-nb writes the executed notebook to ``<build>/jupyter_execute``; the theme lists a
    ``.ipynb`` download when ``ipynb_source`` names a copy under ``_sources``.
    """
    executed = Path(app.outdir).parent / "jupyter_execute" / f"{pagename}.ipynb"
    if not executed.exists():
        return
    target = Path(app.outdir) / "_sources" / f"{pagename}.ipynb"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(executed, target)
    context["ipynb_source"] = f"{pagename}.ipynb"


def _lookup(name: str) -> object | None:
    """The object a dotted name reaches by import and attribute access, or None."""
    import importlib

    parts = name.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for attr in parts[split:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


def _aliases(obj: object, last: str) -> list[str]:
    """The dotted names ``obj`` is reached by: where it is defined, and every module of the
    project that holds it as ``last`` (``xla_permute.collective_permute``, ...)."""
    names = []
    if isinstance(obj, type(sys)):
        names.append(obj.__name__)
    elif isinstance(getattr(obj, "__module__", None), str) and hasattr(obj, "__qualname__"):
        names.append(f"{obj.__module__}.{obj.__qualname__}")
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", None)
        if not isinstance(name, str) or name.partition(".")[0] not in _PACKAGES:
            continue
        if getattr(module, last, None) is obj:
            names.append(f"{name}.{last}")
    return list(dict.fromkeys(names))


_PACKAGES = ("xla_permute", "xla_permute_tools")


def _resolve_public_name(app, env, node, contnode):
    """Resolve a reference to a name of the project by any of the names its object has.

    The API pages document each object once, under the name a user types
    (``xla_permute.collective_permute``); a page or docstring may name it where it is defined
    (``xla_permute.permute.collective_permute``), or relative to the module of the docstring
    it stands in (``PermuteWork`` in ``collective_permute``'s): both reach the entry. A method
    or attribute follows its class (``xla_permute.mesh2d.Mesh2D.shard_sequence``)."""
    import re

    from sphinx.util.nodes import get_node_source

    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    contexts = [None, node.get("py:module")]
    try:
        source = get_node_source(node)
    except ValueError:
        source = ""
    found = re.search(r"docstring of ([\w.]+)", source or "")
    if found:  # the module (and class) the docstring was written in
        parts = found.group(1).split(".")
        contexts += [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]
    domain = env.get_domain("py")
    tried: set[str] = set()
    for context in contexts:
        name = f"{context}.{target}" if context else target
        if name.partition(".")[0] not in _PACKAGES or name in tried:
            continue
        tried.add(name)
        parts = name.split(".")
        for split in range(len(parts), 1, -1):
            obj = _lookup(".".join(parts[:split]))
            if obj is None:
                continue
            for alias in [".".join(parts[:split]), *_aliases(obj, parts[split - 1])]:
                candidate = ".".join([alias, *parts[split:]])
                if candidate == target:
                    continue
                hits = domain.resolve_any_xref(
                    env, node["refdoc"], app.builder, candidate, node, contnode
                )
                if hits:
                    return hits[0][1]
    return None


def _no_type_docstring(app, what, name, obj, options, lines) -> None:
    """A constant without a ``#:`` comment gets no docstring, not its type's (``dict``'s)."""
    if what in ("data", "attribute") and lines:
        own = getattr(type(obj), "__doc__", None)
        if isinstance(own, str) and "\n".join(lines).strip() == inspect.cleandoc(own).strip():
            lines.clear()


def _real_name_targets(app, doctree) -> None:
    """Give each entry documented under its public name (``xla_permute.collective_permute``)
    the anchor of the name it is defined under (``xla_permute.permute.collective_permute``)
    too: the highlighted sources (viewcode) link back to that one."""
    from sphinx import addnodes

    for sig in doctree.findall(addnodes.desc_signature):
        module, fullname = sig.get("module"), sig.get("fullname")
        if not module or not fullname or not module.startswith("xla_permute"):
            continue
        obj = _lookup(f"{module}.{fullname}")
        qualname = getattr(obj, "__qualname__", None)
        if qualname is None or not isinstance(getattr(obj, "__module__", None), str):
            continue
        real = f"{obj.__module__}.{qualname}"
        if real != f"{module}.{fullname}" and real not in sig["ids"]:
            sig["ids"].append(real)


def _viewcode_real_names(app, env) -> None:
    """The highlighted sources (viewcode) link each definition back to
    ``#<module>.<name>``, with the module's name as first documented (``xla_permute`` for
    ``xla_permute.pairs``, whose first entry was ``xla_permute.check_pairs``); make it the
    module the source is, whose ``#xla_permute.pairs.<name>`` every entry carries
    (:func:`_real_name_targets`)."""
    modules = getattr(env, "_viewcode_modules", {})
    for modname, entry in modules.items():
        if isinstance(entry, tuple) and len(entry) == 4:
            modules[modname] = (*entry[:3], modname)


def _trim_icon_classes(app, exc) -> None:
    """Theme weight: keep, in the theme's stylesheet as built, only the Font Awesome icon
    classes a page or a script of the site names (the theme lists ~2,000 of them, 66 KB; the
    site uses about 20). The icons drawn from the stylesheet itself (admonitions, links) name
    their glyphs directly and are untouched."""
    import re

    if exc is not None or app.builder.format != "html":
        return
    out = Path(app.outdir)
    css = out / "_static" / "styles" / "pydata-sphinx-theme.css"
    if not css.exists():
        return
    named = re.compile(r"fa-[a-z0-9-]+")
    used: set[str] = set()
    for path in [*out.rglob("*.html"), *(out / "_static").rglob("*.js")]:
        if "mathjax" not in path.parts and "_sources" not in path.parts:
            used.update(named.findall(path.read_text(errors="replace")))
    rule = re.compile(r'(?<=[}\s])((?:\.fa-[a-z0-9-]+,)*\.fa-[a-z0-9-]+)\{--fa:"[^"]*"\}')
    text = css.read_text()
    kept = rule.sub(lambda m: m.group(0) if used & set(named.findall(m.group(1))) else "", text)
    css.write_text(kept)


def _fresh_source_pages(app) -> None:
    """Have viewcode write every highlighted source page anew: it skips a page newer than its
    module, which kept links back to anchors the API pages no longer have."""
    if app.builder.format == "html":
        shutil.rmtree(Path(app.outdir) / "_modules", ignore_errors=True)


def _test_files_directive():
    """``{test-files}``: one section per ``tests/test_*.py``: its docstring, then its source.

    Every section has the label ``test-<name>`` (``test-test_permute``), so pages cite a test
    file as ``{ref}`tests/test_permute.py <test-test_permute>```.
    """
    import ast

    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    class TestFiles(SphinxDirective):
        def run(self):
            out = []
            for path in sorted((_ROOT / "tests").glob("test_*.py")):
                doc = ast.get_docstring(ast.parse(path.read_text())) or ""
                self.env.note_dependency(str(path))
                label = f"test-{path.stem}"
                section = nodes.section(ids=[label.replace("_", "-")], names=[label])
                section += nodes.title(text=f"tests/{path.name}")
                self.state.document.note_explicit_target(section)
                # The page is MyST markdown, so the nested content is MyST too (reST here
                # would show as raw text: docs-check fails on that).
                body = [*doc.splitlines(), "", f":::{{dropdown}} Source of tests/{path.name}"]
                body += [f"```{{literalinclude}} /../tests/{path.name}", ":language: python"]
                body += ["```", ":::", ""]
                nested_parse_with_titles(self.state, StringList(body, source=str(path)), section)
                out.append(section)
            return out

    return TestFiles


def _runtime_role(name, rawtext, text, lineno, inliner, options=None, content=None):
    """``{page-runtime}`this page```: how long this page's cells took to run, filled in once
    the page has executed (or been read from the test run's cache) by :func:`_fill_runtime`."""
    from docutils import nodes

    node = nodes.inline(text="not measured in this build", classes=["page-runtime"])
    node["page_runtime"] = True
    return [node], []


def _fill_runtime(app, doctree, docname) -> None:
    from docutils import nodes
    from myst_nb.sphinx_ import NbMetadataCollector

    data = NbMetadataCollector.get_exec_data(app.env, docname) or {}
    seconds = data.get("runtime")
    for node in list(doctree.findall(nodes.inline)):
        if node.get("page_runtime") and seconds:
            text = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"
            node.children = [nodes.Text(f"{text} (its cells, as last executed for this build)")]


def setup(app) -> None:
    app.add_role("page-runtime", _runtime_role)
    app.connect("doctree-resolved", _fill_runtime)
    app.connect("html-page-context", _notebook_download, priority=400)
    app.connect("missing-reference", _resolve_public_name)
    app.connect("doctree-read", _real_name_targets)
    app.connect("env-updated", _viewcode_real_names)
    app.connect("autodoc-process-docstring", _no_type_docstring)
    app.connect("build-finished", _trim_icon_classes)
    app.connect("builder-inited", _fresh_source_pages)
    app.add_directive("test-files", _test_files_directive())
