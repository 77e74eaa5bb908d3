import functools
import subprocess
import sys
import textwrap
import time

import pytest
import rank_fns
import torch

from xla_permute import MeshError, RankError, run_on_mesh
from xla_permute.launch import mesh_environment


def test_results_come_back_in_rank_order_and_on_cpu():
    assert run_on_mesh(rank_fns.rank_times, 3, n=4) == [0, 3, 6, 9]
    results = run_on_mesh(rank_fns.xla_tensor_of_rank, n=2)
    for r, out in enumerate(results):
        assert out["t"].device.type == "cpu"
        assert torch.equal(out["t"], torch.full((2,), 2.0 * r))
        assert out["r"] == [r, (r,)]


def test_single_device_mesh():
    assert run_on_mesh(rank_fns.rank_times, 5, n=1) == [0]


@pytest.mark.parametrize("n", [0, -2])
def test_n_below_one(n):
    with pytest.raises(ValueError, match="n must be >= 1"):
        run_on_mesh(rank_fns.rank_times, 1, n=n)


def test_n_not_an_int():
    with pytest.raises(TypeError, match="n must be an int"):
        run_on_mesh(rank_fns.rank_times, 1, n=2.0)


def test_environment_sets_thread_pool_at_least_n():
    env = mesh_environment(8, env=None)
    assert env["CPU_NUM_DEVICES"] == "8" and int(env["XLA_THREAD_POOL_SIZE"]) >= 8


def _in_main():
    return 1


_in_main.__module__ = "__main__"  # as if defined in a script or a notebook kernel


@pytest.mark.parametrize(
    "fn",
    [lambda: 1, functools.partial(rank_fns.rank_times, 1), _in_main],
    ids=["lambda", "partial", "main"],
)
def test_function_that_cannot_be_imported(fn):
    with pytest.raises(TypeError, match="cannot be imported"):
        run_on_mesh(fn)


def test_closure_cannot_be_imported():
    def inner():
        return 1

    with pytest.raises(TypeError, match="notebook cell.*Define the function at the top level"):
        run_on_mesh(inner)


def test_rank_error_names_rank_and_keeps_original():
    with pytest.raises(
        RankError, match="rank 2 of 4 raised ValueError: bad value on rank two"
    ) as e:
        run_on_mesh(rank_fns.rank_two_raises, n=4)
    assert e.value.rank == 2
    assert isinstance(e.value.__cause__, ValueError)


def test_mismatched_collective_is_a_clear_bounded_error():
    start = time.monotonic()
    with pytest.raises(MeshError, match="mismatched collectives") as e:
        run_on_mesh(rank_fns.rank_zero_skips_collective, n=4, timeout=120)
    assert "SIGABRT" in str(e.value) and "rendezvous" in str(e.value)
    assert time.monotonic() - start < 120


def test_hang_is_killed_at_timeout():
    with pytest.raises(MeshError, match="did not finish within 3 s"):
        run_on_mesh(rank_fns.sleep_forever, n=2, timeout=3)


def test_runtime_already_initialised_in_caller():
    code = textwrap.dedent(
        """
        import os
        os.environ["PJRT_DEVICE"] = "CPU"
        import torch, torch_xla
        torch.zeros(1, device=torch_xla.device()).cpu()
        from xla_permute import MeshError, run_on_mesh
        from xla_permute.examples import world_and_rank
        try:
            run_on_mesh(world_and_rank, n=2)
        except MeshError as e:
            print("MeshError:", e)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "MeshError: The XLA runtime is already initialised in this process" in out.stdout, (
        out.stdout + out.stderr
    )
