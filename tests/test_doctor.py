"""``python -m xla_permute doctor``: environment, caveats and the self-test table (the table
itself runs in tests/test_selftest.py; here its rows are stubbed, no mesh is launched)."""

from xla_permute import MeshError
from xla_permute_tools import selftest
from xla_permute_tools.__main__ import main


def test_doctor_reports_environment_caveats_and_the_self_test(monkeypatch, capsys):
    rows = [selftest.Row(c.name, c.backend, True, "ok", 0.1) for c in selftest.CHECKS]
    monkeypatch.setattr(selftest, "run_checks", lambda n: rows)
    assert main(["doctor", "-n", "2"]) == 0
    out = capsys.readouterr().out
    assert "== environment" in out and "torch_xla:" in out
    assert "cpu-thread-pool" in out and "pin-layout" in out  # the caveats for CPU
    assert "self-test: 2-device CPU mesh" in out
    assert all(c.name in out for c in selftest.CHECKS)
    assert f"{len(rows)} of {len(rows)} checks ok" in out


def test_doctor_shows_another_device_types_caveats_without_a_mesh(capsys):
    assert main(["doctor", "--device-type", "NEURON", "--no-self-test"]) == 0
    out = capsys.readouterr().out
    assert "caveats for NEURON" in out and "neuron-complete-rings" in out
    assert "self-test" not in out


def test_doctor_exits_non_zero_on_a_failed_check_or_a_dead_mesh(monkeypatch, capsys):
    bad = selftest.Row("permute ring", "emulated", False, "rank 1: forward differs", 0.1)
    monkeypatch.setattr(selftest, "run_checks", lambda n: [bad])
    assert main(["doctor"]) == 1
    assert "0 of 1 checks ok" in capsys.readouterr().out

    def broken(n):
        raise MeshError("the device process died")

    monkeypatch.setattr(selftest, "run_checks", broken)
    assert main(["doctor"]) == 1
    assert "self-test could not run: MeshError" in capsys.readouterr().out


def test_doctor_lists_caveats_in_one_line_each_and_their_text_on_request(capsys):
    assert main(["doctor", "--device-type", "CPU", "--no-self-test"]) == 0
    short = capsys.readouterr().out
    assert "[error] cpu-thread-pool: the CPU mesh hangs" in short
    assert "what goes wrong" not in short and "doctor --details" in short
    assert main(["doctor", "--device-type", "CPU", "--no-self-test", "--details"]) == 0
    assert "  what goes wrong: XLA:CPU runs the devices'" in capsys.readouterr().out


def test_doctor_reports_spmd_mode(monkeypatch, capsys):
    monkeypatch.delenv("XLA_USE_SPMD", raising=False)
    assert main(["doctor", "--no-self-test"]) == 0
    assert "SPMD mode:         off" in capsys.readouterr().out
    monkeypatch.setenv("XLA_USE_SPMD", "1")
    assert main(["doctor", "--no-self-test"]) == 0
    out = capsys.readouterr().out
    assert "SPMD mode:         on (xr.use_spmd())" in out
    assert "every collective of xla_permute refuses to run in it" in out
