"""The cost model next to published measurements, each row saying how it relates to them.

:func:`validation_table` lists published times (the scaling book's TPU
example, the JAX Pallas Mosaic GPU collective matmul on H100) with the model's predictions;
``kind`` tells a real prediction from a fit (the figure set a model input) and an identity.
:func:`scaling_book_chip_check` asks which TPU the book's example ran on;
:func:`torchtitan_comparison` sets the pipeline model beside torchtitan's published runs.

>>> rows = validation_table()
>>> sorted({r.kind for r in rows})
['fit', 'identity', 'prediction']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from xla_permute_tools.cost.chips import (
    CHIPS,
    JAX_MGPU_COLLECTIVE_MATMUL,
    SCALING_BOOK_JAX,
    SCALING_BOOK_SHARDING,
    Chip,
)
from xla_permute_tools.cost.model import (
    Workload,
    baseline_time,
    collective_matmul_time,
    matmul_time,
    ring_collective_time,
)
from xla_permute_tools.cost.pipeline import predict_pipeline

__all__ = [
    "TORCHTITAN_405B",
    "ValidationRow",
    "format_validation_table",
    "scaling_book_chip_check",
    "torchtitan_comparison",
    "validation_table",
]


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
        ValidationRow(
            src,
            "matmul, contracting dim unsharded",
            "tpu-v5e",
            224,
            ideal * 1e6,
            "fit",
            "sets the int32 matmul rate",
            SCALING_BOOK_JAX,
        ),
        ValidationRow(
            src,
            "all-gather + matmul (default jit)",
            "tpu-v5e",
            311,
            baseline_time(v5e, work, efficiency=eff) * 1e6,
            "prediction",
            "axis of 4 without wraparound",
            SCALING_BOOK_JAX,
        ),
        ValidationRow(
            src,
            "collective matmul (ppermute, uni)",
            "tpu-v5e",
            244,
            collective_matmul_time(v5e, work, efficiency=eff) * 1e6,
            "prediction",
            "",
            SCALING_BOOK_JAX,
        ),
        ValidationRow(
            src,
            "all-gather bf16[2048,8192] over 4",
            "tpu-v5e",
            680,
            ring_collective_time(v5e, 512 * 8192 * 2, 4, wraparound=False) * 1e6,
            "prediction",
            "comm only",
            SCALING_BOOK_SHARDING,
        ),
        ValidationRow(
            src,
            "all-gather bf16[256,256] over 4",
            "tpu-v5e",
            8,
            ring_collective_time(v5e, 64 * 256 * 2, 4, wraparound=False) * 1e6,
            "fit",
            "sets the per-op overhead",
            SCALING_BOOK_SHARDING,
        ),
    ]
    h100 = CHIPS["h100"]
    src = "JAX Pallas MGPU"
    published = {2: (102, 92, 147), 4: (212, 190, 290), 8: (436, 386, 565)}
    for n, (fused, bound, nccl) in published.items():
        work = Workload(m=1024, k=4096, n=4096, n_devices=n, dtype_bytes=2)
        cm = collective_matmul_time(h100, work) * 1e6
        rows += [
            ValidationRow(
                src,
                f"lower bound, {n} GPUs",
                "h100",
                bound,
                cm,
                "identity",
                "N x 43 us + (N-1) x 6 us",
                JAX_MGPU_COLLECTIVE_MATMUL,
            ),
            ValidationRow(
                src,
                f"fused kernel, {n} GPUs",
                "h100",
                fused,
                cm,
                "prediction",
                "",
                JAX_MGPU_COLLECTIVE_MATMUL,
            ),
            ValidationRow(
                src,
                f"NCCL all-gather + cuBLAS, {n} GPUs",
                "h100",
                nccl,
                baseline_time(h100, work) * 1e6,
                "prediction",
                "link peak bandwidth assumed",
                JAX_MGPU_COLLECTIVE_MATMUL,
            ),
        ]
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


#: torchtitan's published Llama 3.1 405B runs on 512 H100 (FSDP 8, TP 8, PP 8, local batch
#: size 32, full activation checkpointing), Table 5 of
#: https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md
#: (memory: the maximum over all GPUs).
TORCHTITAN_405B = {
    "1f1b": {"tokens_per_s_per_gpu": 100.0, "memory_gib": 82.5},
    "interleaved": {"tokens_per_s_per_gpu": 128.0, "memory_gib": 72.7},
}


def torchtitan_comparison(micro_batches: int = 32, stages_per_rank: int = 2) -> dict[str, float]:
    """The model's 1F1B -> interleaved ratios at torchtitan's PP 8 beside the published ones.

    Assumed (the table does not say): ``micro_batches`` micro-batches per step (local batch
    32 in micro-batches of 1) and ``stages_per_rank`` stages per rank; no shift cost. Returns the
    predicted and published throughput ratios and activation-memory / total-memory ratios.

    >>> c = torchtitan_comparison()
    >>> c["published_throughput"], round(c["predicted_throughput"], 3)
    (1.28, 1.099)
    """
    one = predict_pipeline("1f1b", 8, micro_batches)
    inter = predict_pipeline("interleaved", 8, micro_batches, stages_per_rank)
    published = TORCHTITAN_405B
    return {
        "predicted_throughput": inter.throughput_ratio(one),
        "published_throughput": (
            published["interleaved"]["tokens_per_s_per_gpu"]
            / published["1f1b"]["tokens_per_s_per_gpu"]
        ),
        "predicted_activations": inter.activations / one.activations,
        "published_memory": published["interleaved"]["memory_gib"]
        / published["1f1b"]["memory_gib"],
    }
