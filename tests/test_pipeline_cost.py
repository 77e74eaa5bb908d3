"""The pipeline step-time model (xla_permute_tools.cost.pipeline): pure arithmetic on schedules."""

from __future__ import annotations

import pytest

from xla_permute import make_schedule
from xla_permute_tools.cost import predict_pipeline, step_time
from xla_permute_tools.validation import TORCHTITAN_405B, torchtitan_comparison


@pytest.mark.parametrize(
    ("name", "p", "m", "v"),
    [("gpipe", 4, 8, 1), ("1f1b", 4, 5, 1), ("interleaved", 4, 8, 2), ("1f1b", 1, 3, 1)],
)
def test_unit_ticks_are_the_schedule(name, p, m, v):
    s = make_schedule(name, p, m, v)
    # forward = backward = one tick, no shift cost: both models give the tick count
    for lockstep in (False, True):
        t = step_time(s, t_forward=float(v), backward_ratio=1.0, lockstep=lockstep)
        assert t == s.ticks


def test_textbook_step_times():
    """Point-to-point, B = 2F: GPipe and 1F1B take (m + p - 1)(tf + tb); interleaved cuts the
    bubble by v. Each shift adds t_shift on the critical path."""
    p, m = 4, 8
    gpipe, one = predict_pipeline("gpipe", p, m), predict_pipeline("1f1b", p, m)
    assert gpipe.step_time == one.step_time == (m + p - 1) * 3
    inter = predict_pipeline("interleaved", p, m, 2)
    assert inter.step_time == pytest.approx(m * 3 + (p - 1) * 3 / 2)
    assert gpipe.activations == m and one.activations == p
    assert inter.activations == (2 * (p - 1) + p + 1) / 2  # Megatron's warm-up, in stages
    slow = predict_pipeline("1f1b", p, m, t_shift=0.1)
    assert slow.step_time > one.step_time


def test_lockstep_costs_1f1b_where_ticks_mix_forward_and_backward():
    """On stage shifts every tick ends with a collective of all ranks: a tick lasts as long as
    its slowest unit. GPipe's ticks are all-forward or all-backward; 1F1B's steady ticks mix
    them, so with B = 2F it takes longer than GPipe (and longer than point-to-point)."""
    p, m = 4, 8
    gpipe = predict_pipeline("gpipe", p, m, lockstep=True)
    one = predict_pipeline("1f1b", p, m, lockstep=True)
    assert gpipe.step_time == predict_pipeline("gpipe", p, m).step_time
    assert one.step_time > gpipe.step_time
    assert one.step_time <= 2 * (m + p - 1) * 2  # every tick at most a backward


def test_torchtitan_direction():
    c = torchtitan_comparison()
    assert (
        c["published_throughput"]
        == 128 / 100
        == TORCHTITAN_405B["interleaved"]["tokens_per_s_per_gpu"] / 100
    )
    assert 1 < c["predicted_throughput"] < c["published_throughput"]  # same direction
    assert c["predicted_activations"] > 1 > c["published_memory"]  # see the tutorial
