"""The verification table of ``python -m xla_permute demo``.

A :class:`Check` pairs a rank function (run on every device of the mesh) with a verifier
(run here, on the per-rank results, against the pure-torch reference). All checks of one mesh
size run in a single launch; each row reports the check, the backend that produced the result,
ok or the failure, and the slowest rank's wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xla_permute import examples
from xla_permute.launch import run_on_mesh
from xla_permute.pipeline import demo_step, verify_demo_step

__all__ = ["CHECKS", "Check", "Row", "format_table", "run_checks"]


@dataclass(frozen=True)
class Check:
    """One row of the table: ``run`` on every rank, then ``verify(per_rank_results)``."""

    name: str
    backend: str
    run: Callable[[], Any]
    verify: Callable[[list[Any]], None]


@dataclass(frozen=True)
class Row:
    check: str
    backend: str
    ok: bool
    detail: str
    seconds: float


def _verify_all_gather(results: list[Any]) -> None:
    n = len(results)
    expected = torch.arange(float(n)).repeat_interleave(2)[:, None].expand(2 * n, 3)
    for rank, got in enumerate(results):
        if not torch.equal(got, expected):
            raise AssertionError(f"rank {rank}: all-gather differs from the reference")


CHECKS: list[Check] = [
    Check(
        "all-gather with channel id",
        "upstream xm.all_gather",
        examples.all_gather_ranks,
        _verify_all_gather,
    ),
    Check(
        "pipeline step vs single device",
        "emulated stage shifts",
        demo_step,
        verify_demo_step,
    ),
    Check(
        "permute: ring shift + open chain (zero fill) vs reference",
        "emulated",
        examples.permute_demo_forward,
        examples.verify_permute_demo_forward,
    ),
    Check(
        "permute backward vs reference autograd",
        "emulated",
        examples.permute_demo_backward,
        examples.verify_permute_demo_backward,
    ),
    Check(
        "all_gather_matmul uni+bi, fwd+bwd vs all-gather + matmul",
        "emulated",
        examples.all_gather_matmul_demo,
        examples.verify_matmul_demo,
    ),
    Check(
        "matmul_reduce_scatter uni+bi, fwd+bwd vs matmul + reduce-scatter",
        "emulated",
        examples.matmul_reduce_scatter_demo,
        examples.verify_matmul_demo,
    ),
    Check(
        "collective matmul HLO: N-1 permutes, overlappable dots",
        "native (traced, not run)",
        examples.collective_matmul_demo_hlo,
        examples.verify_collective_matmul_demo_hlo,
    ),
    Check(
        "permute HLO: one collective-permute, ring pairs",
        "native (traced, not run)",
        examples.permute_demo_native_hlo,
        examples.verify_permute_demo_native_hlo,
    ),
]


def _checks_by_name(names: Sequence[str]) -> list[Check]:
    by_name = {c.name: c for c in CHECKS}
    return [by_name[name] for name in names]


def _run_on_rank(names: list[str]) -> dict[str, tuple[bool, Any, float]]:
    out = {}
    for check in _checks_by_name(names):
        start = time.perf_counter()
        try:
            value: tuple[bool, Any] = (True, check.run())
        except Exception as e:  # a failing check is a row of the table, not a crash
            value = (False, f"{type(e).__name__}: {e}")
        out[check.name] = (*value, time.perf_counter() - start)
    return out


def run_checks(n: int = 4, names: Sequence[str] | None = None) -> list[Row]:
    """Run the named checks (default: all) in one launch of an ``n``-device mesh."""
    checks = _checks_by_name(names) if names is not None else list(CHECKS)
    per_rank = run_on_mesh(_run_on_rank, [c.name for c in checks], n=n)
    rows = []
    for check in checks:
        results = [r[check.name] for r in per_rank]
        seconds = max(r[2] for r in results)
        failed = [(rank, r[1]) for rank, r in enumerate(results) if not r[0]]
        if failed:
            rank, error = failed[0]
            rows.append(Row(check.name, check.backend, False, f"rank {rank}: {error}", seconds))
            continue
        try:
            check.verify([r[1] for r in results])
        except AssertionError as e:
            rows.append(Row(check.name, check.backend, False, str(e), seconds))
            continue
        rows.append(Row(check.name, check.backend, True, "ok", seconds))
    return rows


def format_table(rows: Sequence[Row]) -> str:
    """A plain-text table: check, backend, result, time."""
    header = ("check", "backend", "result", "time")
    body = [
        (r.check, r.backend, r.detail if not r.ok else "ok", f"{r.seconds * 1e3:.0f} ms")
        for r in rows
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body, strict=True)]
    lines = [
        "  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, tuple("-" * w for w in widths), *body]
    ]
    return "\n".join(lines)
