"""torch_xla is the ``xla`` extra: the package installs and imports without it, and what needs it
says so at once, naming the extra (run with torch_xla hidden, so in both test lanes)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

HIDDEN = "import sys, torch; sys.modules['torch_xla'] = None\nimport xla_permute as xp\n"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", HIDDEN + code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_torch_is_a_range_and_torch_xla_an_extra():
    """As installed (the package's metadata): any torch from 2.9 on, torch_xla only with
    ``[xla]``, which pins the pair it was released for."""
    requires = importlib.metadata.requires("xla-permute")
    plain = [r for r in requires if "extra ==" not in r]
    assert "torch>=2.9" in plain and not [r for r in plain if "torch_xla" in r], plain
    assert sorted(r.split(";")[0] for r in requires if 'extra == "xla"' in r) == [
        "torch==2.9.0",
        "torch_xla==2.9.0",
    ]


def test_what_needs_torch_xla_names_the_extra_at_once():
    calls = {
        "permute": "xp.collective_permute(torch.ones(2), xp.ring_pairs(2))",
        "native": "xp.all_gather(torch.ones(2), 0, backend='native')",
        "layer": "xp.ColumnParallelLinear(4, 8)",
        "backend": "xp.backends.get_backend('emulated')",
        "trace": "xp.hlo.trace([])",
        "tracing": "xp.hlo.tracing().__enter__()",
    }
    code = "".join(
        f"try:\n    {call}\n    print({name!r}, 'no error')\n"
        f"except ModuleNotFoundError as e:\n    print({name!r}, e)\n"
        for name, call in calls.items()
    )
    lines = _run(code).splitlines()
    assert len(lines) == len(calls), lines
    for line in lines:
        assert "needs torch_xla, which is not installed: pip install 'xla-permute[xla]'" in line
        assert "backend='c10d'" in line, line
