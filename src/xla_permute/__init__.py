"""xla-permute: CollectivePermute and collective matmul for PyTorch/XLA.

``import xla_permute as xp`` reaches every user-facing name; the implementation modules stay
importable by their own names (``xla_permute.matmul``, ...). Importing this package never
imports ``torch_xla`` or starts the XLA runtime.
"""

from __future__ import annotations

import importlib
from typing import Any

# Ring attention (context parallelism), its all-gather baseline and its hop schedule as data
from xla_permute.attention import (
    AttentionBlock,
    AttentionHop,
    all_gather_attention,
    ring_attention,
    ring_attention_schedule,
    schedule_work,
)

# Agreement checks (every collective first checks that all ranks pass the same arguments),
# and the refusal of torch.compile
from xla_permute.backends.compiled import CompileError

# Collectives: all-gather, reduce-scatter, all-reduce, sums of gradients
from xla_permute.collectives import (
    all_gather,
    all_reduce,
    all_reduce_gradients,
    reduce_scatter,
    sum_gradients,
)

# The CPU mesh: run a function on every device
from xla_permute.cpu_mesh import MeshError, RankError, run_on_mesh
from xla_permute.debug import DisagreementError, debug_mode

# Collective matmul and its baselines
from xla_permute.matmul import (
    all_gather_matmul,
    all_gather_then_matmul,
    matmul_reduce_scatter,
    matmul_then_reduce_scatter,
)

# The rings of collective matmul: their schedules, as data
from xla_permute.matmul_ring import (
    RingStep,
    all_gather_schedule,
    reduce_scatter_schedule,
    ring_steps,
)

# A TP x CP grid of ranks: its groups and its two-level token sharding
from xla_permute.mesh2d import Mesh2D

# Pairs of a CollectivePermute (pure Python)
from xla_permute.pairs import (
    Decomposition,
    check_groups,
    check_pairs,
    decompose,
    forms_complete_rings,
    inverse_pairs,
    is_ring,
    ring_pairs,
)

# CollectivePermute: checked, differentiable
from xla_permute.permute import collective_permute

# Pipeline parallelism on stage shifts: its groups and GPipe's forward
from xla_permute.pipeline.forward import pipeline_forward, pipeline_groups

# Pipeline schedules as data: each rank's orders and the schedules they play out
from xla_permute.pipeline.orders import SCHEDULES, make_schedule
from xla_permute.pipeline.run import PipelineStep, pipeline_step, split_model
from xla_permute.pipeline.schedule import Overlap, PipelineSchedule, Work

# Pipeline stages without send/recv
from xla_permute.pipeline.shift import shift_pairs, stage_shift

# Split a sequence over ranks and put it back (host, pure torch)
from xla_permute.sequence import shard_sequence, unshard_sequence

# Tensor-parallel attention: heads over ranks, grouped-query attention included
from xla_permute.tensor_parallel.heads import ParallelAttention

# The tensor-parallel layers on collective matmul
from xla_permute.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

# MLP blocks on the tensor-parallel layers
from xla_permute.tensor_parallel.mlp import GatedMLP, SequenceParallelMLP, relu_product, swiglu

# A model made tensor-parallel by a plan (PyTorch's parallelize_module, on these layers)
from xla_permute.tensor_parallel.parallelize import HeadwiseParallel, parallelize_module

# Vocabulary parallelism: embedding and cross-entropy over vocabulary shards
from xla_permute.tensor_parallel.vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

#: Submodules reached as attributes (imported on first use): ``xp.hlo.trace(y)``, ...
_SUBMODULES = ("reference", "hardware", "hlo")


def __getattr__(name: str) -> Any:
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'xla_permute' has no attribute {name!r}")
    module = importlib.import_module(f"xla_permute.{name}")
    globals()[name] = module
    return module


def __dir__() -> list[str]:
    return sorted([*__all__, *_SUBMODULES])


__all__ = [
    "all_gather", "all_gather_attention", "all_gather_matmul", "all_gather_schedule",
    "all_gather_then_matmul", "all_reduce", "all_reduce_gradients", "AttentionBlock",
    "AttentionHop", "check_groups", "check_pairs", "collective_permute",
    "ColumnParallelLinear", "debug_mode", "decompose", "Decomposition", "CompileError",
    "DisagreementError", "forms_complete_rings", "GatedMLP", "HeadwiseParallel",
    "inverse_pairs", "is_ring", "make_schedule", "matmul_reduce_scatter",
    "matmul_then_reduce_scatter", "Mesh2D", "MeshError", "pipeline_forward", "pipeline_groups",
    "pipeline_step", "Overlap", "ParallelAttention", "parallelize_module", "PipelineSchedule",
    "PipelineStep", "RankError", "reduce_scatter", "reduce_scatter_schedule", "relu_product",
    "ring_attention", "ring_attention_schedule", "ring_pairs", "ring_steps", "RingStep",
    "RowParallelLinear", "run_on_mesh", "schedule_work", "SequenceParallelMLP",
    "shard_sequence", "shift_pairs", "split_model", "stage_shift", "sum_gradients", "swiglu",
    "unshard_sequence", "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "SCHEDULES",
    "Work",
]  # fmt: skip
__version__ = "0.1.0"
