"""The compile barrier of the CPU mesh: the ranks compile their step, wait for each other, run.

XLA:CPU aborts a collective whose participants arrive more than 15 s apart, and on the mesh
every rank thread compiles its own program inside ``torch_xla.sync()`` and runs it at once: a
rank that compiles 15 s longer than another (a large program on a loaded machine) aborts the
mesh (caveat ``compile-skew-rendezvous``). So the sync of a rank that called a collective since
its last sync is split into the steps torch_xla's own dynamo bridge uses, with two meetings of
the ranks (:class:`Rendezvous`): meet; find the rank's live tensors with a pending graph (one
walk over the process's objects for all ranks, by the last to arrive, while the others wait);
if that graph holds a collective, compile it into the process's computation cache
(``_xla_warm_up_cache``), meet again, then run the cached graph (``_run_cached_graph``) and
write the results into the tensors. The step marker that follows compiles only the copies (a
few IR nodes each).

A rank that called no collective does not wait. The ranks meet by the count of their
meetings (rank programs are SPMD: the k-th collective step of one rank meets the k-th of the
others); a rank that has not arrived after :data:`WAIT_S` seconds leaves the others to go on
alone, and their status lines say so (:mod:`xla_permute.cpu_mesh.status`). The barrier covers
``torch_xla.sync()`` and ``xm.mark_step()``; a value read with ``.cpu()`` or ``.item()`` before
the sync runs its graph outside it, and so does the base of a view kept past the sync when
only C++ holds the base (the walk cannot see it): the package's ops return tensors of their own.
"""

from __future__ import annotations

import gc
import re
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from xla_permute.backends.tracing import is_tracing
from xla_permute.cpu_mesh import status as mesh_status

__all__ = ["BARRIER_ENV", "WAIT_S", "Rendezvous", "compile_wait_run", "install"]

#: ``XLA_PERMUTE_COMPILE_BARRIER=0`` in a launch's environment turns the barrier off.
BARRIER_ENV = "XLA_PERMUTE_COMPILE_BARRIER"

#: Seconds a rank waits at the barrier for the others before it runs alone.
WAIT_S = 120.0

#: The private torch_xla calls the barrier is made of (checked by :func:`install`).
_CALLS = (
    "_check_tensor_need_materialization",
    "_xla_get_tensor_id",
    "_get_graph_hash",
    "_get_xla_tensors_text",
    "_xla_warm_up_cache",
    "_get_tensors_xla_device_data_node",
    "_run_cached_graph",
)
#: torch_xla's collectives (what ``xm.all_gather`` etc. call): a rank that called one since its
#: last sync meets the others before it looks for its pending graph.
_COLLECTIVE_CALLS = (
    "_xla_all_reduce",
    "_xla_all_reduce_inplace",
    "_xla_all_gather",
    "_xla_all_gather_out",
    "_xla_all_gather_coalesced",
    "_xla_all_gather_coalesced_out",
    "_xla_reduce_scatter",
    "_xla_reduce_scatter_out",
    "_xla_reduce_scatter_coalesced",
    "_xla_reduce_scatter_coalesced_out",
    "_xla_all_to_all",
    "_xla_collective_permute",
    "_xla_send",
    "_xla_recv",
)
#: The collectives in torch_xla's IR text (``xla::all_gather`` ...).
_COLLECTIVE = re.compile(
    r"xla::(all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute|send|recv)\b"
)


class Rendezvous:
    """The n ranks' waits with the same key meet; one ``timeout`` seconds late is left behind.

    >>> r = Rendezvous(1)
    >>> r.wait((0, "run"), rank=0, timeout=1.0)
    []
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self._cond = threading.Condition()
        self._arrived: dict[Hashable, set[int]] = {}
        self._left: dict[Hashable, int] = {}
        self._broken: set[Hashable] = set()

    def wait(
        self, key: Hashable, rank: int, timeout: float, last: Callable[[], Any] | None = None
    ) -> list[int]:
        """Wait at meeting ``key`` until all ranks arrived (the last to arrive calls ``last()``
        first); the ranks missing at the end."""
        with self._cond:
            arrived = self._arrived.setdefault(key, set())
            arrived.add(rank)
            if len(arrived) == self.n and last is not None:
                last()
            self._cond.notify_all()
            full = self._cond.wait_for(
                lambda: len(arrived) == self.n or key in self._broken, timeout
            )
            if not full:
                self._broken.add(key)
            missing = sorted(set(range(self.n)) - arrived)
            self._left[key] = self._left.get(key, 0) + 1
            if self._left[key] == len(arrived) == self.n:
                del self._arrived[key], self._left[key]
                self._broken.discard(key)
            return missing


_local = threading.local()  # per rank: a collective called since the last sync; its meetings
_has_collective: dict[Any, bool] = {}  # graph hash -> whether the graph holds a collective
_compiling: dict[Any, threading.Lock] = {}  # graph hash -> held by the rank compiling it
_found: dict[torch.device, list[torch.Tensor]] = {}  # the last walk's tensors, by device


def _walk() -> None:
    """Collect the garbage, then walk the process's objects once for every rank: its live XLA
    tensors, by device (the last rank to reach a meeting does it, while the others wait:
    a rank thread that freed a tensor whose Python object only the walk held would leave that
    object empty, and torch warns "Deallocating Tensor that still has live PyObject
    references")."""
    gc.collect(1)  # the step's garbage: what is left is what the step markers would take
    _found.clear()
    for o in gc.get_objects():
        try:
            if type(o) in (torch.Tensor, torch.nn.Parameter) and o.device.type == "xla":
                _found.setdefault(o.device, []).append(o)
        except RuntimeError:  # a tensor without a device (an undefined tensor)
            continue


def _pending(found: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The rank's tensors with a graph to run, by torch_xla tensor id (a tensor and its
    ``detach()`` share one), in the order of the ids as the step marker takes them: every rank
    of an SPMD program finds the same graph."""
    import torch_xla

    # a gradient that autograd wrote and nobody read yet has no Python object: ask for it
    found += [t.grad for t in found if t.is_leaf and t.requires_grad and t.grad is not None]
    need = torch_xla._XLAC._check_tensor_need_materialization(found) if found else []
    pending: dict[int, list[torch.Tensor]] = {}
    for t, n in zip(found, need, strict=True):
        if n:
            pending.setdefault(torch_xla._XLAC._xla_get_tensor_id(t), []).append(t)
    return [pending[i] for i in sorted(pending)]


def _meet(
    rendezvous: Rendezvous, key: tuple[int, str], rank: int, last: Any = None, **fields: Any
) -> None:
    mesh_status.enter("barrier", meeting=key[0], **fields)
    missing = rendezvous.wait(key, rank, WAIT_S, last)
    mesh_status.enter("sync", alone=missing)  # the diagnosis names them


def compile_wait_run(rendezvous: Rendezvous, rank: int, device: torch.device) -> None:
    """If this rank called a collective since its last sync: meet the others, and if its
    pending graph holds a collective, compile it, meet the others again, run it."""
    import torch_xla

    if not getattr(_local, "collective", False):
        return
    _local.collective = False
    meeting = _local.meetings = getattr(_local, "meetings", -1) + 1
    _meet(rendezvous, (meeting, "walk"), rank, last=_walk)
    xlac = torch_xla._XLAC
    groups = _pending(_found.pop(device, []))
    tensors = [group[0] for group in groups]
    graph = xlac._get_graph_hash(tensors) if tensors else None
    if graph is not None and graph not in _has_collective:
        _has_collective[graph] = bool(_COLLECTIVE.search(xlac._get_xla_tensors_text(tensors)))
    if graph is None or not _has_collective[graph]:
        return
    mesh_status.enter("compile")
    start = time.monotonic()
    with _compiling.setdefault(graph, threading.Lock()):  # the others find it in the cache
        xlac._xla_warm_up_cache(tensors, [])
    _meet(rendezvous, (meeting, "run"), rank, compile_s=time.monotonic() - start)
    _, inputs = xlac._get_tensors_xla_device_data_node(tensors)
    results = xlac._run_cached_graph(graph, inputs)
    everyone = [t for group in groups for t in group]
    versions = [t._version for t in everyone]
    with torch.no_grad():  # copied, so that a view and its base stay one (functionalization)
        for group, r in zip(groups, results, strict=True):
            for t in group:
                t.copy_(r)
    torch._C._autograd._unsafe_set_version_counter(everyone, versions)


def _noting(call: Callable[..., Any]) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        # one traced to read its HLO never runs (xla_permute.hlo.tracing): no meeting for it
        _local.collective = _local.__dict__.get("collective", False) or not is_tracing()
        return call(*args, **kwargs)

    return collective


def install(n: int) -> Callable[[torch.device], None]:
    """Check the torch_xla calls the barrier needs, note the rank's collectives; the barrier
    of an ``n``-rank mesh, for the rank's sync."""
    import torch_xla
    import torch_xla.runtime as xr

    xlac = torch_xla._XLAC
    missing = [name for name in _CALLS + _COLLECTIVE_CALLS if not hasattr(xlac, name)]
    if missing:
        raise RuntimeError(
            f"the CPU mesh's compile barrier needs torch_xla's {', '.join(missing)}, which this "
            f"torch_xla {torch_xla.__version__} lacks; run with {BARRIER_ENV}=0 (its rendezvous "
            f"may then abort when the ranks' compile times differ by over 15 s)"
        )
    for name in _COLLECTIVE_CALLS:
        setattr(xlac, name, _noting(getattr(xlac, name)))
    rendezvous = Rendezvous(n)

    def barrier(device: torch.device) -> Any:
        compile_wait_run(rendezvous, xr.global_ordinal(), device)

    return barrier
