"""xla-permute: CollectivePermute and collective matmul for PyTorch/XLA."""

from xla_permute.launch import MeshError, RankError, run_on_mesh

__all__ = ["MeshError", "RankError", "run_on_mesh"]
__version__ = "0.1.0"
