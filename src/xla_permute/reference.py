"""The semantics, in a page: pure-torch collectives on a *virtual mesh*.

A virtual mesh tensor has the rank as its leading axis: ``xs[r]`` is what rank ``r`` holds.
These functions are the oracle every backend is tested against and the definitions the docs
quote. They are differentiable with plain torch autograd, which gives the reference gradients.

>>> from xla_permute.pairs import ring_pairs
>>> xs = torch.arange(4.0)[:, None]           # rank r holds [r]
>>> permute(xs, ring_pairs(4)).flatten().tolist()
[3.0, 0.0, 1.0, 2.0]
>>> permute(xs, [(0, 1), (1, 0)]).flatten().tolist()   # ranks 2 and 3 receive zeros
[1.0, 0.0, 0.0, 0.0]
"""

from __future__ import annotations

import torch

from xla_permute.pairs import GroupsLike, PairsLike, global_pairs

__all__ = [
    "accumulation_dtype", "all_gather", "all_gather_matmul", "matmul_reduce_scatter",
    "permute", "reduce_scatter", "stage_shift",
]  # fmt: skip


def accumulation_dtype(dtype: torch.dtype, reduce_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype sums are accumulated (and partial sums travel) in, the package's one rule:
    ``reduce_dtype`` if given, else float32 for half-precision inputs, else ``dtype``.

    >>> accumulation_dtype(torch.bfloat16), accumulation_dtype(torch.bfloat16, torch.bfloat16)
    (torch.float32, torch.bfloat16)
    """
    if reduce_dtype is None:
        return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    if not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point:
        raise TypeError(
            f"reduce_dtype must be a floating torch.dtype such as torch.float32 or the input's "
            f"dtype, or None; got {reduce_dtype!r}"
        )
    return reduce_dtype


def permute(xs: torch.Tensor, pairs: PairsLike, groups: GroupsLike = None) -> torch.Tensor:
    """CollectivePermute: ``out[t] = xs[s]`` for every pair ``(s, t)``; zeros elsewhere.

    With ``groups``, the pairs are group-local and apply inside every group. The result is
    always part of the autograd graph (also for empty pairs), so ``xs.grad`` is the reference
    gradient: zero on every rank whose value went nowhere.
    """
    n = xs.shape[0]
    source = {t: s for s, t in global_pairs(pairs, groups, n)}
    padded = torch.cat([xs, torch.zeros_like(xs[:1])])  # row n: the zero fill
    return padded[[source.get(t, n) for t in range(n)]]


def stage_shift(
    xs: torch.Tensor, offset: int = 1, *, wrap: bool, groups: GroupsLike = None
) -> torch.Tensor:
    """A stage shift: ``out[r] = xs[r - offset]``; the ends get zeros, or wrap with ``wrap``.

    ``0 < |offset| <`` the group size. With ``groups``, ``r`` is the position inside each group.
    The backward is the opposite shift, ``stage_shift(gs, -offset, wrap=wrap)``.

    >>> stage_shift(torch.arange(4.0), 1, wrap=False).tolist()
    [0.0, 0.0, 1.0, 2.0]
    >>> stage_shift(torch.arange(4.0), -1, wrap=True, groups=[[0, 1], [2, 3]]).tolist()
    [1.0, 0.0, 3.0, 2.0]
    """
    n = len(groups[0]) if groups is not None else xs.shape[0]
    pairs = [(r, (r + offset) % n) for r in range(n) if wrap or 0 <= r + offset < n]
    return permute(xs, pairs, groups)


def all_gather(xs: torch.Tensor, dim: int) -> torch.Tensor:
    """AllGather: every rank gets the ranks' blocks concatenated along ``dim`` (per-rank dim)."""
    full = torch.cat(list(xs), dim=dim)
    return full.unsqueeze(0).expand(xs.shape[0], *full.shape)


def reduce_scatter(xs: torch.Tensor, dim: int) -> torch.Tensor:
    """ReduceScatter (sum): rank ``r`` gets block ``r`` along ``dim`` of the sum over ranks."""
    return torch.stack(xs.sum(0).chunk(xs.shape[0], dim=dim))


def _matmul(xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """Per-rank ``xs[r] @ ws[r]`` for per-rank x of any rank >= 2 and 2-D per-rank w."""
    return xs @ ws.reshape(ws.shape[0], *[1] * (xs.dim() - 3), *ws.shape[1:])


def all_gather_matmul(xs: torch.Tensor, ws: torch.Tensor, dim: int) -> torch.Tensor:
    """``out[r] = AllGather(x, dim) @ ws[r]``: each rank multiplies the whole x by its w."""
    return _matmul(all_gather(xs, dim), ws)


def matmul_reduce_scatter(xs: torch.Tensor, ws: torch.Tensor, dim: int) -> torch.Tensor:
    """``out = ReduceScatter(xs[r] @ ws[r], dim)``: the partial products summed and split, in
    :func:`~xla_permute.reference.accumulation_dtype`, rounded once."""
    acc = accumulation_dtype(xs.dtype)
    return reduce_scatter(_matmul(xs.to(acc), ws.to(acc)), dim).to(xs.dtype)
