"""``python -m xla_permute doctor``: the environment, the caveats that apply, and the self-test.

The environment is read without starting the XLA runtime (:func:`xla_permute.hardware.detect`);
the caveats are those of the detected device type, or of ``device_type``. The self-test is the
table of ``python -m xla_permute demo`` (:mod:`xla_permute.tools.selftest`): it always runs on an
N-device CPU mesh, whatever accelerator this machine has.
"""

from __future__ import annotations

from xla_permute import hardware
from xla_permute.tools import selftest

__all__ = ["main"]


def main(n: int = 4, device_type: str | None = None, self_test: bool = True) -> int:
    """Print the report; return 0 when every self-test check passed (or none ran), else 1."""
    env = hardware.detect()
    shown = device_type or env.device_type
    print("xla-permute doctor\n\n== environment (read without starting the XLA runtime)")
    print(env.format())
    try:
        applicable = hardware.caveats(shown)
    except ValueError as e:  # a detected device type the caveats do not know
        print(f"\n== caveats: none ({e})")
        applicable = []
    else:
        print(f"\n== caveats for {hardware.device_type_name(shown)} ({len(applicable)})")
    for caveat in applicable:
        print(caveat.format() + "\n")
    if not self_test:
        return 0
    print("== ", end="")
    return selftest.main(n)
