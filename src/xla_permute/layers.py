"""Tensor-parallel layers on collective matmul (Megatron naming, sequence-parallel form).

With sequence parallelism (Megatron-LM's ``sequence_parallel=True``) activations between
blocks are sharded along the sequence, so a column-parallel linear starts with an all-gather
and a row-parallel linear ends with a reduce-scatter: exactly the two collectives that
collective matmul overlaps with the matmul. ``collective_matmul=False`` runs the upstream
baseline (blocking collective, then matmul) for comparison.

Per-rank shapes, N ranks, sequence dimension ``dim`` (default 1 of ``[batch, seq, features]``):

* :class:`ColumnParallelLinear` ``(K -> F)``: ``x [B, S/N, K] -> y [B, S, F/N]``;
  ``y = AllGather(x) @ W_r.T + b_r`` with ``W_r`` rows ``r*F/N ... (r+1)*F/N`` of the full
  ``nn.Linear`` weight ``[F, K]``.
* :class:`RowParallelLinear` ``(K -> F)``: ``x [B, S, K/N] -> y [B, S/N, F]``;
  ``y = ReduceScatter(x @ W_r.T) + b`` with ``W_r`` columns ``r*K/N ... (r+1)*K/N`` of
  the full weight and the full bias ``b`` (added once per output row; its gradient is
  summed over ranks, see :func:`~xla_permute.collectives.sum_gradients`).
* :class:`SequenceParallelMLP`: column-parallel, activation, row-parallel;
  ``[B, S/N, H] -> [B, S/N, H]``.

Backward: through the collective matmuls' own backward (see :mod:`xla_permute.matmul`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from typing_extensions import Self

from xla_permute.collectives import sum_gradients
from xla_permute.matmul import (
    all_gather_matmul,
    all_gather_then_matmul,
    matmul_reduce_scatter,
    matmul_then_reduce_scatter,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "SequenceParallelMLP"]


def _world(world_size: int | None, rank: int | None) -> tuple[int, int]:
    if world_size is None or rank is None:
        import torch_xla.runtime as xr

        world_size = xr.world_size() if world_size is None else world_size
        rank = xr.global_ordinal() if rank is None else rank
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    return world_size, rank


def _shard(size: int, world_size: int, what: str) -> int:
    if size % world_size:
        raise ValueError(
            f"{what} = {size} is not divisible by the {world_size} ranks; choose a multiple "
            f"of {world_size}"
        )
    return size // world_size


class _ParallelLinear(nn.Module):
    """The shared part of the two layers: ``_sharded`` names the feature axis split over ranks
    (``"out"``: column parallel, ``"in"``: row parallel)."""

    _sharded: str
    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        dim: int = 1,
        collective_matmul: bool = True,
        bidirectional: bool = False,
        world_size: int | None = None,
        rank: int | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        world_size, rank = _world(world_size, rank)
        if self._sharded == "out":
            out_local = _shard(out_features, world_size, "out_features")
            shape, bias_features = (out_local, in_features), out_local
        else:
            in_local = _shard(in_features, world_size, "in_features")
            shape, bias_features = (out_features, in_local), out_features
        self.in_features, self.out_features = in_features, out_features
        self.dim, self.world_size, self.rank = dim, world_size, rank
        self.collective_matmul, self.bidirectional = collective_matmul, bidirectional
        self.weight = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(bias_features)) if bias else None
        self.reset_parameters(generator)

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """``nn.Linear``'s initialisation (uniform in +-1/sqrt(in_features) of the full layer).

        Pass a per-rank ``generator``: on the CPU mesh the ranks are threads sharing torch's
        global RNG, so without one their draws interleave unpredictably.
        """
        bound = 1 / math.sqrt(self.in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound, generator=generator)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound, generator=generator)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs: Any) -> Self:
        """This rank's shard of a full ``nn.Linear`` (together, the same result as it)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    **kwargs)  # fmt: skip
        axis = 0 if cls._sharded == "out" else 1
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(layer.world_size, axis)[layer.rank])
            if layer.bias is not None:
                bias = (
                    linear.bias.chunk(layer.world_size)[layer.rank] if axis == 0 else (linear.bias)
                )
                layer.bias.copy_(bias)
        return layer

    def extra_repr(self) -> str:
        return (
            f"weight={tuple(self.weight.shape)}, rank={self.rank}/{self.world_size}, "
            f"dim={self.dim}, collective_matmul={self.collective_matmul}, "
            f"bidirectional={self.bidirectional}"
        )


class ColumnParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the output features sharded over ranks.

    Input: this rank's sequence shard ``[..., S/N, in_features]``; output: the whole sequence,
    this rank's ``out_features/N`` columns. See the module docstring for the equation.
    """

    _sharded = "out"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``AllGather(x, dim) @ W_r.T + b_r``: ``[..., S/N, K] -> [..., S, F/N]``."""
        w = self.weight.T
        if self.collective_matmul:
            y = all_gather_matmul(x, w, dim=self.dim, bidirectional=self.bidirectional)
        else:
            y = all_gather_then_matmul(x, w, dim=self.dim)
        return y if self.bias is None else y + self.bias


class RowParallelLinear(_ParallelLinear):
    """``nn.Linear(in_features, out_features)`` with the input features sharded over ranks.

    Input: the whole sequence, this rank's ``in_features/N`` columns ``[..., S, in/N]``;
    output: this rank's sequence shard ``[..., S/N, out_features]`` of the summed product.
    """

    _sharded = "in"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``ReduceScatter(x @ W_r.T, dim) + b``: ``[..., S, K/N] -> [..., S/N, F]``."""
        w = self.weight.T
        if self.collective_matmul:
            y = matmul_reduce_scatter(x, w, dim=self.dim, bidirectional=self.bidirectional)
        else:
            y = matmul_then_reduce_scatter(x, w, dim=self.dim)
        # The bias is whole on every rank but each rank adds it to its own rows only.
        return y if self.bias is None else y + sum_gradients(self.bias)


class SequenceParallelMLP(nn.Module):
    """Transformer MLP block, sequence parallel: ``[B, S/N, H] -> [B, S/N, H]``.

    ``y = RowParallel(act(ColumnParallel(x)))``: one all-gather-matmul, one activation on this
    rank's ``ffn/N`` columns, one matmul-reduce-scatter.
    """

    def __init__(
        self,
        fc1: ColumnParallelLinear,
        fc2: RowParallelLinear,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.gelu,
    ) -> None:
        super().__init__()
        self.fc1, self.fc2, self.activation = fc1, fc2, activation

    @classmethod
    def from_mlp(
        cls,
        fc1: nn.Linear,
        fc2: nn.Linear,
        activation: Callable[[torch.Tensor], torch.Tensor] = nn.functional.gelu,
        **kwargs: object,
    ) -> SequenceParallelMLP:
        """This rank's shard of the single-device MLP ``fc2(activation(fc1(x)))``."""
        return cls(
            ColumnParallelLinear.from_linear(fc1, **kwargs),
            RowParallelLinear.from_linear(fc2, **kwargs),
            activation,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(activation(fc1(x)))``: ``[..., S/N, H] -> [..., S/N, H]``."""
        return self.fc2(self.activation(self.fc1(x)))
