"""``xp.parallelize_module``: a Hugging Face Llama made TP + SP by one call, equal to one device.

The user's program is tests/llama_plan.py (a torchtitan-style plan with PyTorch's own style
objects). One 4-device launch runs every plan (sequence parallel with 2 KV heads on 4 ranks and
with 4, tensor parallel only, torchtitan's PrepareModuleInput form, the baseline strategy) and
traces the forward's collectives; one 8-device launch runs 8 query heads over 2 KV heads; one
torchrun launch runs the plan on 4 gloo processes. Each is checked against the same
``LlamaForCausalLM`` on one device (CPU, float64): logits and 3 AdamW steps. Host tests check
the shards and every refusal of a bad plan, before the model changes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import llama_plan as lp
import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torchrun import torchrun

import xla_permute as xp

STEPS = 3
#: The mesh and the CPU differ in float64 only by HF's rotary embedding, computed in float32
#: (1 ulp of float32 in cos/sin: 7.6e-8 in the logits on one XLA device alone, too).
ATOL = 1e-6

CASES = {  # name: (config options, plan, parallelize_module options)
    "sp, 2 KV heads on 4 ranks": ({"kv_heads": 2}, "sp", {}),
    "sp, 4 KV heads on 4 ranks": ({"kv_heads": 4}, "sp", {}),
    "tp only": ({"kv_heads": 2}, "tp", {}),
    "torchtitan's PrepareModuleInput": ({"kv_heads": 2}, "titan", {}),
    "sp, baseline strategy": ({"kv_heads": 2}, "sp", {"strategy": "baseline"}),
}
EIGHT = {"heads": 8, "kv_heads": 2}


def _problem(options: dict, seq: int = 16):
    cfg = lp.config(**options)
    tokens = torch.randint(0, cfg.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))
    return lp.model(cfg), tokens


def _collectives(model: nn.Module, tokens: torch.Tensor, strategy: str) -> dict[str, int]:
    """The collectives of the forward's program (traced, not run), by kind, as the native
    backend (TPU, Neuron) issues them: the CPU mesh's own permutes are all-gathers."""
    import torch_xla

    dev = torch_xla.device()
    model = model.to(dev)
    xp.parallelize_module(model, None, lp.plan(model), strategy=strategy, backend="native")
    with xp.hlo.tracing():
        logits = model(tokens.to(dev)).logits
        program = xp.hlo.parse(xp.hlo.trace(logits))
    del logits
    counts: dict[str, int] = {}
    for c in program.collectives():
        counts[c.kind] = counts.get(c.kind, 0) + 1
    return counts


def _unit_modules(n: int) -> dict:
    """The modules of :func:`_units`, built on the host (the rank threads share torch's RNG)."""
    torch.manual_seed(3)
    return {
        "emb": nn.Embedding(4 * n, 3, padding_idx=1),
    }


def _units(dev: torch.device, modules: dict) -> dict:
    """The pieces on their own, against plain torch on the same rank: the loss with ignored
    tokens, an embedding's padding row."""
    import torch_xla.runtime as xr

    n, r = xr.world_size(), xr.global_ordinal()
    g = torch.Generator().manual_seed(5)
    out: dict = {}
    # The loss of vocabulary shards, tokens ignored, against cross_entropy of the whole.
    logits = torch.randn(2, 6, 8 * n, generator=g)
    target = torch.randint(0, 8 * n, (2, 6), generator=g)
    target[0, :3] = -100
    mine = logits[..., r * 8 : (r + 1) * 8].to(dev).requires_grad_()
    loss = xp.vocab_parallel_cross_entropy(mine, target.to(dev))
    loss.backward()
    whole = logits.clone().requires_grad_()
    want = nn.functional.cross_entropy(whole.flatten(0, 1), target.flatten())
    want.backward()
    out["loss"] = abs(loss.item() - want.item())
    out["loss grad"] = (mine.grad.cpu() - whole.grad[..., r * 8 : (r + 1) * 8]).abs().max().item()
    # An embedding with a padding row: the same lookup, no gradient for that row.
    emb = modules["emb"]
    par = xp.VocabParallelEmbedding.from_embedding(emb, dim=None).to(dev)
    tokens = torch.tensor([[0, 1, 2, 4 * n - 1]])
    y = par(tokens.to(dev))
    y.sum().backward()
    out["embedding"] = (y.cpu() - emb(tokens)).abs().max().item()
    out["padding grad"] = par.weight.grad.cpu()[1].abs().sum().item() if r == 0 else 0.0
    return out


def _mesh_cases(problems: dict, traced: tuple, modules: dict) -> dict:
    import torch_xla

    dev = torch_xla.device()
    out = {"units": _units(dev, modules)}
    out |= {
        name: lp.train(model, tokens, STEPS, dev, plan, **options)
        for name, (model, tokens, plan, options) in problems.items()
    }
    out["collectives"] = {
        s: _collectives(copy.deepcopy(traced[0]), traced[1], s) for s in ("ring", "baseline")
    }
    return out


@pytest.fixture(scope="module")
def mesh4() -> list[dict]:
    problems = {
        name: (*_problem(cfg), plan, options) for name, (cfg, plan, options) in CASES.items()
    }
    # The heaviest launch of the module: slow, not hung, on a loaded machine.
    args = (_mesh_cases, problems, _problem({"kv_heads": 2}), _unit_modules(4))
    return xp.run_on_mesh(*args, n=4, timeout=900)


def _check(got: list, model: nn.Module, tokens: torch.Tensor) -> None:
    want_logits, want_losses = lp.reference(copy.deepcopy(model), tokens, STEPS)
    for rank, (logits, losses, norms) in enumerate(got):
        assert torch.allclose(logits, want_logits, rtol=0, atol=ATOL), rank
        assert losses == pytest.approx(want_losses, rel=1e-6), rank
        for name, weight in norms.items():  # replicated weights: the same bits everywhere
            assert torch.equal(weight, got[0][2][name]), (rank, name)
    assert want_losses[-1] < want_losses[0]  # it trains


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_equals_one_device_in_logits_and_three_adamw_steps(mesh4, name):
    _check([rank[name] for rank in mesh4], *_problem(CASES[name][0]))


def test_every_matmul_of_a_block_is_a_ring(mesh4):
    n, layers = 4, 2
    rings = layers * 4 + 1  # q/k/v, o, gate/up, down per layer; the LM head
    for rank in mesh4:
        ring, baseline = rank["collectives"]["ring"], rank["collectives"]["baseline"]
        # The embedding's reduce-scatter stays (a lookup, no matmul to overlap it with).
        assert ring == {"collective-permute": rings * (n - 1), "reduce-scatter": 1}
        assert baseline == {"all-gather": 2 * layers + 1, "reduce-scatter": 2 * layers + 1}


def test_the_sharded_loss_and_padding_equal_plain_torch(mesh4):
    for rank in mesh4:
        u = rank["units"]
        assert u["loss"] < 1e-6 and u["loss grad"] < 1e-6
        assert u["embedding"] == 0 and u["padding grad"] == 0


def _context(model: nn.Module, tokens: torch.Tensor) -> tuple:
    import torch_xla

    return lp.train_context(model, tokens, STEPS, torch_xla.device(), 2, 2, "zigzag")


def test_tp_sp_and_ring_attention_on_a_2x2_mesh_equal_one_device():
    model, tokens = _problem({"kv_heads": 2})
    got = xp.run_on_mesh(_context, model, tokens, n=4)
    want_logits, want_losses = lp.reference(copy.deepcopy(model), tokens, STEPS)
    shards = torch.stack([got[xp.Mesh2D(tp=2, cp=2).rank(0, c)][0] for c in range(2)])
    logits = xp.unshard_sequence(shards, dim=1, layout="zigzag")
    assert torch.allclose(logits, want_logits, rtol=0, atol=ATOL)
    for rank, (_, losses, norms) in enumerate(got):
        assert losses == pytest.approx(want_losses, rel=1e-6), rank
        for name, weight in norms.items():
            assert torch.equal(weight, got[0][2][name]), (rank, name)


def _eight(model: nn.Module, tokens: torch.Tensor) -> tuple:
    import torch_xla

    return lp.train(model, tokens, STEPS, torch_xla.device(), "sp")


def test_eight_ranks_with_four_copies_of_each_kv_head_equal_one_device():
    model, tokens = _problem(EIGHT)
    _check(xp.run_on_mesh(_eight, model, tokens, n=8), model, tokens)


def test_the_same_plan_on_four_gloo_processes_equals_one_device(tmp_path):
    model, tokens = _problem({"kv_heads": 2})
    torch.save((model, tokens), tmp_path / "problem.pt")
    code, output, _ = torchrun(
        Path(__file__).parent / "llama_plan.py", 4, str(tmp_path), timeout=240
    )
    assert code == 0, output[-4000:]
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    _check(got, model, tokens)


# --- on the host: the shards, and the refusals --------------------------------------------------


def _host(options: dict | None = None, rank: int = 0, n: int = 4):
    model, _ = _problem(options or {"kv_heads": 2})
    return model, dict(world_size=n, rank=rank)


@pytest.mark.parametrize("rank", range(4))
def test_each_rank_holds_its_slices_of_the_weights(rank):
    model, where = _host(rank=rank)
    full = copy.deepcopy(model)
    xp.parallelize_module(model, None, lp.plan(model), **where)
    layer, ref = model.model.layers[0], full.model.layers[0]
    attn = layer.self_attn
    assert isinstance(attn, xp.ParallelAttention)
    assert torch.equal(attn.q_proj.weight, ref.self_attn.q_proj.weight.chunk(4)[rank])
    kv = rank // 2  # 4 query heads, 2 KV heads: ranks 0, 1 hold KV head 0; ranks 2, 3 head 1
    assert torch.equal(attn.k_proj.weight, ref.self_attn.k_proj.weight.chunk(2)[kv])
    assert attn.kv_groups == [[0, 1], [2, 3]]
    assert torch.equal(attn.o_proj.weight, ref.self_attn.o_proj.weight.chunk(4, 1)[rank])
    mlp = layer.mlp  # gate and up on one ring: Hugging Face's MLP became a GatedMLP
    assert isinstance(mlp, xp.GatedMLP) and mlp.gate.strategy == "ring"
    assert torch.equal(mlp.gate.weight, ref.mlp.gate_proj.weight.chunk(4)[rank])
    assert torch.equal(mlp.up.weight, ref.mlp.up_proj.weight.chunk(4)[rank])
    assert torch.equal(mlp.down.weight, ref.mlp.down_proj.weight.chunk(4, 1)[rank])
    emb = model.model.embed_tokens
    assert torch.equal(emb.weight, full.model.embed_tokens.weight.chunk(4)[rank])
    assert torch.equal(model.lm_head.weight, full.lm_head.weight.chunk(4)[rank])
    assert model.model.norm.weight is not None  # kept whole


def _refused(plan: dict, match: str, options: dict | None = None, n: int = 4) -> None:
    model, where = _host(options, n=n)
    before = [type(m) for m in model.modules()]
    with pytest.raises((ValueError, TypeError), match=match):
        xp.parallelize_module(model, None, plan, **where)
    assert [type(m) for m in model.modules()] == before  # untouched


def test_a_key_that_matches_no_module_is_refused_with_close_names():
    _refused({"model.layers.*.mlp.gate": ColwiseParallel()}, "matches no module.*gate_proj")


def test_a_module_matched_twice_is_refused():
    plan = {
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.0.mlp.up_proj": ColwiseParallel(),
    }
    _refused(plan, "matched by two plan keys")


def test_a_style_on_a_module_it_cannot_shard_is_refused():
    _refused({"model.embed_tokens": ColwiseParallel()}, "RowwiseParallel")
    _refused({"model.norm": RowwiseParallel()}, "not a LlamaRMSNorm")
    _refused({"model.layers.*.mlp": xp.HeadwiseParallel()}, "q_proj/k_proj")
    _refused({"model.layers.*.mlp.up_proj": 3}, "style int is not one this package applies")
    _refused(
        {"model.layers.*.mlp.up_proj": ColwiseParallel(input_layouts=Shard(-1))}, "RowwiseParallel"
    )
    _refused(
        {"model.layers.*.mlp.down_proj": RowwiseParallel(input_layouts=Replicate())},
        "Shard\\(-1\\)",
    )


def test_sizes_the_group_does_not_divide_are_refused():
    _refused({"model.layers.*.self_attn": xp.HeadwiseParallel()}, "heads = 4 is not divisible", n=8)
    _refused(
        {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate())},
        "num_embeddings = 128 is not divisible",
        n=3,
    )
    _refused(
        {"model.layers.*.self_attn": xp.HeadwiseParallel()},
        "kv_heads = 3 neither divides",
        {"heads": 12, "kv_heads": 3, "hidden": 48},
        n=2 * 2,
    )


def test_attention_dropout_is_refused():
    _refused(
        {"model.layers.*.self_attn": xp.HeadwiseParallel()},
        "attention dropout 0.1",
        {"kv_heads": 2, "attention_dropout": 0.1},
    )


def test_a_sequence_parallel_plan_must_cover_every_parameter():
    plan = {k: v for k, v in lp.plan(_host()[0]).items() if k != "model.norm"}
    _refused(plan, "model.norm.weight.*SequenceParallel")


def test_a_key_inside_a_module_taken_whole_is_refused():
    plan = {
        "model.layers.*.self_attn": xp.HeadwiseParallel(),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    }
    _refused(plan, "inside")
    _refused({"model.norm": SequenceParallel(), "model": SequenceParallel()}, "inside")


def test_the_vocab_parallel_loss_refuses_mismatched_targets():
    logits = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match="target must have the logits' shape"):
        xp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        xp.vocab_parallel_cross_entropy(logits, torch.zeros(2, 3))
