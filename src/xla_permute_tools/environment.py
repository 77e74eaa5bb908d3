"""What applies here: the device type, count and versions (:func:`detect`), and what the
installed ``torch_xla`` collectives accept (:func:`collective_signatures`).

Neither starts the XLA runtime, so :func:`~xla_permute.run_on_mesh` still works after them.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from xla_permute.hardware import device_type_name, spmd_mode

__all__ = ["CollectiveSignature", "Environment", "collective_signatures", "detect"]


@dataclass(frozen=True)
class Environment:
    """What :func:`~xla_permute_tools.environment.detect` found.

    ``device_count`` is the runtime's count when the XLA runtime is running in this process,
    else what the configuration implies (``CPU_NUM_DEVICES``, TPU chips on the PCI bus,
    ``NEURON_RT_VISIBLE_CORES``), or None when unknown. ``source`` says which:
    ``"runtime"``, ``"PJRT_DEVICE"`` (set by the user) or ``"torch_xla default"`` (chosen by
    torch_xla at import). ``variables`` holds the relevant environment variables that are set.
    ``spmd``: torch_xla's SPMD mode is on (``xr.use_spmd()``), where this package's collectives
    are refused (:func:`~xla_permute.hardware.check_not_spmd`).
    """

    device_type: str
    device_count: int | None
    torch_version: str | None
    torch_xla_version: str | None
    tpu_generation: str | None
    source: str
    runtime_initialized: bool
    variables: dict[str, str] = field(default_factory=dict)
    spmd: bool = False

    def format(self) -> str:
        """Plain-text lines for ``python -m xla_permute doctor``."""
        count = "unknown" if self.device_count is None else str(self.device_count)
        lines = [
            f"device type:       {self.device_type} (from {self.source})",
            f"device count:      {count}",
            f"torch:             {self.torch_version}",
            f"torch_xla:         {self.torch_xla_version}",
            f"TPU generation:    {self.tpu_generation or '-'}",
            f"runtime started:   {self.runtime_initialized}",
            "SPMD mode:         "
            + (
                "on (xr.use_spmd()): this package's collectives refuse to run"
                if self.spmd
                else "off"
            ),
        ]
        lines += [f"  {k}={v}" for k, v in sorted(self.variables.items())]
        return "\n".join(lines)


_VARIABLES = (
    "PJRT_DEVICE",
    "CPU_NUM_DEVICES",
    "XLA_THREAD_POOL_SIZE",
    "XLA_USE_SPMD",
    "ENABLE_COLLECTIVE_MATMUL_IN_MP",
    "LIBTPU_INIT_ARGS",
    "XLA_FLAGS",
    "TPU_ACCELERATOR_TYPE",
    "NEURON_RT_VISIBLE_CORES",
)


def _name(value: str | None) -> str:
    """A device type name from the configuration; ``"UNKNOWN"`` when unset or blank."""
    return device_type_name(value) if value and value.strip() else "UNKNOWN"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _core_list(spec: str) -> int | None:
    """Count cores in a NEURON_RT_VISIBLE_CORES value such as ``0-3`` or ``0,2,4-7``."""
    count = 0
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            return None
        lo, hi = int(m[1]), int(m[2] or m[1])
        count += hi - lo + 1
    return count


def _tpu_generation(tpu: Any, chips: int) -> str | None:
    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")
    if accelerator:
        return accelerator.split("-")[0]
    if chips == 0:
        return None
    try:  # on a TPU VM: the metadata server
        return str(tpu.get_tpu_type())
    except Exception:
        return None


def detect() -> Environment:
    """Detect the device type, device count, versions and TPU generation, safely.

    Never starts the XLA runtime, so :func:`~xla_permute.run_on_mesh` still works
    afterwards. It imports ``torch_xla`` (which does not start the runtime, but, like any
    import of torch_xla, sets ``PJRT_DEVICE`` by torch_xla's default rule when unset: TPU if
    libtpu and a TPU chip are found, NEURON if libneuronxla is, else CPU) and reads the
    configuration. When the runtime is already running here (inside a mesh rank, say), it
    asks the runtime instead.

    >>> env = detect()
    >>> env.device_type in {"CPU", "TPU", "NEURON"} and env.torch_xla_version is not None
    True
    """
    preset = os.environ.get("PJRT_DEVICE")
    previous = logging.root.manager.disable
    quiet = "torch_xla" not in sys.modules and previous < logging.WARNING
    if quiet:  # torch_xla logs its default choice at import; ``source`` reports it instead
        logging.disable(logging.WARNING)
    try:
        import torch_xla
        import torch_xla._internal.tpu as tpu
    except ImportError:
        return Environment(
            device_type=_name(preset),
            device_count=None,
            torch_version=_version("torch"),
            torch_xla_version=None,
            tpu_generation=None,
            source="PJRT_DEVICE" if preset else "torch_xla not installed",
            runtime_initialized=False,
            variables={k: os.environ[k] for k in _VARIABLES if k in os.environ},
            spmd=spmd_mode(),
        )
    finally:
        if quiet:
            logging.disable(previous)
    running = bool(torch_xla._XLAC._xla_runtime_is_initialized())
    device_type = _name(os.environ.get("PJRT_DEVICE"))
    chips = tpu.num_available_chips() if device_type == "TPU" else 0
    generation = _tpu_generation(tpu, chips) if device_type == "TPU" else None
    count: int | None = None
    if running:
        import torch_xla.runtime as xr

        count = xr.global_runtime_device_count()
    elif device_type == "CPU":
        count = int(os.environ.get("CPU_NUM_DEVICES") or 1)
    elif device_type == "TPU" and chips:
        count = chips * (2 if generation in ("v2", "v3") else 1)
    elif device_type == "NEURON" and os.environ.get("NEURON_RT_VISIBLE_CORES"):
        count = _core_list(os.environ["NEURON_RT_VISIBLE_CORES"])
    return Environment(
        device_type=device_type,
        device_count=count,
        torch_version=_version("torch"),
        torch_xla_version=getattr(torch_xla, "__version__", None) or _version("torch_xla"),
        tpu_generation=generation,
        source="runtime" if running else ("PJRT_DEVICE" if preset else "torch_xla default"),
        runtime_initialized=running,
        variables={k: os.environ[k] for k in _VARIABLES if k in os.environ},
        spmd=spmd_mode(),
    )


# --------------------------------------------------------------------------- signatures


@dataclass(frozen=True)
class CollectiveSignature:
    """What an upstream ``xm`` collective accepts: its ``pin_layout`` default (None: no such
    argument) and whether it takes ``channel_id`` and ``use_global_device_ids``."""

    name: str
    pin_layout_default: bool | None
    takes_channel_id: bool
    takes_use_global_device_ids: bool


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "collective_broadcast",
    "collective_permute",
)


def collective_signatures() -> list[CollectiveSignature]:
    """Read the installed ``torch_xla.core.xla_model`` collectives' signatures.

    >>> sigs = {s.name: s for s in collective_signatures()}
    >>> sigs["all_gather"].pin_layout_default, sigs["collective_permute"].pin_layout_default
    (True, None)
    """
    import inspect

    import torch_xla.core.xla_model as xm

    out = []
    for name in _COLLECTIVES:
        params = inspect.signature(getattr(xm, name)).parameters
        pin = params.get("pin_layout")
        out.append(
            CollectiveSignature(
                name=name,
                pin_layout_default=None if pin is None else bool(pin.default),
                takes_channel_id="channel_id" in params,
                takes_use_global_device_ids="use_global_device_ids" in params,
            )
        )
    return out
