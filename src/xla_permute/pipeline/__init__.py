"""Pipeline parallelism without send/recv: stage shifts, schedules as data, and the steps.

* :mod:`~xla_permute.pipeline.shift`: :func:`stage_shift`, every stage's activation to the
  next stage in one permute;
* :mod:`~xla_permute.pipeline.schedule`: the data model of a schedule (per-rank ticks of
  ``F``, ``B``, ``I``, ``W`` and overlapped cells, their shifts, bubble and peak activations);
* :mod:`~xla_permute.pipeline.orders`: each schedule's per-rank orders and
  :func:`make_schedule` (GPipe, 1F1B, interleaved 1F1B, Looped BFS, ZB-H1, ZB1P, ZB-V,
  DualPipeV);
* :mod:`~xla_permute.pipeline.forward`: GPipe's forward on shifts, :func:`pipeline_forward`;
* :mod:`~xla_permute.pipeline.run`: the training step of any schedule, :func:`pipeline_step`.
"""

from xla_permute.pipeline.forward import pipeline_forward, pipeline_groups
from xla_permute.pipeline.orders import SCHEDULES, make_schedule, split_layers
from xla_permute.pipeline.run import PipelineStep, pipeline_step
from xla_permute.pipeline.schedule import Overlap, PipelineSchedule, Work
from xla_permute.pipeline.shift import stage_shift

__all__ = [
    "SCHEDULES", "Overlap", "PipelineSchedule", "PipelineStep", "Work", "make_schedule",
    "pipeline_forward", "pipeline_groups", "pipeline_step", "split_layers", "stage_shift",
]  # fmt: skip
