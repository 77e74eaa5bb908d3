"""Pipeline schedules as data: each rank's work, tick by tick, and the shifts between ticks.

Words, as PyTorch's ``torch.distributed.pipelining`` uses them: the model is cut into
``stages`` (virtual stages) ``0 .. S-1``, placed on ``ranks`` ``p`` ranks, ``stages_per_rank``
``v = S / p`` on each. **Loop** placement (Megatron's): stage ``k`` on rank ``k mod p``.
**V** placement (ZB-V, DualPipeV; ``v = 2``): stages ``r`` and ``2p-1-r`` on rank ``r``, so the
model runs down the ranks and back up, and the turn (stage ``p-1`` to ``p``) stays on rank
``p-1``. A micro-batch runs forward through stages ``0 .. S-1`` and backward in reverse.

A unit of :class:`Work` is one micro-batch on one stage: its forward ``F``, its backward ``B``,
or the backward split in two, ``I`` (the input gradient, which the previous stage waits for)
and ``W`` (the weight gradient, which nobody waits for, so a schedule may run it later). One
*tick* is one cell per rank: a unit, an :class:`Overlap` (DualPipeV: a forward and a backward
of two stages in one tick) or nothing (the bubble). After a tick a forward hands its activation
to the next stage, a ``B`` or ``I`` the input gradient to the previous one: all of a tick's
hand-offs one way (``+1`` or ``-1`` ranks) are **one**
:func:`~xla_permute.pipeline.shift.stage_shift` (two tensors from one rank travel stacked); a
hand-off that stays on its rank (the V's turn) is no shift at all.

Each schedule is each rank's **order** of work (:mod:`xla_permute.pipeline.orders`) played
out tick by tick (:func:`~xla_permute.pipeline.schedule.play`), every unit one tick. Counted
from the data:
:attr:`~PipelineSchedule.idle_ticks` (the bubble) and :attr:`~PipelineSchedule.peak_in_flight`
(the activations a rank holds: a forward adds one, ``B`` or ``W`` frees it; ``I`` keeps it for
``W``).

>>> from xla_permute.pipeline.orders import make_schedule
>>> s = make_schedule("1f1b", ranks=2, micro_batches=3)
>>> [" ".join(str(w) if w else "." for w in tick) for tick in s.work]
['0F0 .', '0F1 1F0', '. 1B0', '0B0 1F1', '0F2 1B1', '0B1 1F2', '. 1B2', '0B2 .']
>>> s.ticks, s.bubble_fraction, s.peak_in_flight
(8, 0.25, (2, 1))
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from xla_permute.pairs import check_int

__all__ = ["Cell", "Overlap", "PipelineSchedule", "Send", "Work", "play", "units"]

Kind = Literal["F", "B", "I", "W"]
Placement = Literal["loop", "v"]


def check_count(value: object, name: str, fix: str) -> int:
    """A count of ranks, stages or micro-batches: an int >= 1 (``check_int``)."""
    return check_int(value, name, 1, fix=fix)


@dataclass(frozen=True, order=True)
class Work:
    """One unit: ``kind`` (``F``, ``B``, ``I`` or ``W``) of ``micro_batch`` on ``stage`` (the
    virtual stage, counted over the whole model). Printed as PyTorch prints its actions:
    ``1F0`` is stage 1's forward of micro-batch 0."""

    kind: Kind
    micro_batch: int
    stage: int = 0

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class Overlap:
    """A forward and a backward (``B`` or ``I``) of two stages on one rank in one tick
    (DualPipeV's overlapped ticks: one unit's compute hides the other's communication)."""

    forward: Work
    backward: Work

    def __str__(self) -> str:
        return f"({self.forward};{self.backward})"


#: What one rank runs in one tick, a unit, an overlapped pair or nothing (idle).
Cell = Work | Overlap | None


def units(cell: Cell) -> tuple[Work, ...]:
    """The units of one cell, in the order they run."""
    if cell is None:
        return ()
    return (cell.forward, cell.backward) if isinstance(cell, Overlap) else (cell,)


@dataclass(frozen=True)
class Send:
    """A hand-off after a tick: ``offset`` ranks on (``+1``, ``-1``, or ``0``: stays on the
    rank), for the receiver's ``kind`` of unit (``"F"``: an activation; ``"B"``: a gradient,
    for its ``B`` or ``I``) of ``micro_batch`` on ``stage``."""

    offset: int
    kind: Literal["F", "B"]
    micro_batch: int
    stage: int


@dataclass(frozen=True)
class PipelineSchedule:
    """Which cell every rank runs at every tick, and what it hands on after it.

    ``work[t][r]``: rank ``r``'s :data:`Cell` at tick ``t`` (``None``: idle). ``sends[t][r]``:
    what rank ``r`` hands on after tick ``t``; :meth:`receives`: what arrives. Every figure is
    counted from ``work``.
    """

    name: str
    ranks: int
    micro_batches: int
    stages_per_rank: int
    work: tuple[tuple[Cell, ...], ...]
    placement: Placement = "loop"

    @property
    def stages(self) -> int:
        """Virtual stages of the model, ``ranks * stages_per_rank``."""
        return self.ranks * self.stages_per_rank

    @property
    def ticks(self) -> int:
        return len(self.work)

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage``: ``stage mod p`` (loop), or the V's."""
        p = self.ranks
        if self.placement == "v":
            return stage if stage < p else 2 * p - 1 - stage
        return stage % p

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` holds, in model order: its stage modules, first to last."""
        return tuple(k for k in range(self.stages) if self.rank_of(k) == rank)

    def send_of(self, rank: int, w: Work) -> Send | None:
        if w.kind == "F" and w.stage < self.stages - 1:
            kind, to = "F", w.stage + 1
        elif w.kind in "BI" and w.stage > 0:
            kind, to = "B", w.stage - 1
        else:
            return None
        dest = self.rank_of(to)
        if dest == rank:
            offset = 0
        elif self.placement == "v":
            offset = dest - rank
        else:  # the loop's ring: forwards go +1, gradients -1
            offset = +1 if kind == "F" else -1
        return Send(offset, kind, w.micro_batch, to)  # type: ignore[arg-type]

    @cached_property
    def sends(self) -> tuple[tuple[tuple[Send, ...], ...], ...]:
        """``sends[t][r]``: rank ``r``'s hand-offs after tick ``t``, in the order of its units."""
        return tuple(
            tuple(
                tuple(s for w in units(cell) if (s := self.send_of(r, w)) is not None)
                for r, cell in enumerate(tick)
            )
            for tick in self.work
        )

    def shifts(self, tick: int) -> tuple[int, ...]:
        """The shifts every rank issues after ``tick``: ``+1`` when some rank hands on to the
        next rank, ``-1`` to the previous one (at most one of each; none for a hand-off that
        stays on its rank)."""
        sent = {s.offset for sends in self.sends[tick] for s in sends}
        return tuple(o for o in (+1, -1) if o in sent)

    def slots(self, tick: int, offset: int) -> int:
        """Tensors one rank sends ``offset`` after ``tick``, at most (stacked into one shift)."""
        return max(sum(s.offset == offset for s in sends) for sends in self.sends[tick])

    def receives(self, tick: int, rank: int) -> dict[int, tuple[Send, ...]]:
        """What arrives at ``rank`` after ``tick``, by offset, in the order of the shift's
        stacked slots (``+1``: from rank ``rank - 1``, ``-1``: from ``rank + 1``, modulo
        ``ranks``; ``0``: from this rank itself)."""
        out = {}
        for offset in (+1, -1, 0):
            sent = self.sends[tick][(rank - offset) % self.ranks]
            got = tuple(s for s in sent if s.offset == offset)
            if got:
                out[offset] = got
        return out

    @property
    def shift_count(self) -> int:
        """Stage shifts in one step (each one permute)."""
        return sum(len(self.shifts(t)) for t in range(self.ticks))

    @cached_property
    def needs_ring(self) -> bool:
        """Whether some hand-off goes from the last rank to the first or back (interleaved
        loop placement: stage ``c p + p-1`` feeds stage ``(c+1) p`` on rank 0)."""
        p = self.ranks
        return p > 1 and any(
            (s.offset == +1 and r == p - 1) or (s.offset == -1 and r == 0)
            for tick in self.sends
            for r, sends in enumerate(tick)
            for s in sends
        )

    @property
    def idle_ticks(self) -> tuple[int, ...]:
        """Idle ticks per rank."""
        return tuple(sum(tick[r] is None for tick in self.work) for r in range(self.ranks))

    @property
    def bubble_fraction(self) -> float:
        """Idle rank-ticks over all rank-ticks."""
        return sum(self.idle_ticks) / (self.ticks * self.ranks)

    def in_flight(self, rank: int) -> tuple[int, ...]:
        """Per tick, the stage activations ``rank`` holds after the tick: forwards whose
        ``B`` (or ``W``) has not run."""
        live, out = 0, []
        for tick in self.work:
            for w in units(tick[rank]):
                live += {"F": 1, "B": -1, "W": -1, "I": 0}[w.kind]
            out.append(live)
        return tuple(out)

    @property
    def peak_in_flight(self) -> tuple[int, ...]:
        """Per rank, the most stage activations held at once (each ``1 / stages_per_rank``
        of a rank's share of the model)."""
        return tuple(max(self.in_flight(r)) for r in range(self.ranks))


def _needs(w: Work, last: int) -> tuple[str, int, int] | None:
    """The unit whose output ``w`` waits for: ``("F"|"B", micro-batch, stage)`` (``"B"``
    stands for the backward or input gradient of that stage)."""
    if w.kind == "F":
        return None if w.stage == 0 else ("F", w.micro_batch, w.stage - 1)
    if w.kind == "W":
        return ("B", w.micro_batch, w.stage)
    return ("F", w.micro_batch, w.stage) if w.stage == last else ("B", w.micro_batch, w.stage + 1)


def play(
    name: str,
    ranks: int,
    micro_batches: int,
    stages_per_rank: int,
    orders: list[list[Cell]],
    placement: Placement = "loop",
) -> PipelineSchedule:
    """Play each rank's order out tick by tick, every cell as early as its inputs allow (a
    forward the previous stage's forward, ``B`` or ``I`` the next stage's ``B`` or ``I`` or, on
    the last stage, its own forward, ``W`` its own ``I``, each one tick earlier).

    ``orders[r]``: rank ``r``'s cells in the order it runs them (``None`` entries are
    dropped). Raises RuntimeError for orders that wait for each other forever.
    """
    p, last = ranks, ranks * stages_per_rank - 1
    orders = [[c for c in order if c is not None] for order in orders]
    done: dict[tuple[str, int, int], int] = {}  # (F|B, micro-batch, stage) -> tick
    position = [0] * p
    work: list[tuple[Cell, ...]] = []
    total = sum(len(o) for o in orders)
    t = 0
    while sum(position) < total:
        row: list[Cell] = [None] * p
        for r in range(p):
            if position[r] < len(orders[r]):
                cell = orders[r][position[r]]
                needs = [_needs(w, last) for w in units(cell)]
                if all(n is None or done.get(n, t) < t for n in needs):
                    row[r] = cell
        for r, cell in enumerate(row):
            for w in units(cell):
                done[(w.kind if w.kind in "FW" else "B", w.micro_batch, w.stage)] = t
            position[r] += cell is not None
        work.append(tuple(row))
        t += 1
        if t > 4 * total + 4 * p:
            raise RuntimeError(f"the {name} orders deadlock at tick {t}")
    return PipelineSchedule(name, ranks, micro_batches, stages_per_rank, tuple(work), placement)
