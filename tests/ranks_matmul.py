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


def mlp_train_step(
    fc1_state: dict[str, torch.Tensor],
    fc2_state: dict[str, torch.Tensor],
    x_full: torch.Tensor,
    target_full: torch.Tensor,
    activation: str,
    variants: list[dict[str, bool]],
    lr: float,
) -> list[dict[str, Any]]:
    """One SGD step of the sequence-parallel MLP for each variant; loss = sum of squares."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch import nn

    from xla_permute.layers import SequenceParallelMLP

    rank, n, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
    act = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}[activation]
    fc1 = nn.Linear(*fc1_state["weight"].shape[::-1])
    fc2 = nn.Linear(*fc2_state["weight"].shape[::-1])
    fc1.load_state_dict(fc1_state)
    fc2.load_state_dict(fc2_state)
    x = x_full.chunk(n, dim=1)[rank].to(device)
    target = target_full.chunk(n, dim=1)[rank].to(device)
    outs = []
    for variant in variants:
        mlp = SequenceParallelMLP.from_mlp(fc1, fc2, act, **variant).to(device)
        loss = ((mlp(x) - target) ** 2).sum()
        loss.backward()
        grads = {name: p.grad for name, p in mlp.named_parameters()}
        with torch.no_grad():
            for p in mlp.parameters():
                p -= lr * p.grad
        outs.append({"loss": loss, "grads": grads, "params": dict(mlp.named_parameters())})
    xm.mark_step()
    return [
        {
            "loss": o["loss"].detach(),
            "grads": {k: v.detach() for k, v in o["grads"].items()},
            "params": {k: v.detach() for k, v in o["params"].items()},
        }
        for o in outs
    ]
