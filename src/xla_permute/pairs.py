"""Source-target pairs of a CollectivePermute: checks, rings, inverses, cycles, groups; and the
two argument checks every op shares (:func:`check_int`, :func:`check_dim`).

A permute is given by pairs ``(source, target)``: rank ``target`` receives rank ``source``'s
tensor. XLA allows any *partial* permutation: every rank is the source of at most one pair and
the target of at most one pair; self pairs ``(r, r)`` keep a value in place; a rank that is no
pair's target receives zeros. With replica groups the ids are group-local and the same pairs
apply inside every group.

Everything here is pure Python and raises before any collective is issued.

>>> ring_pairs(4)
((0, 1), (1, 2), (2, 3), (3, 0))
>>> sorted(inverse_pairs(ring_pairs(4, shift=1))) == sorted(ring_pairs(4, shift=-1))
True
>>> decompose([(0, 1), (1, 0), (2, 3)])
Decomposition(cycles=((0, 1),), chains=((2, 3),))
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple

__all__ = [
    "ERRORS_PAGE", "Decomposition", "PairsLike", "check_dim", "check_groups", "check_int",
    "check_pairs", "decompose", "forms_complete_rings", "global_pairs", "inverse_pairs",
    "is_ring", "ring_pairs", "source_of",
]  # fmt: skip

Pair = tuple[int, int]
Pairs = tuple[Pair, ...]
PairsLike = Iterable[Sequence[int]]
# Replica groups as checked (check_groups): a tuple of rank tuples.
Groups = tuple[tuple[int, ...], ...]
# Replica groups as the ops take them: lists of ranks, or None for one group of all ranks.
GroupsLike = Sequence[Sequence[int]] | None
#: The docs' page that explains errors; a message whose cause is there ends with :func:`see`.
ERRORS_PAGE = "tutorials/15_errors.html"


def see(entry: str) -> str:
    """The end of a message the errors page explains, after a space:
    ``(see the docs, tutorials/15_errors.html#error-<entry>)``."""
    return f" (see the docs, {ERRORS_PAGE}#error-{entry})"


def check_int(
    value: object,
    name: str,
    minimum: int | None = None,
    below: int | None = None,
    *,
    fix: str | None = None,
) -> int:
    """``value`` as an int (a numpy or torch integer scalar too; a bool is not one) with
    ``minimum <= value < below``; else TypeError or ValueError naming ``name``, the range and
    the ``fix``. The one int check of the package.

    >>> check_int(3, "n", 1)
    3
    >>> check_int(0, "n", 1)
    Traceback (most recent call last):
    ...
    ValueError: n must be an int >= 1, got 0
    """
    if minimum is not None and below is not None:
        bounds = f" in [{minimum}, {below})"
    else:
        bounds = f" >= {minimum}" if minimum is not None else ""
        bounds += f" < {below}" if below is not None else ""
    hint = f"; {fix}" if fix else ""
    if not isinstance(value, bool) and not isinstance(value, int):
        with contextlib.suppress(TypeError):  # numpy / torch integer scalars
            value = operator.index(value)  # type: ignore[arg-type]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int{bounds}, got {value!r} ({type(value).__name__}){hint}"
        )
    if (minimum is not None and value < minimum) or (below is not None and value >= below):
        raise ValueError(f"{name} must be an int{bounds}, got {value!r}{hint}")
    return value


def check_dim(dim: object, shape: Sequence[int], what: str = "x", op: str = "") -> int:
    """``dim`` as an index in ``0 .. len(shape) - 1`` (negative counts from the end).

    Raises TypeError (not an int) or ValueError (not a dimension of ``what``), with ``op``'s
    name first when given.

    >>> check_dim(-1, (2, 3, 4))
    2
    """
    prefix = f"{op}: " if op else ""
    dim = check_int(dim, f"{prefix}dim")
    ndim = len(shape)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{prefix}dim={dim!r} is not a dimension of {what} with shape {tuple(shape)}"
        )
    return dim % ndim


class Decomposition(NamedTuple):
    """A partial permutation as disjoint closed cycles and open chains (ranks in visit order).

    A chain ``(a, b, c)`` means a -> b -> c with nobody sending to ``a`` (it receives zeros) and
    ``c`` sending nowhere (its value is dropped). A self pair is a cycle of length one.
    """

    cycles: tuple[tuple[int, ...], ...]
    chains: tuple[tuple[int, ...], ...]


def _as_rank(value: object, where: str) -> int:
    """``value`` as an int rank id (a numpy or torch integer scalar too; a bool is no rank)."""
    try:
        return check_int(value, where)
    except TypeError:
        kind = type(value).__name__
        raise TypeError(f"{where} must be an integer rank id, got {value!r} ({kind})") from None


def _as_lists(value: object, name: str, columns: int | None) -> object:
    """A numpy array or torch tensor of integers as nested lists; anything else unchanged.

    ``columns=2``: pairs, ``(k, 2)`` (or empty); ``None``: groups, ``(g, size)``.
    """
    if not (hasattr(value, "tolist") and hasattr(value, "shape") and hasattr(value, "dtype")):
        return value
    shape = tuple(value.shape)
    kind = str(value.dtype)
    if "int" not in kind:
        raise TypeError(
            f"{name} is an array of dtype {kind}; rank ids must be integers: pass an integer "
            f"array (e.g. .astype(int)) or a list of pairs such as [(0, 1), (1, 0)]"
        )
    empty = len(shape) >= 1 and shape[0] == 0
    if not empty and (len(shape) != 2 or (columns is not None and shape[1] != columns)):
        want = "(k, 2)" if columns == 2 else "(groups, ranks per group)"
        raise TypeError(f"{name} is an array of shape {shape}; it must have the shape {want}")
    return value.tolist()


def check_pairs(pairs: PairsLike, group_size: int | None) -> Pairs:
    """Validate ``pairs`` for groups of ``group_size`` ranks and return them as int tuples.

    Allowed: any partial permutation of ``0..group_size-1`` (self pairs, several cycles, open
    chains). The empty sequence is allowed and means every rank receives zeros.
    ``group_size=None`` checks everything but the upper bound on the ids.

    Raises:
        TypeError: not a sequence of 2-item pairs, or a non-integer id.
        ValueError: a negative id, an id >= ``group_size``, a duplicate source or target.

    >>> check_pairs([[0, 1], [1, 0]], 2)
    ((0, 1), (1, 0))
    >>> check_pairs([(0, 1), (2, 1)], 4)
    Traceback (most recent call last):
    ...
    ValueError: pairs: duplicate target 1 in pairs (0, 1) and (2, 1); every rank may receive ...

    A numpy ``(k, 2)`` integer array or a 2-column integer tensor is accepted as well.
    """
    pairs = _as_lists(pairs, "pairs", 2)  # type: ignore[assignment]
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise TypeError(
            f"pairs must be a sequence of (source, target) pairs such as [(0, 1), (1, 0)], "
            f"got {type(pairs).__name__}"
        )
    out: list[Pair] = []
    by_source: dict[int, Pair] = {}
    by_target: dict[int, Pair] = {}
    for i, pair in enumerate(pairs):
        if getattr(pair, "ndim", None) == 1 and hasattr(pair, "tolist"):  # a numpy/torch row
            pair = pair.tolist()
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(
                f"pairs[{i}] = {pair!r} is not a (source, target) pair; pairs must be a "
                f"sequence of 2-item pairs such as [(0, 1), (1, 0)]"
            )
        s = _as_rank(pair[0], f"pairs[{i}] source")
        t = _as_rank(pair[1], f"pairs[{i}] target")
        for role, rank in (("source", s), ("target", t)):
            if rank < 0:
                raise ValueError(
                    f"pairs[{i}] = {(s, t)}: {role} {rank} is negative; rank ids count from 0"
                )
            if group_size is not None and rank >= group_size:
                raise ValueError(
                    f"pairs[{i}] = {(s, t)}: {role} {rank} is outside the group of "
                    f"{group_size} ranks (ids 0..{group_size - 1}){see('pairs')}"
                )
        if s in by_source:
            raise ValueError(
                f"pairs: duplicate source {s} in pairs {by_source[s]} and {(s, t)}; every rank "
                f"may send to at most one target{see('pairs')}"
            )
        if t in by_target:
            raise ValueError(
                f"pairs: duplicate target {t} in pairs {by_target[t]} and {(s, t)}; every rank "
                f"may receive from at most one source{see('pairs')}"
            )
        by_source[s] = by_target[t] = (s, t)
        out.append((s, t))
    return tuple(out)


def check_groups(groups: GroupsLike, world_size: int) -> Groups:
    """Validate replica groups: equal sizes, no overlap, together exactly ranks 0..N-1.

    ``None`` means one group of all ranks.

    >>> check_groups([[0, 1], [2, 3]], 4)
    ((0, 1), (2, 3))
    >>> check_groups(None, 3)
    ((0, 1, 2),)
    """
    if groups is None:
        return (tuple(range(world_size)),)
    groups = _as_lists(groups, "groups", None)  # type: ignore[assignment]
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise TypeError(
            f"groups must be a non-empty list of rank lists such as [[0, 1], [2, 3]], or None "
            f"for one group of all ranks; got {groups!r}"
        )
    out = []
    owner: dict[int, int] = {}
    for g, group in enumerate(groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence) or not group:
            raise TypeError(f"groups[{g}] = {group!r} must be a non-empty list of rank ids")
        ranks = tuple(_as_rank(r, f"groups[{g}] entry") for r in group)
        for r in ranks:
            if not 0 <= r < world_size:
                raise ValueError(
                    f"groups[{g}] contains rank {r}, outside the world of {world_size} ranks"
                )
            if owner.get(r) == g:
                raise ValueError(f"groups[{g}] lists rank {r} twice; list every rank once")
            if r in owner:
                raise ValueError(
                    f"groups overlap: rank {r} is in groups[{owner[r]}] and groups[{g}]; "
                    f"every rank must be in exactly one group"
                )
            owner[r] = g
        out.append(ranks)
    sizes = {len(g) for g in out}
    if len(sizes) > 1:
        raise ValueError(
            f"groups have different sizes {sorted(sizes)}; the same group-local pairs must "
            f"apply in every group, so all groups need the same size"
        )
    missing = sorted(set(range(world_size)) - set(owner))
    if missing:
        raise ValueError(
            f"groups leave ranks {missing} out; the groups must together cover every rank "
            f"0..{world_size - 1} exactly once"
        )
    return tuple(out)


def global_pairs(pairs: PairsLike, groups: GroupsLike, world_size: int) -> Pairs:
    """Check group-local ``pairs`` and ``groups`` and return the equivalent global pairs.

    >>> global_pairs([(0, 1), (1, 0)], [[0, 1], [2, 3]], 4)
    ((0, 1), (1, 0), (2, 3), (3, 2))
    """
    checked_groups = check_groups(groups, world_size)
    local = check_pairs(pairs, len(checked_groups[0]))
    return tuple((g[s], g[t]) for g in checked_groups for s, t in local)


def ring_pairs(n: int, shift: int = 1) -> Pairs:
    """Pairs of a ring shift: rank ``r`` sends to ``(r + shift) % n``.

    >>> ring_pairs(3, shift=-1)
    ((0, 2), (1, 0), (2, 1))
    """
    try:
        size = _as_rank(n, "n")
    except TypeError:
        size = 0
    if size < 1:
        raise ValueError(f"n must be a positive int number of ranks, got {n!r}")
    n = size
    try:
        shift = _as_rank(shift, "shift")
    except TypeError:
        raise TypeError(f"shift must be an int number of ranks, got {shift!r}") from None
    return tuple((r, (r + shift) % n) for r in range(n))


def inverse_pairs(pairs: PairsLike) -> Pairs:
    """The pairs that send every value back: ``(s, t)`` becomes ``(t, s)``.

    The backward of a permute is the permute of the gradient with the inverse pairs.
    """
    return tuple((int(t), int(s)) for s, t in pairs)


def source_of(pairs: PairsLike, rank: int) -> int | None:
    """The rank that ``rank`` receives from, or None (it receives zeros)."""
    return next((int(s) for s, t in pairs if t == rank), None)


def decompose(pairs: PairsLike) -> Decomposition:
    """Split a partial permutation into closed cycles and open chains.

    Each cycle starts at its smallest rank; each chain at the rank that receives nothing.
    The pairs are checked first (:func:`check_pairs` without an upper bound on the ids).

    >>> decompose(ring_pairs(3))
    Decomposition(cycles=((0, 1, 2),), chains=())
    >>> decompose([(1, 2), (0, 1), (3, 3)])
    Decomposition(cycles=((3,),), chains=((0, 1, 2),))
    """
    succ = dict(check_pairs(pairs, None))
    targets = set(succ.values())
    seen: set[int] = set()
    chains = []
    for start in sorted(set(succ) - targets):  # sends, receives nothing: a chain's head
        chain = [start]
        while chain[-1] in succ:
            chain.append(succ[chain[-1]])
        seen.update(chain)
        chains.append(tuple(chain))
    cycles = []
    for start in sorted(set(succ) - seen):
        if start in seen:
            continue
        cycle = [start]
        while succ[cycle[-1]] != start:
            cycle.append(succ[cycle[-1]])
        seen.update(cycle)
        cycles.append(tuple(cycle))
    return Decomposition(tuple(cycles), tuple(chains))


def is_ring(pairs: PairsLike, n: int) -> bool:
    """True when the pairs form one cycle through all ``n`` ranks (a ring shift, for example).

    The pairs are checked for a group of ``n`` ranks first (:func:`check_pairs`).

    >>> is_ring(ring_pairs(4, shift=3), 4), is_ring([(0, 1), (1, 0)], 4)
    (True, False)
    """
    d = decompose(check_pairs(pairs, n))
    return not d.chains and len(d.cycles) == 1 and len(d.cycles[0]) == n


def forms_complete_rings(pairs: PairsLike) -> bool:
    """True when every pair lies on a closed cycle (no open chain): the Neuron rule.

    >>> forms_complete_rings([(0, 1), (1, 0), (2, 3), (3, 2)]), forms_complete_rings([(0, 1)])
    (True, False)
    """
    return not decompose(pairs).chains
