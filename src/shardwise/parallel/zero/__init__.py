"""ZeRO: optimizer states, gradients (and parameters) partitioned over the dp group."""

from shardwise.parallel.zero.optimizer import ZeroDataParallel
from shardwise.parallel.zero.sharding import Piece, ShardLayout
from shardwise.parallel.zero.stage3 import ZeroStage3

__all__ = ["Piece", "ShardLayout", "ZeroDataParallel", "ZeroStage3"]
