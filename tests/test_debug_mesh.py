"""The debug mode on the collectives and collective matmuls (one mesh launch, N=4).

Ranks that disagree on ``all_gather``, ``reduce_scatter``, ``all_gather_matmul``,
``matmul_reduce_scatter`` or their baselines raise ``DisagreementError`` on every rank before
the first collective, naming the ranks and what differs; ranks that agree get the reference's
result (integer-valued inputs: exact).
"""

from __future__ import annotations

import re

import pytest
import torch

from xla_permute import run_on_mesh

N = 4
D = "DisagreementError"


def _x(rank: int, rows: int = 2, cols: int = 4) -> torch.Tensor:
    return (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) % 5) + rank


def _w(rank: int, k: int = 4, f: int = 2) -> torch.Tensor:
    return (torch.arange(k * f, dtype=torch.float32).reshape(k, f) % 3) - rank


#: case -> the pattern every rank's DisagreementError must match
DISAGREE = {
    "all_gather: 3 rows on rank 1": r"all_gather: .*x\.shape: rank 1 passes \(3, 4\), ranks 0, 2, "
    r"3 pass \(2, 4\)",
    "reduce_scatter: dim 1 on rank 0": r"reduce_scatter: .*dim: rank 0 passes 1, ranks 1, 2, 3 "
    r"pass 0",
    "matmul_reduce_scatter: w [4, 3] on rank 2": r"matmul_reduce_scatter: .*w\.shape: rank 2 "
    r"passes \(4, 3\), ranks 0, 1, 3 pass \(4, 2\)",
    "all_gather_matmul: bidirectional on rank 3": r"all_gather_matmul: .*bidirectional: rank 3 "
    r"passes True, ranks 0, 1, 2 pass False",
    "matmul_reduce_scatter: reduce_dtype float64 on rank 1": r"reduce_dtype: rank 1 passes "
    r"torch\.float64, ranks 0, 2, 3 pass torch\.float32",
    "all_gather_then_matmul: float64 on rank 0": r"all_gather_then_matmul: .*x\.dtype: rank 0 "
    r"passes torch\.float64, ranks 1, 2, 3 pass torch\.float32",
    "matmul_then_reduce_scatter: groups on rank 3": r"matmul_then_reduce_scatter: .*groups: "
    r"rank 3 passes",
}  # fmt: skip


def debug_cases(names: list[str]) -> dict[str, tuple[str, object]]:
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    rank, device = xr.global_ordinal(), torch_xla.device()

    def run(name: str) -> object:
        x, w = _x(rank).to(device), _w(rank).to(device)
        tall = _x(rank, rows=2 * N).to(device)  # [N*m, K] for the reduce-scatters
        if name == "all_gather: 3 rows on rank 1":
            return xp.all_gather(_x(rank, rows=3 if rank == 1 else 2).to(device), 0)
        if name == "reduce_scatter: dim 1 on rank 0":
            return xp.reduce_scatter(_x(rank, rows=4).to(device), 1 if rank == 0 else 0)
        if name == "matmul_reduce_scatter: w [4, 3] on rank 2":
            w = _w(rank, f=3 if rank == 2 else 2).to(device)
            return xp.matmul_reduce_scatter(tall, w, dim=0)
        if name == "all_gather_matmul: bidirectional on rank 3":
            return xp.all_gather_matmul(x, w, dim=0, bidirectional=rank == 3)
        if name == "matmul_reduce_scatter: reduce_dtype float64 on rank 1":
            dtype = torch.float64 if rank == 1 else None
            return xp.matmul_reduce_scatter(tall, w, dim=0, reduce_dtype=dtype)
        if name == "all_gather_then_matmul: float64 on rank 0":
            if rank == 0:
                x, w = x.double(), w.double()
            return xp.all_gather_then_matmul(x, w, dim=0)
        if name == "matmul_then_reduce_scatter: groups on rank 3":
            groups = [[0, 2], [1, 3]] if rank == 3 else [[0, 1], [2, 3]]
            return xp.matmul_then_reduce_scatter(_x(rank, rows=4).to(device), w, dim=0,
                                                 groups=groups)  # fmt: skip
        if name == "agree":  # every op once, the ranks agreeing: the check passes
            return {
                "all_gather": xp.all_gather(x, 0),
                "reduce_scatter": xp.reduce_scatter(tall, 0),
                "all_gather_matmul": xp.all_gather_matmul(x, w, dim=0),
                "matmul_reduce_scatter": xp.matmul_reduce_scatter(tall, w, dim=0),
                "all_gather_then_matmul": xp.all_gather_then_matmul(x, w, dim=0),
                "matmul_then_reduce_scatter": xp.matmul_then_reduce_scatter(tall, w, dim=0),
            }
        raise AssertionError(name)

    out: dict[str, tuple[str, object]] = {}
    with xp.debug_mode():
        for name in names:
            try:
                value = run(name)
                torch_xla.sync()
                value = {k: v.cpu() for k, v in value.items()} if isinstance(value, dict) else value
                out[name] = ("ok", value)
            except Exception as e:  # noqa: BLE001 - the test inspects the type and message
                out[name] = (type(e).__name__, str(e))
    return out


@pytest.fixture(scope="module")
def mesh() -> list[dict]:
    return run_on_mesh(debug_cases, [*DISAGREE, "agree"], n=N, timeout=240)


@pytest.mark.parametrize("name", list(DISAGREE))
def test_disagreement_raises_on_every_rank_naming_the_ranks(mesh, name):
    for r, rank in enumerate(mesh):
        kind, message = rank[name]
        assert kind == D, f"rank {r}: {kind}: {message}"
        assert re.search(DISAGREE[name], message), f"rank {r}: {message!r}"
        assert "agreement check" in message and f"on rank {r} of {N}" in message


def test_ranks_that_agree_get_the_reference_result(mesh):
    xs = torch.stack([_x(r) for r in range(N)])
    tall = torch.stack([_x(r, rows=2 * N) for r in range(N)])
    ws = torch.stack([_w(r) for r in range(N)])
    gathered = torch.cat(list(xs), 0)
    summed = sum(tall[r] @ ws[r] for r in range(N))
    want = {
        "all_gather": [gathered] * N,
        "reduce_scatter": list(sum(tall).chunk(N, 0)),
        "all_gather_matmul": [gathered @ ws[r] for r in range(N)],
        "matmul_reduce_scatter": list(summed.chunk(N, 0)),
    }
    want["all_gather_then_matmul"] = want["all_gather_matmul"]
    want["matmul_then_reduce_scatter"] = want["matmul_reduce_scatter"]
    for r, rank in enumerate(mesh):
        kind, got = rank["agree"]
        assert kind == "ok", got
        for op, expected in want.items():
            assert torch.equal(got[op], expected[r]), (op, r)
