"""Channel ids for collectives: the same on every rank, distinct within one program.

XLA:CPU matches the participants of a collective by its channel id (``op_id`` in the rendezvous
key), else by the module's id, which differs per device thread of the CPU mesh: the rendezvous
would never complete. The counter is **per rank** (per XLA device): the ranks are threads of
one process (a process-wide counter would give two ranks different ids for one collective),
and autograd runs a rank's backward on another thread (a per-thread counter would reuse the
forward's ids). It restarts at every ``xm.mark_step()``, so that a training loop traces the
same graph every step and hits XLA's compile cache.
"""

from __future__ import annotations

import threading

__all__ = ["AGREEMENT_CHANNEL", "next_channel_id"]

#: The channel id of the debug mode's agreement all-gather (:mod:`xla_permute.debug`), which
#: runs in a program of its own, so it never meets the ids of :func:`next_channel_id`.
AGREEMENT_CHANNEL = 1

_lock = threading.Lock()
_next: dict[str, int] = {}  # device -> last id handed out in its current program


def _restart(device: str) -> None:
    with _lock:
        _next.pop(device, None)


def next_channel_id() -> int:
    """Return the next channel id (1, 2, ...) of this rank's current program."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = str(torch_xla.device())
    with _lock:
        first = device not in _next
        _next[device] = _next.get(device, 0) + 1
        channel = _next[device]
    if first:
        xm.add_step_closure(_restart, args=(device,))
    return channel
