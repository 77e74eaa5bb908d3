"""The workshop's warm starter for run_on_mesh (xla_permute_tools.warm): a fork of its zygote
must be the device process a fresh interpreter would be, with the launch's environment,
directory and output, and a process of its own each time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import xla_permute as xp
from xla_permute_tools import warm

WARM = "xla_permute_tools.warm:start_process"


@pytest.fixture(autouse=True)
def warm_launches(monkeypatch):
    """Every launch here starts from the warm process (the root conftest sets it too)."""
    monkeypatch.setenv("XLA_PERMUTE_LAUNCHER", WARM)


def what_the_device_process_sees(names):
    import random

    import torch_xla
    import torch_xla.runtime as xr

    x = torch.arange(4.0).to(torch_xla.device()) * (xr.global_ordinal() + 1)
    return {
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "env": {k: os.environ.get(k) for k in names},
        "random": random.random(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "x": x.cpu(),
        "world": xr.world_size(),
    }


def test_a_fork_takes_the_launch_environment_and_directory(tmp_path, monkeypatch):
    names = ["XLA_PERMUTE_DEBUG", "DISABLE_NUMERIC_CC_TOKEN", "CPU_NUM_DEVICES"]
    monkeypatch.delenv("DISABLE_NUMERIC_CC_TOKEN", raising=False)
    here = os.getcwd()
    first = xp.run_on_mesh(what_the_device_process_sees, names, n=2)
    monkeypatch.chdir(tmp_path)
    env = {"XLA_PERMUTE_DEBUG": "0", "DISABLE_NUMERIC_CC_TOKEN": "1"}
    second = xp.run_on_mesh(what_the_device_process_sees, names, n=4, env=env)
    assert [r["world"] for r in first] == [2, 2] and [r["world"] for r in second] == [4] * 4
    for ranks in (first, second):
        assert len({r["pid"] for r in ranks}) == 1  # the ranks are threads of one process
        assert ranks[0]["pid"] == ranks[0]["sid"]  # ... which leads a session of its own
        for rank, r in enumerate(ranks):
            assert torch.equal(r["x"], torch.arange(4.0) * (rank + 1))
    assert len({first[0]["pid"], second[0]["pid"], os.getpid()}) == 3
    want = {"XLA_PERMUTE_DEBUG": "1", "DISABLE_NUMERIC_CC_TOKEN": None, "CPU_NUM_DEVICES": "2"}
    assert first[0]["env"] == want
    assert second[0]["env"] == {**env, "CPU_NUM_DEVICES": "4"}
    assert (first[0]["cwd"], second[0]["cwd"]) == (here, str(tmp_path))
    # torch_xla adds its default to XLA_FLAGS when imported: the fork imported it
    assert "xla_cpu_enable_fast_math=false" in second[0]["xla_flags"]
    assert first[0]["random"] != second[0]["random"]  # reseeded, as a new process would be


def test_a_variable_read_at_import_gets_a_new_zygote():
    xp.run_on_mesh(what_the_device_process_sees, [], n=2)
    before = warm._zygote
    env = {"XLA_PERMUTE_TEST_VARIABLE": "1"}  # not a launch variable: torch might read it
    out = xp.run_on_mesh(what_the_device_process_sees, list(env), n=2, env=env)
    assert out[0]["env"] == env
    assert before is not None and warm._zygote is not before
    assert ("XLA_PERMUTE_TEST_VARIABLE", "1") in warm._zygote.key


IMPORT_TORCH_XLA = """
import json, os
before = dict(os.environ)
import torch_xla
changed = {k for k in os.environ.keys() | before.keys() if os.environ.get(k) != before.get(k)}
print(json.dumps(sorted(changed)))
"""


def test_importing_torch_xla_changes_only_launch_variables(tmp_path, monkeypatch):
    """A process that launches, imports torch_xla, and launches again uses one zygote: what
    the import sets is launch variables only (seen in a fork that imports it)."""
    (tmp_path / "import_torch_xla.py").write_text(IMPORT_TORCH_XLA)
    monkeypatch.chdir(tmp_path)  # python -m finds the module in the working directory
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    for name in ("GRPC_VERBOSITY", "PJRT_DYNAMIC_PLUGINS"):  # set if torch_xla is imported here
        env.pop(name, None)
    with warm.start_process([sys.executable, "-m", "import_torch_xla"], env) as proc:
        assert isinstance(proc, warm.ForkedProcess)
        changed = json.loads(proc.stdout.read())
    assert "GRPC_VERBOSITY" in changed  # the import sets variables ...
    assert set(changed) <= warm.LAUNCH_VARIABLES  # ... none of which needs a new zygote


def test_results_and_errors_are_the_same_without_the_warm_starter(monkeypatch):
    def rank_gather():
        import torch_xla
        import torch_xla.runtime as xr

        x = torch.full((3,), float(xr.global_ordinal())).to(torch_xla.device())
        if xr.global_ordinal() == 1:
            raise ValueError("rank 1 says no")
        return xp.all_gather(x, 0).cpu()

    started = []
    start = warm.start_process
    monkeypatch.setattr(warm, "start_process", lambda *a: started.append(start(*a)) or
                        started[-1])  # fmt: skip
    outcomes = []
    for value in (WARM, ""):  # the warm starter, then the library's own (Popen)
        monkeypatch.setenv("XLA_PERMUTE_LAUNCHER", value)
        with pytest.raises(xp.RankError, match="rank 1 of 2 raised ValueError: rank 1 says no"):
            xp.run_on_mesh(rank_gather, n=2)
        outcomes.append(xp.run_on_mesh(what_the_device_process_sees, [], n=2))
    assert [type(p) for p in started] == [warm.ForkedProcess] * 2
    for a, b in zip(*outcomes, strict=True):
        assert torch.equal(a["x"], b["x"]) and a["world"] == b["world"]
    # What is not python -m starts a fresh interpreter.
    with start([sys.executable, "-c", "import os"], dict(os.environ)) as proc:
        assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0


@pytest.mark.skipif(sys.platform != "linux", reason="the abort is XLA:CPU's, on Linux")
def test_a_fork_killed_by_a_signal_is_reported_as_such():
    def abort():
        os.abort()

    with pytest.raises(xp.MeshError, match="was killed by SIGABRT"):
        xp.run_on_mesh(abort, n=2)


def test_launches_from_two_threads_at_once():
    """One launch forks the zygote; the other, finding it busy, starts a new interpreter."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda n: xp.run_on_mesh(what_the_device_process_sees, [], n=n),
                             (2, 3)))  # fmt: skip
    assert [len(ranks) for ranks in runs] == [2, 3]
    for ranks in runs:
        for rank, r in enumerate(ranks):
            assert torch.equal(r["x"], torch.arange(4.0) * (rank + 1))
    assert runs[0][0]["pid"] != runs[1][0]["pid"]
