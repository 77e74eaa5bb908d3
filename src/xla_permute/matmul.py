"""Collective matmul: all-gather-matmul and matmul-reduce-scatter as rings of permutes.

Tensor parallelism multiplies a sharded activation by a sharded weight and needs a collective
before (all-gather) or after (reduce-scatter) the matmul. Decomposing the collective into N-1
CollectivePermutes lets every step's matmul run while the next block is in flight (Wang et al.,
ASPLOS 2023; JAX shard_map collective matmul; PyTorch async TP). The rings and their
schedules are in :mod:`xla_permute.matmul_ring`.

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

Memory (XLA:CPU's buffer assignment, x an input of the program; how, in
:mod:`xla_permute.matmul_ring`): all-gather-matmul holds about three x blocks (own, worked
on, in flight) plus w and the output, never the gathered x; with ``chunks=c`` two chunks
replace two of those blocks. Matmul-reduce-scatter holds x, w, one row slice of a block and a
few partial sums: at most the baseline's x plus ``x @ w``.
Empty inputs (0 rows, ``K = 0``, ``F = 0``) give the empty (or zero) result without a
collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xla_permute.backends.select import BackendName, Ring, check_tensor
from xla_permute.collectives import all_gather_checked, reduce_scatter_checked
from xla_permute.debug import agree
from xla_permute.matmul_ring import _block, _RingMatmul
from xla_permute.pairs import GroupsLike, check_dim, check_groups, check_int
from xla_permute.reference import accumulation_dtype

__all__ = [
    "all_gather_matmul", "all_gather_then_matmul", "matmul_reduce_scatter",
    "matmul_then_reduce_scatter",
]  # fmt: skip

Weights = torch.Tensor | Sequence[torch.Tensor]


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


def _begin(
    op: str,
    x: object,
    ws: list[torch.Tensor],
    dim: object,
    groups: GroupsLike,
    backend: str,
    *,
    sharded: bool = False,
    bidirectional: bool = False,
) -> tuple[int, Ring]:
    """Check the inputs of ``op``; return ``dim`` (non-negative) and this rank's ring."""
    chosen = check_tensor(x, "x", backend)
    assert isinstance(x, torch.Tensor)
    ring = Ring.build(groups, backend=chosen, bidirectional=bidirectional)
    for i, w in enumerate(ws):
        name = "w" if len(ws) == 1 else f"w[{i}]"
        w = chosen.check_tensor(w, name)
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
    dim = check_dim(dim, x.shape, op=op)
    if dim == x.dim() - 1:
        raise ValueError(
            f"{op}: dim={dim} is the contracted (last) dimension of x; shard a row or sequence "
            f"dimension instead (e.g. dim=0 for [rows, K], dim=1 for [batch, seq, K])"
        )
    n = ring.size
    if sharded and x.shape[dim] % n:
        raise ValueError(
            f"{op}: x.shape[{dim}] = {x.shape[dim]} is not divisible by the {n} ranks; the "
            f"reduce-scatter gives every rank an equal block, so pad it to a multiple of {n}"
        )
    return dim, ring


def _agree(
    op: str, x: torch.Tensor, ws: list[torch.Tensor], dim: int, ring: Ring, **opts: Any
) -> None:
    """The agreement check (:mod:`xla_permute.debug`), before the shortcut for empty inputs."""
    tensors = {"x": x, "w": ws[0] if len(ws) == 1 else ws}
    agree(op, tensors, {"dim": dim, "groups": ring.groups, **opts}, backend=ring.backend)


def _empty_or_single(x: torch.Tensor, ws: list[torch.Tensor], ring: Ring) -> bool:
    return ring.size == 1 or x.numel() == 0 or any(w.numel() == 0 for w in ws)


def all_gather_matmul(
    x: torch.Tensor,
    w: Weights,
    *,
    dim: int,
    bidirectional: bool = False,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
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
            blocks, for ``chunks`` times the permutes (tutorial 16); the backward too.

    Returns:
        ``[..., N*m, F]`` (a tuple of them for a list of weights): block ``j`` along ``dim`` is
        ``x_j @ w`` with ``x_j`` the shard of the group's ``j``-th rank. Uses ``chunks (N-1)``
        permutes of one x chunk each and ``chunks N`` matmuls per weight; no step's matmul
        waits for the permute issued in its step. Backward: ``dx = ReduceScatter(sum_i dy_i @
        w_i.T)`` and ``dw_i = AllGather(x).T @ dy_i``, both rings. With one rank, or an empty
        x or w: ``x @ w`` repeated N times along ``dim`` (all zeros or empty), without a
        collective.
    """
    op = "all_gather_matmul"
    ws, single = _as_weights(w, op)
    dim, ring = _begin(op, x, ws, dim, groups, backend, bidirectional=bidirectional)
    if x.shape[dim] % check_int(chunks, "all_gather_matmul: chunks", 1):
        fits = [c for c in range(2, min(x.shape[dim], 64) + 1) if x.shape[dim] % c == 0][:3]
        raise ValueError(
            f"all_gather_matmul: chunks={chunks} does not divide x.shape[{dim}] = "
            f"{x.shape[dim]}, the rows of each block; use a divisor such as "
            f"{', '.join(map(str, [1, *fits]))}"
        )
    opts = {"bidirectional": bool(bidirectional), "backend": ring.backend.name, "chunks": chunks}
    _agree(op, x, ws, dim, ring, **opts)
    n = ring.size
    if _empty_or_single(x, ws, ring):
        ys = tuple(torch.cat([x @ wi] * n, dim) if n > 1 else x @ wi for wi in ws)
    else:
        ring.check(x.dtype)
        ys = _RingMatmul.apply((dim, ring, True, None, chunks), x, *ws)
    return ys[0] if single else ys


def matmul_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    dim: int,
    bidirectional: bool = False,
    reduce_dtype: torch.dtype | None = None,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
) -> torch.Tensor:
    """``ReduceScatter(x @ w, dim)`` with the partial sums travelling round the ring.

    Args:
        x: this rank's ``[..., N*m, K]`` (typically a column shard of the activation).
        w: this rank's ``[K, F]`` (typically a row shard of a ``[N*K, F]`` weight).
        dim: the dimension to scatter; ``x.shape[dim]`` must divide by N; not the last.
        bidirectional: one partial sum travels each way: ``N//2 + 1`` steps instead of N.
        reduce_dtype: dtype of the travelling partial sums
            (:func:`~xla_permute.reference.accumulation_dtype`); ``x.dtype`` sends the
            baseline's bytes (half of float32's) at the price of rounding at every hop.
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
    op = "matmul_reduce_scatter"
    dim, ring = _begin(op, x, [w], dim, groups, backend, sharded=True, bidirectional=bidirectional)
    acc = accumulation_dtype(x.dtype, reduce_dtype)
    opts = {"bidirectional": bool(bidirectional), "reduce_dtype": acc, "backend": ring.backend.name}
    _agree(op, x, [w], dim, ring, **opts)
    if _empty_or_single(x, [w], ring):
        return _block(x @ w, ring.position, ring.size, dim)
    ring.check(acc)
    return _RingMatmul.apply((dim, ring, False, acc, 1), x, w)


def all_gather_then_matmul(
    x: torch.Tensor,
    w: Weights,
    *,
    dim: int,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
) -> Any:
    """Baseline: upstream all-gather (channel id; ``all_gather_into_tensor`` on c10d), then
    one matmul per weight. Same result and shapes as :func:`all_gather_matmul`; holds the
    gathered x."""
    ws, single = _as_weights(w, "all_gather_then_matmul")
    dim, ring = _begin("all_gather_then_matmul", x, ws, dim, groups, backend)
    _agree("all_gather_then_matmul", x, ws, dim, ring)
    if _empty_or_single(x, ws, ring):
        ys = tuple(torch.cat([x @ wi] * ring.size, dim) for wi in ws)
    else:
        checked = check_groups(ring.groups, ring.backend.world_size())
        full = all_gather_checked(x, dim, checked, ring.backend)
        ys = tuple(full @ wi for wi in ws)
    return ys[0] if single else ys


def matmul_then_reduce_scatter(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    dim: int,
    reduce_dtype: torch.dtype | None = None,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
) -> torch.Tensor:
    """Baseline: one matmul, then upstream reduce-scatter (channel id; ``reduce_scatter_tensor``
    on c10d) in ``reduce_dtype`` (:func:`~xla_permute.reference.accumulation_dtype`). Same
    result and shapes as :func:`matmul_reduce_scatter`."""
    dim, ring = _begin("matmul_then_reduce_scatter", x, [w], dim, groups, backend, sharded=True)
    acc = accumulation_dtype(x.dtype, reduce_dtype)
    _agree("matmul_then_reduce_scatter", x, [w], dim, ring, reduce_dtype=acc)
    if _empty_or_single(x, [w], ring):
        return _block(x @ w, ring.position, ring.size, dim)
    partial = x.to(acc) @ w.to(acc)
    checked = check_groups(ring.groups, ring.backend.world_size())
    return reduce_scatter_checked(partial, dim, checked, ring.backend).to(x.dtype)
