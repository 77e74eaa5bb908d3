"""The ``c10d`` backend: every op of this package on ``torch.distributed`` process groups.

Real processes (``torchrun``, ``init_process_group``), any c10d backend. A permute is sent by
one ``batch_isend_irecv`` where the group has send/recv (gloo, NCCL, MPI, UCC), else by one
``all_to_all_single`` with one non-zero split per rank (TorchTPU's ``tpu_dist``, any other
backend), or as asked (:func:`permute_route`). Both are **asynchronous**: ``send`` returns a
handle once the transfers are posted, and ``handle.wait()`` blocks at first use, so each hop
of a ring (collective matmul, ring attention) computes while the next block is in flight.
All-gather and reduce-scatter run on one ``dist.new_group`` per group (made on first use by
every rank alike, cached, with the default group's timeout). Tested on CPU tensors with gloo,
both routes (``tests/test_distributed.py``); CUDA with NCCL and other backends' devices are the
same code. A dead peer surfaces as the process group's timeout on the waiting rank.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from xla_permute.backends.base import CommBackend, Handle, Ready
from xla_permute.pairs import Groups, Pairs

__all__ = ["P2P_BACKENDS", "ROUTES", "c10d_backend", "permute_route", "route_of"]

#: The routes a permute can take (:func:`permute_route`).
ROUTES: tuple[str, ...] = ("auto", "p2p", "all_to_all")
#: The c10d backends with send/recv, on which ``"auto"`` is ``"p2p"``.
P2P_BACKENDS = frozenset({"gloo", "nccl", "mpi", "ucc"})
_route = ["auto"]


@contextlib.contextmanager
def permute_route(route: str) -> Iterator[None]:
    """Inside the block the ``c10d`` permutes take ``route`` (call it on every rank alike);
    ``"auto"``, the default, is ``"p2p"`` on :data:`P2P_BACKENDS`, else ``"all_to_all"``."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    before, _route[0] = _route[0], route
    try:
        yield
    finally:
        _route[0] = before


def route_of(pg_backend: str) -> str:
    """The route of a permute on a group whose backend is ``pg_backend`` (``dist.get_backend()``:
    ``"gloo"``, ``"cpu:gloo,cuda:nccl"``, ``"tpu_dist"``)."""
    names = {part.rpartition(":")[2] for part in pg_backend.split(",")}
    auto = "p2p" if names <= P2P_BACKENDS else "all_to_all"
    return auto if _route[0] == "auto" else _route[0]


class _Pending:
    """A posted permute's received tensor; ``wait()`` blocks until its transfers end."""

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
            "backend='c10d' needs a torch.distributed process group: call torch.distributed."
            "init_process_group(...) on every process first (torchrun sets its environment)"
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
                f"{name} is an XLA tensor ({x.device}), but backend='c10d' sends the process "
                f"group's tensors; use backend='auto' (XLA for XLA tensors) or {name}.cpu()"
            )
        pg = dist.get_backend()
        wants = {"nccl": "cuda", "gloo": "cpu"}.get(pg, x.device.type)
        if x.device.type != wants:
            raise ValueError(
                f"{name} is on {x.device}, but the process group's backend is {pg}, which "
                f"sends {wants} tensors here; move it with {name}.{wants}()"
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

    def _device(self) -> torch.device:
        """Where this process's collectives run: the CPU on gloo, else its accelerator (CUDA on
        NCCL, TorchTPU's or TorchNeuron's device on theirs)."""
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        gloo = _dist().get_backend() == "gloo"
        return torch.device("cpu") if gloo or accelerator is None else accelerator

    def _timeout(self) -> Any:
        dist = _dist()
        try:
            return dist.group.WORLD._get_backend(self._device()).options._timeout
        except (AttributeError, RuntimeError):
            return None

    def _group(self, groups: Groups | None) -> tuple[Any, tuple[int, ...]]:
        """``(process group, this rank's group in listed order)``; None: the default group.

        Cached *weakly*: held strongly, the groups outlived ``destroy_process_group()`` until
        the teardown, where gloo's unjoined threads aborted a finished run ("terminate called
        without an active exception")."""
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
        if route_of(dist.get_backend()) == "all_to_all":  # every rank calls it, even in no pair
            sends, gets = [0] * dist.get_world_size(), [0] * dist.get_world_size()
            for source, target in pairs:
                sends[target] += x.numel() if source == rank else 0
                gets[source] += x.numel() if target == rank else 0
            inbox = out.view(-1) if receives else out.new_empty(0)
            outbox = x.view(-1) if any(sends) else x.new_empty(0)
            work = dist.all_to_all_single(inbox, outbox, gets, sends, async_op=True)
            return _Pending(out, [work], x)
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
        mine = torch.tensor([list(row)], dtype=torch.int32, device=self._device())
        out = mine.new_empty((dist.get_world_size(), len(row)))
        dist.all_gather_into_tensor(out, mine)
        return out.cpu().tolist()


_BACKEND = _C10d()


def c10d_backend() -> CommBackend:
    """The ``c10d`` backend of this process (raises unless a process group is initialized)."""
    _dist()
    return _BACKEND
