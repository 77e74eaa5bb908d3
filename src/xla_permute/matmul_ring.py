"""The rings of collective matmul: their schedules as data, and the forward and backward that
run them (the public ops, their checks and baselines are in :mod:`xla_permute.matmul`).

All-gather-matmul: every rank must multiply every rank's x block. Unidirectional: at step ``t``
rank ``r`` holds the block of rank ``r - t`` (mod N), multiplies it and, unless it is the last
step, passes it on to ``r + 1``: N steps, N-1 permutes. Bidirectional: blocks also travel to
``r - 1``; at step ``t`` rank ``r`` holds the blocks of ``r - t`` and ``r + t``: ``N//2 + 1``
steps, still N-1 permutes (``N//2`` one way, ``(N-1)//2`` the other), odd N included.

Matmul-reduce-scatter: the partial sums of block ``b`` travel and collect one contribution per
rank, arriving at rank ``b`` last. Unidirectional: at step ``t`` rank ``r`` adds its contribution
to block ``r - t - 1`` (mod N) and passes the sum on; bidirectional: one sum travels each way and
the two meet at their block. The partial sums travel in
:func:`~xla_permute.reference.accumulation_dtype`.

The rings iterate over these schedules, the docs draw them. What the rings do besides the
pages' loops (tutorial 03) is in the last section: XLA:CPU's read ordering, the eager writes.

>>> [s.blocks for s in all_gather_schedule(4, rank=1)]
[(1,), (0,), (3,), (2,)]
>>> [(s.blocks, s.sends) for s in all_gather_schedule(4, rank=1, bidirectional=True)]
[((1,), (1, -1)), ((0, 2), (1,)), ((3,), ())]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xla_permute.backends.select import Handle, Ring
from xla_permute.pairs import check_int
from xla_permute.reference import accumulation_dtype

__all__ = ["RingStep", "all_gather_schedule", "reduce_scatter_schedule", "ring_steps"]


@dataclass(frozen=True)
class RingStep:
    """One step on one rank.

    ``blocks``: the block ids this rank multiplies at this step, one per direction (``+1``
    first): the rank whose x block is multiplied (all-gather-matmul), or the output block whose
    partial sum gets this rank's contribution (matmul-reduce-scatter). ``sends``: the
    directions (``+1`` = to rank r+1) of the permutes issued at this step, for the next step.
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


def _stream(
    block: torch.Tensor,
    ring: Ring,
    visit: Callable[[int, torch.Tensor, int], None],
    dim: int = 0,
    chunks: int = 1,
) -> None:
    """Hand every rank's ``block`` (``[..., m, ...]`` per rank, ``m`` at ``dim``) to ``visit``,
    as this does, but without ever holding the gathered blocks::

        gathered = AllGather(block, dim).chunk(ring.size, dim)  # by position in the ring
        for j in range(chunks):
            for step in all_gather_schedule(ring.size, ring.position, ring.bidirectional):
                for source in step.blocks:
                    visit(source, gathered[source].chunk(chunks, dim)[j], j)

    Chunk ``j + 1`` is read once chunk ``j`` has arrived at its last hop, so a rank holds two
    chunks (worked on, in flight), not two blocks. A step's permutes are issued before its
    visits and carry the pieces the next step visits; they are waited for after the visits
    (on c10d the transfer runs during them), so no visit depends on a permute of its step.
    """
    reads = _Reads(block)
    for j in range(chunks):
        piece = block if chunks == 1 else reads.read(block, dim, chunks, j, "chunk")
        held = {1: piece, -1: piece}
        for step in all_gather_schedule(ring.size, ring.position, ring.bidirectional):
            in_flight = {d: ring.send(held[d], d) for d in step.sends}
            for direction, source in zip((1, -1), step.blocks, strict=False):
                visit(source, held[direction], j)
            held.update({d: handle.wait() for d, handle in in_flight.items()})
        reads.after("chunk", held[1])


def _ring_all_gather_matmul(
    x: torch.Tensor, ws: Sequence[torch.Tensor], dim: int, ring: Ring, chunks: int = 1
) -> list[torch.Tensor]:
    """``[AllGather(x, dim) @ w for w in ws]``: each product written into its rows of the
    output as soon as it is made (:func:`_write`), so that it dies after its dot."""
    n, m = ring.size, x.shape[dim]
    outs = [x.new_zeros(*x.shape[:dim], n * m, *x.shape[dim + 1 : -1], w.shape[1]) for w in ws]
    position = _position(ring, x)

    def multiply(source: int, x_piece: torch.Tensor, j: int) -> None:
        offset = (source - ring.position) % n  # rank-independent: position holds the rank
        start = (position + offset) % n * m + j * (m // chunks)  # block `source`, chunk j
        for i, w in enumerate(ws):
            outs[i] = _write(outs[i], dim, start, x_piece @ w)

    _stream(x, ring, multiply, dim, chunks)
    return outs


def _ring_matmul_reduce_scatter(
    x: torch.Tensor | Sequence[torch.Tensor],
    ws: Sequence[torch.Tensor],
    dim: int,
    ring: Ring,
    acc: torch.dtype | None,
) -> torch.Tensor:
    """``ReduceScatter(sum_i x_i @ ws[i], dim)``: with one x, ``x_i = x``; with a list, one
    each. At each step a rank adds its share of a block to the sum it received and passes it
    on; the sum of block ``r`` arrives at rank ``r`` last, complete."""
    xs = list(x) if isinstance(x, (list, tuple)) else [x] * len(ws)
    acc = acc or xs[0].dtype  # None (all-gather-matmul's backward): the input's dtype
    share = _Shares(xs, ws, dim, ring, acc)
    received: dict[int, Handle] = {}  # the latest sums in flight to this rank, per direction
    summed: dict[int, torch.Tensor] = {}
    for step in reduce_scatter_schedule(ring.size, ring.position, ring.bidirectional):
        for direction, block in zip((1, -1), step.blocks, strict=False):
            mine = share(block, direction)  # sum_i x_i's block @ ws[i], on this rank
            got = received.get(direction)
            summed[direction] = got.wait() + mine if got is not None else mine
            share.after(direction, summed[direction])
        for d in step.sends:  # carries this step's sums; overlaps the next step's matmuls
            received[d] = ring.send(summed[d], d)
    out = summed[1] + received[-1].wait() if -1 in received else summed[1]
    return out.to(xs[0].dtype)


def _stream_weight_grad(
    streamed: torch.Tensor,
    locals_: Sequence[torch.Tensor],
    dim: int,
    streamed_is_lhs: bool,
    ring: Ring,
    out_dtype: torch.dtype,
    chunks: int = 1,
) -> list[torch.Tensor]:
    """``sum_b lhs_b.T @ rhs_b`` for each of ``locals_``: one operand streamed round the ring
    (in ``chunks`` chunks), the other local, whose block ``b`` along ``dim`` pairs with the
    block from position ``b``."""
    acc_dtype = accumulation_dtype(out_dtype)
    sums: list[torch.Tensor | None] = [None] * len(locals_)

    def accumulate(source: int, held: torch.Tensor, j: int) -> None:
        for i, local in enumerate(locals_):
            mine = _block(_block(local, source, ring.size, dim), j, chunks, dim)
            lhs, rhs = (held, mine) if streamed_is_lhs else (mine, held)
            term = _rows(lhs).to(acc_dtype).T @ _rows(rhs).to(acc_dtype)
            sums[i] = term if sums[i] is None else sums[i] + term

    _stream(streamed, ring, accumulate, dim, chunks)
    return [s.to(out_dtype) for s in sums]


class _RingMatmul(torch.autograd.Function):
    """Both collective matmuls: ``gather=True`` is all-gather-matmul (any number of weights),
    ``False`` matmul-reduce-scatter (one weight).

    Each one's backward for x is the other ring; for w it streams the sharded operand (x for
    all-gather-matmul, dy for matmul-reduce-scatter) round the ring once more.
    """

    @staticmethod
    def forward(ctx: Any, meta: tuple, x: torch.Tensor, *ws: torch.Tensor) -> Any:
        dim, ring, gather, acc, chunks = meta
        ctx.save_for_backward(x, *ws)
        ctx.meta = meta
        if gather:
            return tuple(_ring_all_gather_matmul(x, ws, dim, ring, chunks))
        return _ring_matmul_reduce_scatter(x, ws, dim, ring, acc)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *dys: torch.Tensor):
        x, *ws = ctx.saved_tensors
        dim, ring, gather, acc, chunks = ctx.meta
        dys = [dy.contiguous() for dy in dys]  # an unused output's gradient comes as zeros
        if gather:
            dx = _ring_matmul_reduce_scatter(dys, [w.T for w in ws], dim, ring, acc)
            dws = _stream_weight_grad(x, dys, dim, True, ring, ws[0].dtype, chunks)
        else:
            (dy,) = dys
            (dx,) = _ring_all_gather_matmul(dy, [ws[0].T], dim, ring)
            dws = _stream_weight_grad(dy, [x], dim, False, ring, ws[0].dtype)
        return None, dx, *dws


def _block(t: torch.Tensor, index: int, n: int, dim: int) -> torch.Tensor:
    """Block ``index`` of ``n`` equal blocks of ``t`` along ``dim`` (``narrow``: one slice)."""
    size = t.shape[dim] // n
    return t.narrow(dim, index * size, size)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Merge every dimension but the last: ``[..., c] -> [rows, c]``."""
    return t.reshape(-1, t.shape[-1])


# --------------------------------------------------------------------------------------------
# XLA:CPU's read ordering, and the eager writes: all the rings do beyond the pages' loops.
#
# On XLA every rank traces one program (one compile; none arrives late at a rendezvous), so
# the rows a ring reads or writes are computed on the device, from this rank's position as
# device data (`_position`) plus an offset that is the same on every rank. XLA:CPU drops
# optimisation barriers before it schedules, and schedules every slice of a parameter at its
# start: x cut into its N blocks would have all N copied before the first matmul (1.74x the
# baseline's memory at N=4, tutorial 16). So a read of x (`_Reads`) adds to its index a zero
# computed from the data it must wait for, a dependency XLA keeps; and matmul-reduce-scatter
# reads a block in row slices at most half the partial sum they add to (`_Shares`).
# All-gather-matmul writes each product into its rows of the output (`_write`): on XLA an
# index_copy (a slice_scatter chain or one concatenate would be fused into one op at the end,
# keeping all N products alive); eagerly (c10d, no traced program) in place.
# --------------------------------------------------------------------------------------------


def _position(ring: Ring, t: torch.Tensor) -> int | torch.Tensor:
    """This rank's position: device data on an XLA device (one program for every rank)."""
    if t.device.type != "xla":
        return ring.position
    return torch.tensor(ring.position, dtype=torch.int64).to(t.device)


def _zero_after(t: torch.Tensor) -> torch.Tensor:
    """An int64 zero computed from ``t``'s last element (finite or not): added to an index,
    it makes a read wait for ``t``. XLA folds no float ``* 0``; the last element depends on
    the last part written (a concatenate's last chunk, a sum's newest term)."""
    zero = t.reshape(-1)[-1] * 0  # +-0, or NaN where the element is not finite
    return torch.where(zero == 0, zero, torch.zeros_like(zero)).to(torch.int64)


class _Reads:
    """Reads of x's pieces, each waiting (on XLA) for what :meth:`after` last recorded under
    its ``key`` (a direction of the ring, say); eagerly a read is one ``narrow``."""

    def __init__(self, t: torch.Tensor) -> None:
        self.xla, self.last = t.device.type == "xla", {}  # key -> tensor to wait for

    def after(self, key: object, t: torch.Tensor) -> None:
        if self.xla:
            self.last[key] = t

    def read(
        self, t: torch.Tensor, dim: int, count: int, index: int | torch.Tensor, key: object
    ) -> torch.Tensor:
        """Piece ``index`` (an int, or an int64 0-dim tensor on ``t``'s device) of ``count``
        equal pieces of ``t`` along ``dim``."""
        size, after = t.shape[dim] // count, self.last.get(key)
        if isinstance(index, int) and after is None:
            return t.narrow(dim, index * size, size)
        if isinstance(index, int):
            index = torch.tensor(index).to(t.device)
        if after is not None:
            index = index + _zero_after(after)
        return t.unflatten(dim, (count, size)).index_select(dim, index.reshape(1)).squeeze(dim)


def _row_slices(
    x: torch.Tensor, ws: Sequence[torch.Tensor], dim: int, n: int, acc: torch.dtype
) -> int:
    """How many row slices matmul-reduce-scatter reads each x block in: the fewest (a
    divisor of the block's rows) whose slice of x is at most half the partial sum it adds to
    (the bidirectional ring reads two at once). 1 whenever ``sum F >= 2 K`` in equal dtypes;
    one row per slice when no divisor is fine enough.

    >>> _row_slices(torch.zeros(4 * 1024, 4096), [torch.zeros(4096, 256)], 0, 4, torch.float32)
    32
    """
    m = x.shape[dim] // n
    piece = x.shape[-1] * x.element_size()  # bytes of x per row
    summed = sum(w.shape[1] for w in ws) * acc.itemsize  # bytes of the partial sum per row
    fits = (c for c in range(1, m + 1) if m % c == 0 and 2 * piece <= summed * c)
    return next(fits, max(m, 1))  # none fits (K much larger than F): one row at a time


class _Shares(_Reads):
    """``share(block, direction)``: this rank's share of an output block, ``sum_i x_i's
    block @ ws[i]`` in ``acc``, read in :func:`_row_slices` slices, each read waiting (XLA)
    for the product before it, and a block's first read for what :meth:`after` recorded in
    its direction (the sum of the step before): x is never copied whole, and the matmuls of
    step t wait for no permute issued after step t-2."""

    def __init__(
        self,
        xs: list[torch.Tensor],
        ws: Sequence[torch.Tensor],
        dim: int,
        ring: Ring,
        acc: torch.dtype,
    ) -> None:
        super().__init__(xs[0])
        self.xs, self.dim, self.ring, self.acc = xs, dim, ring, acc
        self.slices = _row_slices(xs[0], ws, dim, ring.size, acc)
        self.position = _position(ring, xs[0])
        self.ws = [w.to(acc) for w in ws]

    def __call__(self, block: int, direction: int) -> torch.Tensor:
        n, slices = self.ring.size, self.slices
        index = (self.position + (block - self.ring.position) % n) % n * slices  # rank-independent
        parts = []
        for _ in range(slices):
            share = None
            for xi, w in zip(self.xs, self.ws, strict=True):
                term = self.read(xi, self.dim, n * slices, index, direction).to(self.acc) @ w
                self.after(direction, term)
                share = term if share is None else share + term
            parts.append(share)
            index = index + 1  # no new constant per slice
        return parts[0] if slices == 1 else torch.cat(parts, self.dim)


def _write(
    out: torch.Tensor, dim: int, start: int | torch.Tensor, product: torch.Tensor
) -> torch.Tensor:
    """``out`` with ``product`` in its rows ``start, start + 1, ...`` along ``dim``."""
    if isinstance(start, int):  # eager: in place
        out.narrow(dim, start, product.shape[dim]).copy_(product)
        return out
    rows = torch.arange(product.shape[dim], device=out.device) + start
    return out.index_copy(dim, rows, product)
