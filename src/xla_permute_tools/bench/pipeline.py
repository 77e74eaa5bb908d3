"""``python -m xla_permute bench --pipeline``: every pipeline schedule's step time, side by side.

Real processes (``torchrun --standalone``, gloo, CPU tensors, one thread per process), the
``c10d`` backend: :func:`xla_permute.pipeline_step` of every schedule of
:data:`~xla_permute.SCHEDULES` on one model, in one launch, in turn (round
``i`` runs every schedule once, the order rotated each round; round 0 warms up). The model:
``layers`` layers ``tanh(x @ w)`` of ``dim`` (seeded, the same on every process), split over
``n`` ranks in ``2 n`` stages (two per rank; GPipe, 1F1B and ZB-H1 hold both of a rank's stages
as one), ``micro_batches`` micro-batches of ``rows`` rows, a mean-squared-error loss.

Wall time of a step: a barrier, the step on every rank, a barrier; the slowest rank's; the
median over ``repeats`` rounds. Beside it, from the schedule's data: ticks, shifts and the
bubble (every cell one tick), and from the run the loss (equal across schedules, allclose).

On this machine the processes share its cores: with fewer cores than processes a rank idle in
the bubble hands its core to another, so the bubble costs little and every tick's rendezvous
costs its latency; the ratios say which schedule issues fewer shifts, not which has the smaller
bubble on a machine with a core (or a chip) per rank.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from xla_permute import SCHEDULES

__all__ = [
    "PIPELINE_PRESETS",
    "PipelineBenchConfig",
    "format_pipeline_report",
    "run_pipeline_bench",
]

#: schedule -> stages per rank (every schedule runs the same 2 n stages of the model)
STAGES_PER_RANK = {name: 1 if name in ("gpipe", "1f1b", "zbh1") else 2 for name in SCHEDULES}


@dataclass(frozen=True)
class PipelineBenchConfig:
    """Sizes and repeats of the pipeline bench (see the module docstring)."""

    n: int = 4
    micro_batches: int = 8
    rows: int = 128
    dim: int = 256
    layers: int = 16
    repeats: int = 5
    timeout: float = 900.0

    def __post_init__(self) -> None:
        for name in ("n", "micro_batches", "rows", "dim", "layers", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.layers % (2 * self.n):
            raise ValueError(
                f"layers={self.layers} must split into {2 * self.n} equal stages (2 per rank); "
                f"pass a multiple of {2 * self.n}"
            )
        if self.micro_batches < 2 * self.n or self.micro_batches % self.n:
            raise ValueError(
                f"micro_batches={self.micro_batches}: pass a multiple of n={self.n}, at least "
                f"{2 * self.n} (DualPipeV needs one per stage, zero bubble rounds of n)"
            )


PIPELINE_PRESETS = {
    "default": PipelineBenchConfig(),
    "tiny": PipelineBenchConfig(n=2, micro_batches=4, rows=8, dim=16, layers=4, repeats=2),
}


def _layers_of(c: PipelineBenchConfig, name: str, rank: int) -> list[list[int]]:
    """The model's layers in each of this rank's stages for ``name``."""
    from xla_permute import make_schedule

    v = STAGES_PER_RANK[name]
    s = make_schedule(name, c.n, c.micro_batches, v)
    per = c.layers // (c.n * v)
    return [list(range(k * per, (k + 1) * per)) for k in s.stages_of(rank)]


def worker(out: str, config: dict[str, Any]) -> None:
    """One process of the launch: every schedule, ``repeats + 1`` rounds, in turn."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import xla_permute as xp

    c = PipelineBenchConfig(**config)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    rank = dist.get_rank()
    weights = {i: (torch.randn(c.dim, c.dim, generator=torch.Generator().manual_seed(i))
                   / c.dim**0.5).requires_grad_() for i in range(c.layers)}  # fmt: skip

    def stage(layers: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            for i in layers:
                x = torch.tanh(x @ weights[i])
            return x

        return run

    g = torch.Generator().manual_seed(1000)
    inputs = torch.randn(c.micro_batches, c.rows, c.dim, generator=g)
    targets = torch.randn(c.micro_batches, c.rows, c.dim, generator=g)
    names = list(STAGES_PER_RANK)
    modules = {name: [stage(ls) for ls in _layers_of(c, name, rank)] for name in names}
    seconds: dict[str, list[float]] = {name: [] for name in names}
    loss: dict[str, float] = {}
    for round_ in range(c.repeats + 1):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            step = xp.pipeline_step(modules[name], inputs, targets,
                                    lambda y, t: ((y - t) ** 2).mean(), schedule=name)  # fmt: skip
            dist.barrier()
            if round_:
                seconds[name].append(time.perf_counter() - start)
            loss[name] = float(step.loss)
            for w in weights.values():
                w.grad = None
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"seconds": seconds, "loss": loss})
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def run_pipeline_bench(
    config: PipelineBenchConfig | None = None, progress: Callable | None = None
) -> dict[str, Any]:
    """Launch the bench (one torchrun launch of ``n`` processes); the results and checks."""
    from xla_permute import make_schedule

    c = config or PIPELINE_PRESETS["default"]
    say = progress or (lambda message: print(f"[bench pipeline] {message}", file=sys.stderr))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={c.n}", "-m", "xla_permute_tools.bench.pipeline",
               str(path), json.dumps(asdict(c))]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "XLA_PERMUTE_DEBUG": "none"}
        say(f"{c.n} processes (torchrun, gloo), {len(STAGES_PER_RANK)} schedules")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=c.timeout, check=False)  # fmt: skip
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(
                f"the pipeline bench launch failed (exit {done.returncode}):\n"
                f"{done.stdout[-2000:]}{done.stderr[-4000:]}"
            )
        ranks = json.loads(path.read_text())
    rows = []
    for name, v in STAGES_PER_RANK.items():
        s = make_schedule(name, c.n, c.micro_batches, v)
        slowest = [max(r["seconds"][name][i] for r in ranks) for i in range(c.repeats)]
        loss = sum(r["loss"][name] for r in ranks)
        rows.append({"schedule": name, "stages_per_rank": v, "seconds": statistics.median(slowest),
                     "ticks": s.ticks, "shifts": s.shift_count, "bubble": s.bubble_fraction,
                     "loss": loss})  # fmt: skip
    base = next(r for r in rows if r["schedule"] == "1f1b")
    for r in rows:
        r["ratio"] = r["seconds"] / base["seconds"]
    losses = [r["loss"] for r in rows]
    same = all(abs(x - losses[0]) <= 1e-4 * max(1.0, abs(losses[0])) for x in losses)
    checks = [{"name": "every schedule gives the same loss (allclose)", "ok": same}]
    return {"config": asdict(c), "cores": os.cpu_count(), "rows": rows, "checks": checks}


def format_pipeline_report(result: dict[str, Any]) -> str:
    """The table, one row per schedule, then the checks.

    >>> r = {"config": asdict(PIPELINE_PRESETS["tiny"]), "cores": 2, "checks": [], "rows": [
    ...     {"schedule": "1f1b", "stages_per_rank": 1, "seconds": 0.01, "ticks": 10,
    ...      "shifts": 8, "bubble": 0.2, "loss": 1.0, "ratio": 1.0}]}
    >>> print(format_pipeline_report(r).splitlines()[3])
    1f1b           1     10      8    20.0%      10.0     1.00x
    """
    c = result["config"]
    lines = [
        f"pipeline bench: {c['n']} processes (gloo, one thread each) on {result['cores']} "
        f"cores; {c['layers']} layers tanh(x @ w) of {c['dim']}, {c['micro_batches']} "
        f"micro-batches of {c['rows']} rows; median of {c['repeats']} (slowest rank)",
        "",
        f"{'schedule':<13}{'v':>3}{'ticks':>7}{'shifts':>7}{'bubble':>9}{'step ms':>10}"
        f"{'x 1f1b':>9}",
    ]
    for r in result["rows"]:
        lines.append(f"{r['schedule']:<13}{r['stages_per_rank']:>3}{r['ticks']:>7}"
                     f"{r['shifts']:>7}{r['bubble']:>9.1%}{1e3 * r['seconds']:>10.1f}"
                     f"{r['ratio']:>8.2f}x")  # fmt: skip
    if result["checks"]:
        lines += ["", "checks:"]
        lines += [f"  [{'ok' if ch['ok'] else 'FAILED'}] {ch['name']}" for ch in result["checks"]]
    return "\n".join(lines)


def config_with(preset: str = "default", **overrides: Any) -> PipelineBenchConfig:
    """A preset with some fields replaced (None leaves a field alone)."""
    fields = {k: v for k, v in overrides.items() if v is not None}
    return replace(PIPELINE_PRESETS[preset], **fields)


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))
