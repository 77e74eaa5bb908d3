"""The communication backends behind every op: one interface, three implementations.

* :mod:`~xla_permute.backends.base`: the interface (:class:`CommBackend`, :class:`Handle`);
* :mod:`~xla_permute.backends.select`: choosing one (``backend="auto"``), the checks of a
  tensor's place, and the one :class:`Ring` every ring of the package drives;
* :mod:`~xla_permute.backends.xla`: torch_xla, ``native`` (TPU, Neuron) and ``emulated`` (the
  CPU mesh), with its channel ids (:mod:`~xla_permute.backends.channels`) and tracing state
  (:mod:`~xla_permute.backends.tracing`);
* :mod:`~xla_permute.backends.c10d`: ``torch.distributed`` processes (gloo, NCCL).

Importing this package imports neither torch_xla nor a process group.
"""

from xla_permute.backends.base import CommBackend, Handle, Ready
from xla_permute.backends.select import (
    BACKENDS,
    BackendName,
    Ring,
    check_tensor,
    distributed_ready,
    get_backend,
)

__all__ = [
    "BACKENDS", "BackendName", "CommBackend", "Handle", "Ready", "Ring", "check_tensor",
    "distributed_ready", "get_backend",
]  # fmt: skip
