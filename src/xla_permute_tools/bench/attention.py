"""``python -m xla_permute bench --attention``: ring attention vs all-gather K/V, measured.

Causal attention over a long sequence split over N ranks (zigzag layout), forward and
forward+backward, as :func:`xla_permute.ring_attention` (N-1 permutes forward, N+1 backward)
and as :func:`xla_permute.all_gather_attention` (one all-gather of K and V). Per rank:
``q [B, Hq, S/N, D]``, ``k, v [B, Hkv, S/N, D]``, float32, inputs are program parameters.

* **bytes sent per rank** (``native`` HLO, traced on the CPU mesh, never run):
  :func:`xla_permute.hlo.bytes_sent_per_rank` over the program's collectives (ring
  algorithms assumed for the all-gather and the reduce-scatter of its backward);
* **peak memory** (``native``): "Total bytes used" of XLA:CPU's buffer assignment of the
  compiled program (``XLA_FLAGS=--xla_dump_to``), as the collective-matmul bench reads it.
  Ranks compile one after the other; ranks 0 and N-1 are measured (their causal work is the
  same under zigzag) and the larger figure is reported.

Both compute attention blocks as plain matmuls (no fused kernel), so the score matrices
dominate the memory: ``[S/N, S]`` per head at once for the all-gather, a chunk-pair block
per hop for the ring.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from xla_permute import run_on_mesh
from xla_permute.debug import ENV as DEBUG_ENV
from xla_permute_tools.bench.measure import read_memory_report
from xla_permute_tools.bench.run import NO_GUARD

__all__ = ["ATTENTION_SHAPE", "attention_rank", "format_attention_report", "run_attention_bench"]

#: B, Hq, Hkv, S, D of the bench: a long sequence, few heads so that it compiles fast.
ATTENTION_SHAPE = (1, 2, 1, 16384, 128)
PROGRAMS = ("ring", "all_gather")
MODES = ("forward", "forward+backward")

_turn = threading.Condition()
_next = [0]


def _build(name: str, mode: str, shape: tuple[int, ...]) -> list[Any]:
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    b, hq, hkv, s, d = shape
    n, dev = xr.world_size(), torch_xla.device()
    grad = mode != "forward"
    q = torch.zeros(b, hq, s // n, d).to(dev).requires_grad_(grad)
    k = torch.zeros(b, hkv, s // n, d).to(dev).requires_grad_(grad)
    v = torch.zeros(b, hkv, s // n, d).to(dev).requires_grad_(grad)
    if name == "ring":
        y = xp.ring_attention(q, k, v, causal=True, layout="zigzag", backend="native")
    else:
        y = xp.all_gather_attention(q, k, v, causal=True, layout="zigzag")
    if not grad:
        return [y]
    y.sum().backward()
    return [q.grad, k.grad, v.grad]


def attention_rank(shape: tuple[int, ...], dump_dir: str) -> dict[str, Any]:
    """Rank function: trace every program (bytes), compile it on ranks 0 and N-1 (memory)."""
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute import hlo

    rank, n = xr.global_ordinal(), xr.world_size()
    with _turn:
        _turn.wait_for(lambda: _next[0] == rank)
    try:
        out: dict[str, Any] = {}
        for name in PROGRAMS:
            for mode in MODES:
                before = set(os.listdir(dump_dir))
                with hlo.tracing():  # native: traced and compiled, never run
                    tensors = _build(name, mode, shape)
                    program = hlo.parse(torch_xla._XLAC._get_xla_tensors_hlo(tensors))
                    if rank in (0, n - 1):
                        torch_xla._XLAC._xla_warm_up_cache(tensors, [])
                    del tensors
                torch_xla.sync()
                new = sorted(set(os.listdir(dump_dir)) - before)
                reports = [f for f in new if f.endswith("memory-usage-report.txt")]
                collectives = program.collectives()
                out[f"{name}|{mode}"] = {
                    "bytes_sent": sum(hlo.bytes_sent_per_rank(c, n, rank) for c in collectives),
                    "collectives": [c.kind for c in collectives],
                    "peak_bytes": read_memory_report(Path(dump_dir, reports[0]))
                    if len(reports) == 1
                    else None,
                }
        return out
    finally:
        with _turn:
            _next[0] += 1
            _turn.notify_all()


def run_attention_bench(
    ns: tuple[int, ...] = (4, 8), shape: tuple[int, ...] = ATTENTION_SHAPE
) -> dict[str, Any]:
    """One mesh launch per N; returns ``{N: {"<program>|<mode>": {...}}}`` (largest rank)."""
    result: dict[str, Any] = {"shape": shape, "n": {}}
    for n in ns:
        with tempfile.TemporaryDirectory(prefix="xla_permute_attn_") as dump:
            # no check programs, no sync guard: the dump holds the measured programs only
            env = {"XLA_FLAGS": f"--xla_dump_to={dump}", DEBUG_ENV: "none", **NO_GUARD}
            per_rank = run_on_mesh(attention_rank, shape, dump, n=n, env=env, timeout=1800)
        merged = {}
        for key in per_rank[0]:
            peaks = [r[key]["peak_bytes"] for r in per_rank if r[key]["peak_bytes"] is not None]
            merged[key] = {
                "bytes_sent": max(r[key]["bytes_sent"] for r in per_rank),
                "collectives": per_rank[0][key]["collectives"],
                "peak_bytes": max(peaks) if peaks else None,
            }
        result["n"][n] = merged
    return result


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f} MiB"


def format_attention_report(result: dict[str, Any]) -> str:
    """A table per N: bytes sent and peak memory, ring vs all-gather, and their ratio."""
    b, hq, hkv, s, d = result["shape"]
    lines = [
        f"Ring attention vs all-gather K/V (causal, zigzag), B={b} Hq={hq} Hkv={hkv} S={s} "
        f"D={d} float32; bytes: native HLO; peak: XLA:CPU buffer assignment (native)",
    ]
    for n, rows in result["n"].items():
        lines.append(f"N={n}")
        lines.append(f"  {'mode':18s} {'':12s} {'ring':>12s} {'all-gather':>12s} {'ring/ag':>8s}")
        for mode in MODES:
            ring, ag = rows[f"ring|{mode}"], rows[f"all_gather|{mode}"]
            for what, fmt in (("bytes_sent", _mib), ("peak_bytes", _mib)):
                ratio = ring[what] / ag[what] if ring[what] and ag[what] else None
                lines.append(
                    f"  {mode:18s} {what:12s} {fmt(ring[what]):>12s} {fmt(ag[what]):>12s} "
                    f"{'-' if ratio is None else f'{ratio:.3f}':>8s}"
                )
    return "\n".join(lines)
