"""MLP blocks on the tensor-parallel layers, sequence parallel: ``[B, S/N, H] -> [B, S/N, H]``.

* :class:`SequenceParallelMLP`: column-parallel, activation, row-parallel.
* :class:`GatedMLP`: ``down(activation(gate(x), up(x)))``, gate and up on one all-gather ring
  (x travels once): SwiGLU (:func:`swiglu`) or the PoC's :func:`relu_product`.

The layers, their ``strategy`` and their backward: :mod:`xla_permute.tensor_parallel.layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from typing_extensions import Self

from xla_permute.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["GatedMLP", "SequenceParallelMLP", "relu_product", "swiglu"]

Act = Callable[[torch.Tensor], torch.Tensor]
Gate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: ``silu(a) * b`` (a from the gate projection, b from the up one)."""
    return F.silu(a) * b


def relu_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The upstream PoC's gate: ``relu(a * b)``."""
    return torch.relu(a * b)


def _check_chain(block: str, names: str, first: nn.Module, second: nn.Module) -> None:
    """A column-parallel layer feeding a row-parallel one: the same ranks and sharded
    dimension, the first's outputs the second's inputs (checked once, when built)."""
    a, b = names.split()
    same = ("dim", "groups", "world_size", "rank")
    differ = [k for k in same if getattr(first, k) != getattr(second, k)]
    f, k = first.out_features, second.in_features
    differ += [f"{a}.out_features = {f} vs {b}.in_features = {k}"] if f != k else []
    if differ:
        raise ValueError(
            f"{block}: {a} feeds {b}, so they must agree on {differ}; build both with the "
            f"same world_size=, rank=, groups= and dim="
        )


class SequenceParallelMLP(nn.Module):
    """Transformer MLP block, sequence parallel: ``[B, S/N, H] -> [B, S/N, H]``.

    ``y = RowParallel(act(ColumnParallel(x)))``: one all-gather-matmul, one activation on this
    rank's ``ffn/N`` columns, one matmul-reduce-scatter.
    """

    def __init__(self, fc1: ColumnParallelLinear, fc2: RowParallelLinear, activation: Act = F.gelu):
        super().__init__()
        _check_chain("SequenceParallelMLP", "fc1 fc2", fc1, fc2)
        self.fc1, self.fc2, self.activation = fc1, fc2, activation

    @classmethod
    def from_mlp(cls, fc1: nn.Linear, fc2: nn.Linear, activation: Act = F.gelu, **kw: Any) -> Self:
        """This rank's shard of the single-device MLP ``fc2(activation(fc1(x)))``."""
        col, row = ColumnParallelLinear.from_linear, RowParallelLinear.from_linear
        return cls(col(fc1, **kw), row(fc2, **kw), activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``fc2(activation(fc1(x)))``: ``[..., S/N, H] -> [..., S/N, H]``."""
        return self.fc2(self.activation(self.fc1(x)))


class GatedMLP(nn.Module):
    """Gated transformer MLP, sequence parallel: ``[B, S/N, H] -> [B, S/N, H]``.

    ``y = down(activation(gate(x), up(x)))``: gate and up are column-parallel, computed on
    one ring by ``gate``'s setting (x travels once: :meth:`ColumnParallelLinear.fused
    <xla_permute.ColumnParallelLinear.fused>`), the activation acts on this rank's ``ffn/N``
    columns of both, down is row-parallel. ``activation(a, b)``: :func:`swiglu`
    (``silu(a) * b``, the default) or :func:`relu_product` (``relu(a * b)``, the PoC's).
    """

    def __init__(
        self,
        gate: ColumnParallelLinear,
        up: ColumnParallelLinear,
        down: RowParallelLinear,
        activation: Gate = swiglu,
    ) -> None:
        super().__init__()
        same = "in_features out_features dim strategy bidirectional groups backend world_size rank"
        differ = [a for a in same.split() if getattr(gate, a) != getattr(up, a)]
        if differ:
            raise ValueError(f"GatedMLP: gate and up must agree on {differ} to share a ring")
        _check_chain("GatedMLP", "gate down", gate, down)
        self.gate, self.up, self.down, self.activation = gate, up, down, activation

    @classmethod
    def from_mlp(
        cls, gate: nn.Linear, up: nn.Linear, down: nn.Linear, activation: Gate = swiglu, **kw: Any
    ) -> Self:
        """This rank's shard of ``down(activation(gate(x), up(x)))`` on one device (each
        weight sharded on its own: rank r holds rows ``r*ffn/N ...`` of gate and of up)."""
        col, row = ColumnParallelLinear.from_linear, RowParallelLinear.from_linear
        return cls(col(gate, **kw), col(up, **kw), row(down, **kw), activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``down(activation(gate(x), up(x)))``: ``[..., S/N, H] -> [..., S/N, H]``."""
        gate, up = self.gate, self.up
        a, b = gate.fused(x, [(gate.weight, gate.bias), (up.weight, up.bias)])
        return self.down(self.activation(a, b))
