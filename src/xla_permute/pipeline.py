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

>>> s = gpipe_schedule(stages=3, micro_batches=2)
>>> s.forward
((0, None, None), (1, 0, None), (None, 1, 0), (None, None, 1))
>>> s.ticks, s.shifts, s.bubble_fraction
(4, 3, 0.5)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from xla_permute.permute import Backend
from xla_permute.pipeline_schedule import PipelineSchedule, Work, check_count, make_schedule
from xla_permute.shift import resolve_wrap, stage_shift

__all__ = [
    "PipelineStep",
    "Schedule",
    "gpipe_schedule",
    "pipeline_forward",
    "pipeline_groups",
    "pipeline_step",
]

Tick = tuple[int | None, ...]


# --------------------------------------------------------------------------------------------
# The schedule, as data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """A GPipe schedule: which micro-batch each stage works on at each tick.

    ``forward[t][s]`` is the micro-batch stage ``s`` runs forward at tick ``t`` (``None``:
    idle); ``backward[t][s]`` the same for the backward ticks, which mirror the forward ones
    (the last stage starts with the last micro-batch). :func:`pipeline_forward` iterates over
    ``forward``; the docs draw both.
    """

    stages: int
    micro_batches: int
    forward: tuple[Tick, ...]
    backward: tuple[Tick, ...]

    @property
    def ticks(self) -> int:
        """Forward ticks, ``M + S - 1``."""
        return len(self.forward)

    @property
    def shifts(self) -> int:
        """The number of stage shifts in the forward pass, ``M + S - 2`` (none for one stage).

        There is one after every tick but the last; the backward issues as many again (the
        opposite shifts).
        """
        return self.ticks - 1 if self.stages > 1 else 0

    @property
    def bubble_fraction(self) -> float:
        """The share of stage-ticks spent idle (the bubble), ``(S - 1) / (M + S - 1)``."""
        idle = sum(m is None for tick in self.forward for m in tick)
        return idle / (self.ticks * self.stages)


def gpipe_schedule(stages: int, micro_batches: int) -> Schedule:
    """The GPipe schedule for ``stages`` stages and ``micro_batches`` micro-batches.

    Forward tick ``t``: stage ``s`` runs micro-batch ``t - s`` if ``0 <= t - s < M``.
    Backward tick ``t``: stage ``s`` runs micro-batch ``(T - 1 - t) - s`` (``T`` ticks).

    >>> gpipe_schedule(2, 2).backward
    ((None, 1), (1, 0), (0, None))
    >>> gpipe_schedule(2, 0)
    Traceback (most recent call last):
    ...
    ValueError: micro_batches=0 is below 1; ...
    """
    check_count(stages, "stages", "a pipeline needs at least one stage")
    check_count(
        micro_batches, "micro_batches", "pass at least one micro-batch (inputs.shape[0] >= 1)"
    )
    ticks = micro_batches + stages - 1

    def tick(t: int) -> Tick:
        return tuple(t - s if 0 <= t - s < micro_batches else None for s in range(stages))

    forward = tuple(tick(t) for t in range(ticks))
    return Schedule(stages, micro_batches, forward, tuple(reversed(forward)))


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
    schedule = gpipe_schedule(n_stages, inputs.shape[0])
    position = comm.rank() % n_stages
    shift_groups = None if len(groups) == 1 else groups

    # Device data, not traced constants: every rank traces the same program.
    is_first = torch.tensor(position == 0).to(inputs.device)
    is_last = torch.tensor(position == n_stages - 1).to(inputs.device)
    zeros = torch.zeros_like(inputs[0])
    received = zeros
    outputs: list[torch.Tensor | None] = [None] * schedule.micro_batches
    for t, tick in enumerate(schedule.forward):
        fresh = inputs[tick[0]] if tick[0] is not None else zeros
        x = torch.where(is_first, fresh, received)
        y = stage(x)
        if t == 0 and (not isinstance(y, torch.Tensor) or y.shape != x.shape):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"stage returned {got} for an input of shape {tuple(x.shape)}; a pipeline "
                f"stage must return a tensor of its input's shape (pad or project inside the "
                f"stage)"
            )
        if tick[-1] is not None:  # the last stage finishes micro-batch tick[-1]
            outputs[tick[-1]] = torch.where(is_last, y, zeros)
        if t < schedule.ticks - 1 and n_stages > 1:
            received = stage_shift(y, offset=1, wrap=ring, groups=shift_groups, backend=chosen)
    return torch.stack(outputs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# A training step of any schedule
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineStep:
    """What one :func:`pipeline_step` did on this rank.

    ``loss``: the sum over micro-batches of ``loss_fn`` on the rank that holds the last
    virtual stage (detached), zero elsewhere. ``schedule``: the schedule that ran (``None``
    for no micro-batch). Counted while running, per tick: ``executed`` (this rank's work,
    ``None``: idle), ``live`` (activations this rank held for a backward after the tick) and
    ``shifts`` (the shifts issued, ``+1`` / ``-1``).
    """

    loss: torch.Tensor
    schedule: PipelineSchedule | None
    executed: tuple[Work | None, ...]
    live: tuple[int, ...]
    shifts: tuple[tuple[int, ...], ...]

    @property
    def peak_live(self) -> int:
        """The most activations this rank held at once (chunk-sized)."""
        return max(self.live, default=0)

    @property
    def idle_ticks(self) -> int:
        return sum(w is None for w in self.executed)


def _check_chunks(chunks: object) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    listed = [chunks] if callable(chunks) else chunks
    if not isinstance(listed, (list, tuple)) or not listed or not all(map(callable, listed)):
        raise TypeError(
            f"chunks must be this rank's model chunk (a callable x -> y) or a non-empty list "
            f"of them (interleaved: chunk c is virtual stage c * stages + rank), got "
            f"{type(chunks).__name__}"
        )
    return list(listed)


def _probe(chunks, loss_fn, x: torch.Tensor, target: torch.Tensor) -> None:
    """Run every chunk and the loss once without gradients, to check the shapes before any
    collective (traced and dropped on XLA; one extra forward per chunk when eager)."""
    with torch.no_grad():
        for c, chunk in enumerate(chunks):
            y = chunk(x)
            if not isinstance(y, torch.Tensor) or y.shape != x.shape or y.dtype != x.dtype:
                got = (
                    f"shape {tuple(y.shape)} and dtype {y.dtype}"
                    if isinstance(y, torch.Tensor)
                    else type(y).__name__
                )
                raise ValueError(
                    f"chunk {c} returned {got} for an input of shape {tuple(x.shape)} and "
                    f"dtype {x.dtype}; every chunk must return its input's shape and dtype (one "
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
    chunks: Callable[[torch.Tensor], torch.Tensor] | list[Callable[[torch.Tensor], torch.Tensor]],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    schedule: str | PipelineSchedule = "1f1b",
    stages: int | None = None,
    wrap: bool | None = None,
    backend: Backend = "auto",
) -> PipelineStep:
    """One training step (forward and backward) of a pipeline schedule, on this rank.

    Equal to the model on one device::

        loss = sum(loss_fn(model(inputs[i]), targets[i]) for i in range(M)); loss.backward()

    where ``model`` is the virtual stages ``0 .. S*v-1`` in a row, virtual stage
    ``c * S + r`` being chunk ``c`` of rank ``r`` (``S`` stages per pipeline). The gradients
    accumulate into the chunks' parameters (``.grad``), as ``loss.backward()`` would: zero
    them between steps as usual (``optimizer.zero_grad()``).

    Each rank runs its own work of the schedule (a forward or backward of one micro-batch on
    one chunk per tick, or nothing) and every rank issues the same shifts in the same order:
    after a tick, one :func:`~xla_permute.shift.stage_shift` ``+1`` when some rank hands on an
    activation, one ``-1`` when some rank hands back a gradient. A rank idle in that tick
    still takes part (it sends zeros). On XLA every rank traces its own program; the
    collectives in them match.

    Args:
        chunks: this rank's model chunk ``y = chunk(x)`` (``y.shape == x.shape``), or the list
            of its ``v`` chunks for ``schedule="interleaved"``.
        inputs: ``(M, *shape)`` micro-batches; read on the first stage only (the other ranks
            pass any tensor of that shape). XLA tensors, or CPU/CUDA tensors with
            ``torch.distributed`` initialized (``backend="c10d"``).
        targets: ``(M, ...)``, read on the last stage only: ``loss_fn(y, targets[i])``.
        loss_fn: ``(output, target) -> scalar tensor`` of one micro-batch.
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or a
            :class:`~xla_permute.pipeline_schedule.PipelineSchedule` of ``(S, M, v)``.
        stages: stages per pipeline (``None``: all ranks); consecutive blocks of ranks form
            pipelines side by side, each with its own micro-batches.
        wrap: the form of the shifts; interleaved schedules need the ring (the last rank hands
            on to the first) and refuse ``wrap=False``. ``None``: the ring where the schedule
            or the hardware needs it, else the open chain.
        backend: ``"auto"``, ``"native"``, ``"emulated"`` (XLA) or ``"c10d"``.

    Returns:
        :class:`PipelineStep`: ``loss`` and what ran. Keep the result (or its ``loss``) alive
        until ``torch_xla.sync()``: on XLA the loss also carries the values this rank received
        in shifts it had no use for, whose collectives the other ranks wait for.

    Raises:
        TypeError: ``chunks``, ``loss_fn``, ``inputs`` or ``targets`` of the wrong kind.
        ValueError: a bad schedule or combination (``chunks > 1`` without ``"interleaved"``,
            interleaved with ``M < S`` or ``wrap=False``), a chunk that changes the shape;
            before any collective is issued, on every rank alike.
    """
    chunk_fns = _check_chunks(chunks)
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
    groups = pipeline_groups(world, stages)
    p, v, m = len(groups[0]), len(chunk_fns), inputs.shape[0]
    position = rank % p
    plan = None
    if isinstance(schedule, PipelineSchedule):
        if (schedule.stages, schedule.micro_batches, schedule.chunks) != (p, m, v):
            raise ValueError(
                f"the schedule is for {schedule.stages} stages, {schedule.micro_batches} "
                f"micro-batches and {schedule.chunks} chunks, the step has {p}, {m} and {v}; "
                f"build it with make_schedule(name, {p}, {m}, {v})"
            )
        plan = schedule
    elif m > 0:
        plan = make_schedule(schedule, p, m, v)
    elif schedule not in ("gpipe", "1f1b", "interleaved"):
        make_schedule(schedule, p, 1, v)  # raises the same error
    needs_ring = v > 1
    if needs_ring and wrap is False:
        raise ValueError(
            "wrap=False asks for open-chain shifts, but the interleaved schedule hands "
            "activations from the last rank to the first (chunk c to chunk c + 1); pass "
            "wrap=None or wrap=True"
        )
    ring = True if needs_ring and wrap is None else resolve_wrap(wrap, device_type)
    if m > 0:
        _probe(chunk_fns, loss_fn, torch.zeros_like(inputs[0]), targets[0])
    from xla_permute import debug

    fields = {
        "inputs.shape": tuple(inputs.shape),
        "inputs.dtype": str(inputs.dtype),
        "targets.shape": tuple(targets.shape),
        "stages": p,
        "chunks": v,
        "schedule": plan.name if plan else str(schedule),
        "wrap": ring,
        "backend": chosen,
    }
    error = comm.device_error(inputs, "inputs")
    debug.check_agreement("pipeline_step", fields, error=error, backend=comm)
    if plan is None:  # no micro-batch: nothing flows, no collective (ranks agree)
        return PipelineStep(inputs.new_zeros(()), None, (), (), ())
    return _run(plan, chunk_fns, inputs, targets, loss_fn, position, groups, ring, comm)


def _run(plan, chunks, inputs, targets, loss_fn, position, groups, ring, comm) -> PipelineStep:
    """The tick loop of :func:`pipeline_step`, after every check."""
    from xla_permute.debug import debug_mode

    shift_groups = None if len(groups) == 1 else groups
    last = plan.virtual_stages - 1
    zeros = torch.zeros_like(inputs[0])
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    arrived: dict[tuple[int, int, int], torch.Tensor] = {}
    unused: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    executed, live, issued = [], [], []
    # The arguments were checked and agreed on once, above; the shifts need not repeat it.
    with debug_mode(False):
        for t, tick in enumerate(plan.work):
            w = tick[position]
            out = {+1: zeros, -1: zeros}
            if w is not None:
                k, key = plan.virtual_stage(position, w.chunk), (w.micro_batch, w.chunk)
                if w.kind == "F":
                    if k == 0:
                        x = inputs[w.micro_batch]
                    else:
                        x = arrived.pop((+1, *key)).detach().requires_grad_()
                    y = chunks[w.chunk](x)
                    if k == last:
                        y = loss_fn(y, targets[w.micro_batch]).reshape(())
                        losses.append(y.detach())
                    else:
                        out[+1] = y.detach()
                    saved[key] = (x, y)
                else:
                    x, y = saved.pop(key)
                    y.backward(None if k == last else arrived.pop((-1, *key)))
                    if k > 0 and x.grad is not None:
                        out[-1] = x.grad
            executed.append(w)
            live.append(len(saved))
            shifts = plan.shifts(t)
            issued.append(shifts)
            received = plan.receives(t, position)
            for offset in shifts:
                got = stage_shift(
                    out[offset], offset=offset, wrap=ring, groups=shift_groups, backend=comm.name
                )
                s = received.get(offset)
                if s is None:
                    unused.append(got)
                else:
                    arrived[(offset, s.micro_batch, s.chunk)] = got
    loss = torch.stack(losses).sum() if losses else inputs.new_zeros(())
    if unused:
        # Keep the collectives whose results this rank does not use in its program (a lazy
        # graph drops what nothing depends on, and the other ranks would wait for them).
        comm.keep([loss, *unused])
    return PipelineStep(loss, plan, tuple(executed), tuple(live), tuple(issued))
