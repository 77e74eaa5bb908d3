"""stage_shift: pairs of the two forms, the hardware rule, and the mesh against the reference.

One mesh launch for the module: every bad call in-rank (each must raise before anything is
issued), then every case, forward and backward, emulated backend, in one program.
"""

from __future__ import annotations

import math

import pytest
import ranks_pipeline
import torch

from xla_permute import reference, run_on_mesh
from xla_permute.pairs import decompose, forms_complete_rings, inverse_pairs, is_ring
from xla_permute.pipeline.shift import check_offset, resolve_wrap, shift_pairs

N = 4
GROUPINGS = {
    "all": None,
    "neighbours": ((0, 1), (2, 3)),
    "strided": ((0, 2), (1, 3)),
    "listed out of order": ((3, 1), (0, 2)),
}


# ---------------------------------------------------------------------------- pure Python


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_forms_and_backward_pairs(n):
    for offset in [k for k in range(-n + 1, n) if k]:
        chain, ring = shift_pairs(n, offset, wrap=False), shift_pairs(n, offset, wrap=True)
        assert all(t - s == offset for s, t in chain)
        assert len(chain) == n - abs(offset) and len(ring) == n
        assert set(chain) <= set(ring)
        assert not decompose(chain).cycles and forms_complete_rings(ring)
        assert is_ring(ring, n) == (math.gcd(n, offset) == 1)  # else several smaller rings
        # the backward of a shift is the opposite shift, in the same form
        assert sorted(inverse_pairs(chain)) == sorted(shift_pairs(n, -offset, wrap=False))
        assert sorted(inverse_pairs(ring)) == sorted(shift_pairs(n, -offset, wrap=True))
        # the reference shift, written from the equation, moves along the same pairs
        xs = torch.arange(1.0, n + 1)
        for wrap, pairs in ((False, chain), (True, ring)):
            want = reference.permute(xs, pairs)
            assert torch.equal(reference.stage_shift(xs, offset, wrap=wrap), want)


@pytest.mark.parametrize(
    ("offset", "n", "error", "words"),
    [
        (0, 4, ValueError, ["offset=0", "no shift", "offset=1"]),
        (4, 4, ValueError, ["offset=4", "group of 4", "0 < |offset| < 4"]),
        (-5, 4, ValueError, ["offset=-5", "0 < |offset| < 4"]),
        (1, 1, ValueError, ["group of 1"]),
        (1.0, 4, TypeError, ["offset must be an int", "1.0"]),
        (True, 4, TypeError, ["offset must be an int", "bool"]),
    ],
)
def test_bad_offsets(offset, n, error, words):
    with pytest.raises(error) as info:
        check_offset(offset, n)
    assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(error):
        shift_pairs(n, offset, wrap=True)


def test_hardware_rule_chooses_the_form():
    assert resolve_wrap(None, "NEURON") is True
    assert resolve_wrap(None, "CPU") is False and resolve_wrap(None, "TPU") is False
    assert resolve_wrap(True, "CPU") is True and resolve_wrap(False, "TPU") is False
    with pytest.raises(ValueError, match=r"wrap=False asks for an open chain.*NEURON.*wrap=None"):
        resolve_wrap(False, "NEURON")
    with pytest.raises(TypeError, match="wrap must be None"):
        resolve_wrap("ring", "CPU")
    for offset in (1, -1, 2):
        pairs = shift_pairs(4, offset, wrap=resolve_wrap(None, "NEURON"))
        assert forms_complete_rings(pairs)


def test_reference_stage_shift_by_hand():
    xs = torch.tensor([10.0, 11.0, 12.0, 13.0])
    assert reference.stage_shift(xs, 1, wrap=False).tolist() == [0, 10, 11, 12]
    assert reference.stage_shift(xs, 1, wrap=True).tolist() == [13, 10, 11, 12]
    assert reference.stage_shift(xs, -2, wrap=False).tolist() == [12, 13, 0, 0]
    assert reference.stage_shift(xs, 1, wrap=False, groups=GROUPINGS["strided"]).tolist() == [
        0,
        0,
        10,
        11,
    ]


# ---------------------------------------------------------------------------- on the mesh


def _cases() -> dict[str, dict]:
    xs = (torch.arange(N)[:, None, None] * 10 + torch.arange(6).reshape(1, 2, 3) + 1).float()
    gs = (torch.arange(N)[:, None, None] * 7 - torch.arange(6).reshape(1, 2, 3) * 3).float()
    cases = {}
    for wrap in (False, True):
        for offset in (1, -1, 2, -2, 3):
            cases[f"wrap={wrap} offset={offset}"] = dict(offset=offset, wrap=wrap, groups=None)
        for name, groups in GROUPINGS.items():
            if groups is not None:
                for offset in (1, -1):
                    cases[f"wrap={wrap} offset={offset} {name}"] = dict(
                        offset=offset, wrap=wrap, groups=groups
                    )
    for case in cases.values():
        case.update(xs=xs, gs=gs)
    cases["bfloat16 ring"] = dict(
        offset=1, wrap=True, groups=None, xs=xs.bfloat16(), gs=gs.bfloat16()
    )
    return cases


CASES = _cases()
BAD = [
    ({"offset": 0}, "ValueError: offset=0"),
    ({"offset": N}, f"ValueError: offset={N} is not smaller than the group of {N}"),
    ({"offset": -N}, f"ValueError: offset={-N}"),
    ({"offset": 2, "groups": [[0, 1], [2, 3]]}, "ValueError: offset=2 is not smaller than the g"),
    ({"offset": 1.0}, "TypeError: offset must be an int"),
    ({"offset": True}, "TypeError: offset must be an int"),
    ({"wrap": "ring"}, "TypeError: wrap must be None"),
    ({"backend": "nccl"}, "ValueError: backend must be one of"),
    ({"groups": [[0, 1], [2]]}, "ValueError: groups have different sizes"),
]


@pytest.fixture(scope="module")
def mesh() -> dict:
    names = list(CASES)
    out = run_on_mesh(
        ranks_pipeline.shift_cases, [CASES[k] for k in names], [kw for kw, _ in BAD], n=N
    )
    return {
        "errors": [r["errors"] for r in out],
        "cases": {k: [r["cases"][i] for r in out] for i, k in enumerate(names)},
    }


def test_cases_tell_the_forms_apart():
    for case in CASES.values():
        open_ = reference.stage_shift(case["xs"], case["offset"], wrap=False, groups=case["groups"])
        ring = reference.stage_shift(case["xs"], case["offset"], wrap=True, groups=case["groups"])
        assert not torch.equal(open_, ring)


@pytest.mark.parametrize("name", list(CASES))
def test_shift_and_its_backward(mesh, name):
    case, got = CASES[name], mesh["cases"][name]
    kw = dict(wrap=case["wrap"], groups=case["groups"])
    want = reference.stage_shift(case["xs"], case["offset"], **kw)
    want_grad = reference.stage_shift(case["gs"], -case["offset"], **kw)  # the opposite shift
    for r in range(N):
        assert got[r]["y"].dtype == case["xs"].dtype
        assert torch.equal(got[r]["y"], want[r]), f"rank {r}: {got[r]['y']} != {want[r]}"
        assert torch.equal(got[r]["grad"], want_grad[r]), f"rank {r} grad"


def test_bad_inputs_raise_in_rank(mesh):
    for r in range(N):
        errors = mesh["errors"][r]
        for (kw, expected), message in zip(BAD, errors, strict=False):
            assert message.startswith(expected), (kw, message)
        assert errors[-1].startswith("ValueError: x is on device cpu, not an XLA device")
