"""Differentiable all-gather and reduce-scatter over all ranks or within groups, with channel ids.

These are the upstream collectives (``xm.all_gather``, ``xm.reduce_scatter``) called the way
that runs on every backend, the CPU mesh included (``pin_layout=False``, a channel id,
``use_global_device_ids=True``), with autograd: the backward of an all-gather is a
reduce-scatter of the gradient and vice versa. They build the baselines that collective matmul
is compared with. ``groups``: replica groups of equal size
(:func:`~xla_permute.pairs.check_groups`); a group gathers (and scatters) in the order it lists
its ranks. ``None``: one group of all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xla_permute.permute import ring_of

__all__ = ["all_gather", "reduce_scatter", "sum_gradients"]

Groups = Sequence[Sequence[int]] | None


def _groups(groups: Groups) -> list[list[int]]:
    import torch_xla.runtime as xr

    from xla_permute.pairs import check_groups

    return [list(g) for g in check_groups(groups, xr.world_size())]


def _all_gather(x: torch.Tensor, dim: int, groups: list[list[int]]) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    from xla_permute.channels import next_channel_id

    return xm.all_gather(
        x,
        dim=dim,
        groups=groups,
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )


def _reduce_scatter(x: torch.Tensor, dim: int, groups: list[list[int]]) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    from xla_permute.channels import next_channel_id

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
    def forward(ctx: Any, x: torch.Tensor, dim: int, groups: list[list[int]]) -> torch.Tensor:
        ctx.dim, ctx.groups = dim, groups
        return _all_gather(x, dim, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _ReduceScatter.apply(grad.contiguous(), ctx.dim, ctx.groups), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, groups: list[list[int]]) -> torch.Tensor:
        ctx.dim, ctx.groups = dim, groups
        return _reduce_scatter(x, dim, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _AllGather.apply(grad.contiguous(), ctx.dim, ctx.groups), None, None


def _dim(x: object, dim: object, op: str) -> int:
    from xla_permute.permute import check_xla_tensor

    x = check_xla_tensor(x, "x")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim={dim!r} is not a dimension of x with shape {tuple(x.shape)}")
    return dim % x.dim()


def _agree(op: str, x: torch.Tensor, dim: int, groups: list[list[int]]) -> None:
    """Debug mode (:mod:`xla_permute.debug`): every rank passes the same shape, dtype, dim and
    groups, and its own device; else raise on every rank before the collective."""
    from xla_permute import debug
    from xla_permute.permute import device_error

    fields = {"x.shape": tuple(x.shape), "x.dtype": str(x.dtype), "dim": dim, "groups": groups}
    debug.check_agreement(op, fields, error=device_error(x))


def all_gather(x: torch.Tensor, dim: int, *, groups: Groups = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward: reduce-scatter of the gradient.

    Per rank: ``[..., m, ...] -> [..., N*m, ...]`` (``m`` at ``dim``, ``N`` the group size;
    block ``j`` is the ``j``-th rank of the group). An empty x gives the empty result without a
    collective. In debug mode the ranks first check that they agree (:mod:`xla_permute.debug`).
    """
    dim = _dim(x, dim, "all_gather")
    checked = _groups(groups)
    _agree("all_gather", x, dim, checked)
    if x.numel() == 0:
        return torch.cat([x] * len(checked[0]), dim)
    return _AllGather.apply(x, dim, checked)


def reduce_scatter(x: torch.Tensor, dim: int, *, groups: Groups = None) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's block along ``dim``; backward: all-gather.

    Per rank: ``[..., N*m, ...] -> [..., m, ...]``; ``x.shape[dim]`` must divide by the group
    size N; the ``j``-th rank of a group gets block ``j``. An empty x gives the empty result
    without a collective. In debug mode the ranks first check that they agree
    (:mod:`xla_permute.debug`).
    """
    dim = _dim(x, dim, "reduce_scatter")
    checked = _groups(groups)
    n = len(checked[0])
    if x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter: x.shape[{dim}] = {x.shape[dim]} is not divisible by the {n} ranks "
            f"of the group; pad it to a multiple of {n}"
        )
    _agree("reduce_scatter", x, dim, checked)
    if x.numel() == 0:
        _, position, _ = ring_of(checked)
        return x.narrow(dim, position * (x.shape[dim] // n), x.shape[dim] // n)
    return _ReduceScatter.apply(x, dim, checked)


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad.unsqueeze(0).contiguous(), 0, ctx.groups).sum(0), None


def sum_gradients(x: torch.Tensor, *, groups: Groups = None) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ranks.

    For a parameter held whole on every rank but used on a shard of the data (the bias of a
    sequence-parallel row-parallel layer): each rank's gradient covers its own rows only, and
    the true gradient is their sum over the group. (An all-reduce, built from a channel-id
    all-gather so that it runs on the CPU mesh too.)
    """
    return _SumGradients.apply(x, _groups(groups))
