"""Collectives whose result is replicated: Megatron's "regions" for tensor parallelism.

A tensor-parallel model holds two kinds of activation: **sharded** ones (each rank a different
piece: a sequence shard, a block of heads, a block of the vocabulary) and **replicated** ones
(the same value on every rank, computed alike by every rank, e.g. the activations of a
tensor-parallel model without sequence parallelism, or the loss). Every rank differentiates the
same scalar loss, so the gradient a rank receives for a replicated value is already the whole
gradient, not its own part of it.

:func:`~xla_permute.collectives.all_reduce` and :func:`~xla_permute.collectives.all_gather` have
the backward of ranks that each contribute a different term of the loss (the gradient is summed).
The two here have the backward of replicated results (Megatron-LM's
``reduce_from_tensor_model_parallel_region`` and ``gather_from_tensor_model_parallel_region``);
with :func:`~xla_permute.collectives.sum_gradients` (identity forward, sum backward: Megatron's
``copy_to_tensor_model_parallel_region``) they are the three a layer needs where a replicated
activation meets a sharded one.
"""

from __future__ import annotations

from typing import Any

import torch

from xla_permute.collectives import all_gather, all_reduce
from xla_permute.pairs import GroupsLike

__all__ = ["gather_replicated", "reduce_replicated"]


class _ReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: GroupsLike, backend: str) -> torch.Tensor:
        return all_reduce(x, groups=groups, backend=backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, dim: int, position: int, groups: GroupsLike, backend: str
    ) -> torch.Tensor:
        ctx.dim, ctx.start, ctx.size = dim, position * x.shape[dim], x.shape[dim]
        return all_gather(x, dim, groups=groups, backend=backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size), None, None, None, None


def reduce_replicated(
    x: torch.Tensor, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """The sum of every rank's partial ``x`` over the group, a replicated result.

    Per rank: ``x [...] -> [...]``, ``y = sum_j x_j`` (the :func:`~xla_permute.all_reduce` sum,
    the same bits on every rank). Backward: ``dx = dy`` (every rank's ``dy`` is the whole
    gradient of the replicated ``y``).
    """
    return _ReduceReplicated.apply(x, groups, backend)


def gather_replicated(
    x: torch.Tensor, dim: int, position: int, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """Every rank's block concatenated along ``dim``, a replicated result.

    Per rank: ``[..., m, ...] -> [..., N*m, ...]`` (``dim`` non-negative; block ``j`` from the
    group's ``j``-th rank; ``position``: this rank's place in its group). Backward: this rank's
    block of ``dy`` (``dy[..., position*m : (position+1)*m, ...]``).
    """
    return _GatherReplicated.apply(x, dim, position, groups, backend)
