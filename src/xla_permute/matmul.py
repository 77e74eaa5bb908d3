"""Collective matmul: all-gather-matmul and matmul-reduce-scatter as rings of permutes.

Tensor parallelism multiplies a sharded activation by a sharded weight and needs a collective
before (all-gather) or after (reduce-scatter) the matmul. Decomposing the collective into N-1
CollectivePermutes lets every step's matmul run while the next block is in flight (Wang et al.,
ASPLOS 2023; JAX shard_map collective matmul; PyTorch async TP). The schedules are in
:mod:`xla_permute.schedule`.

Per-rank shapes (``N`` ranks of the group, ``dim`` the sharded dimension of x, never its last):

* :func:`all_gather_matmul`: ``x [..., m, K]`` and ``w [K, F]`` -> ``[..., N*m, F]``;
  ``y = AllGather(x, dim) @ w``. Several weights ``[w1, w2, ...]`` share one ring (x travels
  once) and give one result each (fused gate/up or QKV). Backward: ``dx = ReduceScatter(sum_i
  dy_i @ w_i.T, dim)`` (one matmul-reduce-scatter ring) and ``dw_i = AllGather(x, dim).T @
  dy_i`` with x streamed around the ring again, so the gathered x is never held.
* :func:`matmul_reduce_scatter`: ``x [..., N*m, K]`` and ``w [K, F]`` -> ``[..., m, F]``;
  ``y = ReduceScatter(x @ w, dim)`` (sum). Backward: ``dx = AllGather(dy, dim) @ w.T`` (an
  all-gather-matmul) and ``dw = x.T @ AllGather(dy, dim)`` with dy streamed around the ring.

``groups``: replica groups of equal size (:func:`~xla_permute.pairs.check_groups`); each group
is its own ring, visited in the order the group lists its ranks (block ``j`` is the shard of
the group's ``j``-th rank), as ``xm.all_gather`` orders a group. ``None``: one group of all
ranks. A group of one rank is a plain ``x @ w``.

Memory (XLA:CPU's buffer assignment, x an input of the program): all-gather-matmul writes
every product into its rows of a preallocated output (``index_copy``, rows computed on the
device so that every rank runs the same program) as soon as it is made, instead of one
concatenate of all N at the end: it holds about three x blocks (own, worked on, in flight)
plus w and the output; with ``chunks=c`` each block travels as c chunks, one chunk all the way
round before the next, and two chunks replace two of those blocks. Matmul-reduce-scatter reads
x in row chunks at most half the partial sum they add to, each read waiting for the data of
the product before it (``_take``): XLA:CPU, free to schedule reads of a parameter, would
otherwise copy all N blocks of x before the first matmul. It then holds x, w, one chunk and a
few partial sums: at most the baseline's x plus ``x @ w``.
Empty inputs (0 rows, ``K = 0``, ``F = 0``) give the empty (or zero) result without a
collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from xla_permute import collectives
from xla_permute.backend import CommBackend, Handle, Ring, check_tensor, ring
from xla_permute.permute import Backend
from xla_permute.schedule import all_gather_schedule, reduce_scatter_schedule

__all__ = [
    "all_gather_matmul",
    "all_gather_then_matmul",
    "matmul_reduce_scatter",
    "matmul_then_reduce_scatter",
    "partial_sum_dtype",
]

_HALF = (torch.bfloat16, torch.float16)
Groups = Sequence[Sequence[int]] | None
Weights = torch.Tensor | Sequence[torch.Tensor]


def partial_sum_dtype(dtype: torch.dtype, reduce_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype of the partial sums a reduce-scatter sends (and accumulates in).

    ``reduce_dtype`` if given, else float32 for half-precision inputs and ``dtype`` otherwise.
    The bench's byte accounting and the cost model use this same rule.

    >>> partial_sum_dtype(torch.bfloat16), partial_sum_dtype(torch.bfloat16, torch.bfloat16)
    (torch.float32, torch.bfloat16)
    """
    if reduce_dtype is None:
        return torch.float32 if dtype in _HALF else dtype
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise TypeError(
            f"reduce_dtype must be a floating torch.dtype such as torch.float32 or the input's "
            f"dtype, or None; got {reduce_dtype!r}"
        )
    return reduce_dtype


def _block(t: torch.Tensor, index: int, n: int, dim: int) -> torch.Tensor:
    """Block ``index`` of ``n`` equal blocks of ``t`` along ``dim`` (``narrow``: one slice)."""
    size = t.shape[dim] // n
    return t.narrow(dim, index * size, size)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Merge every dimension but the last: ``[..., c] -> [rows, c]``."""
    return t.reshape(-1, t.shape[-1])


def _as_weights(w: object, op: str) -> tuple[list[torch.Tensor], bool]:
    """``(weights, single)``: a tensor, or a non-empty list/tuple of tensors."""
    if isinstance(w, torch.Tensor):
        return [w], True
    if isinstance(w, (list, tuple)) and w:
        for i, t in enumerate(w):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"w[{i}] must be a torch.Tensor, got {type(t).__name__}")
        return list(w), False
    raise TypeError(f"{op}: w must be a tensor [K, F] or a non-empty list of them, got {w!r}")


def _check(
    x: torch.Tensor,
    ws: list[torch.Tensor],
    dim: int,
    op: str,
    sharded: bool,
    n: int,
    backend: CommBackend,
) -> int:
    """Validate the inputs of ``op`` and return ``dim`` normalised to be non-negative (``x``
    was checked against ``backend`` already)."""
    for i, w in enumerate(ws):
        name = "w" if len(ws) == 1 else f"w[{i}]"
        w = backend.check_tensor(w, name)
        if w.dim() != 2:
            raise ValueError(f"{op}: {name} must be 2-D [K, F], got shape {tuple(w.shape)}")
        if x.dim() < 2:
            raise ValueError(f"{op}: x must be at least 2-D [..., rows, K], got {tuple(x.shape)}")
        if x.dtype != w.dtype:
            raise TypeError(
                f"{op}: x is {x.dtype} but {name} is {w.dtype}; cast one of them, e.g. "
                f"{name}.to(x.dtype)"
            )
        if x.shape[-1] != w.shape[0]:
            raise ValueError(
                f"{op}: inner dimensions differ: x.shape[-1] = {x.shape[-1]} but {name}.shape[0]"
                f" = {w.shape[0]}; x [..., K] @ w [K, F] needs them equal"
            )
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim={dim!r} is not a dimension of x with shape {tuple(x.shape)}")
    dim %= x.dim()
    if dim == x.dim() - 1:
        raise ValueError(
            f"{op}: dim={dim} is the contracted (last) dimension of x; shard a row or sequence "
            f"dimension instead (e.g. dim=0 for [rows, K], dim=1 for [batch, seq, K])"
        )
    if sharded and x.shape[dim] % n:
        raise ValueError(
            f"{op}: x.shape[{dim}] = {x.shape[dim]} is not divisible by the {n} ranks; the "
            f"reduce-scatter gives every rank an equal block, so pad it to a multiple of {n}"
        )
    return dim


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


def _row_chunks(
    x: torch.Tensor, ws: Sequence[torch.Tensor], dim: int, n: int, acc: torch.dtype
) -> int:
    """How many row chunks matmul-reduce-scatter reads each x block in: the fewest (a
    divisor of the block's rows) whose chunk of x is at most half the partial sum it adds to
    (the bidirectional ring reads two at once). 1 whenever ``sum F >= 2 K`` in equal dtypes;
    one row per chunk when no divisor is fine enough.

    >>> x = torch.zeros(4 * 1024, 4096)
    >>> _row_chunks(x, [torch.zeros(4096, 256)], 0, 4, torch.float32)
    32
    >>> _row_chunks(torch.zeros(4 * 2, 6), [torch.zeros(6, 5)], 0, 4, torch.float32)
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

    Each block of x is read in :func:`_row_chunks` chunks, each read waiting (``_take``) for
    the product before it, and a step's first read for the previous step's sum in its
    direction: x is never copied whole, and the matmuls of step t wait for no permute issued
    after step t-2 (the sum they will be added to waits for step t-1's).
    """
    xs = list(x) if isinstance(x, (list, tuple)) else [x] * len(ws)
    n = ring.size
    acc = acc or xs[0].dtype  # None (all-gather-matmul's backward): the input's dtype
    chunks = _row_chunks(xs[0], ws, dim, n, acc)
    xla = xs[0].device.type == "xla"
    position = _position(ring, xs[0])
    w_acc = [w.to(acc) for w in ws]
    received: dict[int, Handle] = {}  # the latest sums in flight to this rank, per direction
    summed: dict[int, torch.Tensor] = {}
    last: dict[int, Any] = {}  # per direction: what its next read of x waits for (XLA)
    for step in reduce_scatter_schedule(n, ring.position, ring.bidirectional):
        for direction, block in zip((1, -1), step.blocks, strict=False):
            index = (position + (block - ring.position) % n) % n * chunks  # rank-independent
            parts = []
            for _ in range(chunks):
                partial = None
                for xi, w in zip(xs, w_acc, strict=True):
                    after = last.get(direction) if xla else None
                    term = _take(xi, dim, n * chunks, index, after).to(acc) @ w
                    partial = term if partial is None else partial + term
                    last[direction] = term
                parts.append(partial)
                index = index + 1  # no new constant per chunk
            partial = parts[0] if chunks == 1 else torch.cat(parts, dim)
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
    acc_dtype = partial_sum_dtype(out_dtype)
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


def _agree(
    op: str, x: torch.Tensor, ws: list[torch.Tensor], dim: int, ring: Ring, **opts: Any
) -> None:
    """Debug mode (:mod:`xla_permute.debug`): every rank of the world passes the same shapes,
    dtypes, dim, groups and options, each on its own device; else raise on every rank before
    the first collective (and before the shortcut for empty inputs)."""
    from xla_permute import debug

    shapes = tuple(ws[0].shape) if len(ws) == 1 else tuple(tuple(w.shape) for w in ws)
    fields = {
        "x.shape": tuple(x.shape),
        "x.dtype": str(x.dtype),
        "w.shape": shapes,
        "w.dtype": str(ws[0].dtype),
        "dim": dim,
        "groups": ring.groups,
        **{name: (str(v) if isinstance(v, torch.dtype) else v) for name, v in opts.items()},
    }
    errors = [ring.backend.device_error(x), *(ring.backend.device_error(w, "w") for w in ws)]
    error = next((e for e in errors if e is not None), None)
    debug.check_agreement(op, fields, error=error, backend=ring.backend)


def _check_chunks(chunks: object, x: torch.Tensor, dim: int) -> None:
    """``chunks`` is a positive int that divides the rows of x's block along ``dim``."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"all_gather_matmul: chunks must be a positive int, got {chunks!r}")
    if x.shape[dim] % chunks:
        fits = [c for c in range(2, min(x.shape[dim], 64) + 1) if x.shape[dim] % c == 0][:3]
        raise ValueError(
            f"all_gather_matmul: chunks={chunks} does not divide x.shape[{dim}] = "
            f"{x.shape[dim]}, the rows of each block; use a divisor such as "
            f"{', '.join(map(str, [1, *fits]))}"
        )


def _empty_or_single(x: torch.Tensor, ws: list[torch.Tensor], ring: Ring) -> bool:
    return ring.size == 1 or x.numel() == 0 or any(w.numel() == 0 for w in ws)


def _ring(
    x: object, groups: Groups, backend: str, bidirectional: bool = False
) -> tuple[torch.Tensor, Ring]:
    """The op's boundary: ``x`` checked against the backend it resolves to, this rank's ring."""
    chosen = check_tensor(x, "x", backend)
    return x, ring(groups, backend=chosen, bidirectional=bidirectional)  # type: ignore[return-value]


def all_gather_matmul(
    x: torch.Tensor,
    w: Weights,
    *,
    dim: int,
    bidirectional: bool = False,
    groups: Groups = None,
    backend: Backend = "auto",
    chunks: int = 1,
) -> Any:
    """``AllGather(x, dim) @ w`` without ever holding the gathered x; differentiable (once).

    Args:
        x: this rank's shard ``[..., m, K]``, sharded along ``dim`` (rows or sequence).
        w: this rank's weight ``[K, F]`` (typically a column shard of a ``[K, N*F]`` weight),
            or a list of weights ``[K, F_i]`` that share one ring (x travels once).
        dim: the sharded dimension of x; not the last (contracted) one.
        bidirectional: send blocks both ways round the ring: ``N//2 + 1`` steps instead of N.
        groups: replica groups; each is a ring in its listed order (module docstring).
        backend: permute backend, as in :func:`~xla_permute.permute.collective_permute`.
        chunks: send each x block as this many chunks along ``dim`` (a divisor of ``m``), one
            chunk round the whole ring before the next: a rank holds two chunks instead of two
            blocks, for ``chunks`` times the permutes (each paying its latency;
            :func:`xla_permute.cost.chunk_overhead`). The backward streams x in chunks too.

    Returns:
        ``[..., N*m, F]`` (a tuple of them for a list of weights): block ``j`` along ``dim`` is
        ``x_j @ w`` with ``x_j`` the shard of the group's ``j``-th rank. Uses ``chunks (N-1)``
        permutes of one x chunk each and ``chunks N`` matmuls per weight; no step's matmul
        waits for the permute issued in its step. Backward: ``dx = ReduceScatter(sum_i dy_i @
        w_i.T)`` and ``dw_i = AllGather(x).T @ dy_i``, both rings. With one rank, or an empty
        x or w: ``x @ w`` repeated N times along ``dim`` (all zeros or empty), without a
        collective.
    """
    ws, single = _as_weights(w, "all_gather_matmul")
    x, ring_ = _ring(x, groups, backend, bidirectional)
    dim = _check(x, ws, dim, "all_gather_matmul", False, ring_.size, ring_.backend)
    _check_chunks(chunks, x, dim)
    _agree(
        "all_gather_matmul", x, ws, dim, ring_,
        bidirectional=bool(bidirectional), backend=ring_.backend.name, chunks=chunks,
    )  # fmt: skip
    n = ring_.size
    if _empty_or_single(x, ws, ring_):
        ys = tuple(torch.cat([x @ wi] * n, dim) if n > 1 else x @ wi for wi in ws)
    else:
        ring_.check(x.dtype)
        ys = _RingMatmul.apply((dim, ring_, True, None, chunks), x, *ws)
    return ys[0] if single else ys


def matmul_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    dim: int,
    bidirectional: bool = False,
    reduce_dtype: torch.dtype | None = None,
    groups: Groups = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``ReduceScatter(x @ w, dim)`` with the partial sums travelling round the ring.

    Args:
        x: this rank's ``[..., N*m, K]`` (typically a column shard of the activation).
        w: this rank's ``[K, F]`` (typically a row shard of a ``[N*K, F]`` weight).
        dim: the dimension to scatter; ``x.shape[dim]`` must divide by N; not the last.
        bidirectional: one partial sum travels each way: ``N//2 + 1`` steps instead of N.
        reduce_dtype: dtype of the travelling partial sums (:func:`partial_sum_dtype`):
            float32 for half-precision inputs by default; ``x.dtype`` sends the baseline's
            bytes (half of float32's) at the price of rounding at every hop.
        groups: replica groups; each is a ring in its listed order (module docstring).
        backend: permute backend, as in :func:`~xla_permute.permute.collective_permute`.

    Returns:
        ``[..., m, F]``: block ``position`` along ``dim`` of ``sum_r x_r @ w_r`` over the group,
        rounded once to ``x.dtype``. Backward: ``dx = AllGather(dy) @ w.T`` and ``dw = x.T @
        AllGather(dy)``, both rings. With one rank: ``x @ w``; with an empty x or w, this rank's
        block of ``x @ w`` (zeros or empty), without a collective.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"matmul_reduce_scatter: w must be a tensor [K, F], got {type(w)}")
    x, ring_ = _ring(x, groups, backend, bidirectional)
    dim = _check(x, [w], dim, "matmul_reduce_scatter", True, ring_.size, ring_.backend)
    acc = partial_sum_dtype(x.dtype, reduce_dtype)
    _agree(
        "matmul_reduce_scatter", x, [w], dim, ring_,
        bidirectional=bool(bidirectional), reduce_dtype=acc, backend=ring_.backend.name,
    )  # fmt: skip
    if _empty_or_single(x, [w], ring_):
        return _block(x @ w, ring_.position, ring_.size, dim)
    ring_.check(acc)
    return _RingMatmul.apply((dim, ring_, False, acc, 1), x, w)


def all_gather_then_matmul(
    x: torch.Tensor, w: Weights, *, dim: int, groups: Groups = None, backend: Backend = "auto"
) -> Any:
    """Baseline: upstream all-gather (channel id; ``all_gather_into_tensor`` on c10d), then
    one matmul per weight. Same result and shapes as :func:`all_gather_matmul`; holds the
    gathered x."""
    ws, single = _as_weights(w, "all_gather_then_matmul")
    x, ring_ = _ring(x, groups, backend)
    dim = _check(x, ws, dim, "all_gather_then_matmul", False, ring_.size, ring_.backend)
    _agree("all_gather_then_matmul", x, ws, dim, ring_)
    if _empty_or_single(x, ws, ring_):
        ys = tuple(torch.cat([x @ wi] * ring_.size, dim) for wi in ws)
    else:
        full = collectives.all_gather(x, dim, groups=groups, backend=ring_.backend.name)
        ys = tuple(full @ wi for wi in ws)
    return ys[0] if single else ys


def matmul_then_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    dim: int,
    reduce_dtype: torch.dtype | None = None,
    groups: Groups = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Baseline: one matmul, then upstream reduce-scatter (channel id; ``reduce_scatter_tensor``
    on c10d) in ``reduce_dtype`` (:func:`partial_sum_dtype`). Same result and shapes as
    :func:`matmul_reduce_scatter`."""
    x, ring_ = _ring(x, groups, backend)
    dim = _check(x, [w], dim, "matmul_then_reduce_scatter", True, ring_.size, ring_.backend)
    acc = partial_sum_dtype(x.dtype, reduce_dtype)
    _agree("matmul_then_reduce_scatter", x, [w], dim, ring_, reduce_dtype=acc)
    if _empty_or_single(x, [w], ring_):
        return _block(x @ w, ring_.position, ring_.size, dim)
    partial = x.to(acc) @ w.to(acc)
    return collectives.reduce_scatter(partial, dim, groups=groups, backend=ring_.backend.name).to(
        x.dtype
    )
