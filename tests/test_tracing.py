"""The native collective matmul programs, traced on the 4-device mesh and read from their HLO.

This is the evidence that the ring is what it claims: N-1 collective-permutes with ring pairs,
no all-gather or all-reduce, N dots, and every permute has a dot that does not wait for it.
"""

import pytest
from programs import matmul_hlos

from xla_permute import hlo, run_on_mesh
from xla_permute.pairs import ring_pairs

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
