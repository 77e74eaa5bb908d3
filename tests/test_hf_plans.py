"""Hugging Face's own plans: a Qwen2 and a Llama (8 query heads over 2 KV heads) made
tensor-parallel on 4 and 8 ranks by one call with ``config.base_model_tp_plan`` equal one
device (logits, first gradients, 3 AdamW steps); the PyTorch form that cuts a KV head, strings
not applied and tied weights split apart are refused before anything changes."""

from __future__ import annotations

import copy

import llama_plan as lp
import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import xla_permute as xp

STEPS = 3
#: As tests/test_plan.py: the mesh and the CPU differ in float64 only by HF's float32 rotary.
ATOL = 1e-6
#: AdamW turns tiny gradient differences into whole steps: on one device, weights perturbed by
#: 1e-9 (relative) move this Qwen2's three losses by 1.9e-7 (relative), the Llama's by 3.3e-8;
#: the mesh's float32 rotary noise moves them by 7.2e-7 and 9.1e-8. A wrong gradient moves
#: them by orders of magnitude more.
LOSS_RTOL = 1e-5


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa",
        use_cache=False, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).to(torch.float64)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=80, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, attn_implementation="sdpa",
        use_cache=False, max_position_embeddings=64, mlp_bias=True,
    )  # fmt: skip
    torch.manual_seed(1)
    return LlamaForCausalLM(config).to(torch.float64)


MODELS = {"qwen2": _qwen2, "llama": _llama}


def _tokens(model: nn.Module) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, model.config.vocab_size, (2, 16), generator=g)


def _pytorch_form(plan: dict) -> dict:
    """The same plan as PyTorch documents it: ColwiseParallel() for "colwise", ..."""
    return {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in plan.items()}


def _on_rank(models: dict, tokens: dict) -> dict:
    """Per model: the PyTorch form refused (the message; the model unchanged), then the model
    made parallel by one call with its own plan, and 3 AdamW steps."""
    import torch_xla

    dev = torch_xla.device()
    out = {}
    for name, model in models.items():
        model = model.to(dev)
        before = [type(m) for m in model.modules()]
        try:
            xp.parallelize_module(model, None, _pytorch_form(model.config.base_model_tp_plan))
            refused = ""
        except ValueError as e:
            refused = str(e)
        unchanged = [type(m) for m in model.modules()] == before
        xp.parallelize_module(model, None, model.config.base_model_tp_plan)  # the one call
        x, y = tokens[name].to(dev), tokens[name].roll(-1, dims=1).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, first, grads = [], None, {}
        for _ in range(STEPS):
            logits = model(x).logits
            first = logits.detach() if first is None else first
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
            torch_xla.sync()
            grads = grads or {n: p.grad.cpu() for n, p in model.named_parameters()}
        whole = {n: p.detach().cpu() for n, p in model.named_parameters() if "norm" in n}
        attention = type(model.model.layers[0].self_attn).__name__
        out[name] = (first.cpu(), [float(v) for v in torch.stack(losses).cpu()], whole)
        out[name] += (refused, unchanged, attention, grads)
    return out


@pytest.fixture(scope="module", params=[4, 8], ids=lambda n: f"{n} ranks")
def ranks(request) -> tuple[int, list[dict]]:
    models = {name: make() for name, make in MODELS.items()}
    tokens = {name: _tokens(model) for name, model in models.items()}
    return request.param, xp.run_on_mesh(_on_rank, models, tokens, n=request.param, timeout=600)


@pytest.mark.parametrize("name", list(MODELS))
def test_mesh_own_plan_in_one_call_equals_one_device(ranks, name):
    n, got = ranks
    model = MODELS[name]()
    want_logits, want_losses = lp.reference(model, _tokens(model), STEPS)
    assert want_losses[-1] < want_losses[0]  # it trains
    for rank, (logits, losses, whole, *_, attention, _) in enumerate(got[name] for got in got):
        assert attention == "ParallelAttention", rank
        assert torch.allclose(logits, want_logits, rtol=0, atol=ATOL), (n, rank)
        assert losses == pytest.approx(want_losses, rel=LOSS_RTOL), (n, rank)
        for key, weight in whole.items():  # held whole: the same bits on every rank
            assert torch.equal(weight, got[0][name][2][key]), (n, rank, key)


def _first_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    tokens = _tokens(model)
    logits = model(tokens).logits
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, dims=1).flatten()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(MODELS))
def test_mesh_first_gradients_are_the_one_devices_slices(ranks, name):
    """Each rank's gradients of the first step: its block of the one device's (AdamW steps
    hide a gradient off by a factor: their updates are about lr * sign)."""
    n, got = ranks
    want = _first_gradients(MODELS[name]())
    for r, rank in enumerate(got):
        grads = rank[name][6]
        assert set(grads) == set(want)  # the parallel model keeps Hugging Face's names
        for key, g in grads.items():
            full = want[key]
            d = next((d for d in range(g.dim()) if g.shape[d] != full.shape[d]), 0)
            blocks = full.shape[d] // g.shape[d]  # n, or the KV heads (a head's copies)
            mine = full.narrow(d, r * blocks // n * g.shape[d], g.shape[d])
            scale = full.abs().max().item()
            assert torch.allclose(g, mine, rtol=0, atol=1e-6 * scale), (n, r, key)


@pytest.mark.parametrize("name", list(MODELS))
def test_mesh_the_pytorch_form_that_cuts_a_kv_head_is_refused_on_every_rank(ranks, name):
    n, got = ranks
    for rank in got:
        refused, unchanged = rank[name][3:5]
        assert unchanged
        assert "self_attn.k_proj: ColwiseParallel would cut its 2 heads" in refused
        assert f"over {n} ranks" in refused and "HeadwiseParallel()" in refused


# --- on the host: the strings' styles, and the refusals -------------------------------------


def test_the_strings_become_the_styles_and_the_attention_headwise():
    model = _qwen2()
    full = copy.deepcopy(model)
    plan = {**model.config.base_model_tp_plan, **type(model)._tp_plan}  # lm_head: colwise_rep
    xp.parallelize_module(model, None, plan, world_size=4, rank=3)
    layer, ref = model.model.layers[1], full.model.layers[1]
    attn = layer.self_attn
    assert isinstance(attn, xp.ParallelAttention) and attn.o_proj.dim is None
    assert attn.kv_groups == [[0, 1], [2, 3]]  # 2 KV heads on 4 ranks: each on two
    assert torch.equal(attn.q_proj.weight, ref.self_attn.q_proj.weight.chunk(4)[3])
    assert torch.equal(attn.k_proj.bias, ref.self_attn.k_proj.bias.chunk(2)[1])
    assert isinstance(layer.mlp.gate_proj, xp.ColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, xp.RowParallelLinear)
    assert model.lm_head.gather_output and model.lm_head.dim is None
    assert torch.equal(model.lm_head.weight, full.lm_head.weight.chunk(4)[3])
    assert type(model.model.embed_tokens) is nn.Embedding  # not in the plan: whole


def test_the_models_whole_plan_with_both_key_forms_is_taken():
    model = _llama()
    assert any(k.startswith("model.") for k in model.tp_plan)  # and the same from the base on
    xp.parallelize_module(model, None, model.tp_plan, world_size=2, rank=0)
    assert isinstance(model.model.layers[0].self_attn, xp.ParallelAttention)


def test_a_pytorch_form_that_keeps_whole_heads_runs_the_models_own_attention():
    model = _qwen2()  # 2 KV heads on 2 ranks: one each
    xp.parallelize_module(model, None, _pytorch_form(model.config.base_model_tp_plan),
                          world_size=2, rank=1)  # fmt: skip
    assert isinstance(model.model.layers[0].self_attn.k_proj, xp.ColumnParallelLinear)


def _refused(plan: dict, match: str, n: int = 4, model: nn.Module | None = None) -> None:
    model = model or _qwen2()
    before = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=match):
        xp.parallelize_module(model, None, plan, world_size=n, rank=0)
    assert [type(m) for m in model.modules()] == before  # untouched


def test_a_column_split_that_cuts_a_head_is_refused_naming_heads_ranks_and_fix():
    plan = _pytorch_form(_qwen2().config.base_model_tp_plan)
    _refused(plan, r"layers.0.self_attn.k_proj: ColwiseParallel would cut its 2 heads .*4 ranks")
    _refused(plan, r"q_proj: .* 8 heads .* 16 ranks.*HeadwiseParallel\(\)", n=16)


def test_a_string_it_does_not_apply_is_refused_by_name_with_the_style_to_use():
    _refused({"layers.*.mlp.gate_proj": "colwize"}, "'colwize' is not applied here; use one of")
    _refused({"layers.*.mlp.down_proj": "local_rowwise"}, "'local_rowwise'.*RowwiseParallel")
    _refused({"layers.*.mlp.down_proj": "gather"}, "'gather'.*expert")
    _refused({"norm": "sequence_parallel"}, "'sequence_parallel'.*SequenceParallel\\(\\)")


def test_an_attention_parallel_attention_does_not_compute_keeps_its_own_forward():
    model = _qwen2()
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 8  # a window: not ParallelAttention's
    _refused(model.config.base_model_tp_plan, "k_proj: ColwiseParallel would cut", model=model)


def test_a_plan_that_would_untie_tied_weights_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**{**_qwen2().config.to_dict(), "tie_word_embeddings": True})
    model = Qwen2ForCausalLM(config).to(torch.float64)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = {**config.base_model_tp_plan, **type(model)._tp_plan}  # lm_head: colwise_rep
    _refused(plan, "lm_head.weight is model.embed_tokens.weight \\(tied\\)", model=model)
