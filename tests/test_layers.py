"""A training step of the sequence-parallel MLP on the 4-device mesh equals the single-device one.

Tolerance: with ReLU and integer-valued weights and data every value is an exactly
representable integer, so loss, gradients and updated parameters must be *equal*. With GELU
the ranks sum partial products in another order than one device does, so we allow a relative
error of 1e-6 of the largest entry (float32 has a 6e-8 unit roundoff; the sums have <= 64 terms).
"""

import threading

import pytest
import torch
from ranks_matmul import mlp_train_step
from torch import nn

from xla_permute import run_on_mesh
from xla_permute.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

H, F, B, S, N = 8, 16, 2, 8, 4
LR = 2.0**-10
VARIANTS = [
    {"activation": act, "strategy": strategy, "bidirectional": bi}
    for act in ("relu", "gelu")
    for strategy, bi in (("ring", False), ("ring", True), ("baseline", False))
]


def _int_like(t, g):
    return torch.randint(-2, 3, t.shape, generator=g).float()


@pytest.fixture(scope="module")
def run():
    g = torch.Generator().manual_seed(0)
    fc1, fc2 = nn.Linear(H, F), nn.Linear(F, H)
    with torch.no_grad():
        for p in (*fc1.parameters(), *fc2.parameters()):
            p.copy_(_int_like(p, g))
    x, target = _int_like(torch.empty(B, S, H), g), _int_like(torch.empty(B, S, H), g)
    per_rank = run_on_mesh(
        mlp_train_step,
        fc1.state_dict(),
        fc2.state_dict(),
        x,
        target,
        VARIANTS,
        LR,
        n=N,
    )
    return fc1, fc2, x, target, per_rank


def single_device(fc1, fc2, x, target, activation):
    f1, f2 = nn.Linear(H, F), nn.Linear(F, H)
    f1.load_state_dict(fc1.state_dict())
    f2.load_state_dict(fc2.state_dict())
    act = {"relu": nn.functional.relu, "gelu": nn.functional.gelu}[activation]
    loss = ((f2(act(f1(x))) - target) ** 2).sum()
    loss.backward()
    grads = {
        "fc1.weight": f1.weight.grad,
        "fc1.bias": f1.bias.grad,
        "fc2.weight": f2.weight.grad,
        "fc2.bias": f2.bias.grad,
    }
    return (
        loss.detach(),
        grads,
        {
            k: p.detach() - LR * grads[k]
            for k, p in (
                ("fc1.weight", f1.weight),
                ("fc1.bias", f1.bias),
                ("fc2.weight", f2.weight),
                ("fc2.bias", f2.bias),
            )
        },
    )


def gather_shards(shards, key):
    """Reassemble the full tensor from the ranks' shards (or check a replicated one)."""
    if key == "fc2.bias":  # replicated: every rank must hold the same
        assert all(torch.equal(s, shards[0]) for s in shards)
        return shards[0]
    return torch.cat(shards, dim=1 if key == "fc2.weight" else 0)


def close(got, want, exact):
    if exact:
        return torch.equal(got, want)
    return (got - want).abs().max() <= 1e-6 * want.abs().max()


@pytest.mark.parametrize("v", range(len(VARIANTS)), ids=[str(v) for v in VARIANTS])
def test_training_step_matches_single_device(run, v):
    fc1, fc2, x, target, per_rank = run
    variant = VARIANTS[v]
    exact = variant["activation"] == "relu"
    loss, grads, params = single_device(fc1, fc2, x, target, variant["activation"])
    total = sum(r[v]["loss"] for r in per_rank)
    assert close(total, loss, exact), (total, loss)
    for key in grads:
        for kind, want in (("grads", grads[key]), ("params", params[key])):
            got = gather_shards([r[v][kind][key] for r in per_rank], key)
            assert close(got, want, exact), f"{kind} {key}"


def test_sharding_shapes_and_errors():
    col = ColumnParallelLinear(8, 16, world_size=4, rank=1)
    row = RowParallelLinear(16, 8, world_size=4, rank=1)
    assert col.weight.shape == (4, 8) and col.bias.shape == (4,)
    assert row.weight.shape == (8, 4) and row.bias.shape == (8,)
    with pytest.raises(ValueError, match="out_features = 10 is not divisible by the 4 ranks"):
        ColumnParallelLinear(8, 10, world_size=4, rank=0)
    with pytest.raises(ValueError, match="in_features = 6 is not divisible"):
        RowParallelLinear(6, 8, world_size=4, rank=0)
    with pytest.raises(ValueError, match="rank 4 is outside the world of 4 ranks"):
        ColumnParallelLinear(8, 16, world_size=4, rank=4)


def test_from_linear_takes_this_ranks_shard():
    full = nn.Linear(8, 16)
    col = ColumnParallelLinear.from_linear(full, world_size=4, rank=2)
    row = RowParallelLinear.from_linear(nn.Linear(16, 8), world_size=4, rank=3)
    assert torch.equal(col.weight, full.weight[8:12]) and torch.equal(col.bias, full.bias[8:12])
    assert row.weight.shape == (8, 4)


def test_initialisation_uses_the_given_generator():
    a = ColumnParallelLinear(
        8, 16, world_size=4, rank=0, generator=torch.Generator().manual_seed(3)
    )
    b = ColumnParallelLinear(
        8, 16, world_size=4, rank=0, generator=torch.Generator().manual_seed(3)
    )
    assert torch.equal(a.weight, b.weight) and a.weight.abs().max() <= 8**-0.5


_ASKED = threading.local()  # per rank thread: the backend names the ops resolved
_SPY = threading.Lock()


def _backends_asked(strategy, x, g):
    """On each rank: a column- and a row-parallel layer built with ``backend="emulated"``, run
    forward and backward with ``strategy``; the backend names the ops asked for (every op
    resolves its ``backend=`` through ``xla_permute.backends.select.get_backend``, wrapped once per
    process to record the name per rank thread) and the input's gradient."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute.backends.select as backend

    with _SPY:
        if not hasattr(backend.get_backend, "records"):
            real = backend.get_backend

            def recording(name="auto", x=None):
                _ASKED.__dict__.setdefault("names", []).append(name)
                return real(name, x)

            recording.records = True
            backend.get_backend = recording
    r, n, device = xr.global_ordinal(), xr.world_size(), torch_xla.device()
    kw = dict(strategy=strategy, backend="emulated", dim=0)
    col, row = ColumnParallelLinear(4, 8, **kw).to(device), RowParallelLinear(8, 4, **kw).to(device)
    _ASKED.names = []
    xr_ = x.chunk(n)[r].to(device).requires_grad_()
    y = row(col(xr_))
    (y * g.chunk(n)[r].to(device)).sum().backward()
    torch_xla.sync()
    return sorted(set(_ASKED.names)), xr_.grad.cpu()


@pytest.mark.parametrize("strategy", ["baseline", "ring"])
def test_layers_run_every_collective_on_their_own_backend(strategy):
    """A layer built with ``backend="emulated"`` (or ``"c10d"``) runs all its collectives there,
    the baseline's and the bias's gradient sum included; none falls back to ``"auto"``."""
    x, g = torch.ones(4, 4), torch.ones(4, 4)
    for names, dx in run_on_mesh(_backends_asked, strategy, x, g, n=2):
        assert names == ["emulated"], names
        assert dx.shape == (2, 4)
