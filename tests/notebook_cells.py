"""Read the tutorials the way the docs build reads them, and run them cell by cell.

The docs (Sphinx + myst-nb) and the test suite must execute the same cells, so both parse the
MyST-markdown notebooks with myst-nb's own reader. :class:`CellRunner` keeps one Jupyter kernel
per notebook and runs its code cells in order; the pytest collector in the repository's root
``conftest.py`` turns each code cell into one test item.

A notebook whose every cell ran and passed is saved with its outputs to :data:`EXECUTED_CACHE`,
a jupyter-cache that the docs build reads (``nb_execution_mode = "cache"`` in docs/conf.py): the
site shows what the test run executed, and each tutorial executes once per CI run. A notebook
not in the cache (a clean tree, a changed cell, outputs older than the library) is executed by
the docs build itself.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "EXECUTED_CACHE",
    "WARM_UP",
    "CodeCell",
    "CellRunner",
    "cache_executed",
    "FAILURE_WORDS",
    "code_cells",
    "excluded_cells",
    "read_notebook",
    "shown_problems",
]

#: The jupyter-cache shared by the test run (writes) and the docs build (reads).
EXECUTED_CACHE = Path(__file__).resolve().parents[1] / "docs" / "_build" / ".jupyter_cache"

#: Cell tags and metadata with which myst-nb or nbclient would not run a cell (or accept its error).
EXCLUDING_TAGS = frozenset({"skip-execution", "raises-exception", "remove-cell-execution"})

#: Words of which a cell tagged ``demonstrates-failure`` must show one: the failure happened.
#: The site check (tests/check_site.py) looks for the same words on the built page.
FAILURE_WORDS = r"(error|exception|abort|refuse|raise|fail|timed? ?out|SIGABRT)"


def shown_problems(cell: Any) -> list[str]:
    """What the built page would show wrongly of this executed cell (as tests/check_site.py).

    Stderr output that no ``remove-stderr``/``remove-output`` tag hides (a raw log or a warning
    on the page), and a ``demonstrates-failure`` cell whose output shows no error.
    """
    tags = set(cell.get("metadata", {}).get("tags", []))
    problems = []
    if not tags & {"remove-stderr", "remove-output"}:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                first = "".join(out.get("text", "")).strip().splitlines()[:1]
                problems.append(f"stderr output on the page: {first[0][:100] if first else ''}")
    if "demonstrates-failure" in tags:
        shown = []
        for out in cell.get("outputs", []):
            shown.append("".join(out.get("text", "")))
            shown.append("".join(out.get("data", {}).get("text/plain", "")))
            shown.extend([out.get("ename", ""), out.get("evalue", "")])
        if not re.search(FAILURE_WORDS, "\n".join(shown), re.IGNORECASE):
            problems.append("a demonstrates-failure cell shows no error in its output")
    return problems


@dataclass(frozen=True)
class CodeCell:
    """One code cell of a tutorial: its index among all cells and its first line in the file."""

    index: int
    line: int
    source: str


def read_notebook(path: str | Path) -> Any:
    """Parse a MyST-markdown notebook with myst-nb's reader (the one the docs build uses).

    The notebook's metadata gets ``source_map``: the first line (0-based) of every cell.
    """
    from myst_nb.core.read import read_myst_markdown_notebook

    text = Path(path).read_text(encoding="utf-8")
    return read_myst_markdown_notebook(text, add_source_map=True, path=path)


def code_cells(path: str | Path) -> list[CodeCell]:
    """The code cells of a tutorial in order, with the (1-based) line of each cell's fence."""
    nb = read_notebook(path)
    starts = nb.metadata["source_map"]
    return [
        CodeCell(index=i, line=starts[i] + 1, source=cell.source)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
    ]


def excluded_cells(path: str | Path) -> list[int]:
    """Indices of cells that a tag or metadata would keep from running as a test or in the docs."""
    nb = read_notebook(path)
    out = []
    for index, cell in enumerate(nb.cells):
        tags = set(cell.get("metadata", {}).get("tags", []))
        meta = cell.get("metadata", {})
        if tags & EXCLUDING_TAGS or meta.get("skip") or meta.get("execution", {}).get("skip"):
            out.append(index)
    return out


#: What a kernel started ahead of its notebook (:meth:`CellRunner.start`) runs before its first
#: cell: the imports and the warm process of the mesh (``XLA_PERMUTE_LAUNCHER``) that the
#: first cells would wait for otherwise. It leaves no name in the notebook's namespace. Without
#: torch_xla (``make test-live``) it imports the package only.
WARM_UP = (
    "import xla_permute.cpu_mesh as _warm; _warm.run_on_mesh(int, n=1); del _warm"
    if importlib.util.find_spec("torch_xla")
    else "import xla_permute as _warm; del _warm"
)


class CellRunner:
    """Run one notebook's code cells in a single fresh kernel, in order.

    The kernel starts at :meth:`start` (which returns at once: the kernel boots and runs
    :data:`WARM_UP` while the caller goes on) or at the first :meth:`run`, and stops at
    :meth:`close` (killed: nothing of the notebook runs after its last cell). A cell error
    raises ``nbclient.exceptions.CellExecutionError`` with the cell's source and traceback.
    """

    def __init__(
        self, path: str | Path, timeout: float = 900.0, env: dict[str, str] | None = None
    ) -> None:
        import nbclient

        self.path = Path(path)
        self.nb = read_notebook(self.path)
        self.env = dict(os.environ if env is None else env)
        self.env.setdefault("PYTHONWARNINGS", "default")
        self.client = nbclient.NotebookClient(
            self.nb,
            kernel_name="python3",
            timeout=timeout,
            allow_errors=False,
            record_timing=False,  # cell metadata stays as read: the cache's key hashes it
            resources={"metadata": {"path": str(self.path.parent)}},
            shutdown_kernel="immediate",
        )
        self._started = False
        self._connected = False
        self.ran: list[int] = []  # cells that ran and passed, in order
        self.seconds = 0.0  # their total wall time

    def start(self, warm_up: str = WARM_UP) -> None:
        """Start the kernel process now, running ``warm_up`` as it boots; return at once."""
        if not self._started:
            self.client.km = self.client.create_kernel_manager()
            if warm_up:  # run by the kernel as it boots, before it reports ready
                self.client.extra_arguments = [f"--IPKernelApp.exec_lines={warm_up}"]
            self.client.start_new_kernel(env=self.env)
            self._started = True

    def run(self, index: int) -> None:
        """Execute cell ``index`` (an index into all cells, as in :class:`CodeCell`)."""
        t0 = time.perf_counter()
        if not self._started:
            self.start(warm_up="")
        if not self._connected:  # waits until the kernel (and its warm-up) is ready
            self.client.start_new_kernel_client()
            self._connected = True
        self.client.execute_cell(self.nb.cells[index], index)
        problems = shown_problems(self.nb.cells[index])
        if problems:
            raise AssertionError(f"{self.path.name}, cell {index}: " + "; ".join(problems))
        self.seconds += time.perf_counter() - t0
        self.ran.append(index)

    @property
    def complete(self) -> bool:
        """Every code cell ran, in order, and passed."""
        return self.ran == [i for i, c in enumerate(self.nb.cells) if c.cell_type == "code"]

    def close(self) -> None:
        """Stop the kernel, at once (a no-op when it never started)."""
        if self._started:
            self.client._cleanup_kernel()
            self._started = self._connected = False


def cache_executed(runner: CellRunner, cache_path: str | Path = EXECUTED_CACHE) -> None:
    """Save a completely executed notebook, outputs included, for the docs build.

    The key is jupyter-cache's hash of the code cells' source and metadata and the kernelspec,
    computed by the docs build from the page as it reads it: a changed cell misses the cache.
    """
    if not runner.complete:
        raise ValueError(f"{runner.path}: not every cell ran; nothing to cache")
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn

    executed = copy.deepcopy(runner.nb)
    executed.metadata.pop("source_map", None)
    cache = get_cache(str(cache_path))
    cache.cache_notebook_bundle(
        CacheBundleIn(executed, str(runner.path), data={"execution_seconds": runner.seconds}),
        check_validity=False,
        overwrite=True,
    )
