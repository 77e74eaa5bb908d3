"""The benchmarked programs, their sizes, and building one on a rank of the mesh.

A :class:`BenchProgram` is an op ("all_gather_matmul" or "matmul_reduce_scatter") and a
method ("uni", "bi" or "baseline"); for the memory measurements also all-gather-matmul's
backward (``backward=True``: the gradients of x and w for a given dy, an input) and its
chunked ring (``chunks``), :data:`MEMORY_PROGRAMS`. Per-rank shapes: all-gather-matmul
takes x ``[m, k]`` and w ``[k, f]``; matmul-reduce-scatter takes x ``[N*m, k]`` and w
``[k, f]``; float32.
:func:`inputs` makes x and w on this rank's device, :func:`build` traces the program on them.

>>> [p.name for p in PROGRAMS][:3]
['all_gather_matmul/uni', 'all_gather_matmul/bi', 'all_gather_matmul/baseline']
>>> [s.sends for s in BenchProgram("all_gather_matmul", "bi").schedule(4)]
[(1, -1), (1,), ()]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xla_permute as xp
from xla_permute.pairs import check_int

__all__ = [
    "MEMORY_PROGRAMS",
    "PRESETS",
    "PROGRAMS",
    "X_MODES",
    "BenchConfig",
    "BenchProgram",
    "build",
    "inputs",
]

#: Each op and the upstream baseline it replaces (a :mod:`xla_permute.matmul` function).
BASELINES = {
    "all_gather_matmul": "all_gather_then_matmul",
    "matmul_reduce_scatter": "matmul_then_reduce_scatter",
}
#: The ring schedule of each op (rank 0's: the permutes are the same on every rank).
SCHEDULES = {
    "all_gather_matmul": xp.all_gather_schedule,
    "matmul_reduce_scatter": xp.reduce_scatter_schedule,
}
METHODS = ("uni", "bi", "baseline")
#: x a program input (resident for the whole program) or computed inside it.
X_MODES = ("input", "computed")


@dataclass(frozen=True)
class BenchProgram:
    """One benchmarked program: ``op`` (a key of ``BASELINES``) and ``method``
    ("uni", "bi" or "baseline"); ``chunks`` (all-gather-matmul's option) and ``backward``
    (the program computes the gradients of x and w instead of the result).

    >>> BenchProgram("all_gather_matmul", "uni", chunks=4).name
    'all_gather_matmul/uni/c4'
    >>> BenchProgram("all_gather_matmul", "bi", backward=True).baseline.name
    'all_gather_matmul.backward/baseline'
    """

    op: str
    method: str
    chunks: int = 1
    backward: bool = False

    def __post_init__(self) -> None:
        if self.op not in BASELINES:
            raise ValueError(f"BenchProgram: op must be one of {tuple(BASELINES)}, got {self.op!r}")
        if self.method not in METHODS:
            raise ValueError(f"BenchProgram: method must be one of {METHODS}, got {self.method!r}")
        if self.chunks != 1 and (self.op != "all_gather_matmul" or self.method == "baseline"):
            raise ValueError(
                f"BenchProgram: chunks={self.chunks!r} is an option of the all_gather_matmul "
                "rings only; use chunks=1"
            )

    @property
    def name(self) -> str:
        op = f"{self.op}.backward" if self.backward else self.op
        return f"{op}/{self.method}" + (f"/c{self.chunks}" if self.chunks > 1 else "")

    @property
    def baseline(self) -> BenchProgram:
        """The baseline program of this op (and direction of autograd)."""
        return BenchProgram(self.op, "baseline", backward=self.backward)

    @property
    def function(self) -> str:
        """The :mod:`xla_permute.matmul` function that builds it."""
        return BASELINES[self.op] if self.method == "baseline" else self.op

    def schedule(self, n: int) -> list[xp.RingStep] | None:
        """The ring schedule its permutes follow on ``n`` ranks; None for the baseline."""
        if self.method == "baseline":
            return None
        return SCHEDULES[self.op](n, 0, self.method == "bi")


#: The six benchmarked programs, each op as ``uni``, ``bi`` and ``baseline``.
PROGRAMS: tuple[BenchProgram, ...] = tuple(
    BenchProgram(op, method) for op in BASELINES for method in METHODS
)
#: Peak memory only: all-gather-matmul's unidirectional ring with 2 and 4 chunks per block.
#: (Its backward, ``BenchProgram(..., backward=True)``, is not in the default run: compiled
#: in turn by every rank of one launch, a later program ran into an all-gather the other
#: ranks never reached, not yet explained.)
MEMORY_PROGRAMS: tuple[BenchProgram, ...] = tuple(
    BenchProgram("all_gather_matmul", "uni", chunks=c) for c in (2, 4)
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
            check_int(value, f"BenchConfig: {name}", 1)
        for name in ("scaling_n", "warmup"):
            value = getattr(self, name)
            check_int(value, f"BenchConfig: {name}", 0)
        if self.n < 2 or self.scaling_n == 1:
            raise ValueError(
                f"BenchConfig: n (got {self.n}) and scaling_n (got {self.scaling_n}) need at "
                "least 2 devices for a collective (scaling_n=0 skips the second mesh)"
            )


#: Named configurations, ``default`` (about a minute on 2 cores) and ``tiny`` (smoke test).
PRESETS: dict[str, BenchConfig] = {
    "default": BenchConfig(),
    "tiny": BenchConfig(m=16, k=64, f=16, repeats=1, warmup=1, compile_repeats=1),
}


def inputs(
    program: BenchProgram, m: int, k: int, f: int, mode: str, seed: int | None
) -> tuple[Any, Any]:
    """x and w of ``program`` on this rank's device (call it on a rank of the mesh).

    ``mode="input"``: both are device data (program inputs); integer values from ``seed``
    (exact float32 sums), or zeros with ``seed=None`` (for programs that are never run).
    ``mode="computed"``: x is computed inside the traced graph from two input vectors (an
    outer product: not resident, not a constant XLA could fold), w is an input.
    """
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    if mode not in X_MODES:
        raise ValueError(f"mode must be one of {X_MODES}, got {mode!r}")
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


def build(program: BenchProgram, x: Any, w: Any, backend: str) -> list[Any]:
    """Trace ``program`` on x and w with the permute ``backend`` ("native" or "emulated"):
    its result, or for a backward program the gradients of x and w for a dy that is an input
    (zeros)."""
    import torch

    from xla_permute import matmul

    fn = getattr(matmul, program.function)
    options: dict[str, Any] = {}
    if program.method != "baseline":
        options = {"bidirectional": program.method == "bi", "backend": backend}
    if program.chunks > 1:
        options["chunks"] = program.chunks
    if not program.backward:
        return [fn(x, w, dim=0, **options)]
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w, dim=0, **options)
    dy = torch.zeros(tuple(y.shape)).to(y.device)  # device data: an input of the program
    return list(torch.autograd.grad(y, (x, w), dy))
