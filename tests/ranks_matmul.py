"""Rank functions for test_matmul.py and test_layers.py: many cases per launch."""

from __future__ import annotations

from typing import Any

import torch

from xla_permute_tools import accounting

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
        if case.get("chunks"):
            kwargs["chunks"] = case["chunks"]
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


def _error(call: Any) -> str:
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def matmul_errors() -> dict[str, str]:
    """Each bad call of the collective matmuls, and the error it raised (before any collective)."""
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute.matmul import all_gather_matmul, matmul_reduce_scatter

    n, d = xr.world_size(), torch_xla.device()
    x, w = torch.ones(2, 3, device=d), torch.ones(3, 4, device=d)
    return {
        "not divisible": _error(
            lambda: matmul_reduce_scatter(torch.ones(n + 1, 3, device=d), w, dim=0)
        ),
        "inner dims": _error(lambda: all_gather_matmul(x, torch.ones(4, 4, device=d), dim=0)),
        "dtypes": _error(lambda: all_gather_matmul(x, w.to(torch.bfloat16), dim=0)),
        "cpu tensor": _error(lambda: all_gather_matmul(x.cpu(), w, dim=0)),
        "contracted dim": _error(lambda: all_gather_matmul(x, w, dim=-1)),
        "dim out of range": _error(lambda: matmul_reduce_scatter(x, w, dim=2)),
        "w not 2-D": _error(lambda: all_gather_matmul(x, torch.ones(1, 3, 4, device=d), dim=0)),
        "x 1-D": _error(lambda: all_gather_matmul(torch.ones(3, device=d), w, dim=0)),
        **{
            f"chunks={c!r}": _error(lambda c=c: all_gather_matmul(x, w, dim=0, chunks=c))
            for c in (0, 3, True, "2")
        },
    }


def matmul_hlo() -> dict[str, Any]:
    """The native rings traced on this rank (never run), read for overlap: per program, for
    each step t, the matmuls of step t+1 (those its sends, or the result, need and step t's
    do not) and how many of them depend on a permute issued at step t."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    n, d = xr.world_size(), torch_xla.device()
    out = {}
    with xp.hlo.tracing():
        for name, bi, chunks in [("mrs", False, 1), ("mrs", True, 1), ("agm", False, 2)]:
            if name == "mrs":  # K=8 > F=2: x read in 4 row slices per block
                y = xp.matmul_reduce_scatter(
                    torch.ones(4 * n, 8, device=d),
                    torch.ones(8, 2, device=d),
                    dim=0,
                    bidirectional=bi,
                    backend="native",
                )
                schedule = xp.reduce_scatter_schedule(n, 0, bi)
            else:
                y = xp.all_gather_matmul(
                    torch.ones(4, 8, device=d),
                    torch.ones(8, 2, device=d),
                    dim=0,
                    chunks=chunks,
                    backend="native",
                )
                schedule = xp.all_gather_schedule(n, 0, bi) * chunks
            prog = xp.hlo.parse(xp.hlo.trace([y]))
            steps = accounting.permute_steps(prog, n, schedule)
            dots = [i.name for i in prog.ops("dot")]
            entry = {"permutes": sum(map(len, steps)), "dots": len(dots)}
            if name == "agm":  # x travels: each permute is in flight during its step's matmul
                entry["independent"] = [len(prog.independent_of(p)) for s in steps for p in s]
            else:  # partial sums travel: step t's permutes fly during step t+1's matmuls
                feeds = [{t for t in dots if any(prog.depends_on(p, t) for p in s)} for s in steps]
                feeds[-1] = set(dots)  # the last step feeds the result
                later = [feeds[t + 1] - feeds[t] for t in range(len(steps) - 1)]
                entry["next_step"] = [
                    (len(h), sum(prog.depends_on(t, p) for t in h for p in steps[i]))
                    for i, h in enumerate(later)
                ]
            out[f"{name} bi={bi} chunks={chunks}"] = entry
    return out


def matmul_suite(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """The error checks first (they must not issue a collective), then every case, one
    program each: the ranks compile their programs one after another, and one program of all
    cases left the last rank more than XLA:CPU's 10 s rendezvous timeout behind the first on
    two loaded cores; then the native rings, traced only."""
    errors = matmul_errors()
    return {"errors": errors, "cases": matmul_cases(cases, sync_each=True), "hlo": matmul_hlo()}


def collectives_roundtrip(xs: torch.Tensor, gs_gather: torch.Tensor, gs_sum: torch.Tensor):
    """all_gather, reduce_scatter and sum_gradients with their backward, on this rank."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    import xla_permute as xp
    from xla_permute.collectives import all_gather, reduce_scatter, sum_gradients

    rank, d = xr.global_ordinal(), torch_xla.device()
    x = xs[rank].to(d).requires_grad_()
    gathered = all_gather(x, 1)
    scattered = reduce_scatter(gathered, 1)
    b = torch.ones(3, device=d).requires_grad_()
    loss = (gathered * gs_gather[rank].to(d)).sum() + (scattered * gs_sum[rank].to(d)).sum()
    (loss + (sum_gradients(b) * (rank + 1)).sum()).backward()
    xm.mark_step()
    c = torch.ones(3, device=d).requires_grad_()  # sum_gradients' backward alone, for its HLO
    sum_gradients(c).sum().backward()
    sum_hlo = xp.hlo.trace(c.grad)
    xm.mark_step()
    return {
        "gathered": gathered,
        "scattered": scattered,
        "dx": x.grad,
        "db": b.grad,
        "sum_hlo": sum_hlo,
    }


def mlp_train_step(
    fc1_state: dict[str, torch.Tensor],
    fc2_state: dict[str, torch.Tensor],
    x_full: torch.Tensor,
    target_full: torch.Tensor,
    variants: list[dict[str, Any]],
    lr: float,
) -> list[dict[str, Any]]:
    """One SGD step of the sequence-parallel MLP per variant (``activation`` + layer kwargs).

    Every rank builds its shard of the single-device MLP ``fc2(act(fc1(x)))`` from the full
    state dicts, takes its sequence shard (dim 1) of ``x_full`` and ``target_full``, and uses
    loss = sum of squares of its rows (the total loss is the sum over ranks). Returns, per
    variant, the loss, the parameter gradients and the parameters after ``p -= lr * grad``.
    """
    import torch_xla
    import torch_xla.runtime as xr
    from torch import nn

    import xla_permute as xp

    rank, n, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
    acts = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}
    fc1 = nn.Linear(*fc1_state["weight"].shape[::-1])
    fc2 = nn.Linear(*fc2_state["weight"].shape[::-1])
    fc1.load_state_dict(fc1_state)
    fc2.load_state_dict(fc2_state)
    x = x_full.chunk(n, dim=1)[rank].to(device)
    target = target_full.chunk(n, dim=1)[rank].to(device)
    outs = []
    for variant in variants:
        kwargs = {k: v for k, v in variant.items() if k != "activation"}
        mlp = xp.SequenceParallelMLP.from_mlp(fc1, fc2, acts[variant["activation"]], **kwargs)
        mlp = mlp.to(device)
        loss = ((mlp(x) - target) ** 2).sum()
        loss.backward()
        grads = {name: p.grad for name, p in mlp.named_parameters()}
        with torch.no_grad():
            for p in mlp.parameters():
                p -= lr * p.grad
        outs.append({"loss": loss, "grads": grads, "params": dict(mlp.named_parameters())})
    torch_xla.sync()
    return [
        {
            "loss": o["loss"].detach(),
            "grads": {k: v.detach() for k, v in o["grads"].items()},
            "params": {k: v.detach() for k, v in o["params"].items()},
        }
        for o in outs
    ]
