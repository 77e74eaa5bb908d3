"""One pipeline step with ``torch.distributed`` send/recv versus stage shifts, counted.

In torch_xla 2.9 the ``xla`` backend's ``send`` and ``recv`` each issue one single-pair
``xm.collective_permute`` and a graph sync per tensor (pytorch/xla PR 9373). A stage shift moves
all stages' activations in one permute, inside one program. This module reads what the backend
does from its installed source, traces one GPipe step both ways (never executed: the native
permute cannot run on the CPU mesh) and counts programs, collectives and bytes from the HLO
with :mod:`xla_permute.hlo`.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from xla_permute.pipeline import example_batch, mlp_stage, mlp_stage_params, pipeline_forward
from xla_permute.tracing import discard_traced_collectives

__all__ = ["BackendCall", "StepCost", "sendrecv_code_path", "step_cost", "traced_step_programs"]


@dataclass(frozen=True)
class StepCost:
    """What one rank's programs for one step contain, read from their HLO by ``xla_permute.hlo``.

    ``programs``: graphs the rank executes (one per sync); ``collectives``: collective ops over
    all of them; ``kinds``: their opcodes; ``pairs``: the source-target pairs of each permute;
    ``bytes_sent``: what this rank sends (a permute sends its operand if the rank is a source).
    """

    programs: int
    collectives: int
    kinds: tuple[str, ...]
    pairs: tuple[tuple[tuple[int, int], ...] | None, ...]
    bytes_sent: int


def step_cost(hlo_texts: Sequence[str], rank: int, group_size: int) -> StepCost:
    """Parse the HLO of a rank's programs for one step and count what they do."""
    from xla_permute.hlo import bytes_sent_per_rank, parse

    collectives = [c for text in hlo_texts for c in parse(text).collectives()]
    return StepCost(
        programs=len(hlo_texts),
        collectives=len(collectives),
        kinds=tuple(c.kind for c in collectives),
        pairs=tuple(c.pairs for c in collectives),
        bytes_sent=sum(bytes_sent_per_rank(c, group_size, rank) for c in collectives),
    )


@dataclass(frozen=True)
class BackendCall:
    """One method of torch_xla's ``ProcessGroupXla`` as installed: its calls per tensor."""

    method: str
    per_tensor: dict[str, int]
    source: str


def sendrecv_code_path() -> dict[str, BackendCall]:
    """What ``ProcessGroupXla.send`` and ``.recv`` (``torch.distributed``'s ``xla`` backend) do.

    Read from the installed ``torch_xla/distributed/xla_backend.py`` with ``ast``, without
    importing it: for each method, the calls made in its loop over the tensors.
    """
    spec = importlib.util.find_spec("torch_xla")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("torch_xla is not installed")
    path = Path(spec.origin).parent / "distributed" / "xla_backend.py"
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    cls = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ProcessGroupXla"
    )
    out = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in ("send", "recv"):
            loop = next(n for n in ast.walk(fn) if isinstance(n, ast.For))
            calls = Counter(ast.unparse(c.func) for c in ast.walk(loop) if isinstance(c, ast.Call))
            out[fn.name] = BackendCall(fn.name, dict(calls), ast.get_source_segment(text, fn) or "")
    return out


class _SendRecvReplay:
    """The code path of ``ProcessGroupXla.send`` / ``.recv`` (torch_xla 2.9), traced only.

    Per call: one ``xm.collective_permute`` with the single pair ``[[src, dst]]``, then
    ``torch_xla.sync()``. The sync would execute the pending graph (which aborts on the CPU
    mesh: the permute has no channel id), so instead the program it would run is recorded as
    HLO text, and the permute's result is replaced by device data, as a sync leaves it: the
    next recorded program starts where the sync would have left off (the token that orders
    collectives is reset too, as the sync does).
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.programs: list[str] = []

    def _sync(self, result: torch.Tensor) -> torch.Tensor:
        import torch_xla

        self.programs.append(torch_xla._XLAC._get_xla_tensors_hlo([result]))
        discard_traced_collectives()
        return torch.zeros(result.shape, dtype=result.dtype).to(result.device)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        import torch_xla.core.xla_model as xm

        self._sync(xm.collective_permute(tensor, pairs=[[self.rank, dst]]))

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        import torch_xla.core.xla_model as xm

        return self._sync(xm.collective_permute(like, pairs=[[src, self.rank]]))


def _sendrecv_gpipe(
    stage: Callable[[torch.Tensor], torch.Tensor],
    params: dict[str, torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    position: int,
    n_stages: int,
    replay: _SendRecvReplay,
) -> list[str]:
    """GPipe written with send/recv (all forwards, then all backwards); the programs' HLO."""
    rank = replay.rank
    saved = []
    for m in range(inputs.shape[0]):
        if position == 0:
            x = inputs[m]
        else:
            x = replay.recv(torch.zeros_like(inputs[m]), src=rank - 1).requires_grad_()
        y = stage(x)
        saved.append((x, y))
        if position < n_stages - 1:
            replay.send(y, dst=rank + 1)
    for m in reversed(range(inputs.shape[0])):
        x, y = saved[m]
        if position == n_stages - 1:
            grad = targets[m]  # d(sum(out * targets)) / d out
        else:
            grad = replay.recv(torch.zeros_like(y), src=rank + 1)
        y.backward(grad)
        if position > 0:
            replay.send(x.grad, dst=rank - 1)
    import torch_xla

    # The final sync of the step (the optimizer's): the accumulated parameter gradients.
    grads = [p.grad for p in params.values()]
    return [*replay.programs, torch_xla._XLAC._get_xla_tensors_hlo(grads)]


def traced_step_programs(
    micro_batches: int = 4, batch: int = 2, dim: int = 4, hidden: int = 6
) -> dict[str, list[str]]:
    """Rank function, traced and never executed: the HLO of one MLP pipeline step, three ways.

    ``"shift_open"`` / ``"shift_ring"``: :func:`~xla_permute.pipeline.pipeline_forward` with
    native stage shifts (open chain / ring), forward and autograd backward, as the one program
    one sync runs.
    ``"send_recv"``: the same step written with ``torch.distributed`` send/recv on the ``xla``
    backend, one program per sync that backend's code path makes (see ``_SendRecvReplay``),
    plus the step's final sync. Nothing is executed: the CPU mesh cannot run a permute without
    a channel id, and the traced tensors die before any sync.
    """
    import torch_xla
    import torch_xla.runtime as xr

    device = torch_xla.device()
    rank, n_stages = xr.global_ordinal(), xr.world_size()
    inputs, targets = example_batch(micro_batches, batch, dim)
    out: dict[str, list[str]] = {}
    for name, wrap in (("shift_open", False), ("shift_ring", True)):
        params = {
            k: v.to(device).requires_grad_() for k, v in mlp_stage_params(rank, dim, hidden).items()
        }
        outputs = pipeline_forward(
            functools.partial(mlp_stage, params),
            inputs[0].to(device),
            wrap=wrap,
            backend="native",
        )
        loss = (outputs * targets[0].to(device)).sum()
        loss.backward()
        grads = [p.grad for p in params.values()]
        out[name] = [torch_xla._XLAC._get_xla_tensors_hlo([loss, *grads])]
        discard_traced_collectives()  # the next trace starts a program of its own
    params = {
        k: v.to(device).requires_grad_() for k, v in mlp_stage_params(rank, dim, hidden).items()
    }
    out["send_recv"] = _sendrecv_gpipe(
        functools.partial(mlp_stage, params),
        params,
        inputs[0].to(device),
        targets[0].to(device),
        rank,
        n_stages,
        _SendRecvReplay(rank),
    )
    return out
