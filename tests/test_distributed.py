"""Every op on torch.distributed: real processes (torchrun), gloo, CPU tensors, the c10d backend.

One launch per world size (2 and 4 processes), and one more at 4 with the permutes sent by
``all_to_all_single`` instead of ``batch_isend_irecv``, runs every case of tests/dist_cases.py
on every rank: collective_permute (sync and ``async_op``), stage_shift, pipeline_forward (one
pipeline, and two side by side at N=4), all_gather, reduce_scatter, sum_gradients, both
collective matmuls (uni/bi, several weights, ``reduce_dtype``, groups listed out
of order) and their baselines, ring attention (causal, zigzag, grouped-query,
groups) and its all-gather baseline, the four layers (one SGD step each; GatedMLP three), and
the same bad calls on every rank. Each rank saves its results; this module compares them with
the reference on the same data: exact on integer-valued data, forward and backward (attention
and later training steps: float64, 1e-10). The 2-process launch ends with a rank that never
joins: the other must fail within the process group's timeout instead of hanging.
"""

from __future__ import annotations

import re
from pathlib import Path

import dist_cases as dc
import pytest
import torch
from torchrun import torchrun as launch_torchrun

import xla_permute as xp

SCRIPT = Path(__file__).parent / "dist_cases.py"
LAUNCH_TIMEOUT = 240  # seconds for a whole launch; the process group's own timeout is 30 s


def torchrun(n: int, out: Path, *args: str, timeout: float = LAUNCH_TIMEOUT):
    """Run dist_cases.py on ``n`` processes under torchrun; bounded by ``timeout``."""
    env = {"TORCHELASTIC_ERROR_FILE": str(out / "error.json")}
    return launch_torchrun(SCRIPT, n, str(out), *args, timeout=timeout, env=env)


#: (processes, the permutes' route): gloo has send/recv, so "auto" is point-to-point; at N=4
#: the same cases again by one all_to_all_single per permute (the route without send/recv).
LAUNCHES = [(2, "auto"), (4, "auto"), (4, "all_to_all")]


@pytest.fixture(
    scope="module", params=LAUNCHES, ids=lambda p: f"N={p[0]}" + "-a2a" * (p[1] != "auto")
)
def launch(request, tmp_path_factory):
    n, route = request.param
    out = tmp_path_factory.mktemp(f"dist{n}")
    code, output, _ = torchrun(n, out, route)
    assert code == 0, output[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(n)]
    want = "p2p" if route == "auto" else route
    assert [rank["route"] for rank in ranks] == [want] * n
    if n == 2:
        seconds, message = (out / "hang.txt").read_text().split("\n", 1)
        ranks[0]["hang"] = float(seconds), message
    return n, ranks


def _compare(got: dict, want: dict, exact: bool) -> list[str]:
    bad = []
    for key, w in want.items():
        g = got[key]
        same = g.dtype == w.dtype and g.shape == w.shape
        if same and exact:
            same = torch.equal(g, w)
        elif same:
            same = torch.allclose(g, w, rtol=1e-10, atol=1e-10)
        if not same:
            bad.append(f"{key}: got {g.dtype} {tuple(g.shape)}, want {w.dtype} {tuple(w.shape)}")
    return bad


def test_every_op_equals_the_reference(launch):
    n, ranks = launch
    names = [name for name, c in dc.CASES.items() if n >= c.min_n]
    assert names and all(set(ranks[r]["cases"]) == set(names) for r in range(n))
    failures = []
    for name in names:
        c = dc.CASES[name]
        want = dc.expect_case(name, c, n)
        for r in range(n):
            failures += [
                f"{name}, rank {r}: {b}"
                for b in _compare(ranks[r]["cases"][name], want[r], c.exact)
            ]
    assert not failures, "\n".join(failures)


def _layer_reference(kind: str, n: int, steps: int) -> list[dict]:
    """The one-device layer on the whole input, trained as the ranks are, sharded per rank."""
    fc1, fc2, fc3 = dc._linear(4, 8, 20), dc._linear(8, 4, 22), dc._linear(4, 8, 24)
    modules = {
        "ColumnParallelLinear": ({"weight": fc1.weight, "bias": fc1.bias}, fc1),
        "RowParallelLinear": ({"weight": fc2.weight, "bias": fc2.bias}, fc2),
        "SequenceParallelMLP": (
            {
                f"fc{i}.{k}": getattr(m, k)
                for i, m in ((1, fc1), (2, fc2))
                for k in ("weight", "bias")
            },
            lambda x: fc2(torch.relu(fc1(x))),
        ),
        "GatedMLP": (
            {
                f"{a}.{k}": getattr(m, k)
                for a, m in (("gate", fc1), ("up", fc3), ("down", fc2))
                for k in ("weight", "bias")
            },
            lambda x: fc2(xp.relu_product(fc1(x), fc3(x))),
        ),
    }
    params, forward = modules[kind]
    xs = dc.layer_inputs(kind, n)
    x = torch.cat(list(xs), dim=-1 if kind == "RowParallelLinear" else 1)
    opt = torch.optim.SGD(list(params.values()), lr=dc.LR)
    per_rank: list[dict] = [{} for _ in range(n)]
    for step in range(steps):
        opt.zero_grad()
        y = forward(x)
        shards = list(y.chunk(n, dim=-1 if kind == "ColumnParallelLinear" else 1))
        sum((s * dc.upstream(kind, step, r, s)).sum() for r, s in enumerate(shards)).backward()
        for r in range(n):
            per_rank[r][f"y{step}"] = shards[r].detach()
            if step == 0:
                for k, p in params.items():
                    per_rank[r][f"grad {k}"] = _layer_shard(kind, k, p.grad, r, n)
        opt.step()
    for r in range(n):
        for k, p in params.items():
            per_rank[r][f"param {k}"] = _layer_shard(kind, k, p.detach(), r, n)
    return per_rank


def _layer_shard(kind: str, name: str, t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    """This rank's part of a one-device layer's parameter (or its gradient): column-parallel
    weights by rows (their biases chunked), row-parallel weights by columns (biases whole)."""
    layer, _, what = name.rpartition(".")
    column = layer in ("fc1", "gate", "up") or kind == "ColumnParallelLinear"
    if what == "bias":
        return t.chunk(n)[r] if column else t
    return t.chunk(n, 0 if column else 1)[r]


@pytest.mark.parametrize("kind", dc.LAYER_KINDS)
def test_layers_equal_one_device(launch, kind):
    """Forward and first backward exact; GatedMLP's three SGD steps within 1e-10 (float64)."""
    n, ranks = launch
    steps = 3 if kind == "GatedMLP" else 1
    want = _layer_reference(kind, n, steps)
    failures = []
    for strategy in ("ring", "baseline"):
        for r in range(n):
            got = ranks[r]["layers"][kind, strategy]
            first = {k: v for k, v in want[r].items() if k == "y0" or k.startswith("grad")}
            later = {k: v for k, v in want[r].items() if k not in first}
            failures += [f"{strategy} rank {r}: {b}" for b in _compare(got, first, True)]
            failures += [f"{strategy} rank {r}: {b}" for b in _compare(got, later, False)]
    assert not failures, "\n".join(failures)


EXPECTED_ERRORS = {
    "permute duplicate target": r"^ValueError: .*(duplicate|twice|more than once)",
    "permute not a tensor": r"^TypeError: x must be a torch.Tensor, got list",
    "permute native on a CPU tensor": r"^ValueError: x is on device cpu, not an XLA device, but "
    r"backend='native' runs torch_xla collectives on XLA tensors; use backend='c10d'",
    "agm dtypes differ": r"^TypeError: all_gather_matmul: x is torch.float32 but w is torch.floa",
    "mrs rows not divisible": r"^ValueError: matmul_reduce_scatter: x.shape\[0\] = \d+ is not div",
    "attention bad layout": r"^ValueError: .*layout",
    "shift offset too large": r"^ValueError: offset=\d is not smaller than the group",
    "reduce_scatter not divisible": r"^ValueError: reduce_scatter: x.shape\[0\] = \d+ is not div",
    "permute shapes disagree": r"^DisagreementError: collective_permute: the ranks disagree on "
    r"x.shape: .*rank 1 passes \(4, 4\)",
    "agm options disagree": r"^DisagreementError: all_gather_matmul: the ranks disagree on "
    r"bidirectional: rank 0 passes True",
}


def test_bad_input_raises_the_same_clear_error_on_every_rank(launch):
    n, ranks = launch
    assert set(ranks[0]["errors"]) == set(EXPECTED_ERRORS)
    for name, pattern in EXPECTED_ERRORS.items():
        messages = [ranks[r]["errors"][name] for r in range(n)]
        for r, message in enumerate(messages):
            assert re.search(pattern, message), f"{name}, rank {r}: {message}"
        if not name.endswith("disagree"):
            assert len(set(messages)) == 1, messages


def test_a_ring_under_torch_compile_is_refused_on_every_rank(launch):
    """Refused, not compiled: the ops keep host state (handles in flight, the agreement checks)
    that Dynamo cannot trace; every rank raises before any collective, naming the op."""
    n, ranks = launch
    for r in range(n):
        assert ranks[r]["compile"].startswith(
            "CompileError: all_gather_matmul was called inside torch.compile"
        ), ranks[r]["compile"]


@pytest.mark.parametrize("launch", [LAUNCHES[0]], indirect=True, ids=["N=2"])
def test_a_rank_that_never_joins_fails_the_others_within_the_timeout(launch):
    """At the end of the 2-process launch rank 1 sleeps instead of calling all_gather_matmul:
    rank 0 raises after the process group's timeout (2 s there), bounded, no hang."""
    n, ranks = launch
    seconds, message = ranks[0]["hang"]
    assert seconds < 10, (seconds, message)
    assert re.search(r"(?i)timed? ?out", message), message
