"""Hardware caveats as code: what each backend does to a collective, and what this package does.

The caveats users of ``torch_xla`` collectives hit are spread over issue threads. Here they are
data, in four small modules:

* :mod:`~xla_permute.hardware.catalog`: :func:`caveats` lists them per device type, each with
  what goes wrong, the upstream source, and what this package does about it.
* :mod:`~xla_permute.hardware.rules` (the only part the ops import; it needs
  :mod:`xla_permute.pairs` alone): :func:`check_device_pairs` refuses (or warns about) permutes a
  backend cannot run as XLA's semantics promise, and
  :func:`~xla_permute.permute.collective_permute` calls it on the native backend;
  :func:`requires_complete_rings` tells the shift and pipeline helpers which form to use.
* :mod:`~xla_permute.hardware.environment`: :func:`detect` says which of all this applies
  here; :func:`collective_signatures` reads the installed ``xm`` collectives' arguments.
* :mod:`~xla_permute.hardware.tpu`: :func:`tpu_collective_matmul_setup` is the TPU compiler's
  collective-matmul recipe as data a user applies; :func:`read_dump` reads XLA's dumps.

Which checks raise and which warn:

* :class:`ValueError` (the permute cannot run, the message has the fix): on Neuron, pairs that
  do not form complete rings (an open chain such as a pipeline's ``0 -> 1 -> 2``).
* :class:`HardwareWarning` (it runs, but may not mean what XLA says): on Neuron, ranks that
  are in no pair (XLA gives them zeros; Neuron leaves them inactive) and 64-bit dtypes.
* :class:`ValueError` from :func:`check_not_spmd`: every collective of this package in
  torch_xla's SPMD mode (``xr.use_spmd()``), where one program runs on all devices and its
  collectives would see a world of one rank (:func:`spmd_mode` tells).

Facts this project could not confirm in a public source say so in their caveat
(``Caveat.evidence``) instead of citing one.

>>> requires_complete_rings("NEURON"), requires_complete_rings("TPU")
(True, False)
>>> check_device_pairs("TPU", [(0, 1), (1, 2)], 4)      # an open chain: fine on TPU
>>> check_device_pairs("NEURON", [(0, 1), (1, 2)], 4)
Traceback (most recent call last):
...
ValueError: pairs [(0, 1), (1, 2)] form an open chain 0 -> 1 -> 2: NEURON runs only ...
>>> sorted(c.id for c in caveats("CPU"))  # doctest: +NORMALIZE_WHITESPACE
['collective-token', 'compile-skew-rendezvous', 'cpu-channel-ids', 'cpu-thread-pool',
 'empty-sync-device-lock', 'param-aliasing-deadlock', 'pin-layout', 'spmd-manual-collectives',
 'spmd-roll-all-gather', 'torch-compile']
"""

from __future__ import annotations

from xla_permute.hardware.catalog import DEVICE_TYPES, SEVERITIES, Caveat, caveat_rows, caveats
from xla_permute.hardware.environment import (
    CollectiveSignature,
    Environment,
    collective_signatures,
    detect,
)
from xla_permute.hardware.rules import (
    HardwareWarning,
    check_device_pairs,
    check_not_spmd,
    device_type_name,
    requires_complete_rings,
    spmd_mode,
)
from xla_permute.hardware.tpu import (
    DumpReport,
    TpuCollectiveMatmulSetup,
    read_dump,
    tpu_collective_matmul_setup,
)

__all__ = [
    "DEVICE_TYPES",
    "SEVERITIES",
    "Caveat",
    "CollectiveSignature",
    "DumpReport",
    "Environment",
    "HardwareWarning",
    "TpuCollectiveMatmulSetup",
    "caveat_rows",
    "caveats",
    "check_device_pairs",
    "check_not_spmd",
    "collective_signatures",
    "detect",
    "device_type_name",
    "read_dump",
    "requires_complete_rings",
    "spmd_mode",
    "tpu_collective_matmul_setup",
]
