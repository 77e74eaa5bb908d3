"""Agreement checks: before a collective, check that every rank passes the same arguments.

XLA does not check that the ranks of a collective agree: a rank that passes a longer tensor,
another dtype or other pairs makes the others read garbage or wait forever. A check gathers
the call's signature (op, shapes, dtypes, pairs, groups, backend, options) from every rank; if
two differ, every rank raises :class:`DisagreementError`, naming the ranks and what differs::

    collective_permute: the ranks disagree on x.shape: rank 1 passes (3,), ranks 0, 2, 3 pass (2,)

How often is the check level (:data:`LEVELS`), set by ``XLA_PERMUTE_DEBUG`` or, on a rank, by
``with xla_permute.debug_mode(level):``:

* ``"sampled"`` (the default; ``XLA_PERMUTE_DEBUG`` unset or ``0``): each op is checked at its
  1st, 2nd, 4th, 8th, ... call on a rank (the ranks call each op equally often, so they all
  decide alike), so a mistake present from the start (a rank passing bfloat16, uneven shards)
  raises at the first call, and a training loop pays almost nothing after its first step.
* ``"every"``, the **debug mode** (``XLA_PERMUTE_DEBUG=1``, PyTorch's
  ``TORCH_DISTRIBUTED_DEBUG=DETAIL``): every call is checked; the default in the device
  process of :func:`xla_permute.run_on_mesh` (the CPU mesh, where programs are written).
* ``"off"`` (``XLA_PERMUTE_DEBUG=none``): no check at all, to measure what the checks cost.

A check is one small all-gather (``backend.gather_rows``) of the call's ``name=value`` lines
as :data:`SIGNATURE_INTS` int32 values (one length for every call; Neuron takes no 64-bit
collectives), run at once in a program of its own; inside :func:`xla_permute.hlo.tracing` it
is skipped. Only the forward of an op is checked: its backward follows from it.

>>> rows = [signature("op", {"x.shape": s}) for s in [(2, 3), (3, 3)]]
>>> describe_disagreement(rows)
'op: the ranks disagree on x.shape: rank 0 passes (2, 3), rank 1 passes (3, 3)'
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from xla_permute.backends.base import CommBackend
from xla_permute.backends.compiled import check_not_compiling
from xla_permute.backends.tracing import is_tracing
from xla_permute.pairs import see

__all__ = [
    "ENV", "LEVELS", "DisagreementError", "agree", "check_level", "debug_mode",
    "describe_disagreement", "on_op", "signature",
]  # fmt: skip

#: The environment variable of the check level (``1`` every call, ``0`` or unset sampled,
#: ``none`` off; the level names ``every``, ``sampled``, ``off`` work too).
ENV = "XLA_PERMUTE_DEBUG"
#: The check levels, most checks first.
LEVELS = ("every", "sampled", "off")
_FROM_ENV = {"1": "every", "": "sampled", "0": "sampled", "none": "off", **{v: v for v in LEVELS}}
#: int32 values per signature (4 bytes of its UTF-8 text each, zero-padded).
SIGNATURE_INTS = 1024
#: The longest value shown whole; a longer one is cut, with a checksum of the whole.
MAX_VALUE = 160

_local = threading.local()  # per rank: the ranks of the CPU mesh are threads of one process
_op_hook: Callable[[str], None] | None = None


class DisagreementError(ValueError):
    """The ranks passed different arguments to one collective (raised on every rank)."""


def check_level() -> str:
    """This rank's check level, one of :data:`LEVELS`: its :func:`debug_mode`, else
    ``XLA_PERMUTE_DEBUG``'s."""
    override = getattr(_local, "level", None)
    if override is not None:
        return override
    value = os.environ.get(ENV, "").strip().lower()
    if value not in _FROM_ENV:
        raise ValueError(
            f"{ENV}={os.environ[ENV]!r}: set it to 1 (check every call), 0 (the default: check "
            f"each op's 1st, 2nd, 4th, ... call) or none (no checks)"
        )
    return _FROM_ENV[value]


@contextmanager
def debug_mode(level: str = "every") -> Iterator[None]:
    """Check the collectives in the block at ``level``: ``"every"`` call (the debug mode, the
    default), ``"sampled"`` (each op's 1st, 2nd, 4th, ... call) or ``"off"`` (no check).

    Call it on every rank alike, inside the rank function; it holds for this rank's thread and
    overrides ``XLA_PERMUTE_DEBUG``.
    """
    if level not in LEVELS:
        raise ValueError(f"debug_mode takes a level of {LEVELS}, got {level!r}")
    previous, _local.level = getattr(_local, "level", None), level
    try:
        yield
    finally:
        _local.level = previous


def on_op(hook: Callable[[str], None] | None) -> None:
    """Call ``hook(op)`` at every call of an op of this package, checked or not, before its
    collective (``None``: no hook). The CPU mesh's device process records each rank's last op
    with it, for the diagnosis of an abort (:class:`xla_permute.MeshError`)."""
    global _op_hook
    _op_hook = hook


def _checked(op: str) -> bool:
    """Whether this call of ``op`` is checked at this rank's level (counts calls per rank)."""
    level = check_level()
    if level != "sampled":
        return level == "every"
    counts = _local.__dict__.setdefault("counts", {})
    count = counts[op] = counts.get(op, 0) + 1
    return count & (count - 1) == 0  # 1, 2, 4, 8, ...


def _show(value: Any) -> str:
    """A value as the message shows it: text as it is, lists as tuples, long values cut."""

    def tuples(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return tuple(map(tuples, v))
        return int(v) if hasattr(v, "__index__") and not isinstance(v, bool) else v  # numpy

    text = value if isinstance(value, str) else repr(tuples(value))
    text = text.replace("\n", " ")
    if len(text) > MAX_VALUE:
        text = f"{text[: MAX_VALUE - 30]}... (crc32 {zlib.crc32(text.encode()):08x})"
    return text


def signature(op: str, fields: Mapping[str, Any]) -> list[int]:
    """The signature of one call of ``op``: ``name=value`` lines as :data:`SIGNATURE_INTS`
    int32 values."""
    text = "\n".join([op, *(f"{name}={_show(value)}" for name, value in fields.items())])
    data = text.encode()
    if len(data) > 4 * SIGNATURE_INTS:
        raise ValueError(f"the signature of {op} is {len(data)} bytes, over {4 * SIGNATURE_INTS}")
    return list(struct.unpack(f"<{SIGNATURE_INTS}i", data.ljust(4 * SIGNATURE_INTS, b"\0")))


def _by_value(values: Sequence[str], verbs: tuple[str, str] = ("passes", "pass")) -> str:
    """``rank 1 passes a, ranks 0, 2 pass b``: the ranks by value, the fewest ranks first."""
    ranks: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        ranks.setdefault(v, []).append(r)
    order = sorted(ranks.items(), key=lambda kv: (len(kv[1]), kv[1][0]))
    return ", ".join(
        f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))} {verbs[len(rs) > 1]} {v}"
        for v, rs in order
    )


def describe_disagreement(rows: Sequence[Sequence[int]]) -> str | None:
    """None if every rank's signature (``rows[r]``) is the same, else what differs, by rank."""
    texts = [struct.pack(f"<{len(r)}i", *r).rstrip(b"\0").decode(errors="replace") for r in rows]
    if len(set(texts)) <= 1:
        return None
    ops = [text.split("\n")[0] for text in texts]
    if len(set(ops)) > 1:
        return f"the ranks call different collectives: {_by_value(ops, ('calls', 'call'))}"
    fields = [dict(line.partition("=")[::2] for line in t.split("\n")[1:]) for t in texts]
    names = dict.fromkeys(name for f in fields for name in f)
    differ = [n for n in names if len({f.get(n) for f in fields}) > 1]
    parts = [f"{n}: {_by_value([f.get(n, '(nothing)') for f in fields])}" for n in differ]
    return f"{ops[0]}: the ranks disagree on " + "; ".join(parts)


def agree(
    op: str,
    tensors: Mapping[str, Any],
    options: Mapping[str, Any] | None = None,
    *,
    backend: CommBackend,
    error: Exception | None = None,
) -> None:
    """The agreement check of one call of ``op``: raise :class:`DisagreementError` on every
    rank unless all ranks pass the same (if this call is checked at this rank's level).

    ``tensors``: name -> a tensor (its ``name.shape`` and ``name.dtype`` are compared), or a
    list of tensors (their shapes, the first one's dtype). ``options``: name -> what every rank
    must pass alike. Call it before the first collective and any shortcut that skips it.
    ``error``: a check that failed on this rank alone (by default ``backend.device_error``):
    this rank joins the check, then raises it; the others raise :class:`DisagreementError`.
    """
    check_not_compiling(op)
    if _op_hook is not None:
        _op_hook(op)
    fields: dict[str, Any] = {}
    for name, value in tensors.items():
        group = list(value) if isinstance(value, (list, tuple)) else [value]
        shapes = [tuple(t.shape) for t in group]
        fields[f"{name}.shape"] = shapes[0] if len(group) == 1 else tuple(shapes)
        fields[f"{name}.dtype"] = str(group[0].dtype)
        for t in group:
            error = error or backend.device_error(t, name)
    for name, value in (options or {}).items():
        fields[name] = str(value) if isinstance(value, torch.dtype) else value
    # XLA: traced programs are never run, so nothing is checked
    if not _checked(op) or (backend.name != "c10d" and is_tracing()):
        if error is not None:
            raise error
        return
    fields["error"] = None if error is None else f"{type(error).__name__} (see that rank's error)"
    message = describe_disagreement(backend.gather_rows(signature(op, fields)))
    if error is not None:
        raise error
    if message is not None:
        raise DisagreementError(
            f"{message} (xla_permute agreement check, on rank {backend.rank()} of "
            f"{backend.world_size()}: every rank must pass the same to each collective, in "
            f"the same order){see('disagreement')}"
        )
