"""Rank functions for test_permute.py: many cases per mesh launch, one program per batch."""

from __future__ import annotations

from typing import Any

import torch


def permute_cases(cases: list[dict[str, Any]], backend: str = "auto") -> list[dict[str, Any]]:
    """Run every case on this rank; return its outputs (and input gradients for float cases).

    A case: ``xs`` (virtual-mesh input, leading axis = rank), ``pairs``, ``groups`` and, for a
    gradient check, ``gs`` (the upstream gradient of every rank).
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute import collective_permute

    rank, device = xr.global_ordinal(), torch_xla.device()
    outs = []
    for case in cases:
        x = case["xs"][rank].to(device)
        grad = case.get("gs") is not None
        if grad:
            x.requires_grad_(True)
        y = collective_permute(x, case["pairs"], groups=case["groups"], backend=backend)
        out = {"y": y}
        if grad:
            (y * case["gs"][rank].to(device)).sum().backward()
            out["grad"] = x.grad
        outs.append(out)
    xm.mark_step()
    return outs


def traced_native_hlo(pairs: list[tuple[int, int]], groups: Any = None) -> str:
    """HLO text of a native permute, traced here and never executed."""
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute import collective_permute

    x = torch.full((2, 3), float(xr.global_ordinal()), device=torch_xla.device())
    y = collective_permute(x, pairs, groups=groups, backend="native")
    return torch_xla._XLAC._get_xla_tensors_hlo([y])
