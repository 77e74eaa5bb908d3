"""Every schedule PyTorch also has, against PyTorch's own order of work, rank by rank.

The oracle: ``torch.distributed.pipelining._schedule_visualizer.get_schedule_ops(name, p, m,
v)`` (PyTorch 2.9, and the newest in ``make test-live``; no process group needed), each rank's
list of actions with the ``None`` (idle) slots and newer PyTorch's ``REDUCE_GRAD`` dropped,
beside each rank's column of :func:`xla_permute.make_schedule` with the idle ticks dropped,
over p in {2, 4, 8} and m in {p, 2p, 4p}. Identical for interleaved 1F1B,
Looped BFS, interleaved zero bubble, ZB-V and DualPipeV; two differences, each tested here:

* GPipe: PyTorch runs the backwards in micro-batch order, this project last micro-batch first
  (the mirror of the forward, which is what autograd does through ``pipeline_forward``'s
  shifts). Played out, both take the same ticks with the same bubble.
* 1F1B: on the last rank PyTorch 2.9 numbers the forwards from 1 (``F1 .. Fm``, never ``F0``,
  while its backwards are ``B0 .. B(m-1)``); with that renumbering undone it is identical.

Pure Python, no device; ``_schedule_visualizer`` is a private module of PyTorch's, so a change
of its form fails here first.
"""

from __future__ import annotations

import logging

import pytest

from xla_permute import Overlap, Work, make_schedule
from xla_permute.pipeline.schedule import play

visualizer = pytest.importorskip("torch.distributed.pipelining._schedule_visualizer")

#: This project's name -> (PyTorch's name, stages per rank) for the schedules both have.
TORCH = {
    "gpipe": ("GPipe", 1),
    "1f1b": ("1F1B", 1),
    "interleaved": ("Interleaved1F1B", 2),
    "looped_bfs": ("LoopedBFS", 2),
    "zb1p": ("InterleavedZeroBubble", 2),
    "zbv": ("ZBVZeroBubble", 2),
    "dualpipev": ("DualPipeV", 2),
}
IDENTICAL = ("interleaved", "looped_bfs", "zb1p", "zbv", "dualpipev")
SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]


def torch_orders(name: str, p: int, m: int) -> list[list[str]]:
    """PyTorch's per-rank order of ``name`` (this project's name), idle slots dropped, each
    action printed as this project prints its cells (``1F0``, ``(0F3;3B1)``)."""
    torch_name, v = TORCH[name]
    logging.disable(logging.WARNING)  # the visualizer logs every schedule it builds
    try:
        ops = visualizer.get_schedule_ops(torch_name, p, m, v)
    finally:
        logging.disable(logging.NOTSET)

    def text(action) -> str:
        if action.sub_actions:
            return "(" + ";".join(str(a) for a in action.sub_actions) + ")"
        return str(action)

    return [_without_reduce_grad([text(a) for a in rank if a is not None]) for rank in ops]


def _without_reduce_grad(rank: list[str]) -> list[str]:
    """A rank's actions without PyTorch's ``REDUCE_GRAD`` (newer PyTorch, 2.14 here, ends a
    stage's work with the data-parallel gradient reduction; this project's schedules leave it
    to the caller), which may stand only at the end."""
    kept = [a for a in rank if not a.endswith("REDUCE_GRAD")]
    assert all(a.endswith("REDUCE_GRAD") for a in rank[len(kept) :]), rank
    return kept


def our_orders(name: str, p: int, m: int) -> list[list[str]]:
    s = make_schedule(name, p, m, TORCH[name][1])
    return [[str(tick[r]) for tick in s.work if tick[r] is not None] for r in range(p)]


def _parse(text: str) -> Work:
    kind = next(c for c in text if c.isalpha())
    stage, micro_batch = text.split(kind)
    return Work(kind, int(micro_batch), int(stage))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", IDENTICAL)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_identical_to_pytorch(name, p, m):
    if name == "dualpipev" and m < 2 * p:  # both refuse fewer micro-batches than stages
        with pytest.raises(ValueError, match="at least as many microbatches as stages"):
            torch_orders(name, p, m)
        with pytest.raises(ValueError, match=f"micro_batches={m} is below the {2 * p} stages"):
            make_schedule(name, p, m, 2)
        return
    assert our_orders(name, p, m) == torch_orders(name, p, m)


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_gpipe_differs_only_in_the_order_of_the_backwards(p, m):
    ours, theirs = our_orders("gpipe", p, m), torch_orders("gpipe", p, m)
    for r in range(p):
        assert ours[r] != theirs[r] or m == 1
        assert ours[r][:m] == theirs[r][:m]  # the forwards alike
        assert ours[r][m:] == theirs[r][m:][::-1]  # the backwards mirrored
    played = play("gpipe", p, m, 1, [[_parse(w) for w in rank] for rank in theirs])
    s = make_schedule("gpipe", p, m)
    assert (played.ticks, played.idle_ticks, played.peak_in_flight) == (
        s.ticks, s.idle_ticks, s.peak_in_flight)  # fmt: skip


@pytest.mark.parametrize(("p", "m"), SIZES)
def test_1f1b_differs_only_in_pytorchs_numbering_of_the_last_ranks_forwards(p, m):
    ours, theirs = our_orders("1f1b", p, m), torch_orders("1f1b", p, m)
    assert ours[:-1] == theirs[:-1]  # every rank but the last identical
    last = [_parse(w) for w in theirs[-1]]
    forwards = sorted(w.micro_batch for w in last if w.kind == "F")
    backwards = sorted(w.micro_batch for w in last if w.kind == "B")
    assert forwards == list(range(1, m + 1)) and backwards == list(range(m))  # the reproducer
    renumbered = [str(Work(w.kind, w.micro_batch - (w.kind == "F"), w.stage)) for w in last]
    assert renumbered == ours[-1]


def test_the_comparison_can_fail():
    """A schedule with one swap in one rank's order is not PyTorch's."""
    theirs = torch_orders("zbv", 4, 8)
    ours = our_orders("zbv", 4, 8)
    ours[2][5], ours[2][6] = ours[2][6], ours[2][5]
    assert ours != theirs
    s = make_schedule("dualpipev", 4, 8, 2)  # overlapped ticks are compared too
    overlapped = [str(c) for tick in s.work for c in tick if isinstance(c, Overlap)]
    assert overlapped and all(o in sum(torch_orders("dualpipev", 4, 8), []) for o in overlapped)
