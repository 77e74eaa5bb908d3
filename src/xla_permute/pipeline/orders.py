"""The schedules' policies: each rank's order of work, played out by
:func:`~xla_permute.pipeline.schedule.play` into a
:class:`~xla_permute.pipeline.schedule.PipelineSchedule`.

* ``"gpipe"``: every forward, then every backward (last micro-batch first);
* ``"1f1b"`` (PipeDream-flush, Megatron's non-interleaved schedule): ``p - r - 1`` warm-up
  forwards on rank ``r``, then one forward one backward, then the remaining backwards;
* ``"interleaved"`` (Megatron's interleaved 1F1B, ``v`` stages per rank in loop placement):
  forwards in groups of ``p`` micro-batches per stage, then one forward one backward;
* ``"looped_bfs"`` (breadth-first): every micro-batch through a rank's first stage, then next;
* ``"zbh1"`` and ``"zb1p"`` (zero bubble, one and ``v`` stages per rank): 1F1B and
  interleaved 1F1B with each ``B`` split into ``I`` and a ``W`` held back;
* ``"zbv"`` (ZB-V) and ``"dualpipev"`` (DualPipeV): two stages per rank in a V, ``F I W``
  (ZB-V) or overlapped forward + backward ticks (DualPipeV) in the steady state.

Every schedule that PyTorch 2.9 also has gives PyTorch's order of work on every rank (tests/
test_pipeline_torch.py: identical, or the two differences explained there). Counted from the
data, every cell one tick: the bubble is :func:`theory_bubble_fraction`; the peak number of
micro-batches whose activations a rank holds is ``m`` for GPipe and at most ``p`` for 1F1B.

>>> s = make_schedule("interleaved", 4, 8, stages_per_rank=2)
>>> s.ticks, s.bubble_fraction == 3 / 19, s.peak_in_flight, s.stages_of(1)
(38, True, (11, 9, 7, 5), (1, 5))
"""

from __future__ import annotations

from fractions import Fraction

from xla_permute.pipeline.schedule import Cell, Overlap, PipelineSchedule, Work, check_count, play

__all__ = [
    "SCHEDULES", "make_schedule", "stages_per_rank", "theory_bubble_fraction",
]  # fmt: skip


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


def _looped_bfs(p: int, m: int, v: int) -> list[list[Cell]]:
    """Breadth-first (Lamy-Poirier, arXiv 2211.05953): every micro-batch through a rank's
    first stage, then its next, ...; the backwards in reverse, last stage and micro-batch
    first."""
    orders: list[list[Cell]] = []
    for r in range(p):
        held = [c * p + r for c in range(v)]
        order: list[Cell] = [Work("F", i, k) for k in held for i in range(m)]
        order += [Work("B", i, k) for k in reversed(held) for i in reversed(range(m))]
        orders.append(order)
    return orders


def _zero_bubble(p: int, m: int, v: int) -> list[list[Cell]]:
    """ZB1P (Qi et al., arXiv 2401.10241; ``v = 1``: ZB-H1): interleaved 1F1B with each
    backward split into ``I`` and ``W``. Rank ``r`` warms up with ``(v - 1) g + p - r - 1``
    forwards (``g`` micro-batches per round, ``m`` split into rounds of about ``p``), then runs
    ``F I`` pairs; from its ``r``-th backward on, each ``I`` is followed by the oldest ``W``
    still owed, and the rest of the ``W`` close the step. The ``W`` held back on rank ``r``
    fill the ticks where 1F1B's rank ``r`` waits for a gradient."""
    rounds = max(1, m // p)
    group = m // rounds
    orders: list[list[Cell]] = []
    for r in range(p):
        total = m * v
        warmup = min((v - 1) * group + p - 1 - r, total)

        def forward_stage(op: int, r: int = r) -> int:
            return (op // group) % v * p + r

        def backward_stage(op: int, warmup: int = warmup, r: int = r) -> int:
            return (v - 1 - (op - warmup) // group % v) * p + r

        count = {"F": [0] * (p * v), "I": [0] * (p * v), "W": [0] * (p * v)}

        def unit(kind: str, k: int, count=count) -> Work:
            count[kind][k] += 1
            return Work(kind, count[kind][k] - 1, k)  # type: ignore[arg-type]

        order: list[Cell] = [unit("F", forward_stage(op)) for op in range(warmup)]
        owed: list[int] = []  # the stages of the backwards whose W has not run
        for op in range(warmup, total + warmup):
            if op < total:
                order.append(unit("F", forward_stage(op)))
            k = backward_stage(op)
            order.append(unit("I", k))
            owed.append(k)
            if op - warmup >= r:
                order.append(unit("W", owed.pop(0)))
        order += [unit("W", k) for k in owed]
        orders.append(order)
    return orders


def _zbv(p: int, m: int, v: int) -> list[list[Cell]]:
    """ZB-V (Qi et al., arXiv 2401.10241, section 6): stages ``r`` and ``2p-1-r`` on rank
    ``r``, so the last stage sits on rank 0 beside the first. Warm-up: ``2 (p - r) - 1``
    forwards of the first stage, then ``r`` pairs of both stages' forwards, then ``p - r``
    rounds of ``F I W`` on the second stage; steady: ``F I W`` on the first stage then on the
    second; cool-down: the remaining ``I`` of both stages, then every ``W``."""
    n = max(2 * p - 1, m)  # planned as if there were at least 2p - 1 micro-batches
    orders: list[list[Cell]] = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        count = {(kind, k): 0 for kind in "FIW" for k in (first, second)}

        def unit(kind: str, k: int, count=count) -> Work:
            count[kind, k] += 1
            return Work(kind, count[kind, k] - 1, k)  # type: ignore[arg-type]

        order: list[Cell] = [unit("F", first) for _ in range(2 * (p - r) - 1)]
        for _ in range(r):
            order += [unit("F", second), unit("F", first)]
        for _ in range(p - r):
            order += [unit("F", second), unit("I", second), unit("W", second)]
        while count["F", second] < count["F", first] or count["F", first] < n:
            if count["F", first] < n:
                order.append(unit("F", first))
            order += [unit("I", first), unit("W", first)]
            order += [unit("F", second), unit("I", second), unit("W", second)]
        for _ in range(r):
            order += [unit("I", first), unit("I", second)]
        for _ in range(p - r):
            order += [unit("I", first), unit("W", first)]
        while count["W", second] < count["I", second]:
            order.append(unit("W", second))
        while count["W", first] < count["I", first]:
            order.append(unit("W", first))
        orders.append([w for w in order if isinstance(w, Work) and w.micro_batch < m])
    return orders


def _dualpipev(p: int, m: int, v: int) -> list[list[Cell]]:
    """DualPipeV (DeepSeek-V3's DualPipe folded onto ``p`` ranks in a V, arXiv 2412.19437, as
    PyTorch and deepseek-ai/DualPipe order it): forwards of the first stage, then of both;
    ``I W F`` on the second stage; the steady state overlaps a forward of one stage with a
    full backward of the other in one tick (:class:`~xla_permute.pipeline.schedule.Overlap`);
    the cool-down runs backwards, half of them split into ``I`` and a ``W`` held back."""
    orders: list[list[Cell]] = []
    for r in range(p):
        first, second = r, 2 * p - 1 - r
        count = {(kind, k): 0 for kind in "FIW" for k in (first, second)}
        owed: list[tuple[int, int]] = []  # (stage, micro-batch) of a W held back
        order: list[Cell] = []

        def unit(kind: str, k: int, count=count, owed=owed) -> Work:
            key = ("I", k) if kind == "B" else (kind, k)
            i = count[key]
            count[key] += 1
            if kind == "B":
                count["W", k] += 1
            elif kind == "I":
                owed.append((k, i))
            return Work(kind, i, k)  # type: ignore[arg-type]

        def held_back(owed=owed, count=count) -> list[Cell]:
            if not owed:
                return []
            k, i = owed.pop(0)
            count["W", k] += 1
            return [Work("W", i, k)]

        order += [unit("F", first) for _ in range(2 * (p - r - 1))]
        for _ in range(r + 1):
            order += [unit("F", first), unit("F", second)]
        for _ in range(p - r - 1):
            order += [unit("I", second), *held_back(), unit("F", second)]
        for j in range(m - 2 * p + r + 1):
            if j == 0 and r == p - 1:  # not overlapped, to shrink the bubble further
                order += [unit("F", first), unit("B", second)]
            else:
                order.append(Overlap(unit("F", first), unit("B", second)))
            order.append(Overlap(unit("F", second), unit("B", first)))
        for _ in range(p - r - 1):
            order += [unit("B", second), Overlap(unit("F", second), unit("B", first))]
        split = False
        for j in range(r + 1):
            if j == (r + 1) // 2 and r % 2 == 1:
                split = True
            order.append(unit("I" if split else "B", second))
            if j == (r + 1) // 2 and r % 2 == 0:
                split = True
            order.append(unit("I" if split else "B", first))
        for _ in range(p - r - 1):
            order += [*held_back(), unit("I" if split else "B", first)]
        for _ in range(r + 1):
            order += held_back()
        orders.append(order)
    return orders


_ORDERS = {
    "gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved": _interleaved, "looped_bfs": _looped_bfs,
    "zbh1": _zero_bubble, "zb1p": _zero_bubble, "zbv": _zbv, "dualpipev": _dualpipev,
}  # fmt: skip
#: Every schedule :func:`make_schedule` builds.
SCHEDULES: tuple[str, ...] = tuple(_ORDERS)
_MULTI = {"interleaved", "looped_bfs", "zb1p"}  # any number of stages per rank
_V = {"zbv", "dualpipev"}  # two stages per rank, in a V


def make_schedule(
    name: str, ranks: int, micro_batches: int, stages_per_rank: int = 1
) -> PipelineSchedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) for ``ranks`` ranks, ``micro_batches``
    micro-batches and ``stages_per_rank`` stages per rank, as data.

    >>> make_schedule("gpipe", 2, 4, stages_per_rank=2)
    Traceback (most recent call last):
    ...
    ValueError: stages_per_rank=2 needs one of [...]; gpipe runs one stage per rank ...
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {name!r}")
    p = check_count(ranks, "ranks", "a pipeline needs at least one rank")
    m = check_count(micro_batches, "micro_batches", "pass at least one micro-batch")
    v = check_count(stages_per_rank, "stages_per_rank", "every rank holds at least one stage")
    if name in _V:
        if v != 2:
            raise ValueError(
                f"stages_per_rank={v}: {name} places 2 stages on every rank, in a V (stages r "
                f"and 2p-1-r on rank r); pass stages_per_rank=2"
            )
        if name == "dualpipev" and p < 2:
            raise ValueError(
                "ranks=1: dualpipev overlaps the two legs of a V across ranks; pass ranks >= 2"
            )
        if name == "dualpipev" and m < 2 * p:
            raise ValueError(
                f"micro_batches={m} is below the {2 * p} stages: dualpipev needs at least one "
                f"micro-batch per stage, so pass micro_batches >= {2 * p}"
            )
        return play(name, p, m, v, _ORDERS[name](p, m, v), placement="v")
    if name == "interleaved" and v == 1:
        name = "1f1b"  # interleaving one stage per rank is 1F1B
    elif name == "zb1p" and v == 1:
        name = "zbh1"  # ZB1P with one stage per rank is ZB-H1
    elif name not in _MULTI and v != 1:
        raise ValueError(
            f"stages_per_rank={v} needs one of {sorted(_MULTI | _V)}; {name} runs one stage "
            f"per rank (pass stages_per_rank=1, or another schedule)"
        )
    if name == "interleaved" and m < p:
        raise ValueError(
            f"micro_batches={m} is below ranks={p}: the interleaved schedule runs micro-batches "
            f"through each stage in groups of {p} (one per rank), so pass micro_batches >= {p} "
            f"(a multiple of {p} keeps the groups equal), or stages_per_rank=1 for plain 1F1B"
        )
    if name in ("zbh1", "zb1p") and m % max(1, m // p):
        rounds = m // p
        raise ValueError(
            f"micro_batches={m} does not split into {rounds} equal rounds of about {p}: {name} "
            f"runs micro-batches in rounds of m // (m // p); pass a multiple of {rounds}"
        )
    return play(name, p, m, v, _ORDERS[name](p, m, v))


def stages_per_rank(schedule: str | PipelineSchedule, stages: int, ranks: int) -> int:
    """How many of a model's ``stages`` each of ``ranks`` ranks holds under ``schedule`` (a name
    or a :class:`PipelineSchedule`); ValueError naming the split points to pass if they differ."""
    if isinstance(schedule, PipelineSchedule):
        name, v = schedule.name, schedule.stages_per_rank
    else:
        name, v = schedule, 2 if schedule in _V else 1
        v = stages // ranks if schedule in _MULTI else v
    if stages != ranks * v and (name in SCHEDULES or isinstance(schedule, PipelineSchedule)):
        more = f" (or {ranks} more, ...: a multiple of {ranks} stages)" if name in _MULTI else ""
        raise ValueError(
            f"modules holds {stages} stages; {name} runs {max(v, 1)} per rank on {ranks} ranks: "
            f"pass split_model {ranks * max(v, 1) - 1} split points{more}"
        )
    return v


def theory_bubble_fraction(schedule: PipelineSchedule) -> Fraction:
    """The schedule's bubble in closed form, exact, with every cell one tick (``B`` as long as
    ``F``; ``I`` and ``W`` each as long as ``F``): idle rank-ticks over all rank-ticks.

    * GPipe, 1F1B, interleaved 1F1B and Looped BFS (``m >= p``): ``2 (p-1)`` idle ticks per
      rank of ``2 (v m + p-1)``, so ``(p-1) / (v m + p-1)``;
    * ZB-H1, ZB1P (``m >= p``) and ZB-V (``m >= 2p - 1``): ``p-1`` idle ticks of
      ``3 v m + p-1`` (the ``W`` fill the rest of 1F1B's ``2 (p-1)``);
    * DualPipeV (``m >= 2p``): rank ``r`` idles ``2r`` ticks, the last rank ``2p - 3``, of
      ``2m + 5p - 2`` ticks (an overlapped cell is one tick).

    Fewer micro-batches than that leave more of the pipeline idle: ValueError (count it
    from the data, ``schedule.idle_ticks``).

    >>> theory_bubble_fraction(make_schedule("zbh1", 4, 8))
    Fraction(1, 9)
    """
    p, m, v = schedule.ranks, schedule.micro_batches, schedule.stages_per_rank
    name = schedule.name
    least = {"zbv": 2 * p - 1, "looped_bfs": p, "zbh1": p, "zb1p": p}.get(name, 1)
    if m < least:
        raise ValueError(
            f"no closed form for {name} with micro_batches={m} below {least}; count the bubble "
            f"from the data (schedule.bubble_fraction)"
        )
    if name == "dualpipev":
        return Fraction(p * (p - 1) - 1, p * (2 * m + 5 * p - 2))
    if name in ("zbh1", "zb1p", "zbv"):
        return Fraction(p - 1, 3 * v * m + p - 1)
    return Fraction(p - 1, v * m + p - 1)
