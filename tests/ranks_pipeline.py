"""Rank functions for test_shift.py and test_pipeline.py: many cases per launch, one program."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from pipeline_model import mlp_stage, mlp_stage_params


def _place() -> tuple[Any, int]:
    """``(device, rank)``: the XLA mesh's, or a torch.distributed process's (CPU, gloo)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return torch.device("cpu"), dist.get_rank()
    import torch_xla
    import torch_xla.runtime as xr

    return torch_xla.device(), xr.global_ordinal()


def _sync() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        import torch_xla

        torch_xla.sync()


def _error(call: Callable[[], Any]) -> str:
    """Call; return ``"TypeName: message"`` of the error it raises, or ``"no error"``."""
    try:
        call()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def shift_cases(cases: list[dict[str, Any]], bad: list[dict[str, Any]]) -> dict[str, Any]:
    """Bad ``stage_shift`` calls first (each must raise), then every case in one program.

    A case: ``xs`` (virtual mesh, leading axis = rank), ``gs`` (upstream gradient, same
    shape), ``offset``, ``wrap``, ``groups``. Returns the error messages of the bad calls and,
    per case, this rank's ``y`` and input gradient ``grad``.
    """
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute import stage_shift

    rank, device = xr.global_ordinal(), torch_xla.device()
    x0 = torch.ones(2, device=device)
    errors = [_error(lambda kw=kw: stage_shift(x0, **kw)) for kw in bad]
    errors.append(_error(lambda: stage_shift(torch.ones(2), offset=1)))  # a CPU tensor
    outs = []
    for case in cases:
        x = case["xs"][rank].to(device).requires_grad_()
        y = stage_shift(x, offset=case["offset"], wrap=case["wrap"], groups=case["groups"])
        (y * case["gs"][rank].to(device)).sum().backward()
        outs.append({"y": y, "grad": x.grad})
    torch_xla.sync()
    return {"errors": errors, "cases": outs}


def mlp_step(case: dict[str, Any]) -> dict[str, Any]:
    """One MLP pipeline step on this rank (traced; the caller syncs).

    A case: ``inputs``, ``targets`` (``(replicas, M, batch, dim)``; replica ``r`` runs on ranks
    ``r*S .. r*S+S-1``) and optionally ``stages``, ``wrap``, ``backend``. Returns this rank's
    ``loss``, ``outputs``, the ``grads`` of its stage's parameters, its ``replica`` and ``stage``.
    """
    import torch_xla
    import torch_xla.runtime as xr

    from xla_permute import pipeline_forward, pipeline_groups

    device = torch_xla.device()
    stages = case.get("stages")
    n_stages = len(pipeline_groups(xr.world_size(), stages)[0])
    replica, position = divmod(xr.global_ordinal(), n_stages)
    params = {k: v.to(device).requires_grad_() for k, v in mlp_stage_params(position).items()}
    outputs = pipeline_forward(
        functools.partial(mlp_stage, params),
        case["inputs"][replica].to(device),
        stages=stages,
        wrap=case.get("wrap"),
        backend=case.get("backend", "auto"),
    )
    loss = (outputs * case["targets"][replica].to(device)).sum()
    loss.backward()
    grads = {k: v.grad for k, v in params.items()}
    return {"loss": loss, "outputs": outputs, "grads": grads, "replica": replica, "stage": position}


def _send_recv_step(
    params: dict[str, torch.Tensor], inputs: torch.Tensor, targets: torch.Tensor
) -> list[str]:
    """GPipe with ``torch.distributed`` send/recv (all forwards, then all backwards), traced.

    Each call follows ``ProcessGroupXla.send`` / ``.recv`` (torch_xla 2.9): a one-pair
    ``xm.collective_permute``, then ``torch_xla.sync()``. In place of the sync, the program it
    would run is recorded (``xp.hlo.trace``, which also starts a fresh token chain) and the
    received tensor is replaced by device data, as a sync leaves it. Returns the programs' HLO,
    the step's final sync (the parameter gradients) last.
    """
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    import xla_permute as xp

    rank, n_stages = xr.global_ordinal(), xr.world_size()
    programs: list[str] = []

    def call(tensor: torch.Tensor, pair: list[int]) -> torch.Tensor:
        programs.append(xp.hlo.trace(xm.collective_permute(tensor, pairs=[pair])))
        return torch.zeros(tensor.shape).to(tensor.device)

    saved = []
    for m in range(inputs.shape[0]):
        if rank == 0:
            x = inputs[m]
        else:  # recv
            x = call(torch.zeros_like(inputs[m]), [rank - 1, rank]).requires_grad_()
        y = mlp_stage(params, x)
        if rank < n_stages - 1:
            call(y, [rank, rank + 1])  # send
        saved.append((x, y))
    for m in reversed(range(inputs.shape[0])):
        x, y = saved[m]
        last = rank == n_stages - 1  # d loss / d y: the targets, or received from the next stage
        y.backward(targets[m] if last else call(torch.zeros_like(y), [rank + 1, rank]))
        if rank > 0:
            call(x.grad, [rank, rank - 1])  # send the gradient back
    return [*programs, xp.hlo.trace([p.grad for p in params.values()])]


def traced_step_programs(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, list[str]]:
    """The HLO of one MLP pipeline step on this rank, three ways; traced, never executed.

    ``inputs, targets: (M, batch, dim)``, one pipeline over all ranks. ``"shift_open"`` /
    ``"shift_ring"``: ``pipeline_forward`` with native stage shifts, forward and backward, as
    the one program of one sync. ``"send_recv"``: see :func:`_send_recv_step`.
    """
    import torch_xla
    import torch_xla.runtime as xr

    import xla_permute as xp

    device, rank = torch_xla.device(), xr.global_ordinal()
    inputs, targets = inputs.to(device), targets.to(device)
    out = {}
    for name, wrap in (("shift_open", False), ("shift_ring", True), ("send_recv", None)):
        params = {k: v.to(device).requires_grad_() for k, v in mlp_stage_params(rank).items()}
        if name == "send_recv":
            out[name] = _send_recv_step(params, inputs, targets)
            continue
        stage = functools.partial(mlp_stage, params)
        with xp.hlo.tracing():  # the native backend is only traced on the CPU mesh
            y = xp.pipeline_forward(stage, inputs, wrap=wrap, backend="native")
        loss = (y * targets).sum()
        loss.backward()
        out[name] = [xp.hlo.trace([loss, *(p.grad for p in params.values())])]
    return out


def pipeline_cases(cases: list[dict[str, Any]], traced: tuple[torch.Tensor, ...]) -> dict:
    """Bad pipeline calls (each must raise), the MLP cases in one program, then the traced step.

    ``traced``: ``(inputs, targets)`` of the step traced by :func:`traced_step_programs` after
    the cases' program ran. Returns ``errors``, per case the result of :func:`mlp_step`, and
    ``traced``.
    """
    import torch_xla

    from xla_permute import pipeline_forward

    device = torch_xla.device()
    good = torch.zeros(3, 2, 4, device=device)
    bad = [
        lambda: pipeline_forward(torch.relu, torch.zeros((), device=device)),
        lambda: pipeline_forward(torch.relu, good, stages=3),
        lambda: pipeline_forward(torch.relu, good, stages=0),
        lambda: pipeline_forward(lambda x: x.sum(-1), good),
        lambda: pipeline_forward("relu", good),
        lambda: pipeline_forward(torch.relu, good, wrap=1),
        lambda: pipeline_forward(torch.relu, good.cpu()),
    ]
    errors = [_error(call) for call in bad]
    results = [mlp_step(case) for case in cases]
    torch_xla.sync()
    return {"errors": errors, "cases": results, "traced": traced_step_programs(*traced)}


def _stages(case: dict[str, Any], rank: int) -> tuple[int, int, tuple[int, ...]]:
    """``(replica, position, stages)``: this rank's pipeline, its place in it and the stages
    it holds (by the schedule's placement)."""
    from xla_permute import make_schedule

    p, v, m = case["ranks"], case["stages_per_rank"], case["inputs"].shape[1]
    replica, position = divmod(rank, p)
    return replica, position, make_schedule(case["schedule"], p, m, v).stages_of(position)


def schedule_step(case: dict[str, Any]) -> dict[str, Any]:
    """One ``xp.pipeline_step`` of the MLP on this rank (traced; the caller syncs).

    A case: ``inputs``, ``targets`` (``(replicas, M, batch, dim)``), ``schedule``, ``ranks``
    (per pipeline), ``stages_per_rank`` and optionally ``wrap``. This rank's stages are the
    schedule's ``stages_of(position)``, each the reference model's stage of that index.
    Returns this rank's ``loss``, the ``grads`` of every stage (by stage), its ``replica``,
    ``position`` and what ran (``executed``, ``live``, ``shifts``).
    """
    from xla_permute import pipeline_step

    device, rank = _place()
    replica, position, stages = _stages(case, rank)
    params = [
        {k: v.to(device).requires_grad_() for k, v in mlp_stage_params(s).items()} for s in stages
    ]
    step = pipeline_step(
        [functools.partial(mlp_stage, p) for p in params],
        case["inputs"][replica].to(device),
        case["targets"][replica].to(device),
        lambda y, t: (y * t).sum(),
        schedule=case["schedule"],
        ranks=case["ranks"],
        wrap=case.get("wrap"),
    )
    grads = {s: {k: v.grad for k, v in p.items()} for s, p in zip(stages, params, strict=True)}
    return {
        "loss": step.loss,
        "grads": grads,
        "replica": replica,
        "position": position,
        "executed": step.executed,
        "live": step.live,
        "shifts": step.shifts,
    }


def _bad_step_calls() -> list[str]:
    """``xp.pipeline_step`` calls that must raise on every rank before any collective."""
    from xla_permute import make_schedule, pipeline_step

    device = _place()[0]
    x, t = torch.zeros(4, 2, 3, device=device), torch.zeros(4, 2, 3, device=device)

    def loss(y, target):
        return (y * target).sum()

    def step(modules=torch.relu, inputs=x, targets=t, loss_fn=loss, **kw):
        return lambda: pipeline_step(modules, inputs, targets, loss_fn, **kw)

    bad = [
        step(modules=[torch.relu] * 2, schedule="interleaved", inputs=x[:3], targets=t[:3]),
        step(modules=[torch.relu, torch.relu]),  # two stages per rank need "interleaved"
        step(modules=[torch.relu, torch.relu], schedule="interleaved", wrap=False),
        step(schedule="zero-bubble"),
        step(schedule=make_schedule("1f1b", 4, 8)),  # built for 8 micro-batches, not 4
        step(modules=lambda y: y.sum(-1)),  # changes the activation's shape
        step(loss_fn=lambda y, target: y * target),  # not one number per micro-batch
        step(targets=t[:3]),
        *([step(inputs=x.cpu())] if device.type == "xla" else []),  # not on this rank's device
        step(modules="relu"),
        step(ranks=3),
        step(activation="(2, 3)"),
        step(activation=((2, 5), torch.float32)),  # not what the stages hand on
        step(activation="infer", modules=lambda y: y.long()),  # stage 0 hands on no float
    ]
    return [_error(call) for call in bad]


def llama_step(case: dict[str, Any]) -> dict[str, Any]:
    """One ``xp.pipeline_step`` of the Llama-style model of tests/pipeline_llama.py on this
    rank: token ids into stage 0, logits and the cross-entropy on the last stage, the
    activation between stages declared. Returns ``loss``, ``grads`` by stage, ``replica``."""
    from pipeline_llama import BATCH, DIM, SEQ, llama_loss, llama_stage, llama_stage_params

    from xla_permute import pipeline_step

    device, rank = _place()
    replica, position, stages = _stages(case, rank)
    total = case["ranks"] * case["stages_per_rank"]
    params = [
        {k: v.to(device).requires_grad_() for k, v in llama_stage_params(s, total).items()}
        for s in stages
    ]
    step = pipeline_step(
        [functools.partial(llama_stage, p) for p in params],
        case["inputs"][replica].to(device),
        case["targets"][replica].to(device),
        llama_loss,
        schedule=case["schedule"],
        ranks=case["ranks"],
        activation=case.get("activation", ((BATCH, SEQ, DIM), torch.float32)),
    )
    grads = {s: {k: v.grad for k, v in p.items()} for s, p in zip(stages, params, strict=True)}
    return {"loss": step.loss, "grads": grads, "replica": replica}


def step_cases(
    cases: list[dict[str, Any]],
    trainings: list[dict[str, Any]],
    llamas: list[dict[str, Any]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """The bad calls, every :func:`schedule_step` case (one program each), every
    :func:`train_steps` run, then every :func:`llama_step` case; one launch."""
    errors = _bad_step_calls()
    out = []
    for case in cases:
        out.append(schedule_step(case))
        _sync()  # one program per case: see the module docstring of test_pipeline_step
    trained = [train_steps(c) for c in trainings]
    llama = []
    for case in llamas:
        llama.append(llama_step(case))
        _sync()
    return {"errors": errors, "cases": out, "trainings": trained, "llamas": llama}


def train_steps(case: dict[str, Any]) -> dict[str, Any]:
    """``case["steps"]`` training steps of ``xp.pipeline_step`` on this rank, the same batch
    each step: ``optimizer.step()``, ``optimizer.zero_grad()``, ``torch_xla.sync()``.

    A case as for :func:`schedule_step` plus ``optimizer`` (see
    ``pipeline_model.make_optimizer``) and ``steps``. Returns this rank's per-step ``losses``,
    its stages' final ``params`` (by stage), ``replica`` and ``position``.
    """
    from pipeline_model import make_optimizer

    from xla_permute import pipeline_step

    device, rank = _place()
    replica, position, stages = _stages(case, rank)
    params = [
        {k: v.to(device).requires_grad_() for k, v in mlp_stage_params(s).items()} for s in stages
    ]
    opt = make_optimizer(case["optimizer"], [v for p in params for v in p.values()])
    inputs = case["inputs"][replica].to(device)
    targets = case["targets"][replica].to(device)
    losses = []
    for _ in range(case["steps"]):
        step = pipeline_step(
            [functools.partial(mlp_stage, p) for p in params],
            inputs,
            targets,
            lambda y, t: (y * t).sum(),
            schedule=case["schedule"],
            ranks=case["ranks"],
        )
        opt.step()
        opt.zero_grad()
        _sync()
        losses.append(step.loss.cpu())
    final = {
        s: {k: v.detach().cpu() for k, v in p.items()} for s, p in zip(stages, params, strict=True)
    }
    return {"losses": losses, "params": final, "replica": replica, "position": position}
