"""xp.pipeline_step on the 4-device CPU mesh: every schedule equals one device, bit for bit.

One mesh launch for the module (tests/ranks_pipeline.py::step_cases): the bad calls in-rank,
then every configuration below, one step each (the eight schedules at p in {2, 4}: GPipe, 1F1B,
interleaved 1F1B, Looped BFS, ZB-H1, ZB1P, ZB-V and DualPipeV), then several optimizer steps
(SGD and AdamW) of GPipe, 1F1B, ZB-V and DualPipeV, then the Llama-style model of
tests/pipeline_llama.py (token ids in, logits and cross-entropy out). The model (an MLP per
stage, integer-valued, so every value is exact) and its single-device reference are in
tests/pipeline_model.py. Also checked from the run: each rank executed exactly its schedule's
work, issued the schedule's shifts, idled the closed form's ticks and held at most the
schedule's peak of activations (the 1F1B memory claim, counted while running).

Each case is a program of its own (one sync each), not one program for all: every rank
traces a program of its own, the device threads compile them one after another, and XLA:CPU
aborts a collective whose first rank waited 10 s for the last; with one program for all cases
the ranks finished compiling up to 17 s apart on this 2-core machine.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import ranks_pipeline
import torch
from pipeline_llama import llama_batch, llama_problems
from pipeline_model import example_batch, step_problems, training_problems

from xla_permute import make_schedule, run_on_mesh
from xla_permute.pipeline.orders import theory_bubble_fraction

N = 4


def _case(schedule: str, ranks: int, micro_batches: int, stages_per_rank: int = 1, **kw) -> dict:
    inputs, targets = example_batch(micro_batches, replicas=N // ranks)
    return dict(kw, schedule=schedule, ranks=ranks, stages_per_rank=stages_per_rank,
                inputs=inputs, targets=targets)  # fmt: skip


# p in {2, 4} (p = 2: two pipelines side by side), m in {p, 2p, odd}, v in {1, 2}
CASES = (
    {
        f"{name} p={p} m={m}" + (" ring" if wrap else ""): _case(name, p, m, v, wrap=wrap)
        for p, ms in ((4, (4, 8, 5)), (2, (2, 4, 3)))
        for m in ms
        for name, v, wrap in (("1f1b", 1, None), ("interleaved", 2, None))
    }
    | {
        "gpipe p=4 m=5": _case("gpipe", 4, 5),
        "1f1b p=4 m=5 ring": _case("1f1b", 4, 5, wrap=True),
    }
    | {
        f"{name} p={p} m={m}": _case(name, p, m, v)
        for p, ms in ((4, (8,)), (2, (4, 6)))
        for m in ms
        for name, v in (("looped_bfs", 2), ("zbh1", 1), ("zb1p", 2), ("zbv", 2), ("dualpipev", 2))
    }
)
TRAININGS = {
    "gpipe sgd p=4": _case("gpipe", 4, 4, optimizer="sgd", steps=3),
    "1f1b adamw p=2": _case("1f1b", 2, 3, optimizer="adamw", steps=3),  # 2 pipelines
    "zbv adamw p=2": _case("zbv", 2, 4, 2, optimizer="adamw", steps=3),  # I and W, a V
    "dualpipev adamw p=4": _case("dualpipev", 4, 8, 2, optimizer="adamw", steps=3),
}
ERRORS = [
    "ValueError: micro_batches=3 is below ranks=4",
    "ValueError: stages_per_rank=2 needs one of",
    "ValueError: wrap=False asks for open-chain shifts",
    "ValueError: schedule must be one of",
    "ValueError: the schedule is for 4 ranks, 8 micro-batches",
    (  # a stage that changes the shape; on the last rank, the loss of its output fails
        "ValueError: stage module 0 (stage ",
        "ValueError: loss_fn(output, target) raised RuntimeError for the last stage's output",
    ),
    (  # checked where the last stage is; the debug mode tells the other ranks
        "ValueError: loss_fn(output, target) returned (2, 3)",
        "DisagreementError: pipeline_step: the ranks disagree on error: rank 3 passes ValueError",
    ),
    "ValueError: targets has 3 micro-batches and inputs 4",
    "ValueError: inputs is on device cpu, not an XLA device",
    "TypeError: modules must be this rank's stage",
    "ValueError: stages=3 does not divide the 4 ranks",
    "TypeError: activation must be None",
    (  # rank 0's stage and rank 3's loss fail; ranks 1 and 2 hand on what was declared
        "ValueError: stage module 0 (stage 0)",
        "DisagreementError: pipeline_step: the ranks disagree on error: ranks 0, 3 pass ValueE",
        "ValueError: loss_fn(output, target) raised RuntimeError for the last stage's output",
    ),
    "ValueError: activation='infer': stage 0 (on rank 0) could not run",  # every rank alike
]


def _llama(schedule: str, ranks: int, micro_batches: int, stages_per_rank: int = 1, **kw) -> dict:
    inputs, targets = llama_batch(micro_batches, replicas=N // ranks)
    return dict(kw, schedule=schedule, ranks=ranks, stages_per_rank=stages_per_rank,
                inputs=inputs, targets=targets)  # fmt: skip


#: The Llama-style model: token ids in, logits and cross-entropy out (a V puts both on rank 0).
LLAMAS = {
    "llama 1f1b p=4": _llama("1f1b", 4, 4),
    "llama zbv p=2": _llama("zbv", 2, 4, 2),
    "llama dualpipev p=2": _llama("dualpipev", 2, 4, 2),
    "llama zb1p p=4, activation inferred": _llama("zb1p", 4, 4, 2, activation="infer"),
}


@pytest.fixture(scope="module")
def mesh() -> dict:
    out = run_on_mesh(
        ranks_pipeline.step_cases,
        list(CASES.values()),
        list(TRAININGS.values()),
        list(LLAMAS.values()),
        n=N,
    )
    return {
        "errors": [r["errors"] for r in out],
        "cases": {k: [r["cases"][i] for r in out] for i, k in enumerate(CASES)},
        "trainings": {k: [r["trainings"][i] for r in out] for i, k in enumerate(TRAININGS)},
        "llamas": {k: [r["llamas"][i] for r in out] for i, k in enumerate(LLAMAS)},
    }


@pytest.mark.parametrize("name", list(LLAMAS))
def test_llama_shaped_stages_equal_one_device(mesh, name):
    assert llama_problems(LLAMAS[name], mesh["llamas"][name]) == []


def test_bad_calls_raise_on_every_rank(mesh):
    for r in range(N):
        assert len(mesh["errors"][r]) == len(ERRORS)
        for expected, message in zip(ERRORS, mesh["errors"][r], strict=True):
            assert message.startswith(expected), (r, message)  # one prefix, or one of several


@pytest.mark.parametrize("name", list(CASES))
def test_step_equals_one_device(mesh, name):
    assert step_problems(CASES[name], mesh["cases"][name]) == []


@pytest.mark.parametrize("name", list(CASES))
def test_ran_the_schedule(mesh, name):
    """What each rank executed, the shifts it issued and the activations it held, counted
    while running, are the schedule's own."""
    case, got = CASES[name], mesh["cases"][name]
    p, m = case["ranks"], case["inputs"].shape[1]
    s = make_schedule(case["schedule"], p, m, case["stages_per_rank"])
    for r in got:
        assert r["executed"] == tuple(tick[r["position"]] for tick in s.work)
        assert r["shifts"] == tuple(s.shifts(t) for t in range(s.ticks))
        assert r["live"] == s.in_flight(r["position"])
        assert max(r["live"]) == s.peak_in_flight[r["position"]]
    idle = sum(w is None for r in got[:p] for w in r["executed"])
    assert Fraction(idle, s.ticks * p) == theory_bubble_fraction(s)


def test_gradients_bit_identical_across_schedules(mesh):
    """Every schedule of the same model (ranks, micro-batches, stages per rank) gives the same
    loss and the same gradients bit for bit, whatever its order, placement or split of B."""
    groups: dict[tuple, list[str]] = {}
    for name, case in CASES.items():
        key = (case["ranks"], case["inputs"].shape[1], case["stages_per_rank"])
        groups.setdefault(key, []).append(name)
    compared = 0
    for names in groups.values():
        first = {}
        for r in mesh["cases"][names[0]]:
            first.update({(r["replica"], s): g for s, g in r["grads"].items()})
        for name in names[1:]:
            for r in mesh["cases"][name]:
                for s, grads in r["grads"].items():
                    for k, g in grads.items():
                        assert torch.equal(g, first[r["replica"], s][k]), (name, names[0], s, k)
                        compared += 1
    assert compared > 0 and any(len(n) >= 5 for n in groups.values())


def test_1f1b_holds_p_activations_where_gpipe_holds_m(mesh):
    gpipe = mesh["cases"]["gpipe p=4 m=5"]
    one_f_one_b = mesh["cases"]["1f1b p=4 m=5"]
    assert [max(r["live"]) for r in gpipe] == [5, 5, 5, 5]
    assert [max(r["live"]) for r in one_f_one_b] == [4, 3, 2, 1]


@pytest.mark.parametrize("name", list(TRAININGS))
def test_training_steps_equal_one_device(mesh, name):
    assert training_problems(TRAININGS[name], mesh["trainings"][name]) == []


def test_comparisons_find_a_wrong_result():
    """step_problems / training_problems on hand-made per-rank results: equal, then one off."""
    from pipeline_model import reference_step, reference_training

    case = CASES["interleaved p=2 m=3"]
    p, v = case["ranks"], case["stages_per_rank"]
    got = []
    for replica in range(N // p):
        ref = reference_step(case["inputs"][replica], case["targets"][replica], stages=p * v)
        for position in range(p):
            held = [c * p + position for c in range(v)]
            got.append({
                "replica": replica, "position": position,
                "loss": ref["loss"] if position == p - 1 else torch.zeros(()),
                "grads": {s: dict(ref["grads"][s]) for s in held},
            })  # fmt: skip
    assert step_problems(case, got) == []
    got[3]["grads"][3] = {k: g + (k == "w2") for k, g in got[3]["grads"][3].items()}
    assert step_problems(case, got) == ["replica 1, stage 3: grad of w2"]

    case = TRAININGS["1f1b adamw p=2"]
    runs = [reference_training(case["inputs"][r], case["targets"][r], stages=2,
                               optimizer="adamw", steps=3) for r in range(2)]  # fmt: skip
    got = [
        {"replica": r, "position": s, "params": {s: runs[r]["params"][s]},
         "losses": [x if s == 1 else torch.zeros(()) for x in runs[r]["losses"]]}
        for r in range(2) for s in range(2)
    ]  # fmt: skip
    assert training_problems(case, got) == []
    got[0]["losses"] = [x + 1 for x in got[0]["losses"]]
    assert training_problems(case, got)[0].startswith("replica 0: first loss")
