"""Models written from building blocks that the parallel wrappers can split."""

from shardwise.models.cnn import CNN, CNNConfig
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.llama import Llama, LlamaConfig

__all__ = ["CNN", "CNNConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig"]
