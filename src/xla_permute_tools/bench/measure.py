"""What the bench measures on a rank: run, trace and compile times, and peak memory.

Rank functions for :func:`~xla_permute.run_on_mesh` (the host side that launches them is
:mod:`xla_permute_tools.bench.run`):

* :func:`bench_rank`: emulated runs on every rank (:func:`emulated_runs`), then native trace
  and compile rounds on rank 0 (:func:`native_rounds`), which also returns the traced HLO;
* :func:`memory_rank`: one native compile per program and x mode with XLA's dumps on, each
  rank in turn, read with :func:`read_memory_report`.

Timings use ``time.perf_counter``; the native programs are compiled with
``torch_xla._XLAC._xla_warm_up_cache`` and never executed (the native permute cannot run on
the CPU mesh).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xla_permute.hlo import tracing as hlo_tracing
from xla_permute_tools.bench.programs import X_MODES, BenchProgram, build, inputs

__all__ = [
    "TOKEN_ENV",
    "TOKEN_VARIANTS",
    "bench_rank",
    "emulated_runs",
    "memory_rank",
    "native_rounds",
    "read_memory_report",
    "reduce_dtype_hlo",
]

#: torch_xla's switch for the numeric token that orders collectives (read once per process).
TOKEN_ENV = "DISABLE_NUMERIC_CC_TOKEN"
#: The two settings measured: torch_xla's default (token on) and the token off.
TOKEN_VARIANTS = {"token": "0", "no_token": "1"}


def native_rounds(programs: Sequence[BenchProgram], cfg: dict[str, int]) -> dict[str, Any]:
    """Rank 0: trace and compile every native program, ``warmup + compile_repeats`` rounds."""
    import torch_xla

    rounds = cfg["warmup"] + cfg["compile_repeats"]
    trace: dict[str, list[float]] = {p.name: [] for p in programs}
    comp: dict[str, list[float]] = {p.name: [] for p in programs}
    hlo: dict[str, str] = {}
    for i in range(rounds):
        for p in programs:
            x, w = inputs(p, cfg["m"], cfg["k"], cfg["f"] + i, "input", seed=None)
            t0 = time.perf_counter()
            with hlo_tracing():  # native: traced and compiled on the CPU mesh, never run
                outs = build(p, x, w, "native")
            t1 = time.perf_counter()
            if i == 0:
                hlo[p.name] = torch_xla._XLAC._get_xla_tensors_hlo(outs)
            t2 = time.perf_counter()
            torch_xla._XLAC._xla_warm_up_cache(outs, [])
            t3 = time.perf_counter()
            del outs  # never executed: the native permute cannot run on CPU
            torch_xla.sync()  # nothing live: restarts channel ids and torch_xla's token
            if i >= cfg["warmup"]:
                trace[p.name].append(t1 - t0)
                comp[p.name].append(t3 - t2)
    return {"trace_s": trace, "compile_s": comp, "hlo": hlo}


#: matmul-reduce-scatter's partial sums on bfloat16 inputs: the default and the input dtype.
REDUCE_DTYPES = ("default", "bfloat16")


def reduce_dtype_hlo(programs: Sequence[BenchProgram], cfg: dict[str, int]) -> dict[str, str]:
    """Rank 0: the native HLO of each matmul-reduce-scatter program on bfloat16 x and w, with
    ``reduce_dtype`` None (float32 partial sums) and bfloat16 (the input's), traced only.

    Keys ``"<name>|<reduce dtype>"`` (``REDUCE_DTYPES``).
    """
    import torch
    import torch_xla

    from xla_permute import matmul

    out: dict[str, str] = {}
    for p in programs:
        if p.op != "matmul_reduce_scatter":
            continue
        for label in REDUCE_DTYPES:
            reduce_dtype = None if label == "default" else getattr(torch, label)
            x, w = inputs(p, cfg["m"], cfg["k"], cfg["f"], "input", seed=None)
            x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
            with hlo_tracing():  # native: traced, never run
                fn = getattr(matmul, p.function)
                options = (
                    {}
                    if p.method == "baseline"
                    else {"bidirectional": p.method == "bi", "backend": "native"}
                )
                y = fn(x, w, dim=0, reduce_dtype=reduce_dtype, **options)
            out[f"{p.name}|{label}"] = torch_xla._XLAC._get_xla_tensors_hlo([y])
            del y, x, w
            torch_xla.sync()
    return out


def emulated_runs(programs: Sequence[BenchProgram], cfg: dict[str, int]) -> dict[str, Any]:
    """Every rank: run each program on the emulated backend; times and equality to baseline."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    this_device = xm.xla_real_devices([torch_xla.device()])  # e.g. ["CPU:0"]
    times: dict[str, list[float]] = {}
    outputs: dict[str, Any] = {}
    for p in programs:
        x, w = inputs(p, cfg["m"], cfg["k"], cfg["f"], "input", seed=1000 + rank)
        times[p.name] = []
        for i in range(cfg["warmup"] + cfg["repeats"]):
            (y,) = build(p, x, w, "emulated")
            t0 = time.perf_counter()
            torch_xla.sync()
            xm.wait_device_ops(this_device)  # execution is asynchronous: wait for it
            t1 = time.perf_counter()
            if i >= cfg["warmup"]:
                times[p.name].append(t1 - t0)
        outputs[p.name] = y.cpu()
    same = {
        p.name: torch.equal(outputs[p.name], outputs[f"{p.op}/baseline"])
        for p in programs
        if p.method != "baseline" and f"{p.op}/baseline" in outputs
    }
    return {"run_s": times, "same_as_baseline": same, "debug_s": debug_cost(cfg)}


def debug_cost(cfg: dict[str, int]) -> dict[str, list[float]]:
    """Every rank: a permute ring of one x block, call to result, at each agreement-check level
    (``off``, ``sampled``: the default off the mesh, ``every``: the debug mode)."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    import xla_permute as xp

    device = torch_xla.device()
    x = torch.ones(cfg["m"], cfg["k"], device=device)
    ring = xp.ring_pairs(xr.world_size())
    times: dict[str, list[float]] = {level: [] for level in xp.debug.LEVELS}
    for i in range(cfg["warmup"] + cfg["repeats"]):
        for level in times:
            t0 = time.perf_counter()
            with xp.debug_mode(level):
                y = xp.collective_permute(x, ring, backend="emulated")
            torch_xla.sync()
            xm.wait_device_ops(xm.xla_real_devices([device]))
            if i >= cfg["warmup"]:
                times[level].append(time.perf_counter() - t0)
            del y
    return times


def bench_rank(
    programs: Sequence[BenchProgram], cfg: dict[str, int], *, run: bool, native: bool
) -> dict[str, Any] | None:
    """Rank function: emulated runs on every rank (``run``), then native trace/compile rounds
    and traced HLO on rank 0 alone (``native``), once the other ranks are done."""
    import torch_xla.runtime as xr

    out: dict[str, Any] = {}
    if run:
        out.update(emulated_runs(programs, cfg))
    if native and xr.global_ordinal() == 0:
        out.update(native_rounds(programs, cfg))
        out["reduce_dtype_hlo"] = reduce_dtype_hlo(programs, cfg)
    return out


def read_memory_report(path: str | Path) -> int:
    """Bytes on the first line of an XLA ``*memory-usage-report.txt`` ("Total bytes used: N").

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp(), "m-memory-usage-report.txt")
    >>> _ = p.write_text("Total bytes used: 77594636 (74.00MiB)\\n\\nAllocations ...")
    >>> read_memory_report(p) / 2**20
    74.00...
    """
    first = Path(path).read_text().splitlines()[0] if Path(path).stat().st_size else ""
    prefix = "Total bytes used:"
    if not first.startswith(prefix):
        raise ValueError(f"{path}: first line is {first!r}, expected {prefix!r} N (...)")
    return int(first[len(prefix) :].split()[0])


# Ranks are threads of one process: memory_rank lets them compile one rank after the other, so
# that the files a compile adds to the dump directory are that rank's.
_turn = threading.Condition()
_next_rank = [0]
_compiled: dict[tuple[str, str], dict[str, Any]] = {}  # (mode, traced HLO) -> memory figures


def memory_rank(
    programs: Sequence[BenchProgram],
    cfg: dict[str, int],
    dump_dir: str,
    modes: Sequence[str] = X_MODES,
) -> dict[str, Any]:
    """Rank function (run with ``XLA_FLAGS=--xla_dump_to=dump_dir``): each rank in turn (rank
    0 first; the others wait) compiles each native program once per x mode (``modes``, of
    :data:`~xla_permute_tools.bench.programs.X_MODES`) and reads the
    memory report that compile wrote. The collective-matmul programs differ between ranks (the
    order in which a rank's blocks are concatenated depends on its rank), so every rank's is
    compiled; a program identical to an earlier rank's (the baselines) is taken from XLA's
    compile cache without a new dump, and gets that rank's figures.

    Returns ``{"memory": {"<name>|<mode>": {"bytes", "report", "collectives", "fusions",
    "instructions", "permutes"}}, "hlo": {"<name>": traced HLO text (x input)}}``.
    ``collectives`` are the collective kinds of the dumped (optimised) module, checked against
    the traced program's to match the dump to its program; ``fusions`` and ``instructions``
    count the optimised module's fusion ops and instructions (what XLA:CPU generates code
    for); ``permutes`` the optimised module's collective-permutes.
    """
    import torch_xla.runtime as xr

    if unknown := set(modes) - set(X_MODES):
        raise ValueError(f"modes: {sorted(unknown)} are not x modes; choose from {X_MODES}")
    rank = xr.global_ordinal()
    with _turn:
        _turn.wait_for(lambda: _next_rank[0] == rank)
    try:
        return _compile_for_memory(programs, cfg, dump_dir, modes)
    finally:
        with _turn:
            _next_rank[0] += 1
            _turn.notify_all()


def _compile_for_memory(
    programs: Sequence[BenchProgram], cfg: dict[str, int], dump_dir: str, modes: Sequence[str]
) -> dict[str, Any]:
    import torch_xla

    from xla_permute import hlo

    out: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for mode in modes:
        for p in programs:
            x, w = inputs(p, cfg["m"], cfg["k"], cfg["f"], mode, seed=None)
            before = set(os.listdir(dump_dir))
            with hlo_tracing():  # native: traced and compiled on the CPU mesh, never run
                outs = build(p, x, w, "native")
            text = torch_xla._XLAC._get_xla_tensors_hlo(outs)
            if mode == "input":
                texts[p.name] = text
            traced = [c.kind for c in hlo.parse(text).collectives()]
            torch_xla._XLAC._xla_warm_up_cache(outs, [])
            del outs, x, w  # computed x and w are graph nodes: a sync would compile them
            torch_xla.sync()
            new = sorted(set(os.listdir(dump_dir)) - before)
            reports = [f for f in new if f.endswith("memory-usage-report.txt")]
            optimised = [f for f in new if f.endswith("cpu_after_optimizations.txt")]
            if not new and (mode, text) in _compiled:  # an earlier rank's identical program:
                out[f"{p.name}|{mode}"] = _compiled[mode, text]  # XLA reused its executable
                continue
            if len(reports) != 1 or len(optimised) != 1:
                raise RuntimeError(
                    f"{p.name} ({mode}): expected one new memory report and one optimised "
                    f"module in {dump_dir}, found {reports} and {optimised} (was the program "
                    "already compiled in this process, or XLA_FLAGS not passed?)"
                )
            module = hlo.parse(Path(dump_dir, optimised[0]).read_text())
            kinds = [c.kind for c in module.collectives()]
            # XLA may drop collectives whose results nothing uses (the forward's permutes in
            # a backward program, tied to the backward's by torch_xla's token), never add any
            if set(kinds) != set(traced) or len(kinds) > len(traced):
                raise RuntimeError(
                    f"{p.name} ({mode}): the dumped module {optimised[0]} has collectives "
                    f"{kinds}, the traced program {traced}: the dump is not this program's"
                )
            out[f"{p.name}|{mode}"] = _compiled[mode, text] = {
                "bytes": read_memory_report(Path(dump_dir, reports[0])),
                "report": reports[0],
                "collectives": kinds,
                "fusions": len(module.ops("fusion")),
                "instructions": len(module.instructions),
                "permutes": kinds.count("collective-permute"),
            }
    return {"memory": out, "hlo": texts}
