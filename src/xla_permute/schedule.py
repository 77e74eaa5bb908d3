"""Ring schedules of collective matmul and ring attention, as data: what each rank works on at
each step.

The matmul code in :mod:`xla_permute.matmul` iterates over these schedules, and the docs draw
them, so the figure is the schedule that runs.

All-gather-matmul: every rank must multiply every rank's x block. Unidirectional: at step ``t``
rank ``r`` holds the block of rank ``r - t`` (mod N), multiplies it and, unless it is the last
step, passes it on to ``r + 1``: N steps, N-1 permutes. Bidirectional: blocks also travel to
``r - 1``; at step ``t`` rank ``r`` holds the blocks of ``r - t`` and ``r + t``: ``N//2 + 1``
steps, still N-1 permutes (``N//2`` one way, ``(N-1)//2`` the other), odd N included.

Matmul-reduce-scatter: the partial sums of block ``b`` travel and collect one contribution per
rank, arriving at rank ``b`` last. Unidirectional: at step ``t`` rank ``r`` adds its contribution
to block ``r - t - 1`` (mod N) and passes the sum on; bidirectional: one sum travels each way and
the two meet at their block.

>>> [s.blocks for s in all_gather_schedule(4, rank=1)]
[(1,), (0,), (3,), (2,)]
>>> [(s.blocks, s.sends) for s in all_gather_schedule(4, rank=1, bidirectional=True)]
[((1,), (1, -1)), ((0, 2), (1,)), ((3,), ())]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from xla_permute.pairs import check_int
from xla_permute.sequence import layout_chunks

__all__ = [
    "AttentionBlock",
    "AttentionHop",
    "RingStep",
    "all_gather_schedule",
    "reduce_scatter_schedule",
    "ring_attention_schedule",
    "ring_steps",
    "schedule_work",
]


@dataclass(frozen=True)
class RingStep:
    """One step on one rank.

    ``blocks``: the block ids this rank multiplies at this step, one per direction (``+1``
    first). For all-gather-matmul a block id is the rank whose x block is multiplied; for
    matmul-reduce-scatter it is the output block whose partial sum gets this rank's
    contribution. ``sends``: the directions (``+1`` = to rank r+1, ``-1`` = to r-1) of the
    permutes issued at this step; they carry this step's blocks (or sums) to the next step and
    are not inputs of this step's matmuls.
    """

    step: int
    blocks: tuple[int, ...]
    sends: tuple[int, ...]


def ring_steps(n: int, bidirectional: bool) -> tuple[int, int]:
    """Hops travelled in the ``+1`` and ``-1`` directions: ``(N-1, 0)`` or ``(N//2, (N-1)//2)``."""
    n = check_int(n, "n", 1)
    return (n // 2, (n - 1) // 2) if bidirectional else (n - 1, 0)


def all_gather_schedule(n: int, rank: int, bidirectional: bool = False) -> list[RingStep]:
    """The all-gather-matmul schedule of ``rank`` on a ring of ``n`` ranks."""
    up, down = ring_steps(n, bidirectional)
    steps = []
    for t in range(up + 1):
        blocks = [(rank - t) % n]
        if 0 < t <= down:
            blocks.append((rank + t) % n)
        sends = [d for d, hops in ((1, up), (-1, down)) if t < hops]
        steps.append(RingStep(t, tuple(blocks), tuple(sends)))
    return steps


def reduce_scatter_schedule(n: int, rank: int, bidirectional: bool = False) -> list[RingStep]:
    """The matmul-reduce-scatter schedule of ``rank`` on a ring of ``n`` ranks.

    The sum travelling ``+1`` that ends at block ``b`` starts on rank ``b - up`` and the one
    travelling ``-1`` on rank ``b + down``; at the last step rank ``r`` adds its own
    contribution to block ``r`` (listed once).

    >>> [s.blocks for s in reduce_scatter_schedule(4, rank=0)]
    [(3,), (2,), (1,), (0,)]
    """
    up, down = ring_steps(n, bidirectional)
    steps = []
    for t in range(up + 1):
        blocks = [(rank + up - t) % n]
        if t < down:
            blocks.append((rank - down + t) % n)
        sends = [d for d, hops in ((1, up), (-1, down)) if t < hops]
        steps.append(RingStep(t, tuple(blocks), tuple(sends)))
    return steps


# --------------------------------------------------------------------------- ring attention


class AttentionBlock(NamedTuple):
    """One attention block: query chunks x key chunks (global chunk ids), masked or not.

    ``causal=True`` only for a diagonal block (one chunk against itself): the causal mask
    applies inside it. Chunk ids count ``N`` chunks (contiguous) or ``2N`` (zigzag).
    """

    q_chunks: tuple[int, ...]
    k_chunks: tuple[int, ...]
    causal: bool


class AttentionHop(NamedTuple):
    """Hop ``hop`` on one rank: it holds the K/V of rank ``source`` and computes ``blocks``."""

    hop: int
    source: int
    blocks: tuple[AttentionBlock, ...]


def _causal_blocks(own: tuple[int, ...], theirs: tuple[int, ...]) -> tuple[AttentionBlock, ...]:
    full = {i: tuple(j for j in theirs if j < i) for i in own}
    if all(len(full[i]) == len(theirs) for i in own):
        return (AttentionBlock(own, theirs, False),)
    by_keys: dict[tuple[int, ...], list[int]] = {}
    for i in own:
        if full[i]:
            by_keys.setdefault(full[i], []).append(i)
    blocks = [AttentionBlock(tuple(qs), ks, False) for ks, qs in by_keys.items()]
    return tuple(blocks + [AttentionBlock((i,), (i,), True) for i in own if i in theirs])


def ring_attention_schedule(
    n: int, rank: int, *, causal: bool = False, layout: str = "contiguous"
) -> tuple[AttentionHop, ...]:
    """What ``rank`` of ``n`` computes at each of the N hops (K/V moves to rank r+1 per hop).

    >>> [len(h.blocks) for h in ring_attention_schedule(4, 0, causal=True)]   # rank 0 idles
    [1, 0, 0, 0]
    >>> ring_attention_schedule(2, 0, causal=True, layout="zigzag")[1].blocks
    (AttentionBlock(q_chunks=(3,), k_chunks=(1, 2), causal=False),)
    """
    check_int(n, "n (the number of ranks)", 1)
    check_int(rank, "rank", 0, n)
    own = layout_chunks(n, rank, layout)
    hops = []
    for t in range(n):
        source = (rank - t) % n
        theirs = layout_chunks(n, source, layout)
        blocks = _causal_blocks(own, theirs) if causal else (AttentionBlock(own, theirs, False),)
        hops.append(AttentionHop(t, source, blocks))
    return tuple(hops)


def schedule_work(schedule: Sequence[AttentionHop]) -> list[float]:
    """Work per hop in chunk-pair units (a diagonal block counts one half).

    >>> [schedule_work(ring_attention_schedule(4, r, causal=True)) for r in (0, 3)]
    [[0.5, 0, 0, 0], [0.5, 1, 1, 1]]
    """
    return [
        sum(len(b.q_chunks) * len(b.k_chunks) * (0.5 if b.causal else 1) for b in h.blocks)
        for h in schedule
    ]
