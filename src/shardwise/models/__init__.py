"""Models written from building blocks that the parallel wrappers can split, and the
registry of model kinds the engine trains (``models.description``)."""

from shardwise.models import gpt, llama
from shardwise.models.cnn import CNN, CNNConfig
from shardwise.models.description import (
    ModelDescription,
    decoder_layers,
    describe,
    describe_section,
    import_model_module,
    model_kind,
    model_kinds,
    register_model,
    section_kind,
)
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.llama import Llama, LlamaConfig

register_model("gpt", GPTConfig, gpt.describe, gpt.from_section)
register_model("llama", LlamaConfig, llama.describe, llama.from_section)

__all__ = ["CNN", "CNNConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig", "ModelDescription",
           "decoder_layers", "describe", "describe_section", "import_model_module",
           "model_kind", "model_kinds", "register_model", "section_kind"]
