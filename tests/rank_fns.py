"""Rank functions for the tests (importable by the device process through PYTHONPATH)."""

from __future__ import annotations

import torch


def rank_times(k: int) -> int:
    import torch_xla.runtime as xr

    return k * xr.global_ordinal()


def xla_tensor_of_rank() -> dict[str, object]:
    import torch_xla
    import torch_xla.runtime as xr

    r = xr.global_ordinal()
    return {"t": torch.full((2,), float(r), device=torch_xla.device()) * 2, "r": [r, (r,)]}


def rank_two_raises() -> int:
    import torch_xla.runtime as xr

    if xr.global_ordinal() == 2:
        raise ValueError("bad value on rank two")
    return 0


def rank_zero_skips_collective() -> torch.Tensor | None:
    """Ranks 1..N-1 all-gather (and wait for the result); rank 0 never joins."""
    import torch_xla.runtime as xr

    from xla_permute.examples import all_gather_ranks

    return all_gather_ranks() if xr.global_ordinal() != 0 else None


def sleep_forever() -> None:
    import time

    time.sleep(3600)
