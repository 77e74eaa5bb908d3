"""``python -m xla_permute doctor``: the environment, the caveats that apply, and the self-test.

The environment is read without starting the XLA runtime
(:func:`xla_permute_tools.environment.detect`), SPMD mode included; the caveats are those of
the detected device type, or of ``device_type``: one line each (severity, id, summary), or
their whole text with ``details``. The self-test is the table of ``python -m xla_permute demo``
(:mod:`xla_permute_tools.selftest`): it always runs on an N-device CPU mesh, whatever
accelerator this machine has.
"""

from __future__ import annotations

from xla_permute.hardware import device_type_name
from xla_permute_tools import selftest
from xla_permute_tools.catalog import caveats
from xla_permute_tools.environment import detect

__all__ = ["main"]


def main(
    n: int = 4, device_type: str | None = None, self_test: bool = True, details: bool = False
) -> int:
    """Print the report; return 0 when every self-test check passed (or none ran), else 1."""
    env = detect()
    shown = device_type or env.device_type
    print("xla-permute doctor\n\n== environment (read without starting the XLA runtime)")
    print(env.format())
    if env.spmd:
        print(
            "\nSPMD mode is on (xr.use_spmd()): every collective of xla_permute refuses to run "
            "in it (ValueError); run them without use_spmd(), one process or device thread per "
            "device. Caveats spmd-manual-collectives and spmd-roll-all-gather below."
        )
    try:
        applicable = caveats(shown)
    except ValueError as e:  # a detected device type the caveats do not know
        print(f"\n== caveats: none ({e})")
        applicable = []
    else:
        print(f"\n== caveats for {device_type_name(shown)} ({len(applicable)})")
    for caveat in applicable:
        if details:
            print(caveat.format() + "\n")
        else:
            print(f"[{caveat.severity}] {caveat.id}: {caveat.summary}")
    if applicable and not details:
        print(
            f"(each caveat's whole text: python -m xla_permute doctor --details, or "
            f"xla_permute_tools.catalog.caveats({device_type_name(shown)!r}))\n"
        )
    if not self_test:
        return 0
    print("== ", end="")
    return selftest.main(n)
