"""Mesh2D (the TP x CP grid: places, groups, two-level token sharding) on the host, and
all_reduce / all_reduce_gradients on the 4-device mesh (one launch, the rank function below)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import xla_permute as xp
from xla_permute import run_on_mesh

# The mesh probe (one launch): its rank function


def probe(xs: torch.Tensor, gs: torch.Tensor, groups: list[list[int]]) -> dict[str, Any]:
    """``xs[r]``, ``gs[r]``: rank r's input and output gradient (integer-valued)."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    r, dev = xr.global_ordinal(), torch_xla.device()
    out: dict[str, Any] = {"coords": xp.Mesh2D(tp=2, cp=xr.world_size() // 2).coords()}

    x = xs[r].to(dev).requires_grad_()
    y_all = xp.all_reduce(x)  # 15 values over 4 ranks: padded
    y_group = xp.all_reduce(x, groups=groups)
    (y_group * gs[r].to(dev)).sum().backward()
    scalar = xp.all_reduce(torch.tensor(float(r + 1), device=dev))
    empty = xp.all_reduce(torch.zeros(0, 3, device=dev))
    torch_xla.sync()
    out.update(all=y_all, group=y_group, grad=x.grad, scalar=scalar, empty=empty)

    # Gradients of two dtypes, one parameter without a gradient, one empty.
    w32 = torch.nn.Parameter(xs[r, 0].to(dev))
    w64 = torch.nn.Parameter(xs[r, 1].double().to(dev))
    unused = torch.nn.Parameter(torch.ones(2, device=dev))
    nothing = torch.nn.Parameter(torch.ones(0, device=dev))
    (
        (w32 * gs[r, 0].to(dev)).sum() + (w64 * gs[r, 1].double().to(dev)).sum() + nothing.sum()
    ).backward()
    xp.all_reduce_gradients([w32, unused, w64, nothing], groups=groups)
    torch_xla.sync()
    out.update(g32=w32.grad, g64=w64.grad, unused=unused.grad, nothing=nothing.grad)

    # A disagreement (debug mode, on in tests): every rank raises before the collective.
    try:
        xp.all_reduce(torch.ones(2 if r == 0 else 3, device=dev))
        out["disagreement"] = None
    except Exception as e:  # noqa: BLE001 - reported to the test, which asserts on it
        out["disagreement"] = (type(e).__name__, str(e))
    try:
        xp.Mesh2D(tp=2, cp=1).coords()
        out["wrong_size"] = None
    except ValueError as e:
        out["wrong_size"] = str(e)
    return out


# ------------------------------------------------------------------ Mesh2D (host, pure)


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 2), (2, 4), (4, 2), (1, 3), (3, 1)])
def test_places_and_groups(tp, cp):
    mesh = xp.Mesh2D(tp=tp, cp=cp)
    assert mesh.size == tp * cp
    places = [mesh.coords(r) for r in range(mesh.size)]
    assert sorted(places) == sorted((t, c) for t in range(tp) for c in range(cp))
    assert all(mesh.rank(*mesh.coords(r)) == r for r in range(mesh.size))
    assert all(r % tp == t for r, (t, _) in enumerate(places))  # TP innermost
    # Groups partition the ranks; a TP group shares c, a CP group shares t, in order.
    for groups, same, order in ((mesh.tp_groups, 1, 0), (mesh.cp_groups, 0, 1)):
        assert sorted(r for g in groups for r in g) == list(range(mesh.size))
        for g in groups:
            assert len({places[r][same] for r in g}) == 1
            assert [places[r][order] for r in g] == list(range(len(g)))
    assert xp.check_groups(mesh.tp_groups, mesh.size) and xp.check_groups(mesh.cp_groups, mesh.size)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("tp, cp", [(2, 2), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_two_level_sharding(tp, cp, layout):
    mesh, s = xp.Mesh2D(tp=tp, cp=cp), 2 * tp * cp * 3
    x = torch.arange(2 * s * 3).reshape(2, s, 3)
    shards = mesh.shard_sequence(x, dim=1, layout=layout)
    assert shards.shape == (mesh.size, 2, s // mesh.size, 3)
    assert torch.equal(mesh.unshard_sequence(shards, dim=1, layout=layout), x)
    assert torch.equal(mesh.unshard_sequence(list(shards), dim=1, layout=layout), x)
    # A TP group's pieces, concatenated in group order, are its CP shard in `layout`.
    cp_shards = xp.shard_sequence(x, dim=1, n=cp, layout=layout)
    for c, group in enumerate(mesh.tp_groups):
        assert torch.equal(torch.cat([shards[r] for r in group], 1), cp_shards[c])
    positions = mesh.positions(s, layout=layout)
    assert sorted(p for ps in positions for p in ps) == list(range(s))
    assert all(torch.equal(shards[r, :, :, 0], x[:, ps, 0]) for r, ps in enumerate(positions))


def test_zigzag_example():
    assert xp.Mesh2D(tp=2, cp=2).positions(8) == [[0, 1], [6, 7], [2, 3], [4, 5]]


def test_empty_sequence():
    mesh = xp.Mesh2D(tp=2, cp=2)
    shards = mesh.shard_sequence(torch.zeros(2, 0, 3), dim=1)
    assert shards.shape == (4, 2, 0, 3)
    assert mesh.unshard_sequence(shards, dim=1).shape == (2, 0, 3)


def test_refusals():
    with pytest.raises(TypeError, match="tp must be an int"):
        xp.Mesh2D(tp=2.0, cp=2)
    with pytest.raises(ValueError, match="cp must be an int >= 1"):
        xp.Mesh2D(tp=2, cp=0)
    mesh = xp.Mesh2D(tp=2, cp=2)
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 4\)"):
        mesh.coords(4)
    with pytest.raises(ValueError, match=r"cp_index must be an int in \[0, 2\)"):
        mesh.rank(0, 2)
    with pytest.raises(ValueError, match="not divisible by 8 .*zigzag.*pad the sequence"):
        mesh.shard_sequence(torch.zeros(1, 12), dim=1)
    with pytest.raises(ValueError, match="layout must be one of"):
        mesh.shard_sequence(torch.zeros(1, 8), dim=1, layout="ring")
    with pytest.raises(ValueError, match="dim=2 is not a dimension"):
        mesh.shard_sequence(torch.zeros(1, 8), dim=2)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        mesh.shard_sequence([1, 2], dim=0)
    with pytest.raises(ValueError, match="has 4 ranks, got 2 shards"):
        mesh.unshard_sequence([torch.zeros(2)] * 2, dim=0)
    assert mesh == xp.Mesh2D(tp=2, cp=2) and mesh != xp.Mesh2D(tp=4, cp=1)
    assert repr(mesh) == "Mesh2D(tp=2, cp=2)"


def test_all_reduce_refuses_before_any_runtime():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        xp.all_reduce([1.0])
    with pytest.raises(ValueError, match="not an XLA device"):
        xp.all_reduce(torch.ones(2))
    with pytest.raises(TypeError, match=r"parameters\[1\] is a int"):
        xp.all_reduce_gradients([torch.ones(1), 3])
    xp.all_reduce_gradients([torch.ones(1, requires_grad=True)])  # no gradients: nothing to do


# ------------------------------------------------------------------ on the mesh


N = 4
GROUPS = [[0, 2], [1, 3]]


@pytest.fixture(scope="module")
def run():
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(-9, 10, (N, 3, 5), generator=g).float()
    gs = torch.randint(-9, 10, (N, 3, 5), generator=g).float()
    return xs, gs, run_on_mesh(probe, xs, gs, GROUPS, n=N)


def _group(r):
    return next(g for g in GROUPS if r in g)


def test_all_reduce_sums_over_all_ranks_and_groups(run):
    xs, _, per_rank = run
    for r, out in enumerate(per_rank):
        assert torch.equal(out["all"], xs.sum(0))
        assert torch.equal(out["group"], xs[_group(r)].sum(0))
        assert out["scalar"].shape == () and out["scalar"].item() == 1 + 2 + 3 + 4
        assert out["empty"].shape == (0, 3)


def test_all_reduce_backward_sums_the_gradients(run):
    _, gs, per_rank = run
    for r, out in enumerate(per_rank):
        assert torch.equal(out["grad"], gs[_group(r)].sum(0))


def test_all_reduce_gradients(run):
    _, gs, per_rank = run
    for r, out in enumerate(per_rank):
        assert out["g32"].dtype == torch.float32 and out["g64"].dtype == torch.float64
        assert torch.equal(out["g32"], gs[_group(r), 0].sum(0))
        assert torch.equal(out["g64"], gs[_group(r), 1].sum(0).double())
        assert out["unused"] is None and out["nothing"].shape == (0,)


def test_ranks_that_disagree_raise_everywhere(run):
    _, _, per_rank = run
    for out in per_rank:
        kind, message = out["disagreement"]
        assert kind == "DisagreementError" and "all_reduce" in message and "x.shape" in message


def test_mesh2d_coords_on_the_mesh(run):
    _, _, per_rank = run
    assert [out["coords"] for out in per_rank] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert all(
        "Mesh2D(tp=2, cp=1) has 2 ranks but this run has 4" in out["wrong_size"] for out in per_rank
    )
