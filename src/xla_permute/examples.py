"""Rank functions used by the tutorials, doctests and the demo.

They live in the package because the device process must import them: a function defined in
a notebook cell cannot be sent to it.
"""

from __future__ import annotations

import torch

__all__ = [
    "all_gather_ranks",
    "all_reduce_without_channel_id",
    "collective_hlo",
    "describe_device",
    "world_and_rank",
]


def world_and_rank() -> tuple[int, int]:
    """Return ``(world_size, rank)`` as seen by this rank."""
    import torch_xla.runtime as xr

    return xr.world_size(), xr.global_ordinal()


def describe_device() -> dict[str, object]:
    """This rank's view of the mesh: its rank, device, device kind and the world size."""
    import torch_xla
    import torch_xla.runtime as xr

    return {
        "rank": xr.global_ordinal(),
        "device": str(torch_xla.device()),
        "device_type": xr.device_type(),
        "world_size": xr.world_size(),
        "addressable_devices": xr.addressable_device_count(),
    }


def _rank_block(rows: int = 2, cols: int = 3) -> torch.Tensor:
    """A block whose every entry is this rank's id, on this rank's device."""
    import torch_xla
    import torch_xla.runtime as xr

    return torch.full((rows, cols), float(xr.global_ordinal()), device=torch_xla.device())


def all_gather_ranks(rows: int = 2, cols: int = 3) -> torch.Tensor:
    """All-gather each rank's block along dim 0 with a channel id (runs on the CPU mesh)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute.channels import next_channel_id

    out = xm.all_gather(
        _rank_block(rows, cols),
        dim=0,
        groups=[list(range(xr.world_size()))],
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )
    xm.mark_step()
    return out


def all_reduce_without_channel_id() -> torch.Tensor:
    """An upstream all-reduce, which carries no channel id (aborts on the CPU mesh)."""
    import torch_xla.core.xla_model as xm

    out = xm.all_reduce(xm.REDUCE_SUM, _rank_block())
    xm.mark_step()
    return out


def collective_hlo() -> dict[str, str]:
    """HLO text of the two programs above, traced on this rank but not executed."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    x = _rank_block()
    with_channel = xm.all_gather(
        x,
        dim=0,
        groups=[list(range(xr.world_size()))],
        pin_layout=False,
        channel_id=1,
        use_global_device_ids=True,
    )
    without_channel = xm.all_reduce(xm.REDUCE_SUM, x)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo
    return {"all_gather": hlo([with_channel]), "all_reduce": hlo([without_channel])}
