"""Training loops on the 4- and 8-device mesh equal the same model trained on one device.

Every layer kind (ColumnParallelLinear, RowParallelLinear, SequenceParallelMLP, GatedMLP,
and ring attention inside tutorial 10's transformer block on a TP x CP grid) is trained for
3 steps, with SGD (the layers, the block) and AdamW (the MLPs, the block), the way users
write it: ``opt.zero_grad()``, backward, gradient sums of replicated weights,
``opt.step()``, ``torch_xla.sync()``; with the defaults (no environment overrides). One
mesh launch per mesh size runs its cases (the rank functions below, `train_cases`).

Tolerance: the exact cases (ReLU, SGD with lr 1/2, integer-valued weights and data in
{-1, 0, 1}, a loss whose output gradient is an integer tensor) must be *equal*; the test
first checks that the single-device float32 run equals the float64 run, so that every value
of it is exact and no summation order can change it. The others (GELU, SwiGLU, softmax,
RMSNorm, AdamW) sum in another order than one device does: the mesh must be as close to the
float64 run as one device's float32 run is (`check`).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xla_permute as xp
from xla_permute import run_on_mesh

B, S, STEPS = 2, 16, 3
# ---------------------------------------------------------------- the models and the ranks
# Multi-step training loops on the mesh, and the single-device models they must equal.
#
# Every case is one model kind trained for ``steps`` optimizer steps the way users write it
# (``opt.zero_grad()``, forward, ``loss.backward()``, ``opt.step()``, ``torch_xla.sync()``).
# The single-device models live here too, so that the test and the ranks build the same thing:
# the ranks take their shard of the single-device model (``from_linear`` / ``from_mlp``).
#
# Kinds (per rank, N ranks, ``x [B, S, H]``):
#
# * ``column``: ``act(ColumnParallelLinear(H -> F))``, x sharded along the sequence, output
#   ``[B, S, F/N]``;
# * ``row``: ``act(RowParallelLinear(F -> H))``, x sharded along its features, output
#   ``[B, S/N, H]``;
# * ``mlp``: :class:`~xla_permute.tensor_parallel.mlp.SequenceParallelMLP` ``(H -> F -> H)``;
# * ``gated``: :class:`~xla_permute.tensor_parallel.mlp.GatedMLP`;
# * ``block2d``: tutorial 10's transformer block on a ``Mesh2D(tp=2, cp=N/2)``: TP gated MLP
#   and attention heads, sequence parallel, causal zigzag ring attention over the CP groups;
#   gradients of replicated weights summed with
#   :func:`~xla_permute.collectives.all_reduce_gradients`.
#
# Each rank's loss (:func:`loss_of`) covers the values it holds; the total loss is the sum
# over ranks.

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


# ---------------------------------------------------------------- the cases

EXACT = {"loss": "dot", "opt": "sgd", "lr": 0.5, "exact": True}
FLOAT = {"loss": "mse", "lr": 1e-2, "exact": False}
CASES = [
    {"kind": "column", "act": "relu", **EXACT},
    {"kind": "row", "act": "relu", **EXACT},
    {"kind": "mlp", "act": "relu", **EXACT},
    {"kind": "mlp", "act": "gelu", "opt": "adamw", **FLOAT},
    {"kind": "gated", "act": "relu_product", "opt": "sgd", **FLOAT},
    {"kind": "gated", "act": "swiglu", "opt": "adamw", **FLOAT},
    {"kind": "block2d", "act": "", "opt": "adamw", **FLOAT},
    {"kind": "block2d", "act": "", "opt": "sgd", **FLOAT},
]
IDS = [f"{c['kind']}-{c['act'] or 'softmax'}-{c['opt']}" for c in CASES]
# Each rank compiles its own programs, so an 8-device launch costs about twice the CPU of a
# 4-device one, and AdamW steps compile two programs (the first step creates the optimizer's
# state): 83 s of CPU for the block alone on 8 devices with AdamW, 32 s with SGD. To keep
# the suite's budget, the 4-device launch trains every case and the 8-device one the case
# that uses every kind of ring: the block on its 2 x 4 TP x CP grid, with SGD.
MESHES = {4: [0, 1, 2, 3, 4, 5, 6], 8: [7]}
# How a parallel parameter's shards make the single-device one: concatenated along dim 0 or
# 1 over the tensor-parallel ranks, or "same" (replicated: every copy must be equal).
LAYOUT = {
    "column": {"weight": 0, "bias": 0},
    "row": {"weight": 1, "bias": "same"},
    "mlp": {"fc1.weight": 0, "fc1.bias": 0, "fc2.weight": 1, "fc2.bias": "same"},
    "gated": {
        "gate.weight": 0,
        "gate.bias": 0,
        "up.weight": 0,
        "up.bias": 0,
        "down.weight": 1,
        "down.bias": "same",
    },
    "block2d": {
        "qkv.0": ("q.weight", 0),
        "qkv.1": ("k.weight", 0),
        "qkv.2": ("v.weight", 0),
        "o.weight": 1,
        "mlp.gate.weight": ("gate.weight", 0),
        "mlp.up.weight": ("up.weight", 0),
        "mlp.down.weight": ("down.weight", 1),
    },
}


def case_data(case: dict, seed: int):
    """The single-device model, input and target of a case."""
    torch.manual_seed(seed)  # the host's generator (the mesh has not started here)
    model = single_device(case["kind"], case["act"])
    g = torch.Generator().manual_seed(seed)
    width_in = FFN if case["kind"] == "row" else H
    width_out = FFN if case["kind"] == "column" else H
    if case["exact"]:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())
        x = torch.randint(-1, 2, (B, S, width_in), generator=g).float()
        target = torch.randint(-1, 2, (B, S, width_out), generator=g).float()
    else:
        x, target = (
            torch.randn(B, S, width_in, generator=g),
            torch.randn(B, S, width_out, generator=g),
        )
    return model, x, target


def train_one_device(case: dict, model, x, target, dtype=torch.float32):
    model = copy.deepcopy(model).to(dtype)
    x, target = x.to(dtype), target.to(dtype)
    opt = optimizer(case["opt"], model.parameters(), case["lr"])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = loss_of(case["loss"], forward(case["kind"], case["act"], model, x), target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), {k: p.detach() for k, p in model.named_parameters()}


_LAUNCHES: dict[int, object] = {}


def launch(n: int):
    """One mesh launch per mesh size, every case of it, once per module (a failed launch
    fails its other tests without launching again)."""
    if n not in _LAUNCHES:
        try:
            _LAUNCHES[n] = _launch(n)
        except Exception as e:
            _LAUNCHES[n] = e
            raise
    if isinstance(_LAUNCHES[n], Exception):
        pytest.fail(f"the {n}-device launch failed: {_LAUNCHES[n]}"[:2000])
    return _LAUNCHES[n]


def _launch(n: int):
    data = {c: case_data(CASES[c], c) for c in MESHES[n]}
    cases = [{**CASES[c], "steps": STEPS} for c in data]
    per_rank = run_on_mesh(
        train_cases,
        cases,
        [m.state_dict() for m, _, _ in data.values()],
        [x for _, x, _ in data.values()],
        [t for _, _, t in data.values()],
        n=n,
        timeout=900,  # the heaviest launches of the suite: slow, not hung, on a loaded machine
    )
    return data, {c: [r[i] for r in per_rank] for i, c in enumerate(data)}


def assemble(kind: str, name: str, copies: list[torch.Tensor], n: int):
    """(single-device name, full tensor) from every rank's copy of one parameter."""
    layout = LAYOUT.get(kind, {}).get(name, "same")
    if layout == "same":  # replicated on every rank: the same bits everywhere
        assert all(torch.equal(c, copies[0]) for c in copies), f"{name} copies differ"
        return name, copies[0]
    full_name, dim = layout if isinstance(layout, tuple) else (name, layout)
    if kind != "block2d":
        return full_name, torch.cat(copies, dim)
    mesh = mesh_of(n)  # a TP shard, replicated over its CP group
    for group in mesh.cp_groups:
        assert all(torch.equal(copies[r], copies[group[0]]) for r in group), f"{name} CP copies"
    return full_name, torch.cat([copies[r] for r in mesh.tp_groups[0]], dim)


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference, relative to the largest value of ``want``."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def check(what: str, got: torch.Tensor, one: torch.Tensor, exact: torch.Tensor | None) -> None:
    """``got`` (the mesh) against ``one`` (one device, float32): equal when ``exact`` is
    None; else as close to the float64 run ``exact`` as one device is (AdamW divides by the
    root of the squared gradient, which magnifies float32's rounding in small gradients: one
    device itself is up to ~2e-6 away from float64), and within 1e-5 of one device."""
    if exact is None:
        assert torch.equal(got, one), f"{what}: mesh {got} != one device {one}"
        return
    mesh, single = error(got, exact), error(one, exact)
    assert mesh <= 2 * single + 1e-6, f"{what}: mesh {mesh:.1e} vs one device {single:.1e}"
    assert error(got, one) <= 1e-5, f"{what}: {error(got, one):.1e} from one device"


@pytest.mark.parametrize(
    "n, c",
    [(n, c) for n, cs in MESHES.items() for c in cs],
    ids=[f"n{n}-{IDS[c]}" for n, cs in MESHES.items() for c in cs],
)
def test_training_equals_one_device(n, c):
    data, per_case = launch(n)
    case = CASES[c]
    model, x, target = data[c]
    want_losses, want_params = train_one_device(case, model, x, target)
    losses64, params64 = train_one_device(case, model, x, target, torch.float64)
    if case["exact"]:  # the premise: float32 is exact on this data, so any order is too
        assert torch.equal(want_losses.double(), losses64)
        assert all(torch.equal(p.double(), params64[k]) for k, p in want_params.items())
    truth = (lambda k: None) if case["exact"] else params64.get
    results = per_case[c]
    losses = torch.stack([r["losses"] for r in results]).sum(0)
    check("losses", losses, want_losses, None if case["exact"] else losses64)
    names = results[0]["params"].keys()
    got = dict(assemble(case["kind"], k, [r["params"][k] for r in results], n) for k in names)
    assert got.keys() == want_params.keys()
    for k, want in want_params.items():
        check(f"{k} (n={n})", got[k], want, truth(k))
    # The steps did something: every parameter moved.
    start = dict(model.named_parameters())
    assert all(not torch.equal(got[k], start[k].detach()) for k in got)
