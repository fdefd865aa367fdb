"""Context parallelism: the sequence of every layer split over cp ranks.

- ``sharding``: the load-balanced causal layout (rank i holds chunks i and 2cp-1-i);
- ``ring_comm``: the ring of cp ranks, its shift and its direct hop (``shardwise.comm.
  exchange``);
- ``ring_attention``: exact attention over the whole sequence, K/V blocks passed around the
  ring, online-softmax merge, dK/dV passed back (Liu et al. 2023); under a sliding window
  only the blocks a rank's queries see, sent directly;
- ``ulysses``: all-to-all attention over heads (DeepSpeed-Ulysses, Jacobs et al. 2023), and
  its hybrid with the ring (``parallel.cp_comm``);
- ``apply``: ``ContextParallel``, what the engine holds: shard batches, hook chunks.
"""

from shardwise.parallel.context.apply import ContextParallel
from shardwise.parallel.context.ring_attention import ring_attention
from shardwise.parallel.context.ring_comm import Ring
from shardwise.parallel.context.sharding import (
    check_length,
    local_positions,
    shard_sequence,
    unshard_sequence,
)

__all__ = ["ContextParallel", "Ring", "check_length", "local_positions", "ring_attention",
           "shard_sequence", "unshard_sequence"]
