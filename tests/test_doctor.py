"""``python -m xla_permute doctor``: one real run on a 2-device mesh, and its failure paths."""

import torch

from xla_permute import doctor
from xla_permute.__main__ import main
from xla_permute.launch import MeshError


def test_doctor_reports_environment_caveats_and_a_passing_self_test(capsys):
    assert main(["doctor", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "== environment" in out and "torch_xla:" in out
    assert "cpu-thread-pool" in out and "pin-layout" in out  # the caveats for CPU
    assert "mesh: CPU x 2" in out
    rows = [line for line in out.splitlines() if "ok (exact)" in line]
    assert len(rows) == len(doctor.permute_checks(2)) + 2  # permutes + two collective matmuls
    assert f"{len(rows)} of {len(rows)} checks ok" in out


def test_doctor_shows_another_device_types_caveats_without_a_mesh(capsys):
    assert main(["doctor", "--device-type", "NEURON", "--no-self-test"]) == 0
    out = capsys.readouterr().out
    assert "caveats for NEURON" in out and "neuron-complete-rings" in out
    assert "self-test" not in out


def test_doctor_exits_non_zero_on_a_failed_check(monkeypatch, capsys):
    bad = doctor.Result("ring shift +1", "emulated", False, "differs on ranks [1]")
    env = doctor.hardware.detect()
    monkeypatch.setattr(doctor, "run_self_test", lambda n: ([bad], env))
    assert main(["doctor"]) == 1
    assert "0 of 1 checks ok" in capsys.readouterr().out

    def broken(n):
        raise MeshError("the device process died")

    monkeypatch.setattr(doctor, "run_self_test", broken)
    assert main(["doctor"]) == 1
    assert "self-test could not run: MeshError" in capsys.readouterr().out


def test_compare_finds_the_differing_ranks():
    want = torch.arange(12.0).reshape(3, 4)
    got = want.clone()
    got[2, 1] += 1
    assert doctor._compare("c", "b", want.clone(), want).ok
    result = doctor._compare("c", "b", got, want)
    assert not result.ok and "ranks [2]" in result.detail
    assert "shape" in doctor._compare("c", "b", want[:2], want).detail
