"""Roofline cost model: when does collective matmul pay, per chip?

Nothing here runs on a device: it is arithmetic on published chip figures, checked against
published measurements by :func:`validation_table`.

**Shapes.** A :class:`Workload` is what one rank holds. For all-gather-matmul, x is an
``m x k`` shard (the gathered operand, gathered along rows) and w a local ``k x n`` block; the
rank computes ``AllGather(x) @ w``, ``(N m) x n``. For matmul-reduce-scatter, x is ``(N m) x k``
(k is the sharded, contracted dimension), w is ``k x n``, and the rank ends with its ``m x n``
block of the sum. ``b`` is bytes per element of what travels.

**Symbols.** ``R = peak * efficiency`` (FLOP/s), ``H`` HBM bandwidth, ``W = link_bandwidth *
links_per_neighbor`` (bytes/s, one way, towards one ring neighbour), ``L`` per-hop latency,
``O`` fixed cost per collective op issued, ``S`` bytes of the block that travels each step
(``m k b`` for all-gather-matmul, the partial sum ``m n b`` for matmul-reduce-scatter).

* One local matmul: ``T_mm(m, k, n) = max(2 m k n / R, (m k + k n + m n) b / H)``.
* Ring collective (all-gather or reduce-scatter of N blocks of S bytes) as XLA or NCCL run it,
  one op: ``T_coll = ceil((N - 1) / d) * (S / W + L) + O``, with ``d = 2`` when the ring has a
  wraparound link and separate links to both neighbours (``ring_directions == 2``), else
  ``d = 1`` (a line without wraparound, or one switch egress shared by all peers).
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
* Limits: compute-bound, ``T_cm -> max(T_math, T_comm)`` with ``T_math = sum M`` and
  ``T_comm = sum C``; bidirectional halves ``T_comm`` (odd N exactly; ``N / (2 (N - 1))`` for
  even N). Collective matmul pays ``h L + O`` per round where the baseline pays ``O`` once
  and ``L`` per round of a ring that may run both ways; it also re-reads w in every step. On
  small matrices these make it lose (:func:`crossover`).

Neglected: the accumulator additions of matmul-reduce-scatter, the loss of matmul efficiency
on smaller blocks, and contention with other traffic.

>>> chip = CHIPS["tpu-v5e"]
>>> work = Workload(m=4096, k=8192, n=4096, n_devices=4)
>>> speedup(chip, work) > 1 > speedup(chip, Workload(m=64, k=64, n=64, n_devices=4))
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "CHIPS",
    "Chip",
    "Prediction",
    "ValidationRow",
    "Workload",
    "baseline_time",
    "collective_matmul_time",
    "crossover",
    "crossover_table",
    "format_validation_table",
    "matmul_time",
    "predict",
    "ring_collective_time",
    "scaling_book_chip_check",
    "speedup",
    "validation_table",
]

Op = Literal["all_gather_matmul", "matmul_reduce_scatter"]
Method = Literal["baseline", "uni", "bi"]
_OPS = ("all_gather_matmul", "matmul_reduce_scatter")
_METHODS = ("baseline", "uni", "bi")

SCALING_BOOK_TPUS = "https://jax-ml.github.io/scaling-book/tpus/"
SCALING_BOOK_SHARDING = "https://jax-ml.github.io/scaling-book/sharding/"
SCALING_BOOK_JAX = "https://jax-ml.github.io/scaling-book/jax-stuff/"
SCALING_BOOK_GPUS = "https://jax-ml.github.io/scaling-book/gpus/"
JAX_MGPU_COLLECTIVE_MATMUL = "https://docs.jax.dev/en/latest/pallas/gpu/collective_matmul.html"
NEURON_TRN1_ARCH = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/"
    "trn1-arch.html"
)
NEURON_TRAINIUM_ARCH = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/general/arch/neuron-hardware/"
    "trainium.html"
)
NEURON_TRAINIUM2_ARCH = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/"
    "trainium2.html"
)
NEURON_TRN2_ARCH = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/about-neuron/arch/neuron-hardware/"
    "trn2-arch.html"
)
NEURON_NKI_TRN1_ARCH = "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/trainium_inferentia2_arch.html"
NEURON_NKI_TRN2_ARCH = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/trainium2_arch.html"
)
NEURON_INTRANODE_CC = (
    "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/neuron-runtime/explore/"
    "intranode-collective-comm.html"
)
NVIDIA_H100 = "https://www.nvidia.com/en-us/data-center/h100/"

_FIGURES = (
    "peak_flops",
    "link_bandwidth",
    "links_per_neighbor",
    "ring_directions",
    "hop_latency",
    "collective_overhead",
    "hbm_bandwidth",
    "flops_efficiency",
)


@dataclass(frozen=True)
class Chip:
    """Published figures of one accelerator, each with its citation in ``sources``.

    ``peak_flops``: dense bf16/fp16 FLOP/s per chip. ``link_bandwidth``: bytes/s of one link,
    one way. ``links_per_neighbor``: links joining two ring neighbours. ``ring_directions``: 2
    when a device reaches its left and right ring neighbours over separate full-duplex links
    (a torus axis), 1 when one egress serves every peer (a switch: sending both ways splits it).
    ``switched``: every pair is one hop (no wraparound question). ``hop_latency``: seconds paid
    per communication round. ``collective_overhead``: fixed seconds per collective op issued
    (the baseline issues one; collective matmul one per round). ``hbm_bandwidth``: bytes/s.
    ``flops_efficiency``: achievable fraction of ``peak_flops``. ``assumptions`` names the
    figures that are not published as such (see their ``sources`` entry for what was assumed).
    """

    name: str
    peak_flops: float
    link_bandwidth: float
    links_per_neighbor: int
    ring_directions: int
    hop_latency: float
    collective_overhead: float
    hbm_bandwidth: float
    sources: Mapping[str, str]
    flops_efficiency: float = 1.0
    switched: bool = False
    assumptions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        missing = [f for f in _FIGURES if not self.sources.get(f)]
        if missing:
            raise ValueError(f"Chip {self.name!r}: sources has no citation for {missing}")
        unknown = set(self.assumptions) - set(_FIGURES)
        if unknown:
            raise ValueError(f"Chip {self.name!r}: assumptions names unknown figures {unknown}")
        if self.ring_directions not in (1, 2):
            raise ValueError(f"Chip {self.name!r}: ring_directions must be 1 or 2")

    @property
    def neighbor_bandwidth(self) -> float:
        """``W``: bytes/s one way towards one ring neighbour."""
        return self.link_bandwidth * self.links_per_neighbor

    @property
    def flops(self) -> float:
        """``R = peak_flops * flops_efficiency``."""
        return self.peak_flops * self.flops_efficiency


_BOOK_LATENCY = (
    f"{SCALING_BOOK_SHARDING} ('Each hop over an ICI link has some intrinsic overhead ... "
    "typically around 1us'); same figure in the TPU chapter's worked problem 5"
)
_TPU_EFFICIENCY = "no published achieved fraction used: ideal roofline (assumption)"
# The book measured 8 us for an all-gather of bf16[256, 256] over an axis of 4 on TPU v5e
# (no wraparound, 3 rounds); the rounds account for 3 * (32768 B / 4.5e10 B/s + 1 us).
_TPU_OVERHEAD = 8e-6 - 3 * (64 * 256 * 2 / 4.5e10 + 1e-6)


def _tpu(name: str, peak: float, link: float, hbm: float) -> Chip:
    table = f"{SCALING_BOOK_TPUS} (TPU Specs table)"
    return Chip(
        name=name,
        peak_flops=peak,
        link_bandwidth=link,
        links_per_neighbor=1,
        ring_directions=2,
        hop_latency=1e-6,
        collective_overhead=_TPU_OVERHEAD,
        hbm_bandwidth=hbm,
        sources={
            "peak_flops": f"{table}, FLOPs/s/chip (bf16)",
            "link_bandwidth": f"{table}, ICI BW/link (one-way)",
            "links_per_neighbor": f"{table}: one ICI link per torus neighbour",
            "ring_directions": (
                f"{table}: bidirectional ring only with a wraparound link (full axis of 16 on "
                "v5e/v6e, multiples of 4 on v4p/v5p); pass wraparound=False otherwise"
            ),
            "hop_latency": _BOOK_LATENCY,
            "collective_overhead": (
                f"{SCALING_BOOK_SHARDING} (Pop Quiz 2): a latency-bound all-gather of "
                "bf16[256,256] over 4 TPU v5e 'is closer to 8us' measured; 8 us minus the 3 "
                "rounds' 3 x (32 kB / 4.5e10 + 1 us) = 2.8 us (fit to that one figure; the same "
                "software overhead assumed on the other TPUs)"
            ),
            "hbm_bandwidth": f"{table}, HBM BW/chip",
            "flops_efficiency": _TPU_EFFICIENCY,
        },
        assumptions=("collective_overhead", "flops_efficiency"),
    )


_NEURON_LATENCY = (
    f"{NEURON_INTRANODE_CC}: 'the per-hop latency of Ring/KangaRing is about 1-2 us (HBM load "
    "dependent)'; 1.5 us is the midpoint (assumption)"
)
_NEURON_OVERHEAD = (
    f"{NEURON_INTRANODE_CC}: a collective's latency term 'is of 10^0 to 10^1 us magnitude'; no "
    "per-op figure is published: assumed 1.5 us, the low end (assumption)"
)


def _neuron_link(total: str, links: str) -> str:
    return (
        f"{total}; {links}. Per link = total / links / 2: the docs do not say whether the "
        "per-chip total counts both directions; assumed it does, like NVLink's 900 GB/s "
        "(assumption; halve the model's comm times if it is one way)"
    )


CHIPS: dict[str, Chip] = {
    "tpu-v4": _tpu("TPU v4p", 2.75e14, 4.5e10, 1.2e12),
    "tpu-v5e": _tpu("TPU v5e", 1.97e14, 4.5e10, 8.1e11),
    "tpu-v5p": _tpu("TPU v5p", 4.59e14, 9e10, 2.8e12),
    "tpu-v6e": _tpu("TPU v6e", 9.20e14, 9e10, 1.6e12),
    "trn1": Chip(
        name="Trainium (Trn1)",
        peak_flops=190e12,
        link_bandwidth=384 * 2**30 / 4 / 2,
        links_per_neighbor=1,
        ring_directions=2,
        hop_latency=1.5e-6,
        collective_overhead=1.5e-6,
        hbm_bandwidth=820 * 2**30,
        sources={
            "peak_flops": (
                f"{NEURON_TRAINIUM_ARCH}: '190 FP16/BF16/cFP8/TF32 TFLOPS' per chip (the "
                "Trainium2 page's comparison table says 191; an older Trn1 page said 210)"
            ),
            "link_bandwidth": _neuron_link(
                f"{NEURON_TRN1_ARCH}: NeuronLink-v2 384 GiB/sec/device on trn1.32xlarge",
                f"{NEURON_NKI_TRN1_ARCH}: 4 NeuronLink-v2 per Trainium",
            ),
            "links_per_neighbor": f"{NEURON_TRN1_ARCH}: 2D torus, one link per neighbour",
            "ring_directions": f"{NEURON_TRN1_ARCH}: 2D torus (rings have wraparound)",
            "hop_latency": _NEURON_LATENCY,
            "collective_overhead": _NEURON_OVERHEAD,
            "hbm_bandwidth": (
                f"{NEURON_TRAINIUM_ARCH}: '820 GiB/sec' (older pages say 820 GB/sec)"
            ),
            "flops_efficiency": _TPU_EFFICIENCY,
        },
        assumptions=("link_bandwidth", "hop_latency", "collective_overhead", "flops_efficiency"),
    ),
    "trn2": Chip(
        name="Trainium2 (Trn2)",
        peak_flops=667e12,
        link_bandwidth=1.28e12 / 4 / 2,
        links_per_neighbor=1,
        ring_directions=2,
        hop_latency=1.5e-6,
        collective_overhead=1.5e-6,
        hbm_bandwidth=2.9e12,
        sources={
            "peak_flops": f"{NEURON_TRAINIUM2_ARCH}: '667 BF16/FP16/TF32 TFLOPS' (dense)",
            "link_bandwidth": _neuron_link(
                f"{NEURON_TRAINIUM2_ARCH}: 'NeuronLink-v3 ... provides 1.28 TB/sec bandwidth "
                "per chip'",
                f"{NEURON_NKI_TRN2_ARCH}: '4 NeuronLink-v3 for device-to-device'",
            ),
            "links_per_neighbor": f"{NEURON_TRN2_ARCH}: 4x4 2D torus, one link per neighbour",
            "ring_directions": f"{NEURON_TRN2_ARCH}: '4x4, 2D Torus topology'",
            "hop_latency": _NEURON_LATENCY,
            "collective_overhead": _NEURON_OVERHEAD,
            "hbm_bandwidth": f"{NEURON_TRAINIUM2_ARCH}: '96 GiB ... with 2.9 TB/sec'",
            "flops_efficiency": _TPU_EFFICIENCY,
        },
        assumptions=("link_bandwidth", "hop_latency", "collective_overhead", "flops_efficiency"),
    ),
    "h100": Chip(
        name="NVIDIA H100 SXM",
        peak_flops=989.4e12,
        link_bandwidth=25e9,
        links_per_neighbor=18,
        ring_directions=1,
        hop_latency=6e-6,
        collective_overhead=0.0,
        hbm_bandwidth=3.35e12,
        flops_efficiency=2 * 1024 * 4096 * 4096 / 43e-6 / 989.4e12,
        switched=True,
        sources={
            "peak_flops": (
                f"{NVIDIA_H100}: FP16 Tensor Core 1,979 TFLOPS with sparsity, i.e. 989.4 dense; "
                f"{SCALING_BOOK_GPUS}: 9.9e14 bf16/fp16"
            ),
            "link_bandwidth": f"{SCALING_BOOK_GPUS}: NVLink 4.0, 25 GB/s each way per link",
            "links_per_neighbor": (
                f"{SCALING_BOOK_GPUS}: 18 links per GPU into the NVSwitches, 450 GB/s egress "
                f"to any peer ({NVIDIA_H100}: 900 GB/s counting both directions)"
            ),
            "ring_directions": (
                f"{SCALING_BOOK_GPUS}: one 450 GB/s egress shared by all peers (switch)"
            ),
            "hop_latency": (
                f"{JAX_MGPU_COLLECTIVE_MATMUL}: 'adding about 6us for each round of "
                "communication (the memory fences associated with the synchronization are "
                "expensive)'; a kernel synchronisation cost, also used for NCCL's ring steps "
                "(assumption)"
            ),
            "collective_overhead": (
                "no separate per-op figure in the sources: the 6 us per round above covers the "
                "synchronisation (assumption: 0)"
            ),
            "hbm_bandwidth": f"{NVIDIA_H100}: 3.35 TB/s (H100 SXM)",
            "flops_efficiency": (
                f"{JAX_MGPU_COLLECTIVE_MATMUL}: a f16 1024x4096x4096 matmul takes 'about 43us "
                "on a single H100' -> 2*1024*4096*4096/43us/989.4e12 = 0.808 (fit to that one "
                "figure, applied to every H100 row)"
            ),
        },
        assumptions=("hop_latency", "collective_overhead"),
    ),
}


@dataclass(frozen=True)
class Workload:
    """Per-rank shapes of one collective matmul (see the module docstring for the layout).

    ``wraparound``: the ring's axis has a wraparound link (ignored on switched chips).
    """

    m: float
    k: float
    n: float
    n_devices: int
    dtype_bytes: float = 2
    op: Op = "all_gather_matmul"
    wraparound: bool = True

    def __post_init__(self) -> None:
        for name in ("m", "k", "n", "dtype_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"Workload: {name} must be a positive number, got {value!r}")
        if isinstance(self.n_devices, bool) or not isinstance(self.n_devices, int):
            raise TypeError(f"Workload: n_devices must be an int, got {self.n_devices!r}")
        if self.n_devices < 1:
            raise ValueError(f"Workload: n_devices must be >= 1, got {self.n_devices}")
        if self.op not in _OPS:
            raise ValueError(f"Workload: op must be one of {_OPS}, got {self.op!r}")

    @property
    def block_bytes(self) -> float:
        """``S``: bytes that travel per step (x block, or partial-sum block)."""
        width = self.k if self.op == "all_gather_matmul" else self.n
        return self.m * width * self.dtype_bytes


@dataclass(frozen=True)
class Prediction:
    """A predicted time and its parts (seconds): ``total`` and the sums of the compute
    (``math``), bandwidth (``comm``) and latency terms over the schedule's rounds."""

    method: str
    total: float
    math: float
    comm: float
    latency: float


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


def _directions(chip: Chip, wraparound: bool) -> int:
    return chip.ring_directions if (wraparound or chip.switched) else 1


def ring_collective_time(
    chip: Chip, block_bytes: float, n_devices: int, *, wraparound: bool = True
) -> float:
    """All-gather or reduce-scatter of ``n_devices`` blocks of ``block_bytes`` over one ring axis.

    ``T_coll = ceil((N - 1) / d) * (S / W + L) + O``: a bidirectional ring (``d = 2``) needs
    half the rounds; a line without wraparound, or a switch egress, has ``d = 1``. Equals the
    scaling book's ``V / W_bidi`` for large blocks on a full ring.
    """
    d = _directions(chip, wraparound)
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
        d = _directions(chip, work.wraparound)
        rounds = math.ceil((N - 1) / d)
        comm = rounds * S / W
        lat = rounds * chip.hop_latency + (chip.collective_overhead if N > 1 else 0.0)
        return Prediction(method, full + comm + lat, full, comm, lat)
    step = matmul_time(chip, work.m, work.k, work.n, work.dtype_bytes, efficiency=efficiency)
    # Blocks received per round: one per round one way, or up to two (one from each side).
    blocks = [1] * (N - 1) if method == "uni" else [2] * ((N - 1) // 2) + [1] * ((N - 1) % 2)
    d = _directions(chip, work.wraparound)
    transfers = [S / W if (b == 1 or d == 2) else 2 * S / W for b in blocks]
    computes = [step] + [b * step for b in blocks]
    hops = 1 if (work.wraparound or chip.switched) else N - 1
    lat = len(blocks) * (hops * chip.hop_latency + chip.collective_overhead)
    total = sum(max(c, t) for c, t in zip(computes[:-1], transfers, strict=True))
    total += lat + computes[-1]
    return Prediction(method, total, sum(computes), sum(transfers), lat)


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
    wraparound: bool = True,
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
    latency and w re-reads move the result.
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
    """Square-problem crossover sizes (``m = k = n = s``, full rings) per chip, N and direction."""
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


@dataclass(frozen=True)
class ValidationRow:
    """One published measurement next to the model's prediction.

    ``kind``: "prediction" (the figure was not used to set any model input), "fit" (the
    figure set a model input, so the ratio is 1 by construction) or "identity" (the published
    figure is itself the source's formula on inputs the model also uses).
    """

    source: str
    case: str
    chip: str
    published_us: float
    predicted_us: float
    kind: str
    note: str = ""
    url: str = field(default="", repr=False)

    @property
    def ratio(self) -> float:
        """predicted / published."""
        return self.predicted_us / self.published_us


# The scaling book's example computes with int32 (jnp.arange), not bf16: its matmul rate is
# taken from the published 224 us (a fit) and used for the other two rows.
_BOOK_B, _BOOK_D, _BOOK_F, _BOOK_X, _BOOK_Y = 1024, 2048, 8192, 2, 4


def _book_workload(wraparound: bool) -> Workload:
    return Workload(
        m=_BOOK_B / _BOOK_X,
        k=_BOOK_D / _BOOK_Y,
        n=_BOOK_F / _BOOK_Y,
        n_devices=_BOOK_Y,
        dtype_bytes=4,
        wraparound=wraparound,
    )


def _book_efficiency(chip: Chip) -> float:
    flops = 2 * (_BOOK_B / _BOOK_X) * _BOOK_D * (_BOOK_F / _BOOK_Y)
    return flops / 224e-6 / chip.peak_flops


def scaling_book_chip_check() -> list[dict[str, object]]:
    """The scaling book's collective-matmul example under each TPU assumption.

    The passage does not name the chip. For each TPU the int32 matmul rate is refit to the
    published 224 us; the (2, 4) mesh's axis of 4 has no wraparound on v5e/v6e (full axes of
    16 only) and has one on v4p/v5p (multiples of 4). Returns predicted baseline and
    collective-matmul times and their ratios to 311 us and 244 us.
    """
    rows = []
    for key in ("tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e"):
        chip = CHIPS[key]
        work = _book_workload(wraparound=key in ("tpu-v4", "tpu-v5p"))
        eff = _book_efficiency(chip)
        base = baseline_time(chip, work, efficiency=eff) * 1e6
        cm = collective_matmul_time(chip, work, efficiency=eff) * 1e6
        rows.append(
            {
                "chip": key,
                "wraparound": work.wraparound,
                "baseline_us": base,
                "baseline_ratio": base / 311,
                "collective_us": cm,
                "collective_ratio": cm / 244,
            }
        )
    return rows


def validation_table() -> list[ValidationRow]:
    """Predicted vs published: the scaling book (TPU v5e assumed) and JAX Pallas MGPU (H100).

    Scaling book, "Example [Collective Matmul]"
    (https://jax-ml.github.io/scaling-book/jax-stuff/): A[B_X, D_Y] . W[D, F_Y] on a
    (X, Y) = (2, 4) mesh, B, D, F = 1024, 2048, 8192, int32 inputs (``jnp.arange``); per rank
    the gathered block is ``512 x 512`` and w's block ``512 x 2048`` (the contracting-dim
    gather has the same FLOPs and bytes per step as :class:`Workload` with m, k, n = 512, 512,
    2048). Chip: TPU v5e with no wraparound on the axis of 4 (see
    :func:`scaling_book_chip_check`). Two all-gather-only rows come from the book's sharding
    chapter (Pop Quiz 2); the latency-bound one sets the TPU per-op overhead.

    JAX Pallas Mosaic GPU collective matmul on H100: f16, per-shard M = 1024, K = N = 4096,
    2/4/8 GPUs; fused kernel, its stated lower bound, and NCCL all-gather + cuBLAS.
    """
    rows: list[ValidationRow] = []
    v5e = CHIPS["tpu-v5e"]
    work = _book_workload(wraparound=False)
    eff = _book_efficiency(v5e)
    src = "scaling book"
    ideal = matmul_time(v5e, _BOOK_B / _BOOK_X, _BOOK_D, _BOOK_F / _BOOK_Y, 4, efficiency=eff)
    rows += [
        ValidationRow(src, "matmul, contracting dim unsharded", "tpu-v5e", 224, ideal * 1e6,
                      "fit", "sets the int32 matmul rate", SCALING_BOOK_JAX),
        ValidationRow(src, "all-gather + matmul (default jit)", "tpu-v5e", 311,
                      baseline_time(v5e, work, efficiency=eff) * 1e6, "prediction",
                      "axis of 4 without wraparound", SCALING_BOOK_JAX),
        ValidationRow(src, "collective matmul (ppermute, uni)", "tpu-v5e", 244,
                      collective_matmul_time(v5e, work, efficiency=eff) * 1e6, "prediction",
                      "", SCALING_BOOK_JAX),
        ValidationRow(src, "all-gather bf16[2048,8192] over 4", "tpu-v5e", 680,
                      ring_collective_time(v5e, 512 * 8192 * 2, 4, wraparound=False) * 1e6,
                      "prediction", "comm only", SCALING_BOOK_SHARDING),
        ValidationRow(src, "all-gather bf16[256,256] over 4", "tpu-v5e", 8,
                      ring_collective_time(v5e, 64 * 256 * 2, 4, wraparound=False) * 1e6,
                      "fit", "sets the per-op overhead", SCALING_BOOK_SHARDING),
    ]  # fmt: skip
    h100 = CHIPS["h100"]
    src = "JAX Pallas MGPU"
    published = {2: (102, 92, 147), 4: (212, 190, 290), 8: (436, 386, 565)}
    for n, (fused, bound, nccl) in published.items():
        work = Workload(m=1024, k=4096, n=4096, n_devices=n, dtype_bytes=2)
        cm = collective_matmul_time(h100, work) * 1e6
        rows += [
            ValidationRow(src, f"lower bound, {n} GPUs", "h100", bound, cm, "identity",
                          "N x 43 us + (N-1) x 6 us", JAX_MGPU_COLLECTIVE_MATMUL),
            ValidationRow(src, f"fused kernel, {n} GPUs", "h100", fused, cm, "prediction", "",
                          JAX_MGPU_COLLECTIVE_MATMUL),
            ValidationRow(src, f"NCCL all-gather + cuBLAS, {n} GPUs", "h100", nccl,
                          baseline_time(h100, work) * 1e6, "prediction",
                          "link peak bandwidth assumed", JAX_MGPU_COLLECTIVE_MATMUL),
        ]  # fmt: skip
    return rows


def format_validation_table(rows: Sequence[ValidationRow] | None = None) -> str:
    """The validation table as Markdown: source, case, chip, published, predicted, ratio, kind."""
    rows = validation_table() if rows is None else rows
    lines = [
        "| source | case | chip | published (us) | predicted (us) | predicted/published | kind |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.source} | {r.case} | {r.chip} | {r.published_us:g} | {r.predicted_us:.1f} "
            f"| {r.ratio:.2f} | {r.kind} |"
        )
    return "\n".join(lines)
