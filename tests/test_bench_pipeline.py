"""``bench --pipeline`` at its tiny preset: one torchrun launch of 2 processes (gloo).

The smoke test of tools/bench/pipeline.py: every schedule ran on the same model in one launch,
side by side, with the same loss; the ticks, shifts and bubble beside each are the schedule's;
the report and the command line print them. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse

import pytest

from xla_permute import SCHEDULES, make_schedule
from xla_permute_tools.bench import add_arguments
from xla_permute_tools.bench.pipeline import (
    STAGES_PER_RANK,
    PipelineBenchConfig,
    config_with,
    format_pipeline_report,
    run_pipeline_bench,
)


@pytest.fixture(scope="module")
def bench():
    return run_pipeline_bench(config_with("tiny"), progress=print)


def test_every_schedule_ran_with_the_same_loss(bench):
    assert [r["schedule"] for r in bench["rows"]] == list(SCHEDULES)
    assert bench["checks"] == [
        {"name": "every schedule gives the same loss (allclose)", "ok": True}
    ]
    c = bench["config"]
    for r in bench["rows"]:
        s = make_schedule(r["schedule"], c["n"], c["micro_batches"], STAGES_PER_RANK[r["schedule"]])
        assert (r["ticks"], r["shifts"], r["bubble"]) == (s.ticks, s.shift_count, s.bubble_fraction)
        assert r["seconds"] > 0 and r["loss"] > 0
    assert next(r["ratio"] for r in bench["rows"] if r["schedule"] == "1f1b") == 1.0


def test_report_prints_every_schedule(bench):
    report = format_pipeline_report(bench)
    print(report)
    assert all(name in report for name in SCHEDULES)
    assert "[ok] every schedule gives the same loss" in report


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="layers=6 must split into 4 equal stages"):
        PipelineBenchConfig(n=2, layers=6)
    with pytest.raises(ValueError, match="micro_batches=6: pass a multiple of n=4"):
        PipelineBenchConfig(n=4, micro_batches=6)


def test_the_command_line_has_the_option():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--pipeline", "--preset", "tiny"]).pipeline
