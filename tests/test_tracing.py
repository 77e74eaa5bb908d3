"""The native collective matmul programs, traced on the 4-device mesh and read from their HLO.

This is the evidence that the ring is what it claims: N-1 collective-permutes with ring pairs,
no all-gather or all-reduce, N dots, and every permute has a dot that does not wait for it.
"""

from typing import Any

import pytest
import torch

from xla_permute import hlo, run_on_mesh
from xla_permute.pairs import ring_pairs

# Rank functions that trace collective matmul and its baselines for their HLO (never run: the
# native program cannot execute on the CPU mesh, and the traced tensors die before a sync).

MATMUL_OPS = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "all_gather_then_matmul",
    "matmul_then_reduce_scatter",
)


def matmul_program(
    op: str,
    m: int,
    k: int,
    f: int,
    *,
    bidirectional: bool = False,
    backend: str = "native",
    backward: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Trace ``op`` on this rank's device; return its outputs (nothing is executed). Call it
    inside :func:`xla_permute.hlo.tracing` for the native backend.

    All-gather ops take x ``[m, k]`` (this rank's rows), reduce-scatter ops x ``[N*m, k]``;
    w is ``[k, f]``. With ``backward`` the outputs are the gradients of ``sum(y)`` w.r.t. x
    and w instead of y.
    """
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    if op not in MATMUL_OPS:
        raise ValueError(f"op must be one of {MATMUL_OPS}, got {op!r}")
    n, device = xr.world_size(), torch_xla.device()
    rows = m if "all_gather" in op else n * m
    x = torch.ones(rows, k, dtype=dtype, device=device, requires_grad=backward)
    w = torch.ones(k, f, dtype=dtype, device=device, requires_grad=backward)
    kwargs: dict[str, Any] = {"dim": 0}
    if op in ("all_gather_matmul", "matmul_reduce_scatter"):
        kwargs.update(bidirectional=bidirectional, backend=backend)
    y = getattr(xp, op)(x, w, **kwargs)
    if not backward:
        return [y]
    y.sum().backward()
    return [x.grad, w.grad]


def matmul_hlos(specs: list[dict[str, Any]]) -> list[str]:
    """Rank function: the HLO text of :func:`matmul_program` for each spec (its keyword
    arguments), each program standing alone (:func:`xla_permute.hlo.trace`)."""
    import xla_permute as xp

    texts = []
    for spec in specs:
        with xp.hlo.tracing():  # the native backend is only traced on the CPU mesh
            texts.append(xp.hlo.trace(matmul_program(**spec)))
    return texts


N = 4
SPECS = [
    dict(op="all_gather_matmul", bidirectional=False),
    dict(op="all_gather_matmul", bidirectional=True),
    dict(op="matmul_reduce_scatter", bidirectional=False),
    dict(op="matmul_reduce_scatter", bidirectional=True),
    dict(op="all_gather_then_matmul"),
    dict(op="matmul_then_reduce_scatter"),
    dict(op="all_gather_matmul", bidirectional=False, backward=True),
    dict(op="matmul_reduce_scatter", bidirectional=True, backward=True),
]


@pytest.fixture(scope="module")
def programs():
    specs = [dict(spec, m=4, k=8, f=16) for spec in SPECS]
    per_rank = run_on_mesh(matmul_hlos, specs, n=N)
    return [[hlo.parse(text) for text in texts] for texts in per_rank]


@pytest.mark.parametrize(
    "i", range(4), ids=[f"{s['op']} bi={s['bidirectional']}" for s in SPECS[:4]]
)
def test_collective_matmul_is_a_ring_of_permutes(programs, i):
    for rank_programs in programs:
        program = rank_programs[i]
        collectives = program.collectives()
        assert [c.kind for c in collectives] == ["collective-permute"] * (N - 1)
        up, down = set(ring_pairs(N, 1)), set(ring_pairs(N, -1))
        directions = [set(c.pairs) for c in collectives]
        assert all(d in (up, down) for d in directions)
        assert directions.count(down) == (N - 1) // 2 * SPECS[i]["bidirectional"]
        assert len(program.ops("dot")) == N
        for c in collectives:  # some dot can run while each permute is in flight
            assert program.independent_of(c.name), c.name


def test_permutes_carry_one_block_each(programs):
    agm = programs[0][0].collectives()
    mrs = programs[0][2].collectives()
    assert {c.operand_bytes for c in agm} == {4 * 8 * 4}  # x block [m, k] float32
    assert {c.operand_bytes for c in mrs} == {4 * 16 * 4}  # partial sum [m, f] float32


def test_baselines_are_one_blocking_collective(programs):
    for i, kind in ((4, "all-gather"), (5, "reduce-scatter")):
        program = programs[0][i]
        (c,) = program.collectives()
        assert c.kind == kind and c.channel_id is not None and not c.constrain_layout
        assert program.independent_of(c.name) == []  # its one dot waits for it, or it for the dot


def test_torch_xla_token_orders_every_permute(programs):
    """torch_xla threads a token through its collectives: each permute waits for the one before,
    even the two directions of one bidirectional step."""
    for i in (1, 3):
        names = [c.name for c in programs[0][i].collectives()]
        for earlier, later in zip(names, names[1:], strict=False):
            assert programs[0][i].depends_on(later, earlier)


def test_backward_is_rings_too(programs):
    """dx is a ring of N-1 permutes and dw re-streams x (or dy) in N-1 more; the forward's N-1
    permutes are in the program too, chained in by torch_xla's token."""
    for i in (6, 7):
        kinds = [c.kind for c in programs[0][i].collectives()]
        assert kinds == ["collective-permute"] * (3 * (N - 1)), kinds
