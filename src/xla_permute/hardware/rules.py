"""The hardware rules the ops apply: which permutes a device type runs as XLA's semantics say.

This is the part of :mod:`xla_permute.hardware` that the ops import
(:func:`~xla_permute.permute.collective_permute` calls :func:`check_device_pairs` on its native
backend; :func:`~xla_permute.pipeline.shift.stage_shift` asks :func:`requires_complete_rings`). It
depends on :mod:`xla_permute.pairs` only and never imports ``torch_xla``.

Which checks raise and which warn:

* :class:`ValueError` (the permute cannot run, the message has the fix): on Neuron, pairs that
  do not form complete rings (an open chain such as a pipeline's ``0 -> 1 -> 2``).
* :class:`HardwareWarning` (it runs, but may not mean what XLA says): on Neuron, ranks that
  are in no pair (XLA gives them zeros; Neuron leaves them inactive) and 64-bit dtypes.

A device type without rules here (CPU, TPU, or a PJRT plugin this package does not know) runs
any partial permutation. The caveats behind each rule are in :func:`xla_permute.hardware.caveats`.

>>> requires_complete_rings("NEURON"), requires_complete_rings("TPU")
(True, False)
>>> check_device_pairs("TPU", [(0, 1), (1, 2)], 4)      # an open chain: fine on TPU
>>> check_device_pairs("NEURON", [(0, 1), (1, 0), (2, 3), (3, 2)], 4)   # two rings: fine
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from xla_permute import pairs as _pairs
from xla_permute.pairs import check_int

__all__ = [
    "HardwareWarning",
    "check_device_pairs",
    "check_not_spmd",
    "device_type_name",
    "requires_complete_rings",
    "spmd_mode",
]


class HardwareWarning(UserWarning):
    """A collective that runs on this backend but may not do what XLA's semantics say."""


def device_type_name(device_type: object) -> str:
    """The canonical name of a device type: ``"neuron"``, ``"NEURON_0"`` -> ``"NEURON"``.

    Raises:
        TypeError: ``device_type`` is not a string.
        ValueError: it is blank.
    """
    if not isinstance(device_type, str):
        raise TypeError(
            f"device_type must be a device type name such as 'CPU', 'TPU' or 'NEURON' "
            f"(torch_xla.runtime.device_type()), got {device_type!r}"
        )
    name = device_type.strip().split("_")[0].upper()
    if not name:
        raise ValueError(
            f"device_type must name a device type such as 'CPU', 'TPU' or 'NEURON' "
            f"(torch_xla.runtime.device_type()), got the blank string {device_type!r}"
        )
    return name


def requires_complete_rings(device_type: str) -> bool:
    """True when ``device_type`` runs only permutes whose pairs form closed rings (Neuron).

    >>> requires_complete_rings("neuron"), requires_complete_rings("CPU")
    (True, False)
    """
    return device_type_name(device_type) == "NEURON"


def _world_size(world_size: object) -> int:
    return check_int(world_size, "world_size", 1, fix="the number of ranks")


_64_BIT = ("int64", "uint64", "float64", "complex128")


def check_device_pairs(
    device_type: str, pairs: _pairs.PairsLike, world_size: int, *, dtype: Any = None
) -> None:
    """Refuse or warn about a permute that ``device_type`` cannot run as XLA's semantics say.

    ``pairs`` are global ``(source, target)`` rank pairs over ``world_size`` ranks (first
    checked with :func:`xla_permute.pairs.check_pairs`); ``dtype`` is the tensor's dtype, if
    known. Empty pairs issue no collective and are always fine.

    Raises:
        TypeError, ValueError: a bad ``device_type`` or ``world_size`` (not an int >= 1), or
            invalid pairs (see :func:`xla_permute.pairs.check_pairs`).
        ValueError: on Neuron, pairs with an open chain; the message names the pair that
            closes each chain into a ring.

    Warns:
        HardwareWarning: on Neuron, ranks in no pair (not guaranteed zeros there) and 64-bit
        dtypes.

    >>> check_device_pairs("NEURON", [(0, 1), (1, 2)], 4)
    Traceback (most recent call last):
    ...
    ValueError: pairs [(0, 1), (1, 2)] form an open chain 0 -> 1 -> 2: NEURON runs only ...
    """
    dt = device_type_name(device_type)
    n = _world_size(world_size)
    checked = _pairs.check_pairs(pairs, n)
    if not checked or dt != "NEURON":
        return
    chains = _pairs.decompose(checked).chains
    if chains:
        fixes = "; ".join(
            f"add pair ({c[-1]}, {c[0]}) and discard the value rank {c[0]} then receives"
            for c in chains
        )
        paths = ", ".join(" -> ".join(map(str, c)) for c in chains)
        raise ValueError(
            f"pairs {list(checked)} form an open chain {paths}: {dt} runs only permutes whose "
            f"pairs form complete rings. Close each chain into a ring: {fixes} (instead of "
            f"zeros)."
        )
    covered = {r for p in checked for r in p}
    idle = [r for r in range(n) if r not in covered]
    if idle:
        warnings.warn(
            f"ranks {idle} are in no pair of {list(checked)}: XLA gives them zeros, but on "
            f"{dt} ranks outside the pairs stay inactive and their result is not guaranteed "
            f"to be zeros; zero it yourself on those ranks if you use it",
            HardwareWarning,
            stacklevel=2,
        )
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    if name in _64_BIT:
        warnings.warn(
            f"dtype {name} is 64-bit: {dt} collectives do not support 64-bit element types; "
            f"cast first, e.g. x.to(torch.{'int32' if 'int' in name else 'float32'})",
            HardwareWarning,
            stacklevel=2,
        )


#: torch_xla's switch for SPMD mode: ``xr.use_spmd()`` sets it, ``xr.is_spmd()`` reads it.
SPMD_ENV = "XLA_USE_SPMD"


def spmd_mode(environ: Mapping[str, str] | None = None) -> bool:
    """True when torch_xla runs in SPMD mode (``xr.use_spmd()``), read as ``xr.is_spmd()``
    reads it (``XLA_USE_SPMD`` is ``1`` or ``true``), without importing torch_xla.

    >>> spmd_mode({"XLA_USE_SPMD": "1"}), spmd_mode({})
    (True, False)
    """
    env = os.environ if environ is None else environ
    return env.get(SPMD_ENV, "").strip().lower() in ("1", "true")


def check_not_spmd(
    op: str = "xla_permute's collectives", environ: Mapping[str, str] | None = None
) -> None:
    """Refuse ``op`` (the collectives of this package) in torch_xla's SPMD mode.

    The XLA backends ask it whenever an op looks up its place (world size, rank), so every op
    is refused before it issues a collective.

    In SPMD mode one program runs on every device and ``xr.world_size()`` is 1, so an op
    written for one program per device would see a single rank: its permutes would send to
    itself and its all-gathers gather one block, silently. Inside a manual-sharding region
    (torch_xla's experimental ``_shard_map``) ``xm.collective_permute`` aborts the process
    (no channel id: a cross-replica permute with one replica) and ``xm.all_reduce`` is
    dropped (its world-size-1 path). The hardware caveat ``spmd-manual-collectives`` has the
    evidence.

    Raises:
        ValueError: in SPMD mode, naming ``op`` and the two ways that work.

    >>> check_not_spmd("collective_permute", {})
    >>> check_not_spmd(environ={"XLA_USE_SPMD": "1"})
    Traceback (most recent call last):
    ...
    ValueError: xla_permute's collectives cannot run in torch_xla's SPMD mode (xr.use_spmd()): ...
    """
    if not spmd_mode(environ):
        return
    raise ValueError(
        f"{op} cannot run in torch_xla's SPMD mode (xr.use_spmd()): there one program runs on "
        f"every device and xr.world_size() is 1, so this package's collectives, written for "
        f"one program per device, would see a single rank; inside a manual-sharding region "
        f"(torch_xla's _shard_map) xm.collective_permute aborts the process and xm.all_reduce "
        f"is silently dropped. Run them in the multi-process mode (one process or device "
        f"thread per device: torch_xla.launch, xmp.spawn, xla_permute.run_on_mesh) without "
        f"use_spmd(), or in SPMD mode leave the communication to the partitioner "
        f"(xs.mark_sharding). See xla_permute.hardware.caveats(), id spmd-manual-collectives"
    )
