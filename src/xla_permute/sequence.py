"""Split a batch along its sequence and put it back: the layouts of context parallelism.

Pure torch, on the host. A sequence of length ``S`` over ``n`` ranks:

* ``"contiguous"``: rank ``r`` holds chunk ``r`` of ``n`` equal chunks;
* ``"zigzag"`` (head-tail): the sequence is cut into ``2n`` chunks and rank ``r`` holds chunks
  ``r`` and ``2n-1-r``, in that order. Under a causal mask every rank then has the same work
  (an early chunk, cheap, and a late one, expensive).

The shards come as a *virtual mesh* tensor: leading axis the rank, ``shards[r]`` what rank
``r`` holds (as :mod:`xla_permute.reference` uses).

>>> x = torch.arange(8)
>>> shard_sequence(x, dim=0, n=2, layout="zigzag").tolist()
[[0, 1, 6, 7], [2, 3, 4, 5]]
>>> unshard_sequence(shard_sequence(x, dim=0, n=2, layout="zigzag"), dim=0, layout="zigzag")
tensor([0, 1, 2, 3, 4, 5, 6, 7])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from xla_permute.pairs import check_dim, check_int

__all__ = ["LAYOUTS", "layout_chunks", "layout_positions", "shard_sequence", "unshard_sequence"]

LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    """Return ``layout`` if it is a known layout name, else raise ValueError naming the choices."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout  # type: ignore[return-value]


def layout_chunks(n: int, rank: int, layout: str) -> tuple[int, ...]:
    """The global chunk ids rank ``rank`` of ``n`` holds, in local order (of ``n`` chunks for
    ``"contiguous"``, ``2n`` for ``"zigzag"``).

    >>> layout_chunks(4, 1, "contiguous"), layout_chunks(4, 1, "zigzag")
    ((1,), (1, 6))
    """
    check_layout(layout)
    return (rank,) if layout == "contiguous" else (rank, 2 * n - 1 - rank)


def layout_positions(n: int, rank: int, layout: str, length: int) -> torch.Tensor:
    """The global positions of the ``length`` tokens rank ``rank`` of ``n`` holds, in order.

    >>> layout_positions(2, 1, "zigzag", 4).tolist()
    [2, 3, 4, 5]
    """
    chunks = layout_chunks(n, rank, layout)
    size = length // len(chunks)
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def shard_sequence(
    x: torch.Tensor, *, dim: int, n: int, layout: str = "contiguous"
) -> torch.Tensor:
    """Split ``x`` along ``dim`` into ``n`` shards in ``layout``; returns ``[n, *shard_shape]``.
    ``x.shape[dim]`` must divide by ``n`` (``"contiguous"``) or ``2n`` (``"zigzag"``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_int(n, "n (the number of ranks)", 1)
    check_layout(layout)
    dim = check_dim(dim, x.shape)
    chunks = n if layout == "contiguous" else 2 * n
    if x.shape[dim] % chunks:
        raise ValueError(
            f"x.shape[{dim}] = {x.shape[dim]} is not divisible by {chunks} "
            f"({'n' if layout == 'contiguous' else '2n'} chunks for layout={layout!r}, n={n}); "
            f"pad the sequence to a multiple of {chunks}"
        )
    pieces = x.chunk(chunks, dim=dim) if x.shape[dim] else [x] * chunks
    per_rank = [torch.cat([pieces[c] for c in layout_chunks(n, r, layout)], dim) for r in range(n)]
    return torch.stack(per_rank)


def unshard_sequence(
    shards: torch.Tensor | Sequence[torch.Tensor], *, dim: int, layout: str = "contiguous"
) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: ``shards[r]`` per rank -> the whole ``x``.

    ``shards`` is a virtual mesh tensor ``[n, ...]`` or a list of per-rank tensors (what
    :func:`xla_permute.run_on_mesh` returns); ``dim`` counts in a shard's dimensions.
    """
    if isinstance(shards, torch.Tensor):
        if shards.dim() < 1:
            raise ValueError("shards must have a leading rank axis; got a 0-d tensor")
        per_rank = list(shards)
    elif (
        isinstance(shards, Sequence) and shards and all(isinstance(s, torch.Tensor) for s in shards)
    ):
        per_rank = list(shards)
        if len({tuple(s.shape) for s in per_rank}) > 1:
            raise ValueError(
                f"shards have different shapes {[tuple(s.shape) for s in per_rank]}; "
                f"every rank holds an equal shard"
            )
    else:
        raise TypeError("shards must be a tensor [n, ...] or a non-empty list of tensors")
    check_layout(layout)
    n = len(per_rank)
    dim = check_dim(dim, per_rank[0].shape, "a shard")
    if layout == "contiguous":
        return torch.cat(per_rank, dim)
    if per_rank[0].shape[dim] % 2:
        raise ValueError(
            f"a zigzag shard holds two equal chunks, but its dim {dim} has odd length "
            f"{per_rank[0].shape[dim]}"
        )
    pieces: list[torch.Tensor | None] = [None] * (2 * n)
    for r, shard in enumerate(per_rank):
        head, tail = shard.chunk(2, dim) if shard.shape[dim] else (shard, shard)
        pieces[r], pieces[2 * n - 1 - r] = head, tail
    return torch.cat(pieces, dim)  # type: ignore[arg-type]
