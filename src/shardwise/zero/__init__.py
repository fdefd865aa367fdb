"""ZeRO: optimizer states, gradients (and parameters) partitioned over the dp group."""

from shardwise.zero.optimizer import ZeroDataParallel
from shardwise.zero.sharding import Piece, ShardLayout

__all__ = ["Piece", "ShardLayout", "ZeroDataParallel"]
