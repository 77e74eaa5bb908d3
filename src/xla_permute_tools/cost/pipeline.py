"""Step time of a pipeline schedule per chip, from the schedule's own data.

The schedule (:mod:`xla_permute.pipeline.schedule`) says which work each rank runs in which
order; this module gives each unit a duration and plays it out. A forward of one micro-batch on
one stage takes ``t_forward / v`` (``t_forward``: a rank's whole ``1/p`` of the model, in ``v``
stages), a backward ``B`` ``backward_ratio`` times that (2 for a transformer without
recomputation; ``I`` and ``W`` half of it each), and every hand-off between ranks ``t_shift``.
Two ways to play it out:

* ``lockstep=False``, point-to-point (send/recv, ``torch.distributed``): a rank starts its
  next unit as soon as it is free and its input has arrived::

      start(u) = max(end(previous unit on this rank), end(input unit) + t_shift)

* ``lockstep=True``, stage shifts (one collective per direction per tick, every rank
  taking part): a tick ends when its slowest unit ends and its shifts are done::

      tick time = max over ranks of the unit's time + t_shift * (shifts after the tick)

The step time per chip is the time until the last unit ends; tokens per second per chip are
proportional to ``micro_batches / step_time``. Memory: the peak number of stage-sized
activations a rank holds, ``max(schedule.peak_in_flight) / v``.

Not modelled: weights, gradients and optimizer state (the same for every schedule), the loss
head's size, recomputation, overlap of a shift with the next unit's compute.

>>> import xla_permute as xp
>>> s = xp.make_schedule("1f1b", 4, 8)
>>> step_time(s, t_forward=1.0, backward_ratio=1.0) == s.ticks  # unit ticks, no shift cost
True
"""

from __future__ import annotations

from dataclasses import dataclass

import xla_permute as xp
from xla_permute.pipeline.schedule import units

__all__ = [
    "PipelinePrediction",
    "predict_pipeline",
    "step_time",
]


def _unit(schedule: xp.PipelineSchedule, kind: str, t_forward: float, ratio: float) -> float:
    stage = t_forward / schedule.stages_per_rank
    if kind == "F":
        return stage
    return stage * ratio / 2 if kind in "IW" else stage * ratio  # B = I + W, halves


def step_time(
    schedule: xp.PipelineSchedule,
    *,
    t_forward: float,
    backward_ratio: float = 2.0,
    t_shift: float = 0.0,
    lockstep: bool = False,
) -> float:
    """The time of one step of ``schedule`` (see the module docstring for the two models).

    ``t_forward``: the forward of one micro-batch through all of a rank's stages;
    ``backward_ratio``: backward / forward time; ``t_shift``: one hand-off.
    """
    if t_forward < 0 or backward_ratio < 0 or t_shift < 0:
        raise ValueError("t_forward, backward_ratio and t_shift must be >= 0")
    p, last = schedule.ranks, schedule.stages - 1
    if lockstep:
        total = 0.0
        for t, tick in enumerate(schedule.work):
            busy = [
                sum(_unit(schedule, w.kind, t_forward, backward_ratio) for w in units(cell))
                for cell in tick
            ]
            total += max(busy, default=0.0) + t_shift * len(schedule.shifts(t))
        return total
    end: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    for tick in schedule.work:  # ticks order the units so that every input comes first
        for r, cell in enumerate(tick):
            for w in units(cell):
                k, i = w.stage, w.micro_batch
                if w.kind == "F":
                    ready = 0.0 if k == 0 else end["F", i, k - 1] + t_shift
                elif w.kind == "W":
                    ready = end["B", i, k]
                elif k == last:
                    ready = end["F", i, k]
                else:
                    ready = end["B", i, k + 1] + t_shift
                start = max(free[r], ready)
                free[r] = start + _unit(schedule, w.kind, t_forward, backward_ratio)
                end["F" if w.kind == "F" else w.kind if w.kind == "W" else "B", i, k] = free[r]
    return max(free)


@dataclass(frozen=True)
class PipelinePrediction:
    """One schedule's predicted step: ``step_time`` (same unit as ``t_forward``), the
    ``ideal`` time without bubble (``m (1 + backward_ratio) t_forward``), ``efficiency``
    (ideal / step), the ``bubble_fraction`` counted from the schedule's ticks and the peak
    ``activations`` a rank holds, in stage-sized activations."""

    name: str
    ranks: int
    micro_batches: int
    stages_per_rank: int
    step_time: float
    ideal: float
    bubble_fraction: float
    activations: float

    @property
    def efficiency(self) -> float:
        return self.ideal / self.step_time

    def throughput_ratio(self, other: PipelinePrediction) -> float:
        """Tokens per second per chip of this schedule over ``other``'s (same micro-batches)."""
        return (other.step_time / other.micro_batches) / (self.step_time / self.micro_batches)


def predict_pipeline(
    name: str,
    ranks: int,
    micro_batches: int,
    stages_per_rank: int = 1,
    *,
    t_forward: float = 1.0,
    backward_ratio: float = 2.0,
    t_shift: float = 0.0,
    lockstep: bool = False,
) -> PipelinePrediction:
    """:func:`step_time` and the memory of the schedule ``name`` (see
    :func:`xla_permute.make_schedule`).

    >>> one = predict_pipeline("1f1b", 8, 32)
    >>> two = predict_pipeline("interleaved", 8, 32, 2)
    >>> round(two.throughput_ratio(one), 3), one.activations, two.activations
    (1.099, 8.0, 11.5)
    """
    s = xp.make_schedule(name, ranks, micro_batches, stages_per_rank)
    time = step_time(
        s,
        t_forward=t_forward,
        backward_ratio=backward_ratio,
        t_shift=t_shift,
        lockstep=lockstep,
    )
    return PipelinePrediction(
        name=name,
        ranks=ranks,
        micro_batches=micro_batches,
        stages_per_rank=stages_per_rank,
        step_time=time,
        ideal=micro_batches * (1 + backward_ratio) * t_forward,
        bubble_fraction=s.bubble_fraction,
        activations=max(s.peak_in_flight) / stages_per_rank,
    )
