"""Rank functions for test_matmul.py and test_layers.py: many cases per launch."""

from __future__ import annotations

from typing import Any

import torch

OPS = {
    "agm": ("all_gather_matmul", True),
    "mrs": ("matmul_reduce_scatter", True),
    "agm_base": ("all_gather_then_matmul", False),
    "mrs_base": ("matmul_then_reduce_scatter", False),
}


def matmul_cases(cases: list[dict[str, Any]], sync_each: bool = False) -> list[dict[str, Any]]:
    """Run each case (op, xs, ws, dim, bidirectional, gs) on this rank: y, and dx, dw if gs."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute import matmul

    rank, device = xr.global_ordinal(), torch_xla.device()
    outs = []
    for case in cases:
        name, has_bi = OPS[case["op"]]
        fn = getattr(matmul, name)
        kwargs = {"dim": case["dim"]}
        if has_bi:
            kwargs["bidirectional"] = case.get("bidirectional", False)
        x = case["xs"][rank].to(device).requires_grad_(case.get("gs") is not None)
        w = case["ws"][rank].to(device).requires_grad_(case.get("gs") is not None)
        y = fn(x, w, **kwargs)
        out = {"y": y}
        if case.get("gs") is not None:
            (y * case["gs"][rank].to(device)).sum().backward()
            out["dx"], out["dw"] = x.grad, w.grad
        outs.append(out)
        if sync_each:
            xm.mark_step()
    xm.mark_step()
    return outs
