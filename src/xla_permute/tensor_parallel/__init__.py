"""Tensor parallelism on collective matmul: the layers, the blocks built on them, and the plan
that puts them into a model you already have.

* :mod:`~xla_permute.tensor_parallel.layers`: column- and row-parallel linears (Megatron's,
  with and without sequence parallelism) and the collectives of replicated results;
* :mod:`~xla_permute.tensor_parallel.mlp`: MLP blocks, gated or not;
* :mod:`~xla_permute.tensor_parallel.heads`: attention with its heads split over ranks,
  grouped-query attention and context parallelism included;
* :mod:`~xla_permute.tensor_parallel.vocab`: vocabulary-parallel embedding and cross-entropy;
* :mod:`~xla_permute.tensor_parallel.parallelize`: ``parallelize_module`` and its styles.
"""
