"""Roofline cost model: when does collective matmul pay, per chip?

Nothing here runs on a device: it is arithmetic on published chip figures. Four parts (the
model next to published measurements is a check, outside the library:
:mod:`xla_permute_tools.validation`):

* :mod:`xla_permute.cost.chips`: :class:`Chip` and the ``CHIPS`` table, every figure
  with its citation;
* :mod:`xla_permute.cost.model`: the formulas (:func:`matmul_time`, :func:`link_time`,
  :func:`ring_collective_time`, :func:`predict`, :func:`speedup`, :func:`crossover`, ...), in
  its module docstring;
* :mod:`xla_permute.cost.pipeline`: the step time of a pipeline schedule;
* :mod:`xla_permute.cost.strategy`: the layers' ``strategy="auto"`` (ring or baseline, by the
  model, for the detected chip).

Every public name is reached from here: ``xp.cost.predict(xp.cost.CHIPS["tpu-v5p"], work)``.

>>> work = Workload(m=4096, k=8192, n=4096, n_devices=4)
>>> speedup(CHIPS["tpu-v5e"], work) > 1
True
"""

from __future__ import annotations

from xla_permute.cost.chips import CHIPS, Chip
from xla_permute.cost.model import (
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
from xla_permute.cost.pipeline import PipelinePrediction, predict_pipeline, step_time
from xla_permute.cost.strategy import choose_strategy, detected_chip

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
