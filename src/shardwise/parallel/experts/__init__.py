"""Expert parallelism: a mixture of experts' experts split over ep ranks (folded over dp),
tokens dispatched and combined by all-to-all. See ``docs/moe.md``.

- ``dispatch``: ``AllToAll`` (all-to-all forward, its reverse backward), ``dispatch`` and
  ``combine`` (uneven splits: dropless routing).
- ``shard``: ``parallelize_experts``, the ``experts`` style of a model's plan (experts split
  by ep and by tp), ``is_expert``.
"""

from shardwise.parallel.experts.dispatch import AllToAll, combine, dispatch
from shardwise.parallel.experts.shard import is_expert, parallelize_experts, shard_experts

__all__ = ["AllToAll", "combine", "dispatch", "is_expert", "parallelize_experts",
           "shard_experts"]
