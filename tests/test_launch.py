"""run_on_mesh: results, rank functions by reference and by value, and every failure mode."""

import collections
import dataclasses
import functools
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import rank_fns
import torch

from xla_permute import MeshError, RankError, run_on_mesh
from xla_permute.cpu_mesh import mesh_environment


def _launch_mismatched() -> tuple[BaseException | None, float]:
    start = time.monotonic()
    try:
        run_on_mesh(rank_fns.rank_zero_skips_collective, n=4, timeout=120,
                    env={"XLA_PERMUTE_LAUNCHER": ""})  # fmt: skip
    except BaseException as e:  # the test asserts what it is
        return e, time.monotonic() - start
    return None, time.monotonic() - start


@pytest.fixture(scope="module", autouse=True)
def mismatched_launch(request):
    """The launch of test_mismatched_collective_is_a_clear_bounded_error, started with the
    module: its device process waits about 15 s for XLA's rendezvous to give up, idle, while
    the other tests run (started plainly: the warm process, if any, stays theirs)."""
    name = "test_mismatched_collective_is_a_clear_bounded_error"
    if not any(item.name == name for item in request.session.items):
        yield None
        return
    with ThreadPoolExecutor(1) as pool:
        yield pool.submit(_launch_mismatched)


def test_results_come_back_in_rank_order_and_on_cpu():
    assert run_on_mesh(rank_fns.rank_times, 3, n=4) == [0, 3, 6, 9]


Pair = collections.namedtuple("Pair", "tensor rank")


@dataclasses.dataclass
class Box:
    tensor: torch.Tensor
    nested: dict


def _containers():
    import torch_xla
    import torch_xla.runtime as xr

    r = xr.global_ordinal()
    t = torch.full((2,), float(r), device=torch_xla.device()) * 2
    return {"plain": t, "list": [r, (r,)], "pair": Pair(t, r), "box": Box(t, {"k": [t]})}


def test_xla_tensors_in_any_container_come_back_on_cpu():
    for r, out in enumerate(run_on_mesh(_containers, n=2)):
        want = torch.full((2,), 2.0 * r)
        assert out["list"] == [r, (r,)]
        assert isinstance(out["pair"], Pair) and out["pair"].rank == r
        assert isinstance(out["box"], Box)
        for t in (out["plain"], out["pair"].tensor, out["box"].tensor, out["box"].nested["k"][0]):
            assert t.device.type == "cpu" and torch.equal(t, want)


def test_single_device_mesh():
    assert run_on_mesh(rank_fns.rank_times, 5, n=1) == [0]


# --- rank functions by value -----------------------------------------------------------------

SCALE = 10  # a global of this module, used by the functions below


def test_closure_lambda_partial_and_main_functions_travel_by_value():
    offset = 7

    def closure():
        import torch_xla.runtime as xr

        return SCALE * xr.global_ordinal() + offset

    def in_main():
        import torch_xla.runtime as xr

        return -xr.global_ordinal()

    in_main.__module__ = "__main__"  # as if defined in a script or a notebook kernel
    in_main.__qualname__ = "in_main"

    def run_all(fns):
        return [f() for f in fns]

    fns = [closure, in_main, lambda: offset, functools.partial(rank_fns.rank_times, 2)]
    assert run_on_mesh(run_all, fns, n=2) == [[7, 0, 7, 0], [17, -1, 7, 2]]
    assert run_on_mesh(lambda k: k + 1, 1, n=1) == [2]


def test_script_whose_rank_function_lives_in_main(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import xla_permute as xp

            N = 2

            def shift(xs):
                import torch_xla
                import torch_xla.runtime as xr

                x = xs[xr.global_ordinal()].to(torch_xla.device())
                return xp.collective_permute(x, xp.ring_pairs(N))

            if __name__ == "__main__":
                xs = torch.arange(4.0).reshape(N, 2)
                print([y.tolist() for y in xp.run_on_mesh(shift, xs, n=N)])
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[[2.0, 3.0], [0.0, 1.0]]", out.stdout + out.stderr


LOCK = threading.Lock()


def test_global_that_cannot_be_sent_is_named():
    def uses_lock():  # a closure goes by value, with the globals it uses
        with LOCK:
            return 1

    with pytest.raises(TypeError, match=r"uses 'LOCK' \(lock\).*create it inside the function"):
        run_on_mesh(uses_lock)


def test_argument_that_cannot_be_sent_is_named():
    with pytest.raises(TypeError, match=r"args\[1\] \(lock\) cannot be sent"):
        run_on_mesh(rank_fns.rank_times, 1, threading.Lock())


def test_xla_tensor_global_is_named_with_the_fix():
    code = textwrap.dedent(
        """
        import os
        os.environ["PJRT_DEVICE"] = "CPU"
        import torch, torch_xla
        import xla_permute as xp
        t = torch.zeros(2, device=torch_xla.device())
        def uses_t():
            return t + 1
        try:
            xp.run_on_mesh(uses_t, n=2)
        except TypeError as e:
            print("TypeError:", e)
        try:
            xp.run_on_mesh(lambda: 1, n=2)
        except xp.MeshError as e:
            print("MeshError:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "TypeError: fn uses_t uses 't' (Tensor)" in out.stdout, out.stdout + out.stderr
    assert "pass a CPU copy (t.cpu()) as an argument" in out.stdout
    assert "MeshError: The XLA runtime is already initialised in this process" in out.stdout


def _unpicklable_result():
    return threading.Lock()


def test_result_that_cannot_be_sent_back_names_the_rank():
    with pytest.raises(RankError, match="rank 0 of 1 raised TypeError: the result of rank 0"):
        run_on_mesh(_unpicklable_result, n=1)


# --- argument checks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": 0}, ValueError, "n must be an int >= 1, got 0; the number of devices"),
        ({"n": -2}, ValueError, "n must be an int >= 1"),
        ({"n": 2.0}, TypeError, "n must be an int"),
        ({"n": True}, TypeError, "n must be an int"),
        ({"timeout": -1}, ValueError, "timeout must be > 0"),
        ({"timeout": "30"}, TypeError, "timeout must be a number"),
        ({"env": ["A=1"]}, TypeError, "env must be a dict"),
        ({"env": {"FOO": 1}}, TypeError, "names and values must be str"),
        ({"env": {"CPU_NUM_DEVICES": "2"}}, ValueError, "CPU_NUM_DEVICES='4'"),
        ({"env": {"PJRT_DEVICE": "TPU"}}, ValueError, "PJRT_DEVICE='CPU'"),
        ({"env": {"XLA_THREAD_POOL_SIZE": "2"}}, ValueError, "below the 4 devices"),
    ],
)
def test_bad_arguments_raise_before_launch(kwargs, error, match):
    with pytest.raises(error, match=match):
        run_on_mesh(rank_fns.rank_times, 1, **kwargs)


def test_not_callable():
    with pytest.raises(TypeError, match="fn must be a callable"):
        run_on_mesh(3)


def test_environment_sets_thread_pool_at_least_n():
    env = mesh_environment(8, env={"XLA_THREAD_POOL_SIZE": "16", "CPU_NUM_DEVICES": "8"})
    assert env["CPU_NUM_DEVICES"] == "8" and int(env["XLA_THREAD_POOL_SIZE"]) >= 8


# --- failures on the mesh --------------------------------------------------------------------


def test_rank_error_names_rank_and_keeps_original():
    with pytest.raises(
        RankError, match="rank 2 of 4 raised ValueError: bad value on rank two"
    ) as e:
        run_on_mesh(rank_fns.rank_two_raises, n=4)
    assert e.value.rank == 2
    assert isinstance(e.value.__cause__, ValueError)


def test_rank_traceback_names_the_users_file(tmp_path):
    # a script's function travels by value; its traceback names the script, not cloudpickle's
    # "<dynamic-code>"
    script = tmp_path / "train.py"
    script.write_text("def step():\n    raise ValueError('from the script')\n")
    namespace = {"__name__": "__main__"}
    exec(compile(script.read_text(), str(script), "exec"), namespace)
    with pytest.raises(RankError, match="from the script") as e:
        run_on_mesh(namespace["step"], n=2)
    assert f'File "{script}", line 2, in step' in str(e.value)
    assert "raise ValueError('from the script')" in str(e.value)


def test_mismatched_collective_is_a_clear_bounded_error(mismatched_launch):
    error, seconds = mismatched_launch.result()
    assert isinstance(error, MeshError), error
    assert "mismatched collectives" in str(error)
    assert "SIGABRT" in str(error) and "rendezvous" in str(error)
    assert seconds < 120


def test_abort_message_names_the_usual_causes_and_their_fixes():
    from xla_permute.cpu_mesh.launch import _MISMATCH_HINT

    assert "XLA_PERMUTE_DEBUG=1" in _MISMATCH_HINT
    assert "xm.wait_device_ops(xm.xla_real_devices([torch_xla.device()]))" in _MISMATCH_HINT
    assert "more than 15 s apart" in _MISMATCH_HINT  # XLA:CPU's rendezvous limit
    assert "compiling its program much later" in _MISMATCH_HINT
    assert "XLA_ENABLE_PARAM_ALIASING=0" in _MISMATCH_HINT


def test_hang_is_killed_at_timeout():
    with pytest.raises(MeshError, match="did not finish within 3 s"):
        run_on_mesh(rank_fns.sleep_forever, n=2, timeout=3)


def test_mesh_error_names_the_collective_the_missing_rank_and_where_it_was(tmp_path):
    """The diagnosis of an abort: XLA's rendezvous lines and the ranks' status lines."""
    import time

    from xla_permute.cpu_mesh import launch
    from xla_permute.cpu_mesh import status as mesh_status

    key = ("all gather RendezvousKey{run_id=RunId: 0, global_devices=[0,1,2,3], "
           "num_local_participants=4, collective_op_kind=cross_module, op_id=3}")  # fmt: skip
    err = "".join(
        f"E rendezvous.cc:100] [id={r}] This thread has been waiting for `{key}` for 5 seconds "
        f"and may be stuck. Expected 4 threads to join the rendezvous, but not all of them "
        f"arrived on time.\n"
        for r in (0, 1, 3)
    ) + (
        f"F rendezvous.cc:127] [id=0] Termination timeout for `{key}` of 10 seconds exceeded. "
        f"Exiting to ensure a consistent program state. Expected 4 threads to join the "
        f"rendezvous, but only 3 of them arrived on time.\n"
    )
    mesh_status.start(tmp_path)
    for r in range(4):
        mesh_status.set_rank(r)
        mesh_status.note_op("all_gather_matmul")
        mesh_status.enter("sync")
        if r != 2:
            mesh_status.leave_sync(0.0)
    time.sleep(0.05)
    text = launch._diagnose(err, str(tmp_path), 4)
    mesh_status.start(None)  # back to doing nothing in this process
    assert text.startswith(
        "Diagnosis: XLA:CPU aborted an all gather (channel id 3) that 3 of 4 participants "
        "reached in time: ranks 0, 1, 3 waited for rank 2. Rank 2 was inside torch_xla.sync(), "
        "compiling its program for "
    ), text
    assert "(its last op of this package: all_gather_matmul, call 1)" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert launch._diagnose("no abort here", str(empty), 4) == ""  # nothing to say


def test_relay_keeps_xla_rendezvous_progress_lines_for_the_diagnosis_only(capfd):
    """XLA's "may be stuck" / "unstuck" lines of a slow rendezvous reach the tail (which a
    MeshError's diagnosis reads), not the caller's stderr; every other line reaches both."""
    from xla_permute.cpu_mesh import rank_output

    lines = [
        "E rendezvous.cc:100] [id=0] This thread has been waiting for `all gather` for 5 "
        "seconds and may be stuck.",
        "E rendezvous.cc:110] Thread is unstuck! Warning above was a false-alarm.",
        "[rank 1] a user's warning",
    ]
    script = f"import sys\nfor line in {lines!r}:\n    print(line, file=sys.stderr)\n"
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    with proc, proc.stdout, proc.stderr:
        finished, tail = rank_output.relay(proc, timeout=60)
    shown = capfd.readouterr().err
    assert finished and tail.splitlines() == lines
    assert shown.splitlines() == [lines[2]]


# --- the device process and its starter ------------------------------------------------------

STARTED: list[list[str]] = []


def record_start(command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """A starter for XLA_PERMUTE_LAUNCHER: records the command, then starts it as Popen."""
    STARTED.append(command)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip


def test_the_launcher_variable_names_the_starter():
    STARTED.clear()
    env = {"XLA_PERMUTE_LAUNCHER": f"{__name__}:record_start"}
    assert run_on_mesh(rank_fns.rank_times, 2, n=2, env=env) == [0, 2]
    assert [c[:3] for c in STARTED] == [[sys.executable, "-m", "xla_permute.cpu_mesh.device"]]
    assert run_on_mesh(rank_fns.rank_times, 2, n=2, env={"XLA_PERMUTE_LAUNCHER": ""}) == [0, 2]
    assert len(STARTED) == 1  # unset: the plain start


def _last_op_recorded():
    """In the device process: what the rank's status line says after an op of the package."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp
    from xla_permute.cpu_mesh import status

    x = torch.ones(2, device=torch_xla.device())
    xp.collective_permute(x, xp.ring_pairs(xr.world_size()))
    xp.all_gather(x, 0)
    line = status.read(status._directory)[xr.global_ordinal()]
    return line["last_op"], line["calls"]


def test_every_op_reports_to_the_rank_status():
    """The device process registers the status with the debug checks' hook (debug.on_op): the
    diagnosis of an abort names the last op each rank called."""
    assert run_on_mesh(_last_op_recorded, n=2) == [("all_gather", 2)] * 2
