"""collective_permute on the 4-device CPU mesh, against the pure-torch reference.

Three mesh launches for the whole module:

1. every generated and classic case, forward and backward, emulated backend, one program;
2. every bad input called in-rank (nothing may be issued before the error), then the native
   backend traced (never executed) for its HLO;
3. one rank function that lets the ValueError escape, to show how it reaches the caller.
"""

from __future__ import annotations

import re

import permute_cases as pc
import pytest
import ranks_permute
import torch

from xla_permute import RankError, reference, run_on_mesh
from xla_permute.hlo import parse
from xla_permute.pairs import inverse_pairs

N = pc.N
GENERATED = 36
CLASSIC = tuple(pc.classic_cases())


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    out = {f"gen-{i}": case for i, case in enumerate(pc.generated_cases(GENERATED))}
    out.update(pc.classic_cases())
    return out


@pytest.fixture(scope="module")
def mesh(cases) -> dict[str, list[dict]]:
    """Launch 1: the per-rank outputs (and input gradients) of every case."""
    names = list(cases)
    per_rank = run_on_mesh(ranks_permute.permute_cases, [cases[k] for k in names], n=N)
    return {name: [per_rank[r][i] for r in range(N)] for i, name in enumerate(names)}


def reference_of(case: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference output and, for float cases, the reference autograd input gradient."""
    xs, gs = case["xs"], case["gs"]
    out = reference.permute(xs, case["pairs"], case["groups"])
    if gs is None:
        return out, None
    leaf = xs.clone().requires_grad_(True)
    (reference.permute(leaf, case["pairs"], case["groups"]) * gs).sum().backward()
    return out, leaf.grad


def assert_matches_reference(case: dict, got: list[dict]) -> None:
    want, want_grad = reference_of(case)
    for r in range(N):
        y = got[r]["y"]
        assert y.dtype == want.dtype and y.shape == want[r].shape, r
        assert torch.equal(y, want[r]), f"rank {r}: {y} != {want[r]}"
        if want_grad is None:
            assert "grad" not in got[r]
        else:
            grad = got[r]["grad"]
            assert grad.dtype == want_grad.dtype, r
            assert torch.equal(grad, want_grad[r]), f"rank {r} grad: {grad} != {want_grad[r]}"


def test_generated_cases_cover_the_space():
    generated = pc.generated_cases(GENERATED)
    assert len(generated) == GENERATED
    assert {c["xs"].dtype for c in generated} == set(pc.DTYPES)
    assert {c["groups"] for c in generated} == set(pc.GROUPINGS)
    assert {tuple(c["xs"].shape[1:]) for c in generated} == set(pc.SHAPES)
    from xla_permute.pairs import decompose

    shapes = [decompose(c["pairs"]) for c in generated]
    assert any(not c["pairs"] for c in generated)  # empty
    assert any(any(s == t for s, t in c["pairs"]) for c in generated)  # self pairs
    assert any(len([c for c in d.cycles if len(c) > 1]) >= 2 for d in shapes)  # 2+ cycles
    assert any(d.chains and d.cycles for d in shapes)  # open chain next to a cycle
    assert any(c["groups"] is None and len(c["pairs"]) == N for c in generated)


@pytest.mark.parametrize("i", range(GENERATED), ids=lambda i: f"gen-{i}")
def test_generated_case_matches_reference(cases, mesh, i):
    assert_matches_reference(cases[f"gen-{i}"], mesh[f"gen-{i}"])


@pytest.mark.parametrize("name", CLASSIC)
def test_classic_case_matches_reference(cases, mesh, name):
    assert_matches_reference(cases[name], mesh[name])


def test_swap_with_fixed_point_leaves_rank_3_zero(cases, mesh):
    xs, gs, got = cases["swap_fixed"]["xs"], cases["swap_fixed"]["gs"], mesh["swap_fixed"]
    assert torch.equal(got[0]["y"], xs[1]) and torch.equal(got[1]["y"], xs[0])
    assert torch.equal(got[2]["y"], xs[2])
    assert not got[3]["y"].any()
    # Rank 3's value went nowhere: zero gradient. The others get their target's gradient.
    assert not got[3]["grad"].any()
    assert torch.equal(got[0]["grad"], gs[1]) and torch.equal(got[2]["grad"], gs[2])


def test_all_self_pairs_are_the_identity(cases, mesh):
    case, got = cases["all_self"], mesh["all_self"]
    for r in range(N):
        assert torch.equal(got[r]["y"], case["xs"][r])
        assert torch.equal(got[r]["grad"], case["gs"][r])


def test_three_self_pairs_leave_rank_3_zero(cases, mesh):
    case, got = cases["three_self"], mesh["three_self"]
    assert all(torch.equal(got[r]["y"], case["xs"][r]) for r in range(3))
    assert not got[3]["y"].any() and got[3]["y"].dtype == torch.int32


def test_torch_xla_ring_test_expectation(mesh):
    # pytorch/xla test/test_mp_collective_permute.py: expected = [ordinal - 1] * 100, or
    # [world_size - 1] * 100 on ordinal 0.
    for ordinal, out in enumerate(mesh["torch_xla_ring"]):
        expected = [ordinal - 1] * 100 if ordinal != 0 else [N - 1] * 100
        assert out["y"].dtype == torch.int32 and out["y"].tolist() == expected


def test_empty_pairs_give_zeros_on_every_rank(mesh):
    for out in mesh["empty"]:
        assert out["y"].shape == (2, 3) and not out["y"].any() and not out["grad"].any()


# --- launch 2: bad inputs in-rank, then the native lowering traced --------------------------

BAD_X = [
    ("x-on-cpu", "cpu", "emulated", ValueError, r"x is on device cpu, not an XLA device.*\.to\("),
    ("x-not-a-tensor", "list", "emulated", TypeError, r"x must be a torch\.Tensor, got list"),
    ("bad-backend", "xla", "nccl", ValueError, r"backend must be one of \('auto', 'native'"),
]
# The native backend checks the same pairs before calling xm.collective_permute.
BAD_NATIVE = [("native-dup-target", [(0, 1), (2, 1)], ValueError, r"duplicate target 1")]

# Group-local pairs and the global pairs every rank's HLO must carry.
NATIVE = {
    "ring": ([(0, 1), (1, 2), (2, 3), (3, 0)], None, {(0, 1), (1, 2), (2, 3), (3, 0)}),
    "swap-in-groups": ([(0, 1), (1, 0)], [[0, 2], [1, 3]], {(0, 2), (2, 0), (1, 3), (3, 1)}),
    "partial-in-groups": ([(1, 0)], [[3, 2], [1, 0]], {(2, 3), (0, 1)}),
}


def _bad_cases() -> list[dict]:
    out = [{"id": i, "pairs": p, "groups": g} for i, p, g, _, _ in pc.BAD_PAIRS]
    for i, x, backend, *_ in BAD_X:
        out.append({"id": i, "pairs": [(0, 1)], "groups": None, "x": x, "backend": backend})
    out += [{"id": i, "pairs": p, "groups": None, "backend": "native"} for i, p, *_ in BAD_NATIVE]
    return out


@pytest.fixture(scope="module")
def traced() -> list[dict]:
    native = [{"pairs": p, "groups": g} for p, g, _ in NATIVE.values()]
    return run_on_mesh(ranks_permute.bad_inputs_then_traced_hlo, _bad_cases(), native, n=N)


EXPECTED_ERRORS = [pytest.param(i, t, m, id=i) for i, _, _, t, m in pc.BAD_PAIRS]
EXPECTED_ERRORS += [pytest.param(i, t, m, id=i) for i, _, _, t, m in BAD_X]
EXPECTED_ERRORS += [pytest.param(i, t, m, id=i) for i, _, t, m in BAD_NATIVE]


@pytest.mark.parametrize(("case_id", "error", "message"), EXPECTED_ERRORS)
def test_bad_input_raises_in_rank(traced, case_id, error, message):
    for rank, result in enumerate(traced):
        name, text = result["raised"][case_id]
        assert name == error.__name__, f"rank {rank}: {name}: {text}"
        assert re.search(message, text), f"rank {rank}: {text!r} !~ {message!r}"


def test_bad_inputs_issue_no_collective(traced):
    # After all the failing calls, the first collective of the program gets channel id 1:
    # none of them reached the emulated all-gather (which takes a channel id).
    for result in traced:
        (gather,) = parse(result["good_hlo"]).collectives()
        assert gather.kind == "all-gather" and gather.channel_id == 1


@pytest.mark.parametrize("name", NATIVE)
def test_native_lowering_is_one_collective_permute(traced, name):
    _, _, expected = NATIVE[name]
    index = list(NATIVE).index(name)
    for rank, result in enumerate(traced):
        hlo = result["native"][index]
        (forward,) = parse(hlo["forward"]).collectives()
        assert forward.kind == "collective-permute", rank
        assert set(forward.pairs) == expected and len(forward.pairs) == len(expected), rank
        assert not forward.constrain_layout  # no layout pinning for permute upstream
        # Backward: one collective-permute with the inverse pairs, still no all-gather.
        (backward,) = parse(hlo["backward"]).collectives()
        assert backward.kind == "collective-permute", rank
        assert set(backward.pairs) == set(inverse_pairs(expected)), rank


def test_emulated_lowering_is_one_all_gather_with_channel_id(traced):
    for result in traced:
        (gather,) = parse(result["emulated_ring"]).collectives()
        assert gather.kind == "all-gather" and gather.channel_id is not None
        assert gather.replica_groups == (tuple(range(N)),)


@pytest.mark.parametrize("backend", ["native", "emulated"])
def test_empty_pairs_issue_no_collective(traced, backend):
    for result in traced:
        text = result["empty"][backend]
        assert parse(text).collectives() == [], text


# --- launch 3: the error as the caller of run_on_mesh sees it -------------------------------


def test_bad_pairs_error_reaches_the_caller_as_rank_error():
    with pytest.raises(RankError, match=r"raised ValueError: pairs: duplicate target 1") as e:
        run_on_mesh(ranks_permute.permute_raises, [(0, 1), (2, 1)], n=N, timeout=120)
    assert isinstance(e.value.__cause__, ValueError)
    assert "every rank may receive from at most one source" in str(e.value.__cause__)
