"""The package's shape: one public namespace, no import cycles, small modules, short lines, and
the workshop (``xla_permute_tools``: tools, figures, tables, published-number checks) outside
the library's import graph."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "xla_permute"
WORKSHOP = ROOT / "src" / "xla_permute_tools"
#: Modules that are data tables more than code, allowed past the size limit.
DATA_TABLES = {"cost/chips.py", "known_caveats.py"}  # the chip table, the caveats
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


#: The library's layers, lowest first: a module imports only from its own top-level entry or
#: from a lower layer. The CPU mesh runner and the package's namespace are on top: nothing in
#: the library below them imports them.
LAYERS = (
    ("pairs",),
    ("hardware", "reference"),
    ("backends",),
    ("debug",),
    ("permute", "collectives", "sequence"),
    ("matmul_ring", "matmul", "attention", "mesh2d", "pipeline"),
    ("tensor_parallel", "hlo"),
    ("cpu_mesh",),
    ("__init__", "__main__"),
)
#: The library's top level: the ops, their backends, the schedules and the modules.
MAX_TOP_LEVEL = 18
#: ``wc -l`` of every ``.py`` of the library: small enough to read in a day.
MAX_LIBRARY_LINES = 7500


def _entry(module: str) -> str:
    """The top-level entry of a library module (``xla_permute.backends.xla`` -> ``backends``)."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _layer(module: str) -> int:
    entry = _entry(module)
    found = [i for i, layer in enumerate(LAYERS) if entry in layer]
    assert found, f"{module}: its top-level entry {entry!r} is in no layer of LAYERS"
    return found[0]


def test_no_upward_import():
    upward = [
        f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
        for m, deps in _graph().items()
        for d in deps
        if _entry(d) != _entry(m) and _layer(d) > _layer(m)
    ]
    assert not upward, upward


def _nested_library_imports(path: Path) -> list[str]:
    """The library imports of ``path`` made inside a function or class, not at module level."""
    tree = ast.parse(path.read_text())
    top = {id(node) for node in tree.body}
    top |= {  # module level, under an ``if TYPE_CHECKING:`` or a ``try:``
        id(n) for node in tree.body if isinstance(node, ast.If | ast.Try) for n in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in top:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("xla_permute")]
        elif isinstance(node, ast.ImportFrom) and (
            node.level or (node.module or "").startswith("xla_permute")
        ):
            found.append(f"line {node.lineno}: {node.module}")
    return found


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.name))
def test_no_import_hides_in_a_function(path):
    """An import of the library inside a function is how a cycle hides; only third-party
    imports (torch_xla, torch.distributed, transformers) may wait for first use."""
    assert _nested_library_imports(path) == [], path.relative_to(ROOT)


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
    """No library module imports ``xla_permute_tools``; only ``__main__`` names it, as the
    program ``python -m xla_permute`` hands over to."""
    assert WORKSHOP.is_dir()
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        assert _workshop_imports(path) == [], rel
        mentions = path.read_text().count("xla_permute_tools")
        assert mentions == (1 if rel == "__main__.py" else 0), rel


def test_nothing_below_the_top_imports_the_mesh_runner():
    for m, deps in _graph().items():
        if _entry(m) not in ("cpu_mesh", "__init__"):
            assert not [d for d in deps if _entry(d) == "cpu_mesh"], m


def test_the_workshop_is_not_in_the_library():
    names = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    assert not names & {"tools", "figures.py", "tables.py", "cost", "mesh"}, names
    text = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    for workshop_name in ("CHIPS", "known_caveats", "choose_strategy", "zygote"):
        assert workshop_name not in text, workshop_name
    assert {"figures.py", "tables.py", "validation.py", "bench", "cost", "warm.py"} <= {
        p.name for p in WORKSHOP.iterdir()
    }


def _public(module: str) -> set[str]:
    """The names a library module makes public: its ``__all__`` and its public submodules."""
    mod = importlib.import_module(module)
    subs = {p.stem for p in Path(mod.__file__).parent.glob("*.py")} if mod.__file__ else set()
    return set(getattr(mod, "__all__", ())) | (subs if module.count(".") == 0 else set())


def test_the_workshop_imports_only_public_names():
    private = []
    for path in sorted(WORKSHOP.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] == (
                "xla_permute"
            ):
                names = {a.name for a in node.names}
                private += [f"{path.name}: {node.module}.{n}" for n in names - _public(node.module)]
            elif isinstance(node, ast.Import):
                private += [
                    f"{path.name}: {a.name}"
                    for a in node.names
                    if a.name.startswith("xla_permute.")
                    and a.name.rpartition(".")[2] not in _public(a.name.rpartition(".")[0])
                ]
    assert not private, private


def test_the_library_is_small():
    top = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__")
    assert len(top) <= MAX_TOP_LEVEL, top
    lines = sum(len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py"))
    assert lines <= MAX_LIBRARY_LINES, f"the library has {lines} lines"


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
        "for sub in ('reference', 'hardware', 'hlo'):\n"
        "    assert getattr(xp, sub).__name__ == 'xla_permute.' + sub\n"
        "assert not hasattr(xp, 'figures') and not hasattr(xp, 'cost')\n"
        "assert not [m for m in sys.modules if m.startswith('xla_permute_tools')]\n"
        "xp.all_gather_matmul, xp.ColumnParallelLinear, xp.collective_permute, xp.stage_shift\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_a_missing_optional_dependency_names_the_extra():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "import xla_permute as xp\n"
        "assert not hasattr(xp, 'figures')\n"
        "try:\n    from xla_permute_tools import figures\n"
        "except ModuleNotFoundError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "pip install 'xla-permute[figures]'" in out.stdout, out.stdout + out.stderr
