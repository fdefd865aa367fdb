"""ZeRO: optimizer states, gradients (and parameters) partitioned over the dp group."""

from shardwise.zero.optimizer import ZeroDataParallel
from shardwise.zero.sharding import Piece, ShardLayout
from shardwise.zero.stage3 import ZeroStage3

__all__ = ["Piece", "ShardLayout", "ZeroDataParallel", "ZeroStage3"]
