"""Roofline model of collective matmul and its baselines: when does the ring pay, per chip?

Nothing here runs on a device: it is arithmetic on published chip figures, checked against
published measurements by :func:`~xla_permute_tools.validation.validation_table`.

**Shapes.** A :class:`~xla_permute_tools.cost.Workload` is what one rank holds. For
all-gather-matmul, x is an ``m x k`` shard (the gathered operand, gathered along rows) and w a
local ``k x n`` block; the rank computes ``AllGather(x) @ w``, ``(N m) x n``. For
matmul-reduce-scatter, x is ``(N m) x k`` (k is the sharded, contracted dimension), w is
``k x n``, and the rank ends with its ``m x n`` block of the sum. ``b`` is bytes per element
of what travels: the input's for all-gather-matmul; for matmul-reduce-scatter the partial sums'
(:attr:`Workload.partial_sum_bytes`: float32 for bf16 inputs by default, the rule of
:func:`xla_permute.reference.accumulation_dtype` that the code sends with).

**Symbols.** ``R = peak * efficiency`` (FLOP/s), ``H`` HBM bandwidth, ``W = link_bandwidth *
links_per_neighbor`` (bytes/s, one way, towards one ring neighbour), ``L`` per-hop latency,
``O`` fixed cost per collective op issued, ``S`` bytes of the block that travels each step
(``m k b`` for all-gather-matmul, the partial sum ``m n b`` for matmul-reduce-scatter).

* One local matmul: ``T_mm(m, k, n) = max(2 m k n / R, (m k + k n + m n) b / H)``.
* Ring collective (all-gather or reduce-scatter of N blocks of S bytes) as XLA or NCCL run it,
  one op: ``T_coll = ceil((N - 1) / d) * (S / W + L) + O``, with ``d = 2`` when the ring has a
  wraparound link and separate links to both neighbours (``ring_directions == 2``), else
  ``d = 1`` (a line without wraparound, or one switch egress shared by all peers). Whether an
  axis of N devices wraps round is the chip's (:meth:`~xla_permute_tools.cost.Chip.wraparound`:
  on TPU v5e/v6e only a full axis of 16 does) unless the workload says.
* Baseline: ``T_base = T_coll + T_mm(N m, k, n)`` (blocking gather then one matmul; for
  reduce-scatter, one matmul then the blocking scatter).
* Collective matmul: rounds ``r = 1..Rn``; round r moves ``beta_r`` blocks (unidirectional:
  ``beta_r = 1`` for ``N - 1`` rounds; bidirectional: blocks travel both ways, ``beta_r = 2``
  for ``floor((N - 1) / 2)`` rounds plus one round of 1 block when N is even). Computes
  ``M_0 = T_mm(m, k, n)`` (own block) and ``M_r = beta_r T_mm(m, k, n)``; transfers
  ``C_r = S / W``, or ``2 S / W`` when two blocks share one link direction (bidirectional with
  ``d = 1``). The transfer of round r overlaps the compute of round r - 1; each round is its
  own permute (issued together when bidirectional) and pays ``h L + O`` unoverlapped, with
  ``h = 1`` hop on a ring and ``h = N - 1`` on a line (the ring's wrap pair crosses it):

  ``T_cm = sum_{r=1..Rn} (max(M_{r-1}, C_r) + h L + O) + M_Rn``

  Unidirectional: ``T_cm = T_mm + (N - 1) (max(T_mm, S / W) + h L + O)``.
  Matmul-reduce-scatter is the time-reverse of this schedule (partial sums travel instead of
  x blocks), and a max-plus chain has the same total reversed, so the same formula holds with
  ``S = m n b``.
* Chunked ring (all-gather-matmul with ``chunks = c``, ``Workload.chunks``): each block
  travels in ``c`` chunks, one chunk all the way round before the next sets out, so a rank
  holds its input, w, the output and two chunks instead of two blocks. The rounds are the
  same with ``M`` and ``C`` divided by ``c``, run ``c`` times (the first round of chunk ``j``
  also finishes chunk ``j - 1``'s last compute); every permute pays ``h L + O``:

  ``T_cm(c) = sum_j sum_r (max(M_{r-1} / c + [r = 1, j > 0] M_Rn / c, C_r / c) + h L + O)
  + M_Rn / c``

  Compute-bound, chunking adds ``(c - 1) Rn (h L + O)``; communication-bound, it also saves
  up to ``(1 - 1/c) M_Rn`` of un-overlapped last compute. :func:`chunk_overhead` is the net
  price, relative.
* Limits: compute-bound, ``T_cm -> max(T_math, T_comm)`` with ``T_math = sum M`` and
  ``T_comm = sum C``; bidirectional halves ``T_comm`` (odd N exactly; ``N / (2 (N - 1))`` for
  even N). Collective matmul pays ``h L + O`` per round where the baseline pays ``O`` once
  and ``L`` per round of a ring that may run both ways; it also re-reads w in every step. On
  small matrices these make it lose (:func:`~xla_permute_tools.cost.crossover`).

Neglected: the accumulator additions of matmul-reduce-scatter, the loss of matmul efficiency
on smaller blocks, and contention with other traffic.

>>> chip = CHIPS["tpu-v5e"]
>>> work = Workload(m=4096, k=8192, n=4096, n_devices=4)
>>> speedup(chip, work) > 1 > speedup(chip, Workload(m=64, k=64, n=64, n_devices=4))
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from xla_permute.pairs import check_int
from xla_permute_tools.cost.chips import CHIPS, Chip

__all__ = [
    "Prediction",
    "Workload",
    "baseline_time",
    "collective_matmul_time",
    "crossover",
    "chunk_overhead",
    "crossover_table",
    "directions",
    "link_time",
    "matmul_time",
    "partial_sum_bytes",
    "predict",
    "ring_collective_time",
    "speedup",
]

Op = Literal["all_gather_matmul", "matmul_reduce_scatter"]
Method = Literal["baseline", "uni", "bi"]
_OPS = ("all_gather_matmul", "matmul_reduce_scatter")
_METHODS = ("baseline", "uni", "bi")


@dataclass(frozen=True)
class Workload:
    """Per-rank shapes of one collective matmul (see the module docstring for the layout).

    ``dtype_bytes``: bytes per element of x and w. ``reduce_dtype_bytes``: bytes per element
    of matmul-reduce-scatter's partial sums (``reduce_dtype``); None: what the code sends by
    default (:attr:`partial_sum_bytes`). ``wraparound``: the ring's axis has a wraparound
    link (ignored on switched chips); None: the chip's rule for ``n_devices``
    (:meth:`~xla_permute_tools.cost.Chip.wraparound`). ``chunks``: all-gather-matmul's ``chunks``
    option, each block sent in that many chunks (1 for matmul-reduce-scatter).
    """

    m: float
    k: float
    n: float
    n_devices: int
    dtype_bytes: float = 2
    op: Op = "all_gather_matmul"
    wraparound: bool | None = None
    reduce_dtype_bytes: float | None = None
    chunks: int = 1

    def __post_init__(self) -> None:
        for name in ("m", "k", "n", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Workload: {name} must be a positive number, got {value!r}")
        check_int(self.n_devices, "Workload: n_devices", 1)
        if self.op not in _OPS:
            raise ValueError(f"Workload: op must be one of {_OPS}, got {self.op!r}")
        if self.reduce_dtype_bytes is not None:
            partial_sum_bytes(self.dtype_bytes, self.reduce_dtype_bytes)  # checks it
        check_int(self.chunks, "Workload: chunks", 1)
        if self.chunks > 1 and self.op != "all_gather_matmul":
            raise ValueError(
                f"Workload: chunks={self.chunks} is an option of all_gather_matmul only; use "
                "chunks=1 for matmul_reduce_scatter"
            )

    @property
    def partial_sum_bytes(self) -> float:
        """Bytes per partial-sum element matmul-reduce-scatter sends (:func:`partial_sum_bytes`)."""
        return partial_sum_bytes(self.dtype_bytes, self.reduce_dtype_bytes)

    @property
    def block_bytes(self) -> float:
        """``S``: bytes that travel per step (x block, or partial-sum block)."""
        if self.op == "all_gather_matmul":
            return self.m * self.k * self.dtype_bytes
        return self.m * self.n * self.partial_sum_bytes

    def wraps(self, chip: Chip) -> bool:
        """Whether this workload's ring closes on ``chip``: ``wraparound``, else the chip's."""
        return chip.wraparound(self.n_devices) if self.wraparound is None else self.wraparound


@dataclass(frozen=True)
class Prediction:
    """A predicted time and its parts (seconds): ``total`` and the sums of the compute
    (``math``), bandwidth (``comm``) and latency terms over the schedule's rounds."""

    method: str
    total: float
    math: float
    comm: float
    latency: float


#: The floating dtype of each element size (the cost model counts bytes, the code has dtypes).
_FLOAT_OF_SIZE = {1: "float8_e4m3fn", 2: "bfloat16", 4: "float32", 8: "float64"}


def partial_sum_bytes(dtype_bytes: float, reduce_dtype_bytes: float | None = None) -> float:
    """Bytes per element of the partial sums matmul-reduce-scatter (and its baseline) send.

    The rule is the code's own, :func:`xla_permute.reference.accumulation_dtype` (one source of
    truth): ``reduce_dtype_bytes`` if given, else float32's 4 bytes for half-precision (2-byte)
    inputs and the input's size otherwise.

    >>> partial_sum_bytes(2), partial_sum_bytes(2, 2), partial_sum_bytes(4)
    (4, 2, 4)
    """
    import torch

    from xla_permute.reference import accumulation_dtype

    def as_dtype(nbytes: float, name: str) -> torch.dtype:
        if nbytes not in _FLOAT_OF_SIZE:
            raise ValueError(f"{name} must be one of {sorted(_FLOAT_OF_SIZE)}, got {nbytes!r}")
        return getattr(torch, _FLOAT_OF_SIZE[int(nbytes)])

    if dtype_bytes not in _FLOAT_OF_SIZE:  # no float of that size: nothing is widened
        return reduce_dtype_bytes if reduce_dtype_bytes is not None else dtype_bytes
    reduce = (
        None if reduce_dtype_bytes is None else as_dtype(reduce_dtype_bytes, "reduce_dtype_bytes")
    )
    return accumulation_dtype(as_dtype(dtype_bytes, "dtype_bytes"), reduce).itemsize


def matmul_time(
    chip: Chip,
    m: float,
    k: float,
    n: float,
    dtype_bytes: float = 2,
    *,
    efficiency: float | None = None,
) -> float:
    """``T_mm = max(2 m k n / R, (m k + k n + m n) b / H)`` seconds for one local matmul."""
    rate = chip.peak_flops * (chip.flops_efficiency if efficiency is None else efficiency)
    return max(2 * m * k * n / rate, (m * k + k * n + m * n) * dtype_bytes / chip.hbm_bandwidth)


def directions(chip: Chip, wraparound: bool = True) -> int:
    """``d``: ring directions a collective can use at once on ``chip``, 2 or 1.

    2 needs separate links to both neighbours (``chip.ring_directions == 2``) and a ring that
    closes (``wraparound``, or a switched chip where every pair is one hop).
    """
    return chip.ring_directions if (wraparound or chip.switched) else 1


def link_time(chip: Chip, nbytes: float) -> float:
    """``S / W`` seconds to send ``nbytes`` to one ring neighbour, one way (latency apart)."""
    return nbytes / chip.neighbor_bandwidth


def ring_collective_time(
    chip: Chip, block_bytes: float, n_devices: int, *, wraparound: bool | None = None
) -> float:
    """All-gather or reduce-scatter of ``n_devices`` blocks of ``block_bytes`` over one ring axis.

    ``T_coll = ceil((N - 1) / d) * (S / W + L) + O``: a bidirectional ring (``d = 2``) needs
    half the rounds; a line without wraparound, or a switch egress, has ``d = 1``. Equals the
    scaling book's ``V / W_bidi`` for large blocks on a full ring. ``wraparound=None``: the
    chip's rule for ``n_devices`` (:meth:`~xla_permute_tools.cost.Chip.wraparound`).
    """
    if wraparound is None:
        wraparound = chip.wraparound(n_devices)
    d = directions(chip, wraparound)
    if n_devices == 1:
        return 0.0
    rounds = math.ceil((n_devices - 1) / d)
    return rounds * (block_bytes / chip.neighbor_bandwidth + chip.hop_latency) + (
        chip.collective_overhead
    )


def predict(
    chip: Chip, work: Workload, method: Method = "uni", *, efficiency: float | None = None
) -> Prediction:
    """Predicted time of ``method`` ("baseline", "uni" or "bi") for ``work`` on ``chip``.

    Formulas in the module docstring. ``efficiency`` overrides ``chip.flops_efficiency`` (for
    a dtype that does not run at the chip's bf16 rate).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    N, S, W = work.n_devices, work.block_bytes, chip.neighbor_bandwidth
    if method == "baseline":
        full = matmul_time(
            chip, N * work.m, work.k, work.n, work.dtype_bytes, efficiency=efficiency
        )
        d = directions(chip, work.wraps(chip))
        rounds = math.ceil((N - 1) / d)
        comm = rounds * S / W
        lat = rounds * chip.hop_latency + (chip.collective_overhead if N > 1 else 0.0)
        return Prediction(method, full + comm + lat, full, comm, lat)
    step = matmul_time(chip, work.m, work.k, work.n, work.dtype_bytes, efficiency=efficiency)
    # Blocks received per round: one per round one way, or up to two (one from each side).
    blocks = [1] * (N - 1) if method == "uni" else [2] * ((N - 1) // 2) + [1] * ((N - 1) % 2)
    d = directions(chip, work.wraps(chip))
    one = link_time(chip, S)  # two blocks on one link direction take twice as long
    transfers = [one if (b == 1 or d == 2) else 2 * one for b in blocks]
    computes = [step] + [b * step for b in blocks]
    hops = 1 if (work.wraps(chip) or chip.switched) else N - 1
    c = work.chunks  # c rings of chunks, one after the other: c times the permutes
    lat = c * len(blocks) * (hops * chip.hop_latency + chip.collective_overhead)
    total = lat + computes[-1] / c
    for j in range(c):  # ring j's first round also finishes ring j-1's last compute
        carried = ([computes[-1] / c if j else 0.0] + [0.0] * len(blocks))[: len(blocks)]
        total += sum(
            max(m / c + extra, t / c)
            for m, t, extra in zip(computes[:-1], transfers, carried, strict=True)
        )
    return Prediction(method, total, sum(computes), sum(transfers), lat)


def chunk_overhead(
    chip: Chip, work: Workload, chunks: int, *, bidirectional: bool = False
) -> float:
    """Relative price of sending each block in ``chunks`` chunks: ``T_cm(c) / T_cm(1) - 1``.

    Positive when the added latency ``(c - 1) Rn (h L + O)`` outweighs the shorter last
    compute; chunking buys memory (two chunks in flight and worked on instead of two blocks),
    and this is what it costs in time on ``chip``.

    >>> w = Workload(m=4096, k=8192, n=4096, n_devices=8)
    >>> 0 < chunk_overhead(CHIPS["tpu-v5e"], w, 4) < 0.05
    True
    """
    from dataclasses import replace

    method = "bi" if bidirectional else "uni"
    one = predict(chip, replace(work, chunks=1), method).total
    return predict(chip, replace(work, chunks=chunks), method).total / one - 1


def baseline_time(chip: Chip, work: Workload, *, efficiency: float | None = None) -> float:
    """Blocking collective plus one matmul: ``T_coll + T_mm(N m, k, n)`` seconds."""
    return predict(chip, work, "baseline", efficiency=efficiency).total


def collective_matmul_time(
    chip: Chip, work: Workload, *, bidirectional: bool = False, efficiency: float | None = None
) -> float:
    """Ring collective matmul, ``T_cm = sum_r (max(M_{r-1}, C_r) + h L + O) + M_last`` seconds."""
    return predict(chip, work, "bi" if bidirectional else "uni", efficiency=efficiency).total


def speedup(
    chip: Chip, work: Workload, *, bidirectional: bool = False, efficiency: float | None = None
) -> float:
    """``T_base / T_cm``: above 1, collective matmul pays."""
    base = baseline_time(chip, work, efficiency=efficiency)
    return base / collective_matmul_time(
        chip, work, bidirectional=bidirectional, efficiency=efficiency
    )


def _scaled(shape: tuple[float, float, float], vary: str, s: float) -> dict[str, float]:
    m, k, n = shape
    return {
        "all": {"m": s, "k": s, "n": s},
        "m": {"m": s, "k": k, "n": n},
        "k": {"m": m, "k": s, "n": n},
        "n": {"m": m, "k": k, "n": s},
    }[vary]


def crossover(
    chip: Chip,
    n_devices: int,
    *,
    bidirectional: bool = False,
    op: Op = "all_gather_matmul",
    dtype_bytes: float = 2,
    wraparound: bool | None = None,
    vary: Literal["all", "m", "k", "n"] = "all",
    shape: tuple[float, float, float] = (1024, 1024, 1024),
    lo: float = 1.0,
    hi: float = 2.0**20,
    rtol: float = 1e-6,
) -> float:
    """Size below which collective matmul does not pay (``speedup < 1``).

    ``vary="all"`` scales a square problem ``m = k = n = s``; ``"m"``, ``"k"`` or ``"n"``
    scales that dimension of ``shape`` and keeps the other two. Scans ``s`` geometrically over
    ``[lo, hi]``, takes the largest ``s`` with ``speedup < 1`` and bisects (relative tolerance
    ``rtol``) between it and the next scanned size, where the speedup is back at >= 1. Returns
    ``lo`` if collective matmul pays on the whole range and ``math.inf`` if it does not pay
    at ``hi``. With ``vary="k"`` the bandwidth-to-math ratio does not depend on ``k``; only
    latency and w re-reads move the result. ``wraparound=None``: the chip's rule for
    ``n_devices``.
    """
    if vary not in ("all", "m", "k", "n"):
        raise ValueError(f"vary must be 'all', 'm', 'k' or 'n', got {vary!r}")
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")

    def gain(s: float) -> float:
        work = Workload(
            **_scaled(shape, vary, s),
            n_devices=n_devices,
            dtype_bytes=dtype_bytes,
            op=op,
            wraparound=wraparound,
        )
        return speedup(chip, work, bidirectional=bidirectional) - 1.0

    grid = [lo * (hi / lo) ** (i / 256) for i in range(257)]
    losing = [s for s in grid if gain(s) < 0]
    if not losing:
        return lo
    below = losing[-1]
    if below == grid[-1]:
        return math.inf
    above = grid[grid.index(below) + 1]
    while above - below > rtol * above:
        mid = math.sqrt(below * above)
        below, above = (mid, above) if gain(mid) < 0 else (below, mid)
    return above


def crossover_table(
    chips: Iterable[str] = tuple(CHIPS),
    n_devices: Sequence[int] = (4, 8),
    *,
    op: Op = "all_gather_matmul",
    dtype_bytes: float = 2,
) -> list[dict[str, object]]:
    """Square-problem crossover sizes (``m = k = n = s``) per chip, N and direction; each ring
    wraps round as the chip's axis of N does (:meth:`~xla_permute_tools.cost.Chip.wraparound`)."""
    rows = []
    for name in chips:
        for n in n_devices:
            row: dict[str, object] = {"chip": name, "n_devices": n}
            for bidi in (False, True):
                row["bi" if bidi else "uni"] = crossover(
                    CHIPS[name], n, bidirectional=bidi, op=op, dtype_bytes=dtype_bytes
                )
            rows.append(row)
    return rows
