"""A Hugging Face Llama made tensor- and sequence-parallel by one ``parallelize_module`` call.

The user's program of tests/test_plan.py, on the CPU mesh and on torchrun + gloo processes: a
``LlamaForCausalLM`` from a ``LlamaConfig`` (random weights, no download), the torchtitan-style
plan below, then the model's own ``forward``; the loss by
:func:`xla_permute.vocab_parallel_cross_entropy` of its vocabulary-sharded logits. No gradient
is summed by hand. The reference: the same model on one device.
"""

from __future__ import annotations

import torch
from torch import nn


def config(
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    **options,
):
    from transformers import LlamaConfig

    return LlamaConfig(
        **options,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        use_cache=False,
    )


def model(cfg, seed: int = 0, dtype: torch.dtype = torch.float64):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # on the host, before any rank starts
    return LlamaForCausalLM(cfg).to(dtype).eval()


def targets(tokens: torch.Tensor) -> torch.Tensor:
    """The next token of each position (the last predicts the first)."""
    return tokens.roll(-1, dims=1)


def plan(full, strategy: str = "ring") -> dict:
    """The torchtitan Llama plan in Hugging Face's module names, attention as one style."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import xla_permute as xp

    rotary = full.model.rotary_emb

    def rope(q, k, positions):
        cos, sin = rotary(q, positions[None])
        return apply_rotary_pos_emb(q, k, cos, sin)

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.layers.*.input_layernorm": SequenceParallel(),
        "model.layers.*.self_attn": xp.HeadwiseParallel(position_fn=rope),
        "model.layers.*.post_attention_layernorm": SequenceParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.mlp.up_proj": ColwiseParallel(input_layouts=Shard(1)),
        "model.layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1)),
    }


def reference(full, tokens: torch.Tensor, steps: int, lr: float = 1e-2):
    """One device: the first logits and ``steps`` AdamW steps' losses."""
    opt = torch.optim.AdamW(full.parameters(), lr=lr)
    losses, first = [], None
    for _ in range(steps):
        logits = full(tokens).logits
        first = logits.detach().clone() if first is None else first
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets(tokens).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return first, losses


def train(full, tokens: torch.Tensor, steps: int, device, plan_name: str = "sp", **options):
    """The rank's program: one ``parallelize_module`` call, ``steps`` AdamW steps (lr 1e-2).

    Returns the first step's logits gathered ``[B, S, V]``, the losses, and the weights of the
    norms after the steps (replicated: every rank must hold the same)."""
    import xla_permute as xp

    full = full.to(device)
    xp.parallelize_module(full, None, PLANS[plan_name](full), **options)
    tokens = tokens.to(device)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    vocab_parallel = plan_name != "tp"
    losses, first = [], None
    for _ in range(steps):
        logits = full(tokens).logits  # [B, S, V/N] (this rank's vocabulary block) or [B, S, V]
        if first is None:
            first = xp.all_gather(logits.detach(), 2) if vocab_parallel else logits.detach()
        if vocab_parallel:
            loss = xp.vocab_parallel_cross_entropy(logits, targets(tokens))
        else:
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets(tokens).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        _sync(device)
    norms = {n: p.detach().cpu() for n, p in full.named_parameters() if "norm" in n}
    return first.cpu(), [float(v) for v in torch.stack(losses).cpu()], norms


def train_context(full, tokens: torch.Tensor, steps: int, device, tp: int, cp: int, layout: str):
    """TP x CP (:class:`xla_permute.Mesh2D`): the plan over each TP group, ring attention over
    each CP group; this rank's tokens are its CP shard (``layout``). The loss of a rank is its
    tokens' sum over ``B * S`` (the CP ranks' terms add up to the mean). Returns the rank's
    first logits ``[B, S/C, V]``, the global losses, and the norms' weights."""
    import xla_permute as xp

    mesh = xp.Mesh2D(tp=tp, cp=cp)
    _, c = mesh.coords()
    full = full.to(device)
    xp.parallelize_module(
        full, mesh.tp_groups, plan(full), context_groups=mesh.cp_groups, layout=layout
    )
    mine = xp.shard_sequence(tokens, dim=1, n=cp, layout=layout)[c].to(device)
    goal = xp.shard_sequence(targets(tokens), dim=1, n=cp, layout=layout)[c].to(device)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    losses, first = [], None
    for _ in range(steps):
        logits = full(mine).logits  # [B, S/C, V/T]
        if first is None:
            first = xp.all_gather(logits.detach(), 2, groups=mesh.tp_groups)
        total = xp.vocab_parallel_cross_entropy(
            logits, goal, reduction="sum", groups=mesh.tp_groups
        )
        loss = total / tokens.numel()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(xp.all_reduce(loss.detach(), groups=mesh.cp_groups))
        _sync(device)
    norms = {n: p.detach().cpu() for n, p in full.named_parameters() if "norm" in n}
    return first.cpu(), [float(v) for v in torch.stack(losses).cpu()], norms


def _sync(device) -> None:
    if str(device).startswith("xla"):
        import torch_xla

        torch_xla.sync()


def tp_plan(full) -> dict:
    """Tensor parallel without sequence parallelism: activations whole on every rank, full
    logits (``ColwiseParallel`` gathers them), the loss by plain ``cross_entropy``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import xla_permute as xp

    sp = plan(full)
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn": xp.HeadwiseParallel(
            input_layouts=Replicate(), position_fn=sp["model.layers.*.self_attn"].position_fn
        ),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }


def titan_plan(full) -> dict:
    """torchtitan's own form: the MLP's input gathered by ``PrepareModuleInput``, then plain
    column-parallel matmuls (no ring: the gather is not fused)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    fused = plan(full)
    return {
        **fused,
        "model.layers.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
    }


PLANS = {"sp": plan, "tp": tp_plan, "titan": titan_plan}


if __name__ == "__main__":  # one gloo process of tests/test_plan.py (torchrun, CPU tensors)
    import sys
    from pathlib import Path

    import torch.distributed as dist

    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    model, tokens = torch.load(out / "problem.pt", weights_only=False)
    result = train(model, tokens, 3, torch.device("cpu"), "sp")
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
