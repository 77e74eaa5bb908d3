"""Tracing collectives that cannot run here: the runtime's per-rank tracing state.

The native backend (``xm.collective_permute``) cannot run on the CPU mesh; inside
:func:`tracing` the ops build it anyway, for its HLO (:func:`xla_permute.hlo.trace`), and the
XLA backend and the agreement checks ask :func:`is_tracing` whether to refuse or skip.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["discard_traced_collectives", "is_tracing", "tracing"]


def discard_traced_collectives() -> None:
    """Forget the collectives traced on this rank so far (their tensors must be discarded).

    torch_xla threads a token through every collective, so a program traced after another
    would contain the first one's collectives too. This resets the token, as
    ``xm.set_replication`` does, so that the next traced program stands alone.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla._XLAC._set_all_reduce_token(xm._get_device_context().device, None)


def trace(tensors: object) -> str:
    """HLO text of the program that would compute ``tensors`` (a tensor or a list), never run.

    Call it on a rank of the mesh with tensors built from XLA-device inputs; then discard
    them (do not ``torch_xla.sync()`` with them alive). The program stands alone: the collectives
    traced so far are forgotten afterwards
    (:func:`~xla_permute.backends.tracing.discard_traced_collectives`), so the next
    traced program does not contain them. This is how the *native* backend's program, which
    cannot run on the CPU mesh, is read there.
    """
    import torch
    import torch_xla

    outputs = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # type: ignore[call-overload]
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    discard_traced_collectives()
    return text


# Per rank, keyed by its device (as xla_permute.backends.channels): the ranks of the CPU mesh
# are threads
# of one process, and autograd runs a rank's backward on another thread of the same device.
_tracing: dict[str, int] = {}
_tracing_lock = threading.Lock()


def _rank_device() -> str:
    import torch_xla

    return str(torch_xla.device())


@contextmanager
def tracing() -> Iterator[None]:
    """Trace collectives that cannot run here, to read their HLO with :func:`trace`.

    The native backend (``xm.collective_permute``) cannot run on the CPU mesh, so the ops of this
    package refuse it there, except inside this block: the caller promises to trace the tensors
    it builds (:func:`trace`) and discard them, never to run them. On leaving the block the
    collectives traced in it are forgotten
    (:func:`~xla_permute.backends.tracing.discard_traced_collectives`).
    """
    device = _rank_device()
    with _tracing_lock:
        depth = _tracing.get(device, 0)
        _tracing[device] = depth + 1
    try:
        yield
    finally:
        with _tracing_lock:
            _tracing[device] = depth
        if depth == 0:
            discard_traced_collectives()


def is_tracing() -> bool:
    """True inside :func:`tracing` on this rank (also in its backward, on autograd's thread)."""
    with _tracing_lock:
        return _tracing.get(_rank_device(), 0) > 0
