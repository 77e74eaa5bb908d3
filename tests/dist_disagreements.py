"""Ranks that pass different arguments, on real processes (gloo), with the default checks.

Run under torchrun by tests/test_mesh_programs.py with ``XLA_PERMUTE_DEBUG`` unset: the sampled
agreement check (each op's 1st, 2nd, 4th, ... call) must make every rank raise the same
``DisagreementError`` instead of zeros, a wrong result or a dead connection. The cases are the
1st and 2nd calls of ``collective_permute`` and the 1st of ``all_gather_matmul``. Writes
``{case: message or None}`` per rank to ``OUT/rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import xla_permute as xp


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    ring = xp.ring_pairs(n)
    cases = {
        # A rank passing float64 got zeros while the others got ones.
        "dtype": lambda: xp.collective_permute(
            torch.ones(2, dtype=torch.float64 if r == 1 else torch.float32), ring
        ),
        # A rank passing 3 elements instead of 2 got a wrong result.
        "shape": lambda: xp.collective_permute(torch.ones(3 if r == 2 else 2), ring),
        # 3 rows on one rank ended in "Connection reset by peer", then a crash.
        "rows": lambda: xp.all_gather_matmul(
            torch.ones(3 if r == 0 else 2, 4), torch.ones(4, 5), dim=0
        ),
    }
    results = {}
    for name, call in cases.items():
        try:
            call()
            results[name] = None
        except xp.DisagreementError as e:
            results[name] = str(e)
    (out / f"rank{r}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
