"""A Hugging Face Llama made tensor- and sequence-parallel by hand, as a user writes it.

The user's program of the mesh tests (tests/test_mesh_programs.py): a ``LlamaForCausalLM`` from a
``LlamaConfig`` (random weights, no download), its MLPs as :class:`xla_permute.GatedMLP`,
q/k/v on one :func:`xla_permute.all_gather_matmul` ring, ``o_proj`` as
:class:`xla_permute.RowParallelLinear`, embedding, norms and LM head replicated. GQA with fewer
KV heads than ranks: KV head ``h`` lives on the ranks ``r`` with ``r * q_heads_per_rank //
group == h``, and its copies' gradients are summed over those ranks.

Per rank (N ranks, sequence S): tokens ``[B, S/N]`` -> hidden ``[B, S/N, H]`` -> the rank's loss
term ``sum of its tokens' cross-entropy / (B * S)``; the loss is the sum over ranks.
"""

from __future__ import annotations

import torch
from torch import nn


def config(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 128):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )


def model(cfg, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)  # on the host, before any rank starts
    return LlamaForCausalLM(cfg).eval()


def reference_losses(full, tokens: torch.Tensor, steps: int, lr: float = 1e-2) -> list[float]:
    """One device: ``steps`` AdamW steps of the mean next-token... loss on ``tokens``."""
    opt = torch.optim.AdamW(full.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = full(tokens).logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets(tokens).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def targets(tokens: torch.Tensor) -> torch.Tensor:
    """The next token of each position (the last position predicts the first: a ring)."""
    return tokens.roll(-1, dims=1)


class ParallelAttention(nn.Module):
    """This rank's heads of a ``LlamaAttention``: ``[B, S/N, H] -> [B, S/N, H]``."""

    def __init__(self, attn, cfg, rotary, world: int, rank: int) -> None:
        import xla_permute as xp

        super().__init__()
        hd = cfg.hidden_size // cfg.num_attention_heads
        q_per_rank = cfg.num_attention_heads // world
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        first = rank * q_per_rank
        kv = first // group  # the KV head of this rank's q heads (q_per_rank <= group)
        rows = slice(first * hd, (first + q_per_rank) * hd)
        kv_rows = slice(kv * hd, (kv + 1) * hd)
        self.wq = nn.Parameter(attn.q_proj.weight[rows].detach().clone())
        self.wk = nn.Parameter(attn.k_proj.weight[kv_rows].detach().clone())
        self.wv = nn.Parameter(attn.v_proj.weight[kv_rows].detach().clone())
        self.o_proj = xp.RowParallelLinear.from_linear(attn.o_proj)
        self.rotary, self.heads, self.hd = rotary, q_per_rank, hd
        # The ranks that hold the same KV head: their copies' gradients are summed.
        ranks_per_kv = max(1, world * group // cfg.num_attention_heads)
        self.kv_groups = [list(range(g, g + ranks_per_kv)) for g in range(0, world, ranks_per_kv)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        import xla_permute as xp

        q, k, v = xp.all_gather_matmul(x, [self.wq.T, self.wk.T, self.wv.T], dim=1)
        b, s, _ = q.shape
        q = q.view(b, s, self.heads, self.hd).transpose(1, 2)
        k = k.view(b, s, 1, self.hd).transpose(1, 2)
        v = v.view(b, s, 1, self.hd).transpose(1, 2)
        positions = torch.arange(s, device=x.device).unsqueeze(0)
        cos, sin = self.rotary(v, positions)  # the whole sequence: gathered above
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = k.expand(b, self.heads, s, self.hd), v.expand(b, self.heads, s, self.hd)
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.hd))


def parallelize(full, world: int, rank: int):
    """Swap ``full``'s attention and MLP for this rank's tensor-parallel ones, in place."""
    import xla_permute as xp

    cfg = full.config
    for layer in full.model.layers:
        mlp = layer.mlp
        layer.mlp = xp.GatedMLP.from_mlp(mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        layer.self_attn = ParallelAttention(
            layer.self_attn, cfg, full.model.rotary_emb, world, rank
        )
    return full


def rank_loss(full, tokens: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """This rank's term of the mean loss over all ``B * S`` tokens (sequence shard ``rank``)."""
    shard = tokens.chunk(world, dim=1)[rank]
    h = full.model.embed_tokens(shard)
    for layer in full.model.layers:
        h = h + layer.self_attn(layer.input_layernorm(h))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    logits = full.lm_head(full.model.norm(h))
    goal = targets(tokens).chunk(world, dim=1)[rank]
    total = nn.functional.cross_entropy(logits.flatten(0, 1), goal.flatten(), reduction="sum")
    return total / tokens.numel()


def sum_gradients(full, world: int) -> None:
    """Sum the gradients of every copy: replicated parameters over all ranks, KV heads over
    the ranks that share them."""
    import xla_permute as xp

    sharded, kv = set(), []
    for layer in full.model.layers:
        attn = layer.self_attn
        kv += [attn.wk, attn.wv]
        sharded |= {id(p) for p in [attn.wq, *attn.o_proj.parameters(), *layer.mlp.parameters()]}
    replicated = [p for p in full.parameters() if id(p) not in sharded and id(p) not in map(id, kv)]
    xp.all_reduce_gradients(replicated)
    groups = full.model.layers[0].self_attn.kv_groups
    if len(groups[0]) > 1:
        xp.all_reduce_gradients(kv, groups=groups)


def train(full, tokens: torch.Tensor, steps: int, lr: float = 1e-2) -> list[float]:
    """The rank function's body: ``steps`` AdamW steps on the mesh; the global loss per step."""
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    world, rank = xr.world_size(), xr.global_ordinal()
    dev = torch_xla.device()
    full = parallelize(full, world, rank).to(dev)
    tokens = tokens.to(dev)
    opt = torch.optim.AdamW(full.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = rank_loss(full, tokens, world, rank)
        opt.zero_grad()
        loss.backward()
        sum_gradients(full, world)
        opt.step()
        losses.append(xp.all_reduce(loss.detach()))
        torch_xla.sync()
    return [float(v) for v in torch.stack(losses).cpu()]
