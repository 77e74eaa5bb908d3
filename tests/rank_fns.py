"""Rank functions for the tests (importable by the device process through PYTHONPATH)."""

from __future__ import annotations

import torch


def rank_times(k: int) -> int:
    import torch_xla.runtime as xr

    return k * xr.global_ordinal()


def rank_two_raises() -> int:
    import torch_xla.runtime as xr

    if xr.global_ordinal() == 2:
        raise ValueError("bad value on rank two")
    return 0


def rank_zero_skips_collective() -> torch.Tensor | None:
    """Ranks 1..N-1 all-gather (and wait for the result); rank 0 never joins."""
    import torch_xla.runtime as xr

    import xla_permute as xp

    if xr.global_ordinal() == 0:
        return None
    import torch_xla

    x = torch.ones(2, device=torch_xla.device())
    y = xp.all_gather(x, dim=0)
    return y.cpu()


def sleep_forever() -> None:
    import time

    time.sleep(3600)
