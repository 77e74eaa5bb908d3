"""Vocabulary parallelism (Megatron-LM's): embedding, LM head and cross-entropy over vocab shards.

Rank r of N holds rows ``r*V/N ... (r+1)*V/N`` of the embedding table and of the LM head, so
full ``[B, S, V]`` logits never exist on one rank:

* :class:`VocabParallelEmbedding`: tokens ``[B, S]`` -> ``[B, S/N, H]`` (one reduce-scatter)
  or ``[B, S, H]`` (one all-reduce): each rank looks up its rows, the sum is the full lookup.
* The LM head: a :class:`~xla_permute.ColumnParallelLinear`, ``[B, S/N, H] -> [B, S, V/N]``.
* :func:`vocab_parallel_cross_entropy`: logits ``[..., V/N]`` -> the loss, equal to
  ``cross_entropy`` of the gathered logits; the max, the sum of exponentials and the target's
  logit travel (``[..., N]`` and ``[..., 2]`` floats per token), not the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from xla_permute.backends.select import check_tensor
from xla_permute.collectives import all_gather, all_reduce, reduce_scatter
from xla_permute.pairs import GroupsLike, check_int
from xla_permute.reference import accumulation_dtype
from xla_permute.tensor_parallel.layers import _place, reduce_replicated

__all__ = ["VocabParallelEmbedding", "vocab_parallel_cross_entropy"]


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding(num_embeddings, embedding_dim)`` with its rows sharded over ranks.

    Per rank: tokens ``[B, S]`` (the same on every rank) -> ``[B, S/N, H]`` (``dim``: the
    output's sequence dimension) or ``[B, S, H]`` (``dim=None``); ``y = sum_r E_r[t - r*V/N]``
    (zero outside rank r's rows) reduce-scattered or all-reduced. Backward: the gradient of this
    rank's rows only; with ``dim``, after an all-gather of ``dy``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        dim: int | None = 1,
        padding_idx: int | None = None,
        groups: GroupsLike = None,
        backend: str = "auto",
        world_size: int | None = None,
        rank: int | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = n_emb = check_int(num_embeddings, "num_embeddings", 1)
        self.embedding_dim = check_int(embedding_dim, "embedding_dim", 1)
        self.groups = None if groups is None else [list(g) for g in groups]
        self.backend, self.dim = backend, None if dim is None else check_int(dim, "dim", 0)
        what = type(self).__name__
        self.world_size, self.rank = _place(self.groups, backend, world_size, rank, what)
        n = self.world_size
        if n_emb % n:
            raise ValueError(
                f"num_embeddings = {n_emb} is not divisible by the {n} ranks; pad the vocabulary "
                f"to a multiple of {n} (e.g. {n_emb + (-n_emb % n)})"
            )
        self.start, self.padding_idx = self.rank * n_emb // n, padding_idx
        self.weight = nn.Parameter(torch.zeros(n_emb // n, self.embedding_dim, dtype=dtype))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs: Any) -> VocabParallelEmbedding:
        """This rank's rows of a full ``nn.Embedding`` (together, the same lookup)."""
        w = embedding.weight
        layer = cls(*w.shape, padding_idx=embedding.padding_idx, dtype=w.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(w.narrow(0, layer.start, layer.weight.shape[0]))
        return layer.to(w.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, S] -> [B, S/N, H]`` (``[B, S, H]`` with ``dim=None``; class docstring)."""
        block = self.weight.shape[0]
        local = tokens - self.start
        mine = (local >= 0) & (local < block)
        local = torch.where(mine, local, torch.zeros_like(local))
        padding = None if self.padding_idx is None else self.padding_idx - self.start
        padding = padding if padding is not None and 0 <= padding < block else None
        y = nn.functional.embedding(local, self.weight, padding_idx=padding)
        y = y * mine.unsqueeze(-1).to(y.dtype)
        comm = dict(groups=self.groups, backend=self.backend)
        if self.dim is None:
            return reduce_replicated(y, **comm)
        return reduce_scatter(y, self.dim, **comm)

    def extra_repr(self) -> str:
        rows = f"rows {self.start}..{self.start + self.weight.shape[0]} of {self.num_embeddings}"
        return f"{rows}, embedding_dim={self.embedding_dim}, dim={self.dim}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, *args: Any) -> torch.Tensor:
        start, ignore_index, comm = args  # this rank's first token id, the id to ignore, group
        x = logits.to(accumulation_dtype(logits.dtype))
        block = x.shape[-1]
        peak = all_gather(x.amax(-1, keepdim=True), x.dim() - 1, **comm).amax(-1, keepdim=True)
        shifted = x - peak
        exp = shifted.exp()
        local = target - start
        mine = (local >= 0) & (local < block)
        local = torch.where(mine, local, torch.zeros_like(local))
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine.to(x.dtype)
        sums = all_reduce(torch.stack([exp.sum(-1), picked], -1), **comm)
        total, target_logit = sums.unbind(-1)
        kept = target != ignore_index
        loss = (total.log() - target_logit) * kept.to(x.dtype)
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, mine & kept, kept)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local, hit, kept = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), 1.0)
        onehot = onehot * hit.unsqueeze(-1).to(softmax.dtype)
        dx = (softmax - onehot) * (grad * kept.to(grad.dtype)).unsqueeze(-1)
        return dx.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    groups: GroupsLike = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Cross-entropy of logits sharded over the vocabulary, equal to the unsharded one.

    Per rank: ``logits [..., V/N]`` (this rank's block of the vocabulary, as the LM head
    :class:`~xla_permute.ColumnParallelLinear` gives it), ``target [...]`` (token ids or
    ``ignore_index``, the same on every rank) -> the loss, the same on every rank:
    ``l_t = log(sum_v exp(z_tv)) - z_t,target``, summed (``"sum"``), averaged over the tokens
    not ignored (``"mean"``) or per token (``"none"``). In float32 for half-precision logits.
    Backward (no collective): ``dz_tv = (softmax(z_t)_v - [v = target_t]) dl_t``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.dtype.is_floating_point or target.dtype.is_complex or target.dtype == torch.bool:
        raise TypeError(f"target must be an integer tensor of token ids, got {target.dtype}")
    if logits.dim() < 1 or target.shape != logits.shape[:-1]:
        want, got = tuple(logits.shape[:-1]), tuple(target.shape)
        raise ValueError(
            f"target must have the logits' shape without the vocabulary: {want}, got {got}"
        )
    ignore_index = check_int(ignore_index, "ignore_index")
    _, position, _ = check_tensor(logits, "logits", backend).position(groups)
    comm = dict(groups=groups, backend=backend)
    start = position * logits.shape[-1]
    loss = _VocabParallelCrossEntropy.apply(logits, target, start, ignore_index, comm)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / (target != ignore_index).sum()
