"""The torch_xla glue: the ``native`` and ``emulated`` backends (:mod:`xla_permute.backends`).

Everything this package asks of torch_xla at run time is here (channel ids:
:mod:`~xla_permute.backends.channels`, tracing state: :mod:`~xla_permute.backends.tracing`):
this rank's place, the device checks, the permute, the all-gather and reduce-scatter in the
form that runs on every device (``pin_layout=False``, a channel id,
``use_global_device_ids=True``), the agreement all-gather and the optimisation barrier.
torch_xla, the ``xla`` extra, is imported inside the functions; where it is not installed,
:func:`need_torch_xla` says so at once.

* ``native``: ``xm.collective_permute``, one HLO collective-permute (TPU, Neuron). On the CPU
  mesh it cannot run (no channel id: XLA:CPU aborts in a rendezvous), only be traced, inside
  :func:`xla_permute.hlo.tracing`.
* ``emulated``: a channel-id all-gather of every rank's tensor and a per-rank select of its
  source (zeros if none): N times a permute's bytes, but it runs on the CPU mesh.

Both are lazy: ``send`` returns a ready handle on the traced result, and the XLA compiler
decides what overlaps what.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from xla_permute.backends.base import CommBackend, Handle, Ready
from xla_permute.backends.channels import AGREEMENT_CHANNEL, next_channel_id
from xla_permute.backends.tracing import is_tracing
from xla_permute.hardware import check_device_pairs, check_not_spmd
from xla_permute.pairs import Groups, Pairs, see, source_of

__all__ = [
    "check_native_runs_here", "check_xla_tensor", "device_error", "need_torch_xla",
    "xla_backend",
]  # fmt: skip

HAS_TORCH_XLA = importlib.util.find_spec("torch_xla") is not None


def need_torch_xla(what: str) -> None:
    """Raise ModuleNotFoundError naming the ``xla`` extra unless torch_xla is installed."""
    if not HAS_TORCH_XLA:
        raise ModuleNotFoundError(
            f"{what} needs torch_xla, which is not installed: pip install 'xla-permute[xla]' "
            f"(torch_xla 2.9.0, with torch 2.9.0). Without it every op runs on a process "
            f"group (backend='c10d'): call torch.distributed.init_process_group(...) first"
            f"{see('no-torch-xla')}",
            name="torch_xla",
        )


def check_xla_tensor(x: object, name: str = "x", backend: str = "auto") -> torch.Tensor:
    """Raise unless ``x`` is a tensor on an XLA device (the fix is in the message)."""
    need_torch_xla(f"backend={backend!r} outside a torch.distributed process group")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.device.type != "xla":
        raise ValueError(
            f"{name} is on device {x.device}, not an XLA device; move it first with "
            f"{name}.to(torch_xla.device()), or, for {x.device.type} tensors in processes, "
            f"call torch.distributed.init_process_group first (backend='c10d')"
        )
    return x


def device_error(x: torch.Tensor, name: str = "x") -> ValueError | None:
    """The error to raise if the XLA tensor ``x`` is not on this rank's device, else None: on
    the CPU mesh ``device="xla:0"`` on every rank is fine on rank 0 alone, which would wait in
    the collective for the others forever (in debug mode it learns of it in the check)."""
    if x.device.type != "xla":
        return None
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
    """Raise if the native backend would *run* on ``device_type``: ``xm.collective_permute``
    has no channel id, by which XLA:CPU matches a collective's participants, so the CPU mesh
    would abort in a rendezvous (tracing it, inside :func:`xla_permute.hlo.tracing`, is fine)."""
    if device_type != "CPU":
        return
    if not is_tracing():
        raise ValueError(
            "backend='native' (xm.collective_permute) cannot run on the CPU mesh: it carries "
            "no channel id, and XLA:CPU would abort in a rendezvous; use backend='emulated' "
            "(or 'auto') to run it here, or build it inside `with xla_permute.hlo.tracing():` "
            f"to read its HLO with xla_permute.hlo.trace (traced, never run){see('native-on-cpu')}"
        )


def _everywhere(groups: Groups, channel_id: int | None = None) -> dict[str, Any]:
    """A collective's arguments in the form that runs on every device: no pinned layout (an
    all-gather stays one), a channel id (XLA:CPU matches participants by it), global ids."""
    return {
        "groups": [list(g) for g in groups], "pin_layout": False, "use_global_device_ids": True,
        "channel_id": next_channel_id() if channel_id is None else channel_id,
    }  # fmt: skip


class _Xla(CommBackend):
    """What the native and emulated backends share: everything but the permute."""

    def world_size(self) -> int:
        import torch_xla.runtime as xr

        check_not_spmd()  # SPMD mode: xr.world_size() is 1 on every device
        return xr.world_size()

    def rank(self) -> int:
        import torch_xla.runtime as xr

        check_not_spmd()
        return xr.global_ordinal()

    @property
    def device_type(self) -> str:  # type: ignore[override]
        import torch_xla.runtime as xr

        return xr.device_type()

    def check_tensor(self, x: object, name: str = "x") -> torch.Tensor:
        return check_xla_tensor(x, name)

    def device_error(self, x: torch.Tensor, name: str = "x") -> ValueError | None:
        return device_error(x, name)

    def all_gather(self, x: torch.Tensor, dim: int, groups: Groups) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        return xm.all_gather(x, dim=dim, **_everywhere(groups))

    def reduce_scatter(self, x: torch.Tensor, dim: int, groups: Groups) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        return xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, dim, len(groups[0]), **_everywhere(groups))

    def gather_rows(self, row: Sequence[int]) -> list[list[int]]:
        """A program of its own on a fresh collective token: the check neither joins the
        caller's pending collectives (executing them here could run what must only be traced)
        nor is joined by them. Executed at once (``.cpu()``)."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        context = xm._get_device_context().device
        token = torch_xla._XLAC._get_all_reduce_token(context)
        torch_xla._XLAC._set_all_reduce_token(context, None)
        try:
            # int32: Neuron's collectives take no 64-bit types (hardware caveat neuron-no-64bit)
            mine = torch.tensor([list(row)], dtype=torch.int32).to(torch_xla.device())
            everyone = _everywhere([range(self.world_size())], AGREEMENT_CHANNEL)
            gathered = xm.all_gather(mine, dim=0, **everyone).cpu()
        finally:
            torch_xla._XLAC._set_all_reduce_token(context, token)
        return gathered.tolist()

    def keep(self, tensors: list[torch.Tensor]) -> None:
        import torch_xla.core.xla_model as xm

        xm.optimization_barrier_(tensors)


class _Native(_Xla):
    name = "native"

    def check_pairs(self, pairs: Pairs, dtype: torch.dtype) -> None:
        device_type = self.device_type
        check_device_pairs(device_type, pairs, self.world_size(), dtype=dtype)
        check_native_runs_here(device_type)

    def send(self, x: torch.Tensor, pairs: Pairs, tag: int = 0) -> Handle:
        if not pairs or x.numel() == 0:  # zeros or nothing to send: no collective
            return Ready(torch.zeros_like(x))
        import torch_xla.core.xla_model as xm

        return Ready(xm.collective_permute(x, [list(p) for p in pairs]))


class _Emulated(_Xla):
    name = "emulated"

    def send(self, x: torch.Tensor, pairs: Pairs, tag: int = 0) -> Handle:
        if not pairs or x.numel() == 0:  # zeros or nothing to send: no collective
            return Ready(torch.zeros_like(x))
        world_size = self.world_size()
        gathered = self.all_gather(x.unsqueeze(0), 0, (tuple(range(world_size)),))
        # Select this rank's source with an index that is device *data*, not a traced
        # constant: a constant select would let the lazy graph of a zero-filled rank drop the
        # all-gather (its result unused), and the other ranks would wait for it forever. Row
        # N is the zero fill.
        source = source_of(pairs, self.rank())
        index = torch.tensor([world_size if source is None else source]).to(x.device)
        padded = torch.cat([gathered, torch.zeros_like(gathered[:1])])
        # A tensor of its own: a view of the selected row would keep that row, and the
        # all-gather, pending past the sync (the CPU mesh's compile barrier cannot see it).
        return Ready(padded.index_select(0, index).squeeze(0).clone())


_NATIVE, _EMULATED = _Native(), _Emulated()


def xla_backend(name: str | None = None) -> CommBackend:
    """``"native"`` or ``"emulated"``; None: emulated on the CPU backend, native elsewhere."""
    need_torch_xla(f"backend={name or 'auto'!r} outside a torch.distributed process group")
    if name is None:
        name = "emulated" if _NATIVE.device_type == "CPU" else "native"
    return {"native": _NATIVE, "emulated": _EMULATED}[name]
