"""``python -m xla_permute bench --barrier``: what the mesh's compile barrier costs.

On the CPU mesh the sync of a rank that called a collective compiles its step, waits for the
other ranks, then runs it (:mod:`xla_permute.cpu_mesh.barrier`), so that ranks compiling at
different speeds do not abort the mesh (caveat ``compile-skew-rendezvous``). This bench
measures the price, side by side in two launches of each program on the CPU mesh (emulated
permutes):

* **on**: :func:`~xla_permute.run_on_mesh`'s default;
* **off**: ``XLA_PERMUTE_COMPILE_BARRIER=0`` in the launch's environment.

The programs: the training step of ``bench --aliasing``
(:func:`~xla_permute_tools.bench.aliasing.aliasing_rank`: a sequence-parallel MLP on
collective matmul, AdamW, float32), and a Hugging Face ``LlamaForCausalLM`` (random weights
from a ``LlamaConfig``, float32) made tensor-parallel by one
:func:`~xla_permute.parallelize_module` call, its loss by
:func:`~xla_permute.vocab_parallel_cross_entropy` of the vocabulary-sharded logits, AdamW.
Figures per program and launch: the wall time of the first step (it compiles) and the median
of the later steps (after ``warmup``), each the slowest rank's; the losses of the two launches
(equal, or their largest difference); and whether the launch aborted (a :class:`MeshError`
is reported, not raised).
"""

from __future__ import annotations

import statistics
from typing import Any

from xla_permute_tools.bench.aliasing import DEFAULT as LOOP_DEFAULT
from xla_permute_tools.bench.aliasing import aliasing_rank

__all__ = ["format_barrier_report", "llama_rank", "loop_rank", "run_barrier_bench"]

#: Sizes of the Llama: layers, hidden, attention heads, KV heads, vocabulary, tokens, steps.
#: Two warm-up steps, as the loop's: both compile (the second step's program reads AdamW's
#: state, which the first creates); the median is of the steps after them.
LLAMA_DEFAULT = {
    "layers": 2, "hidden": 128, "heads": 8, "kv_heads": 4, "vocab": 256, "seq": 64, "batch": 2,
    "warmup": 2, "steps": 3,
}  # fmt: skip

#: The two launches: the environment each adds to the bench's.
LAUNCHES = {"on": {}, "off": {"XLA_PERMUTE_COMPILE_BARRIER": "0"}}


def loop_rank(cfg: dict[str, int], state: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Rank function: the aliasing bench's step, every step timed; (times, losses)."""
    losses: list[float] = []
    every = {**cfg, "warmup": 0, "steps": cfg["warmup"] + cfg["steps"]}
    return aliasing_rank(every, state, False, losses), losses


def tensor_parallel_plan(full: Any) -> dict[str, Any]:
    """Heads, MLP and vocabulary split over the ranks; activations whole on every rank."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    import xla_permute as xp

    def rope(q, k, positions):
        cos, sin = full.model.rotary_emb(q, positions[None])
        return apply_rotary_pos_emb(q, k, cos, sin)

    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "model.layers.*.self_attn": xp.HeadwiseParallel(Replicate(), position_fn=rope),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(),  # logits [B, S, V/N]: this rank's vocabulary block
    }


def llama_rank(full: Any, tokens: Any, cfg: dict[str, int]) -> tuple[list[float], list[float]]:
    """Rank function: one ``parallelize_module`` call, ``warmup + steps`` AdamW steps;
    (times, losses)."""
    import time

    import torch
    import torch_xla

    import xla_permute as xp

    device = torch_xla.device()
    full = full.to(device)
    xp.parallelize_module(full, None, tensor_parallel_plan(full))
    tokens = tokens.to(device)
    target = tokens.roll(-1, dims=1)  # the next token (the last predicts the first)
    opt = torch.optim.AdamW(full.parameters(), lr=1e-2)
    times, losses = [], []
    for _ in range(cfg["warmup"] + cfg["steps"]):
        start = time.perf_counter()
        opt.zero_grad()
        loss = xp.vocab_parallel_cross_entropy(full(tokens).logits, target)
        loss.backward()
        opt.step()
        torch_xla.sync()
        value = loss.detach().cpu()  # waits for this rank's step
        times.append(time.perf_counter() - start)
        losses.append(float(value))
    return times, losses


def _llama(cfg: dict[str, int]) -> tuple[Any, Any]:
    """The model (seeded random weights, float32) and its tokens, on the host."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=2 * cfg["hidden"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=max(256, cfg["seq"]),
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["seq"]))
    return LlamaForCausalLM(config).float(), tokens


def _launch(fn: Any, args: tuple, cfg: dict[str, int], n: int, env: dict[str, str]) -> dict:
    """One launch: first step and median of the later ones (slowest rank), the losses per
    rank; ``aborted`` names the MeshError if the launch failed."""
    from xla_permute import MeshError, run_on_mesh

    env = {"XLA_PERMUTE_DEBUG": "none", **env}  # a timed run of a correct program: no checks
    try:
        per_rank = run_on_mesh(fn, *args, n=n, env=env)
    except MeshError as e:
        first_line = (str(e).splitlines() or [""])[0]
        return {"first_s": None, "later_s": None, "steps_s": None, "losses": None,
                "aborted": f"{type(e).__name__}: {first_line}"}  # fmt: skip
    steps = [max(step) for step in zip(*(times for times, _ in per_rank), strict=True)]
    return {
        "first_s": steps[0],
        "later_s": statistics.median(steps[max(1, cfg["warmup"]) :]),
        "steps_s": steps,
        "losses": [losses for _, losses in per_rank],
        "aborted": None,
    }


def run_barrier_bench(
    n: int = 4, loop: dict[str, int] | None = None, llama: dict[str, int] | None = None
) -> dict[str, Any]:
    """Both programs, each in both launches; ``{"config", "programs"}``, where
    ``programs[name]`` holds ``on`` and ``off`` (:func:`_launch`'s figures), ``ratio`` (on /
    off of the first step and of the later steps), ``losses_equal`` and ``max_loss_diff``
    (None if a launch aborted)."""
    import torch
    from torch import nn

    loop = {**LOOP_DEFAULT, **(loop or {})}
    llama = {**LLAMA_DEFAULT, **(llama or {})}
    if min(loop["warmup"], llama["warmup"]) < 1 or min(loop["steps"], llama["steps"]) < 1:
        raise ValueError("warmup and steps: at least 1 each (the first step compiles)")
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    fc1, fc2 = nn.Linear(loop["hidden"], loop["ffn"]), nn.Linear(loop["ffn"], loop["hidden"])
    x = torch.randn(loop["batch"], n * loop["seq"], loop["hidden"], generator=g)
    state = {"fc1": fc1.state_dict(), "fc2": fc2.state_dict(), "x": x}
    programs = {
        "loop": (loop_rank, (loop, state), loop),
        "llama": (llama_rank, (*_llama(llama), llama), llama),
    }
    result: dict[str, Any] = {"config": {"n": n, "loop": loop, "llama": llama}, "programs": {}}
    for name, (fn, args, cfg) in programs.items():
        runs = {label: _launch(fn, args, cfg, n, env) for label, env in LAUNCHES.items()}
        on, off = runs["on"], runs["off"]
        both = on["aborted"] is None and off["aborted"] is None
        diff = None
        if both:
            pairs = zip(sum(on["losses"], []), sum(off["losses"], []), strict=True)
            diff = max(abs(a - b) for a, b in pairs)
        result["programs"][name] = {
            **runs,
            "ratio": {key: on[key] / off[key] if both else None for key in ("first_s", "later_s")},
            "losses_equal": None if diff is None else diff == 0.0,
            "max_loss_diff": diff,
        }
    return result


def format_barrier_report(result: dict[str, Any]) -> str:
    """Per program: the two launches and on / off, then whether the losses agree.

    >>> r = {"config": {"n": 4, "loop": {"warmup": 2, "steps": 5},
    ...                 "llama": {"layers": 2, "hidden": 128, "warmup": 2, "steps": 3}},
    ...      "programs": {"loop": {
    ...          "on": {"first_s": 2.0, "later_s": 0.011, "aborted": None},
    ...          "off": {"first_s": 1.6, "later_s": 0.010, "aborted": None},
    ...          "ratio": {"first_s": 1.25, "later_s": 1.1},
    ...          "losses_equal": True, "max_loss_diff": 0.0}, "llama": {
    ...          "on": {"first_s": 9.0, "later_s": 0.5, "aborted": None},
    ...          "off": {"first_s": None, "later_s": None, "aborted": "MeshError: died"},
    ...          "ratio": {"first_s": None, "later_s": None},
    ...          "losses_equal": None, "max_loss_diff": None}}}
    >>> print(format_barrier_report(r))
    compile barrier on the 4-device CPU mesh (emulated permutes), slowest rank
      program                    barrier    first step   later steps
      loop (MLP + AdamW)         on          2000.0 ms       11.0 ms
                                 off         1600.0 ms       10.0 ms
                                 on / off        1.250         1.100
        losses on vs off: equal (7 steps)
      Llama 2 layers, hidden 128 on          9000.0 ms      500.0 ms
                                 off           aborted       aborted
                                 on / off            -             -
        off: MeshError: died
        losses on vs off: not compared (a launch aborted)
      later steps: the median after the warm-up steps (loop 2, llama 2; the first two compile)
    """
    config = result["config"]
    labels = {
        "loop": "loop (MLP + AdamW)",
        "llama": f"Llama {config['llama']['layers']} layers, hidden {config['llama']['hidden']}",
    }
    rows = [
        f"compile barrier on the {config['n']}-device CPU mesh (emulated permutes), slowest rank",
        f"  {'program':<26} {'barrier':<8} {'first step':>12} {'later steps':>13}",
    ]

    def ms(value: float | None) -> str:
        return "aborted" if value is None else f"{value * 1e3:.1f} ms"

    for name, r in result["programs"].items():
        for i, label in enumerate(("on", "off")):
            run = r[label]
            head = labels[name] if i == 0 else ""
            rows.append(
                f"  {head:<26} {label:<8} {ms(run['first_s']):>12} {ms(run['later_s']):>13}"
            )
        ratio = {k: "-" if v is None else f"{v:.3f}" for k, v in r["ratio"].items()}
        rows.append(f"  {'':<26} {'on / off':<8} {ratio['first_s']:>12} {ratio['later_s']:>13}")
        for label in ("on", "off"):
            if r[label]["aborted"]:
                rows.append(f"    {label}: {r[label]['aborted']}")
        steps = config[name]["warmup"] + config[name]["steps"]
        if r["max_loss_diff"] is None:
            rows.append("    losses on vs off: not compared (a launch aborted)")
        elif r["losses_equal"]:
            rows.append(f"    losses on vs off: equal ({steps} steps)")
        else:
            rows.append(f"    losses on vs off: largest difference {r['max_loss_diff']:.3g}")
    warmup = {name: config[name]["warmup"] for name in result["programs"]}
    rows.append(
        "  later steps: the median after the warm-up steps ("
        + ", ".join(f"{name} {w}" for name, w in warmup.items())
        + "; the first two compile)"
    )
    return "\n".join(rows)
