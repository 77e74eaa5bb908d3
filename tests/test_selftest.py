"""The self-test table of ``demo`` and ``doctor``: one real launch on 2 devices, the verifiers
against wrong results, and the command line's argument errors."""

import subprocess
import sys

import pytest
import torch

from xla_permute import reference
from xla_permute_tools import selftest
from xla_permute_tools.__main__ import main


def test_demo_runs_every_check_in_one_launch_and_all_pass(capsys):
    assert main(["demo", "-n", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("check "))
    rows = out[header + 2 : header + 2 + len(selftest.CHECKS)]
    for check, line in zip(selftest.CHECKS, rows, strict=True):
        assert line.startswith(check.name) and check.backend in line, line
        assert line.split(check.backend)[1].split()[0] == "ok", line
    assert f"{len(rows)} of {len(rows)} checks ok" in out[-1]


def test_checks_have_unique_names():
    names = [c.name for c in selftest.CHECKS]
    assert len(names) == len(set(names))


def test_table_has_a_row_per_check():
    rows = [
        selftest.Row("a", "emulated", True, "ok", 0.5),
        selftest.Row("bb", "native", False, "rank 1: x", 1.0),
    ]
    table = selftest.format_table(rows).splitlines()
    assert table[0].split() == ["check", "backend", "result", "time"]
    assert "500 ms" in table[2] and "rank 1: x" in table[3]


def test_an_error_on_a_rank_becomes_a_row(monkeypatch):
    check = selftest.Check("boom", "-", lambda: 1 // 0, lambda results: None)
    monkeypatch.setattr(selftest, "CHECKS", [check])
    ok, detail, seconds = selftest._run_on_rank(["boom"])["boom"]
    assert not ok and detail.startswith("ZeroDivisionError") and seconds >= 0


def test_verifiers_reject_wrong_results():
    n = 2
    gathered = list(reference.all_gather(selftest._ints(1, n, 2, 3), dim=0))
    selftest._verify_all_gather(gathered)
    gathered[1] = gathered[1] + 1
    with pytest.raises(AssertionError, match="rank 1"):
        selftest._verify_all_gather(gathered)

    xs = selftest._ints(2, n, 2, 3)
    swapped = [{k: (xs[r], xs[r]) for k in ("ring", "open chain")} for r in range(n)]
    with pytest.raises(AssertionError, match="rank 0: ring forward differs"):
        selftest._verify_permute(swapped)

    permute = "%cp = f32[2,3]{1,0} collective-permute(f32[2,3]{1,0} %p0), source_target_pairs="
    entry = "ENTRY %m (p0: f32[2,3]) -> f32[2,3] {\n  %p0 = f32[2,3]{1,0} parameter(0)\n  ROOT "
    ring = entry + permute + "{{0,1},{1,0}}\n}"
    selftest._verify_permute_hlo([ring, ring])
    with pytest.raises(AssertionError, match="rank 1: got"):
        selftest._verify_permute_hlo([ring, ring.replace("{{0,1},{1,0}}", "{{0,1}}")])
    # The collective-matmul verifier: a permute with no dot beside it fails.
    with pytest.raises(AssertionError, match="has no dot"):
        selftest._verify_matmul_hlo([[ring], [ring]])


def test_pipeline_verifier_compares_with_one_device():
    ws, h, targets = selftest._pipeline_data(2)
    with pytest.raises(AssertionError, match="loss differs"):
        selftest._verify_pipeline([(torch.tensor(0.0), h, ws[0]), (torch.tensor(1.0), h, ws[1])])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "-n", "0"], "argument -n: must be a number of CPU devices >= 1, got '0'"),
        (["doctor", "-n", "-3"], "argument -n: must be a number of CPU devices >= 1, got '-3'"),
        (["doctor", "--device-type", " "], "argument --device-type: device_type must name"),
    ],
)
def test_bad_arguments_are_one_line_on_stderr_and_exit_2(argv, message):
    out = subprocess.run(
        [sys.executable, "-m", "xla_permute", *argv], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
