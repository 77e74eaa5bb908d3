"""Read HLO text: instructions, the collectives in it, and which ops depend on which.

The evidence that a collective matmul is what it claims (N-1 collective-permutes, no
all-gather, no step's dot waiting on the permute issued in the same step) is in the program
XLA receives. Get that text on a rank with :func:`trace` (traced, nothing executed) and read it
with :func:`parse`. What each rank sends, per collective and per ring step, is
:func:`account_bytes`; how the permutes of a ring depend on each other, :func:`chain_report`.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xla_permute.schedule import RingStep

# Reading the HLO of tensors built on a rank takes the runtime: its tracing state lives with
# the backends; the names stay reachable here, beside the reader of the text.
from xla_permute.backends.tracing import trace, tracing  # noqa: E402

__all__ = [
    "COLLECTIVE_KINDS",
    "ByteAccount",
    "Collective",
    "Instruction",
    "Program",
    "account_bytes",
    "bytes_sent_per_rank",
    "chain_report",
    "parse",
    "permute_steps",
    "shape_bytes",
    "trace",
    "tracing",
]

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
    """A collective op as the evidence needs it.

    ``operand_bytes`` is what one rank puts in (one shard for an all-gather, the full partial
    sum for a reduce-scatter); ``result_bytes`` what it gets out.
    """

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
        """The ``opcode`` instructions that neither use ``name`` nor feed it.

        For a collective, these are the ops that may run while it is in flight: a collective
        matmul's permute of step t has the dot of step t (and earlier ones) here; the
        all-gather of the baseline has none, because its one dot waits for it.
        """
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
            name=m["name"],
            opcode=m["op"],
            type=m["type"],
            operands=names,
            operand_types=types,
            attributes=attributes,
        )
    return program


# ---------------------------------------------------------------- ring accounting


def _program(hlo: str | Program) -> Program:
    return parse(hlo) if isinstance(hlo, str) else hlo


def permute_steps(
    hlo: str | Program,
    n: int,
    schedule: Sequence[RingStep],
    *,
    order: Sequence[int] | None = None,
    name: str = "program",
) -> list[list[str]]:
    """The collective-permutes of a ring program, grouped by the steps of ``schedule``.

    ``schedule``: one :class:`~xla_permute.schedule.RingStep` per step (e.g.
    ``all_gather_schedule(n, 0, bidirectional)``); step ``t`` issues one permute in each
    direction of its ``sends`` (``+1``: to the next rank of ``order``, default ``0..n-1``).
    A permute's direction is read from its pairs; within a direction the permutes form a chain
    through their data (each sends what the previous one delivered, or a sum that includes
    it), which gives their order. The text order of the HLO is not used: without torch_xla's
    token it need not be the issue order. Raises ValueError (naming ``name``) if the permutes
    are not ring shifts or do not match the schedule.
    """
    prog = _program(hlo)
    ring = list(range(n)) if order is None else list(order)
    if sorted(ring) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}, got {order!r}")
    shifts = {d: {(ring[i], ring[(i + d) % n]) for i in range(n)} for d in (1, -1)}
    by_direction: dict[int, list[str]] = {1: [], -1: []}
    for c in prog.collectives():
        if c.kind != "collective-permute":
            continue
        direction = next((d for d in (1, -1) if set(c.pairs or ()) == shifts[d]), None)
        if direction is None:
            raise ValueError(f"{name}: {c.name} is not a ring shift: {c.pairs}")
        by_direction[direction].append(c.name)
    for group in by_direction.values():
        group.sort(key=lambda op, g=group: sum(prog.depends_on(op, o) for o in g))
    wanted = {d: sum(d in s.sends for s in schedule) for d in (1, -1)}
    found = {d: len(g) for d, g in by_direction.items()}
    if found != wanted:
        raise ValueError(
            f"{name}: permutes per direction {found} do not match the schedule "
            f"({wanted} on {n} ranks)"
        )
    taken = {1: 0, -1: 0}
    out = []
    for step in schedule:
        names = []
        for d in step.sends:
            names.append(by_direction[d][taken[d]])
            taken[d] += 1
        out.append(names)
    return out


@dataclass(frozen=True)
class ByteAccount:
    """Bytes one rank sends in one program (from its traced HLO).

    ``per_collective``: ``(kind, bytes)`` in program order; ``per_step``: bytes per ring step
    (a ring program: the permutes of each schedule step; blocking collectives: the N-1 steps
    of their ring algorithms, equal shares); ``gathered_bytes``: the all-gathers' results
    (blocking collectives only; None without an all-gather).
    """

    per_collective: tuple[tuple[str, int], ...]
    per_step: tuple[int, ...]
    total: int
    gathered_bytes: int | None = None


def account_bytes(
    hlo: str | Program,
    n: int,
    schedule: Sequence[RingStep] | None = None,
    *,
    order: Sequence[int] | None = None,
    name: str = "program",
) -> ByteAccount:
    """Bytes each rank sends in a program on ``n`` ranks, read from its HLO.

    With a ``schedule``, the program is a ring of collective-permutes that follows it (see
    :func:`permute_steps`); without, it is blocking collectives (a baseline), counted with
    :func:`bytes_sent_per_rank` (ring algorithms assumed). A ring all-gather of a ``[2, 4]``
    float32 shard on 4 ranks sends 3 shards:

    >>> text = '''
    ... ENTRY %e (p: f32[2,4]) -> f32[8,4] {
    ...   %p = f32[2,4]{1,0} parameter(0)
    ...   ROOT %ag = f32[8,4]{1,0} all-gather(f32[2,4]{1,0} %p), channel_id=1, dimensions={0}
    ... }'''
    >>> account_bytes(text, 4)
    ByteAccount(per_collective=(('all-gather', 96),), per_step=(32, 32, 32), total=96,
                gathered_bytes=128)
    """
    prog = _program(hlo)
    collectives = prog.collectives()
    per = tuple((c.kind, bytes_sent_per_rank(c, n)) for c in collectives)
    total = sum(b for _, b in per)
    if schedule is None:
        if not collectives or "collective-permute" in {k for k, _ in per}:
            raise ValueError(f"{name}: expected blocking collectives and no permute, got {per}")
        gathers = [c.result_bytes for c in collectives if c.kind == "all-gather"]
        steps = max(n - 1, 1)
        return ByteAccount(per, (total // steps,) * steps, total, sum(gathers) if gathers else None)
    if {k for k, _ in per} != {"collective-permute"}:
        raise ValueError(f"{name}: expected only collective-permutes, got {per}")
    sent = {c.name: bytes_sent_per_rank(c, n) for c in collectives}
    grouped = permute_steps(prog, n, schedule, order=order, name=name)
    return ByteAccount(per, tuple(sum(sent[p] for p in s) for s in grouped), total)


def chain_report(
    hlo: str | Program,
    n: int,
    schedule: Sequence[RingStep] | None = None,
    *,
    order: Sequence[int] | None = None,
    name: str = "program",
) -> dict[str, int]:
    """How the permutes of a ring program (following ``schedule``) depend on each other.

    ``permutes``; ``chained``: consecutive permutes in issue order where the later depends on
    the earlier; ``same_step`` / ``same_step_chained``: pairs of permutes issued in the same
    step (bidirectional: one each way; their data are independent) and how many of them
    depend on each other anyway. torch_xla threads every collective through one numeric
    token, so each waits for the previous one and the two directions of a bidirectional step
    run one after the other; with ``DISABLE_NUMERIC_CC_TOKEN=1`` only data dependencies
    remain. ``schedule=None`` (a program without a ring): all zeros.
    """
    if schedule is None:
        return {"permutes": 0, "chained": 0, "same_step": 0, "same_step_chained": 0}
    prog = _program(hlo)
    steps = permute_steps(prog, n, schedule, order=order, name=name)
    issued = [p for s in steps for p in s]
    pairs = [s for s in steps if len(s) == 2]
    return {
        "permutes": len(issued),
        "chained": sum(
            prog.depends_on(b, a) for a, b in zip(issued[:-1], issued[1:], strict=True)
        ),
        "same_step": len(pairs),
        "same_step_chained": sum(prog.depends_on(b, a) or prog.depends_on(a, b)
                                 for a, b in pairs),
    }  # fmt: skip
