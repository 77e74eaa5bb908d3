"""Differentiable all-gather / reduce-scatter / sum_gradients on the mesh against the reference."""

import ranks_matmul
import torch

from xla_permute import hlo, reference, run_on_mesh

N = 2


def test_collectives_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(-3, 4, (N, 2, 3, 2), generator=g).float()
    gs_gather = torch.randint(-3, 4, (N, 2, 3 * N, 2), generator=g).float()
    gs_sum = torch.randint(-3, 4, (N, 2, 3, 2), generator=g).float()
    out = run_on_mesh(ranks_matmul.collectives_roundtrip, xs, gs_gather, gs_sum, n=N)

    x = xs.clone().requires_grad_()
    gathered = reference.all_gather(x, 1)
    scattered = reference.reduce_scatter(gathered, 1)
    ((gathered * gs_gather).sum() + (scattered * gs_sum).sum()).backward()
    for name, want in (("gathered", gathered), ("scattered", scattered), ("dx", x.grad)):
        assert torch.equal(torch.stack([o[name] for o in out]), want), name
    # sum_gradients: rank r's loss uses b with weight r+1; every rank gets the sum 1+..+N.
    # Its backward is the group sum of all_reduce: a reduce-scatter, then an all-gather.
    for o in out:
        assert torch.equal(o["db"], torch.full((3,), float(N * (N + 1) // 2)))
        kinds = [c.kind for c in hlo.parse(o["sum_hlo"]).collectives()]
        assert kinds == ["reduce-scatter", "all-gather"], kinds
