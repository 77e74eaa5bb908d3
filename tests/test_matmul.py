"""Collective matmul on the CPU mesh against the reference: exact, forward and backward.

One launch per mesh size: N=4 and N=2 run every case (all-gather-matmul and
matmul-reduce-scatter, uni- and bidirectional, 2-D and 3-D, both baselines, float32 with
integer values and bfloat16 with small integers; all-gather-matmul with ``chunks``,
matmul-reduce-scatter reading x in row slices), and traces the native rings for their overlap;
N=1 checks the plain-matmul degenerate case.
"""

import pytest
import ranks_matmul
import torch

from xla_permute import reference, run_on_mesh

SHAPES = [((3, 4), 0), ((2, 3, 4), 1), ((2, 3, 4), 0)]  # per-rank x of all-gather-matmul


def _ints(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).float()


def make_cases(n):
    cases = []
    seed = 0
    for op in ["agm", "mrs", "agm_base", "mrs_base"]:
        for bidirectional in [False, True] if "base" not in op else [False]:
            for dtype in [torch.float32, torch.bfloat16]:
                for per_rank, dim in SHAPES if dtype == torch.float32 else SHAPES[:1]:
                    shape = list(per_rank)
                    if op.startswith("mrs"):
                        shape[dim] *= n
                    seed += 1
                    xs = _ints(n, *shape, seed=seed)
                    ws = _ints(n, shape[-1], 5, seed=seed + 1000)
                    ref = (
                        reference.all_gather_matmul
                        if op.startswith("agm")
                        else (reference.matmul_reduce_scatter)
                    )
                    gs = _ints(*ref(xs, ws, dim).shape, seed=seed + 2000)
                    cases.append(
                        dict(
                            op=op,
                            bidirectional=bidirectional,
                            dim=dim,
                            xs=xs.to(dtype),
                            ws=ws.to(dtype),
                            gs=gs.to(dtype),
                            ref=ref,
                        )
                    )
    for op, bidirectional, per_rank, dim, f, chunks, dtype in CHUNKED:
        shape = list(per_rank)
        if op == "mrs":
            shape[dim] *= n
        seed += 1
        xs, ws = _ints(n, *shape, seed=seed), _ints(n, shape[-1], f, seed=seed + 1000)
        ref = reference.all_gather_matmul if op == "agm" else reference.matmul_reduce_scatter
        gs = _ints(*ref(xs, ws, dim).shape, seed=seed + 2000)
        cases.append(
            dict(
                op=op,
                bidirectional=bidirectional,
                dim=dim,
                xs=xs.to(dtype),
                ws=ws.to(dtype),
                gs=gs.to(dtype),
                ref=ref,
                chunks=chunks,
            )
        )
    return cases


#: all-gather-matmul with chunks=c; matmul-reduce-scatter with K > F, so that it reads each
#: block of x in row slices (4 for float32 K=8, F=2; 2 for bfloat16 with float32 sums).
CHUNKED = [
    ("agm", False, (4, 3), 0, 5, 2, torch.float32),
    ("agm", True, (4, 3), 0, 5, 4, torch.float32),
    ("agm", False, (2, 4, 3), 1, 5, 2, torch.bfloat16),
    ("mrs", False, (4, 8), 0, 2, None, torch.float32),
    ("mrs", True, (2, 4, 8), 1, 2, None, torch.float32),
    ("mrs", False, (4, 8), 0, 2, None, torch.bfloat16),
]


def expected(case):
    xs = case["xs"].clone().requires_grad_()
    ws = case["ws"].clone().requires_grad_()
    ys = case["ref"](xs, ws, case["dim"])
    (ys * case["gs"]).sum().backward()
    return ys.detach(), xs.grad, ws.grad


@pytest.fixture(scope="module", params=[4, 2], ids=["N=4", "N=2"])
def mesh_run(request):
    n = request.param
    cases = make_cases(n)
    sendable = [{k: v for k, v in c.items() if k != "ref"} for c in cases]
    return n, cases, run_on_mesh(ranks_matmul.matmul_suite, sendable, n=n)


def test_forward_and_backward_equal_reference(mesh_run):
    n, cases, per_rank = mesh_run
    failures = []
    for i, case in enumerate(cases):
        y, dx, dw = expected(case)
        got = {k: torch.stack([r["cases"][i][k] for r in per_rank]) for k in ("y", "dx", "dw")}
        label = (
            f"{case['op']} bi={case['bidirectional']} dim={case['dim']} {case['xs'].dtype} "
            f"chunks={case.get('chunks')}"
        )
        for name, want in (("y", y), ("dx", dx), ("dw", dw)):
            if got[name].dtype != want.dtype or not torch.equal(got[name], want):
                failures.append(f"{label}: {name} differs")
    assert not failures, failures
    assert len(cases) == 24 + len(CHUNKED)  # 2 ops x 2 directions x 4 + 2 baselines x 4


def test_bad_inputs_raise_before_any_collective(mesh_run):
    n, _, per_rank = mesh_run
    errors = per_rank[0]["errors"]
    assert (
        errors["not divisible"].startswith("ValueError")
        and f"by the {n} ranks" in (errors["not divisible"])
    )
    assert "inner dimensions differ" in errors["inner dims"]
    assert errors["dtypes"].startswith("TypeError") and "cast one of them" in errors["dtypes"]
    assert (
        "not an XLA device" in errors["cpu tensor"]
        and "to(torch_xla.device())" in (errors["cpu tensor"])
    )
    assert "contracted (last) dimension" in errors["contracted dim"]
    assert "is not a dimension of x" in errors["dim out of range"]
    assert "w must be 2-D" in errors["w not 2-D"]
    assert "at least 2-D" in errors["x 1-D"]
    assert errors["chunks=0"].startswith("ValueError: all_gather_matmul: chunks must be an int")
    for bad in ("True", "'2'"):  # not an int: a TypeError
        assert errors[f"chunks={bad}"].startswith("TypeError: all_gather_matmul: chunks must")
    assert "chunks=3 does not divide x.shape[0] = 2" in errors["chunks=3"]
    assert "use a divisor such as 1, 2" in errors["chunks=3"]
    assert all(r["errors"] == errors for r in per_rank)


def test_world_size_one_is_a_plain_matmul():
    cases = [c for c in make_cases(1) if c["op"] in ("agm", "mrs")][:6]
    sendable = [{k: v for k, v in c.items() if k != "ref"} for c in cases]
    (out,) = run_on_mesh(ranks_matmul.matmul_cases, sendable, n=1)
    for case, got in zip(cases, out, strict=True):
        y, dx, dw = expected(case)
        assert torch.equal(got["y"], case["xs"][0] @ case["ws"][0]) and torch.equal(got["y"], y[0])
        assert torch.equal(got["dx"], dx[0]) and torch.equal(got["dw"], dw[0])


def test_native_rings_overlap_every_matmul_with_a_permute(mesh_run):
    """From the traced native HLO of each rank: matmul-reduce-scatter (x read in 4 row slices
    per block) computes step t+1's matmuls while step t's permutes are in flight (none depends
    on them); chunked all-gather-matmul sends c (N-1) permutes, each in flight during a
    matmul."""
    n, _, per_rank = mesh_run
    for rank in per_rank:
        h = rank["hlo"]
        uni = h["mrs bi=False chunks=1"]
        assert uni["permutes"] == n - 1 and uni["dots"] == 4 * n
        assert uni["next_step"] == [(4, 0)] * (n - 1)  # 4 chunks, none waits for the permute
        bi = h["mrs bi=True chunks=1"]
        assert bi["permutes"] == n - 1 and bi["dots"] == 4 * n
        assert all(count >= 4 and dependent == 0 for count, dependent in bi["next_step"]), bi
        agm = h["agm bi=False chunks=2"]
        assert agm["permutes"] == 2 * (n - 1) and agm["dots"] == 2 * n
        assert all(count >= 1 for count in agm["independent"]), agm
