"""Ring or baseline, by the cost model, for the detected chip: an advice a user asks for.

:func:`choose_strategy` says which of collective matmul and its baseline the model predicts
faster for a shape on a chip; :func:`detected_chip` names this rank's accelerator as a key of
``CHIPS`` (TPU generations only; None elsewhere). A user passes the answer on (to a layer's
``strategy``, say); no layer asks the model.
"""

from __future__ import annotations

from xla_permute_tools.cost.chips import CHIPS
from xla_permute_tools.cost.model import Workload, predict
from xla_permute_tools.environment import detect

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
    """``"ring"`` or ``"baseline"``: the faster by :func:`~xla_permute_tools.cost.predict` on
    ``chip`` (a key of ``CHIPS``); ``"ring"`` for an unmodelled chip or an empty shape. So the
    choice is never predicted slower than the better of the two.

    >>> choose_strategy("all_gather_matmul", m=8, k=8, n=8, n_devices=4)  # no chip: the ring
    'ring'
    """
    if chip is None or min(m, k, n) <= 0 or n_devices < 2:
        return "ring"
    work = Workload(m=m, k=k, n=n, n_devices=n_devices, dtype_bytes=dtype_bytes, op=op)
    ring = predict(CHIPS[chip], work, "bi" if bidirectional else "uni").total
    base = predict(CHIPS[chip], work, "baseline").total
    return "ring" if ring <= base else "baseline"
