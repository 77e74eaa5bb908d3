"""No silent garbage by default on the CPU mesh (one mesh launch, N=4).

``run_on_mesh`` turns the debug mode on unless the caller sets ``XLA_PERMUTE_DEBUG``; the launch
here runs with the variable unset, as a new user's would. Four disagreements that XLA runs to
completion with garbage (a longer tensor, another dtype, other pairs, a rank with more rows in
``all_gather_matmul``) raise ``DisagreementError`` on every rank, naming the ranks and what
differs. Mistakes a rank can see alone raise with the debug mode off too, before any collective.
"""

from __future__ import annotations

import re

import pytest
import torch

from xla_permute import debug, run_on_mesh
from xla_permute.cpu_mesh import mesh_environment
from xla_permute.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from xla_permute.tensor_parallel.mlp import GatedMLP, SequenceParallelMLP

N = 4

#: case -> the pattern every rank's DisagreementError must match (the debug mode's default)
DISAGREE = {
    "permute: longer x on rank 1": r"collective_permute: the ranks disagree on x\.shape: rank 1 "
    r"passes \(3,\), ranks 0, 2, 3 pass \(2,\)",
    "permute: float64 on rank 0": r"collective_permute: the ranks disagree on x\.dtype: rank 0 "
    r"passes torch\.float64, ranks 1, 2, 3 pass torch\.float32",
    "permute: ring +1 on ranks 0, 1, ring -1 on 2, 3": r"collective_permute: the ranks disagree "
    r"on pairs: ranks 0, 1 pass \(\(0, 1\), \(1, 2\), \(2, 3\), \(3, 0\)\), ranks 2, 3 pass "
    r"\(\(0, 3\), \(1, 0\), \(2, 1\), \(3, 2\)\)",
    "all_gather_matmul: 3 rows on rank 2": r"all_gather_matmul: the ranks disagree on x\.shape: "
    r"rank 2 passes \(3, 4\), ranks 0, 1, 3 pass \(2, 4\)",
    # the op the user called, with its own arguments (not an internal permute's packed K/V)
    "ring_attention: 4 tokens on rank 1": r"^ring_attention: the ranks disagree on q\.shape: "
    r"rank 1 passes \(1, 2, 4, 4\), ranks 0, 2, 3 pass \(1, 2, 2, 4\)",
}  # fmt: skip

#: case -> (error type, pattern): caught by the rank alone, with the debug mode off
LOCAL = {
    "layer built for 2 ranks, run on 4": ("ValueError", r"ColumnParallelLinear was built for "
                                          r"rank \d of 2 but runs on rank \d of a group of 4"),
    "column layer: x [..., 6], in_features 8": ("ValueError", r"ColumnParallelLinear takes x "
                                                r"\[\.\.\., in_features = 8\] on every rank, "
                                                r"got x of shape \(1, 2, 6\)"),
    "row layer: x [..., 8], in_features/N 2": ("ValueError", r"RowParallelLinear takes x "
                                               r"\[\.\.\., in_features/N = 2\] on every rank"),
    "reduce_scatter: 3 rows, groups of 2": ("ValueError", r"reduce_scatter: x\.shape\[0\] = 3 is "
                                            r"not divisible by the 2 ranks of the group"),
    "matmul_reduce_scatter: 3 rows, groups of 2": ("ValueError", r"x\.shape\[0\] = 3 is not "
                                                   r"divisible by the 2 ranks"),
    "permute: groups of sizes 3 and 1": ("ValueError", r"groups have different sizes \[1, 3\]"),
    "permute: pair (0, 2) in groups of 2": ("ValueError", r"outside the group of 2"),
    "ring_attention: zigzag, odd local length": ("ValueError", r"local sequence length is 3 "
                                                 r"\(odd\)"),
    "column layer on the device, input on the CPU": ("ValueError", r"but the input is on cpu; "
                                                     r"move the input to the layer's device"),
}  # fmt: skip


def default_cases() -> dict[str, object]:
    """Rank function: the environment's debug setting, then every case; errors are returned."""
    import os

    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    rank, device = xr.global_ordinal(), torch_xla.device()
    gen = torch.Generator().manual_seed(rank)

    def rows(n: int, cols: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = (torch.arange(n * cols, dtype=dtype).reshape(n, cols) % 5 + rank).to(device)
        return t.squeeze(-1) if cols == 1 else t

    def call(name: str) -> torch.Tensor:
        ring = xp.ring_pairs(N)
        if name == "permute: longer x on rank 1":
            return xp.collective_permute(rows(3 if rank == 1 else 2, 1), ring)
        if name == "permute: float64 on rank 0":
            return xp.collective_permute(
                rows(2, 1, torch.float64 if rank == 0 else torch.float32), ring
            )
        if name == "permute: ring +1 on ranks 0, 1, ring -1 on 2, 3":
            return xp.collective_permute(rows(2, 1), xp.ring_pairs(N, 1 if rank < 2 else -1))
        if name == "all_gather_matmul: 3 rows on rank 2":
            w = torch.ones(4, 2, device=device)
            return xp.all_gather_matmul(rows(3 if rank == 2 else 2, 4), w, dim=0)
        if name == "layer built for 2 ranks, run on 4":
            layer = ColumnParallelLinear(8, 8, world_size=2, rank=rank % 2, generator=gen)
            return layer.to(device)(torch.ones(1, 2, 8, device=device))
        if name == "column layer: x [..., 6], in_features 8":
            layer = ColumnParallelLinear(8, 8, generator=gen).to(device)
            return layer(torch.ones(1, 2, 6, device=device))
        if name == "row layer: x [..., 8], in_features/N 2":
            layer = RowParallelLinear(8, 8, generator=gen).to(device)
            return layer(torch.ones(1, 4, 8, device=device))
        if name == "reduce_scatter: 3 rows, groups of 2":
            return xp.reduce_scatter(rows(3, 4), 0, groups=[[0, 1], [2, 3]])
        if name == "matmul_reduce_scatter: 3 rows, groups of 2":
            w = torch.ones(4, 2, device=device)
            return xp.matmul_reduce_scatter(rows(3, 4), w, dim=0, groups=[[0, 1], [2, 3]])
        if name == "permute: groups of sizes 3 and 1":
            return xp.collective_permute(rows(2, 1), [(0, 1)], groups=[[0, 1, 2], [3]])
        if name == "permute: pair (0, 2) in groups of 2":
            return xp.collective_permute(rows(2, 1), [(0, 2)], groups=[[0, 1], [2, 3]])
        if name == "ring_attention: zigzag, odd local length":
            q = torch.ones(1, 2, 3, 4, device=device)
            return xp.ring_attention(q, q, q, layout="zigzag")
        if name == "ring_attention: 4 tokens on rank 1":
            q = torch.ones(1, 2, 4 if rank == 1 else 2, 4, device=device)
            return xp.ring_attention(q, q, q)
        if name == "column layer on the device, input on the CPU":
            layer = ColumnParallelLinear(8, 8, generator=gen).to(device)
            return layer(torch.ones(1, 2, 8))
        if name == "agree":  # after all the errors, a ring that agrees still runs
            return xp.collective_permute(rows(2, 1), ring)
        raise AssertionError(name)

    out: dict[str, object] = {
        "environment": os.environ.get(debug.ENV),
        "level": debug.check_level(),
    }
    for name in [*DISAGREE, "agree"]:  # the defaults: no debug_mode() here
        try:
            value = call(name)
            torch_xla.sync()
            out[name] = ("ok", value.cpu())
        except Exception as e:  # noqa: BLE001 - the test inspects the type and the message
            out[name] = (type(e).__name__, str(e))
    with xp.debug_mode("sampled"):  # caught by each rank alone: no check collective needed
        for name in LOCAL:
            try:
                call(name)
                out[name] = ("ok", None)
            except Exception as e:  # noqa: BLE001
                out[name] = (type(e).__name__, str(e))
    return out


@pytest.fixture(scope="module")
def mesh() -> list[dict[str, object]]:
    with pytest.MonkeyPatch.context() as mp:  # a new user's environment: the variable unset
        mp.delenv(debug.ENV, raising=False)
        return run_on_mesh(default_cases, n=N, timeout=240)


def test_the_mesh_turns_the_debug_mode_on(mesh):
    assert [(r["environment"], r["level"]) for r in mesh] == [("1", "every")] * N


@pytest.mark.parametrize("name", list(DISAGREE))
def test_disagreement_raises_on_every_rank_with_the_defaults(mesh, name):
    for r, rank in enumerate(mesh):
        kind, message = rank[name]
        assert kind == "DisagreementError", f"rank {r}: {kind}: {message}"
        assert re.search(DISAGREE[name], message), f"rank {r}: {message!r}"
        assert f"on rank {r} of {N}" in message


def test_ranks_that_agree_still_get_the_permute(mesh):
    xs = [(torch.arange(2, dtype=torch.float32) % 5) + r for r in range(N)]
    for r, rank in enumerate(mesh):
        kind, got = rank["agree"]
        assert kind == "ok", got
        assert torch.equal(got, xs[(r - 1) % N])


@pytest.mark.parametrize("name", list(LOCAL))
def test_local_mistakes_raise_without_the_debug_mode(mesh, name):
    kind, pattern = LOCAL[name]
    for r, rank in enumerate(mesh):
        got_kind, message = rank[name]
        assert got_kind == kind, f"rank {r}: {got_kind}: {message}"
        assert re.search(pattern, message), f"rank {r}: {message!r}"


# ----------------------------------------------------------------------------- no mesh


def test_mesh_environment_default_and_the_callers_choice(monkeypatch):
    monkeypatch.delenv(debug.ENV, raising=False)
    assert mesh_environment(2)[debug.ENV] == "1"
    assert mesh_environment(2, {debug.ENV: "0"})[debug.ENV] == "0"
    monkeypatch.setenv(debug.ENV, "0")  # the caller's environment turns it off
    assert mesh_environment(2)[debug.ENV] == "0"
    monkeypatch.setenv(debug.ENV, " ")  # blank: the default
    assert mesh_environment(2)[debug.ENV] == "1"


def test_outside_the_mesh_the_default_is_sampled(monkeypatch):
    """On a TPU or Neuron host (no run_on_mesh), an unset variable leaves the debug mode off:
    the sampled checks."""
    monkeypatch.delenv(debug.ENV, raising=False)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert debug.check_level() == "sampled"


def _layers(**kw) -> tuple[ColumnParallelLinear, ColumnParallelLinear, RowParallelLinear]:
    col = dict(world_size=2, rank=0)
    gate = ColumnParallelLinear(4, 8, **col)
    up = ColumnParallelLinear(4, 8, **col)
    down = RowParallelLinear(kw.pop("ffn", 8), 4, **{**col, **kw})
    return gate, up, down


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"world_size": 4}, r"agree on \['world_size'\]"),
        ({"dim": 0}, r"agree on \['dim'\]"),
        ({"groups": [[0, 1]]}, r"agree on \['groups'\]"),
        ({"ffn": 6}, r"out_features = 8 vs (fc2|down)\.in_features = 6"),
    ],
)
def test_mlp_blocks_refuse_layers_that_do_not_chain(change, pattern):
    gate, up, down = _layers(**change)
    with pytest.raises(ValueError, match="SequenceParallelMLP: fc1 feeds fc2.*" + pattern):
        SequenceParallelMLP(gate, down)
    with pytest.raises(ValueError, match="GatedMLP: gate feeds down.*" + pattern):
        GatedMLP(gate, up, down)
    SequenceParallelMLP(*_layers()[::2])  # layers that chain: fine
