"""Rank functions that trace collective matmul and its baselines (never run) for their HLO.

The *native* program (one ``collective-permute`` per ring step, what TPU and Neuron run) cannot
execute on the CPU mesh, but it can be traced there and read with :mod:`xla_permute.hlo`.
Nothing is executed: the traced tensors die before any ``torch_xla.sync()``.
"""

from __future__ import annotations

from typing import Any

import torch

MATMUL_OPS = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "all_gather_then_matmul",
    "matmul_then_reduce_scatter",
)


def matmul_program(
    op: str,
    m: int,
    k: int,
    f: int,
    *,
    bidirectional: bool = False,
    backend: str = "native",
    backward: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Trace ``op`` on this rank's device; return its outputs (nothing is executed). Call it
    inside :func:`xla_permute.hlo.tracing` for the native backend.

    All-gather ops take x ``[m, k]`` (this rank's rows), reduce-scatter ops x ``[N*m, k]``;
    w is ``[k, f]``. With ``backward`` the outputs are the gradients of ``sum(y)`` w.r.t. x
    and w instead of y.
    """
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    if op not in MATMUL_OPS:
        raise ValueError(f"op must be one of {MATMUL_OPS}, got {op!r}")
    n, device = xr.world_size(), torch_xla.device()
    rows = m if "all_gather" in op else n * m
    x = torch.ones(rows, k, dtype=dtype, device=device, requires_grad=backward)
    w = torch.ones(k, f, dtype=dtype, device=device, requires_grad=backward)
    kwargs: dict[str, Any] = {"dim": 0}
    if op in ("all_gather_matmul", "matmul_reduce_scatter"):
        kwargs.update(bidirectional=bidirectional, backend=backend)
    y = getattr(xp, op)(x, w, **kwargs)
    if not backward:
        return [y]
    y.sum().backward()
    return [x.grad, w.grad]


def matmul_hlos(specs: list[dict[str, Any]]) -> list[str]:
    """Rank function: the HLO text of :func:`matmul_program` for each spec (its keyword
    arguments), each program standing alone (:func:`xla_permute.hlo.trace`)."""
    import xla_permute as xp

    texts = []
    for spec in specs:
        with xp.hlo.tracing():  # the native backend is only traced on the CPU mesh
            texts.append(xp.hlo.trace(matmul_program(**spec)))
    return texts
