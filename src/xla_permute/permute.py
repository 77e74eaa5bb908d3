"""``collective_permute``: checked, differentiable, on every backend.

Semantics (XLA's CollectivePermute): for every pair ``(s, t)`` rank ``t`` receives rank ``s``'s
tensor; a rank that is no pair's target receives zeros. With ``groups`` the pairs are
group-local and apply inside every group. The per-rank input and output have the same shape
and dtype.

Backends (:mod:`xla_permute.backends.select`): ``"native"``, ``xm.collective_permute`` (TPU,
Neuron; on the CPU mesh only traced, inside :func:`xla_permute.hlo.tracing`); ``"emulated"``, a
channel-id all-gather and a per-rank select, N times a permute's data, for the CPU mesh where
collectives without a channel id cannot run; ``"c10d"``, ``torch.distributed`` point-to-point
between processes, asynchronous; ``"auto"``: ``c10d`` when ``torch.distributed`` is initialized
and ``x`` is not an XLA tensor, else ``emulated`` on the XLA CPU backend, ``native`` elsewhere.

Backward: the permute of the gradient with the inverse pairs, ``grad_x = permute(grad_y,
inverse_pairs(pairs))``; a rank whose value went nowhere gets a zero gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from xla_permute.backends.base import CommBackend, Handle
from xla_permute.backends.select import BackendName, check_tensor
from xla_permute.debug import agree
from xla_permute.pairs import (
    GroupsLike,
    Pairs,
    PairsLike,
    check_groups,
    global_pairs,
    inverse_pairs,
)

__all__ = ["PermuteWork", "collective_permute"]


class _CollectivePermute(torch.autograd.Function):
    """``received`` is the result of the permute already posted; autograd's view of it."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, received: torch.Tensor, pairs: Pairs, backend: CommBackend
    ) -> torch.Tensor:
        ctx.pairs, ctx.backend = pairs, backend
        return received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = permute_checked(grad, inverse_pairs(ctx.pairs), ctx.backend).wait()
        return back, None, None, None


class PermuteWork:
    """A differentiable permute in flight (``collective_permute(..., async_op=True)``).

    ``wait()`` blocks until this rank's tensor has arrived (on c10d; XLA tensors are lazy and
    ready at once) and returns it, connected to ``x`` for autograd: its backward is the
    inverse permute of the gradient.
    """

    __slots__ = ("_x", "_handle", "_pairs", "_backend", "_result")

    def __init__(self, x: torch.Tensor, handle: Handle, pairs: Pairs, backend: CommBackend):
        self._x, self._handle, self._pairs, self._backend = x, handle, pairs, backend
        self._result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor:
        if self._result is None:
            received = self._handle.wait()
            if self._x.requires_grad and torch.is_grad_enabled():
                received = _CollectivePermute.apply(self._x, received, self._pairs, self._backend)
            self._result = received
        return self._result


def permute_checked(x: torch.Tensor, pairs: Pairs, backend: CommBackend) -> PermuteWork:
    """Post the permute of ``x`` with checked global ``pairs`` on ``backend``, checking
    nothing (an op's boundary did); returns the work."""
    x = x.contiguous()
    return PermuteWork(x, backend.send(x.detach(), pairs), pairs, backend)


def collective_permute(
    x: torch.Tensor,
    pairs: PairsLike,
    *,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
    async_op: bool = False,
) -> Any:
    """Send each rank's ``x`` to the rank its pair names; differentiable.

    Args:
        x: this rank's tensor, any shape and dtype (the output has the same): on an XLA
            device for the XLA backends, a CPU (gloo) or CUDA (NCCL) tensor for ``c10d``.
        pairs: ``(source, target)`` rank pairs, a partial permutation (see
            :mod:`xla_permute.pairs`): self pairs, several cycles and open chains are fine.
            Empty pairs mean every rank receives zeros (no collective is issued). Also a
            numpy ``(k, 2)`` integer array or a 2-column integer tensor.
        groups: replica groups that partition the ranks, all of one size; ``pairs`` are then
            group-local and apply in every group. ``None``: one group of all ranks.
        backend: ``"native"``, ``"emulated"``, ``"c10d"`` or ``"auto"`` (module docstring);
            native also applies :func:`xla_permute.hardware.check_device_pairs` to the pairs.
        async_op: return a :class:`PermuteWork` at once (as ``torch.distributed``'s
            ``async_op=True``); its ``wait()`` gives the result. On c10d the transfer runs
            meanwhile; on XLA the result is lazy anyway.

    Returns:
        ``y`` with ``y = x_s`` on rank ``t`` for each pair ``(s, t)``, zeros on ranks that are
        no pair's target. Backward: ``grad_x = collective_permute(grad_y, inverse pairs)``.

    Raises:
        TypeError: ``x`` is not a tensor, or ``pairs``/``groups`` are malformed.
        ValueError: ``x`` is not on a device of the backend (an XLA tensor on c10d, a CPU
            tensor without a process group, another rank's XLA device), or bad ids,
            duplicates, groups or backend, or ``backend="native"`` on the CPU mesh outside
            :func:`xla_permute.hlo.tracing`; before any collective.
        xla_permute.debug.DisagreementError: in debug mode (:mod:`xla_permute.debug`), on
            every rank, when the ranks pass different shapes, dtypes, pairs, groups or
            backends.

    An empty ``x`` (a zero in its shape) gives the empty result without a collective. Every
    rank of the world calls it (ranks outside the pairs too); on NCCL the first
    point-to-point call must involve every rank (a ring does).
    """
    chosen = check_tensor(x, "x", backend)  # a bad x or backend raises first
    world = chosen.world_size()
    checked = global_pairs(pairs, groups, world)
    chosen.check_pairs(checked, x.dtype)  # native: the hardware's rules; others run anything
    options = {"pairs": checked, "groups": check_groups(groups, world), "backend": chosen.name}
    agree("collective_permute", {"x": x}, options, backend=chosen)
    work = permute_checked(x, checked, chosen)
    return work if async_op else work.wait()
