"""Published figures of the modelled accelerators, each with its citation.

A :class:`~xla_permute_tools.cost.Chip` holds what the cost model
(:mod:`xla_permute_tools.cost.model`) needs of one chip: matmul rate, link bandwidth and
topology, per-hop latency, per-op overhead, HBM bandwidth. Every figure has a ``sources``
entry; ``assumptions`` names those that are not published as such. ``CHIPS`` is the table,
keyed by short names.

>>> CHIPS["tpu-v5e"].neighbor_bandwidth, CHIPS["h100"].switched
(45000000000.0, True)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CHIPS", "Chip"]

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
    "wraparound_axis",
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
    ``wraparound_axis``: a ring over an axis of N devices closes with a wraparound link when N
    is a multiple of it (16 on v5e/v6e: only a full axis; 4 on v4p/v5p; 1: every ring closes);
    :meth:`wraparound` applies it. ``switched``: every pair is one hop (no wraparound question).
    ``hop_latency``: seconds paid
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
    wraparound_axis: int
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
        if isinstance(self.wraparound_axis, bool) or not (
            isinstance(self.wraparound_axis, int) and self.wraparound_axis >= 1
        ):
            raise ValueError(f"Chip {self.name!r}: wraparound_axis must be an int >= 1")

    def wraparound(self, n_devices: int) -> bool:
        """Whether a ring of ``n_devices`` on one axis has a wraparound link (a switched chip:
        always, every pair is one hop).

        >>> CHIPS["tpu-v6e"].wraparound(8), CHIPS["tpu-v6e"].wraparound(16)
        (False, True)
        """
        return self.switched or n_devices % self.wraparound_axis == 0

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


def _tpu(name: str, peak: float, link: float, hbm: float, wraparound_axis: int) -> Chip:
    table = f"{SCALING_BOOK_TPUS} (TPU Specs table)"
    return Chip(
        name=name,
        peak_flops=peak,
        link_bandwidth=link,
        links_per_neighbor=1,
        ring_directions=2,
        wraparound_axis=wraparound_axis,
        hop_latency=1e-6,
        collective_overhead=_TPU_OVERHEAD,
        hbm_bandwidth=hbm,
        sources={
            "peak_flops": f"{table}, FLOPs/s/chip (bf16)",
            "link_bandwidth": f"{table}, ICI BW/link (one-way)",
            "links_per_neighbor": f"{table}: one ICI link per torus neighbour",
            "ring_directions": (
                f"{table}: bidirectional ring only with a wraparound link (full axis of 16 on "
                "v5e/v6e, multiples of 4 on v4p/v5p); without one a ring runs one way"
            ),
            "wraparound_axis": (
                f"{SCALING_BOOK_TPUS}: v5e and v6e (Trillium) pods are one 16x16 2D torus with "
                "wraparound links only on a full axis of 16 (an axis of 4 or 8 has none); "
                "v4p/v5p have wraparound on axes that are multiples of 4 (full 4x4x4 cubes)"
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
    "tpu-v4": _tpu("TPU v4p", 2.75e14, 4.5e10, 1.2e12, wraparound_axis=4),
    "tpu-v5e": _tpu("TPU v5e", 1.97e14, 4.5e10, 8.1e11, wraparound_axis=16),
    "tpu-v5p": _tpu("TPU v5p", 4.59e14, 9e10, 2.8e12, wraparound_axis=4),
    "tpu-v6e": _tpu("TPU v6e", 9.20e14, 9e10, 1.6e12, wraparound_axis=16),
    "trn1": Chip(
        name="Trainium (Trn1)",
        peak_flops=190e12,
        link_bandwidth=384 * 2**30 / 4 / 2,
        links_per_neighbor=1,
        ring_directions=2,
        wraparound_axis=1,
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
            "wraparound_axis": f"{NEURON_TRN1_ARCH}: 2D torus: every ring closes (1)",
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
        wraparound_axis=1,
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
            "wraparound_axis": f"{NEURON_TRN2_ARCH}: 2D torus: every ring closes (1)",
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
        wraparound_axis=1,
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
            "wraparound_axis": f"{SCALING_BOOK_GPUS}: NVSwitch, every pair one hop (1)",
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
