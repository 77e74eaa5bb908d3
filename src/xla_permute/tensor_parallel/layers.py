"""Tensor-parallel linear layers on collective matmul (Megatron's, sequence parallel or not).

With sequence parallelism the activations between blocks are sharded along the sequence, so a
column-parallel linear starts with an all-gather and a row-parallel one ends with a
reduce-scatter: the two collectives that collective matmul overlaps with the matmul. Per rank,
N ranks, sequence dimension ``dim`` (1 of ``[B, S, H]``):

* :class:`ColumnParallelLinear` ``(K -> F)``: ``x [..., S/N, K] -> y [..., S, F/N]``,
  ``y = AllGather(x) @ W_r.T + b_r``, ``W_r`` rows ``r*F/N ... (r+1)*F/N`` of the full
  ``nn.Linear`` weight ``[F, K]``. Backward: ``dx = ReduceScatter(dy @ W_r)``.
* :class:`RowParallelLinear` ``(K -> F)``: ``x [..., S, K/N] -> y [..., S/N, F]``,
  ``y = ReduceScatter(x @ W_r.T) + b``, ``W_r`` columns ``r*K/N ... (r+1)*K/N``, the bias
  whole (its gradient summed over ranks). Backward: ``dx = AllGather(dy) @ W_r``.

``dim=None`` (without sequence parallelism): the activations are whole on every rank; the
column layer is a local matmul (backward: ``dx`` summed over ranks), the row layer ends with
``y = AllReduce(x @ W_r.T) + b`` (:func:`reduce_replicated`). ``gather_output=True``
(column): the output's features gathered, ``[..., F]`` (:func:`gather_replicated`).

``strategy``, fixed when the layer is built: ``"ring"`` (collective matmul, the default;
``bidirectional``: both ways round), ``"baseline"`` (the blocking collective, then the matmul)
or ``"xla"`` (the baseline's collectives in the form the TPU compiler rewrites into its own
collective matmul, given the TPU recipe's environment; the reduce-scatter in the input dtype,
as the upstream PoC; the cost model advises, tutorial 04). The group and this rank's place in
it are resolved when the layer is built (given as ``world_size=``, ``rank=`` outside a rank).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from xla_permute.backends.select import BACKENDS, distributed_ready, get_backend
from xla_permute.backends.xla import need_torch_xla
from xla_permute.collectives import all_gather, all_reduce, sum_gradients
from xla_permute.matmul import (
    all_gather_matmul,
    all_gather_then_matmul,
    matmul_reduce_scatter,
    matmul_then_reduce_scatter,
)
from xla_permute.pairs import GroupsLike, check_int, see

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "gather_replicated", "reduce_replicated"]

STRATEGIES = ("ring", "baseline", "xla")  #: a layer's ``strategy``


def _place(
    groups: GroupsLike, backend: str, world_size: object, rank: object, what: str
) -> tuple[int, int]:
    """``(group size, this rank's position)`` for a layer: asked from the running mesh or
    process group; given (``world_size``, ``rank``) outside one, and checked inside one."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    world_size = None if world_size is None else check_int(world_size, "world_size", 1)
    rank = None if rank is None else check_int(rank, "rank", 0)
    if backend == "c10d" or (backend == "auto" and distributed_ready()):
        live = distributed_ready()
    else:  # asking a runtime that has not started would start it (and break run_on_mesh)
        if None in (world_size, rank):
            need_torch_xla(f"{what} without world_size= and rank=")
            import torch_xla  # noqa: F401 (given both, a runtime runs only if it is imported)
        xla = sys.modules.get("torch_xla")
        live = xla is not None and xla._XLAC._xla_runtime_is_initialized()
    if not live:
        if world_size is None or rank is None:
            raise RuntimeError(
                f"{what} built outside a mesh rank needs world_size= and rank= (asking the XLA "
                f"runtime would start it here); build it inside the rank function, or pass both"
                f"{see('outside-rank')}"
            )
        size, position = world_size, rank
    else:
        size, position, _ = get_backend(backend).position(groups)
        if world_size not in (None, size) or rank not in (None, position):
            raise ValueError(
                f"{what} was built for rank {rank} of {world_size} but runs on rank {position} "
                f"of a group of {size}; leave world_size= and rank= out inside a rank"
            )
    if not 0 <= position < size:
        raise ValueError(f"rank {position} is outside the world of {size} ranks")
    return size, position


class _ReduceReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, groups: GroupsLike, backend: str) -> torch.Tensor:
        return all_reduce(x, groups=groups, backend=backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad, None, None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, position: int, *comm: Any) -> torch.Tensor:
        ctx.dim, ctx.start, ctx.size = dim, position * x.shape[dim], x.shape[dim]
        return all_gather(x, dim, groups=comm[0], backend=comm[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size), None, None, None, None


def reduce_replicated(
    x: torch.Tensor, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """The sum of every rank's partial ``x``, a replicated result (Megatron's
    ``reduce_from_tensor_model_parallel_region``): ``x [...] -> [...]``, ``y = sum_j x_j``.
    Backward: ``dx = dy`` (each rank's ``dy`` is the whole gradient of the replicated ``y``)."""
    return _ReduceReplicated.apply(x, groups, backend)


def gather_replicated(
    x: torch.Tensor, dim: int, position: int, *, groups: GroupsLike = None, backend: str = "auto"
) -> torch.Tensor:
    """Every rank's block concatenated along ``dim`` (non-negative), a replicated result
    (Megatron's ``gather_from_tensor_model_parallel_region``): ``[..., m, ...] -> [..., N*m,
    ...]``. Backward: this rank's block (``position`` in its group) of ``dy``, not summed."""
    return _GatherReplicated.apply(x, dim, position, groups, backend)


class _ParallelLinear(nn.Module):
    """The two layers' common part; ``sharded``: ``"out"`` (column) or ``"in"`` (row)."""

    sharded: str

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        dim: int | None = 1,
        strategy: str = "ring",
        bidirectional: bool = False,
        groups: GroupsLike = None,
        backend: str = "auto",
        world_size: int | None = None,
        rank: int | None = None,
        dtype: torch.dtype | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.in_features = check_int(in_features, "in_features", 1)
        self.out_features = check_int(out_features, "out_features", 1)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        self.dim = None if dim is None else check_int(dim, "dim")
        self.strategy, self.bidirectional, self.backend = strategy, bool(bidirectional), backend
        self.groups = None if groups is None else [list(g) for g in groups]
        what = type(self).__name__
        self.world_size, self.rank = _place(self.groups, backend, world_size, rank, what)
        n, split = self.world_size, f"{self.sharded}_features"  # the features split over ranks
        if getattr(self, split) % n:
            raise ValueError(
                f"{split} = {getattr(self, split)} is not divisible by the {n} ranks; choose a "
                f"multiple of {n}"
            )
        column = self.sharded == "out"
        f, k = (out_features // n, in_features) if column else (out_features, in_features // n)
        self.weight = nn.Parameter(torch.empty(f, k, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(f, dtype=dtype)) if bias else None
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``nn.Linear``'s initialisation (uniform in +-1/sqrt(in_features) of the full layer);
        a per-rank ``generator`` keeps the CPU mesh's rank threads from sharing torch's RNG."""
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            for p in (self.weight, self.bias):
                if p is not None:
                    p.uniform_(-bound, bound, generator=generator)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> Self:
        """This rank's shard of a full ``nn.Linear``, in its dtype and on its device (the
        ranks' shards together compute the same)."""
        kwargs.setdefault("dtype", linear.weight.dtype)
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, **kwargs)
        n, r, axis = layer.world_size, layer.rank, 0 if cls.sharded == "out" else 1
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(n, axis)[r])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(n)[r] if axis == 0 else linear.bias)
        return layer.to(linear.weight.device)

    def _check(self, x: torch.Tensor) -> None:
        """x on this layer's device, its features those of the weight (a rank alone sees)."""
        name = type(self).__name__
        if x.device != self.weight.device:
            raise ValueError(
                f"{name}.weight is on {self.weight.device} but the input is on {x.device}; move "
                f"the input to the layer's device (or the layer to the input's: .to(device))"
            )
        if x.dim() < 2 or x.shape[-1] != self.weight.shape[1]:
            what = "in_features" if self.sharded == "out" else "in_features/N"
            raise ValueError(
                f"{name} takes x [..., {what} = {self.weight.shape[1]}] on every rank, got x "
                f"of shape {tuple(x.shape)}"
            )

    def extra_repr(self) -> str:
        shape, place = tuple(self.weight.shape), f"{self.rank}/{self.world_size}"
        return f"weight={shape}, rank={place}, dim={self.dim}, strategy={self.strategy!r}"


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the output features sharded over ranks:
    ``[..., S/N, in_features] -> [..., S, out_features/N]`` (module docstring)."""

    sharded = "out"

    def __init__(self, *args: Any, gather_output: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gather_output = bool(gather_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``AllGather(x, dim) @ W_r.T + b_r``: ``[..., S/N, K] -> [..., S, F/N]`` (``dim=None``:
        ``[..., S, K] -> [..., S, F/N]``; ``gather_output``: ``[..., F]``)."""
        return self.fused(x, [(self.weight, self.bias)])[0]

    def fused(
        self, x: torch.Tensor, params: Sequence[tuple[torch.Tensor, torch.Tensor | None]]
    ) -> tuple[torch.Tensor, ...]:
        """``x`` times several weights, this layer's setting for all, on one ring (x travels
        once): q/k/v, gate/up. ``params``: each output's ``(weight [F_i/N, K], bias)``, this
        rank's rows; returns each output ``[..., S, F_i/N]``."""
        self._check(x)
        ws, comm = [w.T for w, _ in params], dict(groups=self.groups, backend=self.backend)
        if self.dim is None:  # x whole on every rank: local matmuls, dx summed over ranks
            x = sum_gradients(x, **comm)
            ys = [x @ w for w in ws]
        elif self.strategy == "ring":
            ys = all_gather_matmul(x, ws, dim=self.dim, bidirectional=self.bidirectional, **comm)
        else:
            ys = all_gather_then_matmul(x, ws, dim=self.dim, **comm)
        ys = [_add(y, b) for y, (_, b) in zip(ys, params, strict=True)]
        if self.gather_output:
            ys = [gather_replicated(y, y.dim() - 1, self.rank, **comm) for y in ys]
        return tuple(ys)


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the input features sharded over ranks:
    ``[..., S, in_features/N] -> [..., S/N, out_features]`` (module docstring)."""

    sharded = "in"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``ReduceScatter(x @ W_r.T, dim) + b``: ``[..., S, K/N] -> [..., S/N, F]``
        (``dim=None``: ``AllReduce(x @ W_r.T) + b``, ``[..., S, F]``)."""
        self._check(x)
        w, comm = self.weight.T, dict(groups=self.groups, backend=self.backend)
        if self.dim is None:
            return _add(reduce_replicated(x @ w, **comm), self.bias)
        if self.strategy == "ring":
            y = matmul_reduce_scatter(x, w, dim=self.dim, bidirectional=self.bidirectional, **comm)
        else:  # "xla": the reduce-scatter in the input dtype, as the PoC's
            reduce_dtype = x.dtype if self.strategy == "xla" else None
            y = matmul_then_reduce_scatter(x, w, dim=self.dim, reduce_dtype=reduce_dtype, **comm)
        if self.bias is None or y.numel() == 0:
            return _add(y, self.bias)
        # The bias is whole on every rank, but each rank adds it to its own rows only.
        return y + sum_gradients(self.bias, **comm)


def _add(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias
