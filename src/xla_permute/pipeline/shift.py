"""``stage_shift``: every rank sends its tensor ``offset`` ranks ahead, in one CollectivePermute.

This is the point-to-point step of pipeline parallelism without send/recv: at a pipeline tick
every stage hands its activation to the next stage at the same time, so all the hand-offs of
the tick are one permute with the pairs ``(r, r + offset)``. Two forms:

* **open chain** (``wrap=False``): pairs ``(r, r + offset)`` for the ranks where ``r + offset``
  stays inside the group. The last ``|offset|`` ranks send nothing; the first ``|offset|``
  ranks (for a negative offset: the last) receive **zeros**.
* **ring** (``wrap=True``): pairs ``(r, (r + offset) mod n)``, a complete ring. The ranks that
  would receive zeros in the open chain receive the wrapped value from the other end instead;
  the caller discards it (a pipeline's first stage takes its next micro-batch there).

``wrap=None`` (default) chooses by the hardware rules in :mod:`xla_permute.hardware`: the ring
on devices that run only complete rings of CollectivePermute (Neuron), the open chain elsewhere.

Per rank, for a group of ``n`` ranks and rank ``r`` in it::

    y_r = x_{r - offset}          if 0 <= r - offset < n        (both forms)
    y_r = x_{(r - offset) mod n}  otherwise, ring form
    y_r = 0                       otherwise, open chain

Backward: the opposite shift of the gradient, in the same form (the inverse pairs),
``grad_x = stage_shift(grad_y, offset=-offset)``; in the open chain the last ranks' ``x`` went
nowhere and gets a zero gradient. The reference: :func:`xla_permute.reference.stage_shift`.

>>> shift_pairs(4, 1, wrap=False)
((0, 1), (1, 2), (2, 3))
>>> shift_pairs(4, -2, wrap=True)
((0, 2), (1, 3), (2, 0), (3, 1))
>>> from xla_permute.pairs import inverse_pairs
>>> sorted(inverse_pairs(shift_pairs(4, 1, wrap=False))) == sorted(shift_pairs(4, -1, wrap=False))
True
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from xla_permute.backends.select import BackendName, CommBackend, check_tensor
from xla_permute.hardware import requires_complete_rings
from xla_permute.pairs import (
    Groups,
    GroupsLike,
    Pairs,
    check_groups,
    check_int,
    global_pairs,
    ring_pairs,
)
from xla_permute.permute import collective_permute

__all__ = ["check_offset", "checked_shifts", "resolve_wrap", "shift_pairs", "stage_shift"]


def check_offset(offset: object, group_size: int) -> int:
    """``offset``, a shift ahead (negative: back) in groups of ``group_size`` ranks, if it is a
    nonzero int with ``|offset| < group_size``; else raise.

    >>> check_offset(-3, 4)
    -3
    >>> check_offset(4, 4)
    Traceback (most recent call last):
    ...
    ValueError: offset=4 is not smaller than the group of 4 ranks in size: ...
    """
    offset = check_int(offset, "offset", fix="1: to the next stage, -1: to the previous one")
    if offset == 0:
        raise ValueError(
            "offset=0 would send every rank's tensor to itself, which is no shift; use the "
            "tensor itself, or offset=1 / offset=-1 for the next / previous stage"
        )
    if abs(offset) >= group_size:
        same_ring = offset % group_size
        hint = f" (offset={same_ring} is the same ring)" if same_ring else ""
        raise ValueError(
            f"offset={offset} is not smaller than the group of {group_size} ranks in size: an "
            f"open chain would send nothing and a ring would wrap around more than once; use "
            f"an offset with 0 < |offset| < {group_size}{hint}"
        )
    return offset


def shift_pairs(n: int, offset: int = 1, *, wrap: bool) -> Pairs:
    """The ``(source, target)`` pairs of a shift by ``offset`` in a group of ``n`` ranks.

    >>> shift_pairs(3, -1, wrap=False), shift_pairs(3, -1, wrap=True)
    (((1, 0), (2, 1)), ((0, 2), (1, 0), (2, 1)))
    """
    offset = check_offset(offset, n)
    if not isinstance(wrap, bool):
        raise TypeError(f"wrap must be True or False here, got {wrap!r}")
    if wrap:
        return ring_pairs(n, offset)
    return tuple((r, r + offset) for r in range(n) if 0 <= r + offset < n)


def _check_wrap(wrap: object) -> None:
    if wrap is not None and not isinstance(wrap, bool):
        raise TypeError(
            f"wrap must be None (choose by hardware), True (ring) or False (open chain), "
            f"got {wrap!r}"
        )


def checked_shifts(
    comm: CommBackend, offsets: Iterable[int], *, wrap: bool, groups: Groups, dtype: torch.dtype
) -> dict[int, Pairs]:
    """The global pairs of the shift by each of ``offsets`` inside ``groups``, checked once
    (the hardware's rules for ``dtype`` included): a tick loop posts them with
    :func:`~xla_permute.permute.permute_checked`, re-checking nothing per tick."""
    shifts = {}
    for offset in offsets:
        local = shift_pairs(len(groups[0]), offset, wrap=wrap)
        shifts[offset] = global_pairs(local, groups, comm.world_size())
        comm.check_pairs(shifts[offset], dtype)
    return shifts


def resolve_wrap(wrap: bool | None, device_type: str | None = None) -> bool:
    """Choose the form of a shift: ``True`` for the ring, ``False`` for the open chain.

    ``wrap=None`` follows :func:`xla_permute.hardware.requires_complete_rings` for
    ``device_type`` (default: this process's XLA device type). An explicit ``wrap=False`` on a
    device that runs only complete rings raises, since the open chain would fail there.

    >>> resolve_wrap(None, "CPU"), resolve_wrap(None, "NEURON"), resolve_wrap(True, "CPU")
    (False, True, True)
    """
    _check_wrap(wrap)
    if device_type is None:
        import torch_xla.runtime as xr

        device_type = xr.device_type()
    rings_only = requires_complete_rings(device_type)
    if wrap is None:
        return rings_only
    if wrap is False and rings_only:
        raise ValueError(
            f"wrap=False asks for an open chain, but {device_type} devices run only complete "
            f"rings of CollectivePermute; pass wrap=None (or True) for the ring form and "
            f"discard the wrapped value on the ranks that receive it"
        )
    return wrap


def stage_shift(
    x: torch.Tensor,
    *,
    offset: int = 1,
    wrap: bool | None = None,
    groups: GroupsLike = None,
    backend: BackendName = "auto",
) -> torch.Tensor:
    """Send this rank's ``x`` to the rank ``offset`` ahead, all ranks at once, in one permute.

    Args:
        x: this rank's tensor (e.g. a stage's activation), any shape and dtype; every rank
            passes the same shape. On an XLA device, or a CPU/CUDA tensor for ``c10d``. The
            output has the same shape and dtype.
        offset: how many ranks ahead the value goes (``-1``: one rank back); nonzero and
            ``|offset| <`` the group size.
        wrap: ``False``: open chain, ranks without a source receive zeros; ``True``: ring, they
            receive the values that fall off the other end (discard them); ``None``: the ring
            where the hardware requires complete rings (Neuron), else the open chain.
        groups: replica groups, e.g. ``[[0, 1], [2, 3]]`` for two pipelines of two stages; the
            shift runs inside every group, by group-local position. ``None``: all ranks.
        backend: ``"auto"``, ``"native"``, ``"emulated"`` or ``"c10d"`` (see
            :func:`~xla_permute.permute.collective_permute`).

    Returns:
        ``y`` with ``y_r = x_{r - offset}`` (group-local positions; see the module docstring
        for the ranks at the ends). Backward: ``grad_x = stage_shift(grad_y, offset=-offset)``
        in the same form.

    Raises:
        TypeError: ``x`` is no tensor, ``offset`` no int or ``wrap`` no bool (or None).
        ValueError: ``x`` is not on a device of the backend, ``offset`` is 0 or not smaller than
            the group, or ``groups`` or ``backend`` is bad; before any collective.

    Every rank must call it with the same arguments (checked in :mod:`xla_permute.debug` mode)
    and use the result (else its program drops the collective the others wait for). An empty
    ``x`` gives the empty result without a collective.
    """
    chosen = check_tensor(x, "x", backend)
    _check_wrap(wrap)
    checked_groups = check_groups(groups, chosen.world_size())
    wrap = resolve_wrap(wrap, chosen.device_type)
    offset = check_offset(offset, len(checked_groups[0]))
    pairs = shift_pairs(len(checked_groups[0]), offset, wrap=wrap)
    return collective_permute(x, pairs, groups=checked_groups, backend=chosen.name)
