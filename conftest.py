"""Collect every code cell of every tutorial as one pytest item, run in one kernel per tutorial.

Item names give the file and the line of the cell:
``tutorials/01_getting_started.md::cell 3 [L42]``.
Cells run in order in one fresh kernel; after a failing cell, the remaining cells of that
tutorial are reported as not run (skipped with that reason), never as passed. A tutorial whose
every cell passed is saved with its outputs for the docs build (tests/notebook_cells.py), which
then shows these outputs instead of executing the tutorial a second time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The notebook reader lives beside the tests (tests/notebook_cells.py); the test modules import
# their helpers from tests/ as top-level modules too.
sys.path.insert(0, str(Path(__file__).parent / "tests"))

from notebook_cells import CellRunner, cache_executed, code_cells  # noqa: E402

# Settings for the test modules only. The tutorials' kernels do not get them: the test run's
# outputs are what the docs show (docs/conf.py reads them from the cache), so a tutorial runs
# as `make docs` would run it, with the caller's own environment.
TEST_ONLY_ENV = {
    # The CPU-mesh tests run in the debug mode (xla_permute.debug): every collective of the
    # package first checks that all ranks pass the same arguments. The mesh inherits it.
    "XLA_PERMUTE_DEBUG": "1",
    # pytest changes PYTEST_CURRENT_TEST for every test: not a reason for a new warm process of
    # the mesh (xla_permute_tools.warm).
    "XLA_PERMUTE_LAUNCH_VARIABLES": "PYTEST_CURRENT_TEST",
}
TUTORIAL_ENV = dict(os.environ)
for _name, _value in TEST_ONLY_ENV.items():
    os.environ.setdefault(_name, _value)
# The tutorials' kernels import torch_xla on the host; as in docs/conf.py, name the platform.
os.environ.setdefault("PJRT_DEVICE", "CPU")
TUTORIAL_ENV.setdefault("PJRT_DEVICE", "CPU")
# Tests and tutorials launch meshes forked from a warm process that has imported torch (about
# 0.5 s a launch instead of 4 s): the workshop's starter (xla_permute.cpu_mesh.launch.LAUNCHER_ENV).
for _env in (os.environ, TUTORIAL_ENV):
    _env.setdefault("XLA_PERMUTE_LAUNCHER", "xla_permute_tools.warm:start_process")

TUTORIALS = Path(__file__).parent / "tutorials"
#: Executable pages outside tutorials/: the landing page's example runs as a test too.
PAGES = {Path(__file__).parent / "docs" / "index.md"}


def tutorial_after(item: pytest.Item) -> TutorialFile | None:
    """The tutorial whose cells come right after the items of ``item``'s parent, if any."""
    items = item.session.items
    mine = [i for i, other in enumerate(items) if other.parent is item.parent]
    following = items[mine[-1] + 1].parent if mine[-1] + 1 < len(items) else None
    return following if isinstance(following, TutorialFile) else None


def start_next_kernel(item: pytest.Item) -> None:
    following = tutorial_after(item)
    if following is not None:
        following.start_kernel()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At the first test of the module that the first tutorial follows, start its kernel."""
    if not isinstance(item, TutorialCell) and item is next(
        other for other in item.session.items if other.parent is item.parent
    ):
        start_next_kernel(item)


def pytest_collect_file(parent: pytest.Collector, file_path: Path) -> pytest.Collector | None:
    if file_path.suffix == ".md" and (file_path.parent == TUTORIALS or file_path in PAGES):
        return TutorialFile.from_parent(parent, path=file_path)
    return None


class TutorialFile(pytest.File):
    def collect(self):
        self.runner: CellRunner | None = None
        self.failed_cell: str | None = None
        self.cells = code_cells(self.path)
        for number, cell in enumerate(self.cells, start=1):
            yield TutorialCell.from_parent(
                self,
                name=f"cell {number} [L{cell.line}]",
                cell=cell,
                last=number == len(self.cells),
            )

    def _runner(self) -> CellRunner:
        if self.runner is None:
            self.runner = CellRunner(self.path, env=TUTORIAL_ENV)
            self.session.config.add_cleanup(self.runner.close)
        return self.runner

    def start_kernel(self) -> None:
        """Start this tutorial's kernel (it boots and warms up while other items run)."""
        self._runner().start()

    def run_cell(self, item: TutorialCell) -> None:
        if self.failed_cell is not None:
            pytest.skip(f"not run: an earlier cell ({self.failed_cell}) failed")
        runner = self._runner()
        try:
            runner.run(item.cell.index)
            if item.cell is self.cells[0]:
                # The next tutorial's kernel boots beside this one's remaining cells (after
                # the first, so that it does not share the machine with a page's opening
                # measurement): about 8 s of imports that its first cells would wait for.
                start_next_kernel(item)
            if item.last and runner.complete:  # every cell ran and passed: docs reuse it
                cache_executed(runner)
        except BaseException:
            self.failed_cell = item.name
            raise
        finally:
            if item.last:
                runner.close()


class TutorialCell(pytest.Item):
    def __init__(self, *, cell, last: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.last = last

    def runtest(self) -> None:
        self.parent.run_cell(self)

    def repr_failure(self, excinfo, style=None):
        from nbclient.exceptions import CellExecutionError

        if isinstance(excinfo.value, CellExecutionError):
            return f"{self.name} of {self.path.name} failed:\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, self.cell.line - 1, self.name
