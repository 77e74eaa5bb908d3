"""The layers' strategy policy: ring or baseline, by the cost model, for the detected chip.

:func:`choose_strategy` is what ``strategy="auto"`` of the tensor-parallel layers
(:mod:`xla_permute.tensor_parallel.layers`) asks; :func:`detected_chip` names this rank's
accelerator as a key of ``CHIPS`` (TPU generations only; None elsewhere, where the layers keep
the ring).
"""

from __future__ import annotations

from xla_permute.cost.chips import CHIPS
from xla_permute.cost.model import Workload, predict

__all__ = ["choose_strategy", "detected_chip"]

_TPU_CHIPS = {
    "v4": "tpu-v4",
    "v5litepod": "tpu-v5e",
    "v5e": "tpu-v5e",
    "v5p": "tpu-v5p",
    "v6e": "tpu-v6e",
}


def detected_chip() -> str | None:
    """The ``CHIPS`` key of this rank's accelerator, if modelled (asks the XLA runtime)."""
    import torch_xla.runtime as xr

    if xr.device_type() != "TPU":
        return None
    from xla_permute.hardware.environment import detect

    generation = (detect().tpu_generation or "").lower()
    return _TPU_CHIPS.get(generation)


def choose_strategy(
    op: str,
    *,
    m: int,
    k: int,
    n: int,
    n_devices: int,
    dtype_bytes: int = 2,
    bidirectional: bool = False,
    chip: str | None = None,
) -> str:
    """``"ring"`` or ``"baseline"``: the faster by :func:`~xla_permute.cost.predict` on ``chip``
    (a key of ``CHIPS``); ``"ring"`` for an unmodelled chip or an empty shape. So the choice
    is never predicted slower than the better of the two.

    >>> choose_strategy("all_gather_matmul", m=8, k=8, n=8, n_devices=4)  # no chip: the ring
    'ring'
    """
    if chip is None or min(m, k, n) <= 0 or n_devices < 2:
        return "ring"
    work = Workload(m=m, k=k, n=n, n_devices=n_devices, dtype_bytes=dtype_bytes, op=op)
    ring = predict(CHIPS[chip], work, "bi" if bidirectional else "uni").total
    base = predict(CHIPS[chip], work, "baseline").total
    return "ring" if ring <= base else "baseline"
