"""The roofline cost model: limits, monotonicity, crossover, and the published validation."""

from __future__ import annotations

import dataclasses
import math

import pytest

from xla_permute_tools import cost, validation
from xla_permute_tools.cost import CHIPS, Workload
from xla_permute_tools.cost.chips import _FIGURES

TORUS = ["tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "trn1", "trn2"]


def no_latency(chip: cost.Chip) -> cost.Chip:
    return dataclasses.replace(chip, hop_latency=0.0, collective_overhead=0.0)


# ---------------------------------------------------------------- registry


@pytest.mark.parametrize("key", sorted(CHIPS))
def test_every_figure_has_a_citation(key):
    chip = CHIPS[key]
    for figure in _FIGURES:
        assert chip.sources[figure].strip(), figure
        assert getattr(chip, figure) >= 0
    assert set(chip.assumptions) <= set(_FIGURES)
    for figure in chip.assumptions:
        assert "assum" in chip.sources[figure], (key, figure)


def test_tpu_figures_are_the_scaling_books():
    # The book's TPU Specs table (bf16 FLOP/s, ICI one-way per link), as quoted in PUBLISHED.md.
    book = {
        "tpu-v4": (2.75e14, 4.5e10),
        "tpu-v5e": (1.97e14, 4.5e10),
        "tpu-v5p": (4.59e14, 9e10),
        "tpu-v6e": (9.20e14, 9e10),
    }
    for key, (flops, link) in book.items():
        assert (CHIPS[key].peak_flops, CHIPS[key].link_bandwidth) == (flops, link)
        assert CHIPS[key].hop_latency == 1e-6


def test_unpublished_trainium_figures_are_marked_as_assumptions():
    for key in ("trn1", "trn2"):
        assert {"link_bandwidth", "hop_latency"} <= set(CHIPS[key].assumptions)


def test_h100_peak_agrees_with_the_published_utilisation_column():
    # JAX Pallas MGPU table: time and tensor-core utilisation imply the peak the doc used.
    flops = 2 * 1024 * 4096 * 4096
    table = {
        2: [(102, 0.68), (92, 0.75), (147, 0.47)],
        4: [(212, 0.66), (190, 0.73)],
        8: [(436, 0.64), (386, 0.72), (565, 0.49)],
    }
    for n, cells in table.items():
        for t_us, util in cells:
            implied = n * flops / (t_us * 1e-6) / util
            assert implied == pytest.approx(CHIPS["h100"].peak_flops, rel=0.02)


def test_chip_without_a_citation_is_rejected():
    sources = dict(CHIPS["tpu-v5e"].sources)
    del sources["hop_latency"]
    with pytest.raises(ValueError, match="hop_latency"):
        dataclasses.replace(CHIPS["tpu-v5e"], sources=sources)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"m": 0}, ValueError, "m must be a positive number"),
        ({"k": -1}, ValueError, "k must be a positive number"),
        ({"n_devices": 0}, ValueError, "n_devices must be an int >= 1"),
        ({"n_devices": 2.0}, TypeError, "n_devices must be an int"),
        ({"op": "all_reduce"}, ValueError, "op must be one of"),
    ],
)
def test_bad_workload(kwargs, error, match):
    args = {"m": 8, "k": 8, "n": 8, "n_devices": 4, **kwargs}
    with pytest.raises(error, match=match):
        Workload(**args)


def test_bad_method_and_vary():
    work = Workload(m=8, k=8, n=8, n_devices=4)
    with pytest.raises(ValueError, match="method must be one of"):
        cost.predict(CHIPS["tpu-v5e"], work, "ring")
    with pytest.raises(ValueError, match="vary must be"):
        cost.crossover(CHIPS["tpu-v5e"], 4, vary="b")


# ---------------------------------------------------------------- limits and monotonicity


def test_matmul_roofline_limits():
    chip = CHIPS["tpu-v5e"]
    big = cost.matmul_time(chip, 8192, 8192, 8192)
    assert big == pytest.approx(2 * 8192**3 / chip.peak_flops)
    tiny = cost.matmul_time(chip, 8, 8, 8)
    assert tiny == pytest.approx(3 * 64 * 2 / chip.hbm_bandwidth)


@pytest.mark.parametrize("key", sorted(CHIPS))
@pytest.mark.parametrize("method", ["baseline", "uni", "bi"])
@pytest.mark.parametrize("dim", ["m", "k", "n"])
def test_time_grows_with_every_dimension(key, method, dim):
    chip, times = CHIPS[key], []
    for s in [2**i for i in range(0, 16)]:
        shape = {"m": 512, "k": 512, "n": 512, dim: s}
        times.append(cost.predict(chip, Workload(**shape, n_devices=4), method).total)
    assert times == sorted(times)


@pytest.mark.parametrize("method", ["baseline", "uni", "bi"])
def test_time_grows_with_latency_and_falls_with_bandwidth(method):
    chip, work = CHIPS["trn2"], Workload(m=1024, k=1024, n=1024, n_devices=8)
    t = cost.predict(chip, work, method).total
    slower = dataclasses.replace(chip, hop_latency=2 * chip.hop_latency)
    faster = dataclasses.replace(chip, link_bandwidth=2 * chip.link_bandwidth)
    assert cost.predict(slower, work, method).total > t > cost.predict(faster, work, method).total


@pytest.mark.parametrize("key", TORUS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_tiny_matrices_collective_matmul_no_better_than_baseline_plus_latency(key, n):
    chip, work = CHIPS[key], Workload(m=1, k=1, n=1, n_devices=n)
    base = cost.baseline_time(chip, work)
    uni = cost.collective_matmul_time(chip, work)
    step = cost.matmul_time(chip, 1, 1, 1)
    # Collective matmul can at most hide its (negligible) math; it pays latency per round, and
    # on an axis without wraparound (v5e/v6e below 16) its wrap pair crosses the line: N-1 hops.
    hops = 1 if work.wraps(chip) else n - 1
    extra = (n - 1) * (hops * chip.hop_latency + chip.collective_overhead)
    assert base - n * step <= uni <= base + extra + n * step
    assert cost.speedup(chip, work) <= 1.0 + 1e-5
    if n > 2:  # more rounds than the baseline's single bidirectional all-gather
        assert cost.speedup(chip, work) < 0.9


@pytest.mark.parametrize("key", sorted(CHIPS))
@pytest.mark.parametrize("bidirectional", [False, True])
def test_overlapped_time_tends_to_max_of_math_and_comm(key, bidirectional):
    chip = no_latency(CHIPS[key])
    method = "bi" if bidirectional else "uni"
    # Compute-dominated (wide w) and communication-dominated (w one column wide).
    for m, k, n in [(2048, 2048, 2**22), (2**14, 2**14, 1)]:
        p = cost.predict(chip, Workload(m=m, k=k, n=n, n_devices=8), method)
        assert p.total == pytest.approx(max(p.math, p.comm), rel=0.02)


@pytest.mark.parametrize("n", [3, 4, 5, 7, 8])
def test_bidirectional_halves_the_comm_term_on_a_full_ring(n):
    chip = CHIPS["tpu-v5p"]
    work = Workload(m=4096, k=4096, n=8, n_devices=n, wraparound=True)  # a full ring
    uni, bi = cost.predict(chip, work, "uni"), cost.predict(chip, work, "bi")
    expected = 0.5 if n % 2 else n / (2 * (n - 1))
    assert bi.comm / uni.comm == pytest.approx(expected)
    # Without a wraparound link, or behind one switch egress, both ways share the bandwidth.
    line = dataclasses.replace(work, wraparound=False)
    for other_chip, other_work in [(chip, line), (CHIPS["h100"], work)]:
        uni = cost.predict(other_chip, other_work, "uni")
        assert cost.predict(other_chip, other_work, "bi").comm == pytest.approx(uni.comm)


def test_comm_dominated_bidirectional_is_about_twice_as_fast():
    chip = no_latency(CHIPS["tpu-v6e"])
    work = Workload(m=2**14, k=2**14, n=1, n_devices=9, wraparound=True)  # a full ring
    assert cost.speedup(chip, work, bidirectional=True) / cost.speedup(chip, work) == (
        pytest.approx(2.0, rel=0.05)
    )


def test_reduce_scatter_is_the_time_reverse_of_all_gather():
    chip = CHIPS["trn1"]
    for method in ("baseline", "uni", "bi"):
        ag = cost.predict(chip, Workload(m=512, k=2048, n=2048, n_devices=6), method)
        rs = Workload(
            m=512, k=2048, n=2048, n_devices=6, op="matmul_reduce_scatter", reduce_dtype_bytes=2
        )
        assert cost.predict(chip, rs, method) == ag
    # What travels differs: x blocks (m x k) versus partial sums (m x n), float32 by default.
    rs_narrow = Workload(m=512, k=2048, n=64, n_devices=6, op="matmul_reduce_scatter")
    assert rs_narrow.block_bytes == 512 * 64 * 4
    assert dataclasses.replace(rs_narrow, reduce_dtype_bytes=2).block_bytes == 512 * 64 * 2


@pytest.mark.parametrize(
    "dtype, reduce_dtype",
    [
        ("bfloat16", None),
        ("float16", None),
        ("bfloat16", "bfloat16"),
        ("float32", None),
        ("float32", "float64"),
        ("float64", None),
        ("bfloat16", "float32"),
    ],
)
def test_partial_sum_bytes_are_what_the_code_sends(dtype, reduce_dtype):
    # One source of truth: the model's bytes per partial sum come from the code's own rule.
    import torch

    from xla_permute.reference import accumulation_dtype

    dt = getattr(torch, dtype)
    rd = None if reduce_dtype is None else getattr(torch, reduce_dtype)
    sent = accumulation_dtype(dt, rd).itemsize
    rd_bytes = None if rd is None else rd.itemsize
    assert cost.partial_sum_bytes(dt.itemsize, rd_bytes) == sent
    work = Workload(
        m=8,
        k=4,
        n=16,
        n_devices=4,
        dtype_bytes=dt.itemsize,
        op="matmul_reduce_scatter",
        reduce_dtype_bytes=rd_bytes,
    )
    assert work.block_bytes == 8 * 16 * sent
    assert cost.partial_sum_bytes(2) == 4  # bf16 partial sums travel as float32 by default
    with pytest.raises(ValueError, match="reduce_dtype_bytes must be one of"):
        Workload(m=8, k=4, n=16, n_devices=4, reduce_dtype_bytes=3)


@pytest.mark.parametrize("key", ["tpu-v5e", "tpu-v6e"])
def test_v5e_and_v6e_wrap_round_only_on_a_full_axis_of_16(key):
    chip = CHIPS[key]
    assert chip.wraparound_axis == 16 and "16" in chip.sources["wraparound_axis"]
    assert [chip.wraparound(n) for n in (2, 4, 8, 16)] == [False, False, False, True]
    for n in (4, 8):  # the default is the chip's: a line, one direction, N-1 hops per round
        work = Workload(m=1024, k=1024, n=1024, n_devices=n)
        assert not work.wraps(chip)
        line = dataclasses.replace(work, wraparound=False)
        for method in ("baseline", "uni", "bi"):
            assert cost.predict(chip, work, method) == cost.predict(chip, line, method)
        ring = dataclasses.replace(work, wraparound=True)
        assert (
            cost.predict(chip, ring, "baseline").total < cost.predict(chip, work, "baseline").total
        )
    assert Workload(m=1, k=1, n=1, n_devices=16).wraps(chip)
    for other in ("tpu-v4", "tpu-v5p"):  # v4p/v5p: axes that are multiples of 4 wrap round
        assert CHIPS[other].wraparound(4) and CHIPS[other].wraparound(8)
    assert CHIPS["trn2"].wraparound(4) and CHIPS["h100"].wraparound(3)


def test_one_device_is_a_plain_matmul():
    chip, work = CHIPS["tpu-v4"], Workload(m=300, k=200, n=100, n_devices=1)
    t = cost.matmul_time(chip, 300, 200, 100)
    for method in ("baseline", "uni", "bi"):
        assert cost.predict(chip, work, method).total == pytest.approx(t)


# ---------------------------------------------------------------- crossover


@pytest.mark.parametrize("key", sorted(CHIPS))
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_crossover_agrees_with_speedup(key, n, bidirectional):
    chip = CHIPS[key]
    s_star = cost.crossover(chip, n, bidirectional=bidirectional)

    def gain(s):
        return cost.speedup(chip, Workload(m=s, k=s, n=s, n_devices=n), bidirectional=bidirectional)

    assert 1.0 <= s_star < math.inf
    above = [s_star * 1.001 * 2 ** (i / 4) for i in range(40)]
    assert all(gain(s) >= 1.0 for s in above)
    if s_star > 1.0:
        assert gain(s_star * 0.999) < 1.0


def test_crossover_on_one_dimension_and_its_limits():
    chip = CHIPS["tpu-v5e"]
    shape = (4096, 4096, 4096)
    k_star = cost.crossover(chip, 4, vary="k", shape=shape)
    assert cost.speedup(chip, Workload(m=4096, k=k_star * 0.99, n=4096, n_devices=4)) < 1
    assert cost.speedup(chip, Workload(m=4096, k=k_star * 1.01, n=4096, n_devices=4)) >= 1
    slow = dataclasses.replace(chip, collective_overhead=1.0)
    assert cost.crossover(slow, 4, hi=64.0) == math.inf
    assert cost.crossover(CHIPS["h100"], 4, bidirectional=True) == 1.0


def test_crossover_table_covers_every_chip():
    rows = cost.crossover_table()
    assert {r["chip"] for r in rows} == set(CHIPS)
    for r in rows:
        assert r["bi"] <= r["uni"]  # bidirectional pays from smaller sizes on


# ---------------------------------------------------------------- validation


def test_validation_table_rows_come_from_the_model():
    rows = validation.validation_table()
    cases = [(r.source, r.case) for r in rows]
    assert len(rows) == 14 and len(set(cases)) == 14
    book = {r.case: r for r in rows if r.source == "scaling book"}
    assert {r.published_us for r in book.values()} == {224, 311, 244, 680, 8}
    v5e = CHIPS["tpu-v5e"]
    eff = 2 * 512 * 2048 * 2048 / 224e-6 / v5e.peak_flops
    work = Workload(m=512, k=512, n=2048, n_devices=4, dtype_bytes=4, wraparound=False)
    assert book["all-gather + matmul (default jit)"].predicted_us == pytest.approx(
        cost.baseline_time(v5e, work, efficiency=eff) * 1e6
    )
    assert book["collective matmul (ppermute, uni)"].predicted_us == pytest.approx(
        cost.collective_matmul_time(v5e, work, efficiency=eff) * 1e6
    )
    gpu = {r.case: r for r in rows if r.source == "JAX Pallas MGPU"}
    for n, published in [(2, 147), (4, 290), (8, 565)]:
        row = gpu[f"NCCL all-gather + cuBLAS, {n} GPUs"]
        work = Workload(m=1024, k=4096, n=4096, n_devices=n)
        assert row.published_us == published
        assert row.predicted_us == pytest.approx(cost.baseline_time(CHIPS["h100"], work) * 1e6)
    for r in rows:
        assert r.ratio == r.predicted_us / r.published_us
        if r.kind in ("fit", "identity"):
            assert r.ratio == pytest.approx(1.0)
    markdown = validation.format_validation_table(rows)
    assert markdown.count("\n") == len(rows) + 1


def test_h100_lower_bound_is_the_docs_formula():
    for r in validation.validation_table():
        if r.case.startswith("lower bound"):
            n = int(r.case.split(", ")[1].split()[0])
            assert r.predicted_us == pytest.approx(n * 43 + (n - 1) * 6, abs=0.01)


# Predictions that reach the 20% target, and the one that does not (with its documented bound).
WITHIN_20 = [
    ("scaling book", "all-gather + matmul (default jit)"),
    ("scaling book", "collective matmul (ppermute, uni)"),
    ("scaling book", "all-gather bf16[2048,8192] over 4"),
    ("JAX Pallas MGPU", "fused kernel, 2 GPUs"),
    ("JAX Pallas MGPU", "fused kernel, 4 GPUs"),
    ("JAX Pallas MGPU", "fused kernel, 8 GPUs"),
    ("JAX Pallas MGPU", "NCCL all-gather + cuBLAS, 4 GPUs"),
    ("JAX Pallas MGPU", "NCCL all-gather + cuBLAS, 8 GPUs"),
]


@pytest.mark.parametrize("source, case", WITHIN_20)
def test_prediction_within_20_percent(source, case):
    (row,) = [r for r in validation.validation_table() if (r.source, r.case) == (source, case)]
    assert row.kind == "prediction"
    assert 0.8 <= row.ratio <= 1.2, row


def test_nccl_two_gpus_is_underpredicted_within_30_percent():
    # The model assumes NCCL moves 8 MiB at the 450 GB/s link peak (18.6 us + 6 us); the
    # published 147 us minus 2 x 43 us of matmul leaves ~61 us, about 137 GB/s. The scaling
    # book's GPU chapter reports NCCL far below link peak at these message sizes. Not tuned.
    (row,) = [
        r for r in validation.validation_table() if r.case == "NCCL all-gather + cuBLAS, 2 GPUs"
    ]
    assert 0.7 <= row.ratio < 0.8


def test_every_prediction_row_is_classified():
    rows = validation.validation_table()
    predictions = {(r.source, r.case) for r in rows if r.kind == "prediction"}
    assert predictions == set(WITHIN_20) | {("JAX Pallas MGPU", "NCCL all-gather + cuBLAS, 2 GPUs")}


def test_tpu_v5e_is_the_most_consistent_chip_for_the_scaling_book_example():
    rows = validation.scaling_book_chip_check()
    worst = {
        r["chip"]: max(abs(1 - r["baseline_ratio"]), abs(1 - r["collective_ratio"])) for r in rows
    }
    assert min(worst, key=worst.get) == "tpu-v5e"


def test_the_model_is_built_from_reusable_pieces():
    assert cost.predict is cost.model.predict and cost.CHIPS is cost.chips.CHIPS
    chip, work = CHIPS["tpu-v5p"], Workload(m=512, k=4096, n=1024, n_devices=8)
    assert cost.link_time(chip, 9e10) == pytest.approx(1.0)  # 90 GB/s, one link, one way
    uni = cost.predict(chip, work, "uni")
    assert uni.comm == pytest.approx(7 * cost.link_time(chip, work.block_bytes))
    assert uni.math == pytest.approx(8 * cost.matmul_time(chip, 512, 4096, 1024))
    assert cost.directions(chip) == 2 and cost.directions(chip, wraparound=False) == 1
    assert cost.directions(CHIPS["h100"], wraparound=False) == 1  # one switch egress


# ---------------------------------------------------------------- chunked ring


@pytest.mark.parametrize("key", list(CHIPS))
def test_chunks_pay_one_latency_per_permute_and_keep_the_math(key):
    chip, work = CHIPS[key], Workload(m=2048, k=4096, n=2048, n_devices=8)
    one = cost.predict(chip, work, "uni")
    hops = 1 if (work.wraps(chip) or chip.switched) else work.n_devices - 1
    per_permute = hops * chip.hop_latency + chip.collective_overhead
    for c in (2, 4):
        p = cost.predict(chip, dataclasses.replace(work, chunks=c), "uni")
        assert p.math == pytest.approx(one.math) and p.comm == pytest.approx(one.comm)
        assert p.latency == pytest.approx(c * (work.n_devices - 1) * per_permute)
        # never cheaper than the unchunked ring minus its un-overlapped last matmul
        last = cost.matmul_time(chip, work.m, work.k, work.n)
        assert p.total >= one.total - last + last / c + (c - 1) * 7 * per_permute - 1e-12
        assert cost.chunk_overhead(chip, work, c) == pytest.approx(p.total / one.total - 1)


def test_chunks_cost_latency_when_compute_bound():
    chip = CHIPS["h100"]
    work = Workload(m=4096, k=8192, n=4096, n_devices=8)  # compute-bound on H100
    hops = work.n_devices - 1
    extra = (4 - 1) * hops * (chip.hop_latency + chip.collective_overhead)
    four = cost.predict(chip, dataclasses.replace(work, chunks=4), "uni").total
    assert four - cost.predict(chip, work, "uni").total == pytest.approx(extra, rel=1e-6)
    assert cost.chunk_overhead(chip, work, 1) == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"chunks": 0}, ValueError, "chunks must be an int >= 1, got 0"),
        ({"chunks": True}, TypeError, "chunks must be an int >= 1, got True"),
        ({"chunks": 2, "op": "matmul_reduce_scatter"}, ValueError, "option of all_gather_matmul"),
    ],
)
def test_bad_chunks(kwargs, error, match):
    with pytest.raises(error, match=match):
        Workload(m=8, k=8, n=8, n_devices=4, **kwargs)
