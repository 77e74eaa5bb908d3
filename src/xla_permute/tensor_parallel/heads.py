"""Tensor-parallel attention: the heads split over ranks, grouped-query attention included.

Per rank (N ranks, ``Hq`` query and ``Hkv`` key/value heads of size ``D``, hidden ``H``),
sequence parallel (the default): ``x [B, S/N, H] -> y [B, S/N, H]``:

1. ``q, k, v = AllGather(x) @ [Wq_r, Wk_r, Wv_r].T`` on **one** all-gather-matmul ring (x travels
   once): this rank's ``Hq/N`` query heads and their key/value heads, for the whole sequence;
2. ``position_fn(q, k, positions)`` (rotary embeddings), ``positions = 0 ... S-1`` (right only
   after the gather);
3. ``softmax(q k^T / sqrt(D) + causal mask) v`` on this rank's heads (query head ``h`` reads
   key/value head ``h // (Hq/Hkv)``);
4. ``y = ReduceScatter(o @ Wo_r.T) + b``: a :class:`~xla_permute.RowParallelLinear` ring.

With ``dim=None`` x and y are ``[B, S, H]``, whole on every rank; the only collective is
``o_proj``'s all-reduce. **Context parallelism** (``context_groups``: the ranks that split the
sequence): step 3 is :func:`~xla_permute.ring_attention` over them and ``positions`` the
shard's global ones (:func:`~xla_permute.sequence.layout_positions`). **KV heads**: with
``Hkv % N == 0`` rank r holds heads ``r*Hkv/N ...``; with ``N % Hkv == 0`` head ``j`` is held
whole by the ``N/Hkv`` ranks of its query heads, the copies' gradients summed over them in
the backward (:func:`~xla_permute.collectives.sum_gradients`); other ``Hkv`` are refused.
Backward: the collective matmuls' own (:mod:`xla_permute.matmul`) and autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xla_permute.attention import ring_attention
from xla_permute.collectives import sum_gradients
from xla_permute.pairs import GroupsLike, check_int
from xla_permute.sequence import check_layout, layout_positions
from xla_permute.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, _place

__all__ = ["ParallelAttention", "kv_head_groups"]

#: ``position_fn(q [B, h, S, D], k [B, hkv, S, D], positions [S]) -> (q, k)``
PositionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def kv_head_groups(
    heads: int, kv_heads: int, world_size: int, groups: GroupsLike = None
) -> list[list[int]] | None:
    """The ranks that hold the same key/value head, as replica groups (None: one rank each),
    in the tensor-parallel ``groups`` of ``world_size``. ValueError for counts that do not split.

    >>> kv_head_groups(8, 2, 4), kv_head_groups(8, 4, 4)
    ([[0, 1], [2, 3]], None)
    """
    heads = check_int(heads, "heads", 1)
    kv_heads = check_int(kv_heads, "kv_heads", 1)
    if heads % world_size:
        raise ValueError(f"heads = {heads} is not divisible by the {world_size} ranks")
    if heads % kv_heads:
        raise ValueError(f"heads = {heads} is not a multiple of kv_heads = {kv_heads}")
    if kv_heads % world_size == 0:
        return None
    if world_size % kv_heads:  # each rank needs whole key/value heads
        raise ValueError(f"kv_heads = {kv_heads} neither divides nor is divided by {world_size}")
    copies = world_size // kv_heads
    tp = [list(range(world_size))] if groups is None else [list(g) for g in groups]
    return [g[i : i + copies] for g in tp for i in range(0, world_size, copies)]


class ParallelAttention(nn.Module):
    """Multi-head attention with its heads split over ranks (module docstring), built by
    ``ParallelAttention.from_linears``. ``forward(x)`` returns ``y``; with
    ``returns_weights=True`` (in a Hugging Face attention's place) ``(y, None)``, ignoring
    that attention's keyword arguments.
    """

    def __init__(
        self,
        qkv: list[nn.Module],
        o: RowParallelLinear,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        position_fn: PositionFn | None = None,
        causal: bool = True,
        returns_weights: bool = False,
        context_groups: GroupsLike = None,
        layout: str = "contiguous",
    ) -> None:
        super().__init__()
        (self.q_proj, self.k_proj, self.v_proj), self.o_proj, n = qkv, o, o.world_size
        self.kv_groups = kv_head_groups(heads, kv_heads, n, o.groups)
        self.heads, self.kv_heads, self.head_dim = heads // n, max(1, kv_heads // n), head_dim
        self.position_fn, self.causal, self.returns_weights = position_fn, causal, returns_weights
        self.layout = check_layout(layout)
        self.context_groups, self.context = context_groups, None  # context: (size, position)
        if context_groups is not None:  # resolved once, here
            self.context = _place(context_groups, o.backend, None, None, "ParallelAttention")

    @classmethod
    def from_linears(
        cls,
        q: nn.Linear,
        k: nn.Linear,
        v: nn.Linear,
        o: nn.Linear,
        *,
        heads: int,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        **options: Any,
    ) -> ParallelAttention:
        """This rank's heads of the attention whose projections are the ``nn.Linear`` layers
        ``q, k, v, o`` (``kv_heads``: ``heads`` when None; ``head_dim``: ``q``'s rows per head).
        ``options``: the class's keywords and the layers' (``strategy``, ``dim``, ``groups``, ...
        of :class:`~xla_permute.ColumnParallelLinear`), the same for all four projections.
        """
        own = ("position_fn", "causal", "returns_weights", "context_groups", "layout")
        attention = {a: options.pop(a) for a in own if a in options}
        kv_heads = heads if kv_heads is None else kv_heads
        hd = head_dim or q.out_features // heads
        for name, lin, count in (("q", q, heads), ("k", k, kv_heads), ("v", v, kv_heads)):
            if lin.out_features != count * hd:
                raise ValueError(f"{name}: {lin.out_features} rows are not {count} heads of {hd}")
        out = RowParallelLinear.from_linear(o, **options)
        n, r = out.world_size, out.rank
        options |= {"world_size": n, "rank": r}
        parts = [ColumnParallelLinear.from_linear(q, **options)]
        if kv_head_groups(heads, kv_heads, n, out.groups) is None:
            parts += [ColumnParallelLinear.from_linear(t, **options) for t in (k, v)]
        else:  # this rank's one KV head, whole: the head of its query heads
            head = r * (heads // n) // (heads // kv_heads)
            parts += [_rows(t, head * hd, hd) for t in (k, v)]
        return cls(parts, out, heads=heads, kv_heads=kv_heads, head_dim=hd, **attention)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """``[B, S/N, H] -> [B, S/N, H]`` (``[B, S, H]`` without sequence parallelism)."""
        x = hidden_states
        if args or (kwargs.get("attention_mask") is not None and not self.returns_weights):
            raise ValueError("ParallelAttention takes no attention_mask, no positional argument")
        qkv = self._project(x)
        b, s = qkv[0].shape[:2]
        q, k, v = (
            t.view(b, s, h, self.head_dim).transpose(1, 2)
            for t, h in zip(qkv, (self.heads, self.kv_heads, self.kv_heads), strict=True)
        )
        cp = self.context
        positions = torch.arange(s) if cp is None else layout_positions(*cp, self.layout, s)
        if self.position_fn is not None:
            q, k = self.position_fn(q, k, positions.to(x.device))
        if self.context is not None:
            comm = dict(groups=self.context_groups, backend=self.o_proj.backend)
            out = ring_attention(q, k, v, causal=self.causal, layout=self.layout, **comm)
        else:
            group = self.heads // self.kv_heads
            k, v = (t.repeat_interleave(group, dim=1) if group > 1 else t for t in (k, v))
            out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        y = self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))
        return (y, None) if self.returns_weights else y

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v for the whole sequence on one ring; the KV copies' gradients summed."""
        params = [(p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj)]
        if self.kv_groups is not None:
            comm = dict(groups=self.kv_groups, backend=self.o_proj.backend)
            kv = [[None if t is None else sum_gradients(t, **comm) for t in p] for p in params[1:]]
            params[1:] = [tuple(p) for p in kv]
        return self.q_proj.fused(x, params)

    def extra_repr(self) -> str:
        kv = "" if self.kv_groups is None else f", kv copies summed over {self.kv_groups}"
        cp = "" if self.context_groups is None else f", ring over {self.context_groups}"
        return f"heads={self.heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}{kv}{cp}"


def _rows(lin: nn.Linear, first: int, count: int) -> nn.Linear:
    """A copy of rows ``first ... first+count`` of ``lin``: ``nn.Linear(in_features, count)``."""
    w = lin.weight
    part = nn.Linear(w.shape[1], count, lin.bias is not None, w.device, w.dtype)
    part.load_state_dict({k: t[first : first + count] for k, t in lin.state_dict().items()})
    return part
