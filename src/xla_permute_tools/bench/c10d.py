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

Beside each ring, in the same launch and the same interleaved loop: its **compute alone**
(every permute a loopback), its **transfers alone** (its own sends replayed), the **floor**
``max(compute, transfer)`` and the **hidden fraction** (:mod:`xla_permute_tools.bench.overlap`),
and a probe of what the machine overlaps at all (one matmul beside one transfer). Every time is
reported as the median of the slowest rank with its spread (fastest and slowest repeat), with
the rank that was slowest most often and the load average before and after the launch.

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

from xla_permute_tools.bench import overlap

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
    load_before = os.getloadavg()[0]
    programs = {k: fn for k, fn in _programs(c, n, rank).items() if k in c.programs()}
    backend = c10d_backend()
    results, sent, agree, sends = {}, {}, {}, {}
    for key, fn in programs.items():  # one untimed run each: results, bytes and sends
        record: list = []
        with _Counting(backend) as counter, overlap.recorded(backend, record):
            results[key] = fn()
        sent[key], sends[key] = counter.bytes, record
    for op in c.ops:
        base = results[op, "baseline"]
        agree[op] = all(
            torch.allclose(results[op, v], base, rtol=1e-4, atol=1e-4)
            for o, v in c.programs()
            if o == op and v != "baseline"
        )
    timed = {"|".join(k): fn for k, fn in programs.items()}
    for (op, variant), fn in programs.items():
        if variant != "baseline":  # the ring's parts alone
            timed[f"{op}|{variant}|compute"] = _alone(backend, fn)
            timed[f"{op}|{variant}|transfer"] = overlap.replay(backend, sends[op, variant])
    probe = overlap.probe_programs(backend, c.m, c.k, c.f, rank, n)
    timed |= {f"probe|{name}": fn for name, fn in probe.items()}
    times: dict[str, list[float]] = {key: [] for key in timed}
    for rep in range(c.warmup + c.repeats):
        order = list(timed) if rep % 2 == 0 else list(reversed(timed))
        for key in order:
            dist.barrier()
            seconds = overlap.timed(timed[key])
            if rep >= c.warmup:
                times[key].append(seconds)
    timeline: list[dict[str, float]] = []
    end = 0.0
    if ("all_gather_matmul", "ring") in programs:
        dist.barrier()
        with _Counting(backend, timeline) as counter:
            programs["all_gather_matmul", "ring"]()
            end = time.perf_counter() - counter.t0
    mine = {
        "load": [load_before, os.getloadavg()[0]],
        "times": times,
        "sent": {"|".join(k): v for k, v in sent.items()},
        "agree": agree,
        "timeline": {"hops": timeline, "end": end},
    }
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(_summary(c, n, everyone), indent=2) + "\n")
    dist.destroy_process_group()


def _alone(backend: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with every permute a loopback: its compute alone."""

    def run() -> Any:
        with overlap.loopback(backend):
            return fn()

    return run


def _stats(ranks: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """The slowest rank's time per repeat: median, fastest and slowest repeat, and the rank
    that was slowest most often."""
    repeats = len(ranks[0]["times"][key])
    per_repeat = [[r["times"][key][i] for r in ranks] for i in range(repeats)]
    slowest = [max(times) for times in per_repeat]
    laggards = [times.index(max(times)) for times in per_repeat]
    return {
        "seconds": statistics.median(slowest),
        "spread": [min(slowest), max(slowest)],
        "slowest_rank": max(set(laggards), key=laggards.count),
    }


def _summary(c: C10dConfig, n: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rows = []
    for op, variant in c.programs():
        key = f"{op}|{variant}"
        row = {"op": op, "variant": variant, **_stats(ranks, key)}
        row["bytes_per_rank"] = (
            ranks[0]["sent"][key] if variant != "baseline" else _baseline_bytes(op, c, n)
        )
        if variant != "baseline":
            compute = _stats(ranks, f"{key}|compute")["seconds"]
            transfer = _stats(ranks, f"{key}|transfer")["seconds"]
            row |= {
                "compute_seconds": compute,
                "transfer_seconds": transfer,
                "floor_seconds": max(compute, transfer),
                "hidden_fraction": overlap.hidden_fraction(compute, transfer, row["seconds"]),
            }
        rows.append(row)
    for row in rows:
        base = next(r for r in rows if r["op"] == row["op"] and r["variant"] == "baseline")
        row["ratio"] = row["seconds"] / base["seconds"]
    probe = {name: _stats(ranks, f"probe|{name}")["seconds"] for name in ("matmul", "transfer")}
    probe["both"] = _stats(ranks, "probe|both")["seconds"]
    probe["hidden_fraction"] = overlap.hidden_fraction(
        probe["matmul"], probe["transfer"], probe["both"]
    )
    agree = {op: all(r["agree"][op] for r in ranks) for op in ranks[0]["agree"]}
    timeline = [r["timeline"] for r in ranks]
    load = [max(r["load"][0] for r in ranks), max(r["load"][1] for r in ranks)]
    return {
        "n": n,
        "rows": rows,
        "probe": probe,
        "load": load,
        "agree": agree,
        "timeline": timeline,
    }


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
    # A goal a quiet machine of this size meets (the ring's compute no more than the
    # baseline's); the other ratios and the hidden fractions are figures, without a verdict.
    out["checks"] = [
        {
            "name": f"ring attention forward <= 1.0x its all-gather baseline at N={la['n']} "
            f"(a goal on a quiet machine; load {la['load'][1]:.1f})",
            "ok": _ratio(la, "attention forward") <= 1.0,
        }
        for la in out["launches"]
        if "attention forward" in c.ops
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
        f"(slowest rank) and its spread; compute: the ring with loopback permutes; transfer:"
        f" its sends alone; floor = max(compute, transfer); hidden = (compute + transfer - "
        f"ring) / min(compute, transfer)",
    ]
    for la in result["launches"]:
        probe = la["probe"]
        lines += [
            "",
            f"N={la['n']} processes (load average {la['load'][0]:.1f} before, "
            f"{la['load'][1]:.1f} after)",
            f"{'op':<27}{'variant':<9}{'ms':>7}{'spread':>13}{'x base':>8}{'compute':>9}"
            f"{'transfer':>9}{'floor':>7}{'hidden':>8}{'sent/rank':>12}",
        ]
        for r in la["rows"]:
            spread = f"{1e3 * r['spread'][0]:.1f}-{1e3 * r['spread'][1]:.1f}"
            parts = (
                f"{1e3 * r['compute_seconds']:>9.1f}{1e3 * r['transfer_seconds']:>9.1f}"
                f"{1e3 * r['floor_seconds']:>7.1f}{r['hidden_fraction']:>8.2f}"
                if "compute_seconds" in r
                else f"{'':>33}"
            )
            lines.append(
                f"{r['op']:<27}{r['variant']:<9}{1e3 * r['seconds']:>7.1f}{spread:>13}"
                f"{r['ratio']:>7.2f}x{parts}{_mib(r['bytes_per_rank']):>12}"
            )
        lines.append(
            f"probe: matmul {1e3 * probe['matmul']:.1f} ms, transfer {1e3 * probe['transfer']:.1f}"
            f" ms, both {1e3 * probe['both']:.1f} ms: hidden fraction "
            f"{probe['hidden_fraction']:.2f} (what this machine overlaps at all)"
        )
    lines += ["", "checks:"]
    lines += [f"  [{'ok' if ch['ok'] else 'FAILED'}] {ch['name']}" for ch in result["checks"]]
    return "\n".join(lines)


def config_with(preset: str = "default", **overrides: Any) -> C10dConfig:
    """A preset with some fields replaced (None leaves a field alone)."""
    return replace(C10D_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))
