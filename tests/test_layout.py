"""The package's shape: one public namespace, no import cycles, small modules, short lines, and
the workshop (``xla_permute_tools``: tools, figures, tables, published-number checks) outside
the library's import graph."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "xla_permute"
WORKSHOP = ROOT / "src" / "xla_permute_tools"
#: Modules that are data tables more than code, allowed past the size limit.
DATA_TABLES = {"cost/chips.py"}
#: The cap, in code lines (docstrings, comments and blank lines not counted).
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every xla_permute module ``path`` imports, at module level or inside functions."""
    tree = ast.parse(path.read_text())
    package = (
        _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    )
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("xla_permute")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], base]
                ).rstrip(".")
            if base.startswith("xla_permute"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def test_no_import_cycles():
    graph = _graph()
    # A package importing its own submodules (re-exports) is not a cycle through it.
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in graph.items()}
    edges = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in edges.items()}
    edges.pop("xla_permute", None)
    for deps in edges.values():
        deps.discard("xla_permute")
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def _workshop_imports(path: Path) -> list[str]:
    """The ``xla_permute_tools`` modules ``path`` imports (anywhere in it)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("xla_permute_tools")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "xla_permute_tools"
        ):
            found.append(node.module or "")
    return found


def test_nothing_in_the_library_imports_the_workshop():
    """Only ``__main__`` (the command line's dispatcher) imports xla_permute_tools; ``xp.figures``
    names the workshop's module by string, on first use, and nothing else mentions it."""
    assert WORKSHOP.is_dir()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        if rel == "__main__.py":
            assert _workshop_imports(path), "the dispatcher imports the tools"
            continue
        assert _workshop_imports(path) == [], rel
        mentions = path.read_text().count('"xla_permute_tools.')
        assert mentions == (1 if rel == "__init__.py" else 0), rel


def test_the_workshop_is_not_in_the_library():
    names = {p.name for p in PACKAGE.iterdir()}
    assert not names & {"tools", "figures.py", "tables.py"}, names
    assert not (PACKAGE / "cost" / "validation.py").exists()
    assert {"figures.py", "tables.py", "validation.py", "bench"} <= {
        p.name for p in WORKSHOP.iterdir()
    }


def _code_lines(path: Path) -> int:
    """Lines of code: the file's lines minus its docstrings, comments and blank lines."""
    text = path.read_text()
    lines = text.splitlines()
    doc = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                doc |= set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(
        1
        for i, line in enumerate(lines, start=1)
        if i not in doc and line.strip() and not line.strip().startswith("#")
    )


def test_code_lines_count_code_only():
    sample = PACKAGE / "pairs.py"
    total = len(sample.read_text().splitlines())
    assert 0 < _code_lines(sample) < total - 50  # pairs.py's docstrings are long


@pytest.mark.parametrize(
    "path",
    sorted([*PACKAGE.rglob("*.py"), *WORKSHOP.rglob("*.py")]),
    ids=lambda p: str(p.relative_to(ROOT / "src")),
)
def test_modules_are_small(path):
    if str(path.relative_to(PACKAGE if PACKAGE in path.parents else WORKSHOP)) in DATA_TABLES:
        return
    lines = _code_lines(path)
    assert lines <= MAX_LINES, f"{path.name} has {lines} lines of code; split it by concept"


def _code_cell_lines(path: Path) -> list[tuple[int, str]]:
    out, inside = [], False
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if line.startswith("```{code-cell}"):
            inside = True
        elif inside and line.startswith("```"):
            inside = False
        elif inside and not line.startswith(":"):
            out.append((i, line))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "tutorials").glob("*.md")), ids=lambda p: p.name)
def test_tutorial_code_fits_the_page(path):
    long = [f"L{i}: {len(line)} chars" for i, line in _code_cell_lines(path) if len(line) > 90]
    assert not long, f"{path.name}: code lines over 90 characters: {long}"


def test_one_import_reaches_the_library_without_starting_torch_xla():
    code = (
        "import sys, xla_permute as xp\n"
        "assert 'torch_xla' not in sys.modules, 'importing xla_permute imported torch_xla'\n"
        "names = [n for n in xp.__all__ if getattr(xp, n, None) is None]\n"
        "assert not names, names\n"
        "for sub in ('reference', 'hardware', 'hlo', 'cost'):\n"
        "    assert getattr(xp, sub).__name__ == 'xla_permute.' + sub\n"
        "assert xp.figures.__name__ == 'xla_permute_tools.figures'\n"
        "xp.all_gather_matmul, xp.ColumnParallelLinear, xp.collective_permute, xp.stage_shift\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_missing_optional_dependency_names_the_extra():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import xla_permute as xp\n"
        "try:\n    xp.figures\nexcept ModuleNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'xla-permute[figures]'" in out.stdout, out.stdout + out.stderr
