"""Multi-step training loops on the mesh, and the single-device models they must equal.

Every case is one model kind trained for ``steps`` optimizer steps the way users write it
(``opt.zero_grad()``, forward, ``loss.backward()``, ``opt.step()``, ``torch_xla.sync()``).
The single-device models live here too, so that the test and the ranks build the same thing:
the ranks take their shard of the single-device model (``from_linear`` / ``from_mlp``).

Kinds (per rank, N ranks, ``x [B, S, H]``):

* ``column``: ``act(ColumnParallelLinear(H -> F))``, x sharded along the sequence, output
  ``[B, S, F/N]``;
* ``row``: ``act(RowParallelLinear(F -> H))``, x sharded along its features, output
  ``[B, S/N, H]``;
* ``mlp``: :class:`~xla_permute.mlp.SequenceParallelMLP` ``(H -> F -> H)``;
* ``gated``: :class:`~xla_permute.mlp.GatedMLP`;
* ``block2d``: tutorial 10's transformer block on a ``Mesh2D(tp=2, cp=N/2)``: TP gated MLP
  and attention heads, sequence parallel, causal zigzag ring attention over the CP groups;
  gradients of replicated weights summed with
  :func:`~xla_permute.collectives.all_reduce_gradients`.

Each rank's loss (:func:`loss_of`) covers the values it holds; the total loss is the sum
over ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import xla_permute as xp

H, FFN, HEADS = 8, 16, 2
D = H // HEADS
ACTS = {"relu": F.relu, "gelu": F.gelu}
GATES = {"relu_product": xp.relu_product, "swiglu": xp.swiglu}


def heads(t: torch.Tensor) -> torch.Tensor:
    return t.unflatten(-1, (-1, D)).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).flatten(2)


class Mlp(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(H, FFN), nn.Linear(FFN, H), ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Gated(nn.Module):
    def __init__(self, act: str) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(H, FFN), nn.Linear(H, FFN)
        self.down, self.act = nn.Linear(FFN, H), GATES[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


class Block(nn.Module):
    """Tutorial 10's block: RMSNorm, causal attention, residual, RMSNorm, SwiGLU, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(H), nn.RMSNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False)
        self.down = nn.Linear(FFN, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.norm1(x)
        q, k, v = (heads(p(a)) for p in (self.q, self.k, self.v))
        x = x + self.o(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))
        m = self.norm2(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


class ParallelBlock(nn.Module):
    """This rank's shard of :class:`Block` on ``mesh`` (TP index ``t``)."""

    def __init__(self, block: Block, mesh: xp.Mesh2D, t: int) -> None:
        super().__init__()
        self.tp, self.cp = mesh.tp_groups, mesh.cp_groups
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.qkv = nn.ParameterList(
            nn.Parameter(p.weight.detach().chunk(mesh.tp)[t].clone())
            for p in (block.q, block.k, block.v)
        )
        self.o = xp.RowParallelLinear.from_linear(block.o, groups=self.tp)
        self.mlp = xp.GatedMLP.from_mlp(block.gate, block.up, block.down, groups=self.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.norm1(x)
        q, k, v = xp.all_gather_matmul(a, [w.T for w in self.qkv], dim=1, groups=self.tp)
        att = xp.ring_attention(
            heads(q), heads(k), heads(v), causal=True, layout="zigzag", groups=self.cp
        )
        x = x + self.o(merge_heads(att))
        return x + self.mlp(self.norm2(x))


def single_device(kind: str, act: str) -> nn.Module:
    """The single-device model of a case (initialised from torch's global generator)."""
    if kind == "column":
        return nn.Linear(H, FFN)
    if kind == "row":
        return nn.Linear(FFN, H)
    if kind == "mlp":
        return Mlp(act)
    if kind == "gated":
        return Gated(act)
    if kind == "block2d":
        return Block()
    raise ValueError(kind)


def mesh_of(n: int) -> xp.Mesh2D:
    return xp.Mesh2D(tp=2, cp=n // 2)


def forward(kind: str, act: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's output (an activation after the single linear layers)."""
    y = model(x)
    return ACTS[act](y) if kind in ("column", "row") else y


def shard_input(kind: str, t: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """This rank's part of the input ``x [B, S, *]``."""
    if kind == "row":
        return t.chunk(n, -1)[rank]
    if kind == "block2d":
        return mesh_of(n).shard_sequence(t, dim=1)[rank]
    return t.chunk(n, 1)[rank]


def shard_output(kind: str, t: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    """This rank's part of the output (or target) ``[B, S, *]``."""
    if kind == "column":
        return t.chunk(n, -1)[rank]
    if kind == "row":
        return t.chunk(n, 1)[rank]
    return shard_input(kind, t, n, rank)


def parallel(kind: str, model: nn.Module, n: int, rank: int) -> nn.Module:
    """This rank's shard of the single-device ``model``."""
    if kind == "column":
        return xp.ColumnParallelLinear.from_linear(model)
    if kind == "row":
        return xp.RowParallelLinear.from_linear(model)
    if kind == "mlp":
        return xp.SequenceParallelMLP.from_mlp(model.fc1, model.fc2, model.act)
    if kind == "gated":
        return xp.GatedMLP.from_mlp(model.gate, model.up, model.down, model.act)
    if kind == "block2d":
        return ParallelBlock(model, mesh_of(n), mesh_of(n).coords(rank)[0])
    raise ValueError(kind)


def loss_of(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``"mse"``: sum of squares of ``out - target``; ``"dot"``: ``sum(out * target)`` (the
    output's gradient is the integer ``target``: exact cases)."""
    return ((out - target) ** 2).sum() if name == "mse" else (out * target).sum()


def optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.AdamW(params, lr=lr)


def sum_replicated(kind: str, model: nn.Module, n: int) -> None:
    """After backward: sum the gradients of weights that several ranks hold alike."""
    if kind == "block2d":
        norms = [*model.norm1.parameters(), *model.norm2.parameters()]
        shards = [p for name, p in model.named_parameters() if not name.startswith("norm")]
        xp.all_reduce_gradients(norms)
        xp.all_reduce_gradients(shards, groups=mesh_of(n).cp_groups)


def train_cases(
    cases: list[dict[str, Any]], states: list[dict[str, torch.Tensor]], xs: list, targets: list
) -> list[dict[str, Any]]:
    """Rank function: every case trained for ``case["steps"]`` steps; per case the per-step
    loss of this rank and its parameters after the last step."""
    import torch_xla
    import torch_xla.runtime as xr

    rank, n, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
    results = []
    for case, state, x_full, target_full in zip(cases, states, xs, targets, strict=True):
        kind, act = case["kind"], case["act"]
        model = single_device(kind, act)
        model.load_state_dict(state)
        shard = parallel(kind, model, n, rank).to(device)
        opt = optimizer(case["opt"], shard.parameters(), case["lr"])
        x = shard_input(kind, x_full, n, rank).to(device)
        target = shard_output(kind, target_full, n, rank).to(device)
        losses = []
        for _ in range(case["steps"]):
            opt.zero_grad()
            loss = loss_of(case["loss"], forward(kind, act, shard, x), target)
            loss.backward()
            sum_replicated(kind, shard, n)
            opt.step()
            torch_xla.sync()
            losses.append(loss.detach())
        results.append({"losses": torch.stack(losses), "params": dict(shard.named_parameters())})
    return results
