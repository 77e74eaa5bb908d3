"""A small Llama-style model cut into pipeline stages, and its single-device reference (CPU).

Stage ``k`` of ``S`` is one decoder block (RMSNorm, causal multi-head attention, RMSNorm,
SwiGLU MLP, both with residuals); stage 0 also holds the token embedding (it takes token ids
``(batch, seq)``), the last stage the final RMSNorm and the LM head (it returns logits
``(batch, seq, vocab)``), and the loss is the summed cross-entropy of the next tokens. Between
stages flows one activation, ``(batch, seq, dim)`` float32: declared to ``xp.pipeline_step``
as ``activation=``. Not integer-valued (softmax, RMSNorm), so compared with one device to
float32 rounding rather than bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 16, 8, 2, 12, 6, 2


def llama_stage_params(stage: int, stages: int) -> dict[str, torch.Tensor]:
    """Stage ``stage``'s parameters, seeded by the stage (the same on every rank)."""
    g = torch.Generator().manual_seed(100 + stage)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / math.sqrt(shape[0])

    params = {
        "norm1": torch.ones(DIM), "wq": w(DIM, DIM), "wk": w(DIM, DIM), "wv": w(DIM, DIM),
        "wo": w(DIM, DIM), "norm2": torch.ones(DIM), "w_gate": w(DIM, HIDDEN),
        "w_up": w(DIM, HIDDEN), "w_down": w(HIDDEN, DIM),
    }  # fmt: skip
    if stage == 0:
        params["embed"] = torch.randn(VOCAB, DIM, generator=g)
    if stage == stages - 1:
        params |= {"norm_out": torch.ones(DIM), "head": w(DIM, VOCAB)}
    return params


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def llama_stage(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One stage: token ids ``(batch, seq)`` (stage 0) or activations ``(batch, seq, dim)`` in;
    activations out, or logits ``(batch, seq, vocab)`` on the last stage."""
    if "embed" in params:
        x = params["embed"][x]
    b, s, _ = x.shape
    h = _rms(x, params["norm1"])
    q, k, v = (
        (h @ params[n]).reshape(b, s, HEADS, DIM // HEADS).transpose(1, 2)
        for n in ("wq", "wk", "wv")
    )
    causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(DIM // HEADS)
    att = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    x = x + att.transpose(1, 2).reshape(b, s, DIM) @ params["wo"]
    h = _rms(x, params["norm2"])
    x = x + (F.silu(h @ params["w_gate"]) * (h @ params["w_up"])) @ params["w_down"]
    if "head" in params:
        return _rms(x, params["norm_out"]) @ params["head"]
    return x


def llama_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one micro-batch: ``logits (batch, seq, vocab)``, ``targets
    (batch, seq)`` token ids."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")


def llama_batch(micro_batches: int, replicas: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(replicas, M, batch, seq)`` and their next tokens (the targets)."""
    k = torch.arange(replicas * micro_batches * BATCH * (SEQ + 1))
    tokens = ((k * 2654435761) // 256 % VOCAB).reshape(replicas, micro_batches, BATCH, SEQ + 1)
    return tokens[..., :-1].contiguous(), tokens[..., 1:].contiguous()


def llama_reference(inputs: torch.Tensor, targets: torch.Tensor, stages: int) -> dict[str, Any]:
    """The whole model on one device: ``loss`` summed over micro-batches, ``grads[stage]``."""
    params = [
        {k: v.requires_grad_() for k, v in llama_stage_params(s, stages).items()}
        for s in range(stages)
    ]
    loss = torch.zeros(())
    for x, t in zip(inputs, targets, strict=True):
        for p in params:
            x = llama_stage(p, x)
        loss = loss + llama_loss(x, t)
    loss.backward()
    return {"loss": loss.detach(), "grads": [{k: v.grad for k, v in p.items()} for p in params]}


def llama_problems(case: dict[str, Any], got: Sequence[dict[str, Any]]) -> list[str]:
    """Compare per-rank results of ``ranks_pipeline.llama_step`` with :func:`llama_reference`
    (float32 rounding: rtol 1e-4). Empty: equal."""
    p, v = case["ranks"], case["stages_per_rank"]
    problems = []
    for replica in range(len(got) // p):
        ref = llama_reference(case["inputs"][replica], case["targets"][replica], p * v)
        ranks = [r for r in got if r["replica"] == replica]
        loss = sum(r["loss"] for r in ranks)
        if not torch.allclose(loss, ref["loss"], rtol=1e-5):
            problems.append(f"replica {replica}: loss {float(loss)} != {float(ref['loss'])}")
        held = sorted(s for r in ranks for s in r["grads"])
        if held != list(range(p * v)):
            problems.append(f"replica {replica}: stages {held}")
        for r in ranks:
            for stage, grads in r["grads"].items():
                for k, g in grads.items():
                    want = ref["grads"][stage][k]
                    if not torch.allclose(g, want, rtol=1e-4, atol=1e-5):
                        diff = (g - want).abs().max().item()
                        problems.append(f"replica {replica}, stage {stage}: {k} off by {diff}")
    return problems
