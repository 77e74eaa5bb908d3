"""Tensor parallelism within groups of an 8-device mesh: collectives and both collective
matmuls, rings in the group's order, exact against the reference applied group by group."""

import pytest
import torch

import xla_permute as xp
from xla_permute import reference

N = 8
GROUPS = {
    "2x4": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "strided": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "topology": [[0, 2, 4, 6, 7, 5, 3, 1]],
}


def _ints(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def grouped(fn, groups, *per_rank):
    """``fn`` of the reference, applied to each group's ranks in the group's order."""
    out = [None] * N
    for g in groups:
        result = fn(*[t[list(g)] for t in per_rank])
        for pos, rank in enumerate(g):
            out[rank] = result[pos]
    return torch.stack(out)


def suite(xs, xs_rs, ws, groups_by_name):
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    r, d = xr.global_ordinal(), torch_xla.device()
    out = {}
    for name, groups in groups_by_name.items():
        for bi in (False, True):
            x = xs[r].to(d).requires_grad_()
            w = ws[r].to(d).requires_grad_()
            y = xp.all_gather_matmul(x, w, dim=0, bidirectional=bi, groups=groups)
            y.sum().backward()
            out[f"{name}/agm/{bi}"] = (y, x.grad, w.grad)
            torch_xla.sync()
            x = xs_rs[r].to(d).requires_grad_()
            w = ws[r].to(d).requires_grad_()
            y = xp.matmul_reduce_scatter(x, w, dim=0, bidirectional=bi, groups=groups)
            y.sum().backward()
            out[f"{name}/mrs/{bi}"] = (y, x.grad, w.grad)
            torch_xla.sync()
        x = xs[r].to(d)
        out[f"{name}/agm_base"] = xp.all_gather_then_matmul(x, ws[r].to(d), dim=0, groups=groups)
        out[f"{name}/mrs_base"] = xp.matmul_then_reduce_scatter(
            xs_rs[r].to(d), ws[r].to(d), dim=0, groups=groups
        )
        out[f"{name}/all_gather"] = xp.all_gather(x, 0, groups=groups)
        out[f"{name}/reduce_scatter"] = xp.reduce_scatter(xs_rs[r].to(d), 0, groups=groups)
        torch_xla.sync()
    return out


@pytest.fixture(scope="module")
def run():
    xs, ws = _ints(N, 2, 3, seed=1), _ints(N, 3, 2, seed=2)
    xs_rs = {n: _ints(N, 2 * n, 3, seed=3) for n in (4, 8)}
    # one x for mrs per group size: run the two sizes with the x of each group's size
    outs = {}
    for size in (4, 8):
        chosen = {k: v for k, v in GROUPS.items() if len(v[0]) == size}
        outs[size] = xp.run_on_mesh(suite, xs, xs_rs[size], ws, chosen, n=N)
    return xs, xs_rs, ws, outs


@pytest.mark.parametrize("name", list(GROUPS))
def test_groups_match_the_reference_group_by_group(run, name):
    xs, xs_rs, ws, outs = run
    groups = GROUPS[name]
    size = len(groups[0])
    per_rank = outs[size]
    for op, ref, xin in (
        ("agm", reference.all_gather_matmul, xs),
        ("mrs", reference.matmul_reduce_scatter, xs_rs[size]),
    ):
        x = xin.clone().requires_grad_()
        w = ws.clone().requires_grad_()
        y = grouped(lambda a, b, ref=ref: ref(a, b, 0), groups, x, w)
        y.sum().backward()
        for bi in (False, True):
            got = [r[f"{name}/{op}/{bi}"] for r in per_rank]
            assert torch.equal(torch.stack([g[0] for g in got]), y.detach()), (op, bi)
            assert torch.equal(torch.stack([g[1] for g in got]), x.grad), (op, bi)
            assert torch.equal(torch.stack([g[2] for g in got]), w.grad), (op, bi)
        base = torch.stack([r[f"{name}/{op}_base"] for r in per_rank])
        assert torch.equal(base, y.detach()), op
    ag = grouped(lambda a: reference.all_gather(a, 0), groups, xs)
    assert torch.equal(torch.stack([r[f"{name}/all_gather"] for r in per_rank]), ag)
    rs = grouped(lambda a: reference.reduce_scatter(a, 0), groups, xs_rs[size])
    assert torch.equal(torch.stack([r[f"{name}/reduce_scatter"] for r in per_rank]), rs)
