"""``python -m xla_permute bench``: collective matmul against its baselines, measured.

Six programs, side by side: all-gather-matmul and matmul-reduce-scatter, each as a
unidirectional ring (``uni``), a bidirectional ring (``bi``) and the upstream baseline
(:func:`~xla_permute.matmul.all_gather_then_matmul`,
:func:`~xla_permute.matmul.matmul_then_reduce_scatter`). Per-rank shapes: all-gather-matmul
takes x ``[m, k]`` and w ``[k, f]``; matmul-reduce-scatter takes x ``[N*m, k]`` and w
``[k, f]``; float32.

Every figure names the backend that produced it:

* **trace**, **compile** (``native``): the program that runs on TPU and Neuron, one
  ``collective-permute`` per step, traced and compiled by XLA:CPU on rank 0 but never executed
  (the native permute cannot run on the CPU mesh). Trace = building the lazy graph in Python;
  compile = ``torch_xla._XLAC._xla_warm_up_cache`` (lowering and XLA:CPU compile). Medians over
  ``compile_repeats`` rounds after ``warmup`` discarded rounds; round ``i`` uses ``f + i``
  columns so that every round compiles afresh (XLA caches compiled graphs by their hash).
* **peak memory** (``native``): "Total bytes used" of XLA's buffer assignment of the compiled
  program (``*memory-usage-report.txt`` written with ``XLA_FLAGS=--xla_dump_to``), one
  compile per program in a launch of its own, matched to its program by the files that compile
  added and checked by the collectives in the dumped module. The ranks' programs differ (the
  order of the output blocks depends on the rank), so every rank compiles its own, one rank
  after the other, and the largest figure is reported.
  Two cases: x a program **input** (a parameter, live for the whole program) and x
  **computed** inside the program (an outer product of two input vectors, so nothing of x's
  size is resident: the best case for a previous layer's output); w is an input in both.
  Each with torch_xla's numeric collective token (the default) and without it
  (``DISABLE_NUMERIC_CC_TOKEN=1``; "For Neuron we set DISABLE_NUMERIC_CC_TOKEN=1",
  https://github.com/pytorch/xla/pull/6077): the token adds a scalar to every collective's
  operand, which makes XLA copy each block before it is sent, and orders all collectives one
  after the other.
* **bytes sent** (``native`` HLO): what each rank sends, from rank 0's traced HLO (the
  collectives, their pairs and shapes, are the same on every rank) with
  :func:`~xla_permute.hlo.bytes_sent_per_rank` (ring algorithms assumed for all-gather and
  reduce-scatter), per collective, per schedule step and in total.
* **run** (``emulated``): wall time of executing the program on the CPU mesh, where the
  permute is emulated by a channel-id all-gather that moves N times the data of a permute.
  Median over ``repeats`` after ``warmup`` runs, slowest rank. It measures the CPU emulation,
  not what collective matmul does on an accelerator.

The launches: one ``N``-device mesh runs the emulated programs on every rank, then times the
native trace and compile on rank 0 alone; two compile the native programs with XLA's dumps
on (with and without the token); one ``scaling_n``-device mesh times trace and compile again.
Compiles are small and every emulated program is compiled by its warm-up run before any timed
run, so no rank arrives late at a rendezvous.

>>> config = PRESETS["tiny"]
>>> config.n, [p.name for p in PROGRAMS][:3]
(4, ['all_gather_matmul/uni', 'all_gather_matmul/bi', 'all_gather_matmul/baseline'])
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "PROGRAMS",
    "BenchConfig",
    "BenchProgram",
    "ByteAccount",
    "account_bytes",
    "add_arguments",
    "bench_rank",
    "chain_report",
    "config_from_args",
    "format_report",
    "memory_rank",
    "permute_steps",
    "read_memory_report",
    "run_bench",
    "run_from_args",
]

_BASELINE = {
    "all_gather_matmul": "all_gather_then_matmul",
    "matmul_reduce_scatter": "matmul_then_reduce_scatter",
}
X_MODES = ("input", "computed")


@dataclass(frozen=True)
class BenchProgram:
    """One benchmarked program: ``op`` ("all_gather_matmul" or "matmul_reduce_scatter") and
    ``method`` ("uni", "bi" or "baseline")."""

    op: str
    method: str

    @property
    def name(self) -> str:
        return f"{self.op}/{self.method}"

    @property
    def function(self) -> str:
        """The :mod:`xla_permute.matmul` function that builds it."""
        return _BASELINE[self.op] if self.method == "baseline" else self.op


#: The six benchmarked programs, each op as ``uni``, ``bi`` and ``baseline``.
PROGRAMS: tuple[BenchProgram, ...] = tuple(
    BenchProgram(op, method) for op in _BASELINE for method in ("uni", "bi", "baseline")
)


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and repeats. ``m, k, f``: per-rank shapes (module docstring); ``n``: mesh size of
    the main measurements; ``scaling_n``: mesh size of the second trace/compile measurement
    (0 skips it); ``repeats``/``warmup``: timed and discarded emulated runs;
    ``compile_repeats``: timed trace+compile rounds (after ``warmup`` discarded ones)."""

    m: int = 1024
    k: int = 4096
    f: int = 256
    n: int = 4
    scaling_n: int = 8
    repeats: int = 3
    warmup: int = 1
    compile_repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("m", "k", "f", "n", "repeats", "compile_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BenchConfig: {name} must be a positive int, got {value!r}")
        for name in ("scaling_n", "warmup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"BenchConfig: {name} must be an int >= 0, got {value!r}")
        if self.n < 2 or self.scaling_n == 1:
            raise ValueError(
                f"BenchConfig: n (got {self.n}) and scaling_n (got {self.scaling_n}) need at "
                "least 2 devices for a collective (scaling_n=0 skips the second mesh)"
            )


#: Named configurations, ``default`` (about a minute on 2 cores) and ``tiny`` (smoke test).
PRESETS: dict[str, BenchConfig] = {
    "default": BenchConfig(),
    "tiny": BenchConfig(m=8, k=32, f=8, repeats=1, warmup=1, compile_repeats=1),
}


# ---------------------------------------------------------------- rank functions


def _inputs(
    program: BenchProgram, m: int, k: int, f: int, mode: str, seed: int | None
) -> tuple[Any, Any]:
    """x and w of ``program`` on this rank's device.

    ``mode="input"``: both are device data (program inputs); integer values from ``seed``
    (exact float32 sums), or zeros with ``seed=None`` (for programs that are never run).
    ``mode="computed"``: x is computed inside the traced graph from two input vectors (an
    outer product: not resident, not a constant XLA could fold), w is an input.
    """
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    device, n = torch_xla.device(), xr.world_size()
    rows = m if program.op == "all_gather_matmul" else n * m
    if seed is None:
        x, w = torch.zeros(rows, k), torch.zeros(k, f)
    else:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(-2, 3, (rows, k), generator=g).float()
        w = torch.randint(-2, 3, (k, f), generator=g).float()
    if mode == "computed":  # an outer product of two input vectors, computed in the graph
        rows_in, cols_in = x[:, :1].to(device), x[:1, :].to(device)
        return rows_in * cols_in, w.to(device)
    return x.to(device), w.to(device)


def _apply(program: BenchProgram, x: Any, w: Any, backend: str) -> Any:
    from xla_permute import matmul

    fn = getattr(matmul, program.function)
    if program.method == "baseline":
        return fn(x, w, dim=0)
    return fn(x, w, dim=0, bidirectional=program.method == "bi", backend=backend)


def _native_rounds(programs: Sequence[BenchProgram], cfg: dict[str, int]) -> dict[str, Any]:
    """Rank 0: trace and compile every native program, ``warmup + compile_repeats`` rounds."""
    import torch_xla

    rounds = cfg["warmup"] + cfg["compile_repeats"]
    trace: dict[str, list[float]] = {p.name: [] for p in programs}
    comp: dict[str, list[float]] = {p.name: [] for p in programs}
    hlo: dict[str, str] = {}
    for i in range(rounds):
        for p in programs:
            x, w = _inputs(p, cfg["m"], cfg["k"], cfg["f"] + i, "input", seed=None)
            t0 = time.perf_counter()
            outs = [_apply(p, x, w, "native")]
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


def _emulated_runs(programs: Sequence[BenchProgram], cfg: dict[str, int]) -> dict[str, Any]:
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
        x, w = _inputs(p, cfg["m"], cfg["k"], cfg["f"], "input", seed=1000 + rank)
        times[p.name] = []
        for i in range(cfg["warmup"] + cfg["repeats"]):
            y = _apply(p, x, w, "emulated")
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
    return {"run_s": times, "same_as_baseline": same}


def bench_rank(
    programs: Sequence[BenchProgram], cfg: dict[str, int], *, run: bool, native: bool
) -> dict[str, Any] | None:
    """Rank function: emulated runs on every rank (``run``), then native trace/compile rounds
    and traced HLO on rank 0 alone (``native``), once the other ranks are done."""
    import torch_xla.runtime as xr

    out: dict[str, Any] = {}
    if run:
        out.update(_emulated_runs(programs, cfg))
    if native and xr.global_ordinal() == 0:
        out.update(_native_rounds(programs, cfg))
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
    programs: Sequence[BenchProgram], cfg: dict[str, int], dump_dir: str
) -> dict[str, Any]:
    """Rank function (run with ``XLA_FLAGS=--xla_dump_to=dump_dir``): each rank in turn (rank
    0 first; the others wait) compiles each native program once per x mode and reads the
    memory report that compile wrote. The collective-matmul programs differ between ranks (the
    order in which a rank's blocks are concatenated depends on its rank), so every rank's is
    compiled; a program identical to an earlier rank's (the baselines) is taken from XLA's
    compile cache without a new dump, and gets that rank's figures.

    Returns ``{"memory": {"<name>|<mode>": {"bytes", "report", "collectives", "fusions",
    "instructions"}}, "hlo": {"<name>": traced HLO text (x input)}}``. ``collectives`` are the
    collective kinds of the dumped (optimised) module, checked against the traced program's to
    match the dump to its program; ``fusions`` and ``instructions`` count the optimised
    module's fusion ops and instructions (what XLA:CPU generates code for).
    """
    import torch_xla.runtime as xr

    rank = xr.global_ordinal()
    with _turn:
        _turn.wait_for(lambda: _next_rank[0] == rank)
    try:
        return _compile_for_memory(programs, cfg, dump_dir)
    finally:
        with _turn:
            _next_rank[0] += 1
            _turn.notify_all()


def _compile_for_memory(
    programs: Sequence[BenchProgram], cfg: dict[str, int], dump_dir: str
) -> dict[str, Any]:
    import torch_xla

    from xla_permute import hlo

    out: dict[str, Any] = {}
    texts: dict[str, str] = {}
    for mode in X_MODES:
        for p in programs:
            x, w = _inputs(p, cfg["m"], cfg["k"], cfg["f"], mode, seed=None)
            before = set(os.listdir(dump_dir))
            outs = [_apply(p, x, w, "native")]
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
            if sorted(kinds) != sorted(traced):
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
            }
    return {"memory": out, "hlo": texts}


# ---------------------------------------------------------------- HLO accounting


def _schedule(program: BenchProgram, n: int) -> list[Any]:
    from xla_permute import schedule

    make = (
        schedule.all_gather_schedule
        if program.op == "all_gather_matmul"
        else (schedule.reduce_scatter_schedule)
    )
    return make(n, 0, program.method == "bi")


def permute_steps(program: BenchProgram, hlo_text: str, n: int) -> list[list[str]]:
    """The native HLO's collective-permutes of ``program``, grouped by schedule step.

    A permute's direction is read from its pairs (ring ``+1`` or ``-1``); within a direction
    the permutes form a chain through their data (each sends what the previous one delivered,
    or a sum that includes it), which gives their order; step ``t`` issues the next permute
    of each direction in its ``sends``. The text order of the HLO is not used: without
    torch_xla's token it need not be the issue order. Raises ValueError if the permutes do not
    match the schedule.
    """
    from xla_permute import hlo
    from xla_permute.pairs import ring_pairs

    prog = hlo.parse(hlo_text)
    perms = [c for c in prog.collectives() if c.kind == "collective-permute"]
    steps = _schedule(program, n) if program.method != "baseline" else []
    by_direction: dict[int, list[str]] = {1: [], -1: []}
    for c in perms:
        direction = next((d for d in (1, -1) if set(c.pairs or ()) == set(ring_pairs(n, d))), None)
        if direction is None:
            raise ValueError(f"{program.name}: {c.name} is not a ring shift: {c.pairs}")
        by_direction[direction].append(c.name)
    for group in by_direction.values():
        group.sort(key=lambda name, g=group: sum(prog.depends_on(name, o) for o in g))
    wanted = {d: sum(d in s.sends for s in steps) for d in (1, -1)}
    if {d: len(g) for d, g in by_direction.items()} != wanted:
        raise ValueError(
            f"{program.name}: permutes per direction "
            f"{ {d: len(g) for d, g in by_direction.items()} } do not match the schedule "
            f"({wanted} on {n} ranks)"
        )
    taken = {1: 0, -1: 0}
    out = []
    for step in steps:
        names = []
        for d in step.sends:
            names.append(by_direction[d][taken[d]])
            taken[d] += 1
        out.append(names)
    return out


@dataclass(frozen=True)
class ByteAccount:
    """Bytes one rank sends in one program (from its traced native HLO).

    ``per_collective``: ``(kind, bytes)`` in program order; ``per_step``: bytes per ring step
    (collective matmul: the permutes of each schedule step; baseline: the N-1 steps of a ring
    collective, equal shares); ``gathered_bytes``: the all-gather's result (baseline only).
    """

    per_collective: tuple[tuple[str, int], ...]
    per_step: tuple[int, ...]
    total: int
    gathered_bytes: int | None = None


def account_bytes(program: BenchProgram, hlo_text: str, n: int) -> ByteAccount:
    """Bytes each rank sends for ``program`` on ``n`` ranks, read from its native HLO text.

    >>> text = '''
    ... ENTRY %e (p: f32[2,4]) -> f32[8,4] {
    ...   %p = f32[2,4]{1,0} parameter(0)
    ...   ROOT %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), channel_id=1, dimensions={0}
    ... }'''
    >>> account_bytes(BenchProgram("all_gather_matmul", "baseline"), text, 4)
    ByteAccount(per_collective=(('all-gather', 96),), per_step=(32, 32, 32), total=96,
                gathered_bytes=128)
    """
    from xla_permute import hlo

    collectives = hlo.parse(hlo_text).collectives()
    per = tuple((c.kind, hlo.bytes_sent_per_rank(c, n)) for c in collectives)
    total = sum(b for _, b in per)
    if program.method == "baseline":
        if len(collectives) != 1:
            raise ValueError(f"{program.name}: expected one collective, got {per}")
        gathered = collectives[0].result_bytes if collectives[0].kind == "all-gather" else None
        return ByteAccount(per, (total // (n - 1),) * (n - 1), total, gathered)
    if {k for k, _ in per} != {"collective-permute"}:
        raise ValueError(f"{program.name}: expected only collective-permutes, got {per}")
    sent = {c.name: hlo.bytes_sent_per_rank(c, n) for c in collectives}
    steps = permute_steps(program, hlo_text, n)
    return ByteAccount(per, tuple(sum(sent[p] for p in s) for s in steps), total)


def chain_report(program: BenchProgram, hlo_text: str, n: int) -> dict[str, int]:
    """How the permutes of ``program``'s native HLO depend on each other.

    ``permutes``; ``chained``: consecutive permutes in issue order where the later depends on
    the earlier; ``same_step`` / ``same_step_chained``: pairs of permutes issued in the same
    step (bidirectional: one each way; their data are independent) and how many of them
    depend on each other anyway. torch_xla threads every collective through one numeric
    token, so each waits for the previous one and the two directions of a bidirectional step
    run one after the other; with ``DISABLE_NUMERIC_CC_TOKEN=1`` only data dependencies remain.
    """
    from xla_permute import hlo

    if program.method == "baseline":
        return {"permutes": 0, "chained": 0, "same_step": 0, "same_step_chained": 0}
    prog = hlo.parse(hlo_text)
    steps = permute_steps(program, hlo_text, n)
    order = [p for s in steps for p in s]
    pairs = [s for s in steps if len(s) == 2]
    return {
        "permutes": len(order),
        "chained": sum(
            prog.depends_on(b, a) for a, b in zip(order[:-1], order[1:], strict=True)
        ),
        "same_step": len(pairs),
        "same_step_chained": sum(prog.depends_on(b, a) or prog.depends_on(a, b)
                                 for a, b in pairs),
    }  # fmt: skip


# ---------------------------------------------------------------- host side

#: torch_xla's switch for the numeric token that orders collectives (read once per process).
TOKEN_ENV = "DISABLE_NUMERIC_CC_TOKEN"
TOKEN_VARIANTS = {"token": "0", "no_token": "1"}


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _progress(message: str, stream: Any = None) -> None:
    print(f"[bench] {message}", file=stream or sys.stderr, flush=True)


def run_bench(
    config: BenchConfig = PRESETS["default"],
    *,
    progress: Callable[[str], None] | None = _progress,
) -> dict[str, Any]:
    """Measure the :data:`PROGRAMS` with ``config``; returns plain data (JSON-ready).

    ``progress`` receives a line before and after each mesh launch (default: stderr).

    Keys: ``config``, ``environment``, ``backends`` (which backend produced each figure),
    ``programs`` (one dict per program at ``n``: ``trace_s``, ``compile_s``, ``fusions``,
    ``run_s``, ``peak_bytes[variant][mode]`` (largest over ranks), ``peak_bytes_per_rank``,
    ``bytes``, ``chain[variant]``, ``same_as_baseline``), ``scaling`` (trace and compile at
    ``scaling_n``), ``ratios`` (against each op's baseline), ``checks`` (must hold: byte
    equalities, emulated results equal the baseline's) and ``targets`` (reported, not
    enforced). ``variant`` is "token" (torch_xla's default) or "no_token"
    (``DISABLE_NUMERIC_CC_TOKEN=1``).
    """
    from xla_permute.launch import run_on_mesh

    say = progress or (lambda _: None)
    cfg = asdict(config)
    progs = list(PROGRAMS)
    t_start = time.perf_counter()
    default_env = {TOKEN_ENV: TOKEN_VARIANTS["token"]}

    def launch(label: str, fn: Callable[..., Any], *args: Any, n: int, **kwargs: Any) -> Any:
        say(f"{label} on a {n}-device CPU mesh ...")
        t0 = time.perf_counter()
        out = run_on_mesh(fn, *args, n=n, **kwargs)
        say(f"{label}: done in {time.perf_counter() - t0:.1f} s")
        return out

    main = launch(
        f"{len(progs)} programs: emulated runs ({config.warmup} warm-up + {config.repeats} "
        f"timed), then native trace+compile ({config.compile_repeats} rounds)",
        bench_rank, progs, cfg, run=True, native=True, n=config.n, env=default_env,
    )  # fmt: skip
    memory: dict[str, Any] = {}
    for variant, value in TOKEN_VARIANTS.items():
        with tempfile.TemporaryDirectory(prefix="xla_permute_bench_dump_") as dump:
            flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump}".strip()
            memory[variant] = launch(
                f"native compiles with XLA dumps, {TOKEN_ENV}={value}",
                memory_rank, progs, cfg, dump, n=config.n,
                env={"XLA_FLAGS": flags, TOKEN_ENV: value},
            )  # fmt: skip
    scaling_raw = None
    if config.scaling_n:
        scaling_raw = launch(
            f"native trace+compile at N={config.scaling_n}",
            bench_rank, progs, cfg, run=False, native=True, n=config.scaling_n,
            env=default_env,
        )[0]  # fmt: skip

    rank0 = main[0]
    rows = []
    for p in progs:
        account = account_bytes(p, rank0["hlo"][p.name], config.n)
        per_rank = {
            v: {mode: [r["memory"][f"{p.name}|{mode}"]["bytes"] for r in memory[v]]
                for mode in X_MODES}
            for v in TOKEN_VARIANTS
        }  # fmt: skip
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
                "bytes": asdict(account),
                "chain": {
                    "token": chain_report(p, rank0["hlo"][p.name], config.n),
                    "no_token": chain_report(p, memory["no_token"][0]["hlo"][p.name], config.n),
                },
                "same_as_baseline": (
                    None if p.method == "baseline"
                    else all(r["same_as_baseline"][p.name] for r in main)
                ),
            }
        )  # fmt: skip
    scaling = []
    if scaling_raw is not None:
        for p in progs:
            account = account_bytes(p, scaling_raw["hlo"][p.name], config.scaling_n)
            scaling.append(
                {
                    "op": p.op,
                    "method": p.method,
                    "name": p.name,
                    "n": config.scaling_n,
                    "trace_s": _median(scaling_raw["trace_s"][p.name]),
                    "compile_s": _median(scaling_raw["compile_s"][p.name]),
                    "bytes_total": account.total,
                }
            )
    result = {
        "config": cfg,
        "environment": _environment(),
        "backends": {
            "trace_s": "native (traced on rank 0, not executed)",
            "compile_s": "native (XLA:CPU compile via _xla_warm_up_cache, not executed)",
            "fusions": "native (fusion ops of the XLA:CPU-optimised module)",
            "peak_bytes": "native (XLA:CPU buffer assignment, memory-usage-report)",
            "bytes": "native (traced HLO, ring algorithms assumed for all-gather/reduce-scatter)",
            "chain": "native (traced HLO)",
            "run_s": "emulated (CPU mesh; each permute is a channel-id all-gather)",
        },
        "programs": rows,
        "scaling": scaling,
        "seconds": time.perf_counter() - t_start,
    }
    result["ratios"] = _ratios(rows, scaling)
    result["checks"] = _checks(rows, scaling)
    result["targets"] = _targets(result)
    return result


def _environment() -> dict[str, Any]:
    from importlib.metadata import version

    return {
        "torch": version("torch"),
        "torch_xla": version("torch_xla"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
    }


def _by_name(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in rows}


def _ratios(rows: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> dict[str, Any]:
    """Each non-baseline program's figures divided by its op's baseline's."""
    out: dict[str, Any] = {"n": {}, "scaling_n": {}}
    for table, key in ((rows, "n"), (scaling, "scaling_n")):
        named = _by_name(table)
        for r in table:
            if r["method"] == "baseline":
                continue
            base = named[f"{r['op']}/baseline"]
            ratios = {
                "trace_plus_compile": (r["trace_s"] + r["compile_s"])
                / (base["trace_s"] + base["compile_s"]),
            }
            if key == "n":
                ratios["run"] = r["run_s"] / base["run_s"]
                ratios["bytes"] = r["bytes"]["total"] / base["bytes"]["total"]
                ratios["peak"] = {
                    v: {m: r["peak_bytes"][v][m] / base["peak_bytes"][v][m] for m in X_MODES}
                    for v in TOKEN_VARIANTS
                }
            out[key][r["name"]] = ratios
    return out


def _checks(rows: list[dict[str, Any]], scaling: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Facts that must hold (``ok``); a failure makes the command exit 1."""
    checks = []
    named = _by_name(rows)
    for op in _BASELINE:
        base = named.get(f"{op}/baseline")
        for method in ("uni", "bi"):
            r = named.get(f"{op}/{method}")
            if r is None or base is None:
                continue
            sent, base_sent = r["bytes"]["total"], base["bytes"]["total"]
            detail = f"{sent} B vs baseline {base_sent} B"
            ok = sent == base_sent
            if op == "all_gather_matmul":
                n, gathered = r["n"], base["bytes"]["gathered_bytes"]
                expected = (n - 1) * gathered // n
                ok = ok and sent == expected
                detail += f"; (N-1)/N of the gathered operand ({gathered} B) = {expected} B"
            checks.append(
                {"check": f"{r['name']}: bytes sent per rank = baseline's", "ok": ok,
                 "detail": detail}
            )  # fmt: skip
            checks.append(
                {"check": f"{r['name']}: emulated result = baseline's (exact)",
                 "ok": bool(r["same_as_baseline"]), "detail": "integer-valued float32 inputs"}
            )  # fmt: skip
    sc = _by_name(scaling)
    for op in _BASELINE:
        for method in ("uni", "bi"):
            r, base = sc.get(f"{op}/{method}"), sc.get(f"{op}/baseline")
            if r is None or base is None:
                continue
            checks.append({
                "check": f"{r['name']} at N={r['n']}: bytes sent per rank = baseline's",
                "ok": r["bytes_total"] == base["bytes_total"],
                "detail": f"{r['bytes_total']} B vs baseline {base['bytes_total']} B",
            })  # fmt: skip
    return checks


def _targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, reported with their measured values (never asserted)."""
    ratios = result["ratios"]
    out = []
    n = result["config"]["n"]
    peak = ratios["n"].get("all_gather_matmul/uni", {}).get("peak", {})
    for variant, modes in peak.items():
        for mode, value in modes.items():
            out.append({
                "target": f"peak memory, all_gather_matmul/uni vs baseline, N={n}, x {mode}, "
                          f"{TOKEN_ENV}={TOKEN_VARIANTS[variant]}",
                "limit": 0.6, "value": value, "met": value <= 0.6,
                "backend": "native (XLA:CPU buffer assignment)",
            })  # fmt: skip
    for name, r in ratios["scaling_n"].items():
        out.append({
            "target": f"trace+compile, {name} vs baseline, N={result['config']['scaling_n']}",
            "limit": 2.0, "value": r["trace_plus_compile"], "met": r["trace_plus_compile"] <= 2.0,
            "backend": "native (traced and compiled by XLA:CPU)",
        })  # fmt: skip
    for name, r in ratios["n"].items():
        out.append({
            "target": f"bytes sent per rank, {name} vs baseline, N={n}",
            "limit": 1.0, "value": r["bytes"], "met": r["bytes"] == 1.0,
            "backend": "native (traced HLO)",
        })  # fmt: skip
    return out


def _fmt_bytes(value: float) -> str:
    """``1.5 MiB``, ``96 B``: binary units, three significant digits.

    >>> _fmt_bytes(96), _fmt_bytes(3 * 2**20), _fmt_bytes(1536)
    ('96 B', '3 MiB', '1.5 KiB')
    """
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


def _fmt_ratio(value: float | None) -> str:
    return "1 (baseline)" if value is None else f"{value:.2f}x"


def format_report(result: dict[str, Any]) -> str:
    """The results as Markdown tables, every column labelled with its backend."""
    cfg, ratios = result["config"], result["ratios"]
    n = cfg["n"]
    lines = [
        f"Per rank: all_gather_matmul x [{cfg['m']}, {cfg['k']}], matmul_reduce_scatter x "
        f"[N*{cfg['m']}, {cfg['k']}], w [{cfg['k']}, {cfg['f']}], float32. CPU mesh, "
        f"torch_xla {result['environment']['torch_xla']}, {result['environment']['cpu_count']} "
        "cores.",
        "",
        f"Time, N={n} (trace, compile: native program on rank 0, median of "
        f"{cfg['compile_repeats']}; run: EMULATED backend, slowest rank, median of "
        f"{cfg['repeats']}):",
        "",
        "| program | trace ms (native) | compile ms (native) | fusions (native) "
        "| trace+compile vs baseline | run ms (emulated) | run vs baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["programs"]:
        rr = ratios["n"].get(r["name"], {})
        lines.append(
            f"| {r['name']} | {r['trace_s'] * 1e3:.1f} | {r['compile_s'] * 1e3:.1f} | "
            f"{r['fusions']} | {_fmt_ratio(rr.get('trace_plus_compile'))} | "
            f"{r['run_s'] * 1e3:.1f} | {_fmt_ratio(rr.get('run'))} |"
        )
    if result["scaling"]:
        lines += [
            "",
            f"Trace and compile at N={cfg['scaling_n']} (native program on rank 0, median of "
            f"{cfg['compile_repeats']}):",
            "",
            "| program | trace ms (native) | compile ms (native) | trace+compile vs baseline |",
            "|---|---|---|---|",
        ]
        for r in result["scaling"]:
            rr = ratios["scaling_n"].get(r["name"], {})
            lines.append(
                f"| {r['name']} | {r['trace_s'] * 1e3:.1f} | {r['compile_s'] * 1e3:.1f} | "
                f"{_fmt_ratio(rr.get('trace_plus_compile'))} |"
            )
    lines += [
        "",
        f"Peak memory per device, N={n} (native program, XLA:CPU buffer assignment, 'Total "
        f"bytes used', largest over the ranks; x an input or computed in the program; with "
        f"torch_xla's collective token and with {TOKEN_ENV}=1):",
        "",
        "| program | x input | vs baseline | x computed | vs baseline "
        "| x input, no token | vs baseline | x computed, no token | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["programs"]:
        peak = ratios["n"].get(r["name"], {}).get("peak")
        cells = []
        for v in TOKEN_VARIANTS:
            for mode in X_MODES:
                cells.append(_fmt_bytes(r["peak_bytes"][v][mode]))
                cells.append(_fmt_ratio(peak[v][mode] if peak else None))
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Bytes each rank sends, N={n} (native HLO; ring algorithms assumed for the baselines' "
        "all-gather and reduce-scatter):",
        "",
        "| program | per step | in total | vs baseline |",
        "|---|---|---|---|",
    ]
    for r in result["programs"]:
        rr = ratios["n"].get(r["name"], {})
        steps = ", ".join(_fmt_bytes(b) for b in r["bytes"]["per_step"])
        lines.append(
            f"| {r['name']} | {steps} | {_fmt_bytes(r['bytes']['total'])} | "
            f"{_fmt_ratio(rr.get('bytes'))} |"
        )
    lines += ["", "Order of the permutes in the native HLO:", ""]
    for r in result["programs"]:
        for v, label in (("token", "with the token"), ("no_token", f"{TOKEN_ENV}=1")):
            c = r["chain"][v]
            if not c["permutes"]:
                continue
            text = (
                f"- {r['name']}, {label}: {c['chained']} of {c['permutes'] - 1} consecutive "
                "permutes depend on the previous one"
            )
            if c["same_step"]:
                text += (
                    f"; {c['same_step_chained']} of {c['same_step']} two-direction steps serialised"
                )
            lines.append(text)
    lines += ["", "Checks:", ""]
    for c in result["checks"]:
        lines.append(f"- [{'ok' if c['ok'] else 'FAILED'}] {c['check']} ({c['detail']})")
    lines += ["", "Targets (reported, not enforced):", ""]
    for t in result["targets"]:
        lines.append(
            f"- [{'met' if t['met'] else 'missed'}] {t['target']}: {t['value']:.2f} "
            f"(target <= {t['limit']:g}; {t['backend']})"
        )
    lines += ["", f"Total {result['seconds']:.0f} s."]
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``python -m xla_permute bench`` (each overrides the preset)."""
    d = PRESETS["default"]
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="default",
        help="sizes and repeats to start from ('tiny' is the smoke test)",
    )  # fmt: skip
    parser.add_argument("-m", type=int, help=f"rows of this rank's x block (default {d.m})")
    parser.add_argument("-k", type=int, help=f"contracted dimension (default {d.k})")
    parser.add_argument("-f", type=int, help=f"columns of w (default {d.f})")
    parser.add_argument("-n", type=int, help=f"CPU devices of the main mesh (default {d.n})")
    parser.add_argument(
        "--scaling-n", type=int,
        help=f"CPU devices of the trace+compile mesh; 0 skips it (default {d.scaling_n})",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, help=f"timed runs (default {d.repeats})")
    parser.add_argument("--warmup", type=int, help=f"discarded runs/rounds (default {d.warmup})")
    parser.add_argument(
        "--compile-repeats", type=int,
        help=f"timed trace+compile rounds (default {d.compile_repeats})",
    )  # fmt: skip
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The preset, with every option that was given replacing its value."""
    overrides = {
        name: getattr(args, name)
        for name in ("m", "k", "f", "n", "scaling_n", "repeats", "warmup", "compile_repeats")
        if getattr(args, name, None) is not None
    }
    return replace(PRESETS[args.preset], **overrides)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark, print the report, write ``--json``; exit 1 if a check failed."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    _progress(f"config {asdict(config)}")
    result = run_bench(config)
    print(format_report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        _progress(f"wrote {args.json}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1
