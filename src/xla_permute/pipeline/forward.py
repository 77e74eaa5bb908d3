"""Pipeline parallelism on stage shifts: GPipe's forward, and the pipelines of a mesh.

:func:`pipeline_forward` runs GPipe's forward as one SPMD tick loop, the backward left to
autograd (a shift's backward is the opposite shift); :func:`pipeline_groups` splits the ranks
into pipelines. The training step of any schedule is
:func:`~xla_permute.pipeline.run.pipeline_step`.

A pipeline of ``S`` stages runs one stage per rank. ``M`` micro-batches flow through it in
``M + S - 1`` forward *ticks*: at tick ``t`` stage ``s`` works on micro-batch ``t - s`` (when
``0 <= t - s < M``, else it idles), then every stage hands its activation to the next stage at
once with one :func:`~xla_permute.pipeline.shift.stage_shift`; the gradients flow back through
the same ticks in reverse.

SPMD: every rank traces the same program; idle stages compute on what they hold, masked out
by device data (never Python branches on the rank).

The forward ticks are the first ``M + S - 1`` ticks of GPipe's schedule, the data
:func:`~xla_permute.pipeline.orders.make_schedule` builds and the figures draw:

>>> from xla_permute.pipeline.orders import make_schedule
>>> s = make_schedule("gpipe", ranks=3, micro_batches=2)
>>> [" ".join(str(w) if w else "." for w in tick) for tick in s.work[:4]]
['0F0 . .', '0F1 1F0 .', '. 1F1 2F0', '. . 2F1']
>>> [s.shifts(t) for t in range(4)]
[(1,), (1,), (1,), ()]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from xla_permute.backends.select import BackendName, check_tensor
from xla_permute.debug import agree
from xla_permute.permute import permute_checked
from xla_permute.pipeline.orders import make_schedule
from xla_permute.pipeline.schedule import check_count
from xla_permute.pipeline.shift import checked_shifts, resolve_wrap

__all__ = ["pipeline_forward", "pipeline_groups"]


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


def pipeline_forward(
    stage: Callable[[torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    *,
    stages: int | None = None,
    wrap: bool | None = None,
    backend: BackendName = "auto",
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
        wrap: the form of the stage shifts (see :func:`~xla_permute.pipeline.shift.stage_shift`);
            ``None`` follows the hardware rules.
        backend: ``"auto"``, ``"native"`` or ``"emulated"``.

    Returns:
        ``(M, *shape)``: on the last stage, the pipeline's output for every micro-batch
        (``stage_{S-1}(... stage_0(inputs[m]))``); zeros on the other stages. Backward:
        autograd, each shift's the opposite shift.

    Raises:
        TypeError: ``stage`` is not callable, ``wrap`` no bool (or None), ``stages`` no int.
        ValueError: ``inputs`` is not on this rank's XLA device or is 0-d, ``stages`` does not
            divide the world size, ``backend`` is unknown, or the stage changes the shape.
    """
    if not callable(stage):
        raise TypeError(f"stage must be a callable x -> y, got {type(stage).__name__}")
    comm = check_tensor(inputs, "inputs", backend)  # XLA, or c10d in a process group
    if inputs.dim() < 1:
        raise ValueError(
            f"inputs has shape {tuple(inputs.shape)}: its leading axis counts the "
            f"micro-batches; stack them as (M, *activation_shape)"
        )
    wrap = resolve_wrap(wrap, comm.device_type)
    groups = pipeline_groups(comm.world_size(), stages)
    n_stages = len(groups[0])
    options = {"stages": n_stages, "wrap": wrap, "backend": comm.name}
    agree("pipeline_forward", {"inputs": inputs}, options, backend=comm)
    if inputs.shape[0] == 0:  # no micro-batch: nothing flows, no collective (ranks agree)
        return inputs * 0
    m = inputs.shape[0]
    schedule = make_schedule("gpipe", n_stages, m)
    position = comm.rank() % n_stages
    forward_ticks = m + n_stages - 1  # GPipe's first ticks: every forward, no backward
    offsets = {o for t in range(forward_ticks) for o in schedule.shifts(t)}  # {1}, or none
    shifts = checked_shifts(comm, offsets, wrap=wrap, groups=groups, dtype=inputs.dtype)

    # Device data, not traced constants: every rank traces the same program.
    is_first = torch.tensor(position == 0).to(inputs.device)
    is_last = torch.tensor(position == n_stages - 1).to(inputs.device)
    zeros = torch.zeros_like(inputs[0])
    received = zeros
    outputs: list[torch.Tensor | None] = [None] * m
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
            received = permute_checked(y, shifts[1], comm).wait()  # backward: the opposite shift
    return torch.stack(outputs)  # type: ignore[arg-type]
