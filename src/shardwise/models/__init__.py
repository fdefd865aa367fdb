"""Models written from building blocks that the parallel wrappers can split."""

from shardwise.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
