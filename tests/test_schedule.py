"""The ring schedules, simulated on the virtual mesh with the reference permute for many N."""

import pytest
import torch

from xla_permute import reference
from xla_permute.matmul_ring import all_gather_schedule, reduce_scatter_schedule, ring_steps
from xla_permute.pairs import ring_pairs

NS = [1, 2, 3, 4, 5, 8]


def simulate_all_gather_matmul(xs, ws, dim, bidirectional):
    """Run every rank's schedule in lockstep; blocks travel with reference.permute."""
    n = xs.shape[0]
    schedules = [all_gather_schedule(n, r, bidirectional) for r in range(n)]
    held = {1: xs, -1: xs}
    products = [{} for _ in range(n)]
    for t in range(len(schedules[0])):
        sends = {s[t].sends for s in schedules}
        assert len(sends) == 1, "every rank must issue the same permutes at a step"
        in_flight = {d: reference.permute(held[d], ring_pairs(n, d)) for d in sends.pop()}
        for r in range(n):
            for direction, block in zip((1, -1), schedules[r][t].blocks, strict=False):
                products[r][block] = held[direction][r] @ ws[r]
        held.update(in_flight)
    for r in range(n):
        assert sorted(products[r]) == list(range(n)), f"rank {r} missed or repeated a block"
    return torch.stack([torch.cat([p[b] for b in range(n)], dim=dim) for p in products])


def simulate_matmul_reduce_scatter(xs, ws, dim, bidirectional):
    n = xs.shape[0]
    schedules = [reduce_scatter_schedule(n, r, bidirectional) for r in range(n)]
    received, summed = {}, {}
    contributions = [[0] * n for _ in range(n)]  # contributions[block][rank]
    for t in range(len(schedules[0])):
        for direction in (1, -1):
            parts = []
            for r in range(n):
                blocks = dict(zip((1, -1), schedules[r][t].blocks, strict=False))
                if direction not in blocks:
                    parts = None
                    break
                contributions[blocks[direction]][r] += 1
                parts.append(xs[r].chunk(n, dim)[blocks[direction]] @ ws[r])
            if parts is not None:
                p = torch.stack(parts)
                summed[direction] = received[direction] + p if direction in received else p
        for d in schedules[0][t].sends:
            received[d] = reference.permute(summed[d], ring_pairs(n, d))
    assert contributions == [[1] * n] * n, "every rank adds to every block exactly once"
    return summed[1] + received[-1] if -1 in received else summed[1]


def _ints(*shape, seed=0):
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize(("per_rank", "dim"), [((3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), 0)])
def test_all_gather_schedule_computes_reference(n, bidirectional, per_rank, dim):
    xs, ws = _ints(n, *per_rank), _ints(n, per_rank[-1], 5, seed=1)
    got = simulate_all_gather_matmul(xs, ws, dim, bidirectional)
    assert torch.equal(got, reference.all_gather_matmul(xs, ws, dim))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize(("per_rank", "dim"), [((2, 4), 0), ((2, 2, 4), 1), ((2, 3, 4), 0)])
def test_reduce_scatter_schedule_computes_reference(n, bidirectional, per_rank, dim):
    shape = list(per_rank)
    shape[dim] *= n
    xs, ws = _ints(n, *shape), _ints(n, shape[-1], 5, seed=1)
    got = simulate_matmul_reduce_scatter(xs, ws, dim, bidirectional)
    assert torch.equal(got, reference.matmul_reduce_scatter(xs, ws, dim))


@pytest.mark.parametrize("n", NS)
def test_step_and_permute_counts(n):
    for bidirectional in (False, True):
        for schedule in (all_gather_schedule, reduce_scatter_schedule):
            steps = schedule(n, 0, bidirectional)
            assert sum(len(s.sends) for s in steps) == n - 1
            assert len(steps) == (n // 2 + 1 if bidirectional else n)
            assert sum(len(s.blocks) for s in steps) == n
    assert ring_steps(n, True) == (n // 2, (n - 1) // 2)


def test_bad_n():
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        ring_steps(0, False)
