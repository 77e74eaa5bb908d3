"""Collective matmul: all-gather-matmul and matmul-reduce-scatter as rings of permutes.

Tensor parallelism multiplies a sharded activation by a sharded weight and needs a collective
before (all-gather) or after (reduce-scatter) the matmul. Decomposing the collective into N-1
CollectivePermutes lets every step's matmul run while the next block is in flight (Wang et al.,
ASPLOS 2023; JAX shard_map collective matmul; PyTorch async TP). The schedules are in
:mod:`xla_permute.schedule`.

Per-rank shapes (``N`` ranks, ``dim`` the sharded dimension of x, never its last):

* :func:`all_gather_matmul`: ``x [..., m, K]`` and ``w [K, F]`` -> ``[..., N*m, F]``;
  ``y = AllGather(x, dim) @ w``. Backward: ``dx = ReduceScatter(dy @ w.T, dim)`` (a
  matmul-reduce-scatter) and ``dw = AllGather(x, dim).T @ dy`` with x streamed around the ring
  again, so the gathered x is never held.
* :func:`matmul_reduce_scatter`: ``x [..., N*m, K]`` and ``w [K, F]`` -> ``[..., m, F]``;
  ``y = ReduceScatter(x @ w, dim)`` (sum). Backward: ``dx = AllGather(dy, dim) @ w.T`` (an
  all-gather-matmul) and ``dw = x.T @ AllGather(dy, dim)`` with dy streamed around the ring.

Half-precision (bfloat16, float16) partial sums are accumulated in float32 and rounded once.
The world is all ranks (no groups). With one rank both are a plain ``x @ w``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xla_permute import collectives
from xla_permute.pairs import ring_pairs
from xla_permute.permute import Backend, check_xla_tensor, collective_permute, resolve_backend
from xla_permute.schedule import all_gather_schedule, reduce_scatter_schedule

__all__ = [
    "all_gather_matmul",
    "all_gather_then_matmul",
    "matmul_reduce_scatter",
    "matmul_then_reduce_scatter",
]

_HALF = (torch.bfloat16, torch.float16)


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _HALF else dtype


def _block(t: torch.Tensor, index: int, n: int, dim: int) -> torch.Tensor:
    """Block ``index`` of ``n`` equal blocks of ``t`` along ``dim``.

    ``narrow`` lowers to one slice; ``t.chunk(n)`` would lower all n slices again for every
    block used (n^2 slices in the program).
    """
    size = t.shape[dim] // n
    return t.narrow(dim, index * size, size)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Merge every dimension but the last: ``[..., c] -> [rows, c]``."""
    return t.reshape(-1, t.shape[-1])


def _world() -> tuple[int, int]:
    import torch_xla.runtime as xr

    return xr.world_size(), xr.global_ordinal()


def _check(x: object, w: object, dim: int, op: str, sharded_input: bool) -> int:
    """Validate the inputs of ``op`` and return ``dim`` normalised to be non-negative."""
    x = check_xla_tensor(x, "x")
    w = check_xla_tensor(w, "w")
    if w.dim() != 2:
        raise ValueError(f"{op}: w must be 2-D [K, F], got shape {tuple(w.shape)}")
    if x.dim() < 2:
        raise ValueError(f"{op}: x must be at least 2-D [..., rows, K], got {tuple(x.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(
            f"{op}: x is {x.dtype} but w is {w.dtype}; cast one of them, e.g. w.to(x.dtype)"
        )
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{op}: inner dimensions differ: x.shape[-1] = {x.shape[-1]} but w.shape[0] = "
            f"{w.shape[0]}; x [..., K] @ w [K, F] needs them equal"
        )
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: dim={dim!r} is not a dimension of x with shape {tuple(x.shape)}")
    dim %= x.dim()
    if dim == x.dim() - 1:
        raise ValueError(
            f"{op}: dim={dim} is the contracted (last) dimension of x; shard a row or sequence "
            f"dimension instead (e.g. dim=0 for [rows, K], dim=1 for [batch, seq, K])"
        )
    n, _ = _world()
    if sharded_input and x.shape[dim] % n:
        raise ValueError(
            f"{op}: x.shape[{dim}] = {x.shape[dim]} is not divisible by the {n} ranks; the "
            f"reduce-scatter gives every rank an equal block, so pad it to a multiple of {n}"
        )
    return dim


def _stream(
    block: torch.Tensor,
    bidirectional: bool,
    backend: str,
    visit: Callable[[int, torch.Tensor], None],
) -> None:
    """Pass every rank's ``block`` around the ring; call ``visit(source_rank, block)`` on each.

    The permutes of a step are issued before that step's visits and carry the blocks the visits
    use; no visit depends on a permute of its own step.
    """
    n, rank = _world()
    held = {1: block, -1: block}
    for step in all_gather_schedule(n, rank, bidirectional):
        in_flight = {d: collective_permute(held[d], ring_pairs(n, d), backend=backend)
                     for d in step.sends}  # fmt: skip
        for direction, source in zip((1, -1), step.blocks, strict=False):
            visit(source, held[direction])
        held.update(in_flight)


def _ring_all_gather_matmul(
    x: torch.Tensor, w: torch.Tensor, dim: int, bidirectional: bool, backend: str
) -> torch.Tensor:
    products: dict[int, torch.Tensor] = {}

    def multiply(source: int, x_block: torch.Tensor) -> None:
        products[source] = x_block @ w

    _stream(x, bidirectional, backend, multiply)
    return torch.cat([products[b] for b in sorted(products)], dim=dim)


def _ring_matmul_reduce_scatter(
    x: torch.Tensor, w: torch.Tensor, dim: int, bidirectional: bool, backend: str
) -> torch.Tensor:
    n, rank = _world()
    acc = _accumulation_dtype(x.dtype)
    w_acc = w.to(acc)
    received: dict[int, torch.Tensor] = {}
    summed: dict[int, torch.Tensor] = {}
    for step in reduce_scatter_schedule(n, rank, bidirectional):
        for direction, block in zip((1, -1), step.blocks, strict=False):
            partial = _block(x, block, n, dim).to(acc) @ w_acc
            summed[direction] = received[direction] + partial if direction in received else partial
        for d in step.sends:  # carries this step's sums; overlaps the next step's matmuls
            received[d] = collective_permute(summed[d], ring_pairs(n, d), backend=backend)
    out = summed[1] + received[-1] if -1 in received else summed[1]
    return out.to(x.dtype)


def _stream_weight_grad(
    streamed: torch.Tensor,
    local: torch.Tensor,
    dim: int,
    streamed_is_lhs: bool,
    bidirectional: bool,
    backend: str,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``sum_b lhs_b.T @ rhs_b``: one operand streamed round the ring, the other ``local``, whose
    block ``b`` along ``dim`` pairs with the block that came from rank ``b``."""
    acc_dtype = _accumulation_dtype(out_dtype)
    terms: list[torch.Tensor] = []
    n, _ = _world()

    def accumulate(source: int, held: torch.Tensor) -> None:
        mine = _block(local, source, n, dim)
        lhs, rhs = (held, mine) if streamed_is_lhs else (mine, held)
        terms.append(_rows(lhs).to(acc_dtype).T @ _rows(rhs).to(acc_dtype))

    _stream(streamed, bidirectional, backend, accumulate)
    return torch.stack(terms).sum(0).to(out_dtype)


class _RingMatmul(torch.autograd.Function):
    """Both collective matmuls: ``gather=True`` is all-gather-matmul, ``False`` the other.

    Each one's backward for x is the other ring; for w it streams the sharded operand (x for
    all-gather-matmul, dy for matmul-reduce-scatter) round the ring once more.
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, dim: int, bi: bool, backend: str, gather: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.args = dim, bi, backend, gather
        ring = _ring_all_gather_matmul if gather else _ring_matmul_reduce_scatter
        return ring(x, w, dim, bi, backend)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        dim, bi, backend, gather = ctx.args
        dy = dy.contiguous()
        dual = _ring_matmul_reduce_scatter if gather else _ring_all_gather_matmul
        dx = dual(dy, w.T, dim, bi, backend)
        streamed, local = (x, dy) if gather else (dy, x)
        dw = _stream_weight_grad(streamed, local, dim, gather, bi, backend, w.dtype)
        return dx, dw, None, None, None, None


def all_gather_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    dim: int,
    bidirectional: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``AllGather(x, dim) @ w`` without ever holding the gathered x; differentiable (once).

    Args:
        x: this rank's shard ``[..., m, K]``, sharded along ``dim`` (rows or sequence).
        w: this rank's weight ``[K, F]`` (typically a column shard of a ``[K, N*F]`` weight).
        dim: the sharded dimension of x; not the last (contracted) one.
        bidirectional: send blocks both ways round the ring: ``N//2 + 1`` steps instead of N.
        backend: permute backend, as in :func:`~xla_permute.permute.collective_permute`.

    Returns:
        ``[..., N*m, F]``: block ``j`` along ``dim`` is ``x_j @ w``. Uses N-1 permutes of one
        x block each and N matmuls; no step's matmul waits for the permute issued in its step.
        Backward: ``dx = ReduceScatter(dy @ w.T)`` and ``dw = AllGather(x).T @ dy``, both
        rings. With one rank: ``x @ w``.
    """
    dim = _check(x, w, dim, "all_gather_matmul", sharded_input=False)
    if _world()[0] == 1:
        return x @ w
    return _RingMatmul.apply(x, w, dim, bool(bidirectional), resolve_backend(backend), True)


def matmul_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    dim: int,
    bidirectional: bool = False,
    backend: Backend = "auto",
) -> torch.Tensor:
    """``ReduceScatter(x @ w, dim)`` with the partial sums travelling round the ring.

    Args:
        x: this rank's ``[..., N*m, K]`` (typically a column shard of the activation).
        w: this rank's ``[K, F]`` (typically a row shard of a ``[N*K, F]`` weight).
        dim: the dimension to scatter; ``x.shape[dim]`` must divide by N; not the last.
        bidirectional: one partial sum travels each way: ``N//2 + 1`` steps instead of N.
        backend: permute backend, as in :func:`~xla_permute.permute.collective_permute`.

    Returns:
        ``[..., m, F]``: block ``rank`` along ``dim`` of ``sum_r x_r @ w_r``. Half-precision
        inputs accumulate in float32 (the travelling sums are float32) and round once.
        Backward: ``dx = AllGather(dy) @ w.T`` and ``dw = x.T @ AllGather(dy)``, both rings.
        With one rank: ``x @ w``.
    """
    dim = _check(x, w, dim, "matmul_reduce_scatter", sharded_input=True)
    if _world()[0] == 1:
        return x @ w
    return _RingMatmul.apply(x, w, dim, bool(bidirectional), resolve_backend(backend), False)


def all_gather_then_matmul(x: torch.Tensor, w: torch.Tensor, *, dim: int) -> torch.Tensor:
    """Baseline: upstream all-gather (channel id), then one matmul. Same result and shapes as
    :func:`all_gather_matmul`; holds the gathered x."""
    dim = _check(x, w, dim, "all_gather_then_matmul", sharded_input=False)
    return collectives.all_gather(x, dim) @ w


def matmul_then_reduce_scatter(x: torch.Tensor, w: torch.Tensor, *, dim: int) -> torch.Tensor:
    """Baseline: one matmul, then upstream reduce-scatter (channel id). Same result and shapes
    as :func:`matmul_reduce_scatter` (half precision also accumulates in float32)."""
    dim = _check(x, w, dim, "matmul_then_reduce_scatter", sharded_input=True)
    acc = _accumulation_dtype(x.dtype)
    return collectives.reduce_scatter(x.to(acc) @ w.to(acc), dim).to(x.dtype)
