"""``python -m xla_permute doctor``: the environment, the caveats that apply, and a self-test.

The self-test runs once on an N-device CPU mesh (one launch, one program, a few seconds),
whatever accelerator this machine has: ``collective_permute`` on several pair patterns, and
collective matmul (``xla_permute.matmul.all_gather_matmul``, uni- and bidirectional) when
that module is installed, each against the pure-torch reference (:mod:`xla_permute.reference`)
with integer-valued inputs, so the comparison is exact. The backend is whatever ``"auto"``
picks on CPU (the emulated permute).

>>> [c.name for c in permute_checks(4)][:2]
['ring shift +1', 'ring shift -1']
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xla_permute import hardware, reference
from xla_permute.pairs import ring_pairs

__all__ = ["PermuteCheck", "Result", "main", "permute_checks", "run_self_test", "self_test_rank"]


@dataclass(frozen=True)
class PermuteCheck:
    """One permute of the self-test: ``pairs`` (and ``groups``) applied to ``xs``."""

    name: str
    pairs: tuple[tuple[int, int], ...]
    groups: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class Result:
    """One row of the self-test table."""

    check: str
    backend: str
    ok: bool
    detail: str


def permute_checks(n: int) -> list[PermuteCheck]:
    """The permutes of the self-test for ``n`` ranks (ring shifts, a swap, a chain, groups)."""
    checks = [
        PermuteCheck("ring shift +1", ring_pairs(n, 1)),
        PermuteCheck("ring shift -1", ring_pairs(n, -1)),
        PermuteCheck("open chain (zero fill)", tuple((r, r + 1) for r in range(n - 1))),
    ]
    if n >= 2:
        checks.append(PermuteCheck("swap 0 <-> 1", ((0, 1), (1, 0))))
    if n % 2 == 0 and n >= 4:
        groups = tuple(tuple(range(g, g + 2)) for g in range(0, n, 2))
        checks.append(PermuteCheck("pairs within groups of 2", ((0, 1), (1, 0)), groups))
    return checks


def _matmul_available() -> bool:
    try:
        from xla_permute.matmul import all_gather_matmul  # noqa: F401
    except ImportError:
        return False
    return True


def _inputs(n: int) -> dict[str, torch.Tensor]:
    """Integer-valued virtual-mesh inputs (leading axis = rank), distinct per rank."""
    return {
        "x": torch.arange(n * 3 * 4, dtype=torch.float32).reshape(n, 3, 4) - 7,
        "xm": torch.arange(n * 2 * 3, dtype=torch.float32).reshape(n, 2, 3) % 5 - 2,
        "w": torch.arange(n * 3 * 4, dtype=torch.float32).reshape(n, 3, 4) % 7 - 3,
    }


def self_test_rank(
    checks: Sequence[PermuteCheck], inputs: dict[str, torch.Tensor], matmul: bool
) -> dict[str, Any]:
    """Rank function: every check on this rank in one program, and this rank's
    :func:`~xla_permute.hardware.detect`."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute import collective_permute

    rank, device = xr.global_ordinal(), torch_xla.device()
    out: dict[str, Any] = {}
    x = inputs["x"][rank].to(device)
    for check in checks:
        groups = None if check.groups is None else [list(g) for g in check.groups]
        out[check.name] = collective_permute(x, check.pairs, groups=groups)
    if matmul:
        from xla_permute.matmul import all_gather_matmul

        xs, w = inputs["xm"][rank].to(device), inputs["w"][rank].to(device)
        for bidirectional in (False, True):
            out[f"all_gather_matmul bidirectional={bidirectional}"] = all_gather_matmul(
                xs, w, dim=0, bidirectional=bidirectional
            )
    xm.mark_step()
    out["environment"] = hardware.detect()
    return out


def run_self_test(n: int = 4) -> tuple[list[Result], hardware.Environment]:
    """Run the self-test in one launch of an ``n``-device CPU mesh; compare with the reference.

    Returns the rows and the mesh's own :func:`~xla_permute.hardware.detect` (rank 0).
    """
    from xla_permute.launch import run_on_mesh

    checks = permute_checks(n)
    inputs = _inputs(n)
    matmul = _matmul_available()
    per_rank = run_on_mesh(self_test_rank, checks, inputs, matmul, n=n)
    results = []
    for check in checks:
        want = reference.permute(inputs["x"], check.pairs, check.groups)
        got = torch.stack([r[check.name] for r in per_rank])
        results.append(_compare(check.name, "collective_permute (auto: emulated)", got, want))
    if matmul:
        want = reference.all_gather_matmul(inputs["xm"], inputs["w"], dim=0)
        for bidirectional in (False, True):
            name = f"all_gather_matmul bidirectional={bidirectional}"
            got = torch.stack([r[name] for r in per_rank])
            results.append(_compare(name, "ring of permutes (auto: emulated)", got, want))
    else:
        results.append(
            Result("all_gather_matmul", "-", True, "skipped: xla_permute.matmul not installed")
        )
    return results, per_rank[0]["environment"]


def _compare(name: str, backend: str, got: torch.Tensor, want: torch.Tensor) -> Result:
    if got.shape != want.shape:
        return Result(name, backend, False, f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    bad = [r for r in range(want.shape[0]) if not torch.equal(got[r], want[r])]
    if bad:
        return Result(name, backend, False, f"differs from the reference on ranks {bad}")
    return Result(name, backend, True, "ok (exact)")


def _table(rows: Sequence[Result]) -> str:
    header = ("check", "backend", "result")
    body = [(r.check, r.backend, r.detail) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]
    return "\n".join(
        "  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)).rstrip()
        for line in [header, tuple("-" * w for w in widths), *body]
    )


def main(n: int = 4, device_type: str | None = None, self_test: bool = True) -> int:
    """Print the report; return 0 when every self-test check passed, else 1.

    ``device_type`` shows the caveats of another device type than the detected one.
    """
    from xla_permute.launch import MeshError

    env = hardware.detect()
    shown = device_type or env.device_type
    print("xla-permute doctor\n\n== environment (read without starting the XLA runtime)")
    print(env.format())
    applicable = hardware.caveats(shown)
    print(f"\n== caveats for {hardware._device_type(shown)} ({len(applicable)})")
    for caveat in applicable:
        print(caveat.format() + "\n")
    if not self_test:
        return 0
    print(f"== self-test: {n}-device CPU mesh (PJRT_DEVICE=CPU), one launch, vs the reference")
    start = time.perf_counter()
    try:
        rows, mesh_env = run_self_test(n)
    except (MeshError, TypeError, ValueError) as e:
        print(f"self-test could not run: {type(e).__name__}: {e}")
        return 1
    print(f"mesh: {mesh_env.device_type} x {mesh_env.device_count} (as its runtime reports)")
    print(_table(rows))
    failed = [r for r in rows if not r.ok]
    seconds = time.perf_counter() - start
    print(f"{len(rows) - len(failed)} of {len(rows)} checks ok ({seconds:.1f} s)")
    return 1 if failed else 0
