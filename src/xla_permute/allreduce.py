"""All-reduce (a sum over a group) that runs on every backend, and the gradient sum of
replicated parameters.

A weight held whole by several ranks that see different tokens (a tensor-parallel shard
replicated over the context-parallel group, a norm's weight replicated everywhere) gets, on
each rank, the gradient of that rank's tokens only; the true gradient is their sum over the
ranks that hold the same copy. :func:`all_reduce_gradients` sums them after
``loss.backward()``, as data-parallel training does, in one collective per dtype.

``xm.all_reduce`` carries no channel id and aborts the CPU mesh; :func:`all_reduce` is built
from the two collectives that run everywhere: a reduce-scatter of the flattened tensor (each
rank sums one block) and an all-gather of the blocks, the two halves of a ring all-reduce
(``2 (N-1)/N`` times the tensor's bytes per rank). Each block is summed once, on one rank, so
every rank of a group gets the same bits: replicated weights stay identical after the step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from xla_permute.backends.select import CommBackend, check_tensor
from xla_permute.pairs import Groups as CheckedGroups
from xla_permute.pairs import check_groups

__all__ = ["all_reduce", "all_reduce_gradients"]

Groups = Sequence[Sequence[int]] | None


def _sum(x: torch.Tensor, groups: CheckedGroups, backend: CommBackend) -> torch.Tensor:
    """Raw sum over the group: flatten, pad to a multiple of N, reduce-scatter, all-gather."""
    n = len(groups[0])
    flat = x.reshape(-1)
    pad = -flat.numel() % n
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    block = backend.reduce_scatter(flat, 0, groups)
    whole = backend.all_gather(block, 0, groups)
    return whole[: x.numel()].view(x.shape)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, groups: CheckedGroups, backend: CommBackend
    ) -> torch.Tensor:
        ctx.groups, ctx.backend = groups, backend
        return _sum(x, groups, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _AllReduce.apply(grad.contiguous(), ctx.groups, ctx.backend), None, None


def _agree(op: str, fields: dict[str, Any], x: torch.Tensor, backend: CommBackend) -> None:
    from xla_permute import debug

    debug.check_agreement(op, fields, error=backend.device_error(x), backend=backend)


def all_reduce(x: torch.Tensor, *, groups: Groups = None, backend: str = "auto") -> torch.Tensor:
    """The sum of every rank's ``x`` over its group, on every rank of the group.

    Per rank: ``x [...] -> [...]`` (same shape), ``y = sum_j x_j`` over the group's ranks
    ``j``. Bitwise the same on every rank of a group. Backward: ``dx = all_reduce(dy)`` (each
    rank's ``x`` reaches every rank's ``y``). Built from a reduce-scatter and an all-gather of
    the flattened tensor, padded to a multiple of the group size (module docstring); an empty
    ``x`` is returned without a collective. ``groups``: replica groups of equal size
    (:func:`~xla_permute.pairs.check_groups`); None: all ranks. In debug mode the ranks first
    check that they agree on shape, dtype and groups (:mod:`xla_permute.debug`).
    """
    chosen = check_tensor(x, "x", backend)
    checked = check_groups(groups, chosen.world_size())
    fields = {"x.shape": tuple(x.shape), "x.dtype": str(x.dtype),
              "groups": [list(g) for g in checked]}  # fmt: skip
    _agree("all_reduce", fields, x, chosen)
    if x.numel() == 0 or len(checked[0]) == 1:
        return x.clone()
    return _AllReduce.apply(x, checked, chosen)


def all_reduce_gradients(
    parameters: Iterable[torch.Tensor], *, groups: Groups = None, backend: str = "auto"
) -> None:
    """Replace each parameter's ``.grad`` with its sum over the group; call after backward.

    For parameters held alike by the ranks of a group that see different data (module
    docstring): after ``loss.backward()`` each rank's ``p.grad`` covers its own tokens; after
    this call it is ``sum_j p.grad_j`` over the group, the same bits on every rank, so that
    the optimizer steps every copy alike. Parameters without a gradient are skipped; every
    rank must pass the same parameters in the same order, with the same gradients present
    (checked in debug mode). The gradients of one dtype travel as one flat tensor: one
    :func:`all_reduce` per dtype, not one per parameter. Not differentiable (it acts on
    ``.grad``, outside autograd).

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
    described = [None if p.grad is None else (tuple(p.grad.shape), str(p.grad.dtype))
                 for p in params]  # fmt: skip
    fields = {"gradients": repr(described), "groups": [list(g) for g in checked]}
    _agree("all_reduce_gradients", fields, grads[0], chosen)
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
