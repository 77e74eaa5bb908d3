"""Differentiable all-gather and reduce-scatter over all ranks or within groups, on every backend.

On XLA these are the upstream collectives (``xm.all_gather``, ``xm.reduce_scatter``) called the
way that runs on every device, the CPU mesh included (``pin_layout=False``, a channel id,
``use_global_device_ids=True``); on ``c10d`` they are ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` on the process group of ``groups`` (:mod:`xla_permute.backends.select`).
Autograd: the backward of an all-gather is a reduce-scatter of the gradient and vice versa.
They build the baselines that collective matmul is compared with. ``groups``: replica groups
of equal size (:func:`~xla_permute.pairs.check_groups`); a group gathers (and scatters) in the
order it lists its ranks. ``None``: one group of all ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xla_permute.backends.select import CommBackend, check_tensor
from xla_permute.pairs import Groups as CheckedGroups
from xla_permute.pairs import check_groups

__all__ = ["all_gather", "reduce_scatter", "sum_gradients"]

Groups = Sequence[Sequence[int]] | None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, groups: CheckedGroups, backend: CommBackend
    ) -> torch.Tensor:
        ctx.dim, ctx.groups, ctx.backend = dim, groups, backend
        return backend.all_gather(x, dim, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _ReduceScatter.apply(grad.contiguous(), ctx.dim, ctx.groups, ctx.backend)
        return back, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, groups: CheckedGroups, backend: CommBackend
    ) -> torch.Tensor:
        ctx.dim, ctx.groups, ctx.backend = dim, groups, backend
        return backend.reduce_scatter(x, dim, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _AllGather.apply(grad.contiguous(), ctx.dim, ctx.groups, ctx.backend)
        return back, None, None, None


def _dim(x: torch.Tensor, dim: object, op: str) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim={dim!r} is not a dimension of x with shape {tuple(x.shape)}")
    return dim % x.dim()


def _agree(op: str, x: torch.Tensor, dim: int, groups: CheckedGroups, backend: CommBackend) -> None:
    """Debug mode (:mod:`xla_permute.debug`): every rank passes the same shape, dtype, dim and
    groups, and its own device; else raise on every rank before the collective."""
    from xla_permute import debug

    fields = {
        "x.shape": tuple(x.shape),
        "x.dtype": str(x.dtype),
        "dim": dim,
        "groups": [list(g) for g in groups],
    }
    debug.check_agreement(op, fields, error=backend.device_error(x), backend=backend)


def _begin(x: object, dim: object, groups: Groups, backend: str, op: str) -> tuple[Any, ...]:
    """The op's boundary: ``(x, dim, checked groups, backend)``."""
    chosen = check_tensor(x, "x", backend)
    assert isinstance(x, torch.Tensor)
    return x, _dim(x, dim, op), check_groups(groups, chosen.world_size()), chosen


def all_gather(
    x: torch.Tensor, dim: int, *, groups: Groups = None, backend: str = "auto"
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward: reduce-scatter of the gradient.

    Per rank: ``[..., m, ...] -> [..., N*m, ...]`` (``m`` at ``dim``, ``N`` the group size;
    block ``j`` is the ``j``-th rank of the group). An empty x gives the empty result without a
    collective. In debug mode the ranks first check that they agree (:mod:`xla_permute.debug`).
    """
    x, dim, checked, chosen = _begin(x, dim, groups, backend, "all_gather")
    _agree("all_gather", x, dim, checked, chosen)
    if x.numel() == 0:
        return torch.cat([x] * len(checked[0]), dim)
    return _AllGather.apply(x, dim, checked, chosen)


def reduce_scatter(
    x: torch.Tensor, dim: int, *, groups: Groups = None, backend: str = "auto"
) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's block along ``dim``; backward: all-gather.

    Per rank: ``[..., N*m, ...] -> [..., m, ...]``; ``x.shape[dim]`` must divide by the group
    size N; the ``j``-th rank of a group gets block ``j``. An empty x gives the empty result
    without a collective. In debug mode the ranks first check that they agree
    (:mod:`xla_permute.debug`).
    """
    x, dim, checked, chosen = _begin(x, dim, groups, backend, "reduce_scatter")
    n = len(checked[0])
    if x.shape[dim] % n:
        raise ValueError(
            f"reduce_scatter: x.shape[{dim}] = {x.shape[dim]} is not divisible by the {n} ranks "
            f"of the group; pad it to a multiple of {n}"
        )
    _agree("reduce_scatter", x, dim, checked, chosen)
    if x.numel() == 0:
        _, position, _ = chosen.position(checked)
        return x.narrow(dim, position * (x.shape[dim] // n), x.shape[dim] // n)
    return _ReduceScatter.apply(x, dim, checked, chosen)


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, groups: CheckedGroups, backend: CommBackend
    ) -> torch.Tensor:
        ctx.groups, ctx.backend = groups, backend
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        gathered = ctx.backend.all_gather(grad.unsqueeze(0).contiguous(), 0, ctx.groups)
        return gathered.sum(0), None, None


def sum_gradients(x: torch.Tensor, *, groups: Groups = None, backend: str = "auto") -> torch.Tensor:
    """Identity forward; backward sums the gradient over ranks.

    For a parameter held whole on every rank but used on a shard of the data (the bias of a
    sequence-parallel row-parallel layer): each rank's gradient covers its own rows only, and
    the true gradient is their sum over the group. (An all-reduce, built from a channel-id
    all-gather so that it runs on the CPU mesh too; the same on c10d.)
    """
    chosen = check_tensor(x, "x", backend)
    return _SumGradients.apply(x, check_groups(groups, chosen.world_size()), chosen)
