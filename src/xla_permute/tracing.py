"""Trace collective matmul and its baselines on a rank, without running them.

Rank functions for :func:`~xla_permute.launch.run_on_mesh`. They build the program with the
chosen permute backend and return its HLO text, so that the *native* program (one
``collective-permute`` per step, what runs on TPU and Neuron) can be read on the CPU mesh, where
it cannot execute. Nothing is executed: the traced tensors die before any ``mark_step``.
"""

from __future__ import annotations

from typing import Literal

import torch

from xla_permute.hlo import discard_traced_collectives

__all__ = [
    "MATMUL_OPS",
    "discard_traced_collectives",
    "matmul_hlo",
    "matmul_hlos",
    "matmul_program",
]

MatmulOp = Literal["all_gather_matmul", "matmul_reduce_scatter", "all_gather_then_matmul",
                   "matmul_then_reduce_scatter"]  # fmt: skip
MATMUL_OPS: tuple[str, ...] = (
    "all_gather_matmul",
    "matmul_reduce_scatter",
    "all_gather_then_matmul",
    "matmul_then_reduce_scatter",
)


def matmul_program(
    op: MatmulOp,
    m: int,
    k: int,
    f: int,
    *,
    bidirectional: bool = False,
    backend: str = "native",
    backward: bool = False,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:
    """Trace ``op`` on this rank's device; return the output tensors (nothing is executed).

    Shapes: all-gather ops take x ``[m, k]`` (this rank's rows) and w ``[k, f]``;
    reduce-scatter ops take x ``[N*m, k]`` and w ``[k, f]``. With ``backward``, the outputs
    are the gradients of ``sum(y)`` w.r.t. x and w instead of y.
    """
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute import matmul

    if op not in MATMUL_OPS:
        raise ValueError(f"op must be one of {MATMUL_OPS}, got {op!r}")
    n, device = xr.world_size(), torch_xla.device()
    rows = m if "all_gather" in op else n * m
    x = torch.ones(rows, k, dtype=dtype, device=device, requires_grad=backward)
    w = torch.ones(k, f, dtype=dtype, device=device, requires_grad=backward)
    kwargs: dict[str, object] = {"dim": 0}
    if op in ("all_gather_matmul", "matmul_reduce_scatter"):
        kwargs.update(bidirectional=bidirectional, backend=backend)
    y = getattr(matmul, op)(x, w, **kwargs)
    if not backward:
        return [y]
    y.sum().backward()
    return [x.grad, w.grad]


def matmul_hlo(op: MatmulOp, m: int, k: int, f: int, **kwargs: object) -> str:
    """HLO text of :func:`matmul_program` (same arguments), traced and never run."""
    import torch_xla

    text = torch_xla._XLAC._get_xla_tensors_hlo(matmul_program(op, m, k, f, **kwargs))
    discard_traced_collectives()
    return text


def matmul_hlos(specs: list[dict[str, object]]) -> list[str]:
    """:func:`matmul_hlo` for each spec (its keyword arguments), each program standing alone."""
    return [matmul_hlo(**spec) for spec in specs]  # type: ignore[arg-type]
