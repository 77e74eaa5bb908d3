"""xla-permute: CollectivePermute and collective matmul for PyTorch/XLA.

The public namespace; see the API reference for each module.
"""

from xla_permute.launch import MeshError, RankError, run_on_mesh
from xla_permute.pairs import (
    check_groups,
    check_pairs,
    decompose,
    forms_complete_rings,
    inverse_pairs,
    is_ring,
    ring_pairs,
)
from xla_permute.permute import collective_permute
from xla_permute.pipeline import gpipe_schedule, pipeline_forward
from xla_permute.shift import stage_shift

__all__ = [
    "MeshError",
    "RankError",
    "check_groups",
    "check_pairs",
    "collective_permute",
    "decompose",
    "forms_complete_rings",
    "gpipe_schedule",
    "inverse_pairs",
    "is_ring",
    "pipeline_forward",
    "ring_pairs",
    "run_on_mesh",
    "stage_shift",
]
__version__ = "0.1.0"
