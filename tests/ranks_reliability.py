"""Rank functions for test_reliability.py: adversarial probes, many per mesh launch.

A probe is a name; :func:`run_probe` runs it on this rank and returns what happened:
``("ok", value)`` or ``(error type name, message)``. Every probe must leave the mesh usable
for the next one (no collective left waiting), so a probe that raises on one rank raises on
every rank, before (or instead of) its collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def _probe(name: str, rank: int, n: int, device: Any) -> Any:
    import torch_xla.core.xla_model as xm

    import xla_permute as xp

    ring = xp.ring_pairs(n)
    x = torch.arange(2.0).to(device) + 10 * rank
    # --- ranks that disagree (debug mode): every rank raises, naming the ranks ------------
    if name == "longer tensor on rank 1":
        x = torch.arange(3.0 if rank == 1 else 2.0).to(device)
        return xp.collective_permute(x, ring)
    if name == "float64 on rank 1":
        return xp.collective_permute(x.double() if rank == 1 else x, ring)
    if name == "ring -1 on rank 1":
        return xp.collective_permute(x, xp.ring_pairs(n, -1 if rank == 1 else 1))
    if name == "empty on rank 2 only":
        return xp.collective_permute(x[:0] if rank == 2 else x, ring)
    if name == "other groups on rank 3":
        groups = [[0, 1], [2, 3]] if rank == 3 else [[0, 2], [1, 3]]
        return xp.collective_permute(x, [(0, 1), (1, 0)], groups=groups)
    if name == "stage_shift offset -1 on rank 0":
        return xp.stage_shift(x, offset=-1 if rank == 0 else 1)
    if name == "all_gather_matmul 3 rows on rank 1":
        rows = torch.ones(3 if rank == 1 else 2, 4).to(device)
        return xp.all_gather_matmul(rows, torch.ones(4, 2).to(device), dim=0)
    if name == "pipeline 3 micro-batches on rank 1":
        inputs = torch.ones(3 if rank == 1 else 2, 2).to(device)
        return xp.pipeline_forward(lambda v: v + 1, inputs)
    if name == "pipeline_forward on rank 0, collective_permute elsewhere":
        if rank == 0:
            return xp.pipeline_forward(lambda v: v + 1, torch.ones(2, 2).to(device))
        return xp.collective_permute(torch.ones(2, 2).to(device), ring)
    if name == "x on xla:0 on every rank":
        return xp.collective_permute(torch.ones(2, device="xla:0"), ring)
    if name == "inputs on xla:0 on every rank":
        return xp.pipeline_forward(lambda v: v, torch.ones(2, 2, device="xla:0"))
    # --- empty tensors: the empty result, no collective, on every rank alike --------------
    if name.startswith("empty "):
        shape = {"empty 0 rows": (0, 3), "empty 0 columns": (2, 0), "empty 1-d": (0,)}
        if name in shape:
            e = torch.zeros(shape[name]).to(device).requires_grad_()
            y = xp.collective_permute(e, ring)
            y.sum().backward()
            return {"y": y, "grad": e.grad, "hlo": xp.hlo.trace(y)}
        if name == "empty stage_shift":
            return xp.stage_shift(torch.zeros(0, 4).to(device), offset=1)
        if name == "empty pipeline, 0 micro-batches":
            return xp.pipeline_forward(lambda v: v * 2, torch.zeros(0, 3).to(device))
        if name == "empty pipeline activation":
            return xp.pipeline_forward(lambda v: v * 2, torch.zeros(2, 0).to(device))
    # --- numpy / tensor pairs, groups and counts -----------------------------------------
    if name == "pairs numpy (k, 2)":
        return xp.collective_permute(x, np.array(ring))
    if name == "pairs 2-column tensor":
        return xp.collective_permute(x, torch.tensor(ring))
    if name == "pairs numpy int64 entries":
        return xp.collective_permute(x, [(np.int64(s), np.int64(t)) for s, t in ring])
    if name == "groups numpy array":
        return xp.collective_permute(x, [(0, 1), (1, 0)], groups=np.array([[0, 1], [2, 3]]))
    if name == "stage_shift offset np.int64(1)":
        return xp.stage_shift(x, offset=np.int64(1))
    if name == "pipeline stages np.int64(2)":
        return xp.pipeline_forward(lambda v: v + 1, torch.ones(2, 2).to(device) * rank,
                                   stages=np.int64(2))  # fmt: skip
    if name == "pairs float numpy array":
        return xp.collective_permute(x, np.array(ring, dtype=float))
    if name == "pairs numpy (k, 3)":
        return xp.collective_permute(x, np.zeros((2, 3), dtype=int))
    # --- the native backend on the CPU mesh -------------------------------------------------
    if name == "native executed on CPU":
        return xp.collective_permute(x, ring, backend="native")
    if name == "native stage_shift on CPU":
        return xp.stage_shift(x, offset=1, backend="native")
    if name == "native pipeline on CPU":
        return xp.pipeline_forward(lambda v: v, torch.ones(2, 2).to(device), backend="native")
    if name == "native traced in hlo.tracing":
        with xp.hlo.tracing():
            text = xp.hlo.trace(xp.collective_permute(x, ring, backend="native"))
        return [c.kind for c in xp.hlo.parse(text).collectives()]
    # --- step loops -------------------------------------------------------------------------
    if name == "step loop, y deleted before mark_step":
        out = []
        for step in range(3):
            y = xp.collective_permute(x + step, ring)
            out.append(y.cpu())
            del y
            xm.mark_step()
        return out
    # --- the debug mode itself ----------------------------------------------------------------
    if name == "debug_mode('sampled'), ranks agree":
        with xp.debug_mode("sampled"):
            return xp.collective_permute(x, ring)
    raise KeyError(name)


def run_probes(names: list[str]) -> dict[str, tuple[str, Any]]:
    """Run every probe on this rank, in order; sync once after each."""
    import torch_xla
    import torch_xla.runtime as xr

    rank, n, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        try:
            value = _probe(name, rank, n, device)
            torch_xla.sync()
            out[name] = ("ok", value)
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            out[name] = (type(e).__name__, str(e))
    return out
