"""The CPU mesh: run a function on every device of an N-device XLA CPU mesh.

* :mod:`~xla_permute.cpu_mesh.launch`: :func:`run_on_mesh`, the caller's side;
* :mod:`~xla_permute.cpu_mesh.device`: the device process (the rank threads, the sync guard);
* :mod:`~xla_permute.cpu_mesh.barrier`: the compile barrier in every rank's sync;
* :mod:`~xla_permute.cpu_mesh.rank_output`: the ranks' output, live and prefixed by rank;
* :mod:`~xla_permute.cpu_mesh.status`: what each rank was doing, for the diagnosis of an abort.
"""

from xla_permute.cpu_mesh.launch import MeshError, RankError, mesh_environment, run_on_mesh

__all__ = ["MeshError", "RankError", "mesh_environment", "run_on_mesh"]
