"""Choosing a backend (:func:`get_backend`), checking a tensor's place, and the one
:class:`Ring` every ring of the package drives.

=============  ==============================================  ============================
name           what a permute issues                           where
=============  ==============================================  ============================
``native``     ``xm.collective_permute`` (one HLO op)          TPU, Neuron (torch_xla)
``emulated``   a channel-id all-gather and a per-rank select   the XLA CPU mesh (torch_xla)
``c10d``       ``batch_isend_irecv`` or ``all_to_all_single``  any process group (gloo,
                                                               NCCL, TorchTPU, Neuron)
=============  ==============================================  ============================

``backend="auto"`` picks ``c10d`` when ``torch.distributed`` is initialized and the tensor is
not an XLA tensor; otherwise ``emulated`` on the XLA CPU backend and ``native`` elsewhere. The
interface's methods are raw (no autograd, no checks): the ops check their arguments once at
their boundary, then drive a :class:`Ring` (this rank's place, its neighbours' pairs
precomputed); each op's autograd is its own (a permute's backward is the inverse permute).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

import torch

from xla_permute.backends.base import CommBackend, Handle, Ready
from xla_permute.backends.c10d import c10d_backend
from xla_permute.backends.compiled import check_not_compiling
from xla_permute.backends.xla import check_xla_tensor, xla_backend
from xla_permute.pairs import Groups, GroupsLike, Pairs, global_pairs, ring_pairs

__all__ = [
    "BACKENDS", "BackendName", "CommBackend", "Handle", "Ready", "Ring", "check_tensor",
    "distributed_ready", "get_backend",
]  # fmt: skip

BackendName = Literal["auto", "native", "emulated", "c10d"]
BACKENDS: tuple[str, ...] = ("auto", "native", "emulated", "c10d")


def distributed_ready() -> bool:
    """True when ``torch.distributed`` has a process group on a backend other than torch_xla's
    ``xla`` one (whose tensors are XLA tensors, for the XLA backends)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    return dist.get_backend() != "xla"


def get_backend(name: str = "auto", x: torch.Tensor | None = None) -> CommBackend:
    """The backend called ``name`` (``"auto"``: chosen for the tensor ``x``, see the module;
    with ``x=None``, ``c10d`` when a process group is initialized, else XLA)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        is_xla = isinstance(x, torch.Tensor) and x.device.type == "xla"
        name = "c10d" if not is_xla and distributed_ready() else "xla-auto"
    if name == "c10d":
        return c10d_backend()
    return xla_backend(None if name == "xla-auto" else name)


def check_tensor(x: object, name: str = "x", backend: str = "auto") -> CommBackend:
    """Check that ``x`` is a tensor ``backend`` can send; return the backend (resolved).

    Before anything is asked of a runtime (a CPU tensor without a process group is refused
    without starting torch_xla); inside ``torch.compile``, :class:`CompileError` first.
    """
    check_not_compiling()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ready = distributed_ready()
    if backend in ("native", "emulated") and ready and x.device.type != "xla":
        raise ValueError(
            f"{name} is on device {x.device}, not an XLA device, but backend={backend!r} runs "
            f"torch_xla collectives on XLA tensors; use backend='c10d' (or 'auto') for "
            f"{x.device.type} tensors on the torch.distributed process group"
        )
    xla = backend in ("native", "emulated") or (backend == "auto" and not ready)
    if xla:  # before get_backend, which starts the XLA runtime
        check_xla_tensor(x, name, backend)
    chosen = get_backend(backend, x)
    if not xla:
        chosen.check_tensor(x, name)
    return chosen


@dataclass(frozen=True)
class Ring:
    """This rank's ring (``size`` ranks, this rank at ``position``, ``groups`` checked, None:
    all), built once at an op's boundary (``Ring.build``). ``send(t, direction)`` passes every
    rank's ``t`` to the rank ``direction`` (+1 or -1) ahead in its group, unchecked, and returns
    a :class:`Handle`: ``wait()`` where the block is needed, so the work between overlaps."""

    backend: CommBackend
    size: int
    position: int
    groups: Groups | None
    bidirectional: bool = False
    _pairs: dict[int, Pairs] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        groups: GroupsLike = None,
        *,
        backend: CommBackend | str = "auto",
        bidirectional: bool = False,
    ) -> Ring:
        """This rank's ring over ``groups`` (None: all ranks) on ``backend``, after the op's
        own checks; then :meth:`check` with the dtype that travels, before the first hop."""
        chosen = get_backend(backend) if isinstance(backend, str) else backend
        size, position, checked = chosen.position(groups)
        return cls(chosen, size, position, checked, bool(bidirectional))

    def pairs(self, direction: int = 1) -> Pairs:
        """The global pairs of one hop ``direction`` ranks ahead (computed once)."""
        if direction not in self._pairs:
            world = self.backend.world_size()
            self._pairs[direction] = global_pairs(
                ring_pairs(self.size, direction), self.groups, world
            )
        return self._pairs[direction]

    def send(self, t: torch.Tensor, direction: int = 1) -> Handle:
        """Start one hop of every rank's ``t``, ``direction`` ranks ahead (no checks)."""
        return self.backend.send(t.contiguous(), self.pairs(direction), tag=direction % 8)

    def check(self, dtype: torch.dtype) -> None:
        """Apply the backend's rules to the ring's pairs once (native: the hardware's rules,
        and a refusal to run on the CPU mesh outside tracing); before the first hop."""
        if self.size > 1:
            self.backend.check_pairs(self.pairs(1), dtype)

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """Keep ``tensors`` in this rank's program (:meth:`CommBackend.keep`)."""
        if self.size > 1:
            self.backend.keep(tensors)
