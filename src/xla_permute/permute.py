"""``collective_permute``: checked, differentiable, on every backend.

Semantics (XLA's CollectivePermute): for every pair ``(s, t)`` rank ``t`` receives rank ``s``'s
tensor; a rank that is no pair's target receives zeros. With ``groups`` the pairs are
group-local and apply inside every group. The per-rank input and output have the same shape
and dtype.

Backends:

* ``"native"``: ``xm.collective_permute``, one HLO ``collective-permute`` (TPU, Neuron); on
  the CPU mesh only traced, inside :func:`xla_permute.hlo.tracing` (it raises otherwise);
* ``"emulated"``: the same result from a channel-id all-gather and a per-rank select. It moves
  N times the data of a permute and exists for the CPU mesh, where collectives without a channel
  id (``xm.collective_permute`` among them) cannot run;
* ``"auto"``: ``emulated`` on the CPU backend, ``native`` elsewhere.

Backward: the permute of the gradient with the inverse pairs, ``grad_x = permute(grad_y,
inverse_pairs(pairs))``; a rank whose value went nowhere gets a zero gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch

from xla_permute.pairs import (
    Pairs,
    PairsLike,
    check_groups,
    global_pairs,
    inverse_pairs,
    source_of,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "check_native_runs_here",
    "device_error",
    "collective_permute",
    "resolve_backend",
    "ring_of",
]

Backend = Literal["auto", "native", "emulated"]
BACKENDS: tuple[str, ...] = ("auto", "native", "emulated")


def resolve_backend(backend: str, device_type: str | None = None) -> str:
    """Map ``"auto"`` to ``"emulated"`` on the CPU backend and ``"native"`` elsewhere.

    >>> resolve_backend("auto", "CPU"), resolve_backend("auto", "TPU"), resolve_backend("native")
    ('emulated', 'native', 'native')
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if device_type is None:
        import torch_xla.runtime as xr

        device_type = xr.device_type()
    return "emulated" if device_type == "CPU" else "native"


def check_xla_tensor(x: object, name: str = "x") -> torch.Tensor:
    """Raise unless ``x`` is a tensor on an XLA device (the fix is in the message)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "xla":
        raise ValueError(
            f"{name} is on device {x.device}, not an XLA device; move it first with "
            f"{name}.to(torch_xla.device())"
        )
    return x


def device_error(x: torch.Tensor, name: str = "x") -> ValueError | None:
    """The error to raise if the XLA tensor ``x`` is not on this rank's device, else None.

    On the CPU mesh every rank is a thread with a device of its own; a tensor made with
    ``device="xla:0"`` on every rank is fine on rank 0 alone, and rank 0 would wait in the
    collective for the others forever. In debug mode rank 0 learns of it in the check.
    """
    import torch_xla

    here = torch_xla.device()
    if x.device == here:
        return None
    return ValueError(
        f"{name} is on {x.device}, but this rank's device is {here}: every rank passes a "
        f"tensor on its own device; create it with device=torch_xla.device() or move it "
        f"with {name}.to(torch_xla.device())"
    )


def check_native_runs_here(device_type: str) -> None:
    """Raise if the native backend would *run* on ``device_type`` (the CPU mesh cannot).

    XLA:CPU matches the participants of a collective by its channel id, and
    ``xm.collective_permute`` has none: executed on the CPU mesh, it aborts the process in a
    rendezvous. Tracing it for its HLO is fine, inside :func:`xla_permute.hlo.tracing`.
    """
    if device_type != "CPU":
        return
    from xla_permute.hlo import is_tracing

    if not is_tracing():
        raise ValueError(
            "backend='native' (xm.collective_permute) cannot run on the CPU mesh: it carries "
            "no channel id, and XLA:CPU would abort in a rendezvous; use backend='emulated' "
            "(or 'auto') to run it here, or build it inside `with xla_permute.hlo.tracing():` "
            "to read its HLO with xla_permute.hlo.trace (traced, never run)"
        )


def ring_of(
    groups: Sequence[Sequence[int]] | None = None,
) -> tuple[int, int, tuple[tuple[int, ...], ...] | None]:
    """``(group size, this rank's position in its group, checked groups)`` on this rank.

    ``groups=None``: all ranks, and ``None`` as the checked groups. The matmul rings, the
    layers, ring attention and reduce-scatter's empty shortcut all find their ring here.
    """
    import torch_xla.runtime as xr

    world, rank = xr.world_size(), xr.global_ordinal()
    if groups is None:
        return world, rank, None
    checked = check_groups(groups, world)
    group = next(g for g in checked if rank in g)
    return len(group), group.index(rank), checked


def _permute_native(x: torch.Tensor, pairs: Pairs) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    return xm.collective_permute(x, [list(p) for p in pairs])


def _permute_emulated(x: torch.Tensor, pairs: Pairs, world_size: int, rank: int) -> torch.Tensor:
    import torch_xla.core.xla_model as xm

    from xla_permute.channels import next_channel_id

    gathered = xm.all_gather(
        x.unsqueeze(0),
        dim=0,
        groups=[list(range(world_size))],
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )
    # Select this rank's source with an index that is device *data*, not a traced constant:
    # a constant select would let the lazy graph of a zero-filled rank drop the all-gather (its
    # result unused), and the other ranks would wait for it forever. Row N is the zero fill.
    source = source_of(pairs, rank)
    index = torch.tensor([world_size if source is None else source]).to(x.device)
    padded = torch.cat([gathered, torch.zeros_like(gathered[:1])])
    return padded.index_select(0, index).squeeze(0)


def _permute(x: torch.Tensor, pairs: Pairs, backend: str) -> torch.Tensor:
    if not pairs or x.numel() == 0:  # zeros or nothing to send: no collective (ranks agree)
        return torch.zeros_like(x)
    if backend == "native":
        return _permute_native(x, pairs)
    import torch_xla.runtime as xr

    return _permute_emulated(x, pairs, xr.world_size(), xr.global_ordinal())


class _CollectivePermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pairs: Pairs, backend: str) -> torch.Tensor:
        ctx.pairs, ctx.backend = pairs, backend
        return _permute(x, pairs, backend)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        back = _CollectivePermute.apply(grad.contiguous(), inverse_pairs(ctx.pairs), ctx.backend)
        return back, None, None


def collective_permute(
    x: torch.Tensor,
    pairs: PairsLike,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Send each rank's ``x`` to the rank its pair names; differentiable.

    Args:
        x: this rank's tensor, on an XLA device; any shape and dtype. The output has the same.
        pairs: ``(source, target)`` rank pairs, a partial permutation (see
            :mod:`xla_permute.pairs`): self pairs, several cycles and open chains are fine.
            Empty pairs mean every rank receives zeros (no collective is issued). Also a
            numpy ``(k, 2)`` integer array or a 2-column integer tensor.
        groups: replica groups that partition the ranks, all of one size; ``pairs`` are then
            group-local and apply in every group. ``None``: one group of all ranks.
        backend: ``"native"``, ``"emulated"`` or ``"auto"`` (see the module docstring). The
            native backend also applies the hardware's rules to the pairs, which may raise or
            warn (:func:`xla_permute.hardware.check_device_pairs`: open chains on Neuron).

    Returns:
        ``y`` with ``y = x_s`` on rank ``t`` for each pair ``(s, t)``, zeros on ranks that are
        no pair's target. Backward: ``grad_x = collective_permute(grad_y, inverse pairs)``.

    Raises:
        TypeError: ``x`` is not a tensor, or ``pairs``/``groups`` are malformed.
        ValueError: ``x`` is not on this rank's XLA device, or bad ids, duplicates, groups
            or backend, or ``backend="native"`` on the CPU mesh outside
            :func:`xla_permute.hlo.tracing`. Every check runs before any collective is
            issued; the message names the offending value and what is allowed.
        xla_permute.debug.DisagreementError: in debug mode (:mod:`xla_permute.debug`), on
            every rank, when the ranks pass different shapes, dtypes, pairs, groups or
            backends.

    An empty ``x`` (a zero in its shape) gives the empty result without a collective.
    """
    check_xla_tensor(x)
    chosen = resolve_backend(backend)  # a bad x or backend raises before torch_xla is imported
    import torch_xla.runtime as xr

    checked = global_pairs(pairs, groups, xr.world_size())
    if chosen == "native":  # the hardware's rules (xla_permute.hardware); emulated runs anything
        from xla_permute.hardware.rules import check_device_pairs

        check_device_pairs(xr.device_type(), checked, xr.world_size(), dtype=x.dtype)
        check_native_runs_here(xr.device_type())
    from xla_permute import debug

    fields = {
        "x.shape": tuple(x.shape),
        "x.dtype": str(x.dtype),
        "pairs": checked,
        "groups": check_groups(groups, xr.world_size()),
        "backend": chosen,
    }
    debug.check_agreement("collective_permute", fields, error=device_error(x))
    return _CollectivePermute.apply(x, checked, chosen)
