"""The host side of the bench: launch the meshes, collect the figures into one result.

:func:`run_bench` starts the launches described in :mod:`xla_permute_tools.bench` and returns
plain data (JSON-ready); byte and permute-chain figures are read from the traced native HLO
with :func:`xla_permute_tools.accounting.account_bytes` and
:func:`xla_permute_tools.accounting.chain_report`.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from xla_permute.debug import ENV as DEBUG_ENV
from xla_permute_tools import accounting, cost
from xla_permute_tools.bench.measure import (
    REDUCE_DTYPES,
    TOKEN_ENV,
    TOKEN_VARIANTS,
    bench_rank,
    memory_rank,
)
from xla_permute_tools.bench.programs import (
    MEMORY_PROGRAMS,
    PRESETS,
    PROGRAMS,
    X_MODES,
    BenchConfig,
    BenchProgram,
)
from xla_permute_tools.bench.report import checks, ratios

__all__ = ["BACKENDS", "print_progress", "run_bench"]

#: Memory launches (compile only, nothing timed) that run side by side.
MEMORY_LAUNCHES_AT_ONCE = 2

#: Which backend produced each figure of a result (also printed by the report).
BACKENDS = {
    "trace_s": "native (traced on rank 0, not executed)",
    "compile_s": "native (XLA:CPU compile via _xla_warm_up_cache, not executed)",
    "fusions": "native (fusion ops of the XLA:CPU-optimised module)",
    "peak_bytes": "native (XLA:CPU buffer assignment, memory-usage-report)",
    "bytes": "native (traced HLO, ring algorithms assumed for all-gather/reduce-scatter)",
    "chain": "native (traced HLO)",
    "run_s": "emulated (CPU mesh; each permute is a channel-id all-gather)",
}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_progress(message: str, stream: Any = None) -> None:
    """Print one ``[bench]`` progress line (default: stderr)."""
    print(f"[bench] {message}", file=stream or sys.stderr, flush=True)


def _environment() -> dict[str, Any]:
    from importlib.metadata import version

    return {
        "torch": version("torch"),
        "torch_xla": version("torch_xla"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }


def account(program: BenchProgram, text: str, n: int) -> accounting.ByteAccount:
    """Bytes each rank sends in ``program`` on ``n`` ranks, from its traced native HLO."""
    return accounting.account_bytes(text, n, program.schedule(n), name=program.name)


def chain(program: BenchProgram, text: str, n: int) -> dict[str, int]:
    """How the permutes of ``program``'s traced native HLO depend on each other."""
    return accounting.chain_report(text, n, program.schedule(n), name=program.name)


def run_bench(
    config: BenchConfig = PRESETS["default"],
    *,
    progress: Callable[[str], None] | None = print_progress,
) -> dict[str, Any]:
    """Measure the six ``PROGRAMS`` with ``config``; returns plain data (JSON-ready).

    ``progress`` receives a line before and after each mesh launch (default: stderr).

    Keys: ``config``, ``environment``, ``backends`` (which backend produced each figure),
    ``programs`` (one dict per program at ``n``: ``trace_s``, ``compile_s``, ``fusions``,
    ``run_s``, ``peak_bytes[variant][mode]`` (largest over ranks), ``peak_bytes_per_rank``,
    ``bytes``, ``chain[variant]``, ``same_as_baseline``), ``scaling`` (trace and compile at
    ``scaling_n``), ``memory`` (one dict per mesh size of :func:`memory_sizes`, ``n`` and
    ``scaling_n``: ``peak_bytes[name][variant][mode]`` per rank and ``permutes[name]``, for
    the six programs and the ``MEMORY_PROGRAMS``: all-gather-matmul's backward, its chunked
    ring), ``reduce_dtype_bytes``
    (matmul-reduce-scatter on bfloat16 per ``reduce_dtype``: sent, expected, the model's),
    ``ratios`` (against each op's baseline; ``ratios["memory"]`` per mesh size) and
    ``checks`` (facts that must hold: byte equalities, emulated results equal the
    baseline's). ``variant`` is "token" (torch_xla's default) or "no_token"
    (``DISABLE_NUMERIC_CC_TOKEN=1``).
    """
    from xla_permute import run_on_mesh

    say = progress or (lambda _: None)
    cfg = asdict(config)
    progs = list(PROGRAMS)
    t_start = time.perf_counter()
    # The mesh turns the debug mode on by default; the bench times a correct program, so it
    # turns every check off (none), and debug_cost measures the checks on their own (each level).
    no_check = {DEBUG_ENV: "none"}
    default_env = {TOKEN_ENV: TOKEN_VARIANTS["token"], **no_check}

    def launch(label: str, fn: Callable[..., Any], *args: Any, n: int, **kwargs: Any) -> Any:
        say(f"{label} on a {n}-device CPU mesh ...")
        t0 = time.perf_counter()
        out = run_on_mesh(fn, *args, n=n, **kwargs)
        say(f"{label}: done in {time.perf_counter() - t0:.1f} s")
        return out

    main = launch(
        f"{len(progs)} programs: emulated runs ({config.warmup} warm-up + {config.repeats} "
        f"timed), then native trace+compile ({config.compile_repeats} rounds)",
        bench_rank,
        progs,
        cfg,
        run=True,
        native=True,
        n=config.n,
        env=default_env,
    )
    sizes = memory_sizes(config)

    def memory_launch(size: int, variant: str) -> Any:
        value = TOKEN_VARIANTS[variant]
        with tempfile.TemporaryDirectory(prefix="xla_permute_bench_dump_") as dump:
            return launch(
                f"native compiles with XLA dumps, N={size}, {TOKEN_ENV}={value}",
                memory_rank,
                progs + list(MEMORY_PROGRAMS),
                cfg,
                dump,
                n=size,
                env={"XLA_FLAGS": memory_flags(dump), TOKEN_ENV: value, **no_check, **NO_GUARD},
            )

    # The memory launches only compile, one rank at a time (memory_rank), and time nothing:
    # two of them at once use both cores of a small machine.
    with ThreadPoolExecutor(max_workers=MEMORY_LAUNCHES_AT_ONCE) as pool:
        futures = {
            (size, variant): pool.submit(memory_launch, size, variant)
            for size in sizes
            for variant in TOKEN_VARIANTS
        }
        by_size: dict[int, dict[str, Any]] = {size: {} for size in sizes}
        for (size, variant), future in futures.items():
            by_size[size][variant] = future.result()
    memory = by_size[config.n]
    scaling_raw = None
    if config.scaling_n:
        scaling_raw = launch(
            f"native trace+compile at N={config.scaling_n}",
            bench_rank,
            progs,
            cfg,
            run=False,
            native=True,
            n=config.scaling_n,
            env=default_env,
        )[0]

    rank0 = main[0]
    rows = []
    for p in progs:
        per_rank = _per_rank(p, memory)
        rows.append(
            {
                "op": p.op,
                "method": p.method,
                "name": p.name,
                "n": config.n,
                "trace_s": _median(rank0["trace_s"][p.name]),
                "compile_s": _median(rank0["compile_s"][p.name]),
                "fusions": memory["token"][0]["memory"][f"{p.name}|input"]["fusions"],
                "run_s": max(_median(r["run_s"][p.name]) for r in main),
                "peak_bytes": {
                    v: {mode: max(per_rank[v][mode]) for mode in X_MODES} for v in TOKEN_VARIANTS
                },
                "peak_bytes_per_rank": per_rank,
                "bytes": asdict(account(p, rank0["hlo"][p.name], config.n)),
                "chain": {
                    "token": chain(p, rank0["hlo"][p.name], config.n),
                    "no_token": chain(p, memory["no_token"][0]["hlo"][p.name], config.n),
                },
                "same_as_baseline": (
                    None
                    if p.method == "baseline"
                    else all(r["same_as_baseline"][p.name] for r in main)
                ),
            }
        )
    scaling = []
    if scaling_raw is not None:
        for p in progs:
            scaling.append(
                {
                    "op": p.op,
                    "method": p.method,
                    "name": p.name,
                    "n": config.scaling_n,
                    "trace_s": _median(scaling_raw["trace_s"][p.name]),
                    "compile_s": _median(scaling_raw["compile_s"][p.name]),
                    "bytes_total": account(p, scaling_raw["hlo"][p.name], config.scaling_n).total,
                }
            )
    # The debug mode's cost: a permute ring with the check over one without, slowest rank.
    debug_on = max(_median(r["debug_s"]["every"]) for r in main)
    debug_off = max(_median(r["debug_s"]["off"]) for r in main)
    sampled = max(_median(r["debug_s"]["sampled"]) for r in main)
    result = {
        "debug_mode_ratio": debug_on / debug_off,
        "sampled_check_ratio": sampled / debug_off,
        "config": cfg,
        "environment": _environment(),
        "backends": dict(BACKENDS),
        "programs": rows,
        "scaling": scaling,
        "seconds": time.perf_counter() - t_start,
    }
    result["memory"] = [
        {
            "n": size,
            "peak_bytes": {
                p.name: _per_rank(p, by_size[size]) for p in progs + list(MEMORY_PROGRAMS)
            },
            "permutes": {
                p.name: by_size[size]["token"][0]["memory"][f"{p.name}|input"]["permutes"]
                for p in progs + list(MEMORY_PROGRAMS)
            },
        }
        for size in sizes
    ]
    result["reduce_dtype_bytes"] = reduce_dtype_bytes(progs, rank0["reduce_dtype_hlo"], config)
    result["ratios"] = ratios(rows, scaling, result["memory"])
    result["checks"] = checks(
        rows, scaling, result["reduce_dtype_bytes"], result["ratios"]["memory"]
    )
    return result


#: The memory launches only compile, one rank at a time, and each rank's sync after a compile is
#: empty by construction: the mesh's sync guard would compile one more (scalar) program into the
#: dump, and no rank executes a collective that an empty sync could block.
NO_GUARD = {"XLA_PERMUTE_SYNC_GUARD": "0"}


def memory_flags(dump_dir: str) -> str:
    """``XLA_FLAGS`` of a memory launch: this process's, a dump to ``dump_dir``, and LLVM's
    optimizer off. The launch only compiles, and XLA:CPU's buffer assignment, the figure it
    reads, is made before LLVM runs: the peaks are the same either way
    (``tests/test_bench.py`` compares them) and the compiles take about 30% less time."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_dump_to={dump_dir} --xla_backend_optimization_level=0".strip()


def memory_sizes(config: BenchConfig) -> list[int]:
    """The mesh sizes whose peak memory is measured: ``n``, and ``scaling_n`` unless 0."""
    return sorted({config.n, *([config.scaling_n] if config.scaling_n else [])})


def _per_rank(p: BenchProgram, memory: dict[str, Any]) -> dict[str, dict[str, list[int]]]:
    """Peak bytes of ``p``, per token variant, x mode and rank, from one size's launches."""
    return {
        v: {mode: [r["memory"][f"{p.name}|{mode}"]["bytes"] for r in memory[v]] for mode in X_MODES}
        for v in TOKEN_VARIANTS
    }


def reduce_dtype_bytes(
    programs: Sequence[BenchProgram], texts: dict[str, str], config: BenchConfig
) -> list[dict[str, Any]]:
    """Bytes each rank sends in matmul-reduce-scatter on bfloat16 inputs, per ``reduce_dtype``.

    ``sent``: from the traced native HLO (:func:`account`); ``expected``: ``N-1`` partial-sum
    blocks of ``m f`` elements of :func:`xla_permute.reference.accumulation_dtype`'s dtype;
    ``model``: what the cost model charges (:attr:`xla_permute_tools.cost.Workload.block_bytes`,
    from the same rule). The three must agree.
    """
    import torch

    from xla_permute.reference import accumulation_dtype

    out = []
    n = config.n
    for p in programs:
        if p.op != "matmul_reduce_scatter":
            continue
        for label in REDUCE_DTYPES:
            reduce_dtype = None if label == "default" else getattr(torch, label)
            element = accumulation_dtype(torch.bfloat16, reduce_dtype)
            work = cost.Workload(
                m=config.m,
                k=config.k,
                n=config.f,
                n_devices=n,
                dtype_bytes=2,
                op="matmul_reduce_scatter",
                reduce_dtype_bytes=None if reduce_dtype is None else reduce_dtype.itemsize,
            )
            out.append(
                {
                    "name": p.name,
                    "reduce_dtype": label,
                    "partial_sum_dtype": str(element).removeprefix("torch."),
                    "sent": account(p, texts[f"{p.name}|{label}"], n).total,
                    "expected": (n - 1) * config.m * config.f * element.itemsize,
                    "model": (n - 1) * work.block_bytes,
                }
            )
    return out
