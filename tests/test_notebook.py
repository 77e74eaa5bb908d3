"""Guards on the executable docs: every tutorial is in the toctree, runs every cell, has cells."""

import re
from pathlib import Path

import pytest
from notebook_cells import CellRunner, code_cells, excluded_cells, shown_problems

ROOT = Path(__file__).resolve().parents[1]
TUTORIALS = sorted((ROOT / "tutorials").glob("*.md"))
#: Every executable page: the tutorials and the landing page, whose example runs too.
PAGES = [ROOT / "docs" / "index.md", *TUTORIALS]


def toctree_entries() -> list[str]:
    """The landing page's toctree entries, in the order the reader meets them."""
    text = (ROOT / "docs" / "index.md").read_text()
    entries = []
    for block in re.findall(r"```\{toctree\}(.*?)```", text, flags=re.S):
        entries += [ln.strip() for ln in block.splitlines() if ln.strip() and ":" not in ln]
    return entries


def test_there_are_tutorials():
    assert TUTORIALS


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_tutorial_is_in_toctree(path):
    assert f"tutorials/{path.stem}" in toctree_entries(), f"add {path.stem} to docs/index.md"


def test_file_numbers_follow_the_tour():
    # a reader who downloads the notebooks gets them in the order the site presents them
    tour = [e.removeprefix("tutorials/") for e in toctree_entries() if e.startswith("tutorials/")]
    assert tour == [p.stem for p in TUTORIALS]
    assert [int(stem[:2]) for stem in tour] == list(range(1, len(tour) + 1))


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_tutorial_has_cells_and_none_excluded(path):
    assert code_cells(path), f"{path.name}: no code cell collected"
    assert excluded_cells(path) == [], f"{path.name}: cells excluded from execution"


def test_docs_execute_everything():
    conf = (ROOT / "docs" / "conf.py").read_text()
    # "cache": a page runs once, as pytest items whose outputs the build reuses
    # (conftest.py, tests/notebook_cells.py), or in the build when the cache lacks it
    for setting in [
        'nb_execution_mode = "cache"',
        "nb_execution_raise_on_error = True",
        "nb_execution_allow_errors = False",
        "nb_execution_excludepatterns: list[str] = []",
    ]:
        assert setting in conf
    assert "-W" in (ROOT / "Makefile").read_text()


def test_collector_names_cells_by_line(pytestconfig):
    cells = code_cells(TUTORIALS[0])
    lines = TUTORIALS[0].read_text().splitlines()
    for cell in cells:
        # the named line is the cell's first: its code, or its options (``:tags: [...]``)
        first = cell.source.splitlines()[0].strip()
        named = [line.strip() for line in lines[cell.line - 1 : cell.line + 2]]
        assert named[0] == first or (named[0].startswith(":") and first in named), cell.line


def test_failing_cell_raises_and_names_itself(tmp_path):
    nb = tmp_path / "broken.md"
    nb.write_text(
        "---\nkernelspec:\n  name: python3\n  display_name: Python 3\n---\n# t\n\n"
        "```{code-cell} ipython3\nx = 1\n```\n\n"
        "```{code-cell} ipython3\nraise RuntimeError('cell two broke')\n```\n"
    )
    from nbclient.exceptions import CellExecutionError

    runner = CellRunner(nb)
    try:
        cells = code_cells(nb)
        assert [c.line for c in cells] == [9, 13]
        runner.run(cells[0].index)
        with pytest.raises(CellExecutionError, match="cell two broke"):
            runner.run(cells[1].index)
    finally:
        runner.close()


def test_a_cell_that_would_show_badly_fails_as_a_test(tmp_path):
    """Stderr on the page and a failure demonstration that did not fail fail in `make test`,
    not only later in the site check; a tag that hides stderr and a shown error pass."""
    nb = tmp_path / "shown.md"
    fence = "```{code-cell} ipython3\n"
    nb.write_text(
        "---\nkernelspec:\n  name: python3\n  display_name: Python 3\n---\n# t\n\n"
        + fence
        + "import sys; print('a warning', file=sys.stderr)\n```\n\n"
        + fence
        + ":tags: [remove-stderr]\n\nimport sys; print('hidden', file=sys.stderr)\n```\n\n"
        + fence
        + ":tags: [demonstrates-failure]\n\nprint('all went well')\n```\n\n"
        + fence
        + ":tags: [demonstrates-failure]\n\nprint(repr(ValueError('bad n')))\n```\n"
    )
    runner = CellRunner(nb)
    try:
        cells = code_cells(nb)
        with pytest.raises(AssertionError, match="stderr output on the page: a warning"):
            runner.run(cells[0].index)
        runner.run(cells[1].index)
        with pytest.raises(AssertionError, match="shows no error"):
            runner.run(cells[2].index)
        runner.run(cells[3].index)
    finally:
        runner.close()
    assert shown_problems(runner.nb.cells[cells[3].index]) == []


def test_a_kernel_started_ahead_is_warm_and_its_namespace_clean(tmp_path):
    """A kernel started ahead of its notebook (the collector starts the next tutorial's) has
    imported the launcher and started the mesh's warm process, and shows the first cell the
    same names, execution count and output as a kernel started by that cell."""
    nb = tmp_path / "page.md"
    nb.write_text(
        "---\nkernelspec:\n  name: python3\n  display_name: Python 3\n---\n# t\n\n"
        "```{code-cell} ipython3\nimport sys\n"
        "print(sorted(n for n in dir() if not n.startswith('__')))\n"
        "preload = sys.modules.get('xla_permute_tools.warm')\n"
        "warm = preload is not None and preload._zygote is not None\n```\n\n"
        "```{code-cell} ipython3\nwarm\n```\n"
    )
    seen = []
    for ahead in (True, False):
        runner = CellRunner(nb)
        try:
            if ahead:
                runner.start()
            for cell in code_cells(nb):
                runner.run(cell.index)
            cells = [c for c in runner.nb.cells if c.cell_type == "code"]
            seen.append([(c.execution_count, c.outputs) for c in cells])
        finally:
            runner.close()
    (names_ahead, warm_ahead), (names_cold, warm_cold) = seen
    assert names_ahead == names_cold and "_warm" not in names_ahead[1][0]["text"]
    assert warm_ahead[1][0]["data"]["text/plain"] == "True"
    assert warm_cold[1][0]["data"]["text/plain"] == "False"


def _undefined_mesh_functions(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``run_on_mesh(name, ...)`` whose ``def name`` is not in that
    cell or an earlier one of the page."""
    import ast

    calls, defined = [], []
    for cell in code_cells(path):
        source, offset = cell.source, 0
        if source.startswith("%%"):  # a cell magic: %%writefile's body is the script's Python
            if not source.startswith("%%writefile"):
                defined.append(set())
                continue
            source, offset = source.split("\n", 1)[1], 1
        tree = ast.parse(source)
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name == "run_on_mesh" and node.args:
                    arg = node.args[0]
                    shown = arg.id if isinstance(arg, ast.Name) else ast.unparse(arg)
                    if not isinstance(arg, ast.Lambda):
                        calls.append((cell.line + offset + node.lineno - 1, shown, len(defined)))
        defined.append(names)
    return [(line, name) for line, name, i in calls if name not in set().union(*defined[: i + 1])]


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_tutorial_defines_every_function_it_runs_on_the_mesh(path):
    """The reader sees the code each device runs: ``run_on_mesh(f, ...)`` needs ``def f`` on the
    page, in that cell or an earlier one (a lambda is on the page too)."""
    missing = _undefined_mesh_functions(path)
    assert not missing, f"{path.name}: run_on_mesh of functions the page does not define: {missing}"
