"""``bench --backend c10d`` at its tiny preset: one torchrun launch of 2 processes (gloo).

The smoke test of tools/bench/c10d.py: ring and baseline side by side, the results equal
(allclose), the ring's bytes per rank counted at the backend's send equal the baseline's
``N-1`` blocks, every ring row carries its compute alone, transfers alone, floor and hidden
fraction (and the launch its probe, spread and load), the timeline has one hop per permute,
and the report prints. Timings are printed, never asserted.
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


def test_every_ring_carries_its_parts_alone_and_the_launch_its_probe(bench):
    (launch,) = bench["launches"]
    for r in launch["rows"]:
        low, high = r["spread"]
        assert low <= r["seconds"] <= high and r["slowest_rank"] in range(launch["n"])
        if r["variant"] == "baseline":
            assert "compute_seconds" not in r
            continue
        compute, transfer = r["compute_seconds"], r["transfer_seconds"]
        assert compute > 0 and transfer > 0
        assert r["floor_seconds"] == max(compute, transfer)
        want = (compute + transfer - r["seconds"]) / min(compute, transfer)
        assert r["hidden_fraction"] == want
    assert set(launch["probe"]) == {"matmul", "transfer", "both", "hidden_fraction"}
    assert len(launch["load"]) == 2


def test_loopback_and_replay_stand_in_for_the_backend_and_restore_it():
    import torch

    from xla_permute_tools.bench import overlap

    class Backend:
        def __init__(self):
            self.sent = []

        def send(self, x, pairs, tag=0):
            self.sent.append((tuple(x.shape), tag))
            return overlap._Back(x + 1)

    backend, record = Backend(), []
    with overlap.recorded(backend, record):
        with overlap.loopback(backend):
            x = torch.zeros(2, 3)
            assert backend.send(x, [(0, 1)]).wait() is x  # no transfer, its own tensor
        assert torch.equal(backend.send(torch.zeros(4), [(0, 1)], 7).wait(), torch.ones(4))
    assert "send" not in backend.__dict__  # the class's own again
    assert record == [((4,), torch.float32, ((0, 1),), 7)]
    overlap.replay(backend, record)()
    assert backend.sent == [((4,), 7), ((4,), 7)]


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
