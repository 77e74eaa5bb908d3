"""The rings of collective matmul: the forward and backward of :mod:`xla_permute.matmul`.

The public ops (argument checks, the boundary, the baselines) are in :mod:`xla_permute.matmul`;
this module holds what they run once the inputs are checked: every rank's block passed round
the ring (``_stream``), the two rings (all-gather-matmul writing each product into its rows of
the output, matmul-reduce-scatter adding partial sums as they travel), the weight gradients
streamed round the ring once more, and the autograd function over them (``_RingMatmul``).

Reads of x wait for the data before them (``_take``, ``_zero_after``): XLA:CPU, free to
schedule reads of a parameter, would otherwise copy all N blocks of x before the first matmul.
Matmul-reduce-scatter reads each block in row slices at most half the partial sum they add to
(``_row_slices``). The partial sums travel in :func:`~xla_permute.reference.accumulation_dtype`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from xla_permute.backends.select import Handle, Ring
from xla_permute.reference import accumulation_dtype
from xla_permute.schedule import all_gather_schedule, reduce_scatter_schedule


def _block(t: torch.Tensor, index: int, n: int, dim: int) -> torch.Tensor:
    """Block ``index`` of ``n`` equal blocks of ``t`` along ``dim`` (``narrow``: one slice)."""
    size = t.shape[dim] // n
    return t.narrow(dim, index * size, size)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Merge every dimension but the last: ``[..., c] -> [rows, c]``."""
    return t.reshape(-1, t.shape[-1])


def _zero_after(t: torch.Tensor) -> torch.Tensor:
    """An int64 zero computed from ``t``'s last element (finite or not): added to an index,
    it makes a read wait for ``t``. XLA folds no float ``* 0``; the last element depends on
    the last part written (a concatenate's last chunk, a sum's newest term)."""
    zero = t.reshape(-1)[-1] * 0  # +-0, or NaN where the element is not finite
    return torch.where(zero == 0, zero, torch.zeros_like(zero)).to(torch.int64)


def _take(
    t: torch.Tensor, dim: int, count: int, index: int | torch.Tensor, after: Any = None
) -> torch.Tensor:
    """Piece ``index`` of ``count`` equal pieces of ``t`` along ``dim``.

    ``index``: an int, or an int64 0-dim tensor on ``t``'s device (computed from this rank's
    position, so that every rank traces one program). ``after``: a tensor the read waits for.
    XLA:CPU drops optimisation barriers before it schedules, and schedules every slice of a
    parameter at the start: the N row blocks of x, all alive at once. An index computed from
    ``after``'s data is a dependency it keeps, so each piece is read (copied) only when the one
    before it has been used.
    """
    size = t.shape[dim] // count
    if isinstance(index, int) and after is None:
        return t.narrow(dim, index * size, size)
    if isinstance(index, int):
        index = torch.tensor(index).to(t.device)
    if after is not None:
        index = index + _zero_after(after)
    return t.unflatten(dim, (count, size)).index_select(dim, index.reshape(1)).squeeze(dim)


def _position(ring: Ring, t: torch.Tensor) -> int | torch.Tensor:
    """This rank's position: device data on an XLA device (one program for every rank)."""
    if t.device.type != "xla":
        return ring.position
    return torch.tensor(ring.position, dtype=torch.int64).to(t.device)


def _stream(
    block: torch.Tensor,
    ring: Ring,
    visit: Callable[[int, torch.Tensor, int], None],
    dim: int = 0,
    chunks: int = 1,
) -> None:
    """Pass every rank's ``block`` around the ring; call ``visit(source_position, piece, j)``
    on each, ``piece`` the chunk ``j`` of ``chunks`` along ``dim`` (the whole block for 1).

    The chunks go round one after another: chunk ``j + 1`` is read once chunk ``j`` has
    arrived at its last hop, so a rank holds two chunks (worked on, in flight), not two blocks.
    The permutes of a step are issued before that step's visits and carry the pieces the
    visits use; no visit depends on a permute of its own step. They are waited for after the
    visits (on c10d the transfer runs during them).
    """
    last = None
    for j in range(chunks):
        xla = block.device.type == "xla"
        piece = block if chunks == 1 else _take(block, dim, chunks, j, last if xla else None)
        held = {1: piece, -1: piece}
        for step in all_gather_schedule(ring.size, ring.position, ring.bidirectional):
            in_flight = {d: ring.send(held[d], d) for d in step.sends}
            for direction, source in zip((1, -1), step.blocks, strict=False):
                visit(source, held[direction], j)
            held.update({d: handle.wait() for d, handle in in_flight.items()})
        last = held[1]


def _ring_all_gather_matmul(
    x: torch.Tensor, ws: Sequence[torch.Tensor], dim: int, ring: Ring, chunks: int = 1
) -> list[torch.Tensor]:
    n, m = ring.size, x.shape[dim]
    size = m // chunks
    new = x.new_empty if ring.backend.eager else x.new_zeros  # eager: every row is written
    outs = [new(*x.shape[:dim], n * m, *x.shape[dim + 1 : -1], w.shape[1]) for w in ws]
    # Each product goes straight into its rows of the output (a scatter), so that it dies after
    # its dot; a slice_scatter chain or a concatenate is fused by XLA into one op at the end,
    # which keeps all N products alive. The rows are computed on the device from this rank's
    # position (device data) and the step's offset (the same on every rank): every rank traces
    # the same program, so the ranks share one compile and none arrives late at a rendezvous.
    position = torch.tensor(ring.position, dtype=torch.int64).to(x.device)
    rows = torch.arange(size, device=x.device)

    def multiply(source: int, x_piece: torch.Tensor, j: int) -> None:
        offset = (source - ring.position) % n  # rank-independent
        index = rows + (((position + offset) % n) * m + j * size)
        for i, w in enumerate(ws):
            if ring.backend.eager:  # c10d: rows written in place (no traced program to share)
                start = ((ring.position + offset) % n) * m + j * size
                rows_ = outs[i].narrow(dim, start, size)
                if rows_.is_contiguous() and x_piece.dim() == 2:
                    torch.mm(x_piece, w, out=rows_)  # straight into the output: no copy
                else:
                    rows_.copy_(x_piece @ w)
            else:
                outs[i] = outs[i].index_copy(dim, index, x_piece @ w)

    _stream(x, ring, multiply, dim, chunks)
    return outs


def _row_slices(
    x: torch.Tensor, ws: Sequence[torch.Tensor], dim: int, n: int, acc: torch.dtype
) -> int:
    """How many row slices matmul-reduce-scatter reads each x block in: the fewest (a
    divisor of the block's rows) whose slice of x is at most half the partial sum it adds to
    (the bidirectional ring reads two at once). 1 whenever ``sum F >= 2 K`` in equal dtypes;
    one row per slice when no divisor is fine enough. (Not the ``chunks=`` of
    all-gather-matmul, the pieces a block travels in.)

    >>> x = torch.zeros(4 * 1024, 4096)
    >>> _row_slices(x, [torch.zeros(4096, 256)], 0, 4, torch.float32)
    32
    >>> _row_slices(torch.zeros(4 * 2, 6), [torch.zeros(6, 5)], 0, 4, torch.float32)
    2
    """
    m = x.shape[dim] // n
    piece = x.shape[-1] * x.element_size()  # bytes of x per row
    summed = sum(w.shape[1] for w in ws) * acc.itemsize  # bytes of the partial sum per row
    fits = (c for c in range(1, m + 1) if m % c == 0 and 2 * piece <= summed * c)
    return next(fits, max(m, 1))  # none fits (K much larger than F): one row at a time


def _ring_matmul_reduce_scatter(
    x: torch.Tensor | Sequence[torch.Tensor],
    ws: Sequence[torch.Tensor],
    dim: int,
    ring: Ring,
    acc: torch.dtype | None,
) -> torch.Tensor:
    """``ReduceScatter(sum_i x_i @ ws[i])``: with one x, ``x_i = x``; with a list, one each.

    Each block of x is read in :func:`_row_slices` slices, each read waiting (``_take``) for
    the product before it, and a step's first read for the previous step's sum in its
    direction: x is never copied whole, and the matmuls of step t wait for no permute issued
    after step t-2 (the sum they will be added to waits for step t-1's).
    """
    xs = list(x) if isinstance(x, (list, tuple)) else [x] * len(ws)
    n = ring.size
    acc = acc or xs[0].dtype  # None (all-gather-matmul's backward): the input's dtype
    slices = _row_slices(xs[0], ws, dim, n, acc)
    xla = xs[0].device.type == "xla"
    position = _position(ring, xs[0])
    w_acc = [w.to(acc) for w in ws]
    received: dict[int, Handle] = {}  # the latest sums in flight to this rank, per direction
    summed: dict[int, torch.Tensor] = {}
    last: dict[int, Any] = {}  # per direction: what its next read of x waits for (XLA)
    for step in reduce_scatter_schedule(n, ring.position, ring.bidirectional):
        for direction, block in zip((1, -1), step.blocks, strict=False):
            index = (position + (block - ring.position) % n) % n * slices  # rank-independent
            parts = []
            for _ in range(slices):
                partial = None
                for xi, w in zip(xs, w_acc, strict=True):
                    after = last.get(direction) if xla else None
                    term = _take(xi, dim, n * slices, index, after).to(acc) @ w
                    partial = term if partial is None else partial + term
                    last[direction] = term
                parts.append(partial)
                index = index + 1  # no new constant per chunk
            partial = parts[0] if slices == 1 else torch.cat(parts, dim)
            got = received.get(direction)
            summed[direction] = got.wait() + partial if got is not None else partial
            last[direction] = summed[direction]
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
