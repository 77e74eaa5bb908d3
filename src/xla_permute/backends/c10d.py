"""The ``c10d`` backend: every op of this package on ``torch.distributed`` process groups.

Real processes (``torchrun``, ``init_process_group``), real point-to-point: a permute is one
``dist.batch_isend_irecv`` of this rank's sends and receives, **asynchronous**: ``send``
returns a handle as soon as the transfers are posted, and ``handle.wait()`` blocks at first
use. The rings of this package (collective matmul, ring attention) wait for a block only at
the next hop, so each hop's matmul runs while the next block is in flight, eagerly, with no
compiler in between (on XLA the compiler's scheduler decides the overlap instead).

* all-gather and reduce-scatter: ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (sum)
  on the process group of the caller's ``groups``, in the group's listed order;
* ``groups``: one ``dist.new_group`` per group, created on first use by every rank in the
  same order (the ops are SPMD: every rank calls them alike) and cached per groups tuple, with
  the default group's timeout. Point-to-point uses global ranks on the default group;
* this rank's place: ``dist.get_rank()`` / ``dist.get_world_size()``;
* the debug mode's agreement check: an all-gather of one int32 row per rank.

Tensors: CPU tensors with gloo (tested here, ``tests/test_distributed.py``); CUDA tensors with
NCCL are the same code, not tested here. A hung or dead peer surfaces as the process group's
timeout (``init_process_group(timeout=...)``), an error on the waiting rank, not a hang.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from xla_permute.backends.base import CommBackend, Handle, Ready
from xla_permute.pairs import Groups, Pairs

__all__ = ["c10d_backend"]


class _Pending:
    """The received tensor of a posted permute; ``wait()`` blocks until its transfers end."""

    __slots__ = ("_out", "_works", "_sent")

    def __init__(self, out: torch.Tensor, works: list[Any], sent: torch.Tensor) -> None:
        self._out, self._works, self._sent = out, works, sent

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        self._works, self._sent = [], None  # the send buffer may go now
        return self._out


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "backend='c10d' needs a torch.distributed process group: call "
            "torch.distributed.init_process_group(...) on every process first (torchrun sets "
            "the environment for init_process_group('gloo') or ('nccl'))"
        )
    return dist


class _C10d(CommBackend):
    name = "c10d"
    eager = True

    def __init__(self) -> None:
        self._world: weakref.ref | None = None  # the default group the cache belongs to
        self._groups: dict[Groups, weakref.ref] = {}

    def world_size(self) -> int:
        return _dist().get_world_size()

    def rank(self) -> int:
        return _dist().get_rank()

    @property
    def device_type(self) -> str:  # type: ignore[override]
        return "CUDA" if "nccl" in _dist().get_backend() else "CPU"

    def check_tensor(self, x: object, name: str = "x") -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        dist = _dist()
        if x.device.type == "xla":
            raise ValueError(
                f"{name} is an XLA tensor ({x.device}), but backend='c10d' sends CPU or CUDA "
                f"tensors with torch.distributed; use backend='auto' (XLA for XLA tensors) or "
                f"move it with {name}.cpu()"
            )
        pg = dist.get_backend()
        if pg == "nccl" and x.device.type != "cuda":
            raise ValueError(
                f"{name} is on {x.device}, but the process group's backend is nccl, which "
                f"sends CUDA tensors; move it with {name}.cuda() (or use gloo for CPU tensors)"
            )
        if pg == "gloo" and x.device.type != "cpu":
            raise ValueError(
                f"{name} is on {x.device}, but the process group's backend is gloo here, which "
                f"this package uses for CPU tensors; move it with {name}.cpu() (or use nccl)"
            )
        return x

    def device_error(self, x: torch.Tensor, name: str = "x") -> ValueError | None:
        if x.device.type != "cuda" or x.device.index in (None, torch.cuda.current_device()):
            return None
        return ValueError(
            f"{name} is on {x.device}, but this process's CUDA device is "
            f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device(local_rank) "
            f"and create the tensors there"
        )

    def _timeout(self) -> Any:
        dist = _dist()
        device = torch.device("cuda" if "nccl" in dist.get_backend() else "cpu")
        try:
            return dist.group.WORLD._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            return None

    def _group(self, groups: Groups | None) -> tuple[Any, tuple[int, ...]]:
        """``(process group, this rank's group in listed order)``; None: the default group.

        The cache holds the groups *weakly*: ``destroy_process_group()`` must be able to free
        them. A strong reference kept them alive until the interpreter's teardown, where
        gloo's threads were destroyed unjoined and the process aborted ("terminate called
        without an active exception") after a run that had finished.
        """
        dist = _dist()
        world = dist.group.WORLD
        if self._world is None or self._world() is not world:  # a new init_process_group
            self._world, self._groups = weakref.ref(world), {}
        rank, n = dist.get_rank(), dist.get_world_size()
        if groups is None or groups == (tuple(range(n)),):
            return None, tuple(range(n))
        mine = next(g for g in groups if rank in g)
        cached = self._groups.get(groups)
        group = cached() if cached is not None else None
        if group is None:
            timeout = self._timeout()
            made = [dist.new_group(sorted(g), timeout=timeout) for g in groups]  # every rank
            group = made[groups.index(mine)]
            self._groups[groups] = weakref.ref(group)
        return group, mine

    def send(self, x: torch.Tensor, pairs: Pairs, tag: int = 0) -> Handle:
        if not pairs or x.numel() == 0:
            return Ready(torch.zeros_like(x))
        dist = _dist()
        rank = dist.get_rank()
        x = x.contiguous()
        receives = any(t == rank for _, t in pairs)
        out = torch.empty_like(x) if receives else torch.zeros_like(x)  # no source: zeros
        ops = []
        for source, target in pairs:
            if source == rank and target == rank:
                out = x.clone()
            elif source == rank:
                ops.append(dist.P2POp(dist.isend, x, target, tag=tag))
            elif target == rank:
                ops.append(dist.P2POp(dist.irecv, out, source, tag=tag))
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Pending(out, list(works), x)

    def all_gather(self, x: torch.Tensor, dim: int, groups: Groups) -> torch.Tensor:
        dist = _dist()
        pg, mine = self._group(groups)
        n = len(mine)
        buf = x.new_empty((n, *x.shape))
        dist.all_gather_into_tensor(buf, x.unsqueeze(0).contiguous(), group=pg)
        ordered = sorted(mine)
        if list(mine) != ordered:  # the group's rank order is sorted; ours is as listed
            buf = buf[[ordered.index(r) for r in mine]]
        return buf.movedim(0, dim).flatten(dim, dim + 1)

    def reduce_scatter(self, x: torch.Tensor, dim: int, groups: Groups) -> torch.Tensor:
        dist = _dist()
        pg, mine = self._group(groups)
        blocks = x.chunk(len(mine), dim)
        ordered = sorted(mine)  # process-group rank i gets the block of listed rank ordered[i]
        stacked = torch.stack([blocks[mine.index(r)] for r in ordered]).contiguous()
        out = x.new_empty(blocks[0].shape)
        dist.reduce_scatter_tensor(out, stacked.flatten(0, 1) if out.dim() else stacked, group=pg)
        return out

    def gather_rows(self, row: Sequence[int]) -> list[list[int]]:
        dist = _dist()
        device = torch.device("cuda" if dist.get_backend() == "nccl" else "cpu")
        mine = torch.tensor([list(row)], dtype=torch.int32, device=device)
        out = mine.new_empty((dist.get_world_size(), len(row)))
        dist.all_gather_into_tensor(out, mine)
        return out.cpu().tolist()


_BACKEND = _C10d()


def c10d_backend() -> CommBackend:
    """The ``c10d`` backend of this process (raises unless a process group is initialized)."""
    _dist()
    return _BACKEND
