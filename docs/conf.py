"""Sphinx configuration: myst-nb executes every tutorial on every build; any error fails it."""

project = "xla-permute"
author = "xla-permute developers"
copyright = "2026, xla-permute developers"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
]

source_suffix = {".md": "myst-nb", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "jupyter_execute", "**/.ipynb_checkpoints"]
root_doc = "index"

# Execution: forced, every cell, any error fails the build (see docs/NOTES in DOCS_NOTES).
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_allow_errors = False
nb_execution_excludepatterns: list[str] = []
nb_execution_timeout = 900
nb_execution_show_tb = True
nb_kernel_rgx_aliases = {".*": "python3"}
nb_merge_streams = True

myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
nitpicky = False

html_theme = "alabaster"
html_title = "xla-permute"

autodoc_default_options = {"members": True}
autodoc_inherit_docstrings = False  # torch/matplotlib docstrings use roles we do not load
# No intersphinx (CI has no network): references to other projects' types stay plain text.
nitpick_ignore_regex = [
    ("py:.*", r"(torch|torch_xla|pathlib|collections|typing|argparse)\b.*"),
    ("py:.*", r"(nbclient|numpy|matplotlib)\b.*"),
    ("py:.*", r"(Path|Tensor|Callable|Sequence|Any|NotebookNode|Module|Figure)"),
]
