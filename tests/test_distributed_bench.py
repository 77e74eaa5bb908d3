"""``bench --backend c10d`` at its tiny preset: one torchrun launch of 2 processes (gloo).

The smoke test of tools/bench/c10d.py: ring and baseline side by side, the results equal
(allclose), the ring's bytes per rank counted at the backend's send equal the baseline's
``N-1`` blocks, the timeline has one hop per permute, and the report prints. Timings are
printed, never asserted.
"""

from __future__ import annotations

import pytest

from xla_permute_tools.bench.c10d import config_with, format_c10d_report, run_c10d_bench


@pytest.fixture(scope="module")
def bench():
    return run_c10d_bench(config_with("tiny", ops=("all_gather_matmul",)), progress=print)


def test_ring_and_baseline_agree_and_send_the_same_bytes(bench):
    (launch,) = bench["launches"]
    n, c = launch["n"], bench["config"]
    assert n == 2 and all(launch["agree"].values()) and launch["agree"]
    rows = {r["variant"]: r for r in launch["rows"]}
    assert set(rows) == {"ring", "bi", "baseline"}
    block = c["m"] * c["k"] * 4  # one float32 x block
    assert rows["ring"]["bytes_per_rank"] == rows["baseline"]["bytes_per_rank"] == (n - 1) * block
    assert rows["bi"]["bytes_per_rank"] == (n - 1) * block
    assert rows["baseline"]["ratio"] == 1.0 and all(r["seconds"] > 0 for r in rows.values())


def test_timeline_has_every_hop_in_order(bench):
    (launch,) = bench["launches"]
    assert len(launch["timeline"]) == launch["n"]
    for rank in launch["timeline"]:
        assert len(rank["hops"]) == launch["n"] - 1
        for hop in rank["hops"]:
            assert hop["posted"] <= hop["wait"] <= hop["waited"] <= rank["end"]
            assert hop["posted"] <= hop["arrived"] <= hop["waited"]


def test_report_prints_the_table_and_the_checks(bench):
    report = format_c10d_report(bench)
    print(report)
    assert "N=2 processes" in report and "all_gather_matmul" in report
    assert "[ok] ring == baseline (allclose) for all_gather_matmul at N=2" in report
