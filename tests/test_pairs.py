"""Pairs and groups: checks, rings, inverses, cycles. Pure Python, no mesh."""

from __future__ import annotations

import math
import re

import permute_cases as pc
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xla_permute import collective_permute
from xla_permute.backends.select import get_backend
from xla_permute.backends.xla import check_xla_tensor
from xla_permute.pairs import (
    check_groups,
    check_pairs,
    decompose,
    forms_complete_rings,
    global_pairs,
    inverse_pairs,
    is_ring,
    ring_pairs,
    source_of,
)

sizes = st.integers(1, 7)


@st.composite
def sized_partial_permutations(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    n = draw(sizes)
    return n, draw(pc.partial_permutations(n))


# --- every bad input, with the message it must carry ------------------------------------------


@pytest.mark.parametrize(
    ("pairs", "groups", "error", "message"),
    [pytest.param(p, g, e, m, id=i) for i, p, g, e, m in pc.BAD_PAIRS],
)
def test_bad_pairs_and_groups(pairs, groups, error, message):
    with pytest.raises(error, match=message):
        global_pairs(pairs, groups, pc.N)


def test_error_names_the_offending_pair_and_the_rule():
    with pytest.raises(ValueError) as e:
        check_pairs([(0, 1), (1, 2), (3, 2)], 4)
    assert str(e.value) == (
        "pairs: duplicate target 2 in pairs (1, 2) and (3, 2); every rank may receive from at "
        "most one source (see the docs, tutorials/15_errors.html#error-pairs)"
    )


def test_numpy_and_torch_integer_ids_are_accepted():
    np = pytest.importorskip("numpy")
    assert check_pairs([(np.int64(0), torch.tensor(1))], 2) == ((0, 1),)
    assert all(type(r) is int for r in check_pairs([(np.int32(1), np.int64(0))], 2)[0])


def test_pairs_may_be_any_iterable_of_pairs():
    assert check_pairs(iter([[1, 0], (0, 1)]), 2) == ((1, 0), (0, 1))


def test_empty_pairs_are_allowed():
    assert check_pairs([], 4) == ()
    assert global_pairs([], [[0, 1], [2, 3]], 4) == ()


def test_x_not_a_tensor():
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor, got list"):
        collective_permute([1.0, 2.0], [(0, 1)])


def test_x_not_on_an_xla_device():
    with pytest.raises(ValueError, match=r"x is on device cpu, not an XLA device; move it first"):
        collective_permute(torch.ones(2), [(0, 1)])
    with pytest.raises(ValueError, match=r"w is on device cpu"):
        check_xla_tensor(torch.ones(2), name="w")


@pytest.mark.parametrize("backend", ["nccl", "Native", None])
def test_bad_backend(backend):
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'native', 'emul"):
        get_backend(backend)


# --- groups ---------------------------------------------------------------------------------


def test_groups_map_local_ids_to_global_ranks():
    # Group-local id i is the i-th rank *listed* in the group, whatever the order.
    swap = global_pairs([(0, 1), (1, 0)], [[0, 1], [2, 3]], 4)
    assert set(swap) == {(0, 1), (1, 0), (2, 3), (3, 2)}
    assert set(global_pairs([(0, 1)], [[3, 1], [0, 2]], 4)) == {(3, 1), (0, 2)}
    assert global_pairs([(0, 1), (1, 0)], None, 2) == ((0, 1), (1, 0))


@given(
    st.sampled_from(pc.GROUPINGS).flatmap(
        lambda g: st.tuples(st.just(g), pc.partial_permutations(pc.N if g is None else len(g[0])))
    )
)
def test_global_pairs_are_a_partial_permutation_inside_the_groups(case):
    groups, local = case
    glob = global_pairs(local, groups, pc.N)
    assert check_pairs(glob, pc.N) == glob  # still one source and one target per rank
    owner = {r: i for i, g in enumerate(check_groups(groups, pc.N)) for r in g}
    assert all(owner[s] == owner[t] for s, t in glob)  # nothing crosses a group
    assert len(glob) == len(local) * len(check_groups(groups, pc.N))


# --- ring_pairs, inverse, source_of ---------------------------------------------------------


@given(st.integers(1, 9), st.integers(-20, 20))
def test_ring_pairs(n, shift):
    pairs = ring_pairs(n, shift)
    assert check_pairs(pairs, n) == pairs
    assert all(source_of(pairs, r) == (r - shift) % n for r in range(n))
    # A shift is one cycle through all ranks exactly when it is coprime to n.
    assert is_ring(pairs, n) == (math.gcd(shift, n) == 1 or n == 1)
    assert forms_complete_rings(pairs)


@pytest.mark.parametrize(
    ("n", "shift", "error"),
    [(0, 1, ValueError), (True, 1, ValueError), (4, 0.5, TypeError), (2.0, 1, ValueError)],
)
def test_ring_pairs_rejects_bad_arguments(n, shift, error):
    with pytest.raises(error, match=re.escape("n must") if error is ValueError else "shift must"):
        ring_pairs(n, shift)


@given(sized_partial_permutations())
def test_inverse_pairs(case):
    n, pairs = case
    inverse = inverse_pairs(pairs)
    assert check_pairs(inverse, n) == inverse
    assert sorted(inverse_pairs(inverse)) == sorted(pairs)
    for s, t in pairs:
        assert source_of(inverse, s) == t and source_of(pairs, t) == s
    targets = {t for _, t in pairs}
    assert all(source_of(pairs, r) is None for r in range(n) if r not in targets)


# --- decompose, is_ring, forms_complete_rings ------------------------------------------------


def _pairs_of(d) -> list[tuple[int, int]]:
    out = [(c[i], c[(i + 1) % len(c)]) for c in d.cycles for i in range(len(c))]
    return out + [(c[i], c[i + 1]) for c in d.chains for i in range(len(c) - 1)]


@given(sized_partial_permutations())
def test_decompose_covers_every_pair_exactly_once(case):
    n, pairs = case
    d = decompose(pairs)
    assert sorted(_pairs_of(d)) == sorted(pairs)
    ranks = [r for part in (*d.cycles, *d.chains) for r in part]
    assert len(ranks) == len(set(ranks))  # cycles and chains are disjoint
    targets = {t for _, t in pairs}
    assert all(c[0] == min(c) for c in d.cycles)
    assert all(c[0] not in targets and len(c) >= 2 for c in d.chains)


def test_decompose_examples():
    d = decompose([(3, 3), (2, 0), (0, 2), (1, 4), (4, 5)])
    assert d.cycles == ((0, 2), (3,)) and d.chains == ((1, 4, 5),)


@pytest.mark.parametrize("bad", [[(0, 1), (1, 2), (2, 1)], [(0, 1), (0, 2)], [(-1, 0)], [0, 1]])
def test_decompose_checks_its_input(bad):
    # Unchecked, a duplicate target sends the walk round a cycle it never leaves.
    with pytest.raises((TypeError, ValueError)):
        decompose(bad)


@given(sized_partial_permutations())
def test_forms_complete_rings_iff_senders_are_receivers(case):
    _, pairs = case
    sources, targets = {s for s, _ in pairs}, {t for _, t in pairs}
    assert forms_complete_rings(pairs) == (sources == targets)


@given(sized_partial_permutations())
def test_is_ring_iff_walk_from_a_rank_visits_all(case):
    n, pairs = case
    succ = dict(pairs)
    walk, r = [], 0
    while r in succ and len(walk) < n:  # n steps from rank 0
        walk.append(r)
        r = succ[r]
    expected = len(set(walk)) == n and r == 0  # all n ranks visited, back at rank 0
    assert is_ring(pairs, n) == expected


def test_is_ring_checks_ids_against_n():
    with pytest.raises(ValueError, match="outside the group of 2 ranks"):
        is_ring([(0, 5), (5, 0)], 2)


def test_neuron_rule_examples():
    assert forms_complete_rings([(0, 1), (1, 0), (2, 3), (3, 2)])  # two rings
    assert forms_complete_rings([(2, 2)])  # a self pair is a ring of one
    assert not forms_complete_rings([(0, 1), (1, 2)])  # an open chain
    assert forms_complete_rings([])
