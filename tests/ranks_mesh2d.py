"""Rank function of tests/test_mesh2d.py: all_reduce, all_reduce_gradients and Mesh2D's
place on the mesh, every case in one launch."""

from __future__ import annotations

from typing import Any

import torch


def probe(xs: torch.Tensor, gs: torch.Tensor, groups: list[list[int]]) -> dict[str, Any]:
    """``xs[r]``, ``gs[r]``: rank r's input and output gradient (integer-valued)."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    r, dev = xr.global_ordinal(), torch_xla.device()
    out: dict[str, Any] = {"coords": xp.Mesh2D(tp=2, cp=xr.world_size() // 2).coords()}

    x = xs[r].to(dev).requires_grad_()
    y_all = xp.all_reduce(x)  # 15 values over 4 ranks: padded
    y_group = xp.all_reduce(x, groups=groups)
    (y_group * gs[r].to(dev)).sum().backward()
    scalar = xp.all_reduce(torch.tensor(float(r + 1), device=dev))
    empty = xp.all_reduce(torch.zeros(0, 3, device=dev))
    torch_xla.sync()
    out.update(all=y_all, group=y_group, grad=x.grad, scalar=scalar, empty=empty)

    # Gradients of two dtypes, one parameter without a gradient, one empty.
    w32 = torch.nn.Parameter(xs[r, 0].to(dev))
    w64 = torch.nn.Parameter(xs[r, 1].double().to(dev))
    unused = torch.nn.Parameter(torch.ones(2, device=dev))
    nothing = torch.nn.Parameter(torch.ones(0, device=dev))
    ((w32 * gs[r, 0].to(dev)).sum() + (w64 * gs[r, 1].double().to(dev)).sum()
     + nothing.sum()).backward()  # fmt: skip
    xp.all_reduce_gradients([w32, unused, w64, nothing], groups=groups)
    torch_xla.sync()
    out.update(g32=w32.grad, g64=w64.grad, unused=unused.grad, nothing=nothing.grad)

    # A disagreement (debug mode, on in tests): every rank raises before the collective.
    try:
        xp.all_reduce(torch.ones(2 if r == 0 else 3, device=dev))
        out["disagreement"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["disagreement"] = (type(e).__name__, str(e))
    try:
        xp.Mesh2D(tp=2, cp=1).coords()
        out["wrong_size"] = None
    except ValueError as e:
        out["wrong_size"] = str(e)
    return out
