"""The GPipe pipeline on stage shifts: schedule, equality with one device, cost vs send/recv.

One mesh launch for the module (tests/ranks_pipeline.py::pipeline_cases): the bad calls
in-rank, every pipeline case forward and backward in one program (emulated backend), then the
programs of one step traced with the native backend and with the send/recv code path. The
model, its reference and the HLO counting are in tests/pipeline_model.py.
"""

from __future__ import annotations

import pytest
import ranks_pipeline
import torch
from pipeline_model import (
    compare_with_single_device,
    example_batch,
    reference_step,
    sendrecv_code_path,
    step_cost,
)

from xla_permute import (
    Work,
    forms_complete_rings,
    make_schedule,
    pipeline_groups,
    run_on_mesh,
    shift_pairs,
)

N = 4

# ---------------------------------------------------------------------------- pure Python


@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 3), (2, 1), (4, 4), (3, 5), (4, 8)])
def test_gpipe_forward_ticks(stages, micro_batches):
    """pipeline_forward's ticks: the first M + S - 1 of GPipe's schedule, all forwards, then
    the backwards in the mirror order (autograd's, through the opposite shifts)."""
    s = make_schedule("gpipe", stages, micro_batches)
    forward = s.work[: micro_batches + stages - 1]
    assert all(w is None or w.kind == "F" for tick in forward for w in tick)
    assert s.work[len(forward)][-1] == Work("B", micro_batches - 1, stages - 1)
    for m in range(micro_batches):
        # every micro-batch visits every stage once, one stage per tick, in order
        visits = [(t, w.stage) for t, tick in enumerate(forward) for w in tick
                  if w is not None and w.micro_batch == m]  # fmt: skip
        assert visits == [(m + st, st) for st in range(stages)]
    shifts = sum(len(s.shifts(t)) for t in range(len(forward)))
    assert shifts == (len(forward) - 1 if stages > 1 else 0)
    backward = [tuple(None if w is None else w.micro_batch for w in tick)
                for tick in s.work[len(forward):]]  # fmt: skip
    assert backward == [tuple(None if w is None else w.micro_batch for w in tick)
                        for tick in reversed(forward)]  # fmt: skip
    idle = sum(w is None for tick in forward for w in tick)
    assert idle / (len(forward) * stages) == pytest.approx((stages - 1) / len(forward))


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (
            lambda: make_schedule("gpipe", 4, 0),
            ValueError,
            ["micro_batches must be an int >= 1, got 0"],
        ),
        (lambda: make_schedule("gpipe", 0, 4), ValueError, ["ranks must be an int >= 1, got 0"]),
        (lambda: make_schedule("gpipe", 4, 2.0), TypeError, ["micro_batches must be an int"]),
        (lambda: pipeline_groups(4, 3), ValueError, ["stages=3 does not divide the 4", "2, 4]"]),
        (lambda: pipeline_groups(6, 4), ValueError, ["[1, 2, 3, 6]"]),
        (lambda: pipeline_groups(4, -2), ValueError, ["stages must be an int >= 1, got -2"]),
    ],
)
def test_bad_counts(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)


def test_groups():
    assert pipeline_groups(4) == ((0, 1, 2, 3),)
    assert pipeline_groups(4, 2) == ((0, 1), (2, 3))
    assert pipeline_groups(4, 1) == ((0,), (1,), (2,), (3,))


def test_example_batch_is_integer_and_distinct():
    inputs, targets = example_batch(4, replicas=2)
    assert inputs.shape == targets.shape == (2, 4, 2, 4)
    for t in (inputs, targets):
        assert torch.equal(t, t.round())
    flat = inputs.reshape(8, -1)
    assert len({tuple(row.tolist()) for row in flat}) == 8  # no two micro-batches alike


def test_reference_sees_micro_batch_order_and_every_stage():
    """The equality check can fail: the reference depends on pairing and on each stage."""
    inputs, targets = example_batch(4)
    ref = reference_step(inputs[0], targets[0], stages=4)
    swapped = reference_step(inputs[0], targets[0].roll(1, 0), stages=4)
    assert not torch.equal(ref["loss"], swapped["loss"])
    for stage in range(4):
        assert any(g.abs().sum() > 0 for g in ref["grads"][stage].values()), stage
    assert torch.equal(ref["outputs"], ref["outputs"].round())  # exact integer arithmetic
    assert ref["outputs"].abs().max() < 2**24


def test_sendrecv_code_path_of_the_installed_backend():
    """What the send/recv replay of ranks_pipeline follows: one-pair permute + sync per tensor."""
    path = sendrecv_code_path()
    for method in ("send", "recv"):
        calls = path[method][0]
        assert calls["xm.collective_permute"] == 1 and calls["torch_xla.sync"] == 1, calls
    assert "pairs=[[xr.global_ordinal(), dst_rank]]" in path["send"][1]
    assert "pairs=[[src_rank, xr.global_ordinal()]]" in path["recv"][1]


def test_step_cost_reads_hlo():
    text = """
ENTRY %m (p0: f32[2,4]) -> f32[2,4] {
  %p0 = f32[2,4]{1,0} parameter(0)
  ROOT %cp = f32[2,4]{1,0} collective-permute(f32[2,4]{1,0} %p0), source_target_pairs={{0,1},{1,2}}
}"""
    cost = step_cost([text, text], rank=1, group_size=4)
    assert (cost.programs, cost.collectives, cost.bytes_sent) == (2, 2, 64)
    assert cost.pairs == (((0, 1), (1, 2)),) * 2
    assert step_cost([text], rank=2, group_size=4).bytes_sent == 0


def test_comparison_finds_a_wrong_gradient():
    """compare_with_single_device on hand-made per-rank results: equal, then one grad off."""
    inputs, targets = example_batch(3)
    ref = reference_step(inputs[0], targets[0], stages=N)
    results = [
        {
            "replica": 0,
            "stage": s,
            "loss": ref["loss"] if s == N - 1 else torch.zeros(()),
            "outputs": ref["outputs"] if s == N - 1 else torch.zeros_like(ref["outputs"]),
            "grads": {k: g.clone() for k, g in ref["grads"][s].items()},
        }
        for s in range(N)
    ]
    assert compare_with_single_device(results, inputs, targets) == []
    results[1]["grads"]["b1"][0] += 1
    assert compare_with_single_device(results, inputs, targets) == [
        "replica 0, stage 1: grad of b1 differs (max |diff| 1.0)"
    ]


# ---------------------------------------------------------------------------- on the mesh


def _cases() -> dict[str, dict]:
    one = dict(zip(("inputs", "targets"), example_batch(4), strict=True))
    return {
        "4 stages, open chain": dict(one, wrap=False),
        "4 stages, ring": dict(one, wrap=True),
        "4 stages, 1 micro-batch": dict(zip(("inputs", "targets"), example_batch(1), strict=True)),
        "2 replicas of 2 stages": dict(
            zip(("inputs", "targets"), example_batch(3, replicas=2), strict=True), stages=2
        ),
        "4 replicas of 1 stage": dict(
            zip(("inputs", "targets"), example_batch(2, replicas=4), strict=True), stages=1
        ),
    }


CASES = _cases()
ERRORS = [
    "ValueError: inputs has shape ()",  # (0, ...): no micro-batch, the empty result
    "ValueError: stages=3 does not divide the 4 ranks",
    "ValueError: stages must be an int >= 1, got 0",
    "ValueError: stage returned (2,) for an input of shape (2, 4)",
    "TypeError: stage must be a callable",
    "TypeError: wrap must be None",
    "ValueError: inputs is on device cpu, not an XLA device",
]


@pytest.fixture(scope="module")
def mesh() -> dict:
    names = list(CASES)
    traced = tuple(t[0] for t in example_batch())  # one replica, 4 micro-batches
    out = run_on_mesh(ranks_pipeline.pipeline_cases, [CASES[k] for k in names], traced, n=N)
    return {
        "errors": [r["errors"] for r in out],
        "cases": {k: [r["cases"][i] for r in out] for i, k in enumerate(names)},
        "traced": [r["traced"] for r in out],
    }


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_equal_single_device(mesh, name):
    case, got = CASES[name], mesh["cases"][name]
    assert compare_with_single_device(got, case["inputs"], case["targets"]) == []
    stages = case.get("stages") or N
    assert [r["stage"] for r in got] == [r % stages for r in range(N)]


def test_bad_inputs_raise_in_rank(mesh):
    for r in range(N):
        for expected, message in zip(ERRORS, mesh["errors"][r], strict=True):
            assert message.startswith(expected), (r, message)


def test_stage_shift_step_is_one_program(mesh):
    inputs, _ = example_batch()
    m = inputs.shape[1]
    shifts = m + N - 2  # one after every forward tick but the last
    fwd, bwd = set(shift_pairs(N, 1, wrap=False)), set(shift_pairs(N, -1, wrap=False))
    for r, traced in enumerate(mesh["traced"]):
        for form in ("shift_open", "shift_ring"):
            cost = step_cost(traced[form], r, N)
            assert cost.programs == 1
            assert cost.collectives == 2 * shifts  # forward shifts + their opposites
            assert set(cost.kinds) == {"collective-permute"}
            pairs = [set(p) for p in cost.pairs]
            if form == "shift_open":
                assert pairs == [fwd] * shifts + [bwd] * shifts
            else:
                assert all(forms_complete_rings(p) and len(p) == N for p in pairs)


def test_send_recv_step_is_one_program_per_call(mesh):
    m = example_batch()[0].shape[1]
    for r, traced in enumerate(mesh["traced"]):
        neighbours = (r > 0) + (r < N - 1)
        calls = 2 * m * neighbours  # forward: recv + send, backward: recv + send, per m
        cost = step_cost(traced["send_recv"], r, N)
        assert cost.programs == calls + 1  # + the step's final sync
        assert cost.collectives == calls
        assert all(len(p) == 1 and r in p[0] for p in cost.pairs)  # one pair, this rank in it
        per_program = [step_cost([t], r, N).collectives for t in traced["send_recv"]]
        assert per_program == [1] * calls + [0]
