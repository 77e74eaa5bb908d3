"""The CPU mesh runs the programs users write, with run_on_mesh's defaults (issue: three aborts).

One 4-device launch runs them all, each as a user writes it: a loop that drops each permute's
result before ``torch_xla.sync()``; 130+ good and bad calls with a ``mark_step`` after each and
every result dropped; a Hugging Face Llama made tensor-parallel by one plan (tests/llama_plan.py),
3 AdamW steps against one device; a module argument that each rank moves to its device; and the
ops under ``torch.compile``, refused on every rank. A second launch, with the debug mode off,
checks that the default (sampled) agreement check still catches a rank passing bfloat16 or
uneven shards; a torchrun launch does the same on 4 gloo processes (tests/dist_disagreements.py).
"""

from __future__ import annotations

import copy
import json

import llama_plan
import pytest
import torch
from torchrun import torchrun

import xla_permute as xp

N = 4
DROP_STEPS = 20


def _dropped_results() -> int:
    import torch_xla
    import torch_xla.runtime as xr

    dev, n = torch_xla.device(), xr.world_size()
    for i in range(DROP_STEPS):
        y = xp.collective_permute(torch.ones(64, 64, device=dev) * i, xp.ring_pairs(n))
        del y
        torch_xla.sync()
    return DROP_STEPS


def _calls(dev: torch.device, n: int) -> list:
    """Good and bad calls as a user makes them, results dropped; ``(name, call)``."""
    x = torch.ones(4, 8, device=dev)
    w = torch.ones(8, 3, device=dev)
    ring = xp.ring_pairs(n)
    good = [
        ("permute", lambda: xp.collective_permute(x, ring)),
        ("all_gather", lambda: xp.all_gather(x, dim=0)),
        ("reduce_scatter", lambda: xp.reduce_scatter(torch.ones(4 * n, 2, device=dev), dim=0)),
        ("all_reduce", lambda: xp.all_reduce(x)),
        ("agm", lambda: xp.all_gather_matmul(x, w, dim=0)),
        ("mrs", lambda: xp.matmul_reduce_scatter(torch.ones(4 * n, 8, device=dev), w, dim=0)),
        ("shift", lambda: xp.stage_shift(x)),
        ("empty", lambda: xp.collective_permute(torch.ones(0, 3, device=dev), ring)),
    ]
    bad = [
        ("cpu x", lambda: xp.collective_permute(torch.ones(2), ring)),
        ("pairs type", lambda: xp.collective_permute(x, "ring")),
        ("pair out of range", lambda: xp.collective_permute(x, [(0, n)])),
        ("duplicate target", lambda: xp.collective_permute(x, [(0, 1), (2, 1)])),
        ("backend", lambda: xp.collective_permute(x, ring, backend="nccl")),
        ("native on cpu", lambda: xp.collective_permute(x, ring, backend="native")),
        ("groups", lambda: xp.collective_permute(x, ring, groups=[[0, 1], [2]])),
        ("dim", lambda: xp.all_gather(x, dim=5)),
        ("agm dim", lambda: xp.all_gather_matmul(x, w, dim=1)),
        ("agm w", lambda: xp.all_gather_matmul(x, torch.ones(7, 3, device=dev), dim=0)),
        ("mrs rows", lambda: xp.matmul_reduce_scatter(torch.ones(3, 8, device=dev), w, dim=0)),
        ("shift offset", lambda: xp.stage_shift(x, offset=1.5)),
    ]
    return [good[i % len(good)] if i % 3 == 0 else bad[i % len(bad)] for i in range(132)]


def _mixed_calls() -> dict[str, int]:
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    counts = {"ran": 0, "refused": 0}
    for _, call in _calls(torch_xla.device(), xr.world_size()):
        try:
            call()
            counts["ran"] += 1
        except (ValueError, TypeError):
            counts["refused"] += 1
        xm.mark_step()
    return counts


def _compiled() -> dict[str, str]:
    """Each op under torch.compile(backend="openxla"): the error type and its first words."""
    import torch_xla
    import torch_xla.runtime as xr

    dev, n = torch_xla.device(), xr.world_size()
    layer = xp.ColumnParallelLinear(8, 4 * n, bias=False).to(dev)
    x = torch.ones(1, 2, 8, device=dev, requires_grad=True)

    def backward(t: torch.Tensor) -> torch.Tensor:
        layer(t).sum().backward()
        return t.grad

    cases = {
        "collective_permute": lambda t: xp.collective_permute(t * 2, xp.ring_pairs(n)),
        "all_gather_matmul": lambda t: xp.all_gather_matmul(
            t[0], torch.ones(8, 3, device=dev), dim=0
        ),  # fmt: skip
        "ColumnParallelLinear": lambda t: layer(t),
        "ColumnParallelLinear backward": backward,
    }
    out = {}
    for name, f in cases.items():
        try:
            torch.compile(f, backend="openxla")(x)
            out[name] = "ran"
        except xp.CompileError as e:
            out[name] = str(e)
    return out


def _copies(module: torch.nn.Module) -> tuple[int, str]:
    import torch_xla

    module.to(torch_xla.device())  # in place: a module shared by the ranks would race here
    return id(module), str(module.weight.device)


def _device() -> torch.device:
    import torch_xla

    return torch_xla.device()


def _programs(module: torch.nn.Module, full, tokens: torch.Tensor) -> dict:
    return {
        "copies": _copies(module),
        "dropped": _dropped_results(),
        "mixed": _mixed_calls(),
        "llama": llama_plan.train(full, tokens, 3, _device())[1],
        "compile": _compiled(),
    }


@pytest.fixture(scope="module")
def llama():
    cfg = llama_plan.config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128)
    full = llama_plan.model(cfg, dtype=torch.float32)
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    return full, tokens


@pytest.fixture(scope="module")
def programs(llama):
    full, tokens = llama
    return xp.run_on_mesh(_programs, torch.nn.Linear(3, 2), full, tokens, n=N)


def test_a_loop_that_drops_each_permute_before_sync_completes(programs):
    assert [p["dropped"] for p in programs] == [DROP_STEPS] * N


def test_130_good_and_bad_calls_with_a_mark_step_after_each_complete(programs):
    calls = _calls(torch.device("cpu"), N)
    good = sum(1 for i in range(len(calls)) if i % 3 == 0)
    assert [p["mixed"] for p in programs] == [{"ran": good, "refused": len(calls) - good}] * N


def test_a_tensor_parallel_hugging_face_llama_trains_as_on_one_device(programs, llama):
    full, tokens = llama
    want = llama_plan.reference(copy.deepcopy(full), tokens, steps=3)[1]
    for p in programs:
        assert p["llama"] == pytest.approx(want, rel=1e-5)
    assert want[-1] < want[0]  # it trains


def test_each_rank_gets_its_own_copy_of_the_arguments(programs):
    ids = [p["copies"][0] for p in programs]
    assert len(set(ids)) == N
    assert [p["copies"][1] for p in programs] == [f"xla:{r}" for r in range(N)]


def test_torch_compile_is_refused_on_every_rank_naming_the_op(programs):
    for p in programs:
        for name, message in p["compile"].items():
            op = name.split()[0]
            if op == "ColumnParallelLinear":  # the user's call, not the layer's inner ops
                op = "ColumnParallelLinear.forward"
            assert message.startswith(f"{op} was called inside torch.compile"), (name, message)
    assert len({json.dumps(p["compile"]) for p in programs}) == 1


def _mistakes() -> dict[str, str]:
    import torch_xla
    import torch_xla.runtime as xr

    dev, r, n = torch_xla.device(), xr.global_ordinal(), xr.world_size()
    out = {}
    dtype = torch.bfloat16 if r == 2 else torch.float32
    cases = {
        "dtype": lambda: xp.collective_permute(
            torch.ones(2, dtype=dtype, device=dev), xp.ring_pairs(n)
        ),  # fmt: skip
        "shards": lambda: xp.all_gather_matmul(
            torch.ones(1, 3 if r < 2 else 2, 4, device=dev), torch.ones(4, 5, device=dev), dim=1
        ),  # fmt: skip
    }
    for name, call in cases.items():
        try:
            call()
            out[name] = "ran"
        except xp.DisagreementError as e:
            out[name] = str(e).split(" (xla_permute")[0]
    return out


def test_the_default_check_catches_bfloat16_and_uneven_shards_with_debug_off():
    results = xp.run_on_mesh(_mistakes, n=N, env={"XLA_PERMUTE_DEBUG": "0"})
    assert (
        results
        == [
            {
                "dtype": "collective_permute: the ranks disagree on x.dtype: rank 2 passes "
                "torch.bfloat16, ranks 0, 1, 3 pass torch.float32",
                "shards": "all_gather_matmul: the ranks disagree on x.shape: ranks 0, 1 pass "
                "(1, 3, 4), ranks 2, 3 pass (1, 2, 4)",
            }
        ]
        * N
    )


def test_the_default_check_catches_gloo_disagreements_on_every_rank(tmp_path):
    script = llama_plan.__file__.replace("llama_plan.py", "dist_disagreements.py")
    from pathlib import Path

    code, output, _ = torchrun(Path(script), 4, str(tmp_path), timeout=240,
                               env={"XLA_PERMUTE_DEBUG": "0"})  # fmt: skip
    assert code == 0, output[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    strip = [{k: v.split(" (xla_permute")[0] for k, v in r.items()} for r in ranks]
    assert (
        strip
        == [
            {
                "dtype": "collective_permute: the ranks disagree on x.dtype: rank 1 passes "
                "torch.float64, ranks 0, 2, 3 pass torch.float32",
                "shape": "collective_permute: the ranks disagree on x.shape: rank 2 passes (3,), "
                "ranks 0, 1, 3 pass (2,)",
                "rows": "all_gather_matmul: the ranks disagree on x.shape: rank 0 passes (3, 4), "
                "ranks 1, 2, 3 pass (2, 4)",
            }
        ]
        * 4
    )


def _empty_syncs_while_rank_0_gathers() -> list[float]:
    """torch_xla alone: ranks 1-3 sync with nothing to run while rank 0 is in an all-gather."""
    import time

    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    dev, r, n = torch_xla.device(), xr.global_ordinal(), xr.world_size()
    if r != 0:
        time.sleep(1.0)  # rank 0 is inside the all-gather by now, holding its device's lock
        torch_xla.sync()  # nothing to run on this rank
    x = torch.full((2,), float(r)).to(dev)
    g = xm.all_gather(x, pin_layout=False, channel_id=1, use_global_device_ids=True,
                      groups=[list(range(n))])  # fmt: skip
    return g.cpu().tolist()


@pytest.mark.parametrize("guard", ["1", "0"])
def test_a_sync_with_nothing_to_run_waits_for_rank_0_unless_guarded(guard):
    env = {"XLA_PERMUTE_SYNC_GUARD": guard}
    if guard == "1":
        want = [float(r) for r in range(N) for _ in range(2)]
        assert xp.run_on_mesh(_empty_syncs_while_rank_0_gathers, n=N, env=env) == [want] * N
        return
    with pytest.raises(xp.MeshError, match="SIGABRT") as raised:
        xp.run_on_mesh(_empty_syncs_while_rank_0_gathers, n=N, env=env)
    assert "Diagnosis: XLA:CPU aborted an all gather (channel id 1)" in str(raised.value)
