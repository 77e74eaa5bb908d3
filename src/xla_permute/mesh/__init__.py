"""The CPU mesh: run a function on every device of an N-device XLA CPU mesh.

* :mod:`~xla_permute.mesh.launch`: :func:`run_on_mesh` (the caller's side, and the device
  process's: the rank threads, the sync guard, the results);
* :mod:`~xla_permute.mesh.preload`: the warm process each launch forks from;
* :mod:`~xla_permute.mesh.rank_output`: the ranks' output, live and prefixed by rank;
* :mod:`~xla_permute.mesh.status`: what each rank was doing, for the diagnosis of an abort.
"""

from xla_permute.mesh.launch import MeshError, RankError, mesh_environment, run_on_mesh

__all__ = ["MeshError", "RankError", "mesh_environment", "run_on_mesh"]
