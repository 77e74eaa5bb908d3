"""Sphinx configuration: myst-nb executes every tutorial on every build; any error fails it."""

from __future__ import annotations

import shutil
from pathlib import Path

project = "xla-permute"
author = "xla-permute developers"
copyright = "2026, xla-permute developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "sphinx_design",
]

source_suffix = {".md": "myst-nb", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "jupyter_execute", "**/.ipynb_checkpoints", "*.py"]
root_doc = "index"

# Execution: forced, every cell, any error fails the build.
nb_execution_mode = "force"
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
html_css_files = ["wrap.css"]
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True

autodoc_default_options = {"members": True}
autodoc_inherit_docstrings = False  # torch/matplotlib docstrings use roles we do not load
# No intersphinx (CI has no network): references to other projects' types stay plain text.
nitpick_ignore_regex = [
    ("py:.*", r"(torch|torch_xla|pathlib|collections|typing|argparse)\b.*"),
    ("py:.*", r"(nbclient|numpy|matplotlib|cloudpickle)\b.*"),
    ("py:.*", r"(Path|Tensor|Callable|Sequence|Any|NotebookNode|Module|Figure|Self)"),
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


def setup(app) -> None:
    app.connect("html-page-context", _notebook_download, priority=400)
