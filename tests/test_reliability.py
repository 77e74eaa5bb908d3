"""Adversarial probes of the public surface: each behaves (a clear error or the right result).

One table, one mesh launch for all in-mesh probes (the CPU-mesh tests run in the debug mode,
``XLA_PERMUTE_DEBUG=1``, set in the root conftest). Ranks that disagree raise on every rank,
naming the ranks; empty tensors give empty results without a collective; the native backend
raises on the CPU mesh unless traced; numpy pairs, groups and counts are accepted.
"""

from __future__ import annotations

import re

import pytest
import ranks_reliability
import torch

from xla_permute import reference, run_on_mesh

N = 4
D = "DisagreementError"
NATIVE = r"backend='native' .* cannot run on the CPU mesh.*backend='emulated'.*hlo\.tracing"
RING = [(r, (r + 1) % N) for r in range(N)]


def _all(kind: str, pattern: str) -> list[tuple[str, str]]:
    return [(kind, pattern)] * N


def _xs() -> torch.Tensor:
    return torch.stack([torch.arange(2.0) + 10 * r for r in range(N)])


#: probe -> per-rank (outcome, regex on the message), or a function checking the per-rank values
PROBES: dict[str, object] = {
    "longer tensor on rank 1": _all(
        D, r"x\.shape: rank 1 passes \(3,\), ranks 0, 2, 3 pass \(2,\)"
    ),
    "float64 on rank 1": _all(
        D, r"x\.dtype: rank 1 passes torch\.float64, ranks 0, 2, 3 pass torch\.float32"
    ),
    "ring -1 on rank 1": _all(
        D,
        r"pairs: rank 1 passes \(\(0, 3\), \(1, 0\), \(2, 1\), \(3, 2\)\), ranks 0, 2, 3 pass"
        r" \(\(0, 1\), \(1, 2\), \(2, 3\), \(3, 0\)\)",
    ),
    "empty on rank 2 only": _all(D, r"x\.shape: rank 2 passes \(0,\), ranks 0, 1, 3 pass \(2,\)"),
    "other groups on rank 3": _all(D, r"pairs: rank 3 passes .*groups: rank 3 passes \(\(0, 1\)"),
    "stage_shift offset -1 on rank 0": _all(
        D, r"pairs: rank 0 passes \(\(1, 0\), \(2, 1\), \(3, 2\)\)"
    ),
    "all_gather_matmul 3 rows on rank 1": _all(
        D, r"rank 1 passes \(3, 4\), ranks 0, 2, 3 pass \(2, 4\)"
    ),
    "pipeline 3 micro-batches on rank 1": _all(
        D, r"pipeline_forward: .*inputs\.shape: rank 1 passes \(3, 2\), ranks 0, 2, 3 pass \(2, 2\)"
    ),
    "pipeline_forward on rank 0, collective_permute elsewhere": _all(
        D,
        r"different collectives: rank 0 calls pipeline_forward, ranks 1, 2, 3 call "
        r"collective_permute",
    ),
    "x on xla:0 on every rank": [
        (D, r"error: rank 0 passes None, ranks 1, 2, 3 pass ValueError \(see that rank's error\)")
    ]
    + [
        ("ValueError", rf"x is on xla:0, but this rank's device is xla:{r}.*torch_xla\.device\(\)")
        for r in range(1, N)
    ],  # fmt: skip
    "inputs on xla:0 on every rank": [
        (D, r"pipeline_forward: .*error: rank 0 passes None, ranks 1, 2, 3 pass ValueError")
    ]
    + [
        ("ValueError", rf"inputs is on xla:0, but this rank's device is xla:{r}")
        for r in range(1, N)
    ],
    "pairs float numpy array": _all("TypeError", r"pairs is an array of dtype float64.*integer"),
    "pairs numpy (k, 3)": _all("TypeError", r"pairs is an array of shape \(2, 3\).*\(k, 2\)"),
    "native executed on CPU": _all("ValueError", NATIVE),
    "native stage_shift on CPU": _all("ValueError", NATIVE),
    "native pipeline on CPU": _all("ValueError", NATIVE),
}


def _ring_result(got: list) -> None:
    want = reference.permute(_xs(), RING)
    assert all(torch.equal(got[r], want[r]) for r in range(N)), got


def _empty(shape: tuple[int, ...]):
    def check(got: list) -> None:
        for out in got:
            assert out["y"].shape == shape and out["grad"].shape == shape
            assert "collective" not in out["hlo"] and "all-gather" not in out["hlo"]

    return check


def _shape(shape: tuple[int, ...]):
    def check(got: list) -> None:
        assert all(tuple(g.shape) == shape for g in got), [g.shape for g in got]

    return check


def _groups_swap(got: list) -> None:
    want = reference.permute(_xs(), [(0, 1), (1, 0)], [[0, 1], [2, 3]])
    assert all(torch.equal(got[r], want[r]) for r in range(N))


def _shift(got: list) -> None:
    want = reference.stage_shift(_xs(), 1, wrap=False)
    assert all(torch.equal(got[r], want[r]) for r in range(N))


def _two_pipelines(got: list) -> None:
    # stages=2: ranks (0, 1) and (2, 3); the last stage adds 1 twice to the first stage's input
    assert torch.equal(got[1], torch.ones(2, 2) * 0 + 2) and torch.equal(
        got[3], torch.ones(2, 2) * 2 + 2
    )
    assert not got[0].any() and not got[2].any()


def _native_traced(got: list) -> None:
    assert got == [["collective-permute"]] * N


def _step_loop(got: list) -> None:
    for step in range(3):
        want = reference.permute(_xs() + step, RING)
        assert all(torch.equal(got[r][step], want[r]) for r in range(N))


PROBES.update({
    "empty 0 rows": _empty((0, 3)),
    "empty 0 columns": _empty((2, 0)),
    "empty 1-d": _empty((0,)),
    "empty stage_shift": _shape((0, 4)),
    "empty pipeline, 0 micro-batches": _shape((0, 3)),
    "empty pipeline activation": _shape((2, 0)),
    "pairs numpy (k, 2)": _ring_result,
    "pairs 2-column tensor": _ring_result,
    "pairs numpy int64 entries": _ring_result,
    "groups numpy array": _groups_swap,
    "stage_shift offset np.int64(1)": _shift,
    "pipeline stages np.int64(2)": _two_pipelines,
    "native traced in hlo.tracing": _native_traced,
    "step loop, y deleted before mark_step": _step_loop,
    "debug_mode('sampled'), ranks agree": _ring_result,
})  # fmt: skip


@pytest.fixture(scope="module")
def mesh() -> list[dict]:
    return run_on_mesh(ranks_reliability.run_probes, list(PROBES), n=N, timeout=240)


@pytest.mark.parametrize("name", list(PROBES))
def test_probe_behaves(mesh, name):
    expected = PROBES[name]
    got = [rank[name] for rank in mesh]
    if callable(expected):
        assert all(kind == "ok" for kind, _ in got), got
        expected([value for _, value in got])
        return
    for r, ((kind, message), (want_kind, pattern)) in enumerate(zip(got, expected, strict=True)):
        assert kind == want_kind, f"rank {r}: {kind}: {message}"
        assert re.search(pattern, message), f"rank {r}: {message!r} !~ {pattern!r}"
        if kind == D:
            assert "agreement check" in message and f"on rank {r} of {N}" in message
