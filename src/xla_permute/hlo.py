"""Read HLO text: instructions, the collectives in it, and which ops depend on which.

The evidence that a collective matmul is what it claims (N-1 collective-permutes, no
all-gather, no step's dot waiting on the permute issued in the same step) is in the program
XLA receives. Get that text on a rank with :func:`~xla_permute.hlo.trace` (traced, nothing
executed; inside :func:`tracing` for collectives that cannot run here) and read it with
:func:`parse`; what one rank sends for a collective is :func:`bytes_sent_per_rank`.

>>> text = '''
... ENTRY %m (p0: f32[4,8]) -> f32[4,8] {
...   %p0 = f32[4,8]{1,0} parameter(0)
...   %cp = f32[4,8]{1,0} collective-permute(f32[4,8]{1,0} %p0), source_target_pairs={{0,1},{1,0}}
...   ROOT %add = f32[4,8]{1,0} add(f32[4,8]{1,0} %cp, f32[4,8]{1,0} %p0)
... }'''
>>> program = parse(text)
>>> [(c.kind, c.pairs, c.operand_bytes) for c in program.collectives()]
[('collective-permute', ((0, 1), (1, 0)), 128)]
>>> program.depends_on("add", "cp"), program.depends_on("cp", "add")
(True, False)
>>> program.independent_of("cp", "add")
[]
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property

from xla_permute.backends.tracing import enter_tracing, leave_tracing
from xla_permute.backends.xla import need_torch_xla

__all__ = [
    "COLLECTIVE_KINDS", "Collective", "Instruction", "Program", "bytes_sent_per_rank",
    "discard_traced_collectives", "parse", "shape_bytes", "trace", "tracing",
]  # fmt: skip

COLLECTIVE_KINDS = (
    "all-gather",
    "all-reduce",
    "all-to-all",
    "collective-permute",
    "reduce-scatter",
)

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([\d,]*)\]")
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>[a-z][\w\-]*)\((?P<rest>.*)$"
)


def shape_bytes(type_text: str) -> int:
    """Bytes of all arrays in an HLO type (a tuple counts every element).

    >>> shape_bytes("bf16[8,8]{1,0}"), shape_bytes("(f32[2], s32[])")
    (128, 12)
    """
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        total += count * _DTYPE_BYTES[dtype]
    return total


def _split_operands(rest: str) -> tuple[str, str]:
    """Split ``'<operands>), attrs'`` at the parenthesis closing the operand list."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def _int_lists(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(
        tuple(int(v) for v in m.split(",") if v) for m in re.findall(r"\{([\d,]*)\}", text)
    )


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction: name, opcode, result type, operand names and types, attributes."""

    name: str
    opcode: str
    type: str
    operands: tuple[str, ...]
    operand_types: tuple[str, ...]
    attributes: str

    def attribute(self, key: str) -> str | None:
        """The raw text of attribute ``key`` (``{...}`` groups included), or None."""
        m = re.search(
            rf"\b{re.escape(key)}=(\{{(?:[^{{}}]|\{{[^{{}}]*\}})*\}}|[^,\s]+)", self.attributes
        )
        return m.group(1) if m else None


@dataclass(frozen=True)
class Collective:
    """A collective op as the evidence needs it: ``operand_bytes`` is what one rank puts in
    (one shard for an all-gather, the full partial sum for a reduce-scatter), ``result_bytes``
    what it gets out."""

    name: str
    kind: str
    channel_id: int | None
    pairs: tuple[tuple[int, int], ...] | None
    replica_groups: tuple[tuple[int, ...], ...]
    operand_bytes: int
    result_bytes: int
    constrain_layout: bool


def bytes_sent_per_rank(c: Collective, group_size: int, rank: int | None = None) -> int:
    """Bytes one rank sends for collective ``c``, assuming ring algorithms.

    A ring all-gather sends N-1 shards; a ring reduce-scatter N-1 result-sized blocks; a ring
    all-reduce 2(N-1)/N of its operand; an all-to-all (N-1)/N; a collective-permute its operand
    if ``rank`` is a source (``rank=None``: if any rank is, i.e. the busiest rank).
    """
    n = group_size
    if c.kind == "all-gather":
        return (n - 1) * c.operand_bytes
    if c.kind == "reduce-scatter":
        return (n - 1) * c.result_bytes
    if c.kind == "all-reduce":
        return 2 * (n - 1) * c.operand_bytes // n
    if c.kind == "all-to-all":
        return (n - 1) * c.operand_bytes // n
    if c.kind == "collective-permute":
        sources = {s for s, t in (c.pairs or ()) if s != t}
        sends = bool(sources) if rank is None else rank in sources
        return c.operand_bytes if sends else 0
    raise ValueError(f"not a collective kind: {c.kind!r}")


@dataclass
class Program:
    """A parsed HLO module: its instructions by name, in text order."""

    instructions: dict[str, Instruction] = field(default_factory=dict)

    def ops(self, opcode: str) -> list[Instruction]:
        """Instructions with this opcode, in text order."""
        return [i for i in self.instructions.values() if i.opcode == opcode]

    def collectives(self) -> list[Collective]:
        """The collective ops, in text order (the order XLA received them)."""
        out = []
        for ins in self.instructions.values():
            if ins.opcode not in COLLECTIVE_KINDS:
                continue
            channel = ins.attribute("channel_id")
            pairs = ins.attribute("source_target_pairs")
            groups = ins.attribute("replica_groups")
            out.append(
                Collective(
                    name=ins.name,
                    kind=ins.opcode,
                    channel_id=int(channel) if channel else None,
                    pairs=tuple((a, b) for a, b in _int_lists(pairs)) if pairs else None,
                    replica_groups=_int_lists(groups[1:-1]) if groups else (),
                    operand_bytes=sum(shape_bytes(t) for t in ins.operand_types),
                    result_bytes=shape_bytes(ins.type),
                    constrain_layout=ins.attribute("constrain_layout") == "true",
                )
            )
        return out

    @cached_property
    def _ancestors(self) -> dict[str, frozenset[str]]:
        memo: dict[str, frozenset[str]] = {}
        for name, ins in self.instructions.items():  # text order: operands come first
            acc: set[str] = set()
            for op in ins.operands:
                acc.add(op)
                acc |= memo.get(op, frozenset())
            memo[name] = frozenset(acc)
        return memo

    def depends_on(self, name: str, other: str) -> bool:
        """True when instruction ``name`` (transitively) uses the result of ``other``."""
        return other in self._ancestors[name]

    def independent_of(self, name: str, opcode: str = "dot") -> list[str]:
        """The ``opcode`` instructions that neither use ``name`` nor feed it: for a collective,
        the ops that may run while it is in flight (a collective matmul's permute of step t has
        the dot of step t here; the baseline's all-gather none, its one dot waits for it)."""
        return [
            i.name
            for i in self.ops(opcode)
            if not self.depends_on(i.name, name) and not self.depends_on(name, i.name)
        ]


def parse(text: str) -> Program:
    """Parse HLO text (as printed by ``_get_xla_tensors_hlo`` or an XLA dump)."""
    program = Program()
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        operands_text, attributes = _split_operands(m["rest"])
        names = tuple(re.findall(r"%([\w.\-]+)", operands_text))
        types = tuple(t.strip() for t in re.split(r"%[\w.\-]+,?", operands_text) if t.strip())
        program.instructions[m["name"]] = Instruction(
            m["name"], m["op"], m["type"], names, types, attributes
        )
    return program


# ---------------------------------------------------------------- the program of a rank


def discard_traced_collectives() -> None:
    """Forget the collectives traced on this rank so far (their tensors must be discarded):
    reset the token torch_xla threads through every collective, as ``xm.set_replication``
    does, so that the next traced program does not contain the last one's collectives too."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla._XLAC._set_all_reduce_token(xm._get_device_context().device, None)


def trace(tensors: object) -> str:
    """HLO text of the program that would compute ``tensors`` (a tensor or a list), never run.

    Call it on a rank of the mesh with tensors built from XLA-device inputs, then discard them
    (no ``torch_xla.sync()`` with them alive). The collectives traced so far are forgotten
    afterwards (:func:`discard_traced_collectives`)."""
    import torch

    need_torch_xla("xla_permute.hlo.trace")
    import torch_xla

    outputs = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)  # type: ignore[call-overload]
    text = torch_xla._XLAC._get_xla_tensors_hlo(outputs)
    discard_traced_collectives()
    return text


@contextmanager
def tracing() -> Iterator[None]:
    """Trace collectives that cannot run here, to read their HLO (:func:`~xla_permute.hlo.trace`).

    The ops refuse the native backend (``xm.collective_permute``) on the CPU mesh, except in
    this block, whose tensors the caller traces and discards, never runs. On leaving, the
    collectives traced in it are forgotten."""
    need_torch_xla("xla_permute.hlo.tracing")
    depth = enter_tracing()
    try:
        yield
    finally:
        leave_tracing(depth)
        if depth == 0:
            discard_traced_collectives()
