"""Pipeline parallelism without send/recv: stage shifts, schedules as data, and the steps.

* :mod:`~xla_permute.pipeline.shift`: :func:`stage_shift`, a tick's hand-offs in one permute;
* :mod:`~xla_permute.pipeline.schedule`: a schedule as data (ticks, shifts, bubble, memory);
* :mod:`~xla_permute.pipeline.orders`: each schedule's per-rank orders, :func:`make_schedule`;
* :mod:`~xla_permute.pipeline.forward`: GPipe's forward on shifts, :func:`pipeline_forward`;
* :mod:`~xla_permute.pipeline.run`: any schedule's step, :func:`pipeline_step`, on
  :func:`split_model`'s stages or your own.
"""

from xla_permute.pipeline.forward import pipeline_forward, pipeline_groups
from xla_permute.pipeline.orders import SCHEDULES, make_schedule
from xla_permute.pipeline.run import PipelineStep, pipeline_step, split_model
from xla_permute.pipeline.schedule import Overlap, PipelineSchedule, Work
from xla_permute.pipeline.shift import stage_shift

__all__ = [
    "SCHEDULES", "Overlap", "PipelineSchedule", "PipelineStep", "Work", "make_schedule",
    "pipeline_forward", "pipeline_groups", "pipeline_step", "split_model", "stage_shift",
]  # fmt: skip
