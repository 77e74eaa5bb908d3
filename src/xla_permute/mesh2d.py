"""A tensor-parallel x context-parallel grid of ranks: its groups and its token sharding.

``Mesh2D(tp=T, cp=C)`` lays ``T*C`` ranks out as Megatron-LM does, tensor parallelism
innermost (the ranks of a TP group are adjacent, the fastest links): rank
``r = c*T + t`` has TP index ``t`` and CP index ``c``.

* ``tp_groups``: ranks with the same CP index (``[[0, 1], [2, 3]]`` for 2 x 2); they shard
  the weights (column/row parallel) and, with sequence parallelism, split their CP shard's
  tokens between them.
* ``cp_groups``: ranks with the same TP index (``[[0, 2], [1, 3]]``); they hold the same
  weight shards and split the sequence (ring attention runs over them).

The sequence is sharded in two levels: over the CP groups in ``layout`` (``"zigzag"``
balances causal attention, :mod:`xla_permute.sequence`), then each CP shard in ``T``
contiguous pieces over its TP group. So a column-parallel layer's all-gather within a TP
group gives back that group's whole CP shard, in the order ring attention expects, and a
row-parallel layer's reduce-scatter splits it again.

>>> mesh = Mesh2D(tp=2, cp=2)
>>> mesh.tp_groups, mesh.cp_groups, mesh.coords(3)
([[0, 1], [2, 3]], [[0, 2], [1, 3]], (1, 1))
>>> mesh.positions(8)
[[0, 1], [6, 7], [2, 3], [4, 5]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from xla_permute.backends.select import get_backend
from xla_permute.pairs import check_dim, check_int
from xla_permute.sequence import check_layout, shard_sequence, unshard_sequence

__all__ = ["Mesh2D"]


@dataclass(frozen=True)
class Mesh2D:
    """``tp * cp`` ranks as a TP x CP grid (module docstring). Pure Python: build it anywhere.

    Args:
        tp: ranks per tensor-parallel group (weights sharded over them).
        cp: ranks per context-parallel group (the sequence split over them).
    """

    tp: int
    cp: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "tp", check_int(self.tp, "tp", 1))
        object.__setattr__(self, "cp", check_int(self.cp, "cp", 1))

    @property
    def size(self) -> int:
        """The number of ranks, ``tp * cp``."""
        return self.tp * self.cp

    def rank(self, tp_index: int, cp_index: int) -> int:
        """The global rank at ``(tp_index, cp_index)``: ``cp_index * tp + tp_index``."""
        for value, name, top in ((tp_index, "tp_index", self.tp), (cp_index, "cp_index", self.cp)):
            check_int(value, name, 0, top)
        return cp_index * self.tp + tp_index

    def coords(self, rank: int | None = None) -> tuple[int, int]:
        """``(tp_index, cp_index)`` of ``rank``; None: this rank, asked from the running mesh
        (torch_xla, or torch.distributed's process group), whose size must be ``size``."""
        if rank is None:
            comm = get_backend()
            world = comm.world_size()
            if world != self.size:
                raise ValueError(
                    f"{self!r} has {self.size} ranks but this run has {world}; choose tp * cp "
                    f"= {world}"
                )
            rank = comm.rank()
        check_int(rank, "rank", 0, self.size)
        return rank % self.tp, rank // self.tp

    @property
    def tp_groups(self) -> list[list[int]]:
        """The ranks that shard the weights among them, one group per CP index."""
        return [[self.rank(t, c) for t in range(self.tp)] for c in range(self.cp)]

    @property
    def cp_groups(self) -> list[list[int]]:
        """The ranks that hold the same weight shard and split the sequence (ring
        attention's rings), in CP order, one group per TP index."""
        return [[self.rank(t, c) for c in range(self.cp)] for t in range(self.tp)]

    def shard_sequence(self, x: torch.Tensor, *, dim: int, layout: str = "zigzag") -> torch.Tensor:
        """Two-level sharding of ``x`` along ``dim``: ``[size, *shard_shape]``, by global rank.

        Rank ``(t, c)`` holds the ``t``-th of ``tp`` contiguous pieces of CP shard ``c``
        (:func:`~xla_permute.sequence.shard_sequence` over ``cp`` ranks in ``layout``).
        ``x.shape[dim]`` must divide by ``cp * tp`` (contiguous) or ``2 * cp * tp`` (zigzag).
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_layout(layout)
        dim = check_dim(dim, x.shape)
        need = self.size * (2 if layout == "zigzag" else 1)
        if x.shape[dim] % need:
            raise ValueError(
                f"x.shape[{dim}] = {x.shape[dim]} is not divisible by {need} (cp * tp"
                f"{' * 2 for the zigzag layout' if layout == 'zigzag' else ''} = {need} for "
                f"{self!r}); pad the sequence to a multiple of {need}"
            )
        cp_shards = shard_sequence(x, dim=dim, n=self.cp, layout=layout)
        pieces = [shard_sequence(shard, dim=dim, n=self.tp) for shard in cp_shards]
        return torch.cat(pieces)

    def unshard_sequence(
        self, shards: torch.Tensor | Sequence[torch.Tensor], *, dim: int, layout: str = "zigzag"
    ) -> torch.Tensor:
        """Inverse of :meth:`shard_sequence`: ``shards[r]`` by global rank -> the whole ``x``
        (``dim`` counts in a shard's dimensions)."""
        per_rank = list(shards)
        if len(per_rank) != self.size:
            raise ValueError(f"{self!r} has {self.size} ranks, got {len(per_rank)} shards")
        cp_shards = [
            unshard_sequence(per_rank[c * self.tp : (c + 1) * self.tp], dim=dim)
            for c in range(self.cp)
        ]
        return unshard_sequence(cp_shards, dim=dim, layout=layout)

    def positions(self, seq_len: int, *, layout: str = "zigzag") -> list[list[int]]:
        """The token positions each rank holds under :meth:`shard_sequence`, by global rank."""
        check_int(seq_len, "seq_len", 0)
        return self.shard_sequence(torch.arange(seq_len), dim=0, layout=layout).tolist()
