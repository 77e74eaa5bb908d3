"""Pipeline schedules as data (xla_permute.pipeline_schedule): properties, formulas, refusals.

Pure Python, no device. Every schedule drawn by hypothesis must run each (micro-batch, stage)
forward once and backward once on the rank that holds the stage, respect the dependencies (a
forward one tick at least after the previous stage's, a backward one tick at least after the
next one's),
send at most one activation and one gradient per rank per tick, deliver every send to the
work that consumes it, and match the textbook bubble and memory figures exactly.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xla_permute import PipelineSchedule, Work, make_schedule, split_layers
from xla_permute.pipeline_orders import theory_bubble_fraction
from xla_permute.pipeline_schedule import units


@st.composite
def schedules(draw) -> PipelineSchedule:
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    p = draw(st.integers(1, 6))
    if name == "interleaved":
        v = draw(st.integers(2, 4))
        m = draw(st.integers(p, 3 * p + 2))
    else:
        v, m = 1, draw(st.integers(1, 12))
    return make_schedule(name, p, m, v)


def _ticks(s: PipelineSchedule) -> dict[tuple[str, int, int], int]:
    """(kind, micro-batch, stage) -> tick, asserting each occurs once, on its stage's rank."""
    seen: dict[tuple[str, int, int], int] = {}
    for t, tick in enumerate(s.work):
        assert len(tick) == s.ranks
        for r, cell in enumerate(tick):
            for w in units(cell):
                assert s.rank_of(w.stage) == r, (w, r)
                key = (w.kind, w.micro_batch, w.stage)
                assert key not in seen, (key, t)
                seen[key] = t
    return seen


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_unit_once_and_in_dependency_order(s):
    seen = _ticks(s)
    S = s.stages
    expected = {(k, i, j) for k in "FB" for i in range(s.micro_batches) for j in range(S)}
    assert set(seen) == expected  # every (micro-batch, stage) forward once and backward once
    for i in range(s.micro_batches):
        for k in range(1, S):
            assert seen["F", i, k] >= seen["F", i, k - 1] + 1
            assert seen["B", i, k - 1] >= seen["B", i, k] + 1
        assert seen["B", i, S - 1] >= seen["F", i, S - 1] + 1


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_sends_reach_the_work_that_consumes_them(s):
    seen = _ticks(s)
    for t, sends in enumerate(s.sends):
        for r, sent in enumerate(sends):  # one unit per rank per tick, so <= 1 each way
            w = s.work[t][r]
            ends = w is None or (w.kind == "F" and w.stage == s.stages - 1) or (
                w.kind == "B" and w.stage == 0)  # fmt: skip
            assert len(sent) == (0 if ends else 1)
        assert sorted(s.shifts(t)) == sorted({x.offset for x in sum(sends, ()) if x.offset})
        for r in range(s.ranks):
            for got in s.receives(t, r).values():
                for x in got:
                    assert s.rank_of(x.stage) == r
                    assert seen[x.kind, x.micro_batch, x.stage] > t  # arrives before it is needed
    # With one stage per rank no activation leaves the last rank and no gradient the first:
    # the open chain suffices; interleaved schedules hand on from the last rank to the first.
    assert s.needs_ring == (s.stages_per_rank > 1 and s.ranks > 1)


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_bubble_and_memory_formulas(s):
    p, m, v = s.ranks, s.micro_batches, s.stages_per_rank
    assert s.ticks == 2 * (v * m + p - 1)
    assert all(idle == 2 * (p - 1) for idle in s.idle_ticks)
    assert Fraction(sum(s.idle_ticks), s.ticks * p) == Fraction(p - 1, v * m + p - 1)
    assert s.bubble_fraction == pytest.approx(float(theory_bubble_fraction(s)))
    if s.name == "gpipe":
        assert s.peak_in_flight == (m,) * p
    elif s.name == "1f1b":
        assert s.peak_in_flight == tuple(min(p - r, m) for r in range(p))
        assert max(s.peak_in_flight) <= p
    else:  # Megatron: 2 (p - r - 1) + (v - 1) g warm-up forwards, then one more
        g = p + m % p if m >= 2 * p else m
        warm = [min(2 * (p - r - 1) + (v - 1) * g + 1, v * m) for r in range(p)]
        assert s.peak_in_flight == tuple(warm)


def test_interleaved_with_one_stage_per_rank_is_1f1b():
    assert make_schedule("interleaved", 4, 6, 1) == make_schedule("1f1b", 4, 6)


def test_small_example_by_hand():
    s = make_schedule("1f1b", 2, 2)
    F, B = (lambda i, k: Work("F", i, k)), (lambda i, k: Work("B", i, k))
    assert s.work == (
        (F(0, 0), None),
        (F(1, 0), F(0, 1)),
        (None, B(0, 1)),
        (B(0, 0), F(1, 1)),
        (None, B(1, 1)),
        (B(1, 0), None),
    )
    assert [s.shifts(t) for t in range(s.ticks)] == [(1,), (1,), (-1,), (), (-1,), ()]


def test_split_layers():
    assert split_layers(8, 4) == tuple((range(2 * r, 2 * r + 2),) for r in range(4))
    held = split_layers(16, 4, 2)
    assert held[1] == (range(2, 4), range(10, 12))  # stages 1 and 5
    flat = sorted(layer for rank in held for stage in rank for layer in stage)
    assert flat == list(range(16))


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: make_schedule("interleaved", 4, 3, 2), ValueError,
         ["micro_batches=3 is below ranks=4"]),
        (lambda: make_schedule("1f1b", 4, 8, 2), ValueError, ["stages_per_rank=2 needs schedule="]),
        (lambda: make_schedule("zb", 4, 8), ValueError, ["schedule must be one of"]),
        (lambda: make_schedule("1f1b", 4, 0), ValueError, ["micro_batches=0 is below 1"]),
        (lambda: make_schedule("interleaved", 4, 8, 0), ValueError,
         ["stages_per_rank=0 is below 1"]),
        (lambda: make_schedule("1f1b", 2.0, 4), TypeError, ["ranks must be an int"]),
        (lambda: split_layers(6, 2, 2), ValueError,
         ["layers=6 do not split", "stages_per_rank in [1, 3]"]),
        (lambda: split_layers(6, 4), ValueError, ["divisible by 4", "fewer ranks"]),
    ],
)  # fmt: skip
def test_bad_combinations(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)
