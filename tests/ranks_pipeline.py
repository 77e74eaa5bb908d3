"""Rank functions for test_shift.py and test_pipeline.py: many cases per launch, one program."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def _error(call: Callable[[], Any]) -> str:
    """Call; return ``"TypeName: message"`` of the error it raises, or ``"no error"``."""
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def shift_cases(cases: list[dict[str, Any]], bad: list[dict[str, Any]]) -> dict[str, Any]:
    """Bad ``stage_shift`` calls first (each must raise), then every case in one program.

    A case: ``xs`` (virtual mesh, leading axis = rank), ``gs`` (upstream gradient, same
    shape), ``offset``, ``wrap``, ``groups``. Returns the error messages of the bad calls and,
    per case, this rank's ``y`` and input gradient ``grad``.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    from xla_permute import stage_shift

    rank, device = xr.global_ordinal(), torch_xla.device()
    x0 = torch.ones(2, device=device)
    errors = [_error(lambda kw=kw: stage_shift(x0, **kw)) for kw in bad]
    errors.append(_error(lambda: stage_shift(torch.ones(2), offset=1)))  # a CPU tensor
    outs = []
    for case in cases:
        x = case["xs"][rank].to(device).requires_grad_()
        y = stage_shift(x, offset=case["offset"], wrap=case["wrap"], groups=case["groups"])
        (y * case["gs"][rank].to(device)).sum().backward()
        outs.append({"y": y, "grad": x.grad})
    xm.mark_step()
    return {"errors": errors, "cases": outs}


def pipeline_cases(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Bad pipeline calls (each must raise), the MLP pipeline cases, then the traced programs.

    Returns the error messages, the per-case results of
    :func:`xla_permute.pipeline.mlp_pipeline_cases` (one program) and the HLO of
    :func:`xla_permute.sendrecv.traced_step_programs` (traced after that program ran, never
    executed).
    """
    import torch_xla

    from xla_permute.pipeline import mlp_pipeline_cases, pipeline_forward
    from xla_permute.sendrecv import traced_step_programs

    device = torch_xla.device()
    good = torch.zeros(3, 2, 4, device=device)
    bad = [
        lambda: pipeline_forward(torch.relu, torch.zeros(0, 2, 4, device=device)),
        lambda: pipeline_forward(torch.relu, good, stages=3),
        lambda: pipeline_forward(torch.relu, good, stages=0),
        lambda: pipeline_forward(lambda x: x.sum(-1), good),
        lambda: pipeline_forward("relu", good),
        lambda: pipeline_forward(torch.relu, good, wrap=1),
        lambda: pipeline_forward(torch.relu, good.cpu()),
    ]
    errors = [_error(call) for call in bad]
    results = mlp_pipeline_cases(cases)
    return {"errors": errors, "cases": results, "traced": traced_step_programs()}
