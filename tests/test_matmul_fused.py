"""Several weights on one ring, empty inputs, reduce_dtype, and the gated MLP: one N=4 launch.

Exact against xla_permute.reference (integer-valued inputs), forward and backward.
"""

import pytest
import torch
from torch import nn

import xla_permute as xp
from xla_permute import reference
from xla_permute.tensor_parallel.mlp import GatedMLP, relu_product, swiglu

N = 4


def _ints(*shape, seed, low=-3, high=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g).float()


def fused_cases():
    cases = []
    for i, (per_rank, dim, widths, bi) in enumerate(
        [
            ((3, 4), 0, (5, 2), False),
            ((3, 4), 0, (5, 2, 3), True),
            ((2, 3, 4), 1, (2, 2), False),
            ((2, 3, 4), 1, (3, 1), True),
            ((2, 3, 4), 0, (4,), False),
        ]
    ):
        xs = _ints(N, *per_rank, seed=10 * i)
        ws = [_ints(N, per_rank[-1], f, seed=10 * i + j + 1) for j, f in enumerate(widths)]
        gs = [
            _ints(*reference.all_gather_matmul(xs, w, dim).shape, seed=99 + j)
            for j, w in enumerate(ws)
        ]
        cases.append(dict(dim=dim, bi=bi, xs=xs, ws=ws, gs=gs))
    return cases


EMPTY = [  # (op, per-rank x shape, w shape, dim)
    ("agm", (0, 4), (4, 3), 0),
    ("agm", (2, 0), (0, 3), 0),
    ("agm", (2, 4), (4, 0), 0),
    ("mrs", (0, 4), (4, 3), 0),
    ("mrs", (4, 0), (0, 3), 0),
    ("mrs", (4, 4), (4, 0), 0),
    ("agm_base", (0, 4), (4, 3), 0),
    ("mrs_base", (4, 0), (0, 3), 0),
]


def suite(cases, mlp, xs_mlp, gs_mlp, empty):
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    r, d = xr.global_ordinal(), torch_xla.device()
    out = {"fused": [], "empty": [], "mlp": {}, "errors": {}}
    for c in cases:
        x = c["xs"][r].to(d).requires_grad_()
        ws = [w[r].to(d).requires_grad_() for w in c["ws"]]
        ys = xp.all_gather_matmul(x, ws, dim=c["dim"], bidirectional=c["bi"])
        base = xp.all_gather_then_matmul(x.detach(), [w.detach() for w in ws], dim=c["dim"])
        sum((y * g[r].to(d)).sum() for y, g in zip(ys, c["gs"], strict=True)).backward()
        out["fused"].append(
            dict(
                ys=list(ys),
                base=list(base),
                dx=x.grad,
                dws=[w.grad for w in ws],
                kind=type(ys).__name__,
            )
        )
        torch_xla.sync()
    single = xp.all_gather_matmul(cases[0]["xs"][r].to(d), cases[0]["ws"][0][r].to(d), dim=0)
    out["single_is_tensor"] = isinstance(single, torch.Tensor)
    fns = {
        "agm": xp.all_gather_matmul,
        "mrs": xp.matmul_reduce_scatter,
        "agm_base": xp.all_gather_then_matmul,
        "mrs_base": xp.matmul_then_reduce_scatter,
    }
    for op, xshape, wshape, dim in empty:  # every rank alike: no collective is issued
        x = torch.ones(xshape).to(d).requires_grad_()
        w = torch.ones(wshape).to(d).requires_grad_()
        y = fns[op](x, w, dim=dim)
        y.sum().backward()
        out["empty"].append(dict(y=y, dx=x.grad, dw=w.grad))
    torch_xla.sync()
    # bf16 partial sums travelling in bf16 (small integers: still exact) and in float32
    xb = cases[0]["xs"][r].repeat(N, 1).to(torch.bfloat16).to(d)
    wb = cases[0]["ws"][0][r].to(torch.bfloat16).to(d)
    out["reduce_dtype"] = {
        str(rd): xp.matmul_reduce_scatter(xb, wb, dim=0, reduce_dtype=rd)
        for rd in (None, torch.bfloat16, torch.float32)
    }
    torch_xla.sync()
    # the gated MLP from ordinary nn.Linears, both activations, with and without bias
    for name, (gate, up, down, act) in mlp.items():
        for strategy in ("ring", "baseline"):
            layer = GatedMLP.from_mlp(gate, up, down, act, strategy=strategy).to(d)
            x = xs_mlp[r].to(d).requires_grad_()
            y = layer(x)
            (y * gs_mlp[r].to(d)).sum().backward()
            grads = {k: p.grad for k, p in layer.named_parameters()}
            out["mlp"][f"{name}/{strategy}"] = dict(y=y, dx=x.grad, grads=grads)
            torch_xla.sync()

    def error(call):
        try:
            call()
        except (TypeError, ValueError, RuntimeError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    col = xp.ColumnParallelLinear
    out["errors"] = {
        "in 0": error(lambda: col(0, 8)),
        "in -4": error(lambda: col(-4, 8)),
        "in 8.0": error(lambda: col(8.0, 8)),
        "world '4'": error(lambda: col(8, 8, world_size="4", rank=0)),
        "strategy": error(lambda: col(8, 8, strategy="fast")),
        "backend": error(lambda: col(8, 8, backend="nccl")),
        "cpu params": error(lambda: col(8, 8)(torch.ones(2, 8, device=d))),
        "wrong world": error(
            lambda: col(8, 8, world_size=2, rank=r % 2).to(d)(torch.ones(2, 8, device=d))
        ),
        "reduce_dtype": error(
            lambda: xp.matmul_reduce_scatter(
                torch.ones(4, 2, device=d), torch.ones(2, 2, device=d), dim=0, reduce_dtype="f32"
            )
        ),
    }
    torch_xla.sync()
    return out


def _mlp(seed, act, bias, h=8, ffn=12):
    torch.manual_seed(seed)
    return (
        nn.Linear(h, ffn, bias=bias),
        nn.Linear(h, ffn, bias=bias),
        nn.Linear(ffn, h, bias=bias),
        act,
    )


def _integerise(*mods):
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in mods:
            for p in m.parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g).float() / 4)


@pytest.fixture(scope="module")
def run():
    cases = fused_cases()
    mlp = {
        "swiglu+bias": _mlp(0, swiglu, True),
        "relu_product": _mlp(1, relu_product, False),
    }
    for gate, up, down, _ in mlp.values():
        _integerise(gate, up, down)
    xs = _ints(N, 2, 2, 8, seed=5, low=-2, high=3) / 2  # [B, S/N, H] per rank
    gs = _ints(N, 2, 2, 8, seed=6)
    return cases, mlp, xs, gs, xp.run_on_mesh(suite, cases, mlp, xs, gs, EMPTY, n=N)


def test_several_weights_share_one_ring_forward_and_backward(run):
    cases, _, _, _, per_rank = run
    for i, c in enumerate(cases):
        x = c["xs"].clone().requires_grad_()
        ws = [w.clone().requires_grad_() for w in c["ws"]]
        ys = [reference.all_gather_matmul(x, w, c["dim"]) for w in ws]
        sum((y * g).sum() for y, g in zip(ys, c["gs"], strict=True)).backward()
        got = [r["fused"][i] for r in per_rank]
        assert all(g["kind"] == "tuple" for g in got)
        for j, y in enumerate(ys):
            assert torch.equal(torch.stack([g["ys"][j] for g in got]), y.detach()), (i, j)
            assert torch.equal(torch.stack([g["base"][j] for g in got]), y.detach()), (i, j)
            assert torch.equal(torch.stack([g["dws"][j] for g in got]), ws[j].grad), (i, j)
        assert torch.equal(torch.stack([g["dx"] for g in got]), x.grad), i
    assert all(r["single_is_tensor"] for r in per_rank)


def test_empty_inputs_give_the_empty_result(run):
    per_rank = run[-1]
    for k, (op, xshape, wshape, _) in enumerate(EMPTY):
        rows = xshape[0] * N if op.startswith("agm") else xshape[0] // N
        for r in per_rank:
            got = r["empty"][k]
            assert tuple(got["y"].shape) == (rows, wshape[1]), (op, xshape, wshape)
            assert not got["y"].any() and tuple(got["dx"].shape) == xshape
            assert tuple(got["dw"].shape) == wshape and not got["dw"].any()


def test_reduce_dtype(run):
    cases, per_rank = run[0], run[-1]
    xs = cases[0]["xs"].repeat(1, N, 1).to(torch.bfloat16)
    want = reference.matmul_reduce_scatter(xs, cases[0]["ws"][0].to(torch.bfloat16), 0)
    for key in ("None", "torch.bfloat16", "torch.float32"):
        got = torch.stack([r["reduce_dtype"][key] for r in per_rank])
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), key
    assert xp.reference.accumulation_dtype(torch.bfloat16) == torch.float32
    assert xp.reference.accumulation_dtype(torch.float16, torch.float16) == torch.float16
    assert xp.reference.accumulation_dtype(torch.float64) == torch.float64


def test_gated_mlp_equals_the_single_device_mlp(run):
    _, mlp, xs, gs, per_rank = run
    full_x = torch.cat(list(xs), dim=1).requires_grad_()  # [B, S, H]
    full_g = torch.cat(list(gs), dim=1)
    for name, (gate, up, down, act) in mlp.items():
        for m in (gate, up, down):
            m.zero_grad()
        full_x.grad = None
        y = down(act(gate(full_x), up(full_x)))
        (y * full_g).sum().backward()

        def same(a, b, exact=name == "relu_product"):  # silu is not integer-valued
            return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-5)

        for strategy in ("ring", "baseline"):
            got = [r["mlp"][f"{name}/{strategy}"] for r in per_rank]
            assert same(torch.cat([g["y"] for g in got], 1), y.detach()), name
            assert same(torch.cat([g["dx"] for g in got], 1), full_x.grad), name
            for part, lin, axis in (("gate", gate, 0), ("up", up, 0), ("down", down, 1)):
                w = torch.cat([g["grads"][f"{part}.weight"] for g in got], axis)
                assert same(w, lin.weight.grad), (name, part)
                if lin.bias is not None:
                    b = [g["grads"][f"{part}.bias"] for g in got]
                    b = torch.cat(b) if axis == 0 else b[0]
                    assert same(b, lin.bias.grad), (name, part)


def test_layer_arguments_are_checked(run):
    per_rank = run[-1]
    errors = per_rank[0]["errors"]
    assert errors["in 0"].startswith("ValueError") and "in_features" in errors["in 0"]
    assert errors["in -4"].startswith("ValueError") and "in_features" in errors["in -4"]
    assert errors["in 8.0"].startswith("TypeError") and "in_features" in errors["in 8.0"]
    assert errors["world '4'"].startswith("TypeError") and "world_size" in errors["world '4'"]
    assert "strategy must be one of" in errors["strategy"]
    assert "backend must be one of" in errors["backend"]
    assert "ColumnParallelLinear.weight is on cpu" in errors["cpu params"]
    assert "built for rank" in errors["wrong world"] and "of 2" in errors["wrong world"]
    assert (
        errors["reduce_dtype"].startswith("TypeError")
        and "reduce_dtype" in (errors["reduce_dtype"])
    )
    same = {
        k: v for k, v in errors.items() if k not in ("wrong world", "cpu params")
    }  # name the rank
    assert all({k: r["errors"][k] for k in same} == same for r in per_rank)


def test_a_layer_outside_a_mesh_needs_world_size_and_rank():
    import torch_xla

    assert not torch_xla._XLAC._xla_runtime_is_initialized()
    with pytest.raises(RuntimeError, match="world_size= and rank="):
        xp.ColumnParallelLinear(8, 8)
    assert not torch_xla._XLAC._xla_runtime_is_initialized()
    layer = xp.RowParallelLinear(8, 4, world_size=2, rank=1, dtype=torch.bfloat16)
    assert layer.weight.shape == (4, 4) and layer.weight.dtype == torch.bfloat16
