"""What each rank sends in a ring program, per collective and per ring step, read from its HLO.

The bench's evidence beside the timings: :func:`account_bytes` counts the bytes of a program's
collectives (:func:`xla_permute.hlo.bytes_sent_per_rank`, ring algorithms assumed) and
groups the permutes of a ring by the steps of its schedule (:func:`permute_steps`);
:func:`chain_report` says how those permutes depend on each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import xla_permute as xp
from xla_permute.hlo import Program, bytes_sent_per_rank, parse

__all__ = ["ByteAccount", "account_bytes", "chain_report", "permute_steps"]


def _program(hlo: str | Program) -> Program:
    return parse(hlo) if isinstance(hlo, str) else hlo


def permute_steps(
    hlo: str | Program,
    n: int,
    schedule: Sequence[xp.RingStep],
    *,
    order: Sequence[int] | None = None,
    name: str = "program",
) -> list[list[str]]:
    """The collective-permutes of a ring program, grouped by the steps of ``schedule``.

    ``schedule``: one :class:`~xla_permute.RingStep` per step (e.g.
    ``xp.all_gather_schedule(n, 0, bidirectional)``); step ``t`` issues one permute in each
    direction of its ``sends`` (``+1``: to the next rank of ``order``, default ``0..n-1``).
    A permute's direction is read from its pairs; within a direction the permutes form a chain
    through their data (each sends what the previous one delivered, or a sum that includes
    it), which gives their order. The text order of the HLO is not used: without torch_xla's
    token it need not be the issue order. Raises ValueError (naming ``name``) if the permutes
    are not ring shifts or do not match the schedule.
    """
    prog = _program(hlo)
    ring = list(range(n)) if order is None else list(order)
    if sorted(ring) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}, got {order!r}")
    shifts = {d: {(ring[i], ring[(i + d) % n]) for i in range(n)} for d in (1, -1)}
    by_direction: dict[int, list[str]] = {1: [], -1: []}
    for c in prog.collectives():
        if c.kind != "collective-permute":
            continue
        direction = next((d for d in (1, -1) if set(c.pairs or ()) == shifts[d]), None)
        if direction is None:
            raise ValueError(f"{name}: {c.name} is not a ring shift: {c.pairs}")
        by_direction[direction].append(c.name)
    for group in by_direction.values():
        group.sort(key=lambda op, g=group: sum(prog.depends_on(op, o) for o in g))
    wanted = {d: sum(d in s.sends for s in schedule) for d in (1, -1)}
    found = {d: len(g) for d, g in by_direction.items()}
    if found != wanted:
        raise ValueError(
            f"{name}: permutes per direction {found} do not match the schedule "
            f"({wanted} on {n} ranks)"
        )
    taken = {1: 0, -1: 0}
    out = []
    for step in schedule:
        names = []
        for d in step.sends:
            names.append(by_direction[d][taken[d]])
            taken[d] += 1
        out.append(names)
    return out


@dataclass(frozen=True)
class ByteAccount:
    """Bytes one rank sends in one program (from its traced HLO).

    ``per_collective``: ``(kind, bytes)`` in program order; ``per_step``: bytes per ring step
    (a ring program: the permutes of each schedule step; blocking collectives: the N-1 steps
    of their ring algorithms, equal shares); ``gathered_bytes``: the all-gathers' results
    (blocking collectives only; None without an all-gather).
    """

    per_collective: tuple[tuple[str, int], ...]
    per_step: tuple[int, ...]
    total: int
    gathered_bytes: int | None = None


def account_bytes(
    hlo: str | Program,
    n: int,
    schedule: Sequence[xp.RingStep] | None = None,
    *,
    order: Sequence[int] | None = None,
    name: str = "program",
) -> ByteAccount:
    """Bytes each rank sends in a program on ``n`` ranks, read from its HLO.

    With a ``schedule``, the program is a ring of collective-permutes that follows it (see
    :func:`permute_steps`); without, it is blocking collectives (a baseline), counted with
    :func:`bytes_sent_per_rank` (ring algorithms assumed). A ring all-gather of a ``[2, 4]``
    float32 shard on 4 ranks sends 3 shards:

    >>> text = '''
    ... ENTRY %e (p: f32[2,4]) -> f32[8,4] {
    ...   %p = f32[2,4]{1,0} parameter(0)
    ...   ROOT %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), channel_id=1, dimensions={0}
    ... }'''
    >>> account_bytes(text, 4)
    ByteAccount(per_collective=(('all-gather', 96),), per_step=(32, 32, 32), total=96,
                gathered_bytes=128)
    """
    prog = _program(hlo)
    collectives = prog.collectives()
    per = tuple((c.kind, bytes_sent_per_rank(c, n)) for c in collectives)
    total = sum(b for _, b in per)
    if schedule is None:
        if not collectives or "collective-permute" in {k for k, _ in per}:
            raise ValueError(f"{name}: expected blocking collectives and no permute, got {per}")
        gathers = [c.result_bytes for c in collectives if c.kind == "all-gather"]
        steps = max(n - 1, 1)
        return ByteAccount(per, (total // steps,) * steps, total, sum(gathers) if gathers else None)
    if {k for k, _ in per} != {"collective-permute"}:
        raise ValueError(f"{name}: expected only collective-permutes, got {per}")
    sent = {c.name: bytes_sent_per_rank(c, n) for c in collectives}
    grouped = permute_steps(prog, n, schedule, order=order, name=name)
    return ByteAccount(per, tuple(sum(sent[p] for p in s) for s in grouped), total)


def chain_report(
    hlo: str | Program,
    n: int,
    schedule: Sequence[xp.RingStep] | None = None,
    *,
    order: Sequence[int] | None = None,
    name: str = "program",
) -> dict[str, int]:
    """How the permutes of a ring program (following ``schedule``) depend on each other.

    ``permutes``; ``chained``: consecutive permutes in issue order where the later depends on
    the earlier; ``same_step`` / ``same_step_chained``: pairs of permutes issued in the same
    step (bidirectional: one each way; their data are independent) and how many of them
    depend on each other anyway. torch_xla threads every collective through one numeric
    token, so each waits for the previous one and the two directions of a bidirectional step
    run one after the other; with ``DISABLE_NUMERIC_CC_TOKEN=1`` only data dependencies
    remain. ``schedule=None`` (a program without a ring): all zeros.
    """
    if schedule is None:
        return {"permutes": 0, "chained": 0, "same_step": 0, "same_step_chained": 0}
    prog = _program(hlo)
    steps = permute_steps(prog, n, schedule, order=order, name=name)
    issued = [p for s in steps for p in s]
    pairs = [s for s in steps if len(s) == 2]
    return {
        "permutes": len(issued),
        "chained": sum(
            prog.depends_on(b, a) for a, b in zip(issued[:-1], issued[1:], strict=True)
        ),
        "same_step": len(pairs),
        "same_step_chained": sum(prog.depends_on(b, a) or prog.depends_on(a, b)
                                 for a, b in pairs),
    }  # fmt: skip
