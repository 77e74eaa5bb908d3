"""Tensor parallelism on collective matmul: the layers
(:mod:`~xla_permute.tensor_parallel.layers`), the MLP blocks
(:mod:`~xla_permute.tensor_parallel.mlp`), attention with its heads split over ranks
(:mod:`~xla_permute.tensor_parallel.heads`), vocabulary parallelism
(:mod:`~xla_permute.tensor_parallel.vocab`) and the plan that puts them into a model you
already have (:mod:`~xla_permute.tensor_parallel.parallelize`)."""
