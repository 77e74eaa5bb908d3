"""The hardware rules the ops enforce: which permutes a device type runs as XLA's semantics say.

The native backend calls :func:`check_device_pairs` for every permute and
:func:`check_not_spmd` whenever an op looks up its place; :func:`~xla_permute.stage_shift`
asks :func:`requires_complete_rings`. A :class:`ValueError` when the collective cannot run,
a :class:`HardwareWarning` when it runs but may not mean what XLA says. A device type without
rules here (CPU, TPU, a PJRT plugin) runs any partial permutation. The caveats behind the
rules, with their sources, are the workshop's catalog (``python -m xla_permute doctor``).

>>> requires_complete_rings("neuron"), requires_complete_rings("TPU")
(True, False)
>>> check_device_pairs("TPU", [(0, 1), (1, 2)], 4)      # an open chain: fine on TPU
>>> check_device_pairs("NEURON", [(0, 1), (1, 0), (2, 3), (3, 2)], 4)   # two rings: fine
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from xla_permute.pairs import PairsLike, check_int, check_pairs, decompose, see

__all__ = [
    "HardwareWarning", "check_device_pairs", "check_not_spmd", "device_type_name",
    "requires_complete_rings", "spmd_mode",
]  # fmt: skip


class HardwareWarning(UserWarning):
    """A collective that runs on this backend but may not do what XLA's semantics say."""


def device_type_name(device_type: object) -> str:
    """The canonical name of a device type: ``"neuron"``, ``"NEURON_0"`` -> ``"NEURON"``.
    TypeError if ``device_type`` is not a string, ValueError if it is blank."""
    what = "such as 'CPU', 'TPU' or 'NEURON' (torch_xla.runtime.device_type())"
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a device type name {what}, got {device_type!r}")
    name = device_type.strip().split("_")[0].upper()
    if not name:
        raise ValueError(
            f"device_type must name a device type {what}, got the blank string {device_type!r}"
        )
    return name


def requires_complete_rings(device_type: str) -> bool:
    """True when ``device_type`` runs only permutes whose pairs form closed rings (Neuron)."""
    return device_type_name(device_type) == "NEURON"


_64_BIT = ("int64", "uint64", "float64", "complex128")


def check_device_pairs(
    device_type: str, pairs: PairsLike, world_size: int, *, dtype: Any = None
) -> None:
    """Refuse or warn about a permute that ``device_type`` cannot run as XLA's semantics say.

    ``pairs`` are global ``(source, target)`` rank pairs over ``world_size`` ranks (first
    checked with :func:`xla_permute.pairs.check_pairs`, whose errors it raises); ``dtype`` is
    the tensor's dtype, if known. Empty pairs issue no collective and are always fine.

    On Neuron: ValueError for pairs with an open chain (the message names the pair that
    closes each chain into a ring); HardwareWarning for ranks in no pair (not guaranteed zeros
    there) and for 64-bit dtypes.

    >>> check_device_pairs("NEURON", [(0, 1), (1, 2)], 4)
    Traceback (most recent call last):
    ...
    ValueError: pairs [(0, 1), (1, 2)] form an open chain 0 -> 1 -> 2: NEURON runs only ...
    """
    dt = device_type_name(device_type)
    n = check_int(world_size, "world_size", 1, fix="the number of ranks")
    checked = check_pairs(pairs, n)
    if not checked or dt != "NEURON":
        return
    chains = decompose(checked).chains
    if chains:
        fixes = "; ".join(
            f"add pair ({c[-1]}, {c[0]}) and discard the value rank {c[0]} then receives"
            for c in chains
        )
        paths = ", ".join(" -> ".join(map(str, c)) for c in chains)
        raise ValueError(
            f"pairs {list(checked)} form an open chain {paths}: {dt} runs only permutes whose "
            f"pairs form complete rings. Close each chain into a ring: {fixes} (instead of "
            f"zeros).{see('neuron-rings')}"
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


def spmd_mode(environ: Mapping[str, str] | None = None) -> bool:
    """True when torch_xla runs in SPMD mode (``xr.use_spmd()``), read as ``xr.is_spmd()``
    reads it (``XLA_USE_SPMD`` is ``1`` or ``true``), without importing torch_xla."""
    env = os.environ if environ is None else environ
    return env.get("XLA_USE_SPMD", "").strip().lower() in ("1", "true")


def check_not_spmd(
    op: str = "xla_permute's collectives", environ: Mapping[str, str] | None = None
) -> None:
    """Refuse ``op`` (the collectives of this package) in torch_xla's SPMD mode: ValueError.

    There ``xr.world_size()`` is 1: an op would silently see a single rank. Inside
    ``_shard_map`` ``xm.collective_permute`` aborts (caveat ``spmd-manual-collectives``).

    >>> check_not_spmd(environ={"XLA_USE_SPMD": "1"})
    Traceback (most recent call last):
    ...
    ValueError: xla_permute's collectives cannot run in torch_xla's SPMD mode (xr.use_spmd()): ...
    """
    if not spmd_mode(environ):
        return
    raise ValueError(
        f"{op} cannot run in torch_xla's SPMD mode (xr.use_spmd()): there one program runs on "
        f"every device and xr.world_size() is 1, so this package's collectives would see a "
        f"single rank (inside torch_xla's _shard_map xm.collective_permute aborts and "
        f"xm.all_reduce is dropped). Run them without use_spmd(), one process or device "
        f"thread per device (torch_xla.launch, xmp.spawn, xla_permute.run_on_mesh), or in "
        f"SPMD mode leave the communication to the partitioner (xs.mark_sharding){see('spmd')}"
    )
