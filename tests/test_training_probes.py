"""132 probes in one mesh launch, each a collective, an in-place update and a sync (issue 17).

Every probe updates a state tensor ``w`` in place from a collective of its old value and ends
with ``torch_xla.sync()``, as a training loop does: ``w.copy_((y @ M + k) % 13)`` with ``y`` a
ring permute (+1 or -1), an all-gather or a reduce-scatter of ``w``. These are the ingredients
of the deadlock of tutorial 14 ("Training loops on a mesh of threads"): the collective token
holds ``w``'s old buffer, the update donates it to the step's program when parameter aliasing
is on, the 16 x 16 matmul makes the program large enough for XLA:CPU to run it asynchronously,
and the ranks reach their sync at different times (ranks 1..3 sleep 20 ms before it; rank 0
runs a 10 ms step closure, between dispatching its step and resetting the token). With
``XLA_ENABLE_PARAM_ALIASING=1`` this launch deadlocks in its first skewed probe and XLA:CPU
aborts the mesh; with the defaults (``run_on_mesh`` turns aliasing off) all probes pass and
equal the same updates done in plain torch, exactly (small integers).
"""

from __future__ import annotations

import time

import torch

from xla_permute import run_on_mesh

N, SIZE, PROBES = 4, 16, 132
KINDS = ("permute +1", "permute -1", "all_gather", "reduce_scatter")


def _start() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each rank's initial ``w`` (integers 0..12) and the 0/1 matrix ``M``."""
    base = torch.arange(SIZE * SIZE, dtype=torch.float32).reshape(SIZE, SIZE)
    ws = [(base * (r + 1)) % 13 for r in range(N)]
    m = ((base % 3) == 0).to(torch.float32)
    return ws, m


def _collective(kind: str, w: torch.Tensor) -> torch.Tensor:
    """This rank's ``y`` for ``kind``: ``[SIZE, SIZE] -> [SIZE, SIZE]``."""
    import xla_permute as xp

    n = N
    if kind == "permute +1":
        return xp.collective_permute(w, xp.ring_pairs(n))
    if kind == "permute -1":
        return xp.collective_permute(w, xp.ring_pairs(n, -1))
    if kind == "all_gather":
        return xp.all_gather(w, 0).reshape(n, SIZE, SIZE).sum(0)
    return xp.reduce_scatter(w, 0).repeat(n, 1)


def _reference(kind: str, ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's ``y`` for ``kind``, in plain torch."""
    if kind == "permute +1":
        return [ws[(r - 1) % N] for r in range(N)]
    if kind == "permute -1":
        return [ws[(r + 1) % N] for r in range(N)]
    total = sum(ws)
    if kind == "all_gather":
        return [total] * N
    block = SIZE // N
    return [total[r * block : (r + 1) * block].repeat(N, 1) for r in range(N)]


def probe_loop(ws: list[torch.Tensor], m: torch.Tensor) -> torch.Tensor:
    """Run the probes on this rank; return ``w.sum()`` after each, ``[PROBES]``."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    device, rank = torch_xla.device(), xr.global_ordinal()
    w, m = ws[rank].to(device), m.to(device)
    sums = []
    for i in range(PROBES):
        y = _collective(KINDS[i % len(KINDS)], w)
        w.copy_(torch.remainder(y @ m + i % 5, 13))  # in place: w's buffer is the donor
        sums.append(w.sum())
        if rank == 0:  # between dispatching the step and resetting the collective token
            xm.add_step_closure(time.sleep, args=(0.01,))
        else:
            time.sleep(0.02)  # ranks 1..3 reach their sync later
        torch_xla.sync()
    return torch.stack(sums).cpu()


def test_probes_with_a_sync_after_each_pass_and_equal_plain_torch():
    ws, m = _start()
    per_rank = run_on_mesh(probe_loop, ws, m, n=N, timeout=120)
    expected = [[] for _ in range(N)]
    for i in range(PROBES):
        ys = _reference(KINDS[i % len(KINDS)], ws)
        ws = [torch.remainder(y @ m + i % 5, 13) for y in ys]
        for r in range(N):
            expected[r].append(ws[r].sum())
    for r in range(N):
        assert per_rank[r].shape == (PROBES,)
        assert torch.equal(per_rank[r], torch.stack(expected[r])), f"rank {r}"
