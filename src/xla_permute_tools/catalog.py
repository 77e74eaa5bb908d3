"""The catalog of hardware caveats: :func:`caveats` lists those that apply to a device type.

The caveats users of ``torch_xla`` collectives hit are spread over issue threads; here they are
data. Each :class:`~xla_permute_tools.caveat.Caveat` has what goes wrong, the upstream source,
what the library does about it (the rules it enforces are :mod:`xla_permute.hardware`), and
what this project checked itself; facts it could not confirm in a public source say so in
``Caveat.evidence`` instead of citing one. The record is :mod:`xla_permute_tools.caveat`, the
caveats :mod:`xla_permute_tools.known_caveats`.

>>> sorted(c.id for c in caveats("CPU"))  # doctest: +NORMALIZE_WHITESPACE
['collective-token', 'compile-skew-rendezvous', 'cpu-channel-ids', 'cpu-thread-pool',
 'empty-sync-device-lock', 'param-aliasing-deadlock', 'pin-layout', 'spmd-manual-collectives',
 'spmd-roll-all-gather', 'torch-compile']
"""

from __future__ import annotations

from xla_permute.hardware import device_type_name
from xla_permute_tools.caveat import SEVERITIES, Caveat, caveat_rows
from xla_permute_tools.known_caveats import CAVEATS

__all__ = ["DEVICE_TYPES", "SEVERITIES", "Caveat", "caveat_rows", "caveats"]

#: The device types the caveats know (``torch_xla.runtime.device_type()`` names; ``GPU`` is
#: an alias of ``CUDA``). A suffix such as ``NEURON_0`` and any case are accepted.
#: Exactly the device types named in the table (tests/test_hardware.py checks).
DEVICE_TYPES: tuple[str, ...] = ("CPU", "TPU", "NEURON", "CUDA", "GPU")


def _device_type(device_type: object) -> str:
    """``device_type`` as a name of :data:`DEVICE_TYPES`, else TypeError/ValueError."""
    name = device_type_name(device_type)
    if name not in DEVICE_TYPES:
        raise ValueError(
            f"device_type {device_type!r} is not a device type this package has caveats for; "
            f"use one of {', '.join(DEVICE_TYPES)} (any case, a suffix such as NEURON_0 is fine)"
        )
    return name


def caveats(device_type: str | None = None) -> list[Caveat]:
    """The caveats that apply to ``device_type`` (``None``: all of them).

    Raises:
        TypeError: ``device_type`` is not a string.
        ValueError: it is blank or not one of :data:`DEVICE_TYPES` (a typo such as
            ``"NUERON"``); the message lists them.

    >>> [c.id for c in caveats("NEURON")][:2]
    ['pin-layout', 'neuron-complete-rings']
    >>> {c.severity for c in caveats()} <= set(SEVERITIES)
    True
    >>> caveats("NUERON")
    Traceback (most recent call last):
    ...
    ValueError: device_type 'NUERON' is not a device type this package has caveats for; ...
    """
    if device_type is None:
        return list(CAVEATS)
    dt = _device_type(device_type)
    return [c for c in CAVEATS if "*" in c.applies_to or dt in c.applies_to]
