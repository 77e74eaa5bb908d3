"""Ring attention against scaled_dot_product_attention on the whole sequence, on one device.

Host tests check the schedule (every causal block computed exactly once, zigzag balanced).
One mesh launch per N in {1, 2, 4} runs every case (float64, float32, bfloat16; causal and
full; contiguous and zigzag; GQA; batch 2; odd head dims; groups; the all-gather baseline;
empty inputs; the bad inputs) on the emulated backend, and traces the native program for the
HLO evidence (permute count and operands, no all-gather, compute independent of the permute
in flight, the backward's permutes).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from xla_permute import run_on_mesh
from xla_permute.attention import ring_attention_schedule, schedule_work
from xla_permute.sequence import layout_chunks, shard_sequence, unshard_sequence

LAYOUTS = ("contiguous", "zigzag")
#: bfloat16: inputs rounded to bf16; the reference is float64 on those same inputs. Blocks are
#: merged in float32 and the result rounded once, so each value is within a few bf16 ulps.
BF16_BOUND = 2**-7


# ---------------------------------------------------------------- the schedule (host, pure)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_schedule_computes_every_needed_block_once(n, layout, causal):
    for rank in range(n):
        seen: list[tuple[int, int, bool]] = []
        for hop in ring_attention_schedule(n, rank, causal=causal, layout=layout):
            assert hop.source == (rank - hop.hop) % n
            held = layout_chunks(n, hop.source, layout)
            for b in hop.blocks:
                assert set(b.k_chunks) <= set(held)
                seen += [(i, j, b.causal) for i in b.q_chunks for j in b.k_chunks]
        chunks = n * (1 if layout == "contiguous" else 2)
        own = layout_chunks(n, rank, layout)
        want = [(i, j, causal and i == j) for i in own for j in range(chunks)]
        if causal:
            want = [(i, j, d) for i, j, d in want if j <= i]
        assert sorted(seen) == sorted(want)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work_contiguous_does_not(n):
    zig = [
        schedule_work(ring_attention_schedule(n, r, causal=True, layout="zigzag")) for r in range(n)
    ]
    assert all(w == [2.0] * n for w in zig)  # 2 chunk-pairs per rank per hop: half of 4
    con = [schedule_work(ring_attention_schedule(n, r, causal=True)) for r in range(n)]
    assert con[0] == [0.5] + [0] * (n - 1) and con[-1] == [0.5] + [1] * (n - 1)
    busiest = sum(max(w[t] for w in con) for t in range(n))
    assert sum(map(sum, con)) / (n * busiest) == pytest.approx(n / (2 * n - 1))


# ---------------------------------------------------------------- the mesh run


def _randn(*shape, gen, dtype):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def make_cases(n):
    """Host tensors (torch.Generator), sharded: each case carries per-rank slices."""
    gen = torch.Generator().manual_seed(12 + n)
    f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
    gqa = (2, 4, 2, 3)  # B, Hq, Hkv, D: batch 2, grouped-query, odd head dim
    if n == 4:  # the whole matrix, both precisions that matter, the baseline
        specs = [
            dict(dtype=f64, causal=causal, layout=layout, shape=gqa)
            for causal, layout in itertools.product([False, True], LAYOUTS)
        ]
        specs += [
            dict(dtype=bf16, causal=True, layout="zigzag", shape=(2, 2, 2, 8)),
            dict(dtype=f32, causal=True, layout="contiguous", shape=(2, 4, 1, 8)),
            dict(dtype=f64, causal=True, layout="zigzag", shape=gqa, op="gather"),
        ]
    else:
        specs = [
            dict(dtype=f64, causal=True, layout="zigzag", shape=(1, 3, 3, 7), scale=0.3),
            dict(dtype=f32, causal=False, layout="zigzag", shape=(1, 2, 2, 5)),
        ]
        if n == 2:
            specs.append(dict(dtype=f64, causal=True, layout="contiguous", shape=gqa, op="gather"))
    cases = []
    for spec in specs:
        b, hq, hkv, d = spec["shape"]
        s = 4 * n  # 4 rows per rank: two chunks of 2 for zigzag
        q, do = (_randn(b, hq, s, d, gen=gen, dtype=spec["dtype"]) for _ in range(2))
        k, v = (_randn(b, hkv, s, d, gen=gen, dtype=spec["dtype"]) for _ in range(2))
        shard = dict(dim=2, n=n, layout=spec["layout"])
        cases.append(
            dict(
                spec, full=(q, k, v, do), shards=[shard_sequence(t, **shard) for t in (q, k, v, do)]
            )
        )
    return cases


def expected(case):
    q, k, v, do = (t.to(torch.float64).requires_grad_() for t in case["full"])
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=case["causal"], scale=case.get("scale"), enable_gqa=True
    )
    (out * do.detach()).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def attention_suite(cases, trace_shape):
    """Every case (emulated), the bad inputs, empty inputs, groups, native HLO on this rank."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    r, n, dev = xr.global_ordinal(), xr.world_size(), torch_xla.device()
    out = {"cases": [], "errors": _errors(dev), "empty": [], "hlo": {}}
    for case in cases:
        q, k, v, do = (t[r].to(dev) for t in case["shards"])
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        kw = dict(causal=case["causal"], layout=case["layout"], scale=case.get("scale"))
        fn = xp.all_gather_attention if case.get("op") == "gather" else xp.ring_attention
        y = fn(q, k, v, **kw)
        torch_xla.sync()  # forward and backward apart: smaller programs compile faster
        (y * do).sum().backward()
        torch_xla.sync()
        out["cases"].append((y, q.grad, k.grad, v.grad))
    for shape in [(2, 4, 0, 3), (0, 2, 4, 3)]:  # S/N = 0 and B = 0: valid, no collective
        q = torch.ones(shape, device=dev).requires_grad_()
        kv = torch.ones(shape[0], 2, *shape[2:], device=dev).requires_grad_()
        y = xp.ring_attention(q, kv, kv, causal=True, layout="zigzag")
        text = xp.hlo.trace([y])
        y.sum().backward()
        out["empty"].append(
            (tuple(y.shape), tuple(kv.grad.shape), len(xp.hlo.parse(text).collectives()))
        )
    if n == 4:  # two rings of two ranks: groups
        g = [[0, 1], [2, 3]]
        q, k, v = (t[r].to(dev) for t in cases[0]["shards"][:3])
        y = xp.ring_attention(q, k, v, causal=True, groups=g, layout="zigzag")
        torch_xla.sync()
        out["groups"] = y
    with xp.hlo.tracing():  # the native permutes cannot run here: traced, never run
        out["hlo"] = _native_hlo(trace_shape, dev)
    return out


def _errors(dev):
    import xla_permute as xp

    def err(**kw):
        args = dict(q=torch.ones(1, 4, 4, 3, device=dev), k=torch.ones(1, 2, 4, 3, device=dev))
        args["v"] = args["k"]
        args.update(kw)
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        try:
            xp.ring_attention(q, k, v, **args)
        except (TypeError, ValueError) as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    one = torch.ones(1, 2, 4, 3, device=dev)
    return {
        "cpu": err(q=torch.ones(1, 4, 4, 3)),
        "3-D": err(q=torch.ones(4, 4, 3, device=dev)),
        "dtype": err(k=one.double(), v=one.double()),
        "int": err(q=torch.ones(1, 4, 4, 3, device=dev, dtype=torch.int32)),
        "heads": err(q=torch.ones(1, 3, 4, 3, device=dev)),
        "kv shapes": err(v=torch.ones(1, 2, 4, 5, device=dev)),
        "seq": err(k=torch.ones(1, 2, 6, 3, device=dev), v=torch.ones(1, 2, 6, 3, device=dev)),
        "layout": err(layout="ring"),
        "zigzag odd": err(
            q=torch.ones(1, 4, 3, 3, device=dev),
            k=torch.ones(1, 2, 3, 3, device=dev),
            v=torch.ones(1, 2, 3, 3, device=dev),
            layout="zigzag",
        ),
        "scale": err(scale=0.0),
        "scale bool": err(scale=True),
        "causal": err(causal="yes"),
        "groups": err(groups=[[0, 0]]),
        "backend": err(backend="nccl"),
    }


def _native_hlo(shape, dev):
    """Trace (never run) the native ring forward and backward, and the all-gather baseline."""
    import torch_xla.runtime as xr

    import xla_permute as xp
    from xla_permute.attention import ring_attention_schedule

    n, r = xr.world_size(), xr.global_ordinal()
    b, hq, hkv, s, d = shape
    res = {}
    for causal, layout in [(False, "contiguous"), (True, "contiguous"), (True, "zigzag")]:
        q = torch.ones(b, hq, s, d, device=dev).requires_grad_()
        k = torch.ones(b, hkv, s, d, device=dev).requires_grad_()
        v = torch.ones(b, hkv, s, d, device=dev).requires_grad_()
        y = xp.ring_attention(q, k, v, causal=causal, layout=layout, backend="native")
        forward = xp.hlo.parse(xp.hlo.trace([y]))
        permutes = [c for c in forward.collectives() if c.kind == "collective-permute"]
        schedule = ring_attention_schedule(n, r, causal=causal, layout=layout)
        entry = {
            "kinds": sorted({c.kind for c in forward.collectives()}),
            "operands": [forward.instructions[c.name].operand_types for c in permutes],
            "pairs": [c.pairs for c in permutes],
            "independent": [len(forward.independent_of(c.name)) for c in permutes],
            "blocks": [len(h.blocks) for h in schedule],
            "dots": len(forward.ops("dot")),
        }
        y = xp.ring_attention(q, k, v, causal=causal, layout=layout, backend="native")
        y.sum().backward()
        both = xp.hlo.parse(xp.hlo.trace([q.grad, k.grad, v.grad]))
        entry["backward_operands"] = [
            both.instructions[c.name].operand_types for c in both.collectives()
        ]
        # hop i's dots: those the permute starting hop i+1 needs and hop i's does not
        bwd = [c.name for c in both.collectives()][n - 1 :]
        dots = [d.name for d in both.ops("dot")]
        feeds = [{d for d in dots if both.depends_on(p, d)} for p in bwd]
        hops = [feeds[i + 1] - feeds[i] for i in range(len(bwd) - 1)]
        entry["backward_hops"] = [
            (len(h), sum(both.depends_on(d, bwd[i]) for d in h)) for i, h in enumerate(hops)
        ]
        entry["backward_kinds"] = sorted({c.kind for c in both.collectives()})
        res[(causal, layout)] = entry
    q = torch.ones(b, hq, s, d, device=dev)
    k = torch.ones(b, hkv, s, d, device=dev)
    y = xp.all_gather_attention(q, k, k, causal=True)
    gather = xp.hlo.parse(xp.hlo.trace([y]))
    res["gather"] = {
        "kinds": [c.kind for c in gather.collectives()],
        "independent": [len(gather.independent_of(c.name)) for c in gather.collectives()],
    }
    return res


#: The ranks compile different programs (causal skipping); unoptimised LLVM code compiles
#: faster, which keeps them within XLA:CPU's rendezvous timeout on a loaded machine.
FAST = {"XLA_FLAGS": "--xla_backend_optimization_level=0"}
TRACE_SHAPE = (1, 4, 2, 8, 4)  # B, Hq, Hkv, S/N, D of the traced native programs


@pytest.fixture(scope="module", params=[4, 2, 1], ids=["N=4", "N=2", "N=1"])
def mesh_run(request):
    n = request.param
    cases = make_cases(n)
    sendable = [{k: v for k, v in c.items() if k != "full"} for c in cases]
    return n, cases, run_on_mesh(attention_suite, sendable, TRACE_SHAPE, n=n, timeout=600, env=FAST)


def test_forward_and_backward_equal_sdpa(mesh_run):
    n, cases, per_rank = mesh_run
    failures = []
    for i, case in enumerate(cases):
        want = expected(case)
        label = f"{case.get('op', 'ring')} {case['dtype']} causal={case['causal']} {case['layout']}"
        for name, w, j in zip(("out", "dq", "dk", "dv"), want, range(4), strict=True):
            got = unshard_sequence(
                [rank["cases"][i][j] for rank in per_rank], dim=2, layout=case["layout"]
            )
            if got.dtype != case["dtype"] or got.shape != w.shape:
                failures.append(f"{label}: {name} dtype/shape {got.dtype} {tuple(got.shape)}")
                continue
            err = ((got.double() - w).abs().max() / w.abs().max()).item()
            bound = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: BF16_BOUND}
            if not err <= bound[case["dtype"]]:
                failures.append(f"{label}: {name} relative error {err:.2e}")
    assert not failures, failures


def test_groups_are_rings_of_their_own(mesh_run):
    n, cases, per_rank = mesh_run
    if n != 4:
        pytest.skip("groups run on the N=4 mesh")
    q, k, v, _ = cases[0]["shards"]  # ranks 0,1 and 2,3 each attend over their own pair
    for group in ([0, 1], [2, 3]):
        full = [unshard_sequence(t[group], dim=2, layout="zigzag") for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        got = unshard_sequence([per_rank[r]["groups"] for r in group], dim=2, layout="zigzag")
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_empty_inputs_issue_no_collective(mesh_run):
    _, _, per_rank = mesh_run
    for rank in per_rank:
        assert rank["empty"] == [((2, 4, 0, 3), (2, 2, 0, 3), 0), ((0, 2, 4, 3), (0, 2, 4, 3), 0)]


def test_bad_inputs_raise_before_any_collective(mesh_run):
    _, _, per_rank = mesh_run
    e = per_rank[0]["errors"]
    assert all(rank["errors"] == e for rank in per_rank)
    assert "not an XLA device" in e["cpu"] and "q is on device cpu" in e["cpu"]
    assert "q must be 4-D" in e["3-D"]
    assert e["dtype"].startswith("TypeError") and "one floating dtype" in e["dtype"]
    assert e["int"].startswith("TypeError")
    assert "multiple of the key/value heads" in e["heads"]
    assert "k and v must have one shape" in e["kv shapes"]
    assert "must agree in batch, local sequence" in e["seq"]
    assert "layout must be one of" in e["layout"]
    assert "local sequence length is 3 (odd)" in e["zigzag odd"]
    assert "scale must be a positive" in e["scale"] and "scale must" in e["scale bool"]
    assert e["causal"].startswith("TypeError") and "causal must be True or False" in e["causal"]
    assert "groups" in e["groups"] and "backend must be one of" in e["backend"]


def test_native_hlo_is_a_ring_of_kv_permutes(mesh_run):
    n, _, per_rank = mesh_run
    b, hq, hkv, s, d = TRACE_SHAPE
    kv_type = f"f32[2,{b},{hkv},{s},{d}]"
    for rank in per_rank:
        for key, h in ((k, v) for k, v in rank["hlo"].items() if k != "gather"):
            assert h["kinds"] == (["collective-permute"] if n > 1 else []), key
            assert len(h["operands"]) == n - 1  # N-1 hops, K and V in ONE operand each
            assert all(len(ops) == 1 and ops[0].startswith(kv_type) for ops in h["operands"])
            assert all(p == tuple((i, (i + 1) % n) for i in range(n)) for p in h["pairs"])
            # hop t's permute is in flight while hops 0..t compute: 2 dots per block
            assert h["independent"] == [2 * sum(h["blocks"][: t + 1]) for t in range(n - 1)]
            assert h["dots"] == 2 * sum(h["blocks"])
            # backward program: the forward's N-1, then K/V alone, N-2 of [k, v, dk, dv] (K/V
            # ahead, dK/dV one hop behind), dK/dV alone, and dK/dV home
            ops = [o[0].split("{")[0] for o in h["backward_operands"]]
            bwd = f"f32[4,{b},{hkv},{s},{d}]"
            assert h["backward_kinds"] == (["collective-permute"] if n > 1 else [])
            want = [kv_type] * (n - 1) + ([kv_type] + [bwd] * (n - 2) + [kv_type] * 2) * (n > 1)
            assert ops == want, key
            # every backward hop's dots are independent of the permute that starts the hop
            assert len(h["backward_hops"]) == (n if n > 1 else 0), key
            assert all(dependent == 0 for _, dependent in h["backward_hops"]), (key, h)
            if key == (False, "contiguous"):  # no hop skipped: N hops overlap their permute
                assert all(count > 0 for count, _ in h["backward_hops"]), h
        g = rank["hlo"]["gather"]
        assert g["kinds"] == ["all-gather"] and g["independent"] == [0]
