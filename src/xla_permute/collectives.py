"""Differentiable all-gather, reduce-scatter and all-reduce over all ranks or within groups, on
every backend, and the gradient sums of replicated parameters.

On XLA these are the upstream collectives (``xm.all_gather``, ``xm.reduce_scatter``) called the
way that runs on every device, the CPU mesh included (``pin_layout=False``, a channel id,
``use_global_device_ids=True``); on ``c10d`` they are ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` on the process group of ``groups`` (:mod:`xla_permute.backends.select`).
Autograd: the backward of an all-gather is a reduce-scatter of the gradient and vice versa.
They build the baselines that collective matmul is compared with. ``groups``: replica groups
of equal size (:func:`~xla_permute.pairs.check_groups`); a group gathers (and scatters) in the
order it lists its ranks. ``None``: one group of all ranks.

The sum over a group (one implementation, ``_sum``, behind :func:`all_reduce`,
:func:`all_reduce_gradients` and the backward of :func:`sum_gradients`): ``xm.all_reduce``
carries no channel id and aborts the CPU mesh, so the sum is built from the two collectives that
run everywhere: a reduce-scatter of the flattened tensor (each rank sums one block) and an
all-gather of the blocks, the two halves of a ring all-reduce (``2 (N-1)/N`` times the tensor's
bytes per rank). Each block is summed once, on one rank, so every rank of a group gets the same
bits: replicated weights stay identical after the step.

A weight held whole by several ranks that see different tokens (a tensor-parallel shard
replicated over the context-parallel group, a norm's weight replicated everywhere, the bias of a
sequence-parallel row-parallel layer) gets, on each rank, the gradient of that rank's tokens
only; the true gradient is their sum over the ranks that hold the same copy:
:func:`sum_gradients` inside the model (its backward sums), or :func:`all_reduce_gradients`
after ``loss.backward()``, as data-parallel training does, in one collective per dtype.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from xla_permute.backends.select import CommBackend, check_tensor
from xla_permute.debug import agree
from xla_permute.pairs import Groups, GroupsLike, check_dim, check_groups

__all__ = ["all_gather", "all_reduce", "all_reduce_gradients", "reduce_scatter", "sum_gradients"]


class _Collective(torch.autograd.Function):
    """``gather``: all-gather, backward a reduce-scatter of the gradient; else the reverse."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, groups: Groups, backend: CommBackend, gather: bool
    ) -> torch.Tensor:
        ctx.args = dim, groups, backend, not gather
        return (backend.all_gather if gather else backend.reduce_scatter)(x, dim, groups)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _Collective.apply(grad.contiguous(), *ctx.args), None, None, None, None


def _begin(
    x: object, dim: object, groups: GroupsLike, backend: str, op: str, scatter: bool = False
) -> tuple[Any, ...]:
    """The op's boundary (``scatter``: ``x.shape[dim]`` must divide by the group size):
    ``(dim, checked groups, backend)``, after the agreement check (:mod:`xla_permute.debug`)."""
    chosen = check_tensor(x, "x", backend)
    assert isinstance(x, torch.Tensor)
    dim, checked = check_dim(dim, x.shape, op=op), check_groups(groups, chosen.world_size())
    if scatter and x.shape[dim] % len(checked[0]):
        n = len(checked[0])
        raise ValueError(
            f"reduce_scatter: x.shape[{dim}] = {x.shape[dim]} is not divisible by the {n} ranks "
            f"of the group; pad it to a multiple of {n}"
        )
    options = {"dim": dim, "groups": [list(g) for g in checked]}
    agree(op, {"x": x}, options, backend=chosen)
    return dim, checked, chosen


def all_gather(
    x: torch.Tensor, dim: int, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; backward: reduce-scatter of the gradient.

    Per rank: ``[..., m, ...] -> [..., N*m, ...]`` (``m`` at ``dim``, ``N`` the group size;
    block ``j`` is the ``j``-th rank of the group). An empty x gives the empty result without a
    collective. In debug mode the ranks first check that they agree (:mod:`xla_permute.debug`).
    """
    dim, checked, chosen = _begin(x, dim, groups, backend, "all_gather")
    if x.numel() == 0:
        return torch.cat([x] * len(checked[0]), dim)
    return _Collective.apply(x, dim, checked, chosen, True)


def reduce_scatter(
    x: torch.Tensor, dim: int, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's block along ``dim``; backward: all-gather.

    Per rank: ``[..., N*m, ...] -> [..., m, ...]``; ``x.shape[dim]`` must divide by the group
    size N; the ``j``-th rank of a group gets block ``j``. An empty x gives the empty result
    without a collective. In debug mode the ranks first check that they agree
    (:mod:`xla_permute.debug`).
    """
    dim, checked, chosen = _begin(x, dim, groups, backend, "reduce_scatter", scatter=True)
    n = len(checked[0])
    if x.numel() == 0:
        _, position, _ = chosen.position(checked)
        return x.narrow(dim, position * (x.shape[dim] // n), x.shape[dim] // n)
    return _Collective.apply(x, dim, checked, chosen, False)


def all_gather_checked(
    x: torch.Tensor, dim: int, groups: Groups, backend: CommBackend
) -> torch.Tensor:
    """:func:`all_gather` of arguments an op has checked already (and agreed on in debug
    mode): the baselines of :mod:`xla_permute.matmul` call it after their own boundary."""
    return _Collective.apply(x, dim, groups, backend, True)


def reduce_scatter_checked(
    x: torch.Tensor, dim: int, groups: Groups, backend: CommBackend
) -> torch.Tensor:
    """:func:`reduce_scatter` of checked arguments (as :func:`all_gather_checked`)."""
    return _Collective.apply(x, dim, groups, backend, False)


def _sum(x: torch.Tensor, groups: Groups, backend: CommBackend) -> torch.Tensor:
    """Raw sum over the group: flatten, pad to a multiple of N, reduce-scatter, all-gather;
    cloned, not a view of the gathered base (the CPU mesh's compile barrier cannot see it)."""
    n = len(groups[0])
    flat = x.reshape(-1)
    pad = -flat.numel() % n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    block = backend.reduce_scatter(flat, 0, groups)
    whole = backend.all_gather(block, 0, groups)
    return whole[: x.numel()].view(x.shape).clone()


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Groups, backend: CommBackend) -> torch.Tensor:
        ctx.groups, ctx.backend = groups, backend
        return _sum(x, groups, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _AllReduce.apply(grad.contiguous(), ctx.groups, ctx.backend), None, None


class _SumGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: Groups, backend: CommBackend) -> torch.Tensor:
        ctx.groups, ctx.backend = groups, backend
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        if grad.numel() == 0 or len(ctx.groups[0]) == 1:
            return grad, None, None
        return _sum(grad.contiguous(), ctx.groups, ctx.backend), None, None


def sum_gradients(
    x: torch.Tensor, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """Identity forward; backward sums the gradient over ranks: ``dx = all_reduce(dy)``.

    Per rank: ``x [...] -> [...]``. For a weight held whole but used on a shard of the data
    (module docstring): each rank's gradient covers its own rows only.
    """
    chosen = check_tensor(x, "x", backend)
    return _SumGradients.apply(x, check_groups(groups, chosen.world_size()), chosen)


def all_reduce(
    x: torch.Tensor, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """The sum of every rank's ``x`` over its group, on every rank of the group.

    Per rank: ``x [...] -> [...]`` (same shape), ``y = sum_j x_j`` over the group's ranks
    ``j``, bitwise the same on every rank of a group (module docstring). Backward: ``dx =
    all_reduce(dy)``. An empty ``x`` is returned without a collective. In debug mode the ranks
    first check that they agree (:mod:`xla_permute.debug`).
    """
    chosen = check_tensor(x, "x", backend)
    checked = check_groups(groups, chosen.world_size())
    agree("all_reduce", {"x": x}, {"groups": [list(g) for g in checked]}, backend=chosen)
    if x.numel() == 0 or len(checked[0]) == 1:
        return x.clone()
    return _AllReduce.apply(x, checked, chosen)


def all_reduce_gradients(
    parameters: Iterable[torch.Tensor], *, groups: GroupsLike = None, backend: str = "auto"
) -> None:
    """Replace each parameter's ``.grad`` with its sum over the group; call after backward.

    For parameters held alike by ranks that see different data (module docstring): each
    ``p.grad`` becomes ``sum_j p.grad_j`` over the group, the same bits on every rank.
    Parameters without a gradient are skipped; every rank must pass the same parameters in the
    same order, with the same gradients present (checked in debug mode). One flat
    :func:`all_reduce` per dtype. Not differentiable (it acts on ``.grad``).

    Raises:
        TypeError: ``parameters`` holds something other than tensors; ValueError: bad
            ``groups``, a gradient on another device than the first.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = list(parameters)
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"parameters[{i}] is a {type(p).__name__}, not a tensor; pass "
                f"module.parameters() or a list of parameters"
            )
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    chosen = check_tensor(grads[0], "parameters[0].grad", backend)
    checked = check_groups(groups, chosen.world_size())
    for g in grads:
        if g.device != grads[0].device:
            raise ValueError(
                f"all_reduce_gradients: gradients on {grads[0].device} and {g.device}; "
                f"move the module to one device (its rank's) first"
            )
    described = [
        None if p.grad is None else (tuple(p.grad.shape), str(p.grad.dtype)) for p in params
    ]
    options = {"gradients": repr(described), "groups": [list(g) for g in checked]}
    agree("all_reduce_gradients", {"parameters[0].grad": grads[0]}, options, backend=chosen)
    if len(checked[0]) == 1:
        return
    with torch.no_grad():
        for dtype in dict.fromkeys(g.dtype for g in grads):
            same = [p for p in params if p.grad is not None and p.grad.dtype == dtype]
            if sum(p.grad.numel() for p in same) == 0:
                continue
            flat = torch.cat([p.grad.reshape(-1) for p in same])
            summed = _sum(flat, checked, chosen)
            for p, piece in zip(same, summed.split([p.grad.numel() for p in same]), strict=True):
                p.grad.copy_(piece.view_as(p.grad))
