"""The MLP pipeline of test_pipeline.py, its single-device reference and the comparisons (CPU).

A stage is ``relu(x @ w1 + b1) @ w2 + b2`` with parameters in {-1, 0, 1}; inputs and targets
are small integers and the loss is linear, so every value of the forward and the backward is an
integer far below 2**24 and the pipeline must equal one device **exactly**. Also here: reading
torch_xla's send/recv code path (with ``ast``) and counting a step's programs from their HLO.
tutorials/06_pipeline_parallelism.md defines the same model on its page.
"""

from __future__ import annotations

import ast
import importlib.util
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xla_permute import hlo


def mlp_stage_params(stage: int, dim: int = 4, hidden: int = 6) -> dict[str, torch.Tensor]:
    """Parameters of stage ``stage``, entries in {-1, 0, 1}: ``w1 (dim, hidden)``, ``b1``,
    ``w2 (hidden, dim)``, ``b2``."""
    i, j = torch.arange(dim)[:, None], torch.arange(hidden)[None, :]
    return {
        "w1": ((i + 2 * j + 3 * stage) % 3 - 1).float(),
        "b1": ((torch.arange(hidden) + stage) % 3 - 1).float(),
        "w2": ((2 * j.T + i.T + stage) % 3 - 1).float(),
        "b2": ((torch.arange(dim) + 2 * stage) % 3 - 1).float(),
    }


def mlp_stage(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """One stage: ``relu(x @ w1 + b1) @ w2 + b2``; ``x: (batch, dim)`` -> ``(batch, dim)``."""
    return torch.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def example_batch(
    micro_batches: int = 4, batch: int = 2, dim: int = 4, replicas: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer-valued ``inputs`` in {-3..3} and ``targets`` in {-1, 0, 1},
    each ``(replicas, M, batch, dim)``, from a multiplicative hash of the element index."""
    k = torch.arange(replicas * micro_batches * batch * dim).reshape(
        replicas, micro_batches, batch, dim
    )
    inputs = ((k * 2654435761) // 128 % 7 - 3).float()
    targets = ((k * 40503) // 64 % 3 - 1).float()
    return inputs, targets


def reference_step(
    inputs: torch.Tensor, targets: torch.Tensor, *, stages: int, hidden: int = 6
) -> dict[str, Any]:
    """The single-device model: ``stages`` MLP stages in a row; ``inputs (M, batch, dim)``.

    Loss ``sum(out * targets)``. Returns ``loss``, ``outputs (M, batch, dim)`` and ``grads``,
    one dict of parameter gradients per stage.
    """
    params = [
        {k: v.requires_grad_() for k, v in mlp_stage_params(s, inputs.shape[-1], hidden).items()}
        for s in range(stages)
    ]
    outputs = []
    for x in inputs:
        for p in params:
            x = mlp_stage(p, x)
        outputs.append(x)
    out = torch.stack(outputs)
    loss = (out * targets).sum()
    loss.backward()
    return {
        "loss": loss.detach(),
        "outputs": out.detach(),
        "grads": [{k: v.grad for k, v in p.items()} for p in params],
    }


def compare_with_single_device(
    results: Sequence[dict[str, Any]],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    hidden: int = 6,
) -> list[str]:
    """Compare per-rank results of one case of ``ranks_pipeline.mlp_step`` with
    :func:`reference_step`, exactly: per replica the summed loss, the last stage's outputs
    (zeros elsewhere) and every stage's gradients. Returns the differences (empty: equal)."""
    stages = max(r["stage"] for r in results) + 1
    problems = []
    for replica in range(inputs.shape[0]):
        ranks = [r for r in results if r["replica"] == replica]
        ref = reference_step(inputs[replica], targets[replica], stages=stages, hidden=hidden)
        loss = sum(r["loss"] for r in ranks)
        if not torch.equal(loss, ref["loss"]):
            problems.append(f"replica {replica}: loss {loss.item()} != {ref['loss'].item()}")
        for r in ranks:
            where = f"replica {replica}, stage {r['stage']}"
            last = r["stage"] == stages - 1
            expected = ref["outputs"] if last else torch.zeros_like(ref["outputs"])
            if not torch.equal(r["outputs"], expected):
                problems.append(f"{where}: outputs differ")
            for name, grad in ref["grads"][r["stage"]].items():
                if not torch.equal(r["grads"][name], grad):
                    diff = (r["grads"][name] - grad).abs().max().item()
                    problems.append(f"{where}: grad of {name} differs (max |diff| {diff})")
    return problems


# -------------------------------------------------------------- send/recv versus stage shifts


@dataclass(frozen=True)
class StepCost:
    """One rank's programs for one step, read from their HLO: ``programs`` (one per sync),
    ``collectives``, their ``kinds`` and ``pairs``, and the ``bytes_sent`` by this rank."""

    programs: int
    collectives: int
    kinds: tuple[str, ...]
    pairs: tuple[tuple[tuple[int, int], ...] | None, ...]
    bytes_sent: int


def step_cost(hlo_texts: Sequence[str], rank: int, group_size: int) -> StepCost:
    """Parse the HLO of a rank's programs for one step and count what they do."""
    collectives = [c for text in hlo_texts for c in hlo.parse(text).collectives()]
    return StepCost(
        programs=len(hlo_texts),
        collectives=len(collectives),
        kinds=tuple(c.kind for c in collectives),
        pairs=tuple(c.pairs for c in collectives),
        bytes_sent=sum(hlo.bytes_sent_per_rank(c, group_size, rank) for c in collectives),
    )


def sendrecv_code_path() -> dict[str, tuple[Counter, str]]:
    """``ProcessGroupXla.send`` / ``.recv`` as installed: the calls in the loop over the
    tensors (per tensor) and the method's source.

    Read from ``torch_xla/distributed/xla_backend.py`` with ``ast``, without importing it.
    """
    spec = importlib.util.find_spec("torch_xla")
    assert spec is not None and spec.origin is not None
    text = (Path(spec.origin).parent / "distributed" / "xla_backend.py").read_text("utf-8")
    tree = ast.parse(text)
    cls = next(
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ProcessGroupXla"
    )
    out = {}
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in ("send", "recv"):
            loop = next(n for n in ast.walk(fn) if isinstance(n, ast.For))
            calls = Counter(ast.unparse(c.func) for c in ast.walk(loop) if isinstance(c, ast.Call))
            out[fn.name] = (calls, ast.get_source_segment(text, fn) or "")
    return out


# ------------------------------------------------------------------- several training steps


def make_optimizer(name: str, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """``"sgd"`` (lr 2**-12, momentum 0.5) or ``"adamw"`` (lr 1e-2, weight decay 0.1)."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=2**-12, momentum=0.5)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference_training(
    inputs: torch.Tensor, targets: torch.Tensor, *, stages: int, optimizer: str, steps: int
) -> dict[str, Any]:
    """``steps`` optimizer steps of the ``stages``-stage model on one device, the same batch
    every step; grads zeroed the usual way. Returns the per-step ``losses`` and the final
    ``params`` (one dict per stage)."""
    params = [
        {k: v.requires_grad_() for k, v in mlp_stage_params(s).items()} for s in range(stages)
    ]
    opt = make_optimizer(optimizer, [v for p in params for v in p.values()])
    losses = []
    for _ in range(steps):
        loss = torch.zeros(())
        for x, t in zip(inputs, targets, strict=True):
            for p in params:
                x = mlp_stage(p, x)
            loss = loss + (x * t).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"losses": losses, "params": [{k: v.detach() for k, v in p.items()} for p in params]}


def step_problems(case: dict[str, Any], got: Sequence[dict[str, Any]]) -> list[str]:
    """Compare the per-rank results of one ``ranks_pipeline.schedule_step`` case with
    :func:`reference_step` of every pipeline (replica), exactly. Empty: equal."""
    from xla_permute import make_schedule

    p, v, n = case["ranks"], case["stages_per_rank"], len(got)
    plan = make_schedule(case["schedule"], p, case["inputs"].shape[1], v)
    problems = []
    for replica in range(n // p):
        ref = reference_step(case["inputs"][replica], case["targets"][replica], stages=p * v)
        ranks = [r for r in got if r["replica"] == replica]
        if [r["position"] for r in ranks] != list(range(p)):
            problems.append(f"replica {replica}: positions {[r['position'] for r in ranks]}")
        loss = sum(r["loss"] for r in ranks)
        if not torch.equal(loss, ref["loss"]):
            problems.append(f"replica {replica}: loss {float(loss)} != {float(ref['loss'])}")
        if any(r["loss"].any() for r in ranks if r["position"] != plan.rank_of(p * v - 1)):
            problems.append(f"replica {replica}: a loss away from the last stage")
        for r in ranks:
            if tuple(sorted(r["grads"])) != plan.stages_of(r["position"]):
                problems.append(f"replica {replica}: stages {sorted(r['grads'])}")
            for stage, grads in r["grads"].items():
                for k, g in grads.items():
                    if not torch.equal(g, ref["grads"][stage][k]):
                        problems.append(f"replica {replica}, stage {stage}: grad of {k}")
    return problems


def training_problems(case: dict[str, Any], got: Sequence[dict[str, Any]]) -> list[str]:
    """Compare ``ranks_pipeline.train_steps`` results with :func:`reference_training`: the
    first step's loss exactly, later losses and the final parameters to float32 rounding."""
    p, v, steps, problems = case["ranks"], case["stages_per_rank"], case["steps"], []
    for replica in range(len(got) // p):
        ref = reference_training(
            case["inputs"][replica],
            case["targets"][replica],
            stages=p * v,
            optimizer=case["optimizer"],
            steps=steps,
        )
        ranks = [r for r in got if r["replica"] == replica]
        losses = [sum(r["losses"][s] for r in ranks) for s in range(steps)]
        if not torch.equal(losses[0], ref["losses"][0]):
            problems.append(f"replica {replica}: first loss {float(losses[0])}")
        if not torch.allclose(torch.stack(losses), torch.stack(ref["losses"]), rtol=1e-5):
            problems.append(f"replica {replica}: losses {losses} != {ref['losses']}")
        if len({round(float(x), 3) for x in losses}) != steps:
            problems.append(f"replica {replica}: the model did not move: {losses}")
        for r in ranks:
            for stage, params in r["params"].items():
                for k, value in params.items():
                    want = ref["params"][stage][k]
                    if not torch.allclose(value, want, rtol=1e-5, atol=1e-6):
                        problems.append(f"replica {replica}, stage {stage}: param {k}")
    return problems
