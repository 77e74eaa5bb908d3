"""Pipeline schedules as data: GPipe, 1F1B and interleaved 1F1B, tick by tick and rank by rank.

A pipeline of ``p`` ranks (stages) holds ``v`` model *chunks* per rank: chunk ``c`` of rank
``r`` is **virtual stage** ``k = c * p + r`` of ``V = p * v`` (``v = 1``: one stage per rank).
A micro-batch runs forward through virtual stages ``0 .. V-1`` and backward through them in
reverse. One *tick* is one unit of work per rank, the forward (``F``) or the backward (``B``)
of one micro-batch on one chunk, or nothing (the bubble). After a tick every rank that did a
forward hands the output to the next virtual stage and every rank that did a backward hands
the input gradient to the previous one: at most **one forward shift** (offset ``+1``) and **one
backward shift** (offset ``-1``) per tick, each one :func:`~xla_permute.shift.stage_shift`.
A hand-off from virtual stage ``c*p + p-1`` to ``(c+1)*p`` goes from the last rank to the first:
interleaved schedules need the ring form of the shift.

Each schedule is each rank's **order** of work (the policy) played out tick by tick: a rank
runs its next item as soon as its input arrived (a forward needs the previous virtual stage's
forward one tick earlier; a backward the next virtual stage's backward one tick earlier, or,
on the last virtual stage, its own forward). The orders:

* GPipe: every forward, then every backward (last micro-batch first);
* 1F1B (PipeDream-flush, Megatron's non-interleaved schedule): ``p - r - 1`` warm-up forwards,
  then one forward one backward, then the remaining backwards;
* interleaved 1F1B (Megatron's): forwards in groups of ``p`` micro-batches per chunk,
  ``2 (p - r - 1) + (v - 1) p`` warm-up forwards, then one forward one backward (``m >= p``;
  when ``p`` does not divide ``m`` the last group takes the remainder).

Counted from the data (ticks of equal length, forward = backward): the bubble is
``(p-1)/(m+p-1)`` for GPipe and 1F1B and ``(p-1)/(v m + p-1)`` interleaved; the peak number of
micro-batches whose activations a rank holds is ``m`` for GPipe and at most ``p`` for 1F1B.

>>> s = one_f_one_b_schedule(stages=2, micro_batches=3)
>>> [" ".join(str(w) if w else "." for w in tick) for tick in s.work]
['F0 .', 'F1 F0', '. B0', 'B0 F1', 'F2 B1', 'B1 F2', '. B2', 'B2 .']
>>> s.ticks, s.bubble_fraction, s.peak_in_flight
(8, 0.25, (2, 1))
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Literal

__all__ = [
    "SCHEDULES",
    "PipelineSchedule",
    "Send",
    "Work",
    "gpipe_step_schedule",
    "interleaved_schedule",
    "make_schedule",
    "one_f_one_b_schedule",
    "split_layers",
]

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


def check_count(value: object, name: str, fix: str) -> int:
    if not isinstance(value, (bool, int)):
        with contextlib.suppress(TypeError):  # numpy / torch integer scalars
            value = operator.index(value)  # type: ignore[arg-type]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}={value} is below 1; {fix}")
    return value


@dataclass(frozen=True, order=True)
class Work:
    """One unit of work: the forward (``"F"``) or backward (``"B"``) of ``micro_batch`` on
    this rank's ``chunk``."""

    kind: Literal["F", "B"]
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        chunk = f".{self.chunk}" if self.chunk else ""
        return f"{self.kind}{self.micro_batch}{chunk}"


@dataclass(frozen=True)
class Send:
    """What a rank hands on after a tick: ``offset`` +1 (an activation, to the next virtual
    stage) or -1 (a gradient, to the previous one), for ``micro_batch``, arriving at the
    receiver's ``chunk``."""

    offset: int
    micro_batch: int
    chunk: int


@dataclass(frozen=True)
class PipelineSchedule:
    """Which work every rank does at every tick, and what it sends which way after it.

    ``work[t][r]``: rank ``r``'s :class:`Work` at tick ``t`` (``None``: idle, the bubble).
    ``sends[t][r]``: what rank ``r`` hands on after tick ``t`` (a :class:`Send` or ``None``);
    ``receives(t, r)``: what arrives at rank ``r`` after tick ``t``. Every figure below is
    counted from ``work``.
    """

    name: str
    stages: int
    micro_batches: int
    chunks: int
    work: tuple[tuple[Work | None, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    @property
    def ticks(self) -> int:
        return len(self.work)

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """``chunk * stages + rank``: where rank ``rank``'s chunk sits in the model."""
        return chunk * self.stages + rank

    @cached_property
    def sends(self) -> tuple[tuple[Send | None, ...], ...]:
        p, last = self.stages, self.virtual_stages - 1

        def send(r: int, w: Work | None) -> Send | None:
            if w is None:
                return None
            k = self.virtual_stage(r, w.chunk)
            if w.kind == "F" and k < last:
                return Send(+1, w.micro_batch, (k + 1) // p)
            if w.kind == "B" and k > 0:
                return Send(-1, w.micro_batch, (k - 1) // p)
            return None

        return tuple(tuple(send(r, w) for r, w in enumerate(tick)) for tick in self.work)

    def receives(self, tick: int, rank: int) -> dict[int, Send]:
        """What arrives at ``rank`` after ``tick``, by offset (+1: an activation from rank
        ``rank - 1``, -1: a gradient from ``rank + 1``, both modulo ``stages``)."""
        sends, p = self.sends[tick], self.stages
        out = {}
        for offset in (+1, -1):
            s = sends[(rank - offset) % p]
            if s is not None and s.offset == offset and p > 1:
                out[offset] = s
        return out

    def shifts(self, tick: int) -> tuple[int, ...]:
        """The shifts every rank issues after ``tick``: ``+1`` when some rank sends an
        activation, ``-1`` when some rank sends a gradient (at most one of each)."""
        sent = {s.offset for s in self.sends[tick] if s is not None}
        return tuple(o for o in (+1, -1) if o in sent)

    @property
    def shift_count(self) -> int:
        """Stage shifts in one step (each one permute)."""
        return sum(len(self.shifts(t)) for t in range(self.ticks))

    @property
    def needs_ring(self) -> bool:
        """Whether the last rank hands on to the first, as interleaved schedules do (chunk
        ``c`` of the last rank feeds chunk ``c + 1`` of the first)."""
        return self.chunks > 1

    @property
    def idle_ticks(self) -> tuple[int, ...]:
        """Idle ticks per rank."""
        return tuple(sum(tick[r] is None for tick in self.work) for r in range(self.stages))

    @property
    def bubble_fraction(self) -> float:
        """Idle rank-ticks over all rank-ticks."""
        return sum(self.idle_ticks) / (self.ticks * self.stages)

    @property
    def theory_bubble_fraction(self):  # a fractions.Fraction, exact
        """The textbook bubble as an exact fraction, ``(p-1)/(m+p-1)`` for GPipe and 1F1B
        and ``(p-1)/(v m + p-1)`` interleaved."""
        p, m, v = self.stages, self.micro_batches, self.chunks
        return Fraction(p - 1, v * m + p - 1)

    def in_flight(self, rank: int) -> tuple[int, ...]:
        """Per tick, the (micro-batch, chunk) activations rank ``rank`` holds after the tick:
        forwards done whose backward has not run."""
        live, out = 0, []
        for tick in self.work:
            w = tick[rank]
            if w is not None:
                live += 1 if w.kind == "F" else -1
            out.append(live)
        return tuple(out)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per rank, the most chunk activations held at once (in micro-batches of one chunk;
        divide by ``chunks`` for stage-sized activations)."""
        return tuple(max(self.in_flight(r)) for r in range(self.stages))


def _play(name: str, stages: int, micro_batches: int, chunks: int, orders) -> PipelineSchedule:
    """Play each rank's order out tick by tick, every item as early as its input allows."""
    p, last = stages, stages * chunks - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> tick
    position = [0] * p
    work: list[tuple[Work | None, ...]] = []
    total = sum(len(o) for o in orders)
    t = 0
    while sum(position) < total:
        row: list[Work | None] = [None] * p
        for r in range(p):
            if position[r] == len(orders[r]):
                continue
            w = orders[r][position[r]]
            k = w.chunk * p + r
            if w.kind == "F":
                need = None if k == 0 else ("F", w.micro_batch, k - 1)
            else:
                need = ("F", w.micro_batch, k) if k == last else ("B", w.micro_batch, k + 1)
            if need is None or done.get(need, t) < t:
                row[r] = w
        for r, w in enumerate(row):
            if w is not None:
                done[(w.kind, w.micro_batch, w.chunk * p + r)] = t
                position[r] += 1
        work.append(tuple(row))
        t += 1
        if t > 4 * total + 4 * p:  # an order that waits for itself (never for ours)
            raise RuntimeError(f"the {name} orders deadlock at tick {t}")
    return PipelineSchedule(name, stages, micro_batches, chunks, tuple(work))


def _check(stages: object, micro_batches: object) -> tuple[int, int]:
    p = check_count(stages, "stages", "a pipeline needs at least one stage")
    m = check_count(micro_batches, "micro_batches", "pass at least one micro-batch")
    return p, m


def gpipe_step_schedule(stages: int, micro_batches: int) -> PipelineSchedule:
    """GPipe as one step of ticks: all forwards, then all backwards (last micro-batch first).

    >>> s = gpipe_step_schedule(4, 8)
    >>> s.ticks, s.bubble_fraction == 3 / 11, s.peak_in_flight
    (22, True, (8, 8, 8, 8))
    """
    p, m = _check(stages, micro_batches)
    orders = [
        [Work("F", i) for i in range(m)] + [Work("B", i) for i in reversed(range(m))]
        for _ in range(p)
    ]
    return _play("gpipe", p, m, 1, orders)


def one_f_one_b_schedule(stages: int, micro_batches: int) -> PipelineSchedule:
    """1F1B with a flush: ``p - r - 1`` warm-up forwards on rank ``r``, then one forward one
    backward, then the remaining backwards. Any ``m >= 1`` (``m < p``: fewer warm-ups).

    >>> s = one_f_one_b_schedule(4, 8)
    >>> s.ticks, s.bubble_fraction == 3 / 11, s.peak_in_flight
    (22, True, (4, 3, 2, 1))
    """
    p, m = _check(stages, micro_batches)
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Work("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Work("F", warmup + i), Work("B", i)]
        order += [Work("B", i) for i in range(m - warmup, m)]
        orders.append(order)
    return _play("1f1b", p, m, 1, orders)


def _megatron_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron's order of (micro-batch, chunk): groups of ``group`` micro-batches run chunk
    by chunk; the last group takes the remainder (``m % group``)."""
    table = []
    for first in range(0, m, group):
        end = m if first + 2 * group > m else first + group
        table += [(i, c) for c in range(v) for i in range(first, end)]
        if end == m:
            break
    return table


def interleaved_schedule(stages: int, micro_batches: int, chunks: int) -> PipelineSchedule:
    """Megatron's interleaved 1F1B: ``chunks`` model chunks per rank (virtual stages).

    Forwards run in groups of ``p`` micro-batches, chunk 0 then chunk 1 ... (the last group
    also takes the ``m mod p`` left over); backwards in the same order with the chunks
    reversed. Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) g`` forwards (all of them when
    that is more), then alternates; ``g = p``, or the last group's size ``p + m mod p`` when
    ``p`` does not divide ``m`` (a larger group needs that many more forwards in flight to keep
    the last stage fed: ``(v - 1) (m mod p)`` more activations held, the same bubble).
    ``chunks=1`` is :func:`one_f_one_b_schedule`.

    Raises ValueError for ``micro_batches < stages`` with ``chunks > 1``: the groups of ``p``
    micro-batches are what keeps every rank's next chunk fed.

    >>> s = interleaved_schedule(4, 8, 2)
    >>> s.ticks, s.bubble_fraction == 3 / 19, s.peak_in_flight
    (38, True, (11, 9, 7, 5))
    """
    p, m = _check(stages, micro_batches)
    v = check_count(chunks, "chunks", "every rank holds at least one model chunk")
    if v == 1:
        return one_f_one_b_schedule(p, m)
    if m < p:
        raise ValueError(
            f"micro_batches={m} is below stages={p}: the interleaved schedule runs micro-batches "
            f"through each chunk in groups of {p} (one per stage), so pass micro_batches >= {p} "
            f"(a multiple of {p} keeps the groups equal), or chunks=1 for plain 1F1B"
        )
    table = _megatron_table(m, v, p)
    last_group = p + m % p if m >= 2 * p else m  # the last group takes the remainder
    total = m * v
    orders = []
    for r in range(p):
        forwards = [Work("F", i, c) for i, c in table]
        backwards = [Work("B", i, v - 1 - c) for i, c in table]
        warmup = min(2 * (p - r - 1) + (v - 1) * last_group, total)
        order = forwards[:warmup]
        for j in range(total - warmup):
            order += [forwards[warmup + j], backwards[j]]
        order += backwards[total - warmup :]
        orders.append(order)
    return _play("interleaved", p, m, v, orders)


def make_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> PipelineSchedule:
    """The schedule ``name`` (``"gpipe"``, ``"1f1b"`` or ``"interleaved"``) as data.

    >>> make_schedule("1f1b", 2, 4) == one_f_one_b_schedule(2, 4)
    True
    >>> make_schedule("gpipe", 2, 4, chunks=2)
    Traceback (most recent call last):
    ...
    ValueError: chunks=2 needs schedule='interleaved'; ...
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    v = check_count(chunks, "chunks", "every rank holds at least one model chunk")
    if name == "interleaved":
        return interleaved_schedule(stages, micro_batches, v)
    if v != 1:
        raise ValueError(
            f"chunks={v} needs schedule='interleaved'; {name} runs one chunk per rank "
            f"(pass one chunk per rank, or schedule='interleaved')"
        )
    if name == "gpipe":
        return gpipe_step_schedule(stages, micro_batches)
    return one_f_one_b_schedule(stages, micro_batches)


def split_layers(layers: int, stages: int, chunks: int = 1) -> tuple[tuple[range, ...], ...]:
    """Which layers each rank's chunks hold: ``result[r][c]`` is the range of layers of
    virtual stage ``c * stages + r``, ``layers / (stages * chunks)`` consecutive layers each.

    >>> split_layers(8, 2, 2)
    ((range(0, 2), range(4, 6)), (range(2, 4), range(6, 8)))
    >>> split_layers(6, 2, 2)
    Traceback (most recent call last):
    ...
    ValueError: layers=6 do not split into 2 stages x 2 chunks = 4 equal chunks; ...
    """
    n = check_count(layers, "layers", "a model has at least one layer")
    p = check_count(stages, "stages", "a pipeline needs at least one stage")
    v = check_count(chunks, "chunks", "every rank holds at least one model chunk")
    if n % (p * v):
        fits = [c for c in range(1, n + 1) if n % (p * c) == 0]
        raise ValueError(
            f"layers={n} do not split into {p} stages x {v} chunks = {p * v} equal chunks; "
            f"use a number of layers divisible by {p * v}"
            + (f", or chunks in {fits}" if fits else f", or fewer stages than {p}")
        )
    size = n // (p * v)
    return tuple(
        tuple(range((c * p + r) * size, (c * p + r + 1) * size) for c in range(v)) for r in range(p)
    )
