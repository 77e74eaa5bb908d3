"""Roofline cost model: when does collective matmul pay, per chip? (The workshop's advisor.)

Nothing here runs on a device: it is arithmetic on published chip figures, and nothing in the
library imports it. Four parts (the model next to published measurements is
:mod:`xla_permute_tools.validation`):

* :mod:`~xla_permute_tools.cost.chips`: :class:`Chip` and the ``CHIPS`` table, every figure
  with its citation;
* :mod:`~xla_permute_tools.cost.model`: the formulas (:func:`matmul_time`, :func:`link_time`,
  :func:`ring_collective_time`, :func:`predict`, :func:`speedup`, :func:`crossover`, ...), in
  its module docstring;
* :mod:`~xla_permute_tools.cost.pipeline`: the step time of a pipeline schedule;
* :mod:`~xla_permute_tools.cost.strategy`: ring or baseline for a shape, by the model, for
  the detected chip (:func:`choose_strategy`, an advice a user asks for).

Every public name is reached from here:
``from xla_permute_tools import cost; cost.predict(cost.CHIPS["tpu-v5p"], work)``.

>>> work = Workload(m=4096, k=8192, n=4096, n_devices=4)
>>> speedup(CHIPS["tpu-v5e"], work) > 1
True
"""

from __future__ import annotations

from xla_permute_tools.cost.chips import CHIPS, Chip
from xla_permute_tools.cost.model import (
    Prediction,
    Workload,
    baseline_time,
    chunk_overhead,
    collective_matmul_time,
    crossover,
    crossover_table,
    directions,
    link_time,
    matmul_time,
    partial_sum_bytes,
    predict,
    ring_collective_time,
    speedup,
)
from xla_permute_tools.cost.pipeline import PipelinePrediction, predict_pipeline, step_time
from xla_permute_tools.cost.strategy import choose_strategy, detected_chip

__all__ = [
    "CHIPS",
    "Chip",
    "PipelinePrediction",
    "Prediction",
    "Workload",
    "baseline_time",
    "choose_strategy",
    "chunk_overhead",
    "collective_matmul_time",
    "crossover",
    "crossover_table",
    "detected_chip",
    "directions",
    "link_time",
    "matmul_time",
    "partial_sum_bytes",
    "predict",
    "predict_pipeline",
    "ring_collective_time",
    "speedup",
    "step_time",
]
