"""``python -m xla_permute bench --backend c10d``: the rings on torch.distributed, measured.

Real processes (``torchrun --standalone``, gloo, CPU tensors, one thread per process), the
``c10d`` backend (:mod:`xla_permute.backends.c10d`): every permute is a point-to-point
``batch_isend_irecv`` that runs while the ring computes. At each process count (2 and 4 by
default) one launch measures, side by side in one run (interleaved, alternating order):

* all-gather-matmul: ring (uni, bi) vs :func:`~xla_permute.matmul.all_gather_then_matmul`
  (``all_gather_into_tensor`` + one matmul); per rank x ``[m, k]``, w ``[k, f]``;
* matmul-reduce-scatter: ring vs :func:`~xla_permute.matmul.matmul_then_reduce_scatter`
  (one matmul + ``reduce_scatter_tensor``); per rank x ``[N*m, k]``, w ``[k, f]``;
* ring attention, forward and forward+backward, vs
  :func:`~xla_permute.attention.all_gather_attention`; per rank q, k, v ``[1, H, S/N, D]``.

Wall time: a barrier, then the op on every rank; the slowest rank's time counts; the median
over ``repeats`` (after ``warmup``). Bytes per rank: the ring's counted at the backend's
``send`` (what this rank posts); the baselines' as a ring algorithm's ``N-1`` blocks (gloo's
own collective algorithms may move more). The results are checked against each other
(allclose: float32 in another summation order).

The **timeline** of one ring all-gather-matmul (uni, ``N`` processes): per rank and hop, when
the transfer was posted and when it had arrived (a helper thread waits on the transfer), and
when the matmul between posting and waiting ran.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["C10D_PRESETS", "C10dConfig", "format_c10d_report", "run_c10d_bench"]


OPS = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "attention forward",
    "attention forward+backward",
)


@dataclass(frozen=True)
class C10dConfig:
    """Sizes and repeats of the c10d bench (per-rank shapes, see the module docstring)."""

    m: int = 512
    k: int = 1024
    f: int = 512
    seq: int = 512  # S/N: this rank's sequence of ring attention
    heads: int = 4
    head_dim: int = 64
    processes: tuple[int, ...] = (2, 4)
    ops: tuple[str, ...] = OPS
    repeats: int = 10
    warmup: int = 2
    timeout: float = 600.0  # seconds per launch

    def __post_init__(self) -> None:
        for name in ("m", "k", "f", "seq", "heads", "head_dim", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.processes or any(p < 2 for p in self.processes):
            raise ValueError(f"processes must be counts >= 2, got {self.processes}")
        unknown = [op for op in self.ops if op not in OPS]
        if unknown or not self.ops:
            raise ValueError(f"ops must be some of {OPS}, got {self.ops}")

    def programs(self) -> tuple[tuple[str, str], ...]:
        """The (op, variant) pairs measured."""
        return tuple(p for p in PROGRAMS if p[0] in self.ops)


C10D_PRESETS = {
    "default": C10dConfig(),
    "tiny": C10dConfig(
        m=8,
        k=16,
        f=8,
        seq=8,
        heads=2,
        head_dim=4,
        processes=(2,),
        repeats=1,
        warmup=0,
        timeout=120.0,
    ),
}

#: (op, variant) pairs measured; "ring" and "baseline" side by side, "bi" beside them.
PROGRAMS = (
    ("all_gather_matmul", "ring"),
    ("all_gather_matmul", "bi"),
    ("all_gather_matmul", "baseline"),
    ("matmul_reduce_scatter", "ring"),
    ("matmul_reduce_scatter", "bi"),
    ("matmul_reduce_scatter", "baseline"),
    ("attention forward", "ring"),
    ("attention forward", "baseline"),
    ("attention forward+backward", "ring"),
    ("attention forward+backward", "baseline"),
)


# --- the worker (one process per rank, under torchrun) ---------------------------------------


def _programs(c: C10dConfig, n: int, rank: int) -> dict[tuple[str, str], Callable[[], Any]]:
    import torch

    import xla_permute as xp

    g = torch.Generator().manual_seed(rank)
    x, w = torch.randn(c.m, c.k, generator=g), torch.randn(c.k, c.f, generator=g)
    xm = torch.randn(n * c.m, c.k, generator=g)
    q, k, v = (torch.randn(1, c.heads, c.seq, c.head_dim, generator=g) for _ in range(3))

    def attention(fn: Callable, backward: bool) -> Callable[[], Any]:
        def run() -> Any:
            ins = [t.clone().requires_grad_(backward) for t in (q, k, v)]
            out = fn(*ins, causal=False)
            if not backward:
                return out
            out.sum().backward()
            return torch.cat([out.detach().flatten(), *(t.grad.flatten() for t in ins)])

        return run

    return {
        ("all_gather_matmul", "ring"): lambda: xp.all_gather_matmul(x, w, dim=0, backend="c10d"),
        ("all_gather_matmul", "bi"): lambda: xp.all_gather_matmul(
            x, w, dim=0, bidirectional=True, backend="c10d"
        ),
        ("all_gather_matmul", "baseline"): lambda: xp.all_gather_then_matmul(
            x, w, dim=0, backend="c10d"
        ),
        ("matmul_reduce_scatter", "ring"): lambda: xp.matmul_reduce_scatter(
            xm, w, dim=0, backend="c10d"
        ),
        ("matmul_reduce_scatter", "bi"): lambda: xp.matmul_reduce_scatter(
            xm, w, dim=0, bidirectional=True, backend="c10d"
        ),
        ("matmul_reduce_scatter", "baseline"): lambda: xp.matmul_then_reduce_scatter(
            xm, w, dim=0, backend="c10d"
        ),
        ("attention forward", "ring"): attention(xp.ring_attention, False),
        ("attention forward", "baseline"): attention(xp.all_gather_attention, False),
        ("attention forward+backward", "ring"): attention(xp.ring_attention, True),
        ("attention forward+backward", "baseline"): attention(xp.all_gather_attention, True),
    }


def _baseline_bytes(op: str, c: C10dConfig, n: int) -> int:
    """A ring algorithm's bytes per rank for the baseline's collectives (float32)."""
    if op == "all_gather_matmul":
        return (n - 1) * c.m * c.k * 4
    if op == "matmul_reduce_scatter":
        return (n - 1) * c.m * c.f * 4
    kv = 2 * c.heads * c.seq * c.head_dim * 4  # all-gather of [2, 1, H, S/N, D]
    return (n - 1) * kv * (2 if op.endswith("backward") else 1)  # + reduce-scatter of dK/dV


class _Counting:
    """Wraps the c10d backend's ``send``: counts the bytes this rank posts; optionally records
    a timeline (posting, arrival via a helper thread that waits on the transfer)."""

    def __init__(self, backend: Any, timeline: list | None = None) -> None:
        self.backend, self.inner, self.bytes, self.timeline = backend, backend.send, 0, timeline
        self.t0 = time.perf_counter()

    def __enter__(self) -> _Counting:
        self.backend.send = self.send
        return self

    def __exit__(self, *exc: object) -> None:
        del self.backend.send

    def send(self, x: Any, pairs: Any, tag: int = 0) -> Any:
        rank = self.backend.rank()
        self.bytes += sum(x.numel() * x.element_size() for s, t in pairs if s == rank != t)
        if self.timeline is None:
            return self.inner(x, pairs, tag)
        posted = time.perf_counter()
        handle = self.inner(x, pairs, tag)
        event: dict[str, float] = {"posted": posted - self.t0}
        self.timeline.append(event)

        def wait() -> None:
            handle.wait()
            event["arrived"] = time.perf_counter() - self.t0

        thread = threading.Thread(target=wait)
        thread.start()
        return _Timed(handle, thread, event, self.t0)


class _Timed:
    def __init__(self, handle: Any, thread: threading.Thread, event: dict, t0: float) -> None:
        self.handle, self.thread, self.event, self.t0 = handle, thread, event, t0

    def wait(self) -> Any:
        self.event["wait"] = time.perf_counter() - self.t0  # the matmul before it has ended
        self.thread.join()
        self.event["waited"] = time.perf_counter() - self.t0
        return self.handle.wait()


def worker(out: str, config: dict[str, Any]) -> None:
    """One rank of the bench launch: measure, gather to rank 0, which writes ``out`` (JSON)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from xla_permute.backends.c10d import c10d_backend

    c = C10dConfig(
        **{**config, "processes": tuple(config["processes"]), "ops": tuple(config["ops"])}
    )
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank, n = dist.get_rank(), dist.get_world_size()
    programs = {k: fn for k, fn in _programs(c, n, rank).items() if k in c.programs()}
    backend = c10d_backend()
    results, sent, agree = {}, {}, {}
    for key, fn in programs.items():  # one untimed run each: results and bytes
        with _Counting(backend) as counter:
            results[key] = fn()
        sent[key] = counter.bytes
    for op in c.ops:
        base = results[op, "baseline"]
        agree[op] = all(
            torch.allclose(results[op, v], base, rtol=1e-4, atol=1e-4)
            for o, v in c.programs()
            if o == op and v != "baseline"
        )
    times: dict[tuple[str, str], list[float]] = {key: [] for key in c.programs()}
    for rep in range(c.warmup + c.repeats):
        order = c.programs() if rep % 2 == 0 else tuple(reversed(c.programs()))
        for key in order:
            dist.barrier()
            start = time.perf_counter()
            programs[key]()
            if rep >= c.warmup:
                times[key].append(time.perf_counter() - start)
    timeline: list[dict[str, float]] = []
    end = 0.0
    if ("all_gather_matmul", "ring") in programs:
        dist.barrier()
        with _Counting(backend, timeline) as counter:
            programs["all_gather_matmul", "ring"]()
            end = time.perf_counter() - counter.t0
    mine = {
        "times": {"|".join(k): v for k, v in times.items()},
        "sent": {"|".join(k): v for k, v in sent.items()},
        "agree": agree,
        "timeline": {"hops": timeline, "end": end},
    }
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(_summary(c, n, everyone), indent=2) + "\n")
    dist.destroy_process_group()


def _summary(c: C10dConfig, n: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for op, variant in c.programs():
        key = f"{op}|{variant}"
        slowest = [max(r["times"][key][i] for r in ranks) for i in range(c.repeats)]
        rows.append(
            {
                "op": op,
                "variant": variant,
                "seconds": statistics.median(slowest),
                "bytes_per_rank": ranks[0]["sent"][key]
                if variant != "baseline"
                else _baseline_bytes(op, c, n),
            }
        )
    for row in rows:
        base = next(r for r in rows if r["op"] == row["op"] and r["variant"] == "baseline")
        row["ratio"] = row["seconds"] / base["seconds"]
    agree = {op: all(r["agree"][op] for r in ranks) for op in ranks[0]["agree"]}
    timeline = [r["timeline"] for r in ranks]
    return {"n": n, "rows": rows, "agree": agree, "timeline": timeline}


# --- the launcher ---------------------------------------------------------------------------


def run_c10d_bench(config: C10dConfig | None = None, progress: Callable | None = None) -> dict:
    """Launch the bench at every process count of ``config``; the results, by count."""
    c = config or C10D_PRESETS["default"]
    say = progress or (lambda message: print(f"[bench c10d] {message}", file=sys.stderr))
    out: dict[str, Any] = {"config": asdict(c), "launches": []}
    for n in c.processes:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "result.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                "-m",
                "xla_permute_tools.bench.c10d",
                str(path),
                json.dumps(asdict(c)),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "XLA_PERMUTE_DEBUG": "none"}
            say(f"{n} processes (torchrun, gloo)")
            start = time.monotonic()
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=c.timeout, check=False
            )
            if done.returncode != 0 or not path.exists():
                raise RuntimeError(
                    f"the c10d bench launch with {n} processes failed (exit "
                    f"{done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
                )
            launch = json.loads(path.read_text())
            launch["launch_seconds"] = time.monotonic() - start
            out["launches"].append(launch)
    out["checks"] = [
        {
            "name": f"ring all-gather-matmul <= 0.9x the baseline at N={la['n']}",
            "ok": _ratio(la, "all_gather_matmul") <= 0.9,
        }
        for la in out["launches"]
        if "all_gather_matmul" in c.ops
    ] + [
        {"name": f"ring == baseline (allclose) for {op} at N={la['n']}", "ok": ok}
        for la in out["launches"]
        for op, ok in sorted(la["agree"].items())
    ]
    return out


def _ratio(launch: dict, op: str, variant: str = "ring") -> float:
    return next(r["ratio"] for r in launch["rows"] if (r["op"], r["variant"]) == (op, variant))


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def format_c10d_report(result: dict) -> str:
    """The report: one table per process count, then the checks."""
    c = result["config"]
    lines = [
        "c10d bench: the rings on torch.distributed (gloo, CPU tensors, one thread per "
        "process; torchrun --standalone)",
        f"all-gather-matmul x [{c['m']}, {c['k']}] w [{c['k']}, {c['f']}]; "
        f"matmul-reduce-scatter x [N*{c['m']}, {c['k']}]; attention q/k/v [1, {c['heads']}, "
        f"{c['seq']}, {c['head_dim']}] per rank; float32; median of {c['repeats']} "
        f"(slowest rank)",
    ]
    for la in result["launches"]:
        lines += [
            "",
            f"N={la['n']} processes",
            f"{'op':<28}{'variant':<10}{'ms':>9}{'x baseline':>12}{'sent/rank':>14}",
        ]
        for r in la["rows"]:
            lines.append(
                f"{r['op']:<28}{r['variant']:<10}{1e3 * r['seconds']:>9.1f}"
                f"{r['ratio']:>11.2f}x{_mib(r['bytes_per_rank']):>14}"
            )
    lines += ["", "checks:"]
    lines += [f"  [{'ok' if ch['ok'] else 'FAILED'}] {ch['name']}" for ch in result["checks"]]
    return "\n".join(lines)


def config_with(preset: str = "default", **overrides: Any) -> C10dConfig:
    """A preset with some fields replaced (None leaves a field alone)."""
    return replace(C10D_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))
