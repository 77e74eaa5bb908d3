"""The compile-barrier bench on the tiniest sizes: both programs, barrier on and off, N=2."""

from xla_permute_tools.bench.barrier import format_barrier_report, run_barrier_bench

LOOP = {"hidden": 32, "ffn": 32, "seq": 4, "batch": 1, "warmup": 1, "steps": 1}
LLAMA = {"layers": 1, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 32, "seq": 8,
         "batch": 1, "warmup": 1, "steps": 1}  # fmt: skip


def test_both_programs_run_with_and_without_the_barrier_to_equal_losses():
    result = run_barrier_bench(2, LOOP, LLAMA)
    assert sorted(result["programs"]) == ["llama", "loop"]
    for r in result["programs"].values():
        for label in ("on", "off"):
            run = r[label]
            assert run["aborted"] is None
            assert len(run["steps_s"]) == 2 and run["first_s"] == run["steps_s"][0] > 0
            assert run["later_s"] == run["steps_s"][1] > 0
            assert len(run["losses"]) == 2 and all(len(ls) == 2 for ls in run["losses"])
        # the same programs, compiled before the meeting or inside the sync: equal losses
        assert r["losses_equal"] and r["max_loss_diff"] == 0.0
        assert r["on"]["losses"] == r["off"]["losses"]
        assert r["ratio"]["first_s"] == r["on"]["first_s"] / r["off"]["first_s"]
    # tensor parallel: the vocabulary-parallel loss is the same number on every rank
    llama = result["programs"]["llama"]["on"]["losses"]
    assert llama[0] == llama[1]
    report = format_barrier_report(result)
    assert "2-device CPU mesh" in report and "Llama 1 layers, hidden 32" in report
    assert report.count("losses on vs off: equal (2 steps)") == 2
