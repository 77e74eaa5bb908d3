"""Whether this rank is tracing collectives that cannot run here: inside
:func:`xla_permute.hlo.tracing` (entered and left by :func:`enter_tracing`, :func:`leave_tracing`)
the ops build the native backend's permutes on the CPU mesh for their HLO, and the XLA backend
and the agreement checks ask :func:`is_tracing` whether to refuse or skip.
"""

from __future__ import annotations

import threading

__all__ = ["enter_tracing", "is_tracing", "leave_tracing"]

# Per rank, keyed by its device (as xla_permute.backends.channels): the ranks of the CPU mesh
# are threads of one process, and autograd runs a rank's backward on another thread of the
# same device.
_depth: dict[str, int] = {}
_lock = threading.Lock()


def _rank_device() -> str:
    import torch_xla

    return str(torch_xla.device())


def enter_tracing() -> int:
    """Start tracing on this rank; returns the depth to give :func:`leave_tracing`."""
    device = _rank_device()
    with _lock:
        depth = _depth.get(device, 0)
        _depth[device] = depth + 1
    return depth


def leave_tracing(depth: int) -> None:
    """End the tracing block :func:`enter_tracing` started (``depth``: what it returned)."""
    device = _rank_device()
    with _lock:
        _depth[device] = depth


def is_tracing() -> bool:
    """True inside :func:`xla_permute.hlo.tracing` on this rank (also in its backward, on
    autograd's thread)."""
    with _lock:
        return _depth.get(_rank_device(), 0) > 0
