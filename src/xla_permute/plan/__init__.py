"""A model made tensor-parallel by a plan: :func:`parallelize_module` and its styles."""

from xla_permute.plan.parallelize import parallelize_module
from xla_permute.plan.styles import HeadwiseParallel

__all__ = ["HeadwiseParallel", "parallelize_module"]
