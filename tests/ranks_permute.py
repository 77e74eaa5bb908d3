"""Rank functions for test_permute.py: many cases per mesh launch, one program per batch."""

from __future__ import annotations

from typing import Any

import torch

from xla_permute.hlo import discard_traced_collectives, tracing


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


def _x(kind: str = "xla") -> Any:
    import torch_xla
    import torch_xla.runtime as xr

    value = torch.full((2, 3), float(xr.global_ordinal() + 1))
    if kind == "list":
        return value.tolist()
    return value if kind == "cpu" else value.to(torch_xla.device())


def bad_inputs(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Call ``collective_permute`` with every bad input; record what each call raised.

    Run this first in a program (channel ids and the token chain start fresh).

    A case: ``id``, ``pairs``, ``groups`` and optionally ``x`` ("xla", "cpu" or "list") and
    ``backend``. Afterwards one good emulated permute is traced (not run): its all-gather gets
    channel id 1 only if none of the bad calls issued a collective before raising.
    """
    import torch_xla

    from xla_permute import collective_permute

    raised = {}
    for case in cases:
        try:
            collective_permute(
                _x(case.get("x", "xla")),
                case["pairs"],
                groups=case["groups"],
                backend=case.get("backend", "emulated"),
            )
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            raised[case["id"]] = (type(e).__name__, str(e))
        else:
            raised[case["id"]] = ("no error", "")
    good = collective_permute(_x(), [(0, 1), (1, 0)], backend="emulated")
    return {"raised": raised, "good_hlo": torch_xla._XLAC._get_xla_tensors_hlo([good])}


def traced_hlo(native_cases: list[dict[str, Any]]) -> dict[str, Any]:
    """HLO text of permutes traced on this rank and never executed (no mark_step).

    For each native case (``pairs``, ``groups``): the forward and the backward (the gradient
    of ``sum(y * 1)``). Also an emulated ring, and empty pairs on both backends.
    """
    with tracing():  # the native backend is only traced on the CPU mesh
        return _traced_hlo(native_cases)


def _traced_hlo(native_cases: list[dict[str, Any]]) -> dict[str, Any]:
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute import collective_permute

    hlo = torch_xla._XLAC._get_xla_tensors_hlo
    out: dict[str, Any] = {"native": []}
    for case in native_cases:
        discard_traced_collectives()
        x = _x().requires_grad_(True)
        y = collective_permute(x, case["pairs"], groups=case["groups"], backend="native")
        forward = hlo([y])
        discard_traced_collectives()
        y.sum().backward()
        out["native"].append({"forward": forward, "backward": hlo([x.grad])})
        del x, y
    n = xr.world_size()
    ring = [(r, (r + 1) % n) for r in range(n)]
    discard_traced_collectives()
    out["emulated_ring"] = hlo([collective_permute(_x(), ring, backend="emulated")])
    out["empty"] = {}
    for backend in ("native", "emulated"):
        discard_traced_collectives()
        out["empty"][backend] = hlo([collective_permute(_x(), [], backend=backend)])
    return out


def permute_raises(pairs: Any) -> None:
    """Call ``collective_permute`` with ``pairs`` and let its error escape the rank."""
    from xla_permute import collective_permute

    collective_permute(_x(), pairs)


def bad_inputs_then_traced_hlo(
    bad_cases: list[dict[str, Any]], native_cases: list[dict[str, Any]]
) -> dict[str, Any]:
    """:func:`bad_inputs` then :func:`traced_hlo` in one launch (nothing is executed)."""
    return {**bad_inputs(bad_cases), **traced_hlo(native_cases)}
