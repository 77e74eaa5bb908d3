"""Channel ids for collectives: the same on every rank, distinct within one program.

On the CPU mesh every device thread compiles its own module, and XLA:CPU matches the
participants of a collective by its channel id (``op_id`` in the rendezvous key); without one it
falls back to the module's id, which differs per thread, and the rendezvous never completes.
So every collective this package issues carries a channel id from :func:`next_channel_id`.

The counter is per thread (the ranks are threads of one process: a shared counter would hand
rank 0 and rank 1 different ids for the same collective) and restarts at every
``xm.mark_step()``, so that a training loop traces the same graph every step and hits XLA's
compile cache instead of recompiling.
"""

from __future__ import annotations

import threading

__all__ = ["next_channel_id"]

_local = threading.local()


def _restart() -> None:
    _local.next = 0
    _local.armed = False


def next_channel_id() -> int:
    """Return the next channel id (1, 2, ...) of this rank's current program."""
    if not getattr(_local, "armed", False):
        import torch_xla.core.xla_model as xm

        _local.next = 0
        _local.armed = True
        xm.add_step_closure(_restart)
    _local.next += 1
    return _local.next
