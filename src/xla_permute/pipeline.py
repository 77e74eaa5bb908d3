"""GPipe pipeline parallelism on stage shifts: the schedule as data, the tick loop, the checks.

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

import contextlib
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xla_permute.permute import Backend, check_xla_tensor, device_error, resolve_backend
from xla_permute.shift import resolve_wrap, stage_shift

__all__ = ["Schedule", "gpipe_schedule", "pipeline_forward", "pipeline_groups"]

Tick = tuple[int | None, ...]


# --------------------------------------------------------------------------------------------
# The schedule, as data
# --------------------------------------------------------------------------------------------


def _check_count(value: object, name: str, fix: str) -> int:
    if not isinstance(value, (bool, int)):
        with contextlib.suppress(TypeError):  # numpy / torch integer scalars
            value = operator.index(value)  # type: ignore[arg-type]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}={value} is below 1; {fix}")
    return value


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
    _check_count(stages, "stages", "a pipeline needs at least one stage")
    _check_count(
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
    _check_count(world_size, "world_size", "the mesh has at least one rank")
    if stages is None:
        stages = world_size
    _check_count(stages, "stages", "a pipeline needs at least one stage")
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
    check_xla_tensor(inputs, "inputs")
    if inputs.dim() < 1:
        raise ValueError(
            f"inputs has shape {tuple(inputs.shape)}: its leading axis counts the "
            f"micro-batches; stack them as (M, *activation_shape)"
        )
    chosen = resolve_backend(backend)
    import torch_xla.runtime as xr

    ring = resolve_wrap(wrap, xr.device_type())
    groups = pipeline_groups(xr.world_size(), stages)
    n_stages = len(groups[0])
    from xla_permute import debug

    fields = {
        "inputs.shape": tuple(inputs.shape),
        "inputs.dtype": str(inputs.dtype),
        "stages": n_stages,
        "wrap": ring,
        "backend": chosen,
    }
    debug.check_agreement("pipeline_forward", fields, error=device_error(inputs, "inputs"))
    if inputs.shape[0] == 0:  # no micro-batch: nothing flows, no collective (ranks agree)
        return inputs * 0
    schedule = gpipe_schedule(n_stages, inputs.shape[0])
    position = xr.global_ordinal() % n_stages
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
