"""Agreement checks: before a collective, check that every rank passes the same arguments.

XLA does not check that the ranks of a collective agree: a rank that passes a longer tensor,
another dtype or other pairs makes the others read garbage or wait forever. A check all-gathers
a small signature of the call's arguments (the op, every tensor's shape and dtype, the pairs,
groups, backend and options) and compares them on the host. If two ranks differ, every rank
raises :class:`DisagreementError`, naming the ranks and what differs::

    collective_permute: the ranks disagree on x.shape: rank 1 passes (3,), ranks 0, 2, 3 pass (2,)

How often, set by ``XLA_PERMUTE_DEBUG`` (or ``with xla_permute.debug_mode():`` on a rank):

* **sampled** (the default, ``XLA_PERMUTE_DEBUG`` unset or ``0``): each op is checked at its
  1st, 2nd, 4th, 8th, ... call on a rank, so a mistake present from the start (a rank passing
  bfloat16, uneven shards) raises at the first call, and a training loop pays almost nothing
  after its first step (the bench measures it). The ranks call each op equally often, so they
  all decide alike whether a call is checked. On every backend: TPU, Neuron and ``c10d`` too.
* **debug mode** (``XLA_PERMUTE_DEBUG=1``): every call is checked. On by default in the device
  process of :func:`xla_permute.run_on_mesh` (the CPU mesh, where programs are written), which
  sets ``XLA_PERMUTE_DEBUG=1`` unless the caller's environment or its ``env`` sets the variable.
  This is PyTorch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` for this package.
* **none** (``XLA_PERMUTE_DEBUG=none``): no check at all, to measure what the checks cost.

A check costs one small all-gather, executed at once, in a program of its own on a fresh
collective token, so it is never part of the traced program; inside
:func:`xla_permute.hlo.tracing` (traced, never run) it is skipped. Only the forward of an op is
checked: its backward follows from it.

The signature has a fixed length for a given world size (the all-gather itself must agree):
``FIELDS`` fields of ``2 + payload`` int32 values each. Strings are CRC-32 codes (``zlib``,
deterministic across processes), integer tuples travel raw, so the message can show them.

>>> rows = [signature("op", {"x.shape": s}, world_size=2) for s in [(2, 3), (3, 3)]]
>>> len(rows[0]) == signature_length(2)
True
>>> describe_disagreement("op", rows)
'op: the ranks disagree on x.shape: rank 0 passes (2, 3), rank 1 passes (3, 3)'
"""

from __future__ import annotations

import os
import threading
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from xla_permute.backends.compiled import check_not_compiling
from xla_permute.mesh import status as mesh_status

__all__ = [
    "ENV",
    "DisagreementError",
    "agree",
    "check_agreement",
    "debug_mode",
    "describe_disagreement",
    "enabled",
    "LEVELS",
    "level",
    "signature",
    "signature_length",
]

#: The environment variable that turns the debug mode on for every rank ("1") or off ("0").
ENV = "XLA_PERMUTE_DEBUG"
_ON = {"1", "true", "on", "yes", "detail"}
_OFF = {"", "0", "false", "off", "no"}
#: Fields per signature (the channel id of the check's all-gather on XLA, a program of its
#: own, is :data:`xla_permute.backends.channels.AGREEMENT_CHANNEL`).
FIELDS = 12
_MAGIC = 0x5850  # "XP"
_INT32_MAX = 2**31 - 1
_NONE, _INT, _BOOL, _INTS, _PAIRS, _GROUPS, _TEXT = range(7)

_local = threading.local()  # per rank: the ranks of the CPU mesh are threads of one process
_names: dict[int, str] = {}  # CRC-32 -> text, for the message (the mesh is one process)


class DisagreementError(ValueError):
    """The ranks passed different arguments to one collective (raised on every rank)."""


#: The check levels, most checks first (:func:`level`).
LEVELS = ("all", "sampled", "none")


def level() -> str:
    """This rank's check level: ``"all"`` (debug mode), ``"sampled"`` or ``"none"``."""
    override = getattr(_local, "level", None)
    if override is not None:
        return override
    value = os.environ.get(ENV, "").strip().lower()
    if value in _OFF:
        return "sampled"
    if value in _ON:
        return "all"
    if value == "none":
        return "none"
    raise ValueError(
        f"{ENV}={os.environ[ENV]!r}: set it to 1 (check every call), 0 (the default: check "
        f"each op's 1st, 2nd, 4th, ... call) or none (no checks)"
    )


def enabled() -> bool:
    """True when the debug mode (every call checked) is on for this rank."""
    return level() == "all"


def _checked(op: str) -> bool:
    """Whether this call of ``op`` is checked at this rank's level (counts calls per rank)."""
    mode = level()
    if mode != "sampled":
        return mode == "all"
    counts = getattr(_local, "counts", None)
    if counts is None:
        counts = _local.counts = {}
    count = counts[op] = counts.get(op, 0) + 1
    return count & (count - 1) == 0  # 1, 2, 4, 8, ...


@contextmanager
def debug_mode(enabled: bool | str = True) -> Iterator[None]:
    """Turn the debug mode on (``True``: every call checked) or off (``False``: back to the
    sampled checks) for the collectives in the block; or name a level of ``LEVELS``
    (``"none"``: no check, to measure what the checks cost).

    Call it on the rank (inside the function given to :func:`xla_permute.run_on_mesh`), on
    every rank alike; it holds for this rank's thread and overrides ``XLA_PERMUTE_DEBUG``.
    """
    if isinstance(enabled, bool):
        wanted = "all" if enabled else "sampled"
    elif enabled in LEVELS:
        wanted = enabled
    else:
        raise TypeError(f"enabled must be True, False or one of {LEVELS}, got {enabled!r}")
    previous = getattr(_local, "level", None)
    _local.level = wanted
    try:
        yield
    finally:
        _local.level = previous


def _crc(text: str) -> int:
    code = zlib.crc32(text.encode()) & _INT32_MAX  # 31 bits: the signature travels as int32
    _names.setdefault(code, text)
    return code


def signature_length(world_size: int) -> int:
    """Int32 values per signature: a header and ``FIELDS`` fields of ``2 + payload``."""
    return 2 + FIELDS * (2 + _payload(world_size))


def _payload(world_size: int) -> int:
    return max(2 * world_size, 10)


def _is_ints(value: Any) -> bool:
    """A sequence of ints (not a string: a list of strings travels as text)."""
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(v, int) for v in value)
    )


def _encode(value: Any, size: int) -> tuple[int, list[int]]:
    """(kind, payload) of one field value; long or unusual values travel as a CRC-32."""
    if value is None:
        return _NONE, []
    if isinstance(value, bool):
        return _BOOL, [int(value)]
    if isinstance(value, int) and -_INT32_MAX <= value <= _INT32_MAX:
        return _INT, [value]
    if isinstance(value, str):
        return _TEXT, [_crc(value)]
    if isinstance(value, Sequence) and all(isinstance(v, int) for v in value):
        ints = [int(v) for v in value]
        if len(ints) + 1 <= size and all(abs(v) <= _INT32_MAX for v in ints):
            return _INTS, [len(ints), *ints]
    if isinstance(value, Sequence) and all(_is_ints(p) for p in value):
        flat = [int(v) for p in value for v in p]
        if all(len(p) == 2 for p in value) and len(flat) + 1 <= size:
            return _PAIRS, [len(value), *flat]
        if value and len({len(g) for g in value}) == 1 and len(flat) + 1 <= size:
            return _GROUPS, [len(value), *flat]
    return _TEXT, [_crc(repr(value))]


def _learn_dtypes() -> None:
    import torch

    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            _crc(str(value))


def _decode(kind: int, payload: Sequence[int]) -> str:
    if kind == _NONE:
        return "None"
    if kind == _BOOL:
        return str(bool(payload[0]))
    if kind == _INT:
        return str(payload[0])
    if kind == _TEXT:
        if payload[0] not in _names:  # another process's text: dtypes are known everywhere
            _learn_dtypes()
        return _names.get(payload[0], f"<crc32 {payload[0]:#010x}>")
    count, flat = payload[0], list(payload[1:])
    if kind == _INTS:
        return str(tuple(flat[:count]))
    width = 2 if kind == _PAIRS else (len([v for v in flat if v >= 0]) // count if count else 0)
    return str(tuple(tuple(flat[i * width : (i + 1) * width]) for i in range(count)))


def signature(op: str, fields: Mapping[str, Any], *, world_size: int) -> list[int]:
    """The fixed-length int signature of one call: ``op`` and up to ``FIELDS`` named values."""
    if len(fields) > FIELDS:
        raise ValueError(f"at most {FIELDS} fields per signature, got {len(fields)}")
    size = _payload(world_size)
    out = [_MAGIC, _crc(op)]
    for name, value in fields.items():
        kind, payload = _encode(value, size)
        out += [_crc(name), kind, *payload, *[-1] * (size - len(payload))]
    for _ in range(FIELDS - len(fields)):
        out += [0, _NONE, *[-1] * size]
    return out


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def describe_disagreement(op: str, rows: Sequence[Sequence[int]]) -> str | None:
    """None if every rank's signature (``rows[r]``) is the same, else what differs, by rank."""
    rows = [tuple(int(v) for v in row) for row in rows]
    if len(set(rows)) <= 1:
        return None
    width = (len(rows[0]) - 2) // FIELDS
    differences = []

    def by_value(values: list[Any], show: Any, verbs: tuple[str, str] = ("passes", "pass")) -> str:
        groups: dict[Any, list[int]] = {}
        for r, v in enumerate(values):
            groups.setdefault(v, []).append(r)
        order = sorted(groups.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
        parts = [f"{_ranks(ranks)} {verbs[len(ranks) > 1]} {show(v)}" for v, ranks in order]
        return ", ".join(parts)

    ops = [row[1] for row in rows]
    if len(set(ops)) > 1:
        text = by_value(ops, lambda c: _names.get(c, f"<crc32 {c:#010x}>"), ("calls", "call"))
        return f"the ranks call different collectives: {text}"
    for i in range(FIELDS):
        start = 2 + i * width
        fields = [row[start : start + width] for row in rows]
        if len(set(fields)) <= 1:
            continue
        names = Counter(f[0] for f in fields)
        name = _names.get(names.most_common(1)[0][0], f"field {i}")
        differences.append(f"{name}: " + by_value(fields, lambda f: _decode(f[1], f[2:])))
    return f"{op}: the ranks disagree on " + "; ".join(differences)


def agree(
    op: str,
    tensors: Mapping[str, Any],
    options: Mapping[str, Any] | None = None,
    *,
    backend: Any,
    error: Exception | None = None,
) -> None:
    """The agreement check of one call, its signature built from its tensors and options.

    ``tensors``: name -> a tensor (its ``name.shape`` and ``name.dtype`` are checked), or a
    list of tensors (their shapes, and the first one's dtype). ``options``: name -> a value that
    every rank must pass alike (dtypes as ``str``, floats as ``repr``; ints, bools, strings,
    tuples of ints and groups travel as they are). ``error``: a check that failed on this rank
    alone; by default the first tensor that is not on this rank's device
    (``backend.device_error``). Then :func:`check_agreement`.
    """
    import torch

    fields: dict[str, Any] = {}
    found = error
    for name, value in tensors.items():
        group = list(value) if isinstance(value, (list, tuple)) else [value]
        shapes = [tuple(t.shape) for t in group]
        fields[f"{name}.shape"] = shapes[0] if len(group) == 1 else tuple(shapes)
        fields[f"{name}.dtype"] = str(group[0].dtype)
        for t in group:
            if found is None:
                found = backend.device_error(t, name)
    for name, value in (options or {}).items():
        if isinstance(value, torch.dtype):
            value = str(value)
        elif isinstance(value, float):
            value = repr(value)
        fields[name] = value
    check_agreement(op, fields, error=found, backend=backend)


def check_agreement(
    op: str,
    fields: Mapping[str, Any],
    *,
    error: Exception | None = None,
    backend: Any = None,
) -> None:
    """Raise :class:`DisagreementError` on every rank unless all ranks agree (if this call is
    checked: every call in debug mode, each op's 1st, 2nd, 4th, ... call by default).

    ``fields``: what every rank must pass alike (shapes as tuples, dtypes as ``str(dtype)``,
    checked pairs and groups, the backend, options). Call it after the argument checks and
    before the first collective (and before any shortcut that skips the collective, such as an
    empty tensor). On an unchecked call, or inside :func:`xla_permute.hlo.tracing`, it does
    nothing.

    ``error``: a check that failed on this rank alone (a tensor on another rank's device):
    this rank joins the check, then raises ``error``; the other ranks raise
    :class:`DisagreementError` instead of waiting for it in the collective.

    ``backend``: the :class:`~xla_permute.backends.select.CommBackend` (or its name) whose
    all-gather
    carries the check: on XLA a program of its own (a channel id of its own, a fresh token),
    on ``c10d`` an all-gather on the default process group. Default: ``"auto"``.
    """
    check_not_compiling(op)
    mesh_status.note_op(op)
    if not _checked(op):
        if error is not None:
            raise error
        return
    from xla_permute.backends.select import get_backend

    chosen = get_backend(backend or "auto") if not hasattr(backend, "gather_rows") else backend
    if chosen.name != "c10d":  # XLA: traced programs are never run, so nothing is checked
        from xla_permute.backends.tracing import is_tracing

        if is_tracing():
            if error is not None:
                raise error
            return
    world_size = chosen.world_size()
    failed = None if error is None else f"{type(error).__name__} (see that rank's error)"
    row = signature(op, {**fields, "error": failed}, world_size=world_size)
    message = describe_disagreement(op, chosen.gather_rows(row))
    if error is not None:
        raise error
    if message is not None:
        rank = chosen.rank()
        raise DisagreementError(
            f"{message} (xla_permute agreement check, on rank {rank} of {world_size}: every "
            f"rank must pass the same to each collective, in the same order)"
        )
