"""shardwise: distributed training on PyTorch, each technique proven by parity with one process."""

__version__ = "0.1.0"
