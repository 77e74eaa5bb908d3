"""Training loops on the 4- and 8-device mesh equal the same model trained on one device.

Every layer kind (ColumnParallelLinear, RowParallelLinear, SequenceParallelMLP, GatedMLP,
and ring attention inside tutorial 10's transformer block on a TP x CP grid) is trained for
3 steps, with SGD (the layers, the block) and AdamW (the MLPs, the block), the way users
write it: ``opt.zero_grad()``, backward, gradient sums of replicated weights,
``opt.step()``, ``torch_xla.sync()``; with the defaults (no environment overrides). One
mesh launch per mesh size runs its cases (tests/ranks_training.py).

Tolerance: the exact cases (ReLU, SGD with lr 1/2, integer-valued weights and data in
{-1, 0, 1}, a loss whose output gradient is an integer tensor) must be *equal*; the test
first checks that the single-device float32 run equals the float64 run, so that every value
of it is exact and no summation order can change it. The others (GELU, SwiGLU, softmax,
RMSNorm, AdamW) sum in another order than one device does: the mesh must be as close to the
float64 run as one device's float32 run is (`check`).
"""

from __future__ import annotations

import copy

import pytest
import ranks_training as rt
import torch

from xla_permute import run_on_mesh

B, S, STEPS = 2, 16, 3
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
    "gated": {"gate.weight": 0, "gate.bias": 0, "up.weight": 0, "up.bias": 0,
              "down.weight": 1, "down.bias": "same"},  # fmt: skip
    "block2d": {"qkv.0": ("q.weight", 0), "qkv.1": ("k.weight", 0), "qkv.2": ("v.weight", 0),
                "o.weight": 1, "mlp.gate.weight": ("gate.weight", 0),
                "mlp.up.weight": ("up.weight", 0), "mlp.down.weight": ("down.weight", 1)},
}  # fmt: skip


def case_data(case: dict, seed: int):
    """The single-device model, input and target of a case."""
    torch.manual_seed(seed)  # the host's generator (the mesh has not started here)
    model = rt.single_device(case["kind"], case["act"])
    g = torch.Generator().manual_seed(seed)
    width_in = rt.FFN if case["kind"] == "row" else rt.H
    width_out = rt.FFN if case["kind"] == "column" else rt.H
    if case["exact"]:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randint(-1, 2, p.shape, generator=g).float())
        x = torch.randint(-1, 2, (B, S, width_in), generator=g).float()
        target = torch.randint(-1, 2, (B, S, width_out), generator=g).float()
    else:
        x, target = torch.randn(B, S, width_in, generator=g), torch.randn(B, S, width_out,
                                                                           generator=g)  # fmt: skip
    return model, x, target


def train_one_device(case: dict, model, x, target, dtype=torch.float32):
    model = copy.deepcopy(model).to(dtype)
    x, target = x.to(dtype), target.to(dtype)
    opt = rt.optimizer(case["opt"], model.parameters(), case["lr"])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = rt.loss_of(case["loss"], rt.forward(case["kind"], case["act"], model, x), target)
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
        rt.train_cases, cases, [m.state_dict() for m, _, _ in data.values()],
        [x for _, x, _ in data.values()], [t for _, _, t in data.values()], n=n,
        timeout=900,  # the heaviest launches of the suite: slow, not hung, on a loaded machine
    )  # fmt: skip
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
    mesh = rt.mesh_of(n)  # a TP shard, replicated over its CP group
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
    "n, c", [(n, c) for n, cs in MESHES.items() for c in cs],
    ids=[f"n{n}-{IDS[c]}" for n, cs in MESHES.items() for c in cs],
)  # fmt: skip
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
