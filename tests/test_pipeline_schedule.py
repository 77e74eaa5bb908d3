"""Pipeline schedules as data (xla_permute.pipeline.schedule): properties, formulas, refusals.

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

from xla_permute import SCHEDULES, Overlap, PipelineSchedule, Work, make_schedule
from xla_permute.pipeline.orders import theory_bubble_fraction
from xla_permute.pipeline.schedule import units


@st.composite
def schedules(draw, names=("gpipe", "1f1b", "interleaved")) -> PipelineSchedule:
    name = draw(st.sampled_from(names))
    p = draw(st.integers(2 if name == "dualpipev" else 1, 6))
    if name in ("zbv", "dualpipev"):
        v, m = 2, draw(st.integers(2 * p if name == "dualpipev" else 1, 4 * p + 2))
    elif name in ("interleaved", "looped_bfs", "zb1p"):
        v, m = draw(st.integers(2, 4)), draw(st.integers(p, 3 * p + 2))
    else:
        v, m = 1, draw(st.integers(1, 12))
    if name in ("zbh1", "zb1p"):  # rounds of about p micro-batches
        m -= m % max(1, m // p)
    return make_schedule(name, p, m, v)


ALL = schedules(SCHEDULES)


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


@settings(max_examples=300, deadline=None)
@given(ALL)
def test_every_unit_once_and_in_dependency_order(s):
    """Each (micro-batch, stage) runs F once and either B once or I then W once; a unit runs
    at least one tick after the unit whose output it takes."""
    seen = _ticks(s)
    S, m = s.stages, s.micro_batches
    for i in range(m):
        for k in range(S):
            split = ("I", i, k) in seen
            assert ("F", i, k) in seen and (("B", i, k) in seen) != split
            assert split == (("W", i, k) in seen)
            if split:
                assert seen["W", i, k] >= seen["I", i, k] + 1

    def back(i, k):
        return seen.get(("B", i, k), seen.get(("I", i, k)))

    for i in range(m):
        for k in range(1, S):
            assert seen["F", i, k] >= seen["F", i, k - 1] + 1
            assert back(i, k - 1) >= back(i, k) + 1
        assert back(i, S - 1) >= seen["F", i, S - 1] + 1
    assert len(seen) == sum(len(units(c)) for tick in s.work for c in tick)


@settings(max_examples=300, deadline=None)
@given(ALL)
def test_sends_reach_the_work_that_consumes_them(s):
    """Every F (but the last stage's) and every B or I (but the first stage's) hands on once;
    at most one shift per direction per tick, its tensors stacked (two only in an overlapped
    tick); every hand-off reaches its consumer before it runs; the V's turn stays local."""
    seen = _ticks(s)
    for t, sends in enumerate(s.sends):
        for r, sent in enumerate(sends):
            ends = [w for w in units(s.work[t][r])
                    if (w.kind == "F" and w.stage < s.stages - 1)
                    or (w.kind in "BI" and w.stage > 0)]  # fmt: skip
            assert len(sent) == len(ends)
            for x in sent:
                assert x.offset in (+1, -1, 0)
                sender = x.stage - 1 if x.kind == "F" else x.stage + 1
                turn = {sender, x.stage} == {s.ranks - 1, s.ranks}
                assert (x.offset == 0) == (s.placement == "v" and turn) or s.ranks == 1
        assert sorted(s.shifts(t)) == sorted({x.offset for x in sum(sends, ()) if x.offset})
        for offset in s.shifts(t):
            assert 1 <= s.slots(t, offset) <= (2 if s.name == "dualpipev" else 1)
        for r in range(s.ranks):
            for got in s.receives(t, r).values():
                for x in got:
                    assert s.rank_of(x.stage) == r
                    consumer = seen.get((x.kind, x.micro_batch, x.stage))
                    if consumer is None:  # a gradient for a split backward: its I
                        consumer = seen["I", x.micro_batch, x.stage]
                    assert consumer > t  # arrives before it is needed
    # One stage per rank, or a V: no hand-off from the last rank to the first, the open chain
    # suffices; loop placement of several stages per rank needs the ring.
    loop = s.placement == "loop" and s.stages_per_rank > 1
    assert s.needs_ring == (loop and s.ranks > 1)


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


@settings(max_examples=200, deadline=None)
@given(schedules(("looped_bfs", "zbh1", "zb1p", "zbv", "dualpipev")))
def test_bubble_and_memory_of_the_new_schedules(s):
    """The closed forms of theory_bubble_fraction, counted from the data, and the memory:
    breadth-first holds every micro-batch of every stage; zero bubble (ZB-H1) holds p at most,
    as 1F1B does; ZB-V holds 2p stage activations (p ranks' worth) at most, evenly."""
    p, m, v = s.ranks, s.micro_batches, s.stages_per_rank
    try:
        formula = theory_bubble_fraction(s)
    except ValueError:  # fewer micro-batches than the closed form covers: more idle
        assert min(s.idle_ticks) >= p - 1
    else:
        assert Fraction(sum(s.idle_ticks), s.ticks * p) == formula
    if s.name == "looped_bfs":
        assert s.peak_in_flight == (v * m,) * p
    elif s.name == "zbh1":
        assert max(s.peak_in_flight) == min(p, m)
    elif s.name == "zbv" and m >= 2 * p:
        assert s.peak_in_flight == (2 * p,) * p
    if s.name in ("zbv", "dualpipev"):
        assert s.placement == "v" and all(s.stages_of(r) == (r, 2 * p - 1 - r) for r in range(p))
        assert any(isinstance(c, Overlap) for t in s.work for c in t) == (s.name == "dualpipev")


def test_zero_bubble_cuts_1f1bs_bubble_to_a_third_in_time():
    """With durations F = I = W = 1 (B = I + W = 2), the zero-bubble paper's unit times: 1F1B
    idles (p-1)(F+B) per rank, ZB-H1 (p-1)(F+I-W)... = p-1 units, a third; ZB-V ~ none."""
    from xla_permute_tools.cost import predict_pipeline

    p, m = 4, 10
    one, zb = predict_pipeline("1f1b", p, m), predict_pipeline("zbh1", p, m)
    assert 1 - one.efficiency == pytest.approx((p - 1) / (m + p - 1))
    assert 1 - zb.efficiency == pytest.approx((p - 1) / (3 * m + p - 1))  # 9.09%
    assert (1 - zb.efficiency) < (1 - one.efficiency) / 2
    assert zb.activations == one.activations == p
    zbv = predict_pipeline("zbv", p, m, 2)
    assert 1 - zbv.efficiency == pytest.approx((p - 1) / (6 * m + p - 1))


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


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: make_schedule("interleaved", 4, 3, 2), ValueError,
         ["micro_batches=3 is below ranks=4"]),
        (lambda: make_schedule("1f1b", 4, 8, 2), ValueError, ["stages_per_rank=2 needs one of"]),
        (lambda: make_schedule("zb", 4, 8), ValueError, ["schedule must be one of"]),
        (lambda: make_schedule("zbv", 4, 8), ValueError, ["stages_per_rank=1: zbv places 2"]),
        (lambda: make_schedule("dualpipev", 4, 7, 2), ValueError,
         ["micro_batches=7 is below the 8 stages"]),
        (lambda: make_schedule("dualpipev", 1, 4, 2), ValueError, ["ranks=1"]),
        (lambda: make_schedule("zb1p", 4, 9, 2), ValueError, ["9 does not split into 2 equal"]),
        (lambda: make_schedule("1f1b", 4, 0), ValueError, ["micro_batches must be an int >= 1"]),
        (lambda: make_schedule("interleaved", 4, 8, 0), ValueError,
         ["stages_per_rank must be an int >= 1, got 0"]),
        (lambda: make_schedule("1f1b", 2.0, 4), TypeError, ["ranks must be an int"]),
    ],
)  # fmt: skip
def test_bad_combinations(call, error, words):
    with pytest.raises(error) as info:
        call()
    assert all(w in str(info.value) for w in words), str(info.value)
