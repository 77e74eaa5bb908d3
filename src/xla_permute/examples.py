"""Rank functions used by the tutorials, doctests and the demo.

They live in the package because the device process must import them: a function defined in
a notebook cell cannot be sent to it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "all_gather_matmul_demo",
    "all_gather_ranks",
    "collective_matmul_demo_hlo",
    "matmul_demo_inputs",
    "matmul_reduce_scatter_demo",
    "mlp_train_step",
    "verify_collective_matmul_demo_hlo",
    "verify_matmul_demo",
    "all_reduce_without_channel_id",
    "collective_hlo",
    "describe_device",
    "native_permute_hlo",
    "permute_demo_backward",
    "permute_demo_forward",
    "permute_demo_inputs",
    "permute_demo_native_hlo",
    "permute_errors",
    "permute_rank",
    "verify_permute_demo_backward",
    "verify_permute_demo_forward",
    "verify_permute_demo_native_hlo",
    "world_and_rank",
]


def world_and_rank() -> tuple[int, int]:
    """Return ``(world_size, rank)`` as seen by this rank."""
    import torch_xla.runtime as xr

    return xr.world_size(), xr.global_ordinal()


def describe_device() -> dict[str, object]:
    """This rank's view of the mesh: its rank, device, device kind and the world size."""
    import torch_xla
    import torch_xla.runtime as xr

    return {
        "rank": xr.global_ordinal(),
        "device": str(torch_xla.device()),
        "device_type": xr.device_type(),
        "world_size": xr.world_size(),
        "addressable_devices": xr.addressable_device_count(),
    }


def _rank_block(rows: int = 2, cols: int = 3) -> torch.Tensor:
    """A block whose every entry is this rank's id, on this rank's device."""
    import torch_xla
    import torch_xla.runtime as xr

    return torch.full((rows, cols), float(xr.global_ordinal()), device=torch_xla.device())


def all_gather_ranks(rows: int = 2, cols: int = 3) -> torch.Tensor:
    """All-gather each rank's block along dim 0 with a channel id (runs on the CPU mesh)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute.channels import next_channel_id

    out = xm.all_gather(
        _rank_block(rows, cols),
        dim=0,
        groups=[list(range(xr.world_size()))],
        pin_layout=False,
        channel_id=next_channel_id(),
        use_global_device_ids=True,
    )
    xm.mark_step()
    return out


def all_reduce_without_channel_id() -> torch.Tensor:
    """An upstream all-reduce, which carries no channel id (aborts on the CPU mesh)."""
    import torch_xla.core.xla_model as xm

    out = xm.all_reduce(xm.REDUCE_SUM, _rank_block())
    xm.mark_step()
    return out


def collective_hlo() -> dict[str, str]:
    """HLO text of the two programs above, traced on this rank but not executed."""
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    x = _rank_block()
    with_channel = xm.all_gather(
        x,
        dim=0,
        groups=[list(range(xr.world_size()))],
        pin_layout=False,
        channel_id=1,
        use_global_device_ids=True,
    )
    from xla_permute.tracing import discard_traced_collectives

    hlo = torch_xla._XLAC._get_xla_tensors_hlo
    gather_text = hlo([with_channel])
    discard_traced_collectives()  # each program stands alone (no token from the other)
    reduce_text = hlo([xm.all_reduce(xm.REDUCE_SUM, x)])
    discard_traced_collectives()
    return {"all_gather": gather_text, "all_reduce": reduce_text}


# --- CollectivePermute (tutorial 02 and the demo) -------------------------------------------


def permute_rank(
    xs: torch.Tensor,
    cases: list[tuple[Any, Any]],
    gs: torch.Tensor | None = None,
    backend: str = "auto",
) -> list[dict[str, torch.Tensor]]:
    """Run ``collective_permute(xs[rank], pairs, groups=groups)`` for every ``(pairs, groups)``.

    ``xs`` is the virtual mesh (leading axis = rank), passed whole so that every rank builds
    its input from its own row. With ``gs`` (same shape as ``xs``) each case also returns
    ``grad``: this rank's input gradient of ``sum(y * gs[rank])``. All cases, forward and
    backward, form one program (one ``xm.mark_step``).
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute.permute import collective_permute

    rank, device = xr.global_ordinal(), torch_xla.device()
    out = []
    for pairs, groups in cases:
        x = xs[rank].to(device).requires_grad_(gs is not None)
        y = collective_permute(x, pairs, groups=groups, backend=backend)
        if gs is None:
            out.append({"y": y})
            continue
        (y * gs[rank].to(device)).sum().backward()
        out.append({"y": y, "grad": x.grad})
    xm.mark_step()
    return out


def native_permute_hlo(cases: list[tuple[Any, Any]]) -> str:
    """HLO of one program with a native ``collective_permute`` per ``(pairs, groups)``.

    Traced on this rank and never executed (the results die before any ``xm.mark_step``):
    the CPU mesh cannot run a collective without a channel id. The program stands alone:
    collectives traced before or after it are kept out of it (see
    :func:`xla_permute.tracing.discard_traced_collectives`).
    """
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute.permute import collective_permute
    from xla_permute.tracing import discard_traced_collectives

    discard_traced_collectives()
    x = torch.full((2, 3), float(xr.global_ordinal() + 1), device=torch_xla.device())
    ys = [collective_permute(x, p, groups=g, backend="native") for p, g in cases]
    text = torch_xla._XLAC._get_xla_tensors_hlo(ys)
    discard_traced_collectives()  # or torch_xla's token would chain them into later programs
    return text


def permute_demo_inputs(n: int) -> dict[str, Any]:
    """The demo's virtual mesh (non-zero integers), upstream gradient and pairs for ``n`` ranks.

    ``ring``: every rank sends to the next. ``chain``: the same without the wrap-around, a
    partial permutation: rank 0 receives zeros and rank n-1's value goes nowhere.
    """
    from xla_permute.pairs import ring_pairs

    xs = torch.arange(1.0, 6 * n + 1).reshape(n, 2, 3)
    return {
        "xs": xs,
        "gs": 100 + xs.flip(0),
        "cases": {
            "ring": (ring_pairs(n), None),
            "chain": ([(r, r + 1) for r in range(n - 1)], None),
        },
    }


def permute_demo_forward() -> list[dict[str, torch.Tensor]]:
    """Demo check: ring shift and open chain, emulated backend, forward only."""
    import torch_xla.runtime as xr

    d = permute_demo_inputs(xr.world_size())
    return permute_rank(d["xs"], list(d["cases"].values()), backend="emulated")


def permute_demo_backward() -> list[dict[str, torch.Tensor]]:
    """Demo check: the open chain's input gradient, emulated backend."""
    import torch_xla.runtime as xr

    d = permute_demo_inputs(xr.world_size())
    return permute_rank(d["xs"], [d["cases"]["chain"]], gs=d["gs"], backend="emulated")


def permute_demo_native_hlo() -> str:
    """Demo check: the ring shift on the native backend, traced (not run)."""
    import torch_xla.runtime as xr

    return native_permute_hlo([permute_demo_inputs(xr.world_size())["cases"]["ring"]])


def verify_permute_demo_forward(results: list[list[dict[str, torch.Tensor]]]) -> None:
    """Every rank's ring and chain outputs equal :func:`xla_permute.reference.permute`."""
    from xla_permute import reference

    d = permute_demo_inputs(len(results))
    for i, (name, (pairs, groups)) in enumerate(d["cases"].items()):
        want = reference.permute(d["xs"], pairs, groups)
        for rank, got in enumerate(results):
            if not torch.equal(got[i]["y"], want[rank]):
                raise AssertionError(f"rank {rank}: {name} output differs from the reference")


def verify_permute_demo_backward(results: list[list[dict[str, torch.Tensor]]]) -> None:
    """Every rank's input gradient equals the reference's autograd gradient."""
    from xla_permute import reference

    d = permute_demo_inputs(len(results))
    xs = d["xs"].clone().requires_grad_(True)
    (reference.permute(xs, *d["cases"]["chain"]) * d["gs"]).sum().backward()
    for rank, got in enumerate(results):
        if not torch.equal(got[0]["grad"], xs.grad[rank]):
            raise AssertionError(f"rank {rank}: gradient differs from the reference's autograd")


def verify_permute_demo_native_hlo(results: list[str]) -> None:
    """Each rank's HLO holds exactly one collective-permute with the ring's pairs."""
    from xla_permute.hlo import parse

    expected = set(permute_demo_inputs(len(results))["cases"]["ring"][0])
    for rank, text in enumerate(results):
        found = [(c.kind, c.pairs) for c in parse(text).collectives()]
        if len(found) != 1 or found[0][0] != "collective-permute" or set(found[0][1]) != expected:
            raise AssertionError(f"rank {rank}: expected one ring collective-permute, got {found}")


def permute_errors(pairs: Any) -> dict[str, str]:
    """Where bad ``pairs`` fail: this package's check vs upstream ``xm.collective_permute``.

    ``xla_permute``: the error :func:`~xla_permute.permute.collective_permute` raises at the
    call.
    ``upstream``: ``xm.collective_permute`` traces the pairs unchecked; the error only comes
    from XLA's HLO verifier when the program is compiled (compiled here without running, with
    ``torch_xla._XLAC._xla_warm_up_cache``), i.e. at the next ``xm.mark_step`` in a real run.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute.permute import collective_permute

    x = torch.full((2, 3), float(xr.global_ordinal() + 1), device=torch_xla.device())
    out = {}
    try:
        collective_permute(x, pairs)
        out["xla_permute"] = "no error"
    except (TypeError, ValueError) as e:
        out["xla_permute"] = f"{type(e).__name__}: {e}"
    y = xm.collective_permute(x, [list(p) for p in pairs])
    try:
        torch_xla._XLAC._xla_warm_up_cache([y], [])
        out["upstream"] = "compiled"
    except Exception as e:  # noqa: BLE001 - XLA's compile errors come as several types
        out["upstream"] = f"{type(e).__name__}: {e}"
    return out


# --- collective matmul demo checks --------------------------------------------------------


def matmul_demo_inputs(n: int, op: str) -> dict[str, torch.Tensor]:
    """Integer-valued virtual-mesh inputs for a demo check of ``op`` on ``n`` ranks.

    ``all_gather``: x ``[n, 2, 4, 8]`` (batch 2, sequence 4 per rank), w ``[n, 8, 6]``.
    ``reduce_scatter``: x ``[n, 2, 4n, 8]``, w ``[n, 8, 6]``. ``g`` is the upstream gradient.
    """
    g = torch.Generator().manual_seed(7 if op == "all_gather" else 11)
    rows = 4 if op == "all_gather" else 4 * n
    xs = torch.randint(-3, 4, (n, 2, rows, 8), generator=g).float()
    ws = torch.randint(-3, 4, (n, 8, 6), generator=g).float()
    out_rows = 4 * n if op == "all_gather" else 4
    gs = torch.randint(-3, 4, (n, 2, out_rows, 6), generator=g).float()
    return {"xs": xs, "ws": ws, "gs": gs}


def _matmul_demo(op: str) -> dict[str, dict[str, torch.Tensor]]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute import matmul

    rank, device = xr.global_ordinal(), torch_xla.device()
    data = matmul_demo_inputs(xr.world_size(), op)
    ring = getattr(matmul, "all_gather_matmul" if op == "all_gather" else "matmul_reduce_scatter")
    base = getattr(
        matmul, "all_gather_then_matmul" if op == "all_gather" else "matmul_then_reduce_scatter"
    )
    variants = {
        "baseline": lambda x, w: base(x, w, dim=1),
        "uni": lambda x, w: ring(x, w, dim=1),
        "bi": lambda x, w: ring(x, w, dim=1, bidirectional=True),
    }
    out = {}
    for name, fn in variants.items():
        x = data["xs"][rank].to(device).requires_grad_()
        w = data["ws"][rank].to(device).requires_grad_()
        y = fn(x, w)
        (y * data["gs"][rank].to(device)).sum().backward()
        out[name] = {"y": y, "dx": x.grad, "dw": w.grad}
    xm.mark_step()
    return out


def all_gather_matmul_demo() -> dict[str, dict[str, torch.Tensor]]:
    """Demo check: all-gather-matmul uni and bi, and the baseline, forward and backward."""
    return _matmul_demo("all_gather")


def matmul_reduce_scatter_demo() -> dict[str, dict[str, torch.Tensor]]:
    """Demo check: matmul-reduce-scatter uni and bi, and the baseline, forward and backward."""
    return _matmul_demo("reduce_scatter")


def verify_matmul_demo(results: list[dict[str, dict[str, torch.Tensor]]]) -> None:
    """Uni and bi equal the baseline on every rank, forward and backward, exactly."""
    for rank, out in enumerate(results):
        for variant in ("uni", "bi"):
            for key in ("y", "dx", "dw"):
                if not torch.equal(out[variant][key], out["baseline"][key]):
                    raise AssertionError(f"rank {rank}: {variant} {key} differs from the baseline")


def collective_matmul_demo_hlo() -> list[str]:
    """Demo check: HLO of the native all-gather-matmul and matmul-reduce-scatter (not run)."""
    from xla_permute.tracing import matmul_hlo

    return [
        matmul_hlo(op, 4, 8, 6, bidirectional=bi)
        for op in ("all_gather_matmul", "matmul_reduce_scatter")
        for bi in (False, True)
    ]


def verify_collective_matmul_demo_hlo(results: list[list[str]]) -> None:
    """N-1 collective-permutes, no other collective, and a dot free to run beside each."""
    from xla_permute import hlo

    n = len(results)
    for rank, texts in enumerate(results):
        for text in texts:
            program = hlo.parse(text)
            kinds = [c.kind for c in program.collectives()]
            if kinds != ["collective-permute"] * (n - 1):
                raise AssertionError(f"rank {rank}: collectives {kinds}, want {n - 1} permutes")
            if not all(program.independent_of(c.name) for c in program.collectives()):
                raise AssertionError(f"rank {rank}: a permute has no dot to overlap with")


# --- tensor-parallel MLP training step ----------------------------------------------------


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
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr
    from torch import nn

    from xla_permute.layers import SequenceParallelMLP

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
        mlp = SequenceParallelMLP.from_mlp(fc1, fc2, acts[variant["activation"]], **kwargs)
        mlp = mlp.to(device)
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
