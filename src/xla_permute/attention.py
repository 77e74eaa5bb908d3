"""Ring attention (context parallelism) on CollectivePermute, forward and backward.

The sequence is split over the N ranks of a ring (layouts in :mod:`xla_permute.sequence`).
Every rank keeps its query block and passes its key/value block around the ring with N-1
CollectivePermutes; at each hop it attends its queries to the block it holds and merges the
result into a running (output, log-sum-exp) pair. No rank ever holds the whole K/V.

Per rank (``S/N`` this rank's share of the sequence, ``G = Hq/Hkv`` query heads per K/V head):

=============  ==========================  ===========================================
tensor         shape                       note
=============  ==========================  ===========================================
q              ``[B, Hq, S/N, D]``         stays on its rank
k, v           ``[B, Hkv, S/N, D]``        travel together, one permute per hop
out            ``[B, Hq, S/N, D]``         ``softmax(q k^T * scale + mask) v`` over all keys
lse            ``[B, Hkv, G, S/N]``        float32 log-sum-exp, saved for the backward
=============  ==========================  ===========================================

Merge of a block's ``(o_b, l_b)`` into the running ``(o, l)`` (float32; half precision is
rounded once at the end): ``l' = logaddexp(l, l_b)``, ``o' = o e^(l-l') + o_b e^(l_b-l')``
(``_merge``, in the form flash attention keeps: a division and a log once, at the end).

Backward (its own ring, flash-attention style): saved are q, k, v, out and lse, O(S/N) per
rank. Each block's probabilities are recomputed as ``p = exp(s - lse)``; with
``delta = rowsum(dout * out)``: ``dv += p^T dout``, ``ds = p (dout v^T - delta)``,
``dq += scale ds k``, ``dk += scale ds^T q``. dQ stays local; the dK/dV of a K/V block
travel one hop behind it, packed with it in one tensor (``[k, v, dk, dv]``, float32 for half
inputs): the permute that starts hop i carries K/V ahead for hop i+1 and the dK/dV of hop
i-1's block (the sum from the ranks before, plus this rank's share), so it waits for no
block of hop i, and every hop's compute overlaps its permute, as in the forward. Hop 0 sends
K/V alone, hop N-1 dK/dV alone, and one more permute of ``[dk, dv]`` brings them home: the
backward issues N+1 permutes carrying 2N-1 blocks (K/V N-1 times, dK/dV N times), the forward N-1.

Causal: blocks fully above the diagonal are skipped, not computed and discarded. Which
blocks a rank computes at each hop is :func:`ring_attention_schedule`, pure Python. The
collectives never depend on it: every rank issues the same permutes in the same order; only
the compute differs, and a rank whose last block is skipped still consumes the received
tensor (an optimisation barrier), so that its program keeps the permute the others wait for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from xla_permute.backends.select import BackendName, CommBackend, Ring, check_tensor
from xla_permute.collectives import all_gather
from xla_permute.debug import agree
from xla_permute.pairs import GroupsLike, check_int
from xla_permute.reference import accumulation_dtype
from xla_permute.sequence import check_layout, layout_chunks, layout_positions

__all__ = [
    "AttentionBlock",
    "AttentionHop",
    "all_gather_attention",
    "ring_attention",
    "ring_attention_schedule",
    "schedule_work",
]


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


def _span(chunks: tuple[int, ...], held: tuple[int, ...], size: int) -> slice:
    first = held.index(chunks[0])
    return slice(first * size, (first + len(chunks)) * size)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``q [B, Hkv, G, m, D]``, ``k [B, Hkv, n, D]`` -> scaled scores ``[B, Hkv, G, m, n]``.

    G folds into the rows (one batched dot, K not repeated); causal: ``-inf`` above the diagonal.
    """
    b, h, g, m, d = q.shape
    s = (q.reshape(b, h, g * m, d) @ k.transpose(-1, -2)).view(b, h, g, m, -1)
    if scale != 1.0:  # 1.0: the scale is in q already
        s = s * scale
    if causal:
        above = torch.ones(m, m, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _rows(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``p [B, Hkv, G, m, n] @ x [B, Hkv, n, D]`` -> ``[B, Hkv, G, m, D]``."""
    b, h, g, m, n = p.shape
    return (p.reshape(b, h, g * m, n) @ x).view(b, h, g, m, -1)


def _cols(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``p^T @ x`` summed over the G query heads: ``[B, Hkv, G, m, n]``, ``[B, Hkv, G, m, D]``
    -> ``[B, Hkv, n, D]``."""
    b, h, g, m, n = p.shape
    return p.permute(0, 1, 4, 2, 3).reshape(b, h, n, g * m) @ x.reshape(b, h, g * m, -1)


def _add(parts: list[Any], first: int, value: torch.Tensor, size: int, dim: int) -> None:
    """Add ``value`` (one or more chunks along ``dim``) into ``parts[first], parts[first+1]...``."""
    for j, piece in enumerate(value.split(size, dim)):
        parts[first + j] = piece if parts[first + j] is None else parts[first + j] + piece


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's online-softmax state ``(o, m, l)``: ``q [B, Hkv, G, m, D]`` (scaled), ``k,
    v [B, Hkv, n, D]`` -> ``o [B, Hkv, G, m, D]`` (unnormalised), ``m, l [B, Hkv, G, m]``: per
    query row the largest score ``m`` and ``l = sum exp(s - m)``; ``o = exp(s - m) v``."""
    s = _scores(q, k, 1.0, causal)
    m = s.amax(dim=-1)  # finite: every row keeps at least its diagonal key
    p = s.sub_(m[..., None]).exp_()  # in place: s is this block's own
    return _rows(p, v), m, p.sum(dim=-1)


def _merge(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The online-softmax merge of two states ``(o, m, l)`` of the same query rows, as flash
    attention keeps it: ``m' = max(m_a, m_b)``, ``o' = o_a e^(m_a-m') + o_b e^(m_b-m')``,
    ``l' = l_a e^(m_a-m') + l_b e^(m_b-m')``. Any order, one block at a time; the module's
    ``(out, lse)`` form is ``out = o / l``, ``lse = m + log l``, taken once at the end."""
    (o_a, m_a, l_a), (o_b, m_b, l_b) = a, b
    top = torch.maximum(m_a, m_b)
    wa, wb = torch.exp(m_a - top), torch.exp(m_b - top)
    return o_a * wa[..., None] + o_b * wb[..., None], top, l_a * wa + l_b * wb


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ring: Ring,
    hops: Sequence[AttentionHop],
    layout: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, Hkv, G, S/N, D]`` (acc dtype), ``k, v [B, Hkv, S/N, D]`` -> out, lse (acc):
    each hop's blocks (:func:`_attend`) merged (:func:`_merge`) into the state of their
    query chunk while the permute of the hop carries K/V on to rank r+1."""
    n = ring.size
    own = layout_chunks(n, ring.position, layout)
    size = q.shape[3] // len(own)
    state: list[Any] = [None] * len(own)  # per own chunk: (o, m, l)
    kv = torch.stack([k, v])  # K and V travel together: one permute per hop
    q = q * scale  # once, not on every block's scores
    for hop in hops:
        received = ring.send(kv) if hop.hop < n - 1 else None  # started before the blocks
        theirs = layout_chunks(n, hop.source, layout)
        for block in hop.blocks:
            qs, ks = _span(block.q_chunks, own, size), _span(block.k_chunks, theirs, size)
            k_b, v_b = kv[0, :, :, ks].to(q.dtype), kv[1, :, :, ks].to(q.dtype)
            parts = _attend(q[:, :, :, qs], k_b, v_b, block.causal)
            first = own.index(block.q_chunks[0])
            for i, part in enumerate(zip(*(t.split(size, 3) for t in parts), strict=True), first):
                state[i] = part if state[i] is None else _merge(state[i], part)
        if received is not None:
            kv = received.wait()
    out = torch.cat([o / total[..., None] for o, _, total in state], 3)
    lse = torch.cat([m + torch.log(total) for _, m, total in state], 3)
    # One optimisation barrier: a received K/V that no block used would otherwise leave this
    # rank's program with the permute that brought it, and its neighbour would wait forever.
    ring.keep([out, lse, kv])
    return out, lse


def _ring_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    ring: Ring,
    hops: Sequence[AttentionHop],
    layout: str,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All in acc dtype, grouped: ``q, out, dout [B, Hkv, G, S/N, D]`` -> dq, dk, dv; the
    dK/dV travel one hop behind their K/V, packed in one permute (module docstring)."""
    n = ring.size
    own = layout_chunks(n, ring.position, layout)
    size = q.shape[3] // len(own)
    delta = (dout * out).sum(-1)  # [B, Hkv, G, S/N]
    dq: list[Any] = [None] * len(own)
    kv = torch.stack([k, v])
    arrived = None  # dK/dV of the block held one hop back, summed over the ranks before this
    mine = None  # this rank's dK/dV of that block (None: it computed none of it)
    for hop in hops:
        i = hop.hop
        if n > 1:  # K/V ahead, dK/dV behind: ready before this hop's blocks
            behind = [_plus(arrived, mine, kv)] if i > 0 else []
            ahead = [kv] if i < n - 1 else []
            sent = ring.send(torch.cat(ahead + behind) if i and i < n - 1 else (ahead + behind)[0])
        theirs = layout_chunks(n, hop.source, layout)
        mine = _block_grads(q, kv, lse, dout, delta, dq, own, theirs, hop, size, scale)
        if n > 1:
            received = sent.wait()
            kv, arrived = (
                (received[:2], received[2:] if i else None) if i < n - 1 else (kv, received)
            )
    home = _plus(arrived, mine, kv)
    dkv = ring.send(home).wait() if n > 1 else home  # the last permute: home to the owner
    grad_q = torch.cat([torch.zeros_like(q[:, :, :, :size]) if d is None else d for d in dq], 3)
    ring.keep([grad_q, dkv, kv])  # a last K/V no block used stays in the program
    return grad_q, dkv[0], dkv[1]


def _plus(a: torch.Tensor | None, b: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``a + b`` where None is nothing (zeros like ``like`` if both are None)."""
    if a is None and b is None:
        return torch.zeros_like(like)
    return b if a is None else a if b is None else a + b


def _block_grads(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    dq: list[Any],
    own: tuple[int, ...],
    theirs: tuple[int, ...],
    hop: AttentionHop,
    size: int,
    scale: float,
) -> torch.Tensor | None:
    """This rank's ``[dk, dv]`` of the K/V block ``kv`` it holds at ``hop`` (None: no block
    there), and its dQ added into ``dq``."""
    if not hop.blocks:
        return None
    kk, vv = kv[0], kv[1]
    dk: list[Any] = [None] * len(theirs)
    dv: list[Any] = [None] * len(theirs)
    for block in hop.blocks:
        qs, ks = _span(block.q_chunks, own, size), _span(block.k_chunks, theirs, size)
        q_b, do_b = q[:, :, :, qs], dout[:, :, :, qs]
        s = _scores(q_b, kk[:, :, ks], scale, block.causal)
        p = torch.exp(s - lse[:, :, :, qs, None])
        ds = p * (_scores(do_b, vv[:, :, ks], 1.0, False) - delta[:, :, :, qs, None]) * scale
        first_k = theirs.index(block.k_chunks[0])
        _add(dv, first_k, _cols(p, do_b), size, 2)
        _add(dk, first_k, _cols(ds, q_b), size, 2)
        _add(dq, own.index(block.q_chunks[0]), _rows(ds, kk[:, :, ks]), size, 3)
    zero = torch.zeros_like(kk[:, :, :size])
    return torch.stack([torch.cat([zero if t is None else t for t in d], 2) for d in (dk, dv)])


class _RingAttention(torch.autograd.Function):
    """``out = attention(q, k, v)`` over the ring; backward: the ring of dK/dV (see module).
    ``meta``: ``(ring, hops, layout, scale)``, what both rings need besides the tensors."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: tuple):  # noqa: ANN205
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        qg = q.reshape(b, hkv, hq // hkv, s, d).to(accumulation_dtype(q.dtype))
        out, lse = _ring_forward(qg, k, v, *meta)
        ctx.meta = meta
        ctx.save_for_backward(q, k, v, out, lse)
        return out.reshape(b, hq, s, d).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse = ctx.saved_tensors
        acc = out.dtype
        b, hq, s, d = q.shape
        hkv = k.shape[1]
        grouped = (b, hkv, hq // hkv, s, d)
        q_, k_, v_, dout = (t.to(acc) for t in (q.reshape(grouped), k, v, grad.reshape(grouped)))
        dq, dk, dv = _ring_backward(q_, k_, v_, out, lse, dout, *ctx.meta)
        return dq.reshape(b, hq, s, d).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


#: Appended to the shape errors that a [B, S, H, D] tensor (heads and sequence swapped) causes.
_LAYOUT_HINT = (
    "q, k and v are [B, H, S/N, D] (heads before the sequence); from [B, S/N, H, D] pass "
    "q.transpose(1, 2) (and back for the output)"
)


def _check(
    q: object,
    k: object,
    v: object,
    causal: object,
    layout: object,
    scale: object,
    op: str,
    backend: str = "auto",
) -> tuple[float, CommBackend]:
    """Validate the arguments of ``op``; return the scale and the backend (resolved for q)."""
    chosen = check_tensor(q, "q", backend)
    for name, t in (("q", q), ("k", k), ("v", v)):
        chosen.check_tensor(t, name)
        if t.dim() != 4:  # type: ignore[union-attr]
            raise ValueError(f"{op}: {name} must be 4-D [B, H, S/N, D], got {tuple(t.shape)}")  # type: ignore[union-attr]
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor)
    if not q.dtype.is_floating_point or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"{op}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{op}: q, k, v are on {q.device}, {k.device}, {v.device}; use one")
    if k.shape != v.shape:
        raise ValueError(
            f"{op}: k and v must have one shape, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    (b, hq, s, d), hkv = q.shape, k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, s, d):
        raise ValueError(
            f"{op}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, local "
            f"sequence and head dim ([B, Hq, S/N, D] and [B, Hkv, S/N, D])"
        )
    if hkv < 1 or hq % hkv:
        raise ValueError(
            f"{op}: q has {hq} heads and k has {hkv}; the query heads must be a multiple of "
            f"the key/value heads (grouped-query attention). {_LAYOUT_HINT}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be True or False, got {causal!r}")
    check_layout(layout)
    if layout == "zigzag" and s % 2:
        raise ValueError(
            f"{op}: layout='zigzag' holds two equal chunks per rank, but the local sequence "
            f"length is {s} (odd); shard with xla_permute.shard_sequence(..., layout='zigzag'). "
            f"{_LAYOUT_HINT}"
        )
    if scale is None:
        return (1.0 / math.sqrt(d) if d else 1.0), chosen
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
        raise ValueError(f"{op}: scale must be a positive finite number or None, got {scale!r}")
    return float(scale), chosen


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
) -> torch.Tensor:
    """Attention of this rank's queries to the whole sequence, K/V passed around a ring.

    Args:
        q: ``[B, Hq, S/N, D]``, this rank's sequence shard (``layout``) on an XLA device.
        k, v: ``[B, Hkv, S/N, D]`` with ``Hq % Hkv == 0`` (grouped-query attention: query head
            ``h`` uses key/value head ``h // (Hq/Hkv)``; K/V are not repeated in memory).
            Heads come *before* the sequence: a ``[B, S/N, H, D]`` tensor is caught only when
            its shapes contradict; otherwise it runs and is wrong. Pass ``q.transpose(1, 2)``.
        causal: mask keys after the query's position (global positions, from ``layout``);
            fully masked blocks are skipped.
        layout: ``"contiguous"`` or ``"zigzag"`` (balances causal work), the one
            :func:`xla_permute.shard_sequence` cut the shards in (the op cannot see it).
        scale: the score scale, default ``1/sqrt(D)``.
        groups: replica groups of equal size; each is its own ring of ``N = len(group)``
            ranks, and ranks are numbered by their position in the group.
        backend: of the permutes (:func:`xla_permute.collective_permute`).

    Returns:
        ``[B, Hq, S/N, D]``: ``softmax(q K^T * scale + mask) V`` over the whole sequence, in
        the input dtype (merged in float32 for half inputs, rounded once). Differentiable:
        the backward is a ring of its own (module docstring). Collectives: N-1 permutes of
        ``[2, B, Hkv, S/N, D]`` forward; N+1 backward (2N-1 blocks), each overlapping a hop.
        Empty inputs issue none.

    Raises:
        TypeError, ValueError: bad tensors, dtypes, shapes, ``causal``, ``layout``, ``scale``,
            ``groups`` or ``backend``, before any collective (ranks that disagree: in debug
            mode, :mod:`xla_permute.debug`).
    """
    scale_, chosen = _check(q, k, v, causal, layout, scale, "ring_attention", backend)
    ring = Ring.build(groups, backend=chosen)
    options = {"groups": ring.groups, "backend": chosen.name, "causal": causal}
    options |= {"layout": layout, "scale": scale_}
    agree("ring_attention", {"q": q, "k": k}, options, backend=chosen)
    if q.numel() == 0 or k.numel() == 0:  # every rank agrees: no collective
        return q * 0 + (k.sum() + v.sum()) * 0
    ring.check(accumulation_dtype(q.dtype))
    hops = ring_attention_schedule(ring.size, ring.position, causal=causal, layout=layout)
    return _RingAttention.apply(q, k, v, (ring, hops, layout, scale_))


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    layout: str = "contiguous",
    scale: float | None = None,
) -> torch.Tensor:
    """The baseline: all-gather K and V (one all-gather of both), attend, over all ranks.

    Shapes, arguments and result as :func:`ring_attention` (no groups). Every rank holds the
    whole ``[2, B, Hkv, S, D]`` K/V and a ``[B, Hq, S/N, S]`` score matrix; the attention
    waits for the all-gather. Backward by autograd (a reduce-scatter of dK/dV).
    """
    scale_, chosen = _check(q, k, v, causal, layout, scale, "all_gather_attention")
    if q.numel() == 0 or k.numel() == 0:
        return q * 0 + (k.sum() + v.sum()) * 0
    n, rank = chosen.world_size(), chosen.rank()
    (b, hq, s, d), hkv = q.shape, k.shape[1]
    acc = accumulation_dtype(q.dtype)
    kv = all_gather(torch.stack([k, v]), dim=3, backend=chosen.name).to(acc)  # [2, B, Hkv, S, D]
    qg = q.reshape(b, hkv, hq // hkv, s, d).to(acc)
    scores = _scores(qg, kv[0], scale_, False)
    if causal:
        keys = torch.cat([layout_positions(n, r, layout, s) for r in range(n)])
        above = keys[None, :] > layout_positions(n, rank, layout, s)[:, None]
        scores = scores.masked_fill(above.to(q.device), float("-inf"))
    out = _rows(torch.softmax(scores, dim=-1), kv[1])
    return out.reshape(b, hq, s, d).to(q.dtype)
