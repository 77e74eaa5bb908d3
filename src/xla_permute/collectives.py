"""Differentiable all-gather and reduce-scatter over all ranks, with channel ids.

These are the upstream collectives (``xm.all_gather``, ``xm.reduce_scatter``) called the way
that runs on every backend, the CPU mesh included (``pin_layout=False``, a channel id,
``use_global_device_ids=True``), with autograd: the backward of an all-gather is a
reduce-scatter of the gradient and vice versa. They build the baselines that collective matmul
is compared with.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_gather", "reduce_scatter", "sum_gradients"]


def _world() -> list[list[int]]:
    import torch_xla.runtime as xr

    return [list(range(xr.world_size()))]


def _all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    from xla_permute.channels import next_channel_id

    return xm.all_gather(
        x,
        dim=dim,
        groups=_world(),
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )


def _reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    from xla_permute.channels import next_channel_id

    groups = _world()
    return xm.reduce_scatter(
        xm.REDUCE_SUM,
        x,
        1.0,
        dim,
        len(groups[0]),
        groups=groups,
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _ReduceScatter.apply(grad.contiguous(), ctx.dim), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        return _reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllGather.apply(grad.contiguous(), ctx.dim), None


def all_gather(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward: reduce-scatter of the gradient.

    Per rank: ``[..., m, ...] -> [..., N*m, ...]`` (``m`` at ``dim``).
    """
    return _AllGather.apply(x, dim % x.dim())


def reduce_scatter(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's block along ``dim``; backward: all-gather.

    Per rank: ``[..., N*m, ...] -> [..., m, ...]``; ``x.shape[dim]`` must divide by N.
    """
    return _ReduceScatter.apply(x, dim % x.dim())


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _all_gather(grad.unsqueeze(0).contiguous(), 0).sum(0)


def sum_gradients(x: torch.Tensor) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ranks.

    For a parameter held whole on every rank but used on a shard of the data (the bias of a
    sequence-parallel row-parallel layer): each rank's gradient covers its own rows only, and
    the true gradient is their sum. (An all-reduce, built from a channel-id all-gather so that
    it runs on the CPU mesh too.)
    """
    return _SumGradients.apply(x)
