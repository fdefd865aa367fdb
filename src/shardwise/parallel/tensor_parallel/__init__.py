"""Tensor parallelism in the Megatron style (Shoeybi et al. 2019, arXiv:1909.08053), with
sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198). See
``docs/tensor_parallel.md``.

- ``group``: ``RankGroup``, the tp process group and how its collectives run.
- ``mappings``: the conjugate operators (f, g, scatter/gather, sequence gather/scatter).
- ``layers``: ``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``.
- ``loss``: ``vocab_parallel_cross_entropy``.
- ``random``: ``ParallelRNG`` / ``TPDropout`` (same masks on replicas, different on shards).
- ``plan``: ``parallelize``, a model's tensor-parallel plan (``models.description``) applied
  to one of its layers (the engine applies it to the layers of its pipeline chunks).
- ``state``: global grad norm and clipping, replica grad sync, full state dicts.
"""

from shardwise.parallel.tensor_parallel.group import RankGroup
from shardwise.parallel.tensor_parallel.layers import (
                                              ColumnParallelLinear,
                                              RowParallelLinear,
                                              VocabParallelEmbedding,
                                              gather_tensor,
                                              padded_vocab_size,
                                              shard_tensor,
)
from shardwise.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy
from shardwise.parallel.tensor_parallel.mappings import (
                                              copy_to_region,
                                              gather_from_region,
                                              gather_from_sequence,
                                              per_layer_table,
                                              reduce_from_region,
                                              reduce_scatter_to_sequence,
                                              scatter_to_region,
                                              scatter_to_sequence,
)
from shardwise.parallel.tensor_parallel.plan import check_divisible, parallelize
from shardwise.parallel.tensor_parallel.random import ParallelRNG, TPDropout
from shardwise.parallel.tensor_parallel.state import (
                                              clip_grad_norm_,
                                              gather_optimizer_state,
                                              gather_param,
                                              gather_state_dict,
                                              grad_norm,
                                              is_sharded,
                                              load_full_state_dict,
                                              load_optimizer_state,
                                              shard_param,
                                              sync_replicated_grads,
)

__all__ = [
    "RankGroup", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "gather_tensor", "shard_tensor", "padded_vocab_size", "vocab_parallel_cross_entropy",
    "copy_to_region", "reduce_from_region", "scatter_to_region", "gather_from_region",
    "scatter_to_sequence", "gather_from_sequence", "reduce_scatter_to_sequence",
    "per_layer_table", "parallelize", "check_divisible", "ParallelRNG",
    "TPDropout", "clip_grad_norm_", "grad_norm", "gather_param", "gather_state_dict",
    "shard_param", "load_full_state_dict", "is_sharded", "sync_replicated_grads",
    "gather_optimizer_state", "load_optimizer_state",
]
