"""Test data for the permute tests: hypothesis strategies, case builders, the bad-input table.

Shared by test_pairs.py and test_reference.py (pure, no mesh) and test_permute.py (which sends
the generated cases to the mesh in one launch). A case is a plain dict that pickles: ``xs`` is
the virtual-mesh input (leading axis = rank), ``gs`` the upstream gradient (float cases only).
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

N = 4  # ranks of the test mesh

#: Replica groupings of the 4-rank mesh: none, neighbours, strided, and groups whose listed
#: order differs from rank order (group-local id i is the i-th rank listed).
GROUPINGS: tuple[Any, ...] = (
    None,
    ((0, 1), (2, 3)),
    ((0, 2), (1, 3)),
    ((3, 1), (0, 2)),
    ((2, 0, 3, 1),),
)
DTYPES = (torch.float32, torch.bfloat16, torch.int32)
SHAPES = ((), (3,), (2, 3), (2, 1, 4))


@st.composite
def partial_permutations(draw: st.DrawFn, n: int) -> list[tuple[int, int]]:
    """A random partial permutation of ``range(n)``, pairs in random order.

    A permutation with a random subset of its arrows kept: self pairs, several cycles and
    open chains all occur, and so do the empty and the full permutation.
    """
    perm = draw(st.permutations(range(n)))
    drop = draw(st.sets(st.sampled_from(range(n)), max_size=n))  # arrows of perm to drop
    pairs = [(s, perm[s]) for s in range(n) if s not in drop]
    return list(draw(st.permutations(pairs)))


def virtual_mesh(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integer-valued data for N ranks, exact in bfloat16, never zero, disjoint per rank.

    Rank r's values lie in ``64 * r - 96 + [-30, 30]``: a value from the wrong rank, or a zero
    where data should be, cannot go unnoticed.
    """
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(-30, 31, (N, *shape), generator=g)
    offset = (64 * torch.arange(N) - 96).reshape(N, *([1] * len(shape)))
    return (noise + offset).to(dtype)


def make_case(
    pairs: list[tuple[int, int]], groups: Any, dtype: torch.dtype, shape: tuple, seed: int
) -> dict[str, Any]:
    """A case dict for ``ranks_permute.permute_cases``; float cases carry ``gs``."""
    xs = virtual_mesh(shape, dtype, seed)
    gs = virtual_mesh(shape, dtype, seed + 1) if dtype.is_floating_point else None
    return {"xs": xs, "gs": gs, "pairs": [list(p) for p in pairs], "groups": groups}


@st.composite
def permute_cases(draw: st.DrawFn) -> dict[str, Any]:
    groups = draw(st.sampled_from(GROUPINGS))
    size = N if groups is None else len(groups[0])
    return make_case(
        draw(partial_permutations(size)),
        groups,
        draw(st.sampled_from(DTYPES)),
        draw(st.sampled_from(SHAPES)),
        draw(st.integers(0, 2**31 - 1)),
    )


def _key(case: dict[str, Any]) -> tuple:
    return (sorted(map(tuple, case["pairs"])), case["groups"])


def generated_cases(count: int = 36) -> list[dict[str, Any]]:
    """``count`` distinct cases drawn by hypothesis, the same on every run.

    Hypothesis runs derandomized and without its example database; it draws many small,
    repetitive examples first, so it draws several times ``count`` and keeps the first
    ``count`` with distinct (pairs, groups).
    """
    out: dict[tuple, dict[str, Any]] = {}

    @settings(
        max_examples=6 * count,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(permute_cases())
    def collect(case: dict[str, Any]) -> None:
        out.setdefault(repr(_key(case)), case)

    collect()
    return list(out.values())[:count]


def classic_cases() -> dict[str, dict[str, Any]]:
    """XLA's classic collective-permute test cases, and torch_xla's own ring test.

    From xla/tests/collective_ops_test.cc in openxla/xla:

    * ``swap_fixed`` (``CollectivePermute_Simple``): (1,0),(0,1) swap plus (2,2) fixed point;
      rank 3 receives zeros ("Nothing writes to replica 3, so it is memzero'ed").
    * ``all_self`` (``CollectivePermute_Degnerate``): every rank keeps its value.
    * ``three_self`` (``CollectivePermute_NoDegnerate``): ranks 0-2 keep theirs, rank 3 zeros.
    * ``CollectivePermute_Rotate`` is the ring shift below.

    And:

    * ``four_cycle``: one cycle through all ranks that is not a ring shift.
    * ``torch_xla_ring``: test/test_mp_collective_permute.py in pytorch/xla: int32 ``[ordinal] *
      100``, pairs ``[i - 1, i]`` for i in 1..n-1 plus ``[n - 1, 0]``.
    """
    torch_xla_xs = torch.arange(N, dtype=torch.int32)[:, None].expand(N, 100).contiguous()
    torch_xla_pairs = [[i - 1, i] for i in range(1, N)] + [[N - 1, 0]]
    return {
        "swap_fixed": make_case([(0, 1), (1, 0), (2, 2)], None, torch.float32, (2, 3), 11),
        "all_self": make_case([(r, r) for r in range(N)], None, torch.bfloat16, (3,), 12),
        "three_self": make_case([(0, 0), (1, 1), (2, 2)], None, torch.int32, (2,), 15),
        "four_cycle": make_case([(0, 2), (2, 1), (1, 3), (3, 0)], None, torch.float32, (2,), 13),
        "torch_xla_ring": dict(xs=torch_xla_xs, gs=None, pairs=torch_xla_pairs, groups=None),
        "empty": make_case([], None, torch.float32, (2, 3), 14),
    }


#: Bad pairs/groups: (id, pairs, groups, exception type, regex the message must match).
#: Every message names the offending value and what is allowed.
BAD_PAIRS: list[tuple[str, Any, Any, type[Exception], str]] = [
    ("not-a-sequence", 5, None, TypeError, r"pairs must be a sequence of \(source, target\)"),
    ("string", "01", None, TypeError, r"pairs must be a sequence .* got str"),
    ("flat-list", [0, 1], None, TypeError, r"pairs\[0\] = 0 is not a \(source, target\) pair"),
    ("triple", [(0, 1, 2)], None, TypeError, r"pairs\[0\] = \(0, 1, 2\) is not a"),
    ("float-id", [(0, 1.0)], None, TypeError, r"pairs\[0\] target must be an integer rank id"),
    ("bool-id", [(True, 0)], None, TypeError, r"source must be an integer rank id, got True"),
    ("string-id", [("0", 1)], None, TypeError, r"pairs\[0\] source must be an integer"),
    ("negative", [(0, 1), (-1, 2)], None, ValueError, r"pairs\[1\] = \(-1, 2\): source -1 is neg"),
    ("outside", [(0, 4)], None, ValueError, r"target 4 is outside the group of 4 ranks \(ids 0..3"),
    (
        "outside-group",
        [(0, 2)],
        [[0, 1], [2, 3]],
        ValueError,
        r"target 2 is outside the group of 2 ranks \(ids 0..1\)",
    ),
    ("dup-source", [(0, 1), (0, 2)], None, ValueError, r"duplicate source 0 in pairs \(0, 1\) and"),
    ("dup-target", [(0, 1), (2, 1)], None, ValueError, r"duplicate target 1 in pairs \(0, 1\) and"),
    ("dup-self", [(1, 1), (1, 1)], None, ValueError, r"duplicate source 1"),
    ("groups-overlap", [(0, 1)], [[0, 1], [1, 2]], ValueError, r"groups overlap: rank 1 is in"),
    ("groups-repeat", [(0, 1)], [[0, 0], [2, 3]], ValueError, r"groups\[0\] lists rank 0 twice"),
    ("groups-ragged", [(0, 1)], [[0, 1], [2]], ValueError, r"different sizes \[1, 2\]"),
    ("groups-missing", [(0, 1)], [[0, 1]], ValueError, r"groups leave ranks \[2, 3\] out"),
    ("groups-sizes", [(0, 1)], [[0, 1, 2], [3]], ValueError, r"different sizes \[1, 3\]"),
    ("groups-outside", [(0, 1)], [[0, 1], [2, 5]], ValueError, r"rank 5, outside the world of 4"),
    ("groups-empty", [(0, 1)], [], TypeError, r"groups must be a non-empty list of rank lists"),
    ("groups-flat", [(0, 1)], [0, 1, 2, 3], TypeError, r"groups\[0\] = 0 must be a non-empty"),
    ("groups-float", [(0, 1)], [[0, 1.5], [2, 3]], TypeError, r"groups\[0\] entry must be an int"),
]
