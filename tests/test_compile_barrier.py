"""The CPU mesh's compile barrier and torch.compile inside a rank (xla_permute.cpu_mesh.barrier).

XLA:CPU aborts a collective whose ranks arrive more than 15 s apart. A rank that reaches its
sync 20 s after the others (the deterministic stand-in for a slow compile on a loaded machine)
aborts the mesh with the barrier off and not with it on (the default); torch.compile of local
math before and after a collective equals eager, forward and backward; the barrier's meetings
and the diagnosis of a rank left behind are checked without a launch.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import xla_permute as xp
from xla_permute.cpu_mesh import launch
from xla_permute.cpu_mesh import status as mesh_status
from xla_permute.cpu_mesh.barrier import BARRIER_ENV, WAIT_S, Rendezvous

N = 4
LATE_S = 20.0


def _late_rank() -> list[float]:
    """Rank 1 sleeps 20 s between issuing a permute and its sync; then an all-gather."""
    import torch_xla
    import torch_xla.runtime as xr

    dev, r, n = torch_xla.device(), xr.global_ordinal(), xr.world_size()
    y = xp.collective_permute(torch.full((2,), float(r), device=dev), xp.ring_pairs(n))
    if r == 1:
        time.sleep(LATE_S)
    torch_xla.sync()
    z = xp.all_gather(y * 10, dim=0)
    torch_xla.sync()
    return z.cpu().tolist()


def test_a_rank_20_s_late_to_its_sync_runs_with_the_barrier():
    results = xp.run_on_mesh(_late_rank, n=N)
    # rank j receives rank j-1's value (ring_pairs sends r -> r+1)
    want = [10.0 * ((j - 1) % N) for j in range(N) for _ in range(2)]
    assert results == [want] * N


def test_a_rank_20_s_late_to_its_sync_aborts_without_the_barrier():
    with pytest.raises(xp.MeshError, match="SIGABRT") as raised:
        xp.run_on_mesh(_late_rank, n=N, env={BARRIER_ENV: "0"})
    assert "Diagnosis: XLA:CPU aborted" in str(raised.value)


def _compiled_norm_program(compile_it: bool):
    """The user's program as a notebook cell writes it (sent by value: each rank its own copy
    of the functions): an RMSNorm module and an MLP function, eager or compiled, before and
    after an all-gather, trained for three AdamW steps; the gradients flow through the
    compiled graphs' backward into the all-gather's. The ranks reach their compiles at
    different times (rank r waits 0.05 r s per step), so one rank's compile meets another's
    compiled call or backward."""

    def mlp(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x @ a) @ b

    def program() -> list[torch.Tensor]:
        import torch_xla
        import torch_xla.runtime as xr

        dev, r = torch_xla.device(), xr.global_ordinal()
        norm = torch.nn.RMSNorm(8, eps=1e-6).to(dev)
        x = (torch.arange(32.0).reshape(4, 8) / 8 - r).to(dev).requires_grad_()
        a = (torch.eye(8) + 0.1).to(dev).requires_grad_()
        b = (torch.eye(8) - 0.05).to(dev).requires_grad_()
        params = [x, a, b, *norm.parameters()]
        opt = torch.optim.AdamW(params, lr=0.01)
        if compile_it:
            norm, mlp_ = (
                torch.compile(norm, backend="openxla"),
                torch.compile(mlp, backend="openxla"),
            )
        else:
            mlp_ = mlp
        losses = []
        for _ in range(3):
            time.sleep(0.05 * r)
            y = norm(xp.all_gather(mlp_(norm(x), a, b), dim=0))
            loss = mlp_(y, a, b).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
            losses.append(loss.detach().cpu())
        return [torch.stack(losses), *(p.detach().cpu() for p in params)]

    return program


def test_torch_compile_of_local_math_around_a_collective_equals_eager():
    eager = xp.run_on_mesh(_compiled_norm_program(False), n=N)
    compiled = xp.run_on_mesh(_compiled_norm_program(True), n=N)
    for rank_eager, rank_compiled in zip(eager, compiled, strict=True):
        for e, c in zip(rank_eager, rank_compiled, strict=True):
            torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)
    assert not torch.equal(eager[0][1], eager[1][1])  # the ranks trained different x


def _shared_norm(compile_it: bool) -> torch.Tensor:
    """The norm imported from a module (the rank threads share its code) around a gather."""
    import torch_xla
    import torch_xla.runtime as xr

    x = (torch.arange(32.0).reshape(4, 8) / 8 + xr.global_ordinal()).to(torch_xla.device())
    norm = torch.compile(_shared_rms, backend="openxla") if compile_it else _shared_rms
    return norm(xp.all_gather(norm(x), dim=0)).cpu()


def _shared_rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_torch_compile_of_a_function_the_ranks_share_equals_eager():
    eager = xp.run_on_mesh(_shared_norm, False, n=N)
    for e, c in zip(eager, xp.run_on_mesh(_shared_norm, True, n=N), strict=True):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-5)


def test_the_ranks_meet_by_key_and_a_late_one_is_left_behind():
    meet, met, order = Rendezvous(3), {}, []

    def rank(r: int, key: int, delay: float, timeout: float) -> None:
        time.sleep(delay)
        met[(r, key)] = meet.wait(key, r, timeout, last=lambda: order.append(key))

    threads = [threading.Thread(target=rank, args=(r, 0, 0.1 * r, 5.0)) for r in range(3)]
    threads += [threading.Thread(target=rank, args=(r, 1, 0.0, 0.5)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == [0]  # the last to arrive at meeting 0 called last(); meeting 1 never filled
    assert [met[(r, 0)] for r in range(3)] == [[], [], []]
    assert [met[(r, 1)] for r in range(2)] == [[2], [2]]
    late = meet.wait(1, 2, 5.0)  # meeting 1 was broken: the late rank goes on at once
    assert late == []


def test_the_diagnosis_names_compiles_barrier_and_a_rank_left_behind(tmp_path):
    key = (
        "all gather RendezvousKey{run_id=RunId: 0, global_devices=[0,1,2,3], "
        "num_local_participants=4, collective_op_kind=cross_module, op_id=1}"
    )
    err = "".join(
        f"E rendezvous.cc:100] [id={r}] This thread has been waiting for `{key}` for 5 seconds "
        f"and may be stuck.\n"
        for r in (0, 1, 2)
    ) + (
        f"F rendezvous.cc:127] [id=0] Termination timeout for `{key}` of 10 seconds exceeded. "
        f"Expected 4 threads to join the rendezvous, but only 3 of them arrived on time.\n"
    )
    mesh_status.start(tmp_path)
    try:
        for r in range(N):
            mesh_status.set_rank(r)
            mesh_status.enter("compile" if r == 3 else "sync", compile_s=10.0 + r)
            if r == 0:
                mesh_status.enter("sync", compile_s=10.0, alone=[3])
        time.sleep(0.05)
        text = launch._diagnose(err, str(tmp_path), N)
    finally:
        mesh_status.start(None)
    assert "ranks 0, 1, 2 waited for rank 3. Rank 3 was compiling its step" in text, text
    assert "(0: 10.0 s; 1: 11.0 s; 2: 12.0 s; 3: 13.0 s)" in text, text
    assert (
        f"Rank 0 ran its step without rank 3, which had not reached the compile barrier "
        f"after {WAIT_S:g} s" in text
    ), text


def test_a_torch_xla_without_the_calls_the_barrier_needs_is_named_at_start(monkeypatch):
    import torch_xla

    from xla_permute.cpu_mesh import barrier

    monkeypatch.delattr(torch_xla._XLAC, "_run_cached_graph")
    with pytest.raises(RuntimeError, match=f"lacks; run with {BARRIER_ENV}=0") as raised:
        barrier.install(N)
    assert "_run_cached_graph" in str(raised.value)
