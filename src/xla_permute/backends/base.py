"""The interface every communication backend implements (:class:`CommBackend`): a permute that
can be waited on (:class:`Handle`), all-gather, reduce-scatter, this rank's place in its group
and the debug mode's agreement all-gather; :mod:`xla_permute.backends.select` chooses one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from xla_permute.pairs import Groups, GroupsLike, Pairs, check_groups

__all__ = ["CommBackend", "Handle", "Ready"]


class Handle(Protocol):
    """A permute in flight: ``wait()`` blocks until this rank's tensor has arrived."""

    def wait(self) -> torch.Tensor: ...


class Ready:
    """A handle whose tensor is already there (XLA's lazy tensors; a permute of nothing)."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def wait(self) -> torch.Tensor:
        return self._tensor


class CommBackend:
    """The interface (see the module docstring). Subclasses implement every method."""

    name: str = "?"
    #: The device type the hardware rules apply to (:mod:`xla_permute.hardware`).
    device_type: str = "CPU"
    #: True when ops run as called, so in-place writes are fine; False when lazy (XLA), where
    #: every rank builds a traced program alike.
    eager: bool = False

    def world_size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def position(self, groups: GroupsLike = None) -> tuple[int, int, Groups | None]:
        """``(group size, this rank's position in its group, checked groups)``; groups=None:
        all ranks, and None as the checked groups."""
        world, rank = self.world_size(), self.rank()
        if groups is None:
            return world, rank, None
        checked = check_groups(groups, world)
        group = next(g for g in checked if rank in g)
        return len(group), group.index(rank), checked

    def check_tensor(self, x: object, name: str = "x") -> torch.Tensor:
        """Raise TypeError/ValueError unless ``x`` is a tensor this backend can send."""
        raise NotImplementedError

    def device_error(self, x: torch.Tensor, name: str = "x") -> ValueError | None:
        """The error if ``x`` is on another rank's device (this rank alone knows), else None."""
        return None

    def check_pairs(self, pairs: Pairs, dtype: torch.dtype) -> None:
        """Apply the hardware's rules to the global ``pairs`` (may raise or warn)."""

    def send(self, x: torch.Tensor, pairs: Pairs, tag: int = 0) -> Handle:
        """Start the permute of this rank's ``x`` with the global, checked ``pairs``."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, dim: int, groups: Groups) -> torch.Tensor:
        """Concatenate the group's ``x`` along ``dim``, in the group's listed order."""
        raise NotImplementedError

    def reduce_scatter(self, x: torch.Tensor, dim: int, groups: Groups) -> torch.Tensor:
        """Sum ``x`` over the group; keep this rank's block (its listed position) of ``dim``."""
        raise NotImplementedError

    def gather_rows(self, row: Sequence[int]) -> list[list[int]]:
        """The debug mode's agreement all-gather: every rank's int32 ``row``, by rank."""
        raise NotImplementedError

    def keep(self, tensors: list[torch.Tensor]) -> None:
        """Keep ``tensors`` in this rank's program (an optimisation barrier on XLA, where a
        received tensor nobody uses would drop its permute; nothing to do eagerly)."""

    def __repr__(self) -> str:
        return f"<xla_permute backend {self.name!r}>"
