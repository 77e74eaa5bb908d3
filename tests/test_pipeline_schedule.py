"""Pipeline schedules as data (xla_permute.pipeline_schedule): properties, formulas, refusals.

Pure Python, no device. Every schedule drawn by hypothesis must run each (micro-batch, chunk)
forward once and backward once on every rank, respect the dependencies (a forward one tick at
least after the previous virtual stage's, a backward one tick at least after the next one's),
send at most one activation and one gradient per rank per tick, deliver every send to the
work that consumes it, and match the textbook bubble and memory figures exactly.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xla_permute import (
    PipelineSchedule,
    Work,
    gpipe_schedule,
    interleaved_schedule,
    make_schedule,
    one_f_one_b_schedule,
    split_layers,
)
from xla_permute.pipeline_schedule import gpipe_step_schedule


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
    """(kind, micro-batch, virtual stage) -> tick, asserting each occurs once."""
    seen: dict[tuple[str, int, int], int] = {}
    for t, tick in enumerate(s.work):
        assert len(tick) == s.stages
        for r, w in enumerate(tick):
            if w is not None:
                key = (w.kind, w.micro_batch, s.virtual_stage(r, w.chunk))
                assert key not in seen, (key, t)
                seen[key] = t
    return seen


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_unit_once_and_in_dependency_order(s):
    seen = _ticks(s)
    V = s.virtual_stages
    expected = {(k, i, j) for k in "FB" for i in range(s.micro_batches) for j in range(V)}
    assert set(seen) == expected  # every (micro-batch, chunk) forward once and backward once
    for i in range(s.micro_batches):
        for k in range(1, V):
            assert seen["F", i, k] >= seen["F", i, k - 1] + 1
            assert seen["B", i, k - 1] >= seen["B", i, k] + 1
        assert seen["B", i, V - 1] >= seen["F", i, V - 1] + 1


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_sends_reach_the_work_that_consumes_them(s):
    seen = _ticks(s)
    for t, sends in enumerate(s.sends):
        for r, send in enumerate(sends):  # one send per rank per tick, so <= 1 each way
            w = s.work[t][r]
            assert (send is None) == (
                w is None
                or (w.kind == "F" and s.virtual_stage(r, w.chunk) == s.virtual_stages - 1)
                or (w.kind == "B" and s.virtual_stage(r, w.chunk) == 0)
            )
        assert sorted(s.shifts(t)) == sorted({x.offset for x in sends if x is not None})
        for r in range(s.stages):
            for offset, got in s.receives(t, r).items():
                kind = "F" if offset == 1 else "B"
                consumer = seen[kind, got.micro_batch, s.virtual_stage(r, got.chunk)]
                assert consumer > t  # arrives before it is needed
    # Without chunks no activation leaves the last rank and no gradient the first: the open
    # chain suffices; interleaved schedules hand on from the last rank to the first.
    wraps = any(
        (x.offset == 1 and r == s.stages - 1) or (x.offset == -1 and r == 0)
        for sends in s.sends
        for r, x in enumerate(sends)
        if x is not None and s.stages > 1
    )
    assert wraps == (s.needs_ring and s.stages > 1)


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_bubble_and_memory_formulas(s):
    p, m, v = s.stages, s.micro_batches, s.chunks
    assert s.ticks == 2 * (v * m + p - 1)
    assert all(idle == 2 * (p - 1) for idle in s.idle_ticks)
    assert Fraction(sum(s.idle_ticks), s.ticks * p) == Fraction(p - 1, v * m + p - 1)
    assert s.bubble_fraction == pytest.approx(float(s.theory_bubble_fraction))
    if s.name == "gpipe":
        assert s.peak_in_flight == (m,) * p
    elif s.name == "1f1b":
        assert s.peak_in_flight == tuple(min(p - r, m) for r in range(p))
        assert max(s.peak_in_flight) <= p
    else:  # Megatron: 2 (p - r - 1) + (v - 1) g warm-up forwards, then one more
        g = p + m % p if m >= 2 * p else m
        warm = [min(2 * (p - r - 1) + (v - 1) * g + 1, v * m) for r in range(p)]
        assert s.peak_in_flight == tuple(warm)


def test_gpipe_step_schedule_is_gpipe_forward_then_backward():
    for p, m in [(1, 3), (3, 5), (4, 4)]:
        s, old = gpipe_step_schedule(p, m), gpipe_schedule(p, m)
        forward = [
            tuple(None if w is None or w.kind == "B" else w.micro_batch for w in tick)
            for tick in s.work[: old.ticks]
        ]
        assert tuple(forward) == old.forward


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved_schedule(4, 6, 1) == one_f_one_b_schedule(4, 6)


def test_small_example_by_hand():
    s = one_f_one_b_schedule(2, 2)
    F, B = (lambda i: Work("F", i)), (lambda i: Work("B", i))
    assert s.work == (
        (F(0), None),
        (F(1), F(0)),
        (None, B(0)),
        (B(0), F(1)),
        (None, B(1)),
        (B(1), None),
    )
    assert [s.shifts(t) for t in range(s.ticks)] == [(1,), (1,), (-1,), (), (-1,), ()]


def test_split_layers():
    assert split_layers(8, 4) == tuple((range(2 * r, 2 * r + 2),) for r in range(4))
    chunks = split_layers(16, 4, 2)
    assert chunks[1] == (range(2, 4), range(10, 12))  # virtual stages 1 and 5
    flat = sorted(layer for rank in chunks for chunk in rank for layer in chunk)
    assert flat == list(range(16))


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: interleaved_schedule(4, 3, 2), ValueError, ["micro_batches=3 is below stages=4"]),
        (lambda: make_schedule("1f1b", 4, 8, 2), ValueError, ["chunks=2 needs schedule="]),
        (lambda: make_schedule("zb", 4, 8), ValueError, ["schedule must be one of"]),
        (lambda: one_f_one_b_schedule(4, 0), ValueError, ["micro_batches=0 is below 1"]),
        (lambda: interleaved_schedule(4, 8, 0), ValueError, ["chunks=0 is below 1"]),
        (lambda: one_f_one_b_schedule(2.0, 4), TypeError, ["stages must be an int"]),
        (lambda: split_layers(6, 2, 2), ValueError, ["layers=6 do not split", "chunks in [1, 3]"]),
        (lambda: split_layers(6, 4), ValueError, ["divisible by 4", "fewer stages"]),
    ],
)
def test_bad_combinations(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)
