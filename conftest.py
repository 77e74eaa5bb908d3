"""Collect every code cell of every tutorial as one pytest item, run in one kernel per tutorial.

Item names give the file and the line of the cell:
``tutorials/01_getting_started.md::cell 3 [L42]``.
Cells run in order in one fresh kernel; after a failing cell, the remaining cells of that
tutorial are reported as not run (skipped with that reason), never as passed. A tutorial whose
every cell passed is saved with its outputs for the docs build (tests/notebook_cells.py), which
then shows these outputs instead of executing the tutorial a second time.
"""

from __future__ import annotations

import importlib.util
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

#: What needs torch_xla (the ``xla`` extra) gets the marker ``xla``; ``make test-live`` (torch
#: without torch_xla) deselects it. The test modules under "*" need it whole; of the others, the
#: tests whose names (after ``test_``) start as listed. Why: they run on the CPU mesh
#: (``run_on_mesh``: XLA:CPU devices), read XLA tensors' HLO, or read torch_xla's own
#: configuration (test_hardware, test_pipeline's send/recv path, the workshop's environment
#: doctests); test_docs's builds execute the pages, which run the mesh.
NEEDS_TORCH_XLA = {
    "*": "bench_attention collectives debug_mesh matmul matmul_fused matmul_groups reliability "
    "tracing training training_probes warm compile_barrier bench_barrier",
    "attention": "bad_inputs_raise_before empty_inputs_issue forward_and_backward "
    "groups_are_rings native_hlo",
    "bench": "all_gather_matmul_sends emulated_results matmul_reduce_scatter_sends memory_comes "
    "memory_does memory_is memory_rank partial_sum_bytes report_labels rings_at_their smoke "
    "the_token trace_and_compile",
    "debug_default": "disagreement_raises local_mistakes ranks_that_agree the_mesh_turns",
    "docs": "api_pages docs_build_without search_index",
    "hardware": "collective_permute_consults collective_signatures detect_ the_xla_backends_refuse",
    "launch": "closure_lambda every_op_reports hang_is_killed mesh_error_names "
    "mismatched_collective rank_error_names rank_traceback result_that_cannot results_come_back "
    "script_whose single_device_mesh the_launcher_var xla_tensor",
    "layers": "layers_run_every_collective training_step_matches",
    "mesh2d": "all_reduce mesh2d_coords_on_the_mesh ranks_that_disagree",
    "mesh_programs": "130_good a_loop_that_drops a_sync_with_nothing a_tensor_parallel_hugging "
    "each_rank_gets the_default_check_catches_bfloat16 torch_compile_is_refused",
    "notebook": "a_kernel_started_ahead",  # its warm-up starts the mesh's warm process
    "pairs": "x_not_on_an_xla_device",
    "permute": "all_self bad_input_raises bad_inputs_issue bad_pairs_error classic_case "
    "empty_pairs emulated_lowering generated_case_matches native_lowering swap_with three_self "
    "torch_xla_ring",
    "pipeline": "bad_inputs_raise_in_rank forward_and_backward send_recv_step "
    "sendrecv_code_path stage_shift_step",
    "pipeline_split": "split_by_names probe_advice",
    "pipeline_step": "1f1b_holds bad_calls gradients_bit ran_the llama_shaped step_equals "
    "training_steps",
    "plan": "eight_ranks every_matmul_of_a_block the_plan_equals the_sharded_loss "
    "tp_sp_and_ring_attention",
    "hf_plans": "mesh_",
    "selftest": "demo_runs_every_check",
    "shift": "bad_inputs_raise_in_rank shift_and_its_backward",
    "strategy": "xla_strategy_on_the_cpu_mesh",
}
#: Doctests that run the mesh or read torch_xla.
XLA_DOCTESTS = {
    "xla_permute.cpu_mesh.launch",
    "xla_permute_tools.environment.collective_signatures",
    "xla_permute_tools.environment.detect",
}
HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None
# Modules that import torch_xla at their top are not collected without it (no doctest to run).
collect_ignore = (
    []
    if HAS_TORCH_XLA
    else [
        "src/xla_permute/cpu_mesh/device.py",
        "src/xla_permute/cpu_mesh/barrier.py",
        "tutorials/scripts/train_block.py",
    ]
)


def needs_torch_xla(item: pytest.Item) -> bool:
    """Whether ``item`` needs torch_xla: :data:`NEEDS_TORCH_XLA`, a doctest of
    :data:`XLA_DOCTESTS`, or a cell of a page whose code imports torch_xla or runs the mesh."""
    if isinstance(item, TutorialCell):
        return item.parent.needs_torch_xla
    if isinstance(item, pytest.DoctestItem):
        return item.name in XLA_DOCTESTS
    module = item.path.stem.removeprefix("test_")
    if item.path.parent.name != "tests":
        return False
    if module in NEEDS_TORCH_XLA["*"].split():
        return True
    names = tuple(NEEDS_TORCH_XLA.get(module, "").split())
    return bool(names) and item.originalname.removeprefix("test_").startswith(names)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if needs_torch_xla(item):
            item.add_marker(pytest.mark.xla)


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
        code = "\n".join(cell.source for cell in self.cells)
        uses = ("import torch_xla", "run_on_mesh", "run_bench(")  # run_bench: on the mesh
        self.needs_torch_xla = any(use in code for use in uses)
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
