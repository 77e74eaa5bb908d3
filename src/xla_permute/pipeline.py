"""Pipeline parallelism on stage shifts: GPipe's forward, and a training step for any schedule.

:func:`pipeline_forward` runs GPipe's forward as one SPMD tick loop, the backward left to
autograd (a shift's backward is the opposite shift). :func:`pipeline_step` runs a training
step of a schedule of :mod:`xla_permute.pipeline_schedule` (GPipe, 1F1B, interleaved 1F1B):
forwards and backwards as the schedule orders them, gradients accumulated over micro-batches.

A pipeline of ``S`` stages runs one stage per rank. ``M`` micro-batches flow through it in
``M + S - 1`` forward *ticks*: at tick ``t`` stage ``s`` works on micro-batch ``t - s`` (when
``0 <= t - s < M``, else it idles), then every stage hands its activation to the next stage at
once with one :func:`~xla_permute.shift.stage_shift`. The backward is autograd through the
same ticks in reverse: the backward of each shift is the opposite shift, so the gradients flow back
stage by stage without any code of ours.

SPMD: every rank runs the same tick loop and issues the same shifts in the same order (the
lazy-tensor rule: a collective that one rank leaves out of its program blocks the others).
Idle stages compute on whatever they hold and the results are masked out, with masks that are
device data (never Python branches on the rank), so every rank traces the same program.

The forward ticks are the first ``M + S - 1`` ticks of GPipe's schedule, the data
:func:`~xla_permute.pipeline_orders.make_schedule` builds and the figures draw:

>>> from xla_permute.pipeline_orders import make_schedule
>>> s = make_schedule("gpipe", ranks=3, micro_batches=2)
>>> [" ".join(str(w) if w else "." for w in tick) for tick in s.work[:4]]
['0F0 . .', '0F1 1F0 .', '. 1F1 2F0', '. . 2F1']
>>> [s.shifts(t) for t in range(4)]
[(1,), (1,), (1,), ()]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from xla_permute.permute import Backend
from xla_permute.pipeline_orders import SCHEDULES, make_schedule
from xla_permute.pipeline_schedule import Cell, PipelineSchedule, check_count, units
from xla_permute.shift import resolve_wrap, stage_shift

__all__ = [
    "PipelineStep",
    "pipeline_forward",
    "pipeline_groups",
    "pipeline_step",
]


def pipeline_groups(world_size: int, stages: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Split ``world_size`` ranks into pipelines of ``stages`` consecutive ranks.

    ``stages=None``: one pipeline over all ranks. With fewer stages than ranks the pipelines
    are data-parallel replicas: ranks ``[0..S-1]``, ``[S..2S-1]``, ...

    >>> pipeline_groups(4), pipeline_groups(4, 2)
    (((0, 1, 2, 3),), ((0, 1), (2, 3)))
    >>> pipeline_groups(4, 3)
    Traceback (most recent call last):
    ...
    ValueError: stages=3 does not divide the 4 ranks; ...
    """
    check_count(world_size, "world_size", "the mesh has at least one rank")
    if stages is None:
        stages = world_size
    check_count(stages, "stages", "a pipeline needs at least one stage")
    if world_size % stages:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"stages={stages} does not divide the {world_size} ranks; every pipeline needs "
            f"one rank per stage, so use one of {divisors} (or stages=None for {world_size})"
        )
    return tuple(tuple(range(g, g + stages)) for g in range(0, world_size, stages))


# --------------------------------------------------------------------------------------------
# The tick loop
# --------------------------------------------------------------------------------------------


def pipeline_forward(
    stage: Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    *,
    stages: int | None = None,
    wrap: bool | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Run the GPipe forward of this rank's ``stage`` over all micro-batches; differentiable.

    Call it on every rank (SPMD), each with its own stage, then compute a loss from the result
    and call ``backward()`` on **every** rank: the loss is zero away from the last stage, but
    the backward shifts are collectives that all ranks must issue.

    Args:
        stage: this rank's stage, ``y = stage(x)`` with ``y.shape == x.shape`` (one
            activation shape flows through the pipeline).
        inputs: ``(M, *shape)``, the ``M`` micro-batches, on this rank's XLA device. Only the
            first stage reads the values; the other ranks pass any tensor of the same shape.
            ``M = 0`` (or an empty activation) gives the empty result without a collective.
        stages: stages per pipeline; must divide the world size (``None``: all ranks). With
            fewer stages than ranks, consecutive blocks of ranks form independent pipelines.
        wrap: the form of the stage shifts (see :func:`~xla_permute.shift.stage_shift`);
            ``None`` follows the hardware rules.
        backend: ``"auto"``, ``"native"`` or ``"emulated"``.

    Returns:
        ``(M, *shape)``: on the last stage, the pipeline's output for every micro-batch
        (``stage_{S-1}(... stage_0(inputs[m]))``); zeros on the other stages. Backward:
        through :func:`~xla_permute.shift.stage_shift`, whose backward is the opposite shift.

    Raises:
        TypeError: ``stage`` is not callable, ``wrap`` no bool (or None), ``stages`` no int.
        ValueError: ``inputs`` is not on this rank's XLA device or is 0-d, ``stages``
            does not divide the world size, ``backend`` is unknown, or the stage changes the
            shape. Both are raised before any collective is issued, with the fix in the
            message.
    """
    if not callable(stage):
        raise TypeError(f"stage must be a callable x -> y, got {type(stage).__name__}")
    from xla_permute.backend import check_tensor

    comm = check_tensor(inputs, "inputs", backend)  # XLA, or c10d in a process group
    if inputs.dim() < 1:
        raise ValueError(
            f"inputs has shape {tuple(inputs.shape)}: its leading axis counts the "
            f"micro-batches; stack them as (M, *activation_shape)"
        )
    chosen = comm.name
    ring = resolve_wrap(wrap, comm.device_type)
    groups = pipeline_groups(comm.world_size(), stages)
    n_stages = len(groups[0])
    from xla_permute import debug

    fields = {
        "inputs.shape": tuple(inputs.shape),
        "inputs.dtype": str(inputs.dtype),
        "stages": n_stages,
        "wrap": ring,
        "backend": chosen,
    }
    error = comm.device_error(inputs, "inputs")
    debug.check_agreement("pipeline_forward", fields, error=error, backend=comm)
    if inputs.shape[0] == 0:  # no micro-batch: nothing flows, no collective (ranks agree)
        return inputs * 0
    m = inputs.shape[0]
    schedule = make_schedule("gpipe", n_stages, m)
    position = comm.rank() % n_stages
    shift_groups = None if len(groups) == 1 else groups

    # Device data, not traced constants: every rank traces the same program.
    is_first = torch.tensor(position == 0).to(inputs.device)
    is_last = torch.tensor(position == n_stages - 1).to(inputs.device)
    zeros = torch.zeros_like(inputs[0])
    received = zeros
    outputs: list[torch.Tensor | None] = [None] * m
    forward_ticks = m + n_stages - 1  # GPipe's first ticks: every forward, no backward
    for t, tick in enumerate(schedule.work[:forward_ticks]):
        first, last = tick[0], tick[-1]
        fresh = inputs[first.micro_batch] if first is not None else zeros
        x = torch.where(is_first, fresh, received)
        y = stage(x)
        if t == 0 and (not isinstance(y, torch.Tensor) or y.shape != x.shape):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"stage returned {got} for an input of shape {tuple(x.shape)}; a pipeline "
                f"stage must return a tensor of its input's shape (pad or project inside the "
                f"stage)"
            )
        if last is not None:  # the last stage finishes micro-batch last.micro_batch
            outputs[last.micro_batch] = torch.where(is_last, y, zeros)
        if schedule.shifts(t):
            received = stage_shift(y, offset=1, wrap=ring, groups=shift_groups, backend=chosen)
    return torch.stack(outputs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# A training step of any schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStep:
    """What one :func:`pipeline_step` did on this rank.

    ``loss``: the sum over micro-batches of ``loss_fn`` on the rank that holds the last stage
    (detached), zero elsewhere. ``schedule``: the schedule that ran (``None`` for no
    micro-batch). Counted while running, per tick: ``executed`` (the cell this rank ran,
    ``None``: idle), ``live`` (stage activations this rank held for a backward after the tick)
    and ``shifts`` (the shifts issued, ``+1`` / ``-1``).
    """

    loss: torch.Tensor
    schedule: PipelineSchedule | None
    executed: tuple[Cell, ...]
    live: tuple[int, ...]
    shifts: tuple[tuple[int, ...], ...]

    @property
    def peak_live(self) -> int:
        """The most stage activations this rank held at once."""
        return max(self.live, default=0)

    @property
    def idle_ticks(self) -> int:
        return sum(w is None for w in self.executed)


Module = Callable[[torch.Tensor], torch.Tensor]


def _check_modules(modules: object) -> list[Module]:
    listed = [modules] if callable(modules) else modules
    if not isinstance(listed, (list, tuple)) or not listed or not all(map(callable, listed)):
        raise TypeError(
            f"modules must be this rank's stage (a callable x -> y) or a non-empty list of its "
            f"stages in model order (schedule.stages_of(rank)), got {type(modules).__name__}"
        )
    return list(listed)


def _probe(modules, loss_fn, x: torch.Tensor, target: torch.Tensor) -> None:
    """Run every stage module and the loss once without gradients, to check the shapes before
    any collective (traced and dropped on XLA; one extra forward per stage when eager)."""
    with torch.no_grad():
        for c, module in enumerate(modules):
            y = module(x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
                got = (
                    f"shape {tuple(y.shape)} and dtype {y.dtype}"
                    if isinstance(y, torch.Tensor)
                    else type(y).__name__
                )
                raise ValueError(
                    f"stage module {c} returned {got} for an input of shape {tuple(x.shape)} and "
                    f"dtype {x.dtype}; every stage must return its input's shape and dtype (one "
                    f"activation shape flows through the pipeline; pad or project inside it)"
                )
            loss = loss_fn(y, target)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
                raise ValueError(
                    f"loss_fn(output, target) returned {got}; it must return one number (a "
                    f"scalar tensor) per micro-batch: reduce it with .sum() or .mean()"
                )


def pipeline_step(
    modules: Module | list[Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    schedule: str | PipelineSchedule = "1f1b",
    ranks: int | None = None,
    wrap: bool | None = None,
    backend: Backend = "auto",
) -> PipelineStep:
    """One training step (forward and backward) of a pipeline schedule, on this rank.

    Equal to the model on one device::

        loss = sum(loss_fn(model(inputs[i]), targets[i]) for i in range(M)); loss.backward()

    where ``model`` is the stages ``0 .. S-1`` in a row, placed on the ranks as the schedule
    says (:meth:`~xla_permute.pipeline_schedule.PipelineSchedule.stages_of`). The gradients
    accumulate into the stages' parameters (``.grad``), as ``loss.backward()`` would: zero
    them between steps as usual (``optimizer.zero_grad()``).

    Each rank runs its own column of the schedule (per tick a forward ``F``, a backward ``B``,
    an input gradient ``I``, a weight gradient ``W``, or nothing) and every rank issues the
    same shifts in the same order: after a tick, one :func:`~xla_permute.shift.stage_shift`
    ``+1`` when some rank hands on to the next rank, one ``-1`` when some rank hands back. A
    rank idle in that tick still takes part (it sends zeros). ``I`` is
    ``torch.autograd.grad(y, x, dy, retain_graph=True)`` (the stage input's gradient, the
    graph kept); ``W`` later backpropagates the same ``dy`` into the stage's parameters (the
    leaves of the graph other than ``x``), without running the forward again.

    Args:
        modules: this rank's stage ``y = module(x)`` (``y.shape == x.shape``), or the list of
            its stages in model order (``schedule.stages_of(rank)``: for the interleaved
            schedule stage ``c`` of the list is stage ``c * ranks + rank`` of the model).
        inputs: ``(M, *shape)`` micro-batches; read on the first stage only (the other ranks
            pass any tensor of that shape). XLA tensors, or CPU/CUDA tensors with
            ``torch.distributed`` initialized (``backend="c10d"``).
        targets: ``(M, ...)``, read on the last stage only: ``loss_fn(y, targets[i])``.
        loss_fn: ``(output, target) -> scalar tensor`` of one micro-batch.
        schedule: a name of :data:`~xla_permute.pipeline_orders.SCHEDULES` or a
            :class:`~xla_permute.pipeline_schedule.PipelineSchedule` of ``(p, M, v)``.
        ranks: ranks per pipeline (``None``: all ranks); consecutive blocks of ranks form
            pipelines side by side, each with its own micro-batches.
        wrap: the form of the shifts; schedules that hand on from the last rank to the first
            (interleaved) need the ring and refuse ``wrap=False``. ``None``: the ring where the
            schedule or the hardware needs it, else the open chain.
        backend: ``"auto"``, ``"native"``, ``"emulated"`` (XLA) or ``"c10d"``.

    Returns:
        :class:`PipelineStep`: ``loss`` and what ran. Keep the result (or its ``loss``) alive
        until ``torch_xla.sync()``: on XLA the loss also carries the values this rank received
        in shifts it had no use for, whose collectives the other ranks wait for.

    Raises:
        TypeError: ``modules``, ``loss_fn``, ``inputs`` or ``targets`` of the wrong kind.
        ValueError: a bad schedule or combination (several stages per rank with a schedule of
            one, interleaved with ``M < p``, ``wrap=False`` where the ring is needed), a stage
            that changes the shape; before any collective is issued, on every rank alike.
    """
    stage_fns = _check_modules(modules)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    from xla_permute.backend import check_tensor

    comm = check_tensor(inputs, "inputs", backend)  # XLA, or c10d in a process group
    world, rank, device_type, chosen = comm.world_size(), comm.rank(), comm.device_type, comm.name
    if inputs.dim() < 1:
        raise ValueError(
            f"inputs has shape {tuple(inputs.shape)}: its leading axis counts the "
            f"micro-batches; stack them as (M, *activation_shape)"
        )
    if not isinstance(targets, torch.Tensor) or targets.dim() < 1:
        raise TypeError(f"targets must be a tensor (M, ...), got {type(targets).__name__}")
    if targets.shape[0] != inputs.shape[0]:
        raise ValueError(
            f"targets has {targets.shape[0]} micro-batches and inputs {inputs.shape[0]}; pass "
            f"one target per micro-batch (targets[i] for inputs[i])"
        )
    groups = pipeline_groups(world, ranks)
    p, v, m = len(groups[0]), len(stage_fns), inputs.shape[0]
    position = rank % p
    plan = None
    if isinstance(schedule, PipelineSchedule):
        if (schedule.ranks, schedule.micro_batches, schedule.stages_per_rank) != (p, m, v):
            raise ValueError(
                f"the schedule is for {schedule.ranks} ranks, {schedule.micro_batches} "
                f"micro-batches and {schedule.stages_per_rank} stages per rank, the step has "
                f"{p}, {m} and {v}; build it with make_schedule(name, {p}, {m}, {v})"
            )
        plan = schedule
    elif m > 0:
        plan = make_schedule(schedule, p, m, v)
    elif schedule not in SCHEDULES:
        make_schedule(schedule, p, 1, v)  # raises the same error
    needs_ring = plan.needs_ring if plan is not None else False
    if needs_ring and wrap is False:
        raise ValueError(
            f"wrap=False asks for open-chain shifts, but the {plan.name} schedule hands "
            f"activations from the last rank to the first (stage c * ranks + ranks - 1 to "
            f"stage (c + 1) * ranks); pass wrap=None or wrap=True"
        )
    ring = True if needs_ring and wrap is None else resolve_wrap(wrap, device_type)
    if m > 0:
        _probe(stage_fns, loss_fn, torch.zeros_like(inputs[0]), targets[0])
    from xla_permute import debug

    fields = {
        "inputs.shape": tuple(inputs.shape),
        "inputs.dtype": str(inputs.dtype),
        "targets.shape": tuple(targets.shape),
        "ranks": p,
        "stages_per_rank": v,
        "schedule": plan.name if plan else str(schedule),
        "wrap": ring,
        "backend": chosen,
    }
    error = comm.device_error(inputs, "inputs")
    debug.check_agreement("pipeline_step", fields, error=error, backend=comm)
    if plan is None:  # no micro-batch: nothing flows, no collective (ranks agree)
        return PipelineStep(inputs.new_zeros(()), None, (), (), ())
    return _run(plan, stage_fns, inputs, targets, loss_fn, position, groups, ring, comm)


def _leaves(y: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    """The leaves of ``y``'s graph that want a gradient, ``x`` excluded: the stage's
    parameters, for its ``W``."""
    found, seen, stack = [], set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if variable is not None and variable is not x:
            found.append(variable)
        stack.extend(n for n, _ in node.next_functions)
    return found


def _run(plan, modules, inputs, targets, loss_fn, position, groups, ring, comm) -> PipelineStep:
    """The tick loop of :func:`pipeline_step`, after every check."""
    from xla_permute.debug import debug_mode

    shift_groups = None if len(groups) == 1 else groups
    last = plan.stages - 1
    local = {k: i for i, k in enumerate(plan.stages_of(position))}
    zeros = torch.zeros_like(inputs[0])
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    grads_out: dict[tuple[int, int], torch.Tensor | None] = {}  # dy kept from I for W
    arrived: dict[tuple[str, int, int], torch.Tensor] = {}
    unused: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    executed, live, issued = [], [], []
    # The arguments were checked and agreed on once, above; the shifts need not repeat it.
    with debug_mode(False):
        for t, tick in enumerate(plan.work):
            cell = tick[position]
            outgoing: dict[int, list[torch.Tensor]] = {+1: [], -1: [], 0: []}
            for w in units(cell):
                key = (w.micro_batch, w.stage)
                payload = None
                if w.kind == "F":
                    if w.stage == 0:
                        x = inputs[w.micro_batch]
                    else:
                        x = arrived.pop(("F", *key)).detach().requires_grad_()
                    y = modules[local[w.stage]](x)
                    if w.stage == last:
                        y = loss_fn(y, targets[w.micro_batch]).reshape(())
                        losses.append(y.detach())
                    else:
                        payload = y.detach()
                    saved[key] = (x, y)
                elif w.kind == "W":
                    x, y = saved.pop(key)
                    params = _leaves(y, x)
                    if params:
                        torch.autograd.backward(y, grads_out.pop(key), inputs=params)
                else:
                    x, y = saved[key] if w.kind == "I" else saved.pop(key)
                    dy = None if w.stage == last else arrived.pop(("B", *key))
                    if w.kind == "B":
                        y.backward(dy)
                        if w.stage > 0:
                            payload = x.grad
                    else:
                        grads_out[key] = dy
                        if w.stage > 0:
                            (payload,) = torch.autograd.grad(y, x, dy, retain_graph=True)
                send = plan.send_of(position, w)
                if send is not None:
                    if payload is None:  # x.grad is None: the stage did not use its input
                        payload = zeros
                    if send.offset == 0:  # the V's turn: stays on this rank
                        arrived[(send.kind, send.micro_batch, send.stage)] = payload
                    else:
                        outgoing[send.offset].append(payload)
            executed.append(cell)
            live.append(len(saved))
            shifts = plan.shifts(t)
            issued.append(shifts)
            received = plan.receives(t, position)
            for offset in shifts:
                slots = plan.slots(t, offset)
                sent = outgoing[offset] + [zeros] * (slots - len(outgoing[offset]))
                packed = sent[0] if slots == 1 else torch.stack(sent)
                got = stage_shift(
                    packed, offset=offset, wrap=ring, groups=shift_groups, backend=comm.name
                )
                mine = received.get(offset, ())
                for i, s in enumerate(mine):
                    arrived[(s.kind, s.micro_batch, s.stage)] = got if slots == 1 else got[i]
                if len(mine) < slots:
                    unused.append(got)
    loss = torch.stack(losses).sum() if losses else inputs.new_zeros(())
    if unused:
        # Keep the collectives whose results this rank does not use in its program (a lazy
        # graph drops what nothing depends on, and the other ranks would wait for them).
        comm.keep([loss, *unused])
    return PipelineStep(loss, plan, tuple(executed), tuple(live), tuple(issued))
