"""xp.pipeline_step on torch.distributed (c10d, gloo, CPU tensors): the script that
tests/test_pipeline_dist.py launches with ``torchrun``, one process per rank.

``pipeline_dist.py OUT_DIR`` runs, on this rank, the bad calls, every case and every training
run of tests/test_pipeline_step.py (the same code the CPU mesh runs,
tests/ranks_pipeline.py::step_cases) and saves ``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch


def main(out_dir: str) -> None:
    import ranks_pipeline
    import test_pipeline_step as cases
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.set_num_threads(1)
    out = ranks_pipeline.step_cases(
        list(cases.CASES.values()), list(cases.TRAININGS.values()), list(cases.LLAMAS.values())
    )
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
