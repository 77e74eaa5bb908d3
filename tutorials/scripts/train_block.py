"""One transformer block trained on a TP x CP grid under torch_xla.launch.

The code of tutorials/10_putting_it_together.md, put together from its cells (the page
checks that this file is what they define). Usage: python train_block.py DIR, with
DIR/inputs.pt holding (state_dict, xs, targets); rank i saves DIR/rank<i>.pt.
"""

import copy

import torch
import torch.nn.functional as F
import torch_xla
from torch import nn

import xla_permute as xp

TP, CP = 2, 2  # 2 tensor-parallel ranks x 2 context-parallel ranks = 4 devices
H, HEADS, FFN, B, S = 16, 4, 32, 2, 16  # hidden, heads, MLP width, batch, sequence
D, STEPS, LR = H // HEADS, 3, 1e-2


def heads(t):  # [B, s, h*D] -> [B, h, s, D]
    return t.unflatten(-1, (-1, D)).transpose(1, 2)


def merge_heads(t):  # [B, h, s, D] -> [B, s, h*D]
    return t.transpose(1, 2).flatten(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(H), nn.RMSNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.gate = nn.Linear(H, FFN, bias=False)
        self.up = nn.Linear(H, FFN, bias=False)
        self.down = nn.Linear(FFN, H, bias=False)

    def forward(self, x):  # x [B, S, H]
        a = self.norm1(x)
        q, k, v = (heads(p(a)) for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(merge_heads(att))
        m = self.norm2(x)
        return x + self.down(F.silu(self.gate(m)) * self.up(m))


def loss_of(out, target):  # a rank's share: the total is the sum over ranks
    return F.mse_loss(out, target, reduction="sum") / (B * S * H)


mesh = xp.Mesh2D(tp=TP, cp=CP)


class ParallelBlock(nn.Module):
    def __init__(self, block, mesh, t):  # t: this rank's TP index
        super().__init__()
        self.tp, self.cp = mesh.tp_groups, mesh.cp_groups
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.qkv = nn.ParameterList(  # rows of this rank's heads, [H/TP, H] each
            nn.Parameter(p.weight.detach().chunk(mesh.tp)[t].clone())
            for p in (block.q, block.k, block.v))
        self.o = xp.RowParallelLinear.from_linear(block.o, groups=self.tp)
        self.mlp = xp.GatedMLP.from_mlp(block.gate, block.up, block.down, groups=self.tp)

    def forward(self, x):  # x [B, S/(TP*CP), H]: this rank's tokens
        a = self.norm1(x)
        q, k, v = xp.all_gather_matmul(a, [w.T for w in self.qkv], dim=1, groups=self.tp)
        att = xp.ring_attention(heads(q), heads(k), heads(v), causal=True,
                                layout="zigzag", groups=self.cp)
        x = x + self.o(merge_heads(att))
        return x + self.mlp(self.norm2(x))


def train(state, xs, targets):
    t, c = mesh.coords()  # this rank's place (checks that the run has TP*CP ranks)
    r, dev = mesh.rank(t, c), torch_xla.device()
    block = Block()
    block.load_state_dict(state)
    model = ParallelBlock(block, mesh, t).to(dev)
    norms = [*model.norm1.parameters(), *model.norm2.parameters()]
    shards = [p for name, p in model.named_parameters() if not name.startswith("norm")]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x, target = xs[r].to(dev), targets[r].to(dev)
    outs, losses = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        out = model(x)
        loss = loss_of(out, target)
        loss.backward()
        xp.all_reduce_gradients(norms)  # over all ranks
        xp.all_reduce_gradients(shards, groups=mesh.cp_groups)
        opt.step()
        torch_xla.sync()
        outs.append(out.detach())
        losses.append(loss.detach())
    return outs[0], torch.stack(losses), dict(model.named_parameters())


def _mp_fn(index, folder):
    state, xs, targets = torch.load(f"{folder}/inputs.pt")
    out, losses, params = train(state, xs, targets)
    params = {k: p.detach().cpu() for k, p in params.items()}
    torch.save((out.cpu(), losses.cpu(), params), f"{folder}/rank{index}.pt")


if __name__ == "__main__":
    import sys

    torch_xla.launch(_mp_fn, args=(sys.argv[1],))
