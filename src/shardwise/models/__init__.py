"""Models written from building blocks that the parallel wrappers can split, and the
registry of model kinds the engine trains (``models.description``).

The models themselves are loaded lazily (PEP 562: a module ``__getattr__`` and ``__dir__``
over ``_LAZY``): ``from shardwise.models import GPT, Llama`` works as ever, but importing
this package, or ``shardwise.models.description`` through it, imports no model (the Llama's
experts would bring in ``torch._dynamo``, a second of start-up that ``shardwise plan`` does
not need). shardwise's own kinds, "gpt" and "llama", are registered by ``_register_own``,
which the registry calls before its first registration or lookup, so they still come first
and a kind of yours with the same name still wins.
"""

from __future__ import annotations

import importlib

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

# public name -> its submodule; the submodules themselves (``shardwise.models.gpt``) load the
# same way on first use
_LAZY: dict[str, str] = {"CNN": "cnn", "CNNConfig": "cnn", "GPT": "gpt", "GPTConfig": "gpt",
                         "Llama": "llama", "LlamaConfig": "llama"}
_SUBMODULES = ("cnn", "gpt", "hf", "llama", "meta_init", "moe", "sampling", "sequence")


def _register_own() -> None:
    """Register "gpt" and "llama" (``models.description`` calls it once, first)."""
    from shardwise.models import gpt, llama

    register_model("gpt", gpt.GPTConfig, gpt.describe, gpt.from_section)
    register_model("llama", llama.LlamaConfig, llama.describe, llama.from_section)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # cached: __getattr__ runs once per name
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


__all__ = ["CNN", "CNNConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig", "ModelDescription",
           "decoder_layers", "describe", "describe_section", "import_model_module",
           "model_kind", "model_kinds", "register_model", "section_kind"]
