"""The pure-torch oracle: checked against independent formulations, not against itself."""

from __future__ import annotations

import permute_cases as pc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xla_permute import reference
from xla_permute.pairs import check_groups, inverse_pairs, ring_pairs

N = pc.N


@st.composite
def grouped_cases(draw: st.DrawFn) -> dict:
    groups = draw(st.sampled_from(pc.GROUPINGS))
    pairs = draw(pc.partial_permutations(N if groups is None else len(groups[0])))
    shape = draw(st.sampled_from(pc.SHAPES))
    return pc.make_case(pairs, groups, torch.float32, shape, draw(st.integers(0, 2**31 - 1)))


@given(st.integers(-9, 9), st.sampled_from(pc.SHAPES), st.sampled_from(pc.DTYPES))
def test_ring_shift_is_a_roll(shift, shape, dtype):
    xs = pc.virtual_mesh(shape, dtype, seed=abs(shift))
    assert torch.equal(reference.permute(xs, ring_pairs(N, shift)), torch.roll(xs, shift, 0))


def test_identity_empty_and_zero_fill():
    xs = pc.virtual_mesh((2, 3), torch.int32, seed=0)
    assert torch.equal(reference.permute(xs, [(r, r) for r in range(N)]), xs)
    assert torch.equal(reference.permute(xs, []), torch.zeros_like(xs))
    out = reference.permute(xs, [(0, 1), (1, 0), (2, 2)])
    assert torch.equal(out[:3], xs[[1, 0, 2]]) and not out[3].any()
    assert out.dtype == xs.dtype and out.shape == xs.shape


@given(grouped_cases())
def test_groups_act_independently(case):
    # Permuting inside each group equals permuting that group's slice with the local pairs.
    xs, pairs, groups = case["xs"], case["pairs"], case["groups"]
    out = reference.permute(xs, pairs, groups)
    for g in check_groups(groups, N):
        assert torch.equal(out[list(g)], reference.permute(xs[list(g)], pairs))


@given(grouped_cases())
def test_inverse_pairs_bring_values_back_to_their_sources(case):
    xs, pairs, groups = case["xs"], case["pairs"], case["groups"]
    back = reference.permute(reference.permute(xs, pairs, groups), inverse_pairs(pairs), groups)
    sources = {g[s] for g in check_groups(groups, N) for s, _ in pairs}
    for r in range(N):
        assert torch.equal(back[r], xs[r] if r in sources else torch.zeros_like(xs[r]))


@given(grouped_cases())
def test_backward_is_the_permute_with_inverse_pairs(case):
    # Autograd of the oracle, and the adjoint identity <P x, g> = <x, P^T g> with P^T the
    # inverse pairs: the backward every backend must implement.
    xs, gs, pairs, groups = case["xs"], case["gs"], case["pairs"], case["groups"]
    leaf = xs.clone().requires_grad_(True)
    (reference.permute(leaf, pairs, groups) * gs).sum().backward()
    expected = reference.permute(gs, inverse_pairs(pairs), groups)
    assert torch.equal(leaf.grad, expected)
    lhs = (reference.permute(xs, pairs, groups) * gs).sum()
    assert torch.equal(lhs, (xs * expected).sum())


def test_rank_whose_value_goes_nowhere_gets_zero_gradient():
    xs = pc.virtual_mesh((3,), torch.float32, seed=1).requires_grad_(True)
    reference.permute(xs, [(0, 1)]).sum().backward()
    assert xs.grad[0].eq(1).all() and not xs.grad[1:].any()
    empty = pc.virtual_mesh((3,), torch.float32, seed=2).requires_grad_(True)
    reference.permute(empty, []).sum().backward()  # still in the graph: zero gradient
    assert not empty.grad.any()


def test_reference_checks_pairs():
    with pytest.raises(ValueError, match="duplicate target 1"):
        reference.permute(torch.zeros(4, 2), [(0, 1), (2, 1)])
    with pytest.raises(ValueError, match="groups leave ranks"):
        reference.permute(torch.zeros(4, 2), [(0, 1)], [[0, 1]])


@given(st.integers(0, 1), st.integers(0, 2**31 - 1))
def test_all_gather_and_reduce_scatter_are_adjoint(dim, seed):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randint(-9, 10, (N, 2, 3), generator=g).double()
    full_shape = (2 * N, 3) if dim == 0 else (2, 3 * N)
    ys = torch.randint(-9, 10, (N, *full_shape), generator=g).double()
    gathered = reference.all_gather(xs, dim)
    assert gathered.shape == (N, *full_shape)
    assert all(torch.equal(gathered[r], torch.cat(list(xs), dim)) for r in range(N))
    scattered = reference.reduce_scatter(ys, dim)
    assert scattered.shape == xs.shape
    assert torch.equal((gathered * ys).sum(), (xs * scattered).sum())


def test_collective_matmuls_match_unsharded_matmul():
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(-4, 5, (N, 2, 8), generator=g).float()  # rows sharded
    ws = torch.randint(-4, 5, (N, 8, 3), generator=g).float()  # column blocks per rank
    out = reference.all_gather_matmul(xs, ws, dim=0)
    for r in range(N):
        assert torch.equal(out[r], xs.reshape(2 * N, 8) @ ws[r])
    # Contraction sharded: rank r holds x[:, block r] and w[block r, :].
    xk = torch.randint(-4, 5, (N, 8, 2), generator=g).float()
    wk = torch.randint(-4, 5, (N, 2, 3), generator=g).float()
    full = torch.cat(list(xk), 1) @ torch.cat(list(wk), 0)
    assert torch.equal(torch.cat(list(reference.matmul_reduce_scatter(xk, wk, dim=0)), 0), full)
