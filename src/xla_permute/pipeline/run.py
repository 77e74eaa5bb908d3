"""A training step of any pipeline schedule on stage shifts, :func:`pipeline_step`, and the
stages cut from a model by name that it runs, :func:`split_model`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from inspect import signature

import torch

from xla_permute.backends.select import BackendName, check_tensor
from xla_permute.debug import agree
from xla_permute.permute import permute_checked
from xla_permute.pipeline.forward import pipeline_groups
from xla_permute.pipeline.orders import SCHEDULES, make_schedule, stages_per_rank
from xla_permute.pipeline.schedule import Cell, PipelineSchedule, units
from xla_permute.pipeline.shift import checked_shifts, resolve_wrap

__all__ = ["PipelineStep", "pipeline_step", "split_model"]


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


Module = Callable[[torch.Tensor], torch.Tensor]


def split_model(
    model: torch.nn.Module, split_points: Sequence[str] | Mapping
) -> torch.nn.ModuleList:
    """The model cut into stages at ``split_points`` (PyTorch's ``split_spec``: the names of the
    modules that begin a stage, or ``{name: SplitPoint.BEGINNING or END}``), for
    :func:`pipeline_step`. A stage runs its modules in a row: the model's children, a child
    holding a split point replaced by its children (a ``ModuleList`` of blocks; Hugging Face's
    ``model``, whose layers get ``position_embeddings`` from its ``rotary_emb``). So the
    embedding opens stage 0, the head closes the last; the forward must be that chain.
    """
    points = [split_points] if isinstance(split_points, str) else split_points
    at = list(points.items()) if isinstance(points, Mapping) else [(n, 0) for n in points]
    pieces, i = list(model.named_children()), 0
    while i < len(pieces):  # a child that holds a split point: its children instead
        name, module = pieces[i]
        if any(n.startswith(f"{name}.") for n, _ in at):
            pieces[i : i + 1] = [(f"{name}.{c}", m) for c, m in module.named_children()]
        else:
            i += 1
    rotary = [m for n, m in pieces if n.endswith("rotary_emb")]
    names = [n for n, _ in pieces if not n.endswith("rotary_emb")]
    starts = [names.index(n) + (getattr(pt, "name", pt) == "END") for n, pt in at if n in names]
    if len(starts) < len(at) or starts != sorted(set(starts)) or {0, len(names)} & set(starts):
        unknown = [n for n, _ in at if n not in names]
        near = [n for n, _ in model.named_modules() for u in unknown if n.endswith(f".{u}")]
        raise ValueError(
            f"split_points {[n for n, _ in at]} must name once each, in model order, the "
            f"modules that begin stages 1, 2, ...: {', '.join(names)}"
            + (f"; {unknown[0]!r} is none of them" if unknown else ", none empty")
            + (f" ({near[0]!r}?)" if near else "")
        )
    if rotary and getattr(getattr(model, "config", None), "_attn_implementation", "") == "eager":
        raise ValueError("model: load it with attn_implementation='sdpa' (causal without a mask)")
    pieces = [
        _Rotary(m, rotary[0])
        if rotary and "position_embeddings" in signature(m.forward).parameters
        else m
        for n, m in pieces
        if not n.endswith("rotary_emb")
    ]
    cut = zip([0, *starts], [*starts, len(pieces)], strict=True)
    return torch.nn.ModuleList(torch.nn.Sequential(*pieces[a:b]) for a, b in cut)


class _Rotary(torch.nn.Module):
    """A Hugging Face decoder layer given the ``position_embeddings`` of ``0 .. seq-1``."""

    def __init__(self, layer: torch.nn.Module, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.layer, self.rotary = layer, rotary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        where = torch.arange(x.shape[1], device=x.device)[None]
        return self.layer(x, position_embeddings=self.rotary(x, where))


def _check_modules(modules: object) -> list[Module]:
    if isinstance(modules, torch.nn.ModuleList):  # every stage of the model (split_model's)
        modules = list(modules)
    listed = [modules] if callable(modules) else modules
    if not isinstance(listed, (list, tuple)) or not listed or not all(map(callable, listed)):
        raise TypeError(
            f"modules must be this rank's stage (a callable x -> y), a non-empty list of its "
            f"stages in model order (schedule.stages_of(rank)) or split_model's ModuleList of "
            f"every stage, got {type(modules).__name__}"
        )
    return list(listed)


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS, _TEXT = 8, 200  # an activation's dims; the bytes of stage 0's error each rank shows


def _infer(
    schedule, modules, inputs, position, group, comm, ok: bool
) -> tuple[tuple[int, ...], torch.dtype]:
    """The activation stage 0 hands on, from the first micro-batch: the rank that holds stage
    0 runs it (no gradient) and every rank of the pipeline reads its shape and dtype (or the
    stage's error) from one all-gather of an int row (:meth:`gather_rows`), so all agree."""
    row = [0] * (_MAX_DIMS + 2 + _TEXT)  # ndim (-1: stage 0 failed), dims..., dtype, error
    if 0 in schedule.stages_of(position) and not ok:
        row[0] = -1
    elif 0 in schedule.stages_of(position):
        try:
            with torch.no_grad():
                y = modules[schedule.stages_of(position).index(0)](inputs[0])
            shape = tuple(y.shape)
            if y.dtype not in _DTYPES or len(shape) > _MAX_DIMS:
                raise ValueError(f"an activation of shape {shape} and dtype {y.dtype}")
            row[: _MAX_DIMS + 1] = [len(shape), *shape, *[0] * (_MAX_DIMS - len(shape))]
            row[_MAX_DIMS + 1] = _DTYPES.index(y.dtype)
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            text = f" ({type(e).__name__}: {e})".encode()[:_TEXT]
            row[0], row[-_TEXT : len(row) - _TEXT + len(text)] = -1, list(text)
    first = comm.gather_rows(row)[group[schedule.rank_of(0)]]
    if first[0] < 0:
        said = bytes(first[-_TEXT:]).rstrip(b"\0").decode(errors="replace")
        raise ValueError(
            f"activation='infer': stage 0 (on rank {group[schedule.rank_of(0)]}) could not run on "
            f"the first micro-batch or returned no floating tensor of at most {_MAX_DIMS} dims"
            f"{said or ' (see that rank)'}; declare activation=(shape, dtype)"
        )
    return tuple(first[1 : 1 + first[0]]), _DTYPES[first[_MAX_DIMS + 1]]


def _activation(activation: object, inputs: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """The declared activation between stages as ``(shape, dtype)``."""
    if activation is None:
        return tuple(inputs.shape[1:]), inputs.dtype
    if isinstance(activation, torch.Tensor):
        return tuple(activation.shape), activation.dtype
    ok = isinstance(activation, tuple) and len(activation) == 2
    if ok and isinstance(activation[1], torch.dtype):
        shape = activation[0]
        if isinstance(shape, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in shape):
            return tuple(shape), activation[1]
    raise TypeError(
        f"activation must be None (the micro-batch's shape and dtype), 'infer' (what stage 0 "
        f"returns for the first micro-batch), an example tensor or (shape, dtype) of the "
        f"tensor one stage hands the next, got {activation!r}"
    )


def _probe(schedule, modules, loss_fn, inputs, targets, position, activation) -> None:
    """Run this rank's stages and the loss once without gradients, to check the shapes before
    any collective (traced and dropped on XLA; one extra forward per stage when eager): stage
    0 takes a micro-batch, every other stage the declared activation; every stage but the last
    returns the activation, the last stage's output goes to ``loss_fn``."""
    shape, dtype = activation
    between = torch.zeros(shape, dtype=dtype, device=inputs.device)
    with torch.no_grad():
        for c, (k, module) in enumerate(zip(schedule.stages_of(position), modules, strict=True)):
            x = inputs[0] if k == 0 else between
            try:
                y = module(x)
            except (RuntimeError, TypeError, ValueError, IndexError) as e:
                raise ValueError(
                    f"stage module {c} (stage {k}) raised {type(e).__name__} ({e}) for its input "
                    f"of shape {tuple(x.shape)} and dtype {x.dtype}: stage 0 takes a micro-batch, "
                    f"the others what the stage before returns; declare activation=(shape, dtype)"
                ) from e
            if k == schedule.stages - 1:
                try:
                    loss = loss_fn(y, targets[0])
                except (RuntimeError, TypeError, ValueError, IndexError) as e:
                    raise ValueError(
                        f"loss_fn(output, target) raised {type(e).__name__} for the last stage's "
                        f"output of shape {tuple(getattr(y, 'shape', ()))}: {e}"
                    ) from e
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    got = tuple(loss.shape) if isinstance(loss, torch.Tensor) else loss
                    raise ValueError(
                        f"loss_fn(output, target) returned {got}; it must return one number (a "
                        f"scalar tensor) per micro-batch: reduce it with .sum() or .mean()"
                    )
            elif not isinstance(y, torch.Tensor) or tuple(y.shape) != shape or y.dtype != dtype:
                got = type(y).__name__
                if isinstance(y, torch.Tensor):
                    got = f"shape {tuple(y.shape)} and dtype {y.dtype}"
                raise ValueError(
                    f"stage module {c} (stage {k}) returned {got} for an input of shape "
                    f"{tuple(x.shape)} and dtype {x.dtype}; every stage but the last must return "
                    f"the activation, shape {shape} and dtype {dtype} (declare another with "
                    f"activation=(shape, dtype))"
                )


def pipeline_step(
    modules: Module | list[Module],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    schedule: str | PipelineSchedule = "1f1b",
    ranks: int | None = None,
    activation: torch.Tensor | tuple[tuple[int, ...], torch.dtype] | str | None = None,
    wrap: bool | None = None,
    backend: BackendName = "auto",
) -> PipelineStep:
    """One training step (forward and backward) of a pipeline schedule, on this rank.

    Equal to the model on one device::

        loss = sum(loss_fn(model(inputs[i]), targets[i]) for i in range(M)); loss.backward()

    where ``model`` is the stages ``0 .. S-1`` in a row, placed on the ranks as the schedule
    says (:meth:`~xla_permute.pipeline.schedule.PipelineSchedule.stages_of`). The gradients
    accumulate into the stages' parameters (``.grad``), as ``loss.backward()`` would: zero
    them between steps as usual (``optimizer.zero_grad()``).

    Stage 0 takes a micro-batch ``inputs[i]`` (token ids, say), every stage hands the next an
    ``activation`` of one declared shape and dtype, the last stage's output goes to
    ``loss_fn`` with ``targets[i]``. Each rank checks its stages against the declaration before
    any collective; all ranks must declare the same (the debug mode compares them).

    Args:
        modules: this rank's stage ``y = module(x)``, the list of its stages in model order
            (``schedule.stages_of(rank)``: for the interleaved schedule stage ``c`` of the
            list is stage ``c * ranks + rank`` of the model; for a V, stages ``rank`` and
            ``2 ranks - 1 - rank``), or every stage, :func:`split_model`'s ``ModuleList``.
        inputs: ``(M, *shape)`` micro-batches; read on the first stage only (the other ranks
            pass any tensor of that shape). XLA tensors, or CPU/CUDA tensors with
            ``torch.distributed`` initialized (``backend="c10d"``).
        targets: ``(M, ...)``, read on the last stage only: ``loss_fn(y, targets[i])``.
        loss_fn: ``(output, target) -> scalar tensor`` of one micro-batch.
        activation: what one stage hands the next, per micro-batch: ``(shape, dtype)`` or an
            example tensor; ``None``: the micro-batch's own shape and dtype
            (``inputs.shape[1:]``, ``inputs.dtype``); ``"infer"``: what stage 0 returns for
            the first micro-batch (one more forward of stage 0 without gradient, on its rank,
            and one small all-gather that tells every rank of the pipeline, before the step).
        schedule: a name of :data:`~xla_permute.pipeline.orders.SCHEDULES` or a
            :class:`~xla_permute.pipeline.schedule.PipelineSchedule` of ``(p, M, v)``.
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
        TypeError: ``modules``, ``loss_fn``, ``inputs``, ``targets`` or ``activation`` of the
            wrong kind.
        ValueError: a bad schedule or combination (several stages per rank with a schedule of
            one, interleaved with ``M < p``, ``wrap=False`` where the ring is needed), on every
            rank; a stage that does not return the declared activation, or a ``loss_fn`` that
            fails on the last stage's output, on its rank (in debug mode the others raise
            :class:`~xla_permute.debug.DisagreementError`). All before any collective.
    """
    stage_fns = _check_modules(modules)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    comm = check_tensor(inputs, "inputs", backend)  # XLA, or c10d in a process group
    world, rank = comm.world_size(), comm.rank()
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
    if isinstance(modules, torch.nn.ModuleList):  # every stage: this rank runs its own
        v = stages_per_rank(schedule, v, p)
    position = rank % p
    name = schedule.name if isinstance(schedule, PipelineSchedule) else str(schedule)
    if isinstance(schedule, PipelineSchedule):
        if (schedule.ranks, schedule.micro_batches, schedule.stages_per_rank) != (p, m, v):
            raise ValueError(
                f"the schedule is for {schedule.ranks} ranks, {schedule.micro_batches} "
                f"micro-batches and {schedule.stages_per_rank} stages per rank, the step has "
                f"{p}, {m} and {v}; build it with make_schedule(name, {p}, {m}, {v})"
            )
    elif m > 0:
        schedule = make_schedule(schedule, p, m, v)
    else:  # no micro-batch: nothing to run, but a bad name raises the same error
        if schedule not in SCHEDULES:
            make_schedule(schedule, p, 1, v)
        schedule = None
    if len(stage_fns) != v and schedule is not None:  # split_model's: the stages placed here
        stage_fns = [stage_fns[k] for k in schedule.stages_of(position)]
    needs_ring = schedule is not None and schedule.needs_ring
    if needs_ring and wrap is False:
        raise ValueError(
            f"wrap=False asks for open-chain shifts, but the {name} schedule hands "
            f"activations from the last rank to the first (stage c * ranks + ranks - 1 to "
            f"stage (c + 1) * ranks); pass wrap=None or wrap=True"
        )
    wrap = True if needs_ring and wrap is None else resolve_wrap(wrap, comm.device_type)
    infer = isinstance(activation, str) and activation == "infer"
    between = _activation(None if infer else activation, inputs)
    error = comm.device_error(inputs, "inputs")
    if infer and schedule is not None:  # one gather, on every rank alike (also one that failed)
        group = groups[rank // p]
        between = _infer(schedule, stage_fns, inputs, position, group, comm, error is None)
    if schedule is not None and error is None:
        try:  # this rank's own stages: an error here joins the ranks' agreement below
            _probe(schedule, stage_fns, loss_fn, inputs, targets, position, between)
        except ValueError as e:
            error = e
    options = {"activation": (between[0], str(between[1])), "ranks": p, "stages_per_rank": v}
    options |= {"schedule": name, "wrap": wrap, "backend": comm.name}
    tensors = {"inputs": inputs, "targets": targets}
    agree("pipeline_step", tensors, options, backend=comm, error=error)
    if schedule is None:  # no micro-batch: nothing flows, no collective (ranks agree)
        return PipelineStep(inputs.new_zeros(()), None, (), (), ())
    zeros = torch.zeros(between[0], dtype=between[1], device=inputs.device)
    offsets = {o for t in range(schedule.ticks) for o in schedule.shifts(t)}
    shifts = checked_shifts(comm, offsets, wrap=wrap, groups=groups, dtype=between[1])
    return _run(schedule, stage_fns, inputs, targets, loss_fn, position, shifts, comm, zeros)


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


def _run(
    schedule, modules, inputs, targets, loss_fn, position, shifts, comm, zeros
) -> PipelineStep:
    """The tick loop of :func:`pipeline_step`, after every check; ``shifts``: the checked
    global pairs of each shift by offset; ``zeros``: an activation of zeros, what a rank sends
    when it has nothing to send."""
    last = schedule.stages - 1
    local = {k: i for i, k in enumerate(schedule.stages_of(position))}
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    grads_out: dict[tuple[int, int], torch.Tensor | None] = {}  # dy kept from I for W
    arrived: dict[tuple[str, int, int], torch.Tensor] = {}
    unused: list[torch.Tensor] = []
    losses: list[torch.Tensor] = []
    executed, live, issued = [], [], []
    for t, tick in enumerate(schedule.work):
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
                params, dy = _leaves(y, x), grads_out.pop(key)
                if params:
                    torch.autograd.backward(y, dy, inputs=params)
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
            send = schedule.send_of(position, w)
            if send is not None:
                if payload is None:  # x.grad is None: the stage did not use its input
                    payload = zeros
                if send.offset == 0:  # the V's turn: stays on this rank
                    arrived[(send.kind, send.micro_batch, send.stage)] = payload
                else:
                    outgoing[send.offset].append(payload)
        executed.append(cell)
        live.append(len(saved))
        issued.append(schedule.shifts(t))
        received = schedule.receives(t, position)
        for offset in schedule.shifts(t):
            slots = schedule.slots(t, offset)
            sent = outgoing[offset] + [zeros] * (slots - len(outgoing[offset]))
            packed = sent[0] if slots == 1 else torch.stack(sent)
            # Posted on the pairs checked once, before the loop (the arguments were agreed on).
            got = permute_checked(packed, shifts[offset], comm).wait()
            mine = received.get(offset, ())
            for i, s in enumerate(mine):
                arrived[(s.kind, s.micro_batch, s.stage)] = got if slots == 1 else got[i]
            if len(mine) < slots:
                unused.append(got)
    loss = torch.stack(losses).sum() if losses else zeros.new_zeros(())
    if unused:
        # Keep the collectives whose results this rank does not use in its program (a lazy
        # graph drops what nothing depends on, and the other ranks would wait for them).
        comm.keep([loss, *unused])
    return PipelineStep(loss, schedule, tuple(executed), tuple(live), tuple(issued))
