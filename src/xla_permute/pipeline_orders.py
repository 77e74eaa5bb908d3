"""The schedules' policies: each rank's order of work, played out by
:func:`~xla_permute.pipeline_schedule.play` into a :class:`~xla_permute.pipeline_schedule.
PipelineSchedule`.

* ``"gpipe"``: every forward, then every backward (last micro-batch first);
* ``"1f1b"`` (PipeDream-flush, Megatron's non-interleaved schedule): ``p - r - 1`` warm-up
  forwards on rank ``r``, then one forward one backward, then the remaining backwards;
* ``"interleaved"`` (Megatron's interleaved 1F1B, ``v`` stages per rank in loop placement):
  forwards in groups of ``p`` micro-batches per stage, ``2 (p - r - 1) + (v - 1) p`` warm-up
  forwards, then one forward one backward (``m >= p``; when ``p`` does not divide ``m`` the
  last group takes the remainder).

Counted from the data (ticks of equal length): the bubble is ``(p-1)/(m+p-1)`` for GPipe and
1F1B and ``(p-1)/(v m + p-1)`` interleaved; the peak number of micro-batches whose activations a
rank holds is ``m`` for GPipe and at most ``p`` for 1F1B.

>>> s = make_schedule("interleaved", 4, 8, stages_per_rank=2)
>>> s.ticks, s.bubble_fraction == 3 / 19, s.peak_in_flight, s.stages_of(1)
(38, True, (11, 9, 7, 5), (1, 5))
"""

from __future__ import annotations

from fractions import Fraction

from xla_permute.pipeline_schedule import Cell, PipelineSchedule, Work, check_count, play

__all__ = ["SCHEDULES", "make_schedule", "split_layers", "theory_bubble_fraction"]

#: Every schedule :func:`make_schedule` builds.
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved")


def _gpipe(p: int, m: int, v: int) -> list[list[Cell]]:
    return [
        [Work("F", i, r) for i in range(m)] + [Work("B", i, r) for i in reversed(range(m))]
        for r in range(p)
    ]


def _one_f_one_b(p: int, m: int, v: int) -> list[list[Cell]]:
    orders: list[list[Cell]] = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order: list[Cell] = [Work("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Work("F", warmup + i, r), Work("B", i, r)]
        order += [Work("B", i, r) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def _megatron_table(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron's order of (micro-batch, local stage): groups of ``group`` micro-batches run
    stage by stage; the last group takes the remainder (``m % group``)."""
    table = []
    for first in range(0, m, group):
        end = m if first + 2 * group > m else first + group
        table += [(i, c) for c in range(v) for i in range(first, end)]
        if end == m:
            break
    return table


def _interleaved(p: int, m: int, v: int) -> list[list[Cell]]:
    """Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) g`` forwards (all of them when that
    is more), then alternates; ``g = p``, or the last group's size ``p + m mod p`` when ``p``
    does not divide ``m`` (a larger group needs that many more forwards in flight to keep the
    last stage fed: ``(v - 1) (m mod p)`` more activations held, the same bubble)."""
    table = _megatron_table(m, v, p)
    last_group = p + m % p if m >= 2 * p else m
    total = m * v
    orders: list[list[Cell]] = []
    for r in range(p):
        forwards = [Work("F", i, c * p + r) for i, c in table]
        backwards = [Work("B", i, (v - 1 - c) * p + r) for i, c in table]
        warmup = min(2 * (p - r - 1) + (v - 1) * last_group, total)
        order: list[Cell] = list(forwards[:warmup])
        for j in range(total - warmup):
            order += [forwards[warmup + j], backwards[j]]
        order += backwards[total - warmup :]
        orders.append(order)
    return orders


_ORDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved}
_MULTI = {"interleaved"}  # schedules of several stages per rank


def make_schedule(
    name: str, ranks: int, micro_batches: int, stages_per_rank: int = 1
) -> PipelineSchedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for ``ranks`` ranks, ``micro_batches``
    micro-batches and ``stages_per_rank`` stages per rank, as data.

    >>> make_schedule("gpipe", 2, 4, stages_per_rank=2)
    Traceback (most recent call last):
    ...
    ValueError: stages_per_rank=2 needs schedule='interleaved'; ...
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    p = check_count(ranks, "ranks", "a pipeline needs at least one rank")
    m = check_count(micro_batches, "micro_batches", "pass at least one micro-batch")
    v = check_count(stages_per_rank, "stages_per_rank", "every rank holds at least one stage")
    if name in _MULTI and v == 1:
        name = "1f1b"  # interleaving one stage per rank is 1F1B
    elif name not in _MULTI and v != 1:
        raise ValueError(
            f"stages_per_rank={v} needs schedule='interleaved'; {name} runs one stage per rank "
            f"(pass stages_per_rank=1, or schedule='interleaved')"
        )
    if name == "interleaved" and m < p:
        raise ValueError(
            f"micro_batches={m} is below ranks={p}: the interleaved schedule runs micro-batches "
            f"through each stage in groups of {p} (one per rank), so pass micro_batches >= {p} "
            f"(a multiple of {p} keeps the groups equal), or stages_per_rank=1 for plain 1F1B"
        )
    return play(name, p, m, v, _ORDERS[name](p, m, v))


def theory_bubble_fraction(schedule: PipelineSchedule) -> Fraction:
    """The schedule's bubble in closed form, exact: ``(p-1)/(v m + p-1)`` for GPipe, 1F1B
    (``v = 1``) and interleaved 1F1B."""
    p, m, v = schedule.ranks, schedule.micro_batches, schedule.stages_per_rank
    return Fraction(p - 1, v * m + p - 1)


def split_layers(
    layers: int, ranks: int, stages_per_rank: int = 1
) -> tuple[tuple[range, ...], ...]:
    """Which layers each rank's stages hold (loop placement): ``result[r][c]`` is the range of
    layers of stage ``c * ranks + r``, ``layers / (ranks * stages_per_rank)`` consecutive
    layers each.

    >>> split_layers(8, 2, 2)
    ((range(0, 2), range(4, 6)), (range(2, 4), range(6, 8)))
    >>> split_layers(6, 2, 2)
    Traceback (most recent call last):
    ...
    ValueError: layers=6 do not split into 2 ranks x 2 stages per rank = 4 equal stages; ...
    """
    n = check_count(layers, "layers", "a model has at least one layer")
    p = check_count(ranks, "ranks", "a pipeline needs at least one rank")
    v = check_count(stages_per_rank, "stages_per_rank", "every rank holds at least one stage")
    if n % (p * v):
        fits = [c for c in range(1, n + 1) if n % (p * c) == 0]
        raise ValueError(
            f"layers={n} do not split into {p} ranks x {v} stages per rank = {p * v} equal "
            f"stages; use a number of layers divisible by {p * v}"
            + (f", or stages_per_rank in {fits}" if fits else f", or fewer ranks than {p}")
        )
    size = n // (p * v)
    return tuple(
        tuple(range((c * p + r) * size, (c * p + r + 1) * size) for c in range(v)) for r in range(p)
    )
