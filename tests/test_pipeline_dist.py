"""xp.pipeline_step on real processes: torchrun, gloo, CPU tensors, the c10d backend.

One launch of 4 processes (tests/pipeline_dist.py) runs the cases of
tests/test_pipeline_step.py with the same rank code as the CPU mesh: GPipe, 1F1B and
interleaved 1F1B at p=4 and as two pipelines of 2 (process subgroups), one step each and
several optimizer steps, and the same bad calls. Each must equal one device as on the mesh.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import test_pipeline_step as mesh_cases
import torch
from pipeline_llama import llama_problems
from pipeline_model import step_problems, training_problems
from torchrun import torchrun

from xla_permute import make_schedule

N = 4
SCRIPT = Path(__file__).parent / "pipeline_dist.py"
LAUNCH_TIMEOUT = 240  # seconds for the launch; the process group's own timeout is 30 s


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("pipeline_dist")
    code, output, _ = torchrun(SCRIPT, N, str(out), timeout=LAUNCH_TIMEOUT)
    assert code == 0, output[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(N)]


def test_bad_calls_raise_on_every_rank(ranks):
    expected = [e for e in mesh_cases.ERRORS if "not an XLA device" not in e]
    for r, got in enumerate(ranks):
        assert len(got["errors"]) == len(expected)
        for want, message in zip(expected, got["errors"], strict=True):
            assert message.startswith(want), (r, message)


@pytest.mark.parametrize("name", list(mesh_cases.CASES))
def test_step_equals_one_device(ranks, name):
    i = list(mesh_cases.CASES).index(name)
    got = [r["cases"][i] for r in ranks]
    case = mesh_cases.CASES[name]
    assert step_problems(case, got) == []
    p, v = case["ranks"], case["stages_per_rank"]
    s = make_schedule(case["schedule"], p, case["inputs"].shape[1], v)
    for r in got:
        assert r["executed"] == tuple(tick[r["position"]] for tick in s.work)
        assert r["live"] == s.in_flight(r["position"])


@pytest.mark.parametrize("name", list(mesh_cases.LLAMAS))
def test_llama_shaped_stages_equal_one_device(ranks, name):
    i = list(mesh_cases.LLAMAS).index(name)
    got = [r["llamas"][i] for r in ranks]
    assert llama_problems(mesh_cases.LLAMAS[name], got) == []


@pytest.mark.parametrize("name", list(mesh_cases.TRAININGS))
def test_training_steps_equal_one_device(ranks, name):
    i = list(mesh_cases.TRAININGS).index(name)
    got = [r["trainings"][i] for r in ranks]
    assert training_problems(mesh_cases.TRAININGS[name], got) == []
